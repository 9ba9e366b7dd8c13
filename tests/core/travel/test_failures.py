"""Every failure ends a run cleanly, and resume refuses what it cannot trust (issue 15).

Each failure is met as a user meets it: the real CLI in a subprocess with a fault flag, a real SSH server on
127.0.0.1 (the embedded asyncssh server the default run uses), real files with real permissions. Each test
asserts the exit code, the final ledger row, the JSON error where ``--json`` was given, and that nothing was lost.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import HolderData, ServeDevice, small_settings, started, wait_for

from gputravel.agents.ssh_holder import HolderState, SshHolderLink
from gputravel.agents.ssh_links import EmbeddedSshServer
from gputravel.core.config import RunSettings
from gputravel.core.errors import LedgerError
from gputravel.core.ledger import LedgerRow, read_rows, verify_ledger
from gputravel.core.travel.engine import TravelEngine

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
SMALL = ["--holders", "2", "--rounds", "2", "--steps-per-visit", "2", "--batch-size", "4", "--seq-len", "32", "--chunk-kib", "16",
         "--buffer-mib", "0.25", "--no-record"]


def gputravel(*args: str, cwd: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "gputravel.console.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def rows(out: Path, kind: str | None = None) -> list[LedgerRow]:
    return [r for r in read_rows(out / "ledger.db") if kind is None or r.kind == kind]


def json_error(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The ``--json`` error envelope on stdout, checked for its shape."""
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and set(doc["error"]) >= {"type", "message", "exit_code"}, doc
    assert doc["error"]["exit_code"] == proc.returncode
    assert "Traceback" not in proc.stdout + proc.stderr
    return dict(doc["error"])


@pytest.fixture(scope="module")
def data(holder_data: HolderData) -> Path:
    return holder_data({"alice": 0, "bob": 1}, WORDS, 12_000, file="text.txt", newline=False)


