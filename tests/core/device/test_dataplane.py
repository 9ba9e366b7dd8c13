"""The device's data plane (``core/device/dataplane.py``) and the agent's long-lived resources.

- The staged path (what CUDA runs: open into a ring of staging slots, copy, a completion step that acks
  only once the bytes are in device memory) runs here on the CPU with the same code (``staged=True``),
  with a real in-process device service, real AES-GCM and a real authenticated session.
- ``@pytest.mark.gpu``: the same on a CUDA device (pinned slots, one copy stream, events); skipped
  without CUDA.
- A real holder agent, driven frame by frame over pipes against the real device service process: one
  data connection, one ring and one set of send slots for all its hand-offs.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import device_process

from gputravel.agents.holder import Agent, open_dataset
from gputravel.core.attestation import provision_emulated
from gputravel.core.device.service import DeviceService
from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.handshake import Initiator
from gputravel.core.protocol import TAG_LEN, DirectionKey, FrameType, SendState, read_frame, write_frame
from gputravel.core.protocol.errors import TagError
from gputravel.core.protocol.shmring import ring_supported

CHUNK = 4096


def service(tmp_path: Path, *, device: str = "cpu", staged: bool | None = True) -> DeviceService:
    _, identity = provision_emulated(tmp_path / "state")
    svc = DeviceService(identity=identity, buffer_bytes=64 * 1024, device=device, staged=staged)
    init = Initiator(context=b"dataplane-test")
    svc.open_session(initiator_public=init.public_bytes(), context=b"dataplane-test")
    return svc


def handoff(svc: DeviceService, epoch: int, length: int) -> SendState:
    head = svc.windows.op_handoff(epoch=epoch, offset=0, length=length, chunk_size=CHUNK, payload=b"").header
    key = DirectionKey.from_wire(head["provisioning_key"])
    return SendState(key, session_id=bytes.fromhex(head["session_id"]))


def seal(sender: SendState, data: bytes, seq: int) -> tuple[dict[str, Any], bytes]:
    off = seq * CHUNK
    n = min(CHUNK, len(data) - off)
    out = bytearray(n + TAG_LEN)
    assert sender.seal_into(data[off: off + n], out, frame_type=FrameType.CHUNK, offset=off, length=n) == seq
    return {"e": sender.epoch, "s": seq, "o": off, "n": n}, bytes(out)


def provision_staged(svc: DeviceService, epoch: int, data: bytes) -> list[bool]:
    """Submit every chunk at once; returns, per ack, whether the chunk's bytes were already in device
    memory when it was acknowledged."""
    sender = handoff(svc, epoch, len(data))
    in_memory: list[bool] = []
    acked = threading.Semaphore(0)

    def reply_for(off: int, n: int) -> Any:
        def reply(ack: dict[str, Any] | None, exc: BaseException | None) -> None:
            assert exc is None and ack is not None, exc
            in_memory.append(bytes(svc.buffer.tensor[off: off + n].cpu().numpy()) == data[off: off + n])
            acked.release()
        return reply

    n_chunks = -(-len(data) // CHUNK)
    for seq in range(n_chunks):
        head, ct = seal(sender, data, seq)
        svc.intake.submit_chunk(head, ct, reply_for(head["o"], head["n"]))
    closed = svc.windows.op_close_window(epoch=epoch, payload=b"").header  # waits for the copies
    assert closed["complete"] is True and closed["bytes"] == len(data)
    for _ in range(n_chunks):
        assert acked.acquire(timeout=10)
    return in_memory


def test_the_staged_path_acks_only_once_a_chunk_is_in_device_memory_and_allocates_once(tmp_path: Path) -> None:
    svc = service(tmp_path)
    svc.ops.op_set_data_path(parallel_auth=True, overlap=True, workers=2, payload=b"")
    data = os.urandom(10 * CHUNK + 123)
    for epoch in (1, 2, 3):
        assert all(provision_staged(svc, epoch, data))
        assert bytes(svc.buffer.tensor[: len(data)].numpy()) == data
        svc.windows.op_scrub(payload=b"")
    counters = svc.counters
    assert counters["alloc_staging"] == 1 and counters["alloc_pool"] == 1  # once per service, not per hand-off
    assert counters["h2d_ns"] > 0 and counters["open_ns"] > 0 and counters["chunks"] == 33
    staging = svc.plane._staging
    assert staging is not None and all(not s.any() for s in staging.slots)  # scrubbed: no plaintext left


def test_a_tampered_chunk_on_the_staged_path_frees_its_slot_and_leaves_memory_untouched(tmp_path: Path) -> None:
    svc = service(tmp_path)
    data = os.urandom(2 * CHUNK)
    sender = handoff(svc, 1, len(data))
    head, ct = seal(sender, data, 0)
    bad = bytearray(ct)
    bad[10] ^= 1
    with pytest.raises(TagError):
        svc.intake.accept_chunk(head, bytes(bad))
    assert svc.counts.rejected["tag"] == 1 and not svc.buffer.tensor.any()
    staging = svc.plane._staging
    assert staging is not None and all(not s.any() for s in staging.slots)  # the bad tag zeroed its slot
    # every slot is free again: as many chunks as slots go through without waiting
    for seq in (0, 1):
        assert svc.intake.accept_chunk(*seal(SendState(sender_key(svc, 1), session_id=sender.session_id, start=seq),
                                      data, seq))["s"] == seq
    assert bytes(svc.buffer.tensor[: len(data)].numpy()) == data


def sender_key(svc: DeviceService, epoch: int) -> DirectionKey:
    w = svc.windows.window
    assert w is not None and w.epoch == epoch
    from gputravel.core.protocol import Direction, provisioning_key

    s = svc.secrets
    assert s is not None
    return provisioning_key(s.master, s.session_id, epoch=epoch, offset=w.offset, length=w.length,
                            direction=Direction.HOLDER_TO_DEVICE)


@pytest.mark.gpu
def test_cuda_provisioning_goes_through_pinned_slots_one_copy_stream_and_events(tmp_path: Path) -> None:
    svc = service(tmp_path, device="cuda", staged=None)
    assert svc.plane.staged
    data = os.urandom(12 * CHUNK + 7)
    for epoch in (1, 2):
        assert all(provision_staged(svc, epoch, data))
        assert bytes(svc.buffer.tensor[: len(data)].cpu().numpy()) == data
        svc.windows.op_scrub(payload=b"")
    staging = svc.plane._staging
    assert staging is not None and all(s.is_pinned() for s in staging.slots)
    assert svc.counters["alloc_staging"] == 1 and svc.counters["h2d_ns"] > 0


# --- a real agent, its hand-offs driven over pipes -----------------------------------------------
@pytest.fixture(scope="module")
def device(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, DeviceClient]]:
    with device_process(tmp_path_factory.mktemp("dp-state"), buffer_bytes=1 << 20, allow_fault_injection=True) as dev:
        yield dev.handle, dev.client


class Driven:
    """An in-process ``Agent`` on pipes; the test speaks the orchestrator's side."""

    def __init__(self, data: Path) -> None:
        self.ds = open_dataset(data, val_fraction=0.1)
        r_in, w_in = os.pipe()
        r_out, w_out = os.pipe()
        self.agent = Agent("driven", self.ds, open(w_out, "wb"), open(r_in, "rb"))  # noqa: SIM115
        self.to_agent, self.from_agent = open(w_in, "wb"), open(r_out, "rb")  # noqa: SIM115
        self.thread = threading.Thread(target=self.agent.run, daemon=True)
        self.thread.start()
        hello = read_frame(self.from_agent)
        assert hello is not None and hello.type is FrameType.HELLO

    def handoff(self, header: dict[str, Any]) -> dict[str, Any]:
        write_frame(self.to_agent, FrameType.HANDOFF, header)
        self.to_agent.flush()
        while True:
            frame = read_frame(self.from_agent)
            assert frame is not None
            assert frame.type is not FrameType.ERROR, frame.header
            if frame.type is FrameType.DONE:
                return frame.header

    def bye(self) -> None:
        write_frame(self.to_agent, FrameType.BYE, {})
        self.to_agent.flush()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


