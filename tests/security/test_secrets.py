"""No key byte anywhere: files, ledger, report, events, CLI output, exception messages.

After full runs we collect every key that was used: each session's master secret and the control
channel's keys of every epoch of it (derived with ``channel_key``), every provisioning key handed to a
holder, the checkpoint key file's bytes and the per-run checkpoint sealing key derived from it. Then
each key is looked for as raw bytes, lower and upper hex and base64 (standard and URL-safe, with and
without padding; in text also with the whitespace removed, as rich wraps long lines) in:

* every file under the run folder (ledger database and its -wal/-shm, checkpoints, settings.json,
  platform/), except the checkpoint key file itself (which is the key);
* the JSON report, each event's ``repr`` and ``to_dict()``;
* the stdout and stderr of a ``gputravel run`` subprocess (embedded SSH transport, direct data path);
* the text (``str``, ``repr`` and traceback) of every exception raised in a failing run: a chunk
  tampered on the wire, an integrity failure (model altered), an agent killed mid-transfer, a tampered
  checkpoint, requests the device refuses, and a refused ``--resume``.

Also: the key, checkpoint and private key files are 0600, and ``gputravel run --resume`` refuses a
world- or group-readable checkpoint key, saying so (exit 2).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import stat
import subprocess
import sys
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from helpers import HolderData, small_settings

from gputravel.console.entries import ENTRIES
from gputravel.core import events as ev
from gputravel.core.api import build_engine, resolve_holder_dirs
from gputravel.core.deviceclient import client as client_mod
from gputravel.core.errors import GpuTravelError
from gputravel.core.ledger import read_rows
from gputravel.core.protocol import Direction
from gputravel.core.protocol.keys import channel_key
from gputravel.core.training.checkpoint import CheckpointStore
from gputravel.core.travel import framed_link as holders_mod
from gputravel.core.travel import recovery as recovery_mod
from gputravel.core.travel.local_link import LocalHolderLink

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

WORDS = "a lazy dog sleeps while seven quick owls sing over the quiet brown town at night".split()
ARGS = ["--holders", "2", "--rounds", "1", "--steps-per-visit", "2", "--batch-size", "4", "--seq-len", "32",
        "--chunk-kib", "16", "--buffer-mib", "0.25"]

#: ``gputravel`` with hooks that record, outside the run folder, every key used and every event.
INSTRUMENTED_CLI = r'''
import atexit, json, sys
from pathlib import Path

from gputravel.core.deviceclient import client as dc
from gputravel.core.travel import engine as eng
from gputravel.core.travel import framed_link as holders

dump = Path(sys.argv[1])
keys = {"sessions": [], "channel": [], "provisioning": []}
events = []

_set_epoch = dc.DeviceClient._set_epoch
def set_epoch(self, epoch):
    _set_epoch(self, epoch)
    keys["channel"].append([self.secrets.master.hex(), self.secrets.session_id.hex(), epoch])
dc.DeviceClient._set_epoch = set_epoch

_provision = holders.FramedSession.provision
async def provision(self, handoff, **kw):
    keys["provisioning"].append(handoff.key.key.hex())
    return await _provision(self, handoff, **kw)
holders.FramedSession.provision = provision

_emit = eng.TravelEngine.emit
def emit(self, event):
    events.append(repr(event))
    events.append(json.dumps(event.to_dict(), default=str))
    _emit(self, event)
eng.TravelEngine.emit = emit

atexit.register(lambda: dump.write_text(json.dumps({"keys": keys, "events": events})))
sys.argv = ["gputravel", *sys.argv[2:]]
from gputravel.console.cli import main as cli
cli.main()
'''


# --- helpers -----------------------------------------------------------------------------------------
def channel_keys(records: Iterable[tuple[bytes, bytes, int]]) -> list[bytes]:
    """Masters and every control-channel key of epochs 0..the highest seen, both directions, per session."""
    top: dict[tuple[bytes, bytes], int] = {}
    for master, sid, epoch in records:
        top[(master, sid)] = max(top.get((master, sid), 0), epoch)
    out = []
    for (master, sid), last in top.items():
        out.append(master)
        for e in range(last + 1):
            for d in (Direction.ORCH_TO_DEVICE, Direction.DEVICE_TO_ORCH):
                k = channel_key(master, sid, epoch=e, direction=d)
                out += [k.key]
    return out


def checkpoint_keys(out: Path, run_id: str) -> list[bytes]:
    store_key = (out / "keys" / "checkpoint.key").read_bytes()
    sealing = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                   info=b"gputravel/checkpoint/v1|" + run_id.encode()).derive(store_key)
    # the run's checkpoint key the device seals under (format 2), handed over the sealed control channel only
    run_key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                   info=b"gputravel/checkpoint/v2|" + run_id.encode()).derive(store_key)
    return [store_key, sealing, run_key]


def needles(keys: Iterable[bytes]) -> dict[bytes, str]:
    found: dict[bytes, str] = {}
    for i, k in enumerate(keys):
        assert len(k) >= 16, "not a key"
        for form, n in (("raw", k), ("hex", k.hex().encode()), ("HEX", k.hex().upper().encode()),
                        ("b64", base64.b64encode(k)), ("b64-nopad", base64.b64encode(k).rstrip(b"=")),
                        ("b64url", base64.urlsafe_b64encode(k).rstrip(b"="))):
            found[n] = f"key #{i} as {form}"
    return found


def scan(blob: bytes | str, what: str, keys: dict[bytes, str]) -> None:
    data = blob.encode(errors="surrogateescape") if isinstance(blob, str) else blob
    variants = [data] if not isinstance(blob, str) else [data, b"".join(data.split())]
    for v in variants:
        for needle, name in keys.items():
            assert needle not in v, f"{name} found in {what}"


def scan_run_folder(out: Path, keys: dict[bytes, str]) -> list[Path]:
    files = [p for p in out.rglob("*") if p.is_file()]
    for p in files:
        if p == out / "keys" / "checkpoint.key":
            continue  # the key itself
        scan(p.read_bytes(), str(p), keys)
    return files


def private_files(out: Path) -> list[Path]:
    """Files that are keys or sealed state: the checkpoint key, checkpoints, the platform's private keys."""
    found = []
    for p in out.rglob("*"):
        if p.is_file() and (p.suffix in (".key", ".gtc") or b"PRIVATE KEY" in p.read_bytes()):
            found.append(p)
    return found


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture(scope="module")
def data(holder_data: HolderData) -> Path:
    return holder_data({"alice": 40, "bob": 41}, WORDS, 12_000, name="secretdata", newline=False)


