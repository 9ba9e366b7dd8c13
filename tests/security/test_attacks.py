"""A malicious holder: with a valid provisioning key it attacks the device, and is caught and named.

``MaliciousAgent`` is a subclass of the real ``gputravel.agents.holder.Agent`` run as a subprocess
(a small script written to ``tmp_path``, started by a ``LocalHolderLink`` subclass), so the honest
protocol code does the genuine part of its hand-off and the attacks come from a real separate
process holding the key, as a compromised holder VM would. (A ``FramedSession`` sending crafted
frames would run inside the orchestrator, which never holds a provisioning key on the direct path:
it could not seal chunks the way an attacker with the key does.)

During its own visit, on a data connection of its own to the device (the direct-path endpoint of its
HANDOFF), mallory:

(a) seals a chunk with its valid key for bytes just past the end of its window,
(b) tries to read the buffer back: frames the data port does not take (a REQUEST to read, a DATA_OPEN
    asking for a range) on the data connection,
(d) replays a chunk of alice's, captured on the wire by a tap on alice's (honest) agent,

(e) sends a chunk header nested 8,000 lists deep (a bounded decoder's named ``frame`` refusal, not a
    dead device thread),

then lets its genuine chunks through (its visit trains), and, after DONE and after the engine closed
its window, (c) seals a fresh chunk under its dead key and sends it on a new data connection.

Each attempt must be refused, counted against mallory's epoch, written to the ledger as an
``attack-detected`` row with holder, epoch and code, and shown in the report (``visits[i].attack``);
alice and bob complete; no byte outside mallory's window was written.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import HolderData, small_settings

from gputravel.console.entries import ENTRIES
from gputravel.core import events as ev
from gputravel.core.api import build_engine
from gputravel.core.ledger import read_rows, verify_ledger
from gputravel.core.procs import die_with_parent
from gputravel.core.travel.framed_link import STREAM_LIMIT
from gputravel.core.travel.local_link import LocalHolderLink

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls sing softly at night".split()

AGENTS_SCRIPT = r'''
"""Test-only holder agents: TappedAgent (honest; its sealed chunks are captured on the wire) and
MaliciousAgent (attacks the device with its valid key)."""
import json
import socket
import sys
import threading
import time
from pathlib import Path

from gputravel.agents.holder import Agent, open_dataset
from gputravel.core.protocol import FrameType, SendState, encode_frame, read_frame
from gputravel.core.protocol.frames import MAGIC, PREFIX, VERSION, frame_head
from gputravel.core.protocol.holderlink import Admission


def nested_frame(ftype, depth=8000):
    """A frame whose header nests ``depth`` lists: raw bytes (no JSON encoder writes one this deep)."""
    header = b'{"e":' + b"[" * depth + b"]" * depth + b"}"
    return PREFIX.pack(MAGIC, VERSION, int(ftype), len(header), 0) + header


class DataConn:
    """A raw data connection to the device (the direct path), one request and its answer at a time."""

    def __init__(self, endpoint, h, holder):
        """Admitted for the window of HANDOFF ``h`` with its key, as ``holder`` (``ready``: the answer)."""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(20)
        self.sock.connect(endpoint["path"])
        self.stream = self.sock.makefile("rb")
        admit = Admission.make(h.key.key, session_id=bytes.fromhex(h.session_id), epoch=h.epoch, holder=holder)
        self.ready = self.send(FrameType.DATA_OPEN, {"session": h.session_id, "admit": admit.to_wire()})

    def send(self, ftype, header, payload=b""):
        return self.send_raw(frame_head(ftype, header, len(payload)) + bytes(payload))

    def send_raw(self, raw):
        self.sock.sendall(raw)
        frame = read_frame(self.stream)
        if frame is None:
            return {"type": "closed"}
        return {"type": frame.type.name, "header": frame.header, "payload_len": len(frame.payload)}

    def close(self):
        try:
            self.sock.sendall(encode_frame(FrameType.BYE, {}))
        except OSError:
            pass
        self.sock.close()


class TappedAgent(Agent):
    """An honest agent; an eavesdropper on its wire records every sealed chunk it sends."""

    def __init__(self, *args, workdir, **kw):
        super().__init__(*args, **kw)
        self.tap = Path(workdir) / f"tap-{self.name}.jsonl"

    def _provision_loop(self, h, sender, out, direct, **kw):
        send_chunk = out.send

        def tapped(head, ct, slot):
            with open(self.tap, "a") as f:
                f.write(json.dumps({"head": head, "ct": bytes(ct).hex()}) + "\n")
            send_chunk(head, ct, slot)

        out.send = tapped
        super()._provision_loop(h, sender, out, direct, **kw)


class MaliciousAgent(Agent):
    """Holds a valid provisioning key and abuses it: out-of-window write, read-back, replay, reuse."""

    def __init__(self, *args, workdir, **kw):
        super().__init__(*args, **kw)
        self.workdir = Path(workdir)

    def log(self, what, answer):
        with open(self.workdir / "attacks.jsonl", "a") as f:
            f.write(json.dumps({"attack": what, "answer": answer}) + "\n")

    def provision(self, h):
        key = h.key  # the typed hand-off (core.protocol.holderlink.Handoff) and its ProvisioningKey
        session = bytes.fromhex(h.session_id)
        epoch, base, cs = h.epoch, h.window_offset, h.chunk_size
        total = h.window_len
        n_chunks = h.n_chunks
        endpoint = h.data_endpoint.to_wire()
        conn = DataConn(endpoint, h, self.name)
        assert conn.ready["type"] == "DATA_READY", conn.ready
        # (a) a chunk sealed with the valid key, for bytes just past the end of the window
        evil = SendState(key, session_id=session, start=n_chunks + 1000)
        off, n = base + total, 64
        seq, ct = evil.seal(b"\xee" * n, frame_type=FrameType.CHUNK, offset=off, length=n)
        self.log("write-outside-window", conn.send(FrameType.CHUNK, {"e": epoch, "s": seq, "o": off, "n": n}, ct))
        # (b) read the buffer back: the data port takes chunks in, nothing else
        self.log("read-back", conn.send(FrameType.REQUEST, {"e": epoch, "op": "read", "offset": base, "length": total}))
        self.log("read-back", conn.send(FrameType.DATA_OPEN, {"e": epoch, "session": h.session_id,
                                                              "read": [base, total]}))
        # (d) replay a chunk captured from another holder's hand-off
        captured = [json.loads(line) for line in (self.workdir / "tap-alice.jsonl").read_text().splitlines()]
        c = captured[0]
        self.log("replay", conn.send(FrameType.CHUNK, c["head"], bytes.fromhex(c["ct"])))
        # (e) a chunk header nested 8,000 lists deep (issue 24: it once killed the device's thread unanswered)
        self.log("nested-header", conn.send_raw(nested_frame(FrameType.CHUNK)))
        conn.close()
        # the genuine hand-off: its own data arrives and trains
        super().provision(h)
        # (c) after DONE, once the engine closed the window: the dead key, a fresh chunk
        threading.Thread(target=self.reuse_after_return, args=(h, key, session, epoch, base, cs),
                         daemon=True).start()

    def reuse_after_return(self, h, key, session, epoch, base, cs):
        go, done = self.workdir / "go-reuse", self.workdir / "reuse-done"
        deadline = time.monotonic() + 60
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            # a connection for the dead window: its admission (a valid MAC under the dead key) is refused
            # as stale-epoch and charged to mallory's window (only its holder could make it)
            conn = DataConn(h.data_endpoint.to_wire(), h, self.name)
            self.log("reuse-after-return", conn.ready)
            conn.close()
        except Exception as exc:  # reported to the test through the log
            self.log("reuse-after-return", {"type": "exception", "error": repr(exc)})
        done.write_text("1")


class NestingAgent(Agent):
    """Answers its HANDOFF with a progress report whose header nests 8,000 lists deep, on its holder link:
    the orchestrator's decoder must refuse it by name and charge this holder, not fail the run."""

    def __init__(self, *args, workdir, **kw):
        super().__init__(*args, **kw)

    def provision(self, h):
        self.link.out.write(nested_frame(FrameType.ACK))
        self.link.out.flush()