@pytest.mark.parametrize("ring", [True, False])
def test_an_agent_keeps_one_connection_one_ring_and_one_set_of_slots_admitting_it_for_each_hand_off(
        device: tuple[Any, DeviceClient], tmp_path: Path, ring: bool) -> None:
    if ring and not ring_supported():
        pytest.skip("no memfd here")
    handle, client = device
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "part.txt").write_bytes(os.urandom(300_000))
    agent = Driven(tmp_path / "h")
    length = 200_000
    want = hashlib.sha256(agent.ds.train.read(0, length)).hexdigest()
    made = client.stats().counters.get("rings_made", 0)
    seen: set[tuple[int, int]] = set()
    try:
        for _ in range(3):
            epoch = client.stats().epoch + 1
            grant = client.handoff(epoch=epoch, offset=0, length=length, chunk_size=CHUNK * 4)
            done = agent.handoff({"epoch": epoch, "session": grant.session_id, "key": grant.provisioning_key.to_wire(),
                                  "window_offset": 0, "chunk_size": CHUNK * 4, "train": [0, length], "val": [0, 0],
                                  "length": length,
                                  "data_endpoint": {"path": handle.socket_path, **({} if ring else {"ring": False})}})
            assert done["bytes"] == length
            # the agent's stages, and its parts of the hand-off's fixed cost (``handoff.STAGE_PARTS``)
            assert set(done["stages"]) == {"setup_s", "data_s", "read_seal_s", "wait_s", "take_key_s",
                                           "admit_sent_s", "ack_to_done_s", "cpu_s", "seal_cpu_s"}
            assert 0 <= done["stages"]["take_key_s"] <= done["stages"]["admit_sent_s"] <= done["stages"]["setup_s"]
            # its CPU account (``bench provision``'s cpu_s): the seal calls ran, and within the process's CPU time
            assert 0 < done["stages"]["seal_cpu_s"] <= done["stages"]["cpu_s"] + 1e-6
            closed = client.close_window(epoch=epoch)
            assert closed.complete and closed.bytes == length
            assert client.call("digest", offset=0, length=length)[0]["sha256"] == want
            conn = agent.agent._data
            assert conn is not None
            seen.add((id(conn), id(conn.ring)))
            client.scrub()
        assert len(seen) == 1  # one data connection (and one ring), admitted again for every hand-off
        counters = client.stats().counters
        if ring:
            assert counters["rings_made"] == made + 1
        else:
            assert agent.agent.slot_allocations == 1  # the send slots were allocated once
    finally:
        agent.bye()


