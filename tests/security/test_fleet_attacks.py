"""An attacker on a fleet's store, a diverging replica, a rank killed mid-round (issue 24, "Fleet").

torchrun's c10d store takes any client: the attacker here is a raw ``TCPStore`` client on the store the
ranks use (a real one, on 127.0.0.1), writing the keys the fleet reads. What it can do is stop the fleet
(every refusal is a named error); what it cannot do is get a key, a message or a device accepted:

* the ring's key agreement (``core/collectives/keys.py``) refuses a replayed handshake message, a group key
  it did not seal, and, once pinned to the devices the workers attested, another genuine device answering
  for a rank (without the pin that device would be accepted: the test shows both);
* the fleet-key agreement (``core/fleet/keyagree.py``) refuses a worker whose hello carries a key its CVM quote
  does not bind (a replayed genuine quote), by name, and sends no key; a wrapped fleet key forged on the store
  does not open;
* the workers' group (``FleetGroup``) refuses a rank that does not hold the fleet key, and every altered,
  replayed or relabelled message (``FleetAuthError``, counted);
* a replica that drifts from the others stops every rank with ``ReplicaDivergedError`` and the step is not
  committed; a rank killed mid-round stops the others with a named error (no hang) and ``--resume`` finishes.

Ranks of the handshake run as threads with their own store clients; the worker group and whole fleets run
as real processes (torchrun for the fleets: slow).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from helpers import fleet_settings

from gputravel.console.entries import GPU_RANK
from gputravel.core.attestation import DeviceIdentity, VendorCA
from gputravel.core.collectives.keys import RingKeys, establish_ring_keys
from gputravel.core.errors import (
    AttestationError,
    ConfigError,
    FleetAuthError,
    FleetJoinError,
    GpuTravelError,
    WorkerError,
)
from gputravel.core.fleet.auth import open_message, seal_message
from gputravel.core.fleet.keyagree import FleetCvm, KeyAgreement, agree_fleet_key
from gputravel.core.fleet.keybench import summarise_agreement
from gputravel.core.fleet.pki import local_sim_pki
from gputravel.core.protocol.keywrap import LinkKey, wrap_key
from gputravel.core.runfolder.folder import RunFolder

TIMEOUT = timedelta(seconds=120)  # generous: the shared 2-core machine runs at load 8 or more


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def store() -> Any:
    """A real c10d TCPStore on 127.0.0.1 (the fleet's rendezvous store), hosted by the test."""
    master = dist.TCPStore("127.0.0.1", _free_port(), is_master=True, timeout=TIMEOUT)  # type: ignore[attr-defined]
    yield master


def client(master: Any) -> Any:
    """Another connection to the same store: a rank's, or the attacker's (the store cannot tell them apart)."""
    return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=TIMEOUT)  # type: ignore[attr-defined]


class Vendor:
    def __init__(self) -> None:
        self.ca = VendorCA.generate()
        self.devices = [self.ca.issue_device(f"emu-gpu-{r}") for r in range(2)]

    @staticmethod
    def name(identity: DeviceIdentity) -> str:
        return f"{identity.device_id}:{identity.fingerprint()}"