def main():
    role, name, data, workdir = sys.argv[1:5]
    out, inp = sys.stdout.buffer, sys.stdin.buffer
    sys.stdout = sys.stderr
    cls = {"tapped": TappedAgent, "malicious": MaliciousAgent, "nesting": NestingAgent}[role]
    return cls(name, open_dataset(Path(data), val_fraction=0.1), out, inp, workdir=workdir).run()


if __name__ == "__main__":
    sys.exit(main())
'''


class ScriptLink(LocalHolderLink):
    """A local agent subprocess running one of the test agents of ``AGENTS_SCRIPT``."""

    def __init__(self, name: str, data: Path, *, role: str, script: Path, workdir: Path) -> None:
        super().__init__(name, data, agent=ENTRIES.holder_agent)
        self.role, self.script, self.workdir = role, script, workdir

    async def start(self) -> Any:
        with open(self.workdir / f"{self.name}.stderr", "ab") as err:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, str(self.script), self.role, self.name, str(self.data_dir), str(self.workdir),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err, limit=STREAM_LIMIT,
                preexec_fn=die_with_parent)
        self.session.attach(self.proc.stdout, self.proc.stdin)
        self.info = await self.session.greet()
        return self.info


@pytest.fixture(scope="module")
def data(holder_data: HolderData) -> Path:
    return holder_data({"alice": 100, "bob": 101, "mallory": 102}, WORDS, 6000, name="attackdata", newline=False)


async def test_malicious_holder_is_refused_named_in_the_ledger_and_marked_in_the_report(data: Path,
                                                                                       tmp_path: Path) -> None:
    work = tmp_path / "agents"
    work.mkdir()
    script = work / "agents.py"
    script.write_text(AGENTS_SCRIPT)
    out = tmp_path / "run"
    settings = small_settings(data, out, holders=3, steps_per_visit=1, buffer_mib=0.125, transport="local",
                              data_path="direct", allow_fault_injection=True, visit_attempts=1)
    links = [ScriptLink("alice", data / "alice", role="tapped", script=script, workdir=work),
             LocalHolderLink("bob", data / "bob", agent=ENTRIES.holder_agent),
             ScriptLink("mallory", data / "mallory", role="malicious", script=script, workdir=work)]
    engine = await asyncio.to_thread(build_engine, settings, links=links)
    outside: dict[str, Any] = {}

    def at_mallorys_verify(event: ev.Event) -> None:
        """Mallory's window is closed (RETURN done): let it reuse its dead key now, and look at the buffer
        outside its window before training touches anything."""
        if not (isinstance(event, ev.PhaseStarted) and event.holder == "mallory" and event.phase == "VERIFY"):
            return
        (work / "go-reuse").write_text("1")
        deadline = time.monotonic() + 30
        while not (work / "reuse-done").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        plan = engine.walk.current.plan
        start, length = plan.window_len, settings.buffer_bytes - plan.window_len
        head, _ = engine.device.client.call("digest", offset=start, length=length)
        outside.update(head, zeros=hashlib.sha256(bytes(length)).hexdigest())

    engine.bus.sinks.append(at_mallorys_verify)
    try:
        report = (await engine.run()).to_json()
    finally:
        await engine.aclose()

    # what mallory's attempts got back from the device: each one refused, with its code
    attempts = [json.loads(line) for line in (work / "attacks.jsonl").read_text().splitlines()]
    answers = [(a["attack"], a["answer"].get("type"), a["answer"].get("header", {}).get("code")) for a in attempts]
    assert answers == [("write-outside-window", "ERROR", "window"), ("read-back", "ERROR", "frame"),
                       ("read-back", "ERROR", "frame"), ("replay", "ERROR", "replay"),
                       ("nested-header", "ERROR", "frame"), ("reuse-after-return", "ERROR", "stale-epoch")], answers
    assert all(a["answer"]["payload_len"] == 0 for a in attempts)  # nothing read back

    # the honest holders complete; mallory's genuine chunks arrived, so its visit trained too
    by_holder = {v["holder"]: v for v in report["visits"]}
    assert [v["outcome"] for v in report["visits"]] == ["done", "done", "done"]
    assert not by_holder["alice"]["attack"] and not by_holder["bob"]["attack"]
    mallory = by_holder["mallory"]
    assert mallory["attack"] is True
    assert mallory["attack_attempts"] == {"window": 1, "frame": 3, "replay": 1, "stale-epoch": 1}
    assert report["attacks"] == [{"visit": mallory["visit"], "holder": "mallory", "epoch": mallory["epoch"],
                                  "attempts": mallory["attack_attempts"]}]

    # ledger: one attack-detected row per code, against mallory's holder and epoch
    rows = [r for r in read_rows(out / "ledger.db") if r.kind == "attack-detected"]
    assert sorted((r.holder, r.epoch, r.outcome, r.detail["count"]) for r in rows) == sorted([
        ("mallory", mallory["epoch"], "window", 1), ("mallory", mallory["epoch"], "frame", 3),
        ("mallory", mallory["epoch"], "replay", 1), ("mallory", mallory["epoch"], "stale-epoch", 1)])
    after_return = {r.outcome: r.detail["after_return"] for r in rows}
    assert after_return == {"window": False, "frame": False, "replay": False, "stale-epoch": True}
    assert all(r.key_fp == mallory["key_fingerprint"] for r in rows)
    assert verify_ledger(out / "ledger.db").ok
    assert "Traceback" not in (out / "device.log").read_text()  # every attempt answered, none crashed a thread

    # no byte outside mallory's window was written: the rest of the buffer is still the scrubbed zeros,
    # and the window took exactly its own chunks
    assert outside and outside["sha256"] == outside["zeros"], outside
    window_len = next(r for r in read_rows(out / "ledger.db") if r.kind == "phase" and r.phase == "PROVISION"
                      and r.holder == "mallory").nbytes
    assert mallory["bytes"] == window_len > 0  # what the device counted into the window: the plan, no more


async def test_a_holder_sending_the_orchestrator_a_deeply_nested_header_fails_only_its_own_visit_by_name(
        data: Path, tmp_path: Path) -> None:
    """Issue 24 item 5, on the orchestrator: a header of 8,000 nested lists on the holder link once aborted
    the whole run as an internal bug (``run-failed internal``, no holder named). Now the bounded decoder
    refuses it as a ``FrameError``, the visit of the holder that sent it fails as an ``AgentError`` naming
    it, and the other holder's visit and the run go on."""
    work = tmp_path / "agents"
    work.mkdir()
    script = work / "agents.py"
    script.write_text(AGENTS_SCRIPT)
    out = tmp_path / "run"
    settings = small_settings(data, out, steps_per_visit=1, buffer_mib=0.125, transport="local", data_path="direct",
                              visit_attempts=1)
    links = [LocalHolderLink("alice", data / "alice", agent=ENTRIES.holder_agent),
             ScriptLink("mallory", data / "mallory", role="nesting", script=script, workdir=work)]
    engine = await asyncio.to_thread(build_engine, settings, links=links)
    try:
        report = (await engine.run()).to_json()
    finally:
        await engine.aclose()

    outcomes = {v["holder"]: v["outcome"] for v in report["visits"]}
    assert outcomes == {"alice": "done", "mallory": "failed"}
    rows = read_rows(out / "ledger.db")
    failed = [r for r in rows if r.kind == "visit-failed"]
    assert [(r.holder, r.outcome) for r in failed] == [("mallory", "agent")]
    assert "mallory: sent a malformed frame" in failed[0].detail["error"]
    assert "header nests deeper than the 32 levels allowed" in failed[0].detail["error"]
    assert not [r for r in rows if r.kind == "run-failed" or r.outcome == "internal"]
    assert verify_ledger(out / "ledger.db").ok