def test_below_four_cores_chunks_in_socket_frames_get_one_decrypt_thread_and_ring_chunks_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = service(tmp_path, staged=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    auto = svc.ops.op_set_data_path(payload=b"").header
    assert auto["workers"] == 0 and svc.plane.pool is None  # no decrypt workers on 2 cores (measured slower)
    assert svc.plane.frame_pool is not None and svc.plane.per_set == 4  # but frames are opened off the receiver
    svc.ops.op_set_data_path(parallel_auth=False, overlap=False, payload=b"")  # the ablation's serial row
    assert svc.plane.pool is None and svc.plane.frame_pool is None and svc.plane.per_set == 2
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    svc.ops.op_set_data_path(payload=b"")
    assert svc.plane.pool is not None and svc.plane.frame_pool is None  # workers open every chunk
    svc.plane.close()


def test_chunks_on_the_tcp_data_port_land_byte_for_byte_with_receiving_overlapped(
        device: tuple[Any, DeviceClient], tmp_path: Path) -> None:
    handle, client = device
    if handle.data_port is None:
        pytest.skip("this device opened no TCP data port")
    client.set_data_path()  # auto: what a run asks for
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "part.txt").write_bytes(os.urandom(600_000))
    agent = Driven(tmp_path / "h")
    length = 500_000
    want = hashlib.sha256(agent.ds.train.read(0, length)).hexdigest()
    try:
        for _ in range(3):
            epoch = client.stats().epoch + 1
            grant = client.handoff(epoch=epoch, offset=0, length=length, chunk_size=CHUNK * 2)
            done = agent.handoff({"epoch": epoch, "session": grant.session_id, "key": grant.provisioning_key.to_wire(),
                                  "window_offset": 0, "chunk_size": CHUNK * 2, "train": [0, length], "val": [0, 0],
                                  "length": length,
                                  "data_endpoint": {"host": handle.data_host, "port": handle.data_port}})
            assert done["bytes"] == length and done["retransmits"] == 0
            closed = client.close_window(epoch=epoch)
            assert closed.complete and closed.bytes == length
            assert client.call("digest", offset=0, length=length)[0]["sha256"] == want
            client.scrub()
    finally:
        agent.bye()
        client.set_data_path(parallel_auth=False, overlap=False)  # the module's device as the other tests had it