# --- 1. an agent or its SSH session dies while the holder waits ------------------------------------
def test_agent_killed_while_waiting_goes_offline_reconnects_and_the_run_ends_0(data: Path, tmp_path: Path) -> None:
    """``--fault kill-agent@ATTEST:2`` on the default (embedded SSH) transport: alice's agent dies before its
    second visit; the holder goes offline, is reconnected and re-verified, and the visit is done by the new agent."""
    out = tmp_path / "run"
    proc = gputravel("run", "--data", str(data), *SMALL, "--out", str(out), "--json",
                     "--fault", "kill-agent@ATTEST:2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    assert [(v["holder"], v["outcome"]) for v in report["visits"]] == [("alice", "done"), ("bob", "done")] * 2
    all_rows = rows(out)
    assert all_rows[-1].kind == "run-completed" and all_rows[-1].outcome == "ok"
    alice = [(r.kind, r.outcome) for r in all_rows if r.holder == "alice" and r.kind == "holder-state"]
    states = [s for _, s in alice]
    off = states.index("offline")
    # offline, then a fresh connection whose agent's hash is verified before it is ready for the key
    assert states[off:off + 4] == ["offline", "connecting", "verified", "ready"]
    assert states[off + 4:off + 6] == ["provisioning", "returned"]
    done = [r.detail["visit"] for r in all_rows if r.kind == "visit-completed"]
    assert sorted(done) == [0, 1, 2, 3]  # nothing lost, nothing twice
    assert verify_ledger(out / "ledger.db").ok


@pytest.fixture
def ssh(data: Path, tmp_path: Path) -> Iterator[EmbeddedSshServer]:
    (tmp_path / "ssh").mkdir()
    server = EmbeddedSshServer([(n, data / n) for n in ("alice", "bob")], workdir=tmp_path / "ssh")
    server.specs = server.start()  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.stop()


def small(data: Path, out: Path, **kw: Any) -> RunSettings:
    return small_settings(data, out, **{"rounds": 2, "allow_fault_injection": True, "transport": "ssh", **kw})


def witness_handoffs(ssh: EmbeddedSshServer, holder: str) -> int:
    path = ssh.workdir / "homes" / holder / ".gputravel" / "witness.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if json.loads(line).get("at") == "hand-off")


async def test_a_holder_whose_agent_does_not_come_back_gets_no_key_and_the_run_ends_partial(
        ssh: EmbeddedSshServer, data: Path, tmp_path: Path) -> None:
    """Alice's agent dies while she waits, and the bundle on her machine is changed behind our back: the
    reconnect refuses it (hash mismatch), so she is never verified-ready again and is handed no key; her
    visit fails by the retry policy, bob's go on, and the run ends partial (exit 9 on the CLI)."""
    out = tmp_path / "run"
    links = [SshHolderLink(s, max_reconnects=1) for s in ssh.specs]  # type: ignore[attr-defined]
    alice = links[0]
    async with started(small(data, out, fault="kill-agent@ATTEST:2"), links) as engine:
        def tamper(e: TravelEngine) -> None:  # as alice's second visit begins (the fault plan then kills her agent)
            if e.walk.current is None or e.walk.current.plan.index != 2:
                e.fault["ATTEST"] = tamper
                return
            (agent_dir,) = [d for d in (ssh.workdir / "homes" / "alice" / ".gputravel").glob("agent-*")
                            if ".part-" not in d.name]
            with open(agent_dir / "gputravel" / "agents" / "holder" / "agent.py", "a") as f:
                f.write("\n# changed behind the orchestrator's back\n")

        engine.fault["ATTEST"] = tamper
        report = (await engine.run()).to_json()
        keys_derived = (await asyncio.to_thread(engine.device.client.stats)).counters["handoffs"]

    outcomes = [(v["holder"], v["outcome"]) for v in report["visits"]]
    assert outcomes == [("alice", "done"), ("bob", "done"), ("alice", "failed"), ("bob", "done")]
    assert report["failed_visits"] == 1
    assert witness_handoffs(ssh, "alice") == 1  # her first visit's hand-off only: no key after she went down
    assert witness_handoffs(ssh, "bob") == 2
    assert alice.state in (HolderState.OFFLINE, HolderState.FAILED)
    failed = [r for r in rows(out, "visit-failed") if r.holder == "alice"]
    assert failed and all(r.detail["visit"] == 2 for r in failed)
    assert "hash mismatch" in failed[-1].detail["error"]
    assert {r.phase for r in failed} == {"HANDOFF"}  # failed before its window was opened
    # no provisioning key for alice once she went offline: no HANDOFF row (which names the key) for her
    # after it, and the device derived exactly one key per HANDOFF row
    all_rows = rows(out)
    off = next(i for i, r in enumerate(all_rows) if r.kind == "holder-state" and r.holder == "alice"
               and r.outcome == "offline")
    handoffs = [r for r in all_rows if r.kind == "phase" and r.phase == "HANDOFF"]
    assert not [r for r in all_rows[off:] if r.kind == "phase" and r.phase == "HANDOFF" and r.holder == "alice"]
    assert keys_derived == len(handoffs) == 3
    assert rows(out)[-1].kind == "run-completed" and rows(out)[-1].outcome == "partial"
    assert verify_ledger(out / "ledger.db").ok


# --- 2. resume refuses a run folder it cannot trust; 7. ...and starts one that never got going --------
@pytest.fixture(scope="module")
def finished(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished local run, started with a relative --data path from the data's parent folder."""
    out = tmp_path_factory.mktemp("finished") / "run"
    proc = gputravel("run", "--data", data.name, *SMALL, "--rounds", "1", "--transport", "local", "--out", str(out),
                     "--json", cwd=data.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def files(out: Path) -> list[Path]:
    """A run folder's files (less SQLite's -wal/-shm companions, which a read-only reader may create)."""
    return sorted(p.relative_to(out) for p in out.rglob("*") if not p.name.endswith(("-wal", "-shm")))


def resume(out: Path, *, cwd: Path) -> subprocess.CompletedProcess[str]:
    return gputravel("run", "--resume", "--out", str(out), "--json", "--no-record", cwd=cwd)


def test_settings_json_holds_absolute_paths_and_resume_works_from_another_folder(finished: Path,
                                                                                 data: Path, tmp_path: Path) -> None:
    saved = json.loads((finished / "settings.json").read_text())
    assert saved["data_dir"] == str(data.resolve()) and Path(saved["out_dir"]).is_absolute()
    out = copy_run(finished, tmp_path / "run")
    n = len(rows(out))
    proc = resume(out, cwd=tmp_path)  # not where the run started: the relative --data would not resolve here
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [v["outcome"] for v in json.loads(proc.stdout)["visits"]] == ["done (earlier run)"] * 2
    assert [r.kind for r in rows(out)[n:]][-1] == "run-completed" and verify_ledger(out / "ledger.db").ok


def _tamper_settings(out: Path) -> None:
    path = out / "settings.json"
    saved = json.loads(path.read_text())
    saved["lr"] = saved["lr"] * 2  # valid, but not what the run started with
    path.write_text(json.dumps(saved))


def _cut_ledger(out: Path) -> None:
    """Rows cut off the end, and the progress state rewritten to match what is left (a careful attacker)."""
    db = sqlite3.connect(out / "ledger.db")
    cut = db.execute("SELECT max(seq) FROM events WHERE kind = 'phase' AND phase = 'VERIFY'").fetchone()[0]
    # visit 0's commit row is written once its checkpoint is durable (in the background): under load it can
    # land after visit 1's VERIFY; the cut keeps it, as the rewritten state says visit 0 is done
    committed = db.execute("SELECT max(seq) FROM events WHERE kind = 'visit-completed'"
                           " AND json_extract(detail, '$.visit') = 0").fetchone()[0]
    cut = max(cut, committed + 1)
    db.execute("DELETE FROM events WHERE seq >= ?", (cut,))  # the last visit's VERIFY row and every row after
    db.execute("UPDATE state SET value = '[0]' WHERE key = 'visits_done'")
    db.execute("UPDATE state SET value = '1' WHERE key = 'checkpoint_seq'")
    db.commit()
    db.close()


def _rewrite_row(out: Path) -> None:
    db = sqlite3.connect(out / "ledger.db")
    db.execute("UPDATE events SET outcome = 'ok!' WHERE seq = 5")
    db.commit()
    db.close()


def _state_lies(out: Path) -> None:
    db = sqlite3.connect(out / "ledger.db")
    db.execute("UPDATE state SET value = '[0]' WHERE key = 'visits_done'")
    db.commit()
    db.close()


def _flip_checkpoint(out: Path) -> None:
    path = sorted((out / "checkpoints").glob("ckpt-*.gtc"))[-1]
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 1
    path.write_bytes(blob)


def _drop_key(out: Path) -> None:
    (out / "keys" / "checkpoint.key").unlink()


def _other_key(out: Path) -> None:
    (out / "keys" / "checkpoint.key").write_bytes(os.urandom(32))


def _drop_ledger(out: Path) -> None:
    (out / "ledger.db").unlink()
    for extra in ("ledger.db-wal", "ledger.db-shm"):
        (out / extra).unlink(missing_ok=True)


@pytest.mark.parametrize(("tamper", "kind", "code", "words"), [
    (_tamper_settings, "IntegrityError", 5, "settings.json changed since the run started"),
    (_cut_ledger, "LedgerError", 8, "not the one checkpoint"),
    (_rewrite_row, "LedgerError", 8, "ledger"),
    (_state_lies, "LedgerError", 8, "progress state lists visits [0] done, the chained rows [0, 1]"),
    (_flip_checkpoint, "IntegrityError", 5, "does not verify"),
    (_drop_key, "IntegrityError", 5, "checkpoint.key is missing"),
    (_other_key, "IntegrityError", 5, "does not verify"),
    (_drop_ledger, "LedgerError", 8, "holds checkpoints but no ledger.db"),
])
def test_resume_refuses_what_it_cannot_trust_and_appends_nothing(
        tamper: Any, kind: str, code: int, words: str, finished: Path, tmp_path: Path) -> None:
    out = copy_run(finished, tmp_path / "run")
    tamper(out)
    ledger_before = (out / "ledger.db").read_bytes() if (out / "ledger.db").exists() else None
    files_before = files(out)
    proc = resume(out, cwd=tmp_path)
    err = json_error(proc)
    assert (err["type"], err["exit_code"]) == (kind, code) and words in err["message"], err
    assert proc.returncode == code
    # nothing appended, nothing created: the refusal came before the device or the ledger was opened
    assert files(out) == files_before
    if ledger_before is not None:
        assert (out / "ledger.db").read_bytes() == ledger_before


def test_resume_of_a_run_killed_in_its_first_seconds_starts_it(data: Path, tmp_path: Path) -> None:
    """Killed before its ledger existed: ``--resume`` starts the run with its saved settings; with not even
    settings.json, it says that a plain re-run is what to do."""
    out = tmp_path / "run"
    proc = gputravel("run", "--data", str(data), *SMALL, "--rounds", "1", "--transport", "local", "--out", str(out),
                     "--json", "--fault", "kill-orchestrator@ATTEST:0")
    assert proc.returncode == -9
    _drop_ledger(out)  # as if killed a moment earlier, before the ledger was created
    shutil.rmtree(out / "checkpoints")
    proc = resume(out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [v["outcome"] for v in json.loads(proc.stdout)["visits"]] == ["done", "done"]
    assert rows(out)[-1].kind == "run-completed"

    empty = tmp_path / "empty"
    empty.mkdir()
    err = json_error(resume(empty, cwd=tmp_path))
    assert err["exit_code"] == 2 and "plain `gputravel run`" in err["message"]


# --- 3. settings before anything; the JSON error; the final row ------------------------------------
@pytest.mark.parametrize(("args", "words"), [
    (["--break-before", "HANDOF"], "'HANDOF' is not one of"),  # a usage error (typer checks the choice)
    (["--break-before", "NOPE"], "'NOPE' is not one of"),
    (["--lr", "nan"], "lr must be a finite number"),
    (["--lr", "inf"], "lr must be a finite number"),
    (["--lr", "1e9"], "lr must be in"),
    (["--rounds", "99999999999999999999"], "rounds must be in [1, 1,000,000]"),
    (["--steps-per-visit", "0"], "steps-per-visit must be >= 1"),
    (["--seed", "-1"], "seed must be in"),
])
def test_bad_settings_exit_2_before_any_run_folder_or_latest_link_exists(args: list[str], words: str, data: Path,
                                                                         tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "run-earlier").mkdir()
    (tmp_path / "runs" / "latest").symlink_to("run-earlier")
    proc = gputravel("run", "--data", str(data), "--holders", "2", *args, "--json", cwd=tmp_path)
    err = json_error(proc)
    assert proc.returncode == 2 and err["type"] in ("ConfigError", "BadParameter") and words in err["message"], err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["latest", "run-earlier"]
    assert os.readlink(tmp_path / "runs" / "latest") == "run-earlier"


def test_the_error_printer_keeps_square_brackets(tmp_path: Path) -> None:
    inventory = tmp_path / "holders.toml"
    inventory.write_text("[defaults]\n")
    proc = gputravel("run", "--holders-file", str(inventory), "--json", cwd=tmp_path)
    err = json_error(proc)
    assert proc.returncode == 2 and "no [[holder]] entries" in err["message"]
    assert "no [[holder]] entries" in proc.stderr  # rich markup escaped, not eaten
    assert not (tmp_path / "runs").exists()


def test_an_attestation_failure_ends_with_a_final_row_and_its_exit_code(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = gputravel("run", "--data", str(data), *SMALL, "--transport", "local", "--cc-mode", "devtools",
                     "--out", str(out), "--json")
    err = json_error(proc)
    assert (proc.returncode, err["type"]) == (3, "AttestationError")
    last = rows(out)[-1]
    assert (last.kind, last.outcome) == ("run-failed", "attestation") and verify_ledger(out / "ledger.db").ok


def _signal_masks(pid: int) -> dict[str, str]:
    """A process's blocked, ignored and caught signals as the kernel says (``/proc/<pid>/status``)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = (line.partition(":") for line in f)
            return {k: v.strip() for k, _, v in fields if k in ("SigBlk", "SigIgn", "SigCgt")}
    except OSError:
        return {}


def _ctrl_c_reaches_it() -> None:
    """In the run's process before it starts: SIGINT at its default, as in a terminal. A suite started in the
    background of a non-interactive shell (``make test &``) ignores SIGINT, every child inherits that, and a run
    that ignores SIGINT rightly goes on: the test would then say nothing about Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_a_run_cleanly_and_it_resumes(data: Path, tmp_path: Path) -> None:
    """SIGINT while visits run: exit 130, the JSON error, a final ``run-failed`` row (cancelled), no process
    left behind; ``--resume`` then finishes the run with every visit done exactly once."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    recorded = [a for a in SMALL if a != "--no-record"]  # the default: the run is recorded too
    proc = subprocess.Popen([sys.executable, "-m", "gputravel.console.cli", "run", "--data", str(data), *recorded,
                             "--rounds", "40", "--transport", "local", "--out", str(out), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=_ctrl_c_reaches_it)
    t0 = time.monotonic()
    seen, polls, unreadable = False, 0, ""  # what the wait saw: said if the run did not stop
    try:
        deadline = t0 + 120
        while time.monotonic() < deadline:  # until the first visit is committed
            polls += 1
            try:
                if any(r.kind == "visit-completed" for r in rows(out)):
                    seen = True
                    break
            except LedgerError as exc:  # not there yet, or its schema not yet written
                unreadable = str(exc)
            time.sleep(0.2)
        running = proc.poll() is None
        masks = _signal_masks(proc.pid) if running else {}  # SIGINT is bit 2 (0x2): blocked, ignored, caught
        sent_s = time.monotonic() - t0
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (f"SIGINT sent {sent_s:.1f} s in, the run still running then: {running}; a "
                                    f"committed visit seen: {seen} after {polls} polls (last unreadable: "
                                    f"{unreadable!r}); its signal masks then: {masks}\n{stderr[-3000:]}")
    doc = json.loads(stdout)
    assert doc["error"]["type"] == "CancelledRunError" and doc["error"]["exit_code"] == 130
    last = rows(out)[-1]
    assert (last.kind, last.outcome) == ("run-failed", "cancelled")
    done_before = {r.detail["visit"] for r in rows(out) if r.kind == "visit-completed"}
    assert done_before
    again = resume(out, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    completed = [r.detail["visit"] for r in rows(out) if r.kind == "visit-completed"]
    assert sorted(completed) == list(range(80))  # every visit exactly once, across both runs
    assert verify_ledger(out / "ledger.db").ok


# --- 4. named errors where tracebacks were ---------------------------------------------------------
def test_an_unreadable_holder_folder_is_a_data_error(data: Path, tmp_path: Path) -> None:
    """Permissions are checked as a user without CAP_DAC_OVERRIDE would meet them (``capsh`` drops it; we run
    as root here)."""
    if shutil.which("capsh") is None:
        pytest.skip("needs capsh to drop CAP_DAC_OVERRIDE")
    root = tmp_path / "data"
    shutil.copytree(data, root)
    (root / "bob").chmod(0)
    cmd = " ".join([sys.executable, "-m", "gputravel.console.cli", "run", "--data", str(root), "--holders", "2",
                    "--json"])
    proc = subprocess.run(["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--", "-c", cmd],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    err = json_error(proc)
    assert (proc.returncode, err["type"]) == (2, "DataError")
    assert str(root / "bob") in err["message"] and "Permission denied" in err["message"]
    assert not (tmp_path / "runs").exists()


def test_an_inventory_client_key_that_is_not_a_key_exits_2(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("this is not a private key\n")
    key.chmod(0o600)
    (tmp_path / "holders.toml").write_text(
        '[[holder]]\nname = "a"\nhost = "127.0.0.1"\nuser = "u"\nclient_key = "key"\ndata = "/srv/a"\n'
        'host_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHX5lHw6Fh6KdK7r0g0hVXkS5LqS6G7l0aHqH7O3n0Ab"\n')
    proc = gputravel("run", "--holders-file", "holders.toml", "--json", cwd=tmp_path)
    err = json_error(proc)
    assert (proc.returncode, err["type"]) == (2, "ConfigError")
    assert "client_key" in err["message"] and "not a private key" in err["message"]


def test_a_missing_cuda_device_is_one_line_without_the_childs_traceback(data: Path, tmp_path: Path) -> None:
    import torch

    missing = f"cuda:{torch.cuda.device_count() + 7}"
    proc = gputravel("run", "--data", str(data), "--holders", "2", "--transport", "local", "--device", missing,
                     "--json", cwd=tmp_path)
    err = json_error(proc)
    assert (proc.returncode, err["type"]) == (2, "ConfigError")
    assert missing in err["message"] and "\n" not in err["message"] and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


# --- 5. absurd sizes -------------------------------------------------------------------------------
def test_a_schedule_past_the_stated_limit_is_refused_before_it_is_built() -> None:
    from gputravel.core.errors import ConfigError
    from gputravel.core.travel.holders import HolderInfo
    from gputravel.core.travel.schedule import MAX_PLANNED_VISITS, plan_visits

    info = HolderInfo("a", "byte", train_bytes=10 * 2**20, val_bytes=2**20, files=1, agent_sha256="0" * 64,
                      transport="local")
    with pytest.raises(ConfigError, match="limit is 1,000,000"):  # 45 parts x 30,000 rounds: 1.35 million visits
        plan_visits([info], rounds=30_000, buffer_bytes=2**18, val_share=0.1, min_train_bytes=100)
    plans = plan_visits([info], rounds=3, buffer_bytes=2**18, val_share=0.1, min_train_bytes=100)
    assert len(plans) == 3 * 45 <= MAX_PLANNED_VISITS


# --- 6. the device service bounds unauthenticated connections; stats stay small ---------------------
@pytest.fixture
def device(serve_device: ServeDevice) -> tuple[Any, Any, str, Any]:
    """A real device service (real sockets, real keys) served in this process with small bounds:
    4 connections may wait to authenticate, for 0.5 s each."""
    d = serve_device(max_pending=4, handshake_timeout=0.5)
    return d.service, d.server, d.sock, d.new_client


def test_stalled_and_garbage_connections_are_bounded_counted_and_the_device_keeps_serving(
        device: tuple[Any, Any, str, Any]) -> None:
    import socket
    import threading

    service, _server, sock, new_client = device
    threads_before = threading.active_count()
    stalled = []
    for _ in range(20):  # connect and say nothing
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock)
        stalled.append(s)
    try:
        wait_for(lambda: service.counts.refused["evicted"] + service.counts.refused["full"] >= 16)
        # only 4 wait at a time: each newcomer is refused (``full``) or, once the oldest has waited half the
        # deadline, takes its place (``evicted``)
        assert service.counts.refused["evicted"] + service.counts.refused["full"] == 16
        wait_for(lambda: threading.active_count() - threads_before <= 4)
        assert threading.active_count() - threads_before <= 4
        wait_for(lambda: service.counts.refused["timeout"] >= 4)
        assert service.counts.refused["timeout"] == 4  # the 4 that waited were cut off at the hand-shake limit
        wait_for(lambda: threading.active_count() <= threads_before)
        assert threading.active_count() <= threads_before  # every thread given back
    finally:
        for s in stalled:
            s.close()

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # garbage as a first frame
        s.connect(sock)
        s.sendall(b"\xde\xad\xbe\xef" * 64)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(10)
        while s.recv(4096):
            pass
    assert sum(service.counts.refused.values()) == 21
    assert service.counts.rejected == {}  # a refused connection is not a refused chunk

    client = new_client()
    try:
        result = client.connect()  # the device still serves a genuine peer
        assert result.ok
        stats = client.stats()
        assert stats.refused == dict(service.counts.refused) and sum(stats.refused.values()) == 21
    finally:
        client.close()


def test_stats_list_only_recent_epochs_so_their_header_stays_under_the_limit(
        device: tuple[Any, Any, str, Any]) -> None:
    """Rejections in 1,000 epochs: each ``stats`` answer lists at most a page of the epochs changed since
    the caller's last one, and paging through them yields every count (once)."""
    from gputravel.core.device.service import STATS_EPOCHS

    service, _server, _sock, new_client = device
    service.windows.dead_epochs.update(range(1, 1001))
    for epoch in range(1, 1001):
        for code in ("tag", "replay", "window", "stale-epoch", "frame"):
            service.counts.count_rejection(code, epoch)
    client = new_client()
    try:
        client.connect()
        seen: dict[str, dict[str, int]] = {}
        since, pages = 0, 0
        while True:
            stats = client.stats(since=since)  # over the wire: an oversized header would be a FrameError
            assert len(stats.rejected_by_epoch) <= STATS_EPOCHS
            assert not set(stats.rejected_by_epoch) & set(seen)
            seen.update(stats.rejected_by_epoch)
            since, pages = stats.rejection_gen, pages + 1
            if not stats.more:
                break
        assert pages == -(-1000 // STATS_EPOCHS)
        assert len(seen) == 1000 and all(sum(c.values()) == 5 for c in seen.values())
        assert client.stats(since=since).rejected_by_epoch == {}  # nothing new since
        service.windows.dead_epochs.add(7)  # (a new session forgets the old one's epochs)
        service.counts.count_rejection("tag", 7)
        assert client.stats(since=since).rejected_by_epoch == {"7": {"tag": 2, "replay": 1, "window": 1,
                                                                     "stale-epoch": 1, "frame": 1}}
    finally:
        client.close()


def test_ledger_show_of_a_broken_ledger_names_the_break_and_exits_8(finished: Path, tmp_path: Path) -> None:
    out = copy_run(finished, tmp_path / "run")
    assert gputravel("ledger", "show", str(out / "ledger.db")).returncode == 0
    _rewrite_row(out)
    proc = gputravel("ledger", "show", str(out / "ledger.db"), "--json")
    assert proc.returncode == 8 and "ledger broken" in proc.stderr and "row 5" in proc.stderr
    doc = json.loads(proc.stdout)  # one JSON error object, the rows still there to read in it
    assert doc["error"]["type"] == "LedgerError" and len(doc["rows"]) == len(rows(out))


@pytest.mark.parametrize(("field", "value", "words"), [
    ("breakpoints", ("HANDOF",), "break-before 'HANDOF' is not a phase"),
    ("lr", float("nan"), "lr must be a finite number"),
    ("buffer_mib", float("inf"), "buffer-mib must be a finite number"),
    ("rounds", 10**20, "rounds must be in [1, 1,000,000]"),
    ("holders", "3", "holders must be an integer"),
    ("seed", 2**64, "seed must be in"),
])
def test_run_settings_refuse_what_no_caller_may_pass(field: str, value: Any, words: str) -> None:
    """The console and the API build ``RunSettings`` too: the same checks, whoever calls."""
    from gputravel.core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        RunSettings(**{field: value})
    assert words in info.value.reason
