"""Holder agents over SSH, against asyncssh's server on 127.0.0.1 (``EmbeddedSshServer``, one account
and home folder per holder): deploy and hash check, full runs on both data paths, and every fault of
the issue with a named error and nothing lost. Plus the inventory parser.

Runs are tiny (2 holders of ~75 KB, 16 KiB chunks, a 0.25 MiB buffer, batch 4 x 32 tokens); the
transfer faults use one holder of ~600 KB in 4 KiB chunks, so a transfer has ~150 chunks in flight
order and a fault lands in its middle.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import asyncssh
import pytest
from helpers import live_processes, small_settings, started, write_holder
from hypothesis import HealthCheck, example, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from gputravel.agents import deploy as deploy_mod
from gputravel.agents.deploy import HolderState, connect, deploy, remote_hash
from gputravel.agents.holder import agent_sha256, bundle_contents, digest_files, open_dataset, package_root
from gputravel.agents.inventory import ALLOWED, HolderSpec, load_inventory, parse_inventory
from gputravel.agents.ssh_holder import SshHolderLink
from gputravel.agents.ssh_links import EmbeddedSshServer, links_from_specs
from gputravel.core import api
from gputravel.core import events as ev
from gputravel.core.config import RunSettings
from gputravel.core.errors import AgentError, ConfigError, LinkLostError
from gputravel.core.files import InsecureKeyError
from gputravel.core.ledger import LedgerRow, parse_head, read_rows, verify_ledger
from gputravel.core.protocol.holderlink import DataEndpoint, ProvisioningKey
from gputravel.core.travel.engine import TravelEngine
from gputravel.core.travel.holders import Handoff

WORDS = "the quick brown fox jumps over a lazy dog while cat and bird sat on the warm mat".split()
HAPPY_STATES = ["connecting", "deploying", "verified", "ready", "provisioning", "returned", "stopped"]


# --- fixtures and helpers ------------------------------------------------------------------------
# data_root: conftest.py (alice and bob)
@pytest.fixture(scope="module")
def big_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Alice with ~600 KB (~150 chunks of 4 KiB in one visit, more than the agent keeps in flight), Bob small."""
    root = tmp_path_factory.mktemp("big")
    write_holder(root / "alice", 3, WORDS, n_words=130_000)
    write_holder(root / "bob", 4, WORDS)
    return root


@dataclass
class Ssh:
    server: EmbeddedSshServer
    specs: dict[str, HolderSpec]

    def home(self, name: str) -> Path:
        return self.server.workdir / "homes" / name

    def agent_dirs(self, name: str) -> list[Path]:
        return sorted((self.home(name) / ".gputravel").glob("agent-*"))


@contextlib.contextmanager
def ssh_server(root: Path, workdir: Path, names: tuple[str, ...] = ("alice", "bob")) -> Iterator[Ssh]:
    workdir.mkdir(parents=True)
    server = EmbeddedSshServer([(n, root / n) for n in names], workdir=workdir)
    specs = server.start()
    try:
        yield Ssh(server, {s.name: s for s in specs})
    finally:
        if server.proc is not None and server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)  # a test may have stopped it
        server.stop()


@pytest.fixture
def ssh(data_root: Path, tmp_path: Path) -> Iterator[Ssh]:
    with ssh_server(data_root, tmp_path / "ssh") as s:
        yield s


@pytest.fixture
def ssh_big(big_root: Path, tmp_path: Path) -> Iterator[Ssh]:
    with ssh_server(big_root, tmp_path / "ssh") as s:
        yield s


def small(data: Path, out: Path, **kw: Any) -> RunSettings:
    # visit_attempts=1: a failed visit stays failed, so the faults below are seen as they happen
    return small_settings(data, out, **{"allow_fault_injection": True, "transport": "ssh", "visit_attempts": 1, **kw})


def rows_of(out: Path, kind: str | None = None) -> list[LedgerRow]:
    return [r for r in read_rows(out / "ledger.db") if kind is None or r.kind == kind]


def states_of(out: Path, holder: str) -> list[str]:
    return [r.outcome for r in rows_of(out, "holder-state") if r.holder == holder]


@pytest.fixture(autouse=True)
def no_leaked_processes(tmp_path: Path) -> Iterator[None]:
    """No device service, SSH server or agent outlives a test (agents run in homes under tmp_path)."""
    yield
    me, where = os.getpid(), str(tmp_path)

    def leaked() -> list[str]:
        return [f"{p.pid}: {p.cmd}" for p in live_processes()
                if (p.ppid == me and "gputravel" in p.cmd) or p.cwd.startswith(where)]

    deadline = time.monotonic() + 5
    while leaked() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leaked() == [], "device service, SSH server or agent processes outlived the test"