def test_a_hand_off_with_a_key_for_no_open_window_is_refused_admission_and_charged_to_nobody(
        device: tuple[Any, DeviceClient], tmp_path: Path) -> None:
    """A HANDOFF whose key names an epoch the device opened no window for (the old key, relabelled): the
    data connection is not admitted, the hand-off fails by name, the refusal is anonymous (no epoch charged),
    and the agent's next hand-off is admitted and completes."""
    handle, client = device
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "part.txt").write_bytes(os.urandom(300_000))
    agent = Driven(tmp_path / "h")
    length, chunk = 200_000, CHUNK * 4

    def header(epoch: int, grant: Any) -> dict[str, Any]:
        return {"epoch": epoch, "session": grant.session_id, "key": grant.provisioning_key.to_wire(), "window_offset": 0,
                "chunk_size": chunk, "train": [0, length], "val": [0, 0], "length": length,
                "data_endpoint": {"path": handle.socket_path}}

    try:
        epoch = client.stats().epoch + 1
        grant = client.handoff(epoch=epoch, offset=0, length=length, chunk_size=chunk)
        agent.handoff(header(epoch, grant))
        assert client.close_window(epoch=epoch).complete
        before = client.stats()
        relabelled = {**header(epoch + 1, grant), "key": {**grant.provisioning_key.to_wire(), "epoch": epoch + 1}}
        write_frame(agent.to_agent, FrameType.HANDOFF, relabelled)
        agent.to_agent.flush()
        answer = read_frame(agent.from_agent)
        assert answer is not None and answer.type is FrameType.ERROR
        while answer is not None and answer.type is FrameType.ACK:
            answer = read_frame(agent.from_agent)
        assert answer is not None and answer.type is FrameType.ERROR
        assert "refused this hand-off" in answer.header["reason"], answer.header
        assert agent.agent._data is None  # the connection (and its ring) went with the failed hand-off
        after = client.stats()
        assert after.counters.get("chunks", 0) == before.counters.get("chunks", 0)  # nothing reached the buffer
        assert after.refused.get("anonymous", 0) == before.refused.get("anonymous", 0) + 1
        assert after.rejected_by_epoch == {} or str(epoch + 1) not in after.rejected_by_epoch
        epoch = after.epoch + 1
        grant = client.handoff(epoch=epoch, offset=0, length=length, chunk_size=chunk)
        done = agent.handoff(header(epoch, grant))
        assert done["bytes"] == length and client.close_window(epoch=epoch).complete
    finally:
        agent.bye()


def test_an_answer_to_a_bind_not_waited_for_must_bind_the_mapped_ring_in_the_shape_and_epoch_asked_for() -> None:
    """``_DataConn.confirm_ring`` in isolation (a connection object with no socket: only its ``awaiting``
    state is used): what an honest device never sends (a new descriptor, another epoch or shape) fails the
    hand-off by name; an answer nobody waits for is dropped, its descriptor closed."""
    from gputravel.agents.holder.dataconn import DataConn, RingOffer
    from gputravel.core.errors import FrameError, GpuTravelError
    from gputravel.core.protocol.holderlink import DataReady
    from gputravel.core.protocol.shmring import RingSpec

    conn = DataConn.__new__(DataConn)  # no socket, no reader thread: confirm_ring reads only ``awaiting``
    spec = RingSpec(7, 8, CHUNK + TAG_LEN)

    def offer(wire: Any, fd: int = -1) -> RingOffer:
        return RingOffer(conn, DataReady.from_wire({"session": "00", "ring": wire}), fd)

    conn.awaiting = spec
    conn.confirm_ring(offer(spec.to_wire()))  # the bind asked for: accepted
    assert conn.awaiting is None
    for wrong, reason in ((RingSpec(6, 8, CHUNK + TAG_LEN).to_wire(), "not RingSpec"),
                          (RingSpec(7, 4, CHUNK + TAG_LEN).to_wire(), "not RingSpec")):
        conn.awaiting = spec
        with pytest.raises(GpuTravelError, match=reason):
            conn.confirm_ring(offer(wrong))
        assert conn.awaiting is None  # one answer per bind: a second one is not awaited
    with pytest.raises(FrameError, match="epoch: expected an integer"):  # unusable: refused as it is read
        offer({"epoch": "x", "slots": 8, "slot_bytes": CHUNK + TAG_LEN})
    for awaited in (spec, None):
        conn.awaiting = awaited
        r, w = os.pipe()
        os.close(w)
        if awaited is None:
            conn.confirm_ring(offer(spec.to_wire(), fd=r))  # nobody waits: dropped
        else:
            with pytest.raises(GpuTravelError, match="new ring"):
                conn.confirm_ring(offer(spec.to_wire(), fd=r))
        with pytest.raises(OSError):
            os.fstat(r)  # the descriptor was closed either way