def run_ranks(master: Any, jobs: dict[int, Callable[[Any], Any]]) -> dict[int, Any]:
    """Each job on its own thread and store client; returns what each returned or raised."""
    results: dict[int, Any] = {}

    def go(rank: int, job: Callable[[Any], Any]) -> None:
        try:
            results[rank] = job(client(master))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[rank] = exc

    threads = [threading.Thread(target=go, args=(r, j), daemon=True) for r, j in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def handshake(vendor: Vendor, rank: int, *, identity: DeviceIdentity | None = None, prefix: str,
              expected: list[str] | None = None) -> Callable[[Any], RingKeys]:
    def job(s: Any) -> RingKeys:
        return establish_ring_keys(s, rank=rank, world=2, identity=identity or vendor.devices[rank],
                                   root=vendor.ca.root, crl=vendor.ca.crl(), prefix=prefix, timeout=TIMEOUT,
                                   expected=expected)
    return job


# --- the ring's key agreement against a store attacker --------------------------------------------------
def test_honest_pinned_ring_agrees_and_names_the_attested_devices(store: Any) -> None:
    vendor = Vendor()
    names = [vendor.name(d) for d in vendor.devices]
    got = run_ranks(store, {r: handshake(vendor, r, prefix="p/honest", expected=names) for r in range(2)})
    assert all(isinstance(k, RingKeys) for k in got.values()), got
    assert got[0].peers["right"] == names[1] and got[1].peers["left"] == names[0]
    assert got[0].send.fingerprint == got[1].recv.fingerprint  # one link key, agreed by both


def test_another_genuine_device_answering_for_rank_0_is_refused_once_the_ring_is_pinned(store: Any) -> None:
    """The attacker holds a device certified by the same vendor (any genuine GPU) and runs rank 0's side of
    the handshake on the store. Unpinned, rank 1 accepts it (its evidence verifies); pinned to the device
    rank 0's orchestrator attested, rank 1 refuses it by name."""
    vendor = Vendor()
    rogue = vendor.ca.issue_device("rogue-gpu")
    names = [vendor.name(d) for d in vendor.devices]
    unpinned = run_ranks(store, {0: handshake(vendor, 0, identity=rogue, prefix="p/unpinned"),
                                 1: handshake(vendor, 1, prefix="p/unpinned")})
    assert isinstance(unpinned[1], RingKeys) and unpinned[1].peers["left"].startswith("rogue-gpu:")
    pinned = run_ranks(store, {0: handshake(vendor, 0, identity=rogue, prefix="p/pinned"),
                               1: handshake(vendor, 1, prefix="p/pinned", expected=names)})
    assert isinstance(pinned[1], AttestationError), pinned
    assert "rank 0 answered as device rogue-gpu:" in pinned[1].reason and names[0] in pinned[1].reason
    assert isinstance(pinned[0], AttestationError)  # the rogue learns it was refused; no key for anyone


def test_a_replayed_handshake_message_injected_into_the_store_is_refused(store: Any) -> None:
    """The attacker recorded rank 0's nonce and init message of an earlier ring (genuine evidence of the real
    device) and writes them under the new ring's keys before rank 0 does: rank 1's fresh nonce is not in
    that evidence, so it is refused."""
    vendor = Vendor()
    names = [vendor.name(d) for d in vendor.devices]
    spy = client(store)
    first = run_ranks(store, {r: handshake(vendor, r, prefix="p/old", expected=names) for r in range(2)})
    assert all(isinstance(k, RingKeys) for k in first.values())
    for kind in ("nonce", "init"):
        spy.set(f"p/new/{kind}/0", spy.get(f"p/old/{kind}/0"))  # injected before rank 0 speaks
    got = run_ranks(store, {1: handshake(vendor, 1, prefix="p/new", expected=names)})
    assert isinstance(got[1], AttestationError), got
    assert "evidence of rank 0 does not verify" in got[1].reason and "nonce" in got[1].reason
    assert spy.get("p/new/done/1").startswith(b"ERR:")  # and it says so on the store, for every rank


class _SlowGroupKey:
    """Rank 0's store client, slow to publish the group key: only once rank 1 has finished with whatever it read
    there (its ``done`` key), so the attacker's value is the one read, whatever the machine's load."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def set(self, key: str, value: str) -> None:
        if key.endswith("/group/0"):  # the group key, not the prefix's own "/group/"
            done = key.removesuffix("/group/0") + "/done/1"
            deadline = time.monotonic() + 60
            while not self.inner.check([done]) and time.monotonic() < deadline:
                time.sleep(0.02)
        self.inner.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_group_key_injected_into_the_store_does_not_authenticate(store: Any) -> None:
    """The attacker writes its own ring-wide group key where rank 1 reads rank 0's: it is sealed under no
    link key of this ring, so rank 1 refuses it and no rank gets keys."""
    vendor = Vendor()
    names = [vendor.name(d) for d in vendor.devices]
    client(store).set("p/group/group/0", os.urandom(64))
    got = run_ranks(store, {0: lambda s: handshake(vendor, 0, prefix="p/group", expected=names)(_SlowGroupKey(s)),
                            1: handshake(vendor, 1, prefix="p/group", expected=names)})
    assert isinstance(got[1], AttestationError) and "group key from rank 0 does not authenticate" in got[1].reason
    assert isinstance(got[0], AttestationError)  # rank 0 leaves with the named error, not a hang


# --- the workers' group ------------------------------------------------------------------------------------
def test_worker_messages_that_are_injected_altered_replayed_or_relabelled_are_refused() -> None:
    key, other = os.urandom(32), os.urandom(32)
    ctx = "restart=0 world=2 exchange=3"
    sealed = seal_message(key, context=ctx, sender=1, obj={"weight": 1.0, "lost": False})
    assert open_message(key, sealed, context=ctx, sender=1) == {"weight": 1.0, "lost": False}
    altered = bytearray(sealed)
    altered[2] ^= 1
    cases = {
        "injected without the key": seal_message(other, context=ctx, sender=1, obj={"weight": 9.0, "lost": False}),
        "altered": bytes(altered),
        "truncated": sealed[:-1],
        "garbage": b"\x80" * 10,
    }
    for what, data in cases.items():
        with pytest.raises(FleetAuthError):
            open_message(key, data, context=ctx, sender=1)
        assert what
    with pytest.raises(FleetAuthError):  # replayed into a later exchange
        open_message(key, sealed, context="restart=0 world=2 exchange=4", sender=1)
    with pytest.raises(FleetAuthError):  # relabelled as another rank's
        open_message(key, sealed, context=ctx, sender=0)


class TamperingStore:
    """A real store client whose reads of one key return what the attacker wrote there instead (the attacker
    overwrote it between the writer's set and the reader's get; isolates that race)."""

    def __init__(self, inner: Any, key: str, forged: bytes) -> None:
        self.inner, self.key, self.forged = inner, key, forged

    def set(self, key: str, value: str) -> None:
        self.inner.set(key, value)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.inner.wait(keys, timeout)

    def get(self, key: str) -> bytes:
        return self.forged if key == self.key else bytes(self.inner.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))


def _agree(stores: list[Any], cvm: FleetCvm, context: str) -> list[KeyAgreement | GpuTravelError]:
    results: list[KeyAgreement | GpuTravelError] = [GpuTravelError("never ran")] * len(stores)

    def rank(r: int) -> None:
        try:
            results[r] = agree_fleet_key(stores[r], rank=r, world=len(stores), context=context, cvm=cvm,
                                         timeout_s=60)
        except GpuTravelError as exc:
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


@pytest.fixture(scope="module")
def cvm(tmp_path_factory: pytest.TempPathFactory) -> FleetCvm:
    folder = RunFolder(tmp_path_factory.mktemp("node"))
    local_sim_pki(folder)
    return FleetCvm.sim(folder.cvm)


def test_the_fleet_key_is_agreed_by_attested_workers_and_never_written(store: Any, cvm: FleetCvm) -> None:
    results = _agree([dist.PrefixStore("a", client(store)) for _ in range(3)], cvm, "job=a restart=0")
    assert all(isinstance(r, KeyAgreement) for r in results), results
    a, b, c = results
    assert isinstance(a, KeyAgreement) and isinstance(b, KeyAgreement) and isinstance(c, KeyAgreement)
    assert a.key == b.key == c.key and len(a.key) == 32 and a.info["verified"] == [0, 1, 2]
    assert a.key.hex() not in json.dumps(a.info)
    # one platform (one node's CVM folder): each worker checks its first peer's quote with dcap-qvl in full, the
    # second's (same QE data, same collateral) for its own signature and report data (core/evidence/tdx_family.py)
    assert all((r.info["verify_full"], r.info["verify_reused"]) == (1, 1) for r in (a, b, c))
    # what `bench fleet-key` makes of the workers' rows: the fleet from the first hello to the last key
    rows = [{"rank": r, **got.info} for r, got in enumerate((a, b, c))]
    summary = summarise_agreement(rows, go_at=min(x.info["hello_at"] for x in (a, b, c)))
    span = max(x.info["key_at"] for x in (a, b, c)) - min(x.info["hello_at"] for x in (a, b, c))
    assert summary["fleet_ms"] == round(span * 1e3, 2) == max(summary["worker_ms"]) > 0
    assert (summary["verify_full"], summary["verify_reused"]) == (3, 3)
    with pytest.raises(ConfigError, match="did not agree one fleet key"):
        summarise_agreement([*rows[:2], {**rows[2], "key_fingerprint": "0" * 16}], go_at=0.0)


def test_a_replayed_quote_with_the_attackers_key_is_refused_by_name(store: Any, cvm: FleetCvm) -> None:
    """The attacker takes rank 1's place with its own X25519 key and a genuine quote replayed from another
    agreement: the quote binds another key (and job), so rank 0 refuses rank 1 and sends no fleet key."""
    genuine = _agree([dist.PrefixStore("old", client(store)) for _ in range(2)], cvm, "job=old restart=0")
    assert all(isinstance(r, KeyAgreement) for r in genuine)
    hello = json.loads(store.get("old/hello/1"))
    hello["public"] = LinkKey().public.hex()
    attacker = dist.PrefixStore("new", client(store))
    attacker.set("hello/1", json.dumps(hello))
    attacker.set("verdict/1", "{}")
    result: list[Any] = []

    def rank_0() -> None:
        try:
            result.append(agree_fleet_key(dist.PrefixStore("new", client(store)), rank=0, world=2,
                                          context="job=new restart=0", cvm=cvm, timeout_s=60))
        except GpuTravelError as exc:
            result.append(exc)

    t = threading.Thread(target=rank_0)
    t.start()
    t.join(timeout=120)
    assert isinstance(result[0], AttestationError)
    assert "rank 1: report-data-binding" in result[0].reason and "no fleet key was sent" in result[0].reason
    assert not store.check(["new/key/1"])


def test_a_worker_that_never_posts_its_hello_is_named_with_its_node_at_the_join_deadline(store: Any,
                                                                                        cvm: FleetCvm) -> None:
    """Rank 3 (node 1 of two nodes of two ranks) died before its first post: rank 0 waits the join deadline
    (1 s here), not the agreement's timeout, then names the rank and node that never came, with no key sent."""
    prefix = dist.PrefixStore("lone", client(store))
    for r in (1, 2):  # the other live workers' hellos are there
        prefix.set(f"hello/{r}", "{}")
    t0 = time.monotonic()
    with pytest.raises(FleetJoinError) as caught:
        agree_fleet_key(prefix, rank=0, world=4, context="job=lone restart=0", cvm=cvm, timeout_s=600,
                        join_timeout_s=1, ranks_per_node=2)
    assert time.monotonic() - t0 < 60  # the join deadline, far from the agreement's 600 s
    assert "no word from rank 3 (node 1) within 1 s" in caught.value.reason
    assert "rank 1" not in caught.value.reason and caught.value.exit_code == 10
    assert caught.value.code == "fleet-join"


class LaggingStore:
    """A real store client whose every answer takes ``lag_s`` (a loaded machine's round trip): a wait shorter than
    that times out as torch's would, before the answer comes (isolates the join's "who is missing" look)."""

    def __init__(self, inner: Any, lag_s: float) -> None:
        self.inner, self.lag_s = inner, lag_s

    def set(self, key: str, value: str) -> None:
        self.inner.set(key, value)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        if timeout.total_seconds() < self.lag_s:
            time.sleep(timeout.total_seconds())
            raise RuntimeError(f"wait timeout after {timeout.total_seconds() * 1000:.0f}ms")
        time.sleep(self.lag_s)
        self.inner.wait(keys, timeout - timedelta(seconds=self.lag_s))

    def get(self, key: str) -> bytes:
        return bytes(self.inner.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [bytes(v) for v in self.inner.multi_get(keys)]

    def check(self, keys: list[str]) -> bool:
        time.sleep(self.lag_s)
        return bool(self.inner.check(keys))


def test_on_a_slow_store_only_the_worker_that_never_posted_is_named(store: Any, cvm: FleetCvm) -> None:
    """The join names who is missing by looking at each hello without a deadline of its own: a 1 ms wait per key
    timed out on a loaded machine and named this worker's own posted hello as missing (CI, load 10)."""
    prefix = dist.PrefixStore("slow", client(store))
    for r in (1, 2):
        prefix.set(f"hello/{r}", "{}")
    with pytest.raises(FleetJoinError) as caught:
        agree_fleet_key(LaggingStore(prefix, 0.005), rank=0, world=4, context="job=slow restart=0", cvm=cvm,
                        timeout_s=600, join_timeout_s=1, ranks_per_node=2)
    assert "no word from rank 3 (node 1) within 1 s" in caught.value.reason
    assert "rank 0" not in caught.value.reason
    assert not store.check(["lone/key/1"]) and not store.check(["lone/verdict/0"])


def test_a_fleet_key_forged_on_the_store_does_not_open(store: Any, cvm: FleetCvm) -> None:
    """The attacker writes its own wrapped key for rank 1: it is not wrapped by rank 0's attested key, so
    rank 1 refuses it (AttestationError), never using a key the attacker knows."""
    forged = wrap_key(LinkKey(), LinkKey().public, b"job=f restart=0 to=1", os.urandom(32), epoch=0,
                      fingerprint="fleet-key").encode()  # what rank 1 reads
    results = _agree([dist.PrefixStore("f", client(store)),
                      TamperingStore(dist.PrefixStore("f", client(store)), "key/1", forged)], cvm, "job=f restart=0")
    assert isinstance(results[0], KeyAgreement)
    assert isinstance(results[1], AttestationError) and "does not open" in results[1].reason


_WORKER = """
import json, os, sys
from gputravel.core.errors import GpuTravelError
from gputravel.core.fleet.rank import FleetGroup
group = FleetGroup(key=bytes.fromhex(sys.argv[1]), timeout_s=180)
try:
    got = group.gather({"rank": group.rank, "digest": "d" * 64})
    print(json.dumps({"ok": got, "refused": group.refused}))
except GpuTravelError as exc:
    print(json.dumps({"error": type(exc).__name__, "reason": exc.reason, "refused": group.refused}))
sys.stdout.flush()
os._exit(0)  # the answer is out; gloo's threads are not torn down (its peer may be gone: that aborts)
"""


def _workers(store: Any, keys: list[bytes]) -> list[dict[str, Any]]:
    procs = []
    for rank, key in enumerate(keys):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, key.hex()], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)  # a loaded 2-core machine starts torch slowly
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_a_rank_without_the_fleet_key_is_refused_by_the_worker_group(store: Any) -> None:
    """Two real worker processes on the store: with the fleet key they agree; a stranger standing in for
    rank 1 (it found the store and took rank 1's place, but has no fleet key) gets nothing accepted: rank 0
    refuses its message with FleetAuthError and counts it."""
    key = os.urandom(32)
    honest = _workers(store, [key, key])
    assert [m["rank"] for m in honest[0]["ok"]] == [0, 1] and honest[0]["refused"] == 0
    fresh = dist.TCPStore("127.0.0.1", _free_port(), is_master=True, timeout=TIMEOUT)  # type: ignore[attr-defined]
    stranger = _workers(fresh, [key, os.urandom(32)])
    assert stranger[0]["error"] == "FleetAuthError" and "rank 1" in stranger[0]["reason"]
    assert stranger[0]["refused"] == 1
    assert stranger[1]["error"] == "FleetAuthError"  # the stranger cannot read rank 0's either