def expected_digest(engine: TravelEngine, data: Path) -> str:
    """SHA-256 of what the current visit's window must hold: the holder's train slice, then val slice."""
    plan = engine.walk.current.plan  # type: ignore[union-attr]
    ds = open_dataset(data / plan.holder, val_fraction=engine.settings.val_fraction)
    return hashlib.sha256(ds.train.read(plan.train_start, plan.train_len)
                          + ds.val.read(plan.val_start, plan.val_len)).hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- 1. deploy, hash check, redeploy on change ---------------------------------------------------
async def test_deploy_into_hash_folder_verifies_and_redeploys_only_when_the_bundle_changes(
        ssh: Ssh, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, home, want = ssh.specs["alice"], ssh.home("alice"), agent_sha256()
    states: list[tuple[str, str]] = []
    conn = await connect(spec)
    try:
        first = await deploy(conn, spec, on_state=lambda s, d: states.append((s, d)))
        assert first.uploaded is True and first.bundle_sha256 == want
        assert first.remote_dir == f".gputravel/agent-{want[:16]}"
        assert first.cryptography  # the remote python's cryptography version
        assert states == [("deploying", first.remote_dir), ("verified", want)]
        folder = home / first.remote_dir
        assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.py")) == \
            sorted(rel for rel, _ in bundle_contents())  # the agent and core.protocol, nothing else
        assert (folder / "gputravel/agents/holder/agent.py").read_bytes() == (package_root() / "agents/holder/agent.py").read_bytes()
        assert await remote_hash(conn, spec, first.remote_dir) == want  # recomputed there, without importing it
        assert await remote_hash(conn, spec, ".gputravel/agent-0000000000000000") is None
        assert ssh.agent_dirs("alice") == [folder]  # the staging folder was renamed into place
        mtime = (folder / "gputravel/agents/holder/agent.py").stat().st_mtime_ns

        states.clear()
        second = await deploy(conn, spec, on_state=lambda s, d: states.append((s, d)))
        assert second.uploaded is False and second.remote_dir == first.remote_dir
        assert states == [("verified", want)]
        assert (folder / "gputravel/agents/holder/agent.py").stat().st_mtime_ns == mtime

        changed = [(rel, data + b"\n# the next agent release\n" if rel == "gputravel/agents/holder/agent.py" else data)
                   for rel, data in bundle_contents()]
        monkeypatch.setattr(deploy_mod, "bundle_contents", lambda: changed)
        third = await deploy(conn, spec)
        new = digest_files(changed)
        assert new != want and third.uploaded is True and third.bundle_sha256 == new
        assert third.remote_dir == f".gputravel/agent-{new[:16]}"
        assert (home / third.remote_dir / "gputravel/agents/holder/agent.py").read_bytes().endswith(b"release\n")
        assert await remote_hash(conn, spec, third.remote_dir) == new
        assert await remote_hash(conn, spec, first.remote_dir) == want  # the earlier release is untouched
        assert [p.name for p in ssh.agent_dirs("alice")] == sorted([f"agent-{want[:16]}", f"agent-{new[:16]}"])
    finally:
        conn.close()
        await conn.wait_closed()


async def test_a_stalled_upload_is_a_named_error_not_a_hang(ssh: Ssh, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SSH server stops answering as the deployer starts its upload: ``deploy`` gives up after the upload's
    bound with a named error, before the keepalive would notice, and nothing is installed under the bundle's
    hash."""
    spec = ssh.specs["alice"]
    proc = ssh.server.proc
    assert proc is not None
    monkeypatch.setattr(deploy_mod, "UPLOAD_TIMEOUT_S", 2.0)
    states: list[str] = []

    def on_state(state: str, detail: str) -> None:
        states.append(state)
        if state == HolderState.DEPLOYING:  # the server stops answering: the SFTP session never starts
            os.kill(proc.pid, signal.SIGSTOP)

    conn = await connect(spec)
    try:
        with pytest.raises(AgentError, match="upload stalled: not done after 2 s") as info:
            await deploy(conn, spec, on_state=on_state)
        assert info.value.host == "alice"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        conn.close()
    assert states == [HolderState.DEPLOYING] and ssh.agent_dirs("alice") == []


# --- 2. full runs through SSH --------------------------------------------------------------------
@pytest.mark.parametrize("data_path", ["channel", "direct"])
async def test_full_run_through_ssh_completes_every_visit_and_reports_the_deployment(
        data_path: str, ssh: Ssh, data_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    events: list[ev.Event] = []
    report = (await api.run(small(data_root, out, rounds=2, data_path=data_path),
                           links=links_from_specs(list(ssh.specs.values())), sinks=[events.append])).to_json()

    assert [(v["holder"], v["outcome"]) for v in report["visits"]] == [("alice", "done"), ("bob", "done")] * 2
    assert all(v["integrity_ok"] and v["scrub_verified"] and v["bytes"] > 0 for v in report["visits"])
    assert report["failed_visits"] == 0 and report["ledger"]["verified"]
    holders = {h["name"]: h for h in report["holders"]}
    assert set(holders) == {"alice", "bob"}
    for name, h in holders.items():
        assert (h["transport"], h["host"], h["port"], h["user"]) == ("ssh", "127.0.0.1", ssh.server.port, name)
        assert h["bundle_sha256"] == h["agent_sha256"] == agent_sha256()
        assert h["remote_dir"] == f".gputravel/agent-{agent_sha256()[:16]}" and h["uploaded"] is True
        assert (ssh.home(name) / h["remote_dir"] / "gputravel/agents/holder/agent.py").is_file()

        seen = [e.state for e in events if isinstance(e, ev.HolderStateChanged) and e.holder == name]
        want = HAPPY_STATES[:4] + ["provisioning", "returned"] * 2 + ["stopped"]
        assert seen == want
        assert states_of(out, name) == want  # the same states as ledger rows
        verified = [e.detail for e in events if isinstance(e, ev.HolderStateChanged) and e.holder == name
                    and e.state == "verified"]
        assert verified == [agent_sha256()]
        # the holder's own witness of the ledger, in its home: this run's two hand-offs and the farewell are
        # the last lines
        witness = ssh.home(name) / ".gputravel" / "witness.jsonl"
        assert witness.stat().st_mode & 0o777 == 0o600
        records = [json.loads(line) for line in witness.read_text().splitlines()][-3:]
        assert [(r["holder"], r["at"]) for r in records] == [(name, "hand-off")] * 2 + [(name, "end")]
        assert verify_ledger(out / "ledger.db", expect_heads=[parse_head(r["ledger_head"]) for r in records]).ok
    # the key is released (HANDOFF) only after the holder's agent was verified and ready
    kinds = [(r.kind, r.phase, r.holder, r.outcome) for r in rows_of(out)]
    first_handoff = kinds.index(("phase", "HANDOFF", "alice", "ok"))
    assert kinds.index(("holder-state", None, "bob", "ready")) < first_handoff


# --- 3. host keys, authentication, reachability -------------------------------------------------
async def test_unknown_host_key_is_refused_and_no_key_is_released(ssh: Ssh, data_root: Path, tmp_path: Path) -> None:
    stranger = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    alice = replace(ssh.specs["alice"], host_key=stranger)
    out = tmp_path / "run"
    with pytest.raises(AgentError, match="host key not verified") as info:
        await api.run(small(data_root, out), links=links_from_specs([alice, ssh.specs["bob"]]))
    assert info.value.host == "alice"
    rows = rows_of(out)
    assert not [r for r in rows if r.phase == "HANDOFF" or r.kind == "holder-connected"]
    assert states_of(out, "alice") == ["connecting", "failed"]
    assert "host key not verified" in [r for r in rows if r.kind == "holder-state" and r.holder == "alice"][-1].detail[
        "detail"]
    assert [r.outcome for r in rows if r.kind == "run-failed"] == ["agent"]
    assert not (ssh.home("alice") / ".gputravel").exists()  # nothing was uploaded to an unverified host


async def test_changed_host_key_is_refused(ssh: Ssh) -> None:
    old = ssh.specs["alice"]
    conn = await connect(old)  # the pin matches the server as it was
    conn.close()
    await conn.wait_closed()
    ssh.server.stop()
    ssh.server.start()  # same accounts and folders, a new host key (and client keys, written to the same files)
    assert ssh.server.host_public != old.host_key
    moved = replace(old, port=ssh.server.port)  # the old pin
    with pytest.raises(AgentError, match="host key not verified"):
        await connect(moved)
    link = SshHolderLink(moved)
    with pytest.raises(AgentError, match="host key not verified"):
        await link.start()
    assert link.state == HolderState.FAILED and link.conn is None and link.process is None
    assert [s for _, s, _ in link.history] == ["connecting", "failed"]


async def test_wrong_client_key_is_an_authentication_failure(ssh: Ssh, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger_key"
    stranger.write_bytes(asyncssh.generate_private_key("ssh-ed25519").export_private_key())
    stranger.chmod(0o600)
    link = SshHolderLink(replace(ssh.specs["alice"], client_key=stranger))
    with pytest.raises(AgentError, match="authentication failed") as info:
        await link.start()
    assert info.value.host == "alice" and link.state == HolderState.FAILED
    assert not (ssh.home("alice") / ".gputravel").exists()


async def test_unreachable_host_fails_fast_with_a_named_error(ssh: Ssh) -> None:
    link = SshHolderLink(replace(ssh.specs["alice"], port=free_port(), connect_timeout=30.0))
    t0 = time.monotonic()
    with pytest.raises(AgentError, match="unreachable") as info:
        await link.start()
    assert time.monotonic() - t0 < 30  # refused at once, never waiting out the connect timeout (however loaded)
    assert info.value.host == "alice" and link.state == HolderState.FAILED
    assert "127.0.0.1" in link.state_detail


# --- 4. the remote python --------------------------------------------------------------------------
async def test_remote_python_without_cryptography_is_named(ssh: Ssh, tmp_path: Path) -> None:
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    bare = venv / "bin" / "python"
    assert subprocess.run([str(bare), "-c", "import cryptography"], capture_output=True).returncode != 0
    link = SshHolderLink(replace(ssh.specs["alice"], python=str(bare)))
    with pytest.raises(AgentError) as info:
        await link.start()
    reason = str(info.value)
    assert f"remote python '{bare}' lacks the 'cryptography' package" in reason
    assert "No module named 'cryptography'" in reason and "pip install" in reason
    assert link.state == HolderState.FAILED
    assert not (ssh.home("alice") / ".gputravel").exists()  # checked before anything is uploaded


async def test_remote_python_missing_altogether_is_named(ssh: Ssh, tmp_path: Path) -> None:
    link = SshHolderLink(replace(ssh.specs["alice"], python=str(tmp_path / "no-such-python")))
    with pytest.raises(AgentError, match="lacks python itself"):
        await link.start()


async def test_remote_cryptography_too_old_for_the_agent_is_named(ssh: Ssh) -> None:
    system = "/usr/bin/python3"
    probe = subprocess.run([system, "-c", "import cryptography; from cryptography.hazmat.primitives.ciphers.aead "
                                          "import AESGCM; print(cryptography.__version__, "
                                          "hasattr(AESGCM, 'encrypt_into'))"], capture_output=True, text=True) \
        if Path(system).exists() else None
    if probe is None or probe.returncode != 0 or not probe.stdout.strip().endswith("False"):
        pytest.skip(f"{system} has no cryptography, or one new enough for the agent")
    version = probe.stdout.split()[0]
    link = SshHolderLink(replace(ssh.specs["alice"], python=system))
    with pytest.raises(AgentError, match=f"has cryptography {version}, which lacks AESGCM.encrypt_into"):
        await link.start()


# --- 5. the agent bundle tampered after upload ---------------------------------------------------
@pytest.mark.parametrize("how", ["modified file", "added module"])
async def test_bundle_tampered_at_rest_is_refused_with_hash_mismatch(how: str, ssh: Ssh, data_root: Path,
                                                                     tmp_path: Path) -> None:
    spec = ssh.specs["alice"]
    conn = await connect(spec)
    try:
        report = await deploy(conn, spec)
    finally:
        conn.close()
        await conn.wait_closed()
    folder = ssh.home("alice") / report.remote_dir
    if how == "modified file":
        target = folder / "gputravel/agents/holder/agent.py"
        target.write_bytes(target.read_bytes() + b"\nimport os  # exfiltrate\n")
    else:
        target = folder / "gputravel/core/protocol/sneaky.py"
        target.write_text("print('hello')\n")
    tampered = target.read_bytes()

    out = tmp_path / "run"
    with pytest.raises(AgentError, match="hash mismatch") as info:
        await api.run(small(data_root, out), links=links_from_specs([spec, ssh.specs["bob"]]))
    assert info.value.host == "alice" and "refused, no key released" in str(info.value)
    rows = rows_of(out)
    assert not [r for r in rows if r.phase == "HANDOFF" or r.kind == "holder-connected"]
    assert states_of(out, "alice") == ["connecting", "failed"]
    assert target.read_bytes() == tampered  # refused, not silently papered over
    assert [r.outcome for r in rows if r.kind == "run-failed"] == ["agent"]


async def test_bundle_tampered_between_verification_and_start_is_refused(ssh: Ssh) -> None:
    """The agent reports the hash of the files it runs from: a swap after the check is caught too."""
    link = SshHolderLink(ssh.specs["alice"])
    original = link._start_agent

    async def swap_then_start() -> None:
        target = ssh.home("alice") / link.deploy_report.remote_dir / "gputravel/core/protocol/keys.py"  # type: ignore[union-attr]
        target.write_bytes(target.read_bytes() + b"\n# swapped\n")
        await original()

    link._start_agent = swap_then_start  # type: ignore[method-assign]
    with pytest.raises(AgentError, match="hash mismatch") as info:
        await link.start()
    assert "no key released" in str(info.value)
    assert link.state == HolderState.FAILED and link.conn is None and link.process is None
    assert [s for _, s, _ in link.history] == ["connecting", "deploying", "verified", "failed"]


# --- 6. the connection drops mid-transfer: reconnect and resume ------------------------------------
@pytest.mark.parametrize("data_path", ["channel", "direct"])
async def test_connection_dropped_mid_transfer_resumes_and_the_buffer_equals_the_holder_data(
        data_path: str, ssh_big: Ssh, big_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    settings = small(big_root, out, holders=1, chunk_kib=4, buffer_mib=1.0, data_path=data_path)
    link = SshHolderLink(ssh_big.specs["alice"])
    original = link.provision
    dropped: list[int] = []
    tasks: list[asyncio.Task[None]] = []

    async def provision(handoff: Handoff, **kw: Any) -> Any:
        if not dropped:
            inner = kw["on_progress"]

            def progress(seq: int) -> None:
                inner(seq)
                if not dropped:  # after the first acknowledgement, the SSH connection drops
                    dropped.append(seq)
                    tasks.append(asyncio.get_running_loop().create_task(link.drop_connection()))

            kw["on_progress"] = progress
        return await original(handoff, **kw)

    link.provision = provision  # type: ignore[method-assign]
    seen: dict[str, Any] = {}
    async with started(settings, [link]) as engine:
        def before_train(e: TravelEngine) -> None:  # the buffer as provisioned, before TRAIN touches anything
            plan = e.walk.current.plan  # type: ignore[union-attr]
            head, _ = e.device.client.call("digest", offset=0, length=plan.window_len)
            seen.update(buffer=head["sha256"], want=expected_digest(e, big_root), window=plan.window_len)

        engine.fault["VERIFY"] = before_train
        report = (await engine.run()).to_json()

    assert len(dropped) == 1  # dropped once, after the first acknowledgement (direct: batched ACKs)
    (visit,) = report["visits"]
    assert visit["outcome"] == "done" and visit["integrity_ok"] and visit["scrub_verified"]
    n_chunks = -(-seen["window"] // settings.chunk_size)
    assert n_chunks > 100
    assert (visit["bytes"], visit["chunks"]) == (seen["window"], n_chunks)  # none lost, none twice
    assert seen["buffer"] == seen["want"]  # byte for byte the holder's data
    (row,) = rows_of(out, "provision-interrupted")
    assert (row.holder, row.outcome, row.detail["attempt"]) == ("alice", "link-lost", 1)
    assert 1 <= row.detail["resume_from"] < n_chunks  # resumed in the middle, from the device's count
    assert states_of(out, "alice") == HAPPY_STATES[:5] + ["offline", "connecting", "verified", "ready",
                                                          "provisioning", "returned", "stopped"]
    assert report["ledger"]["verified"]


async def test_uninterrupted_transfer_fills_the_buffer_with_the_same_bytes(ssh_big: Ssh, big_root: Path,
                                                                        tmp_path: Path) -> None:
    """The reference for the test above: the digest check itself is sound."""
    settings = small(big_root, tmp_path / "run", holders=1, chunk_kib=4, buffer_mib=1.0)
    seen: dict[str, str] = {}
    async with started(settings, links_from_specs([ssh_big.specs["alice"]])) as engine:
        def before_train(e: TravelEngine) -> None:
            plan = e.walk.current.plan  # type: ignore[union-attr]
            seen["buffer"] = e.device.client.call("digest", offset=0, length=plan.window_len)[0]["sha256"]
            seen["want"] = expected_digest(e, big_root)

        engine.fault["VERIFY"] = before_train
        report = (await engine.run()).to_json()
    assert report["visits"][0]["outcome"] == "done"
    assert seen["buffer"] == seen["want"]
    assert rows_of(tmp_path / "run", "provision-interrupted") == []


# --- 7. the agent is killed mid-transfer (the connection stays up) -------------------------------
async def test_agent_killed_mid_transfer_fails_the_visit_scrubs_and_the_run_goes_on(
        ssh_big: Ssh, big_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    links = links_from_specs(list(ssh_big.specs.values()))
    links[0].session.kill_after_chunks = 1  # SshHolderLink.kill: kill -9 of the agent's pid, over SSH
    report = (await api.run(small(big_root, out, rounds=2, chunk_kib=4, buffer_mib=1.0, data_path="channel"),
                           links=links)).to_json()  # kill_after_chunks counts the relay's acknowledgements

    v0, v1, v2, v3 = report["visits"]
    assert (v0["holder"], v0["outcome"], v0["failed_phase"]) == ("alice", "failed", "PROVISION")
    assert v0["scrub_verified"] is True and v0["integrity_ok"] is False and v0["loss_first"] is None
    assert [(v["holder"], v["outcome"]) for v in (v1, v2, v3)] == [("bob", "done"), ("alice", "done"),
                                                                   ("bob", "done")]
    assert report["failed_visits"] == 1
    (row,) = rows_of(out, "visit-failed")
    assert (row.holder, row.phase, row.outcome) == ("alice", "PROVISION", "agent")
    assert row.detail["scrub_verified"] is True
    assert rows_of(out, "provision-interrupted") == []  # the agent died; the link did not drop
    alice = states_of(out, "alice")
    assert alice[:6] == ["connecting", "deploying", "verified", "ready", "provisioning", "failed"]
    assert "offline" not in alice
    # restarted for its next visit over a new connection, without uploading again
    assert alice[6:] == ["connecting", "verified", "ready", "provisioning", "returned", "stopped"]
    assert report["ledger"]["verified"]


# --- 8. keepalive timeout: the holder is marked offline ------------------------------------------
async def test_keepalive_timeout_marks_the_holder_offline(ssh: Ssh) -> None:
    spec = replace(ssh.specs["alice"], keepalive_interval=0.5, keepalive_count_max=2, connect_timeout=1.5)
    link = SshHolderLink(spec, max_reconnects=1)
    await link.start()
    assert link.state == HolderState.READY
    handoff = Handoff(epoch=1, session_id="00" * 16, key=ProvisioningKey(bytes(32), bytes(4), 1, 3), window_offset=0,
                      chunk_size=4096, train=(0, 4096), val=(0, 0))
    assert ssh.server.proc is not None
    os.kill(ssh.server.proc.pid, signal.SIGSTOP)  # the server stops answering, the TCP connection stays
    try:
        t0 = time.monotonic()
        with pytest.raises(LinkLostError, match="connection lost") as info:
            await link.provision(handoff, device_socket="/nonexistent",
                                 data_endpoint=DataEndpoint(path="/nonexistent"))
        assert time.monotonic() - t0 < 10
        assert info.value.code == "link-lost"
        assert link.state == HolderState.OFFLINE
        assert [s for _, s, _ in link.history][-2:] == ["provisioning", "offline"]
        with pytest.raises(AgentError, match="unreachable"):  # still not answering: stays offline
            await link.reconnect()
        assert link.state == HolderState.OFFLINE
    finally:
        os.kill(ssh.server.proc.pid, signal.SIGCONT)
        await link.close()


# --- 9. the inventory ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def key_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("inv")
    (d / "key").write_bytes(asyncssh.generate_private_key("ssh-ed25519").export_private_key())
    (d / "key").chmod(0o600)  # a client key others can read is refused
    (d / "known_hosts").write_text("")
    return d


PIN = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHX5lHw6Fh6KdK7r0g0hVXkS5LqS6G7l0aHqH7O3n0Ab"


def holder_toml(**over: Any) -> str:
    fields: dict[str, Any] = {"name": "a", "host": "10.0.0.5", "user": "ua", "client_key": "key",
                              "host_key": PIN, "data": "/srv/a"}
    fields.update(over)
    return "[[holder]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items() if v is not None)


def test_inventory_parses_defaults_and_relative_paths(key_dir: Path) -> None:
    text = ('[defaults]\nuser = "shared"\npython = "/usr/bin/python3"\nport = 2222\n\n'
            + holder_toml(user=None, known_hosts="known_hosts", host_key=None) + "\n"
            + holder_toml(name="b", host="10.0.0.6", port=22, keepalive_interval=1))
    path = key_dir / "holders.toml"
    path.write_text(text)
    a, b = load_inventory(path)
    assert (a.name, a.user, a.port, a.python, a.host_key) == ("a", "shared", 2222, "/usr/bin/python3", None)
    assert a.client_key == key_dir / "key" and a.known_hosts == key_dir / "known_hosts"
    assert (b.user, b.port, b.host_key, b.keepalive_interval) == ("ua", 22, PIN, 1.0)


@pytest.mark.parametrize(("text", "field"), [
    (holder_toml(colour="blue"), "colour"),
    (holder_toml(host=None), "'host'"),
    (holder_toml(data=None), "'data'"),
    (holder_toml(client_key="no-such-key"), "client_key"),
    (holder_toml(client_key="."), "client_key"),
    (holder_toml(host_key=None), "'host_key' or 'known_hosts'"),
    (holder_toml(host_key=None, known_hosts="nope"), "known_hosts"),
    (holder_toml(port="22"), "'port'"),
    (holder_toml(port=70000), "port 70000"),
    ("[defaults]\nhost = 'x'\n" + holder_toml(), "'host'"),
    ("[extras]\n" + holder_toml(), "extras"),
    ("", "no [[holder]]"),
    (holder_toml() + holder_toml(), "duplicate holder name"),
    ("[[holder]\nname=", "not valid TOML"),
    (holder_toml(data_route="pigeon"), "data_route"),
], ids=["unknown key", "missing host", "missing data", "unreadable key file", "key file is a folder",
        "missing host key pin", "missing known_hosts file", "port type", "port range", "per-holder default",
        "unknown section", "empty", "duplicate", "bad toml", "data route"])
def test_inventory_errors_name_the_field(text: str, field: str, key_dir: Path) -> None:
    with pytest.raises(ConfigError) as info:
        parse_inventory(text, base=key_dir, source="holders.toml")
    assert field in str(info.value) and "holders.toml" in str(info.value)


@pytest.mark.parametrize(("mode", "who"), [(0o644, "world"), (0o604, "world"), (0o640, "group"), (0o660, "group")])
def test_inventory_refuses_a_client_key_others_can_read(tmp_path: Path, mode: int, who: str) -> None:
    """Like the checkpoint key (and ssh itself): a group- or world-readable client_key is refused at load."""
    key = tmp_path / "keys" / "holder-a"
    key.parent.mkdir()
    key.write_bytes(asyncssh.generate_private_key("ssh-ed25519").export_private_key())
    key.chmod(mode)
    inventory = tmp_path / "holders.toml"
    inventory.write_text(holder_toml(client_key="keys/holder-a"))

    with pytest.raises(InsecureKeyError) as info:
        load_inventory(inventory)
    message = str(info.value)
    assert str(inventory) in message and "holder 'a'" in message and "client_key" in message
    assert str(key) in message and f"{who}-readable" in message and f"chmod 600 {key}" in message
    assert isinstance(info.value, ConfigError)

    key.chmod(0o600)  # 0600 is accepted
    (spec,) = load_inventory(inventory)
    assert spec.client_key == key


def test_unreadable_inventory_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the inventory"):
        load_inventory(tmp_path / "missing.toml")


def _toml_str(v: str) -> str:
    return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F or c in '"\\' else c
                         for c in v) + '"'


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v == float("inf") else "-inf" if v == float("-inf") else repr(v))
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_str(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, int):
        return str(v)
    return _toml_str(v)


_FIELDS = st.sampled_from(sorted(ALLOWED) + ["colour", "Name", "", "holder", "defaults"])
_ODD_STRINGS = st.sampled_from(["key", "known_hosts", ".", "/", "~", "~nobody-such-user/key", "a\x00b", "/dev/null",
                                PIN, "ssh-ed25519 garbage", "../" * 40 + "etc/passwd", "x" * 5000, ""])
_ODD_PATHS = st.sampled_from(["a\x00b", "key\x00", "", ".", "/", "~", "~nobody-such-user/key", "/dev/null",
                              "/proc/self/mem", "x" * 5000, "../" * 40 + "etc/passwd", "known_hosts", "key"])
_VALUES = st.one_of(st.integers(-2**70, 2**70), st.floats(), st.booleans(), st.text(max_size=30), _ODD_STRINGS,
                    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_HOLDER = st.dictionaries(_FIELDS, _VALUES, max_size=14)


_VALID = {"name": st.text(min_size=1, max_size=5), "host": st.just("10.0.0.5"), "user": st.just("u"),
          "client_key": st.just("key"), "data": st.just("/srv/d"), "port": st.integers(1, 65535),
          "host_key": st.just(PIN), "known_hosts": st.just("known_hosts"), "python": st.just("python3"),
          "connect_timeout": st.floats(0, 30), "keepalive_interval": st.floats(0, 30),
          "keepalive_count_max": st.integers(0, 9), "remote_dir": st.just(".gputravel"),
          "val_fraction": st.floats(0, 1)}


@st.composite
def near_valid_holders(draw: st.DrawFn) -> dict[str, Any]:
    """A valid holder with a few fields deleted or given odd values, so random input reaches every check."""
    holder = {k: draw(v) for k, v in _VALID.items()
              if k in ("name", "host", "user", "client_key", "data", "host_key") or draw(st.booleans())}
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(sorted(_VALID) + ["client_key", "known_hosts"] * 4))
        if draw(st.integers(0, 4)) == 0:
            holder.pop(key, None)
        elif key in ("client_key", "known_hosts") and draw(st.booleans()):
            holder[key] = draw(_ODD_PATHS)
        else:
            holder[key] = draw(st.one_of(_ODD_STRINGS, _VALUES))
    return holder


@st.composite
def inventories(draw: st.DrawFn) -> str:
    parts = []
    if draw(st.integers(0, 2)) == 0:
        defaults = draw(st.one_of(_HOLDER, near_valid_holders().map(
            lambda h: {k: v for k, v in h.items() if k not in ("name", "host", "data")})))
        parts.append("[defaults]\n" + "".join(f"{_toml_str(k)} = {_toml_value(v)}\n" for k, v in defaults.items()))
    for holder in draw(st.lists(st.one_of(_HOLDER, near_valid_holders(), near_valid_holders()), max_size=3)):
        if draw(st.integers(0, 9)) == 0:
            holder = {**holder, draw(_FIELDS): draw(_VALUES)}
        parts.append("[[holder]]\n" + "".join(f"{_toml_str(k)} = {_toml_value(v)}\n" for k, v in holder.items()))
    text = "\n".join(parts)
    if draw(st.integers(0, 4)) == 0 and text:  # a damaged file
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.text(max_size=8)) + text[at + draw(st.integers(0, 8)):]
    return text


@hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(inventories(), inventories(), inventories(), st.text(max_size=200)))
@example(text=holder_toml(client_key="a\x00b"))  # once a ValueError from the path check
@example(text=holder_toml(host_key=None, known_hosts="x" * 5000))  # once an OSError (name too long)
def test_inventory_parser_only_ever_raises_config_error(text: str, key_dir: Path) -> None:
    try:
        specs = parse_inventory(text, base=key_dir)
    except ConfigError as exc:
        assert str(exc)
        return
    for spec in specs:  # whatever parses is a usable spec
        assert isinstance(spec, HolderSpec) and 0 < spec.port < 65536
        assert spec.host_key is not None or spec.known_hosts is not None
        assert spec.client_key.is_file()


async def test_inventory_holders_reach_the_device_data_port_through_an_ssh_forward(ssh: Ssh, data_root: Path,
                                                                                   tmp_path: Path) -> None:
    """An inventory holder is another machine: the device's 127.0.0.1 data port is not its own, so the
    direct path rides a remote port forward on the holder's SSH connection (data_route = "forward")."""
    seen: dict[str, Any] = {}
    links = links_from_specs(list(ssh.specs.values()))
    original = SshHolderLink._route

    async def spy(self: SshHolderLink, endpoint: DataEndpoint | None) -> DataEndpoint | None:
        routed = await original(self, endpoint)
        seen[self.name] = (endpoint, routed)
        return routed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SshHolderLink, "_route", spy)
        report = (await api.run(small(data_root, tmp_path / "run", data_path="direct", transport="inventory"),
                               links=links)).to_json()
    assert all(v["outcome"] == "done" for v in report["visits"])
    for name in ("alice", "bob"):
        asked, routed = seen[name]
        assert asked.host == "127.0.0.1" and routed.host == "127.0.0.1"
        assert routed.port != asked.port  # the holder-side end of the forward, not the device's port


def test_a_network_data_route_passes_the_device_endpoint_through(ssh: Ssh) -> None:
    spec = replace(next(iter(ssh.specs.values())), data_route="network")
    link = SshHolderLink(spec)
    endpoint = DataEndpoint(host="10.1.2.3", port=4242)
    assert asyncio.run(link._route(endpoint)) == endpoint
    assert asyncio.run(link._route(DataEndpoint(path="/x"))) == DataEndpoint(path="/x")