def _nested_frame(ftype: FrameType, depth: int = 8000) -> bytes:
    """A frame whose header nests ``depth`` lists (raw bytes: no JSON encoder writes one that deep)."""
    from gputravel.core.protocol.frames import MAGIC, PREFIX, VERSION

    header = b'{"e":' + b"[" * depth + b"]" * depth + b"}"
    return PREFIX.pack(MAGIC, VERSION, int(ftype), len(header), 0) + header


def test_a_deeply_nested_header_gets_an_error_reply_and_is_counted_by_the_device(
        device: tuple[Any, DeviceClient], tmp_path: Path) -> None:
    """Issue 24 item 5, on the device: 8,000 nested ``[`` as a first frame, and on an open data connection,
    are each answered with a named ERROR (``frame``) and counted; the device keeps serving (no thread died
    on a RecursionError: the next data connection and the control channel still work)."""
    import socket

    from gputravel.core.protocol import encode_frame

    handle, client = device
    before = client.stats()

    def exchange(*frames: bytes) -> Any:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(20)
            s.connect(handle.socket_path)
            for raw in frames:
                s.sendall(raw)
            stream = s.makefile("rb")
            answers = []
            while (frame := read_frame(stream)) is not None:
                answers.append(frame)
            return answers

    first = exchange(_nested_frame(FrameType.DATA_OPEN))  # before authenticating: refused
    assert [(f.type, f.header["code"]) for f in first] == [(FrameType.ERROR, "frame")]
    assert "header nests deeper than the 32 levels allowed" in first[0].header["reason"]
    from gputravel.core.protocol.holderlink import Admission

    epoch = before.epoch + 1
    grant = client.handoff(epoch=epoch, offset=0, length=CHUNK, chunk_size=CHUNK)
    session = bytes.fromhex(grant.session_id)
    admit = Admission.make(grant.provisioning_key.key, session_id=session, epoch=epoch,
                           holder="h").to_wire()
    opened = encode_frame(FrameType.DATA_OPEN, {"session": session.hex(), "admit": admit})
    later = exchange(opened, _nested_frame(FrameType.CHUNK))  # on an admitted data connection: rejected
    assert [f.type for f in later] == [FrameType.DATA_READY, FrameType.ERROR]
    assert later[1].header["code"] == "frame" and "nests" in later[1].header["reason"]
    after = client.stats()
    assert after.refused.get("frame", 0) == before.refused.get("frame", 0) + 1
    assert after.rejected.get("frame", 0) == before.rejected.get("frame", 0) + 1
    assert after.rejected_by_epoch.get(str(epoch)) == {"frame": 1}  # charged to the window it was admitted for
    client.close_window(epoch=epoch)
    # still serving: a malformed DATA_OPEN (a session that is not hex) is refused by name too
    bad = exchange(encode_frame(FrameType.DATA_OPEN, {"session": ["not", "hex"]}))
    assert bad[0].type is FrameType.ERROR and bad[0].header["code"] == "frame"
    assert client.stats().refused.get("frame", 0) == before.refused.get("frame", 0) + 2