# --- whole fleets under torchrun (slow) -------------------------------------------------------------------
@pytest.fixture(scope="module")
def fleet_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gputravel.core.bench.data import make_holders

    return make_holders(tmp_path_factory.mktemp("holders"), 3, 40_000)


@pytest.fixture(scope="module")
def fleet_reference(fleet_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from gputravel.core.fleet.rank import FleetOptions
    from gputravel.core.fleet.run import launch_fleet

    report: dict[str, Any] = launch_fleet(fleet_settings(fleet_data, tmp_path_factory.mktemp("ref") / "f"),
                                          FleetOptions(gpus=2, timeout_s=120), entry=GPU_RANK, quiet=True)
    return report


def _check_resumed(report: dict[str, Any], reference: dict[str, Any]) -> None:
    assert report["fleet"]["replica_digests_equal"] is True
    assert sorted(v["visit"] for v in report["visits"] if v["outcome"] == "done") == [0, 1, 2]
    assert report["ledger"]["verified"] is True
    assert report["training"]["model_digest"] == reference["training"]["model_digest"]


@pytest.mark.slow
def test_a_diverging_replica_stops_every_rank_uncommitted_and_resume_reaches_the_reference(
        fleet_data: Path, tmp_path: Path, fleet_reference: dict[str, Any]) -> None:
    """GPU 1's replica drifts after its step (fault injection: one parameter moved on that device alone):
    the digest check after the step stops every rank with ReplicaDivergedError naming both digests, every
    ledger still verifies, the step is recorded ``diverged`` and not committed; ``--resume`` redoes it from
    the last equal checkpoint and ends with the uninterrupted fleet's model."""
    from gputravel.core.errors import ReplicaDivergedError
    from gputravel.core.fleet.rank import FleetOptions
    from gputravel.core.fleet.run import launch_fleet
    from gputravel.core.ledger import read_rows, verify_ledger

    out = tmp_path / "d"
    with pytest.raises(ReplicaDivergedError, match="diverged in step 0"):
        launch_fleet(fleet_settings(fleet_data, out), FleetOptions(gpus=2, timeout_s=120, ring_fault="drift@1"),
                     entry=GPU_RANK, quiet=True)
    reports = 0
    for rank in (0, 1):
        ledger = out / f"rank-{rank}" / "ledger.db"
        assert verify_ledger(ledger).ok
        steps = [r for r in read_rows(ledger) if r.kind == "fleet-step"]
        assert [(r.detail["step"], r.outcome) for r in steps] == [(0, "diverged")]
        # the first rank to stop ends the job: torchrun may stop the other before it writes its report
        report = out / f"rank-{rank}" / "report.json"
        if report.exists():
            reports += 1
            assert json.loads(report.read_text())["error"]["code"] == "replica-diverged"
    assert reports >= 1
    resumed = launch_fleet(fleet_settings(fleet_data, out, resume=True), FleetOptions(gpus=2, timeout_s=120),
                           entry=GPU_RANK, quiet=True)
    _check_resumed(resumed, fleet_reference)


@pytest.mark.slow
def test_a_rank_killed_mid_round_stops_the_other_with_a_named_error_and_resume_finishes(
        fleet_data: Path, tmp_path: Path, fleet_reference: dict[str, Any]) -> None:
    """Rank 1's worker is SIGKILLed at its TRAIN in round 0 with no elastic restart: the launcher ends
    (no hang) with a named error (not internal), each rank's ledger verifies and holds its initial sealed
    checkpoint, and ``--resume`` finishes the fleet with the uninterrupted one's model."""
    from gputravel.core.fleet.rank import FleetOptions
    from gputravel.core.fleet.run import launch_fleet
    from gputravel.core.ledger import verify_ledger

    out = tmp_path / "k"
    t0 = time.monotonic()
    with pytest.raises(GpuTravelError) as caught:
        launch_fleet(fleet_settings(fleet_data, out, fault="kill-orchestrator@TRAIN:1"),
                     FleetOptions(gpus=2, timeout_s=120), entry=GPU_RANK, quiet=True)
    assert time.monotonic() - t0 < 120, "the surviving rank waited out the fleet's timeout"
    # torchrun stopped the surviving rank (SIGTERM) once rank 1 died: the job's failure, named, exit 10
    assert isinstance(caught.value, WorkerError) and caught.value.exit_code == 10, caught.value
    assert "torchrun job exited" in caught.value.reason
    assert "rank 1 failed first (killed by signal 9)" in caught.value.reason
    for rank in (0, 1):
        assert verify_ledger(out / f"rank-{rank}" / "ledger.db").ok
        assert (out / f"rank-{rank}" / "checkpoints" / "ckpt-000000.gtc").exists()
    resumed = launch_fleet(fleet_settings(fleet_data, out, resume=True), FleetOptions(gpus=2, timeout_s=120),
                           entry=GPU_RANK, quiet=True)
    _check_resumed(resumed, fleet_reference)


@pytest.mark.slow
def test_a_raw_store_client_writing_the_ring_keys_of_a_running_fleet_gets_nothing_accepted(
        fleet_data: Path, tmp_path: Path) -> None:
    """The attacker connects a raw TCPStore client to the running fleet's store (torchrun's agent store; it
    reads the port from a rank's environment, as a process of the same user can) and keeps writing
    its own values under every key of the devices' ring handshake (nonces, ephemeral keys and evidence,
    responses, the group key). The ranks read them: the handshake refuses each (the evidence does not verify
    or the group key does not authenticate), the fleet stops with the named AttestationError (exit 3), every
    rank's ledger verifies, and no ring key was agreed, so no hop was ever sealed under a key the attacker
    chose."""
    from gputravel.core.fleet.rank import FleetOptions
    from gputravel.core.fleet.run import Rendezvous, launch_fleet
    from gputravel.core.ledger import read_rows, verify_ledger

    port = _free_port()
    stop = threading.Event()
    written = [0]
    ring = "gputravel/devices/0/gputravel/ring/0-1/0"
    keys = [f"{ring}/{kind}/{r}" for kind in ("nonce", "init", "resp", "group") for r in (0, 1)]

    def store_port() -> int | None:
        """The workers' store (torchrun's agent store, MASTER_PORT), read from a rank's environment."""
        for proc in Path("/proc").iterdir():
            try:
                cmd = (proc / "cmdline").read_bytes()
                if b"gputravel.console.cli.fleet_rank" not in cmd or str(out).encode() not in cmd:
                    continue
                env = dict(v.split(b"=", 1) for v in (proc / "environ").read_bytes().split(b"\0") if b"=" in v)
                return int(env[b"MASTER_PORT"])
            except (OSError, KeyError, ValueError):
                continue
        return None

    def attacker() -> None:
        attacker_store = None
        while not stop.is_set() and attacker_store is None:
            try:
                found = store_port()
                if found is None:
                    time.sleep(0.02)
                    continue
                attacker_store = dist.TCPStore("127.0.0.1", found, is_master=False,  # type: ignore[attr-defined]
                                               timeout=timedelta(seconds=2))
            except Exception:  # noqa: BLE001 - the store is not up yet
                time.sleep(0.05)
        while not stop.is_set() and attacker_store is not None:
            for key in keys:
                try:
                    attacker_store.set(key, os.urandom(96))
                    written[0] += 1
                except Exception:  # noqa: BLE001 - the store went away with the job
                    return
            time.sleep(0.001)

    thread = threading.Thread(target=attacker, daemon=True)
    thread.start()
    out = tmp_path / "s"
    try:
        with pytest.raises(AttestationError, match="ring handshake"):
            launch_fleet(fleet_settings(fleet_data, out), FleetOptions(gpus=2, timeout_s=120),
                         rdzv=Rendezvous(rdzv_endpoint=f"127.0.0.1:{port}"), entry=GPU_RANK, quiet=True)
    finally:
        stop.set()
        thread.join(10)
    assert written[0] > 0, "the attacker never reached the store"
    for rank in (0, 1):
        ledger = out / f"rank-{rank}" / "ledger.db"
        assert verify_ledger(ledger).ok
        assert not [r for r in read_rows(ledger) if r.kind == "fleet-joined"]  # no ring was formed