def gputravel(*args: str, instrument: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "100"}
    cmd = ([sys.executable, "-c", INSTRUMENTED_CLI, str(instrument)] if instrument else
           [sys.executable, "-m", "gputravel.console.cli"])
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def cli_run(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One full ``gputravel run`` (embedded SSH server, direct data path), keys and events recorded."""
    tmp = tmp_path_factory.mktemp("cli")
    out, dump = tmp / "run", tmp / "dump.json"
    proc = gputravel("run", "--data", str(data), *ARGS, "--out", str(out), "--json", instrument=dump)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recorded = json.loads(dump.read_text())
    report = json.loads(proc.stdout)
    k = recorded["keys"]
    keys = (channel_keys((bytes.fromhex(m), bytes.fromhex(s), e) for m, s, e in k["channel"])
            + [bytes.fromhex(p) for p in k["provisioning"]] + checkpoint_keys(out, report["run_id"]))
    return {"out": out, "proc": proc, "report": report, "events": recorded["events"], "keys": keys,
            "n_provisioning": len(k["provisioning"]), "n_sessions": len({m for m, _, _ in k["channel"]})}


def test_the_scan_finds_a_key_in_any_of_its_forms() -> None:
    key = bytes(range(7, 39))
    keys = needles([key])
    for text in (b"x" + key, key.hex(), "id " + key.hex().upper(), base64.b64encode(key).decode(),
                 base64.urlsafe_b64encode(key).decode(), key.hex()[:40] + "\n  " + key.hex()[40:]):
        with pytest.raises(AssertionError, match="key #0"):
            scan(text, "a sample", keys)


# --- 1. a full run over SSH: files, report, events, CLI output -----------------------------------------
def test_no_key_in_the_run_folder_report_events_or_cli_output(cli_run: dict[str, Any]) -> None:
    out, proc, report = cli_run["out"], cli_run["proc"], cli_run["report"]
    assert report["failed_visits"] == 0 and report["ledger"]["verified"]
    assert all(h["transport"] == "ssh" for h in report["holders"])
    assert cli_run["n_provisioning"] == len(report["visits"]) == 2 and cli_run["n_sessions"] == 1
    keys = needles(cli_run["keys"])
    assert len(cli_run["keys"]) >= 1 + 2 * (report["control_rotations"] + 1) + 2 + 2
    files = scan_run_folder(out, keys)
    names = {p.name for p in files}
    assert {"ledger.db", "settings.json", "checkpoint.key"} <= names
    assert any(p.suffix == ".gtc" for p in files) and any(p.parts[-3] == "platform" for p in files
                                                          if len(p.parts) >= 3)
    scan(json.dumps(report), "the JSON report", keys)
    scan(proc.stdout, "the CLI's stdout", keys)
    scan(proc.stderr, "the CLI's stderr", keys)
    assert "attested" in proc.stderr  # the progress output is there, and was scanned
    assert len(cli_run["events"]) > 20
    for text in cli_run["events"]:
        scan(text, f"event {text[:60]}", keys)


def test_key_checkpoint_and_private_key_files_are_0600(cli_run: dict[str, Any]) -> None:
    out = cli_run["out"]
    private = private_files(out)
    assert out / "keys" / "checkpoint.key" in private
    assert sum(p.suffix == ".gtc" for p in private) >= 1
    assert sum(p.is_relative_to(out / "platform") for p in private) >= 2  # device key, vendor CA keys
    bad = {str(p.relative_to(out)): oct(mode(p)) for p in private if mode(p) != 0o600}
    assert bad == {}
    for folder in (out / "keys", out / "checkpoints"):
        assert mode(folder) & 0o077 == 0, f"{folder} is {oct(mode(folder))}"


@pytest.mark.parametrize(("perm", "word"), [(0o644, "world-readable"), (0o640, "group-readable")])
def test_resume_refuses_a_readable_checkpoint_key(cli_run: dict[str, Any], perm: int, word: str) -> None:
    out = cli_run["out"]
    key = out / "keys" / "checkpoint.key"
    rows_before = len(read_rows(out / "ledger.db"))
    os.chmod(key, perm)
    try:
        proc = gputravel("run", "--resume", "--out", str(out), "--json")
    finally:
        os.chmod(key, 0o600)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    said = " ".join(proc.stderr.split())
    assert word in said and "checkpoint.key" in "".join(proc.stderr.split()) and "chmod 600" in said, said
    error = json.loads(proc.stdout)["error"]  # --json: the error envelope, no report
    assert (error["type"], error["exit_code"]) == ("InsecureKeyError", 2) and word in error["message"]
    assert len(read_rows(out / "ledger.db")) == rows_before  # refused before anything ran
    keys = needles(cli_run["keys"])
    scan(proc.stderr, "the refusal", keys)
    scan(proc.stdout, "the refusal on stdout", keys)


# --- 2. a failing run: exceptions, errors, rejections --------------------------------------------------
async def test_no_key_in_the_errors_of_a_failing_run(data: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    channel: list[tuple[bytes, bytes, int]] = []
    provisioning: list[bytes] = []
    errors: list[BaseException] = []

    set_epoch = client_mod.DeviceClient._set_epoch

    def recording_set_epoch(self: Any, epoch: int) -> None:
        set_epoch(self, epoch)
        channel.append((self.secrets.master, self.secrets.session_id, epoch))

    provision = holders_mod.FramedSession.provision

    async def recording_provision(self: Any, handoff: Any, **kw: Any) -> Any:
        provisioning.append(handoff.key.key)
        try:
            return await provision(self, handoff, **kw)
        except BaseException as exc:
            errors.append(exc)
            raise

    fail_visit = recovery_mod.Recovery.fail_visit

    async def recording_fail_visit(self: Any, rec: Any, exc: Any, window_open: bool) -> None:
        errors.append(exc)
        await fail_visit(self, rec, exc, window_open)

    monkeypatch.setattr(client_mod.DeviceClient, "_set_epoch", recording_set_epoch)
    monkeypatch.setattr(holders_mod.FramedSession, "provision", recording_provision)
    monkeypatch.setattr(recovery_mod.Recovery, "fail_visit", recording_fail_visit)

    out = tmp_path / "run"
    settings = small_settings(data, out, rounds=2, steps_per_visit=1, transport="local", data_path="channel",
                              allow_fault_injection=True, visit_attempts=2, fault="kill-agent@PROVISION:2")
    links = {name: LocalHolderLink(name, path, agent=ENTRIES.holder_agent) for name, path in resolve_holder_dirs(settings)}
    links["alice"].session.tamper_on_wire = {0}  # a chunk altered on the wire: TagError, retransmitted
    engine = await asyncio.to_thread(build_engine, settings, links=list(links.values()))
    events: list[ev.Event] = []
    tampered: list[int] = []

    def sink(event: ev.Event) -> None:
        events.append(event)
        if (isinstance(event, ev.PhaseStarted) and event.holder == "bob" and event.phase == "VERIFY"
                and not tampered):
            tampered.append(event.visit)
            engine.device.client.tamper(region="model")  # the model changes while bob holds a key

    engine.bus.sinks.append(sink)
    try:
        try:
            report = (await engine.run()).to_json()
        except GpuTravelError as exc:  # not expected; its text is scanned all the same
            errors.append(exc)
            raise
        # requests the device refuses, and a tampered checkpoint
        for op, args in (("handoff", {"epoch": 0, "offset": 0, "length": 16, "chunk_size": 16}),
                         ("handoff", {"epoch": 10**6, "offset": -5, "length": 16, "chunk_size": 16}),
                         ("close_window", {"epoch": 1}), ("restore", {}), ("no-such-op", {})):
            try:
                await asyncio.to_thread(engine.device.client.call, op, b"\x00" * 8 if op == "restore" else b"", **args)
            except GpuTravelError as exc:
                errors.append(exc)
    finally:
        try:
            if engine.device.handle.alive() and engine.device.client.secrets:
                await asyncio.to_thread(engine.device.client.shutdown)
        except GpuTravelError:
            pass
        engine.device.client.close()
        engine.device.handle.stop()
    seq, path = engine.ckpts.store.latest()
    blob = bytearray(path.read_bytes())
    blob[-40] ^= 1
    path.write_bytes(bytes(blob))
    try:
        CheckpointStore.over(engine.ckpts.store).load(seq, run_id=report["run_id"])
    except GpuTravelError as exc:
        errors.append(exc)

    # the failures happened, and were recorded
    failures = [f for v in report["visits"] for f in v["earlier_failures"]]
    assert any("measurement mismatch" in f for f in failures), failures
    assert any("PROVISION" in f for f in failures), failures
    assert report["provisioning"]["rejected"].get("tag") == 1
    assert all(v["outcome"] == "done" for v in report["visits"])
    codes = {getattr(e, "code", type(e).__name__) for e in errors}
    assert {"integrity", "agent", "tag", "stale-epoch", "window", "device"} <= codes, codes

    keys = needles(channel_keys(channel) + provisioning + checkpoint_keys(out, report["run_id"]))
    assert len(provisioning) >= 5  # 4 visits, 2 of them redone
    for exc in errors:
        for text in (str(exc), repr(exc), "".join(traceback.format_exception(exc)),
                     repr(getattr(exc, "__dict__", {}))):
            scan(text, f"exception {exc!r}", keys)
    scan(json.dumps(report), "the JSON report", keys)
    for e in events:
        scan(repr(e), f"event {type(e).__name__}", keys)
        scan(json.dumps(e.to_dict(), default=str), f"event {type(e).__name__}", keys)
    scan_run_folder(out, keys)
    rejected = [r for r in read_rows(out / "ledger.db") if r.kind in ("chunk-rejected", "visit-failed")]
    assert len(rejected) >= 3
