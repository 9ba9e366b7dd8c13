"""The device service's boundary under hostile input, through its real process and Unix socket.

One emulated device service (``python -m gputravel.core.device``, fault injection on) serves the whole
module. Every test opens its own hand-off with a fresh epoch, speaks the data path with a plain socket
and ``gputravel.core.protocol`` frames, and checks three things: the exact ERROR code on the wire, the
device's ``rejected`` counter, and that the buffer holds what only genuine chunks put there (through the
``digest`` debug op or the ``close_window`` report).
"""

from __future__ import annotations

import hashlib
import json
import random
import socket
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
from helpers import device_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.errors import DeviceError, StaleEpochError, WindowError
from gputravel.core.platform.base import DeviceHandle
from gputravel.core.protocol import (
    MAX_PAYLOAD,
    TAG_LEN,
    DirectionKey,
    Frame,
    FrameType,
    SendState,
    encode_frame,
    read_frame,
)
from gputravel.core.protocol.frames import MAGIC, MAX_HEADER, PREFIX, VERSION
from gputravel.core.protocol.holderlink import Admission
from gputravel.core.training.model import preset
from gputravel.core.training.trainer import TrainSettings

BUFFER = 256 * 1024
KNOWN_CODES = {"frame", "tag", "replay", "stale-epoch", "window"}


def _program() -> bytes:
    model = replace(preset("tiny"), block_size=16, n_layer=1, n_head=2, n_embd=32)
    train = TrainSettings(steps_per_visit=2, batch_size=2, seq_len=16)
    return json.dumps({"program": "gputravel.gpt2/v1", "model": model.to_dict(), "train": train.to_dict()}).encode()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def plaintext(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# --- the rig: one device service, one control session -------------------------------------------
@dataclass
class Window:
    """One open hand-off as a holder sees it: geometry, provisioning key, session."""

    epoch: int
    offset: int
    length: int
    chunk_size: int
    key: DirectionKey
    session_id: bytes

    @property
    def n_chunks(self) -> int:
        return -(-self.length // self.chunk_size)

    def slot(self, seq: int) -> tuple[int, int]:
        off = self.offset + seq * self.chunk_size
        return off, min(self.chunk_size, self.offset + self.length - off)

    def seal(self, seq: int, data: bytes, *, key: DirectionKey | None = None, session_id: bytes | None = None,
             claim_epoch: int | None = None) -> tuple[dict[str, Any], bytes]:
        """Seal chunk ``seq`` of ``data`` (the whole window's plaintext) exactly as the holder agent does."""
        key = key or self.key
        off, n = self.slot(seq)
        lo = off - self.offset
        sender = SendState(key, session_id=session_id or self.session_id, start=seq)
        out = bytearray(n + TAG_LEN)
        assert sender.seal_into(data[lo: lo + n], out, frame_type=FrameType.CHUNK, offset=off, length=n) == seq
        return {"e": key.epoch if claim_epoch is None else claim_epoch, "s": seq, "o": off, "n": n}, bytes(out)


@dataclass
class Rig:
    handle: DeviceHandle
    client: DeviceClient
    epoch: int = 0
    #: the window handed off last: a data connection is admitted for it (a MAC under its key)
    current: Window | None = None

    def call(self, op: str, payload: bytes = b"", **args: Any) -> dict[str, Any]:
        """The raw wire answer (its header), for the checks on what the device sends."""
        return self.client.call(op, payload, **args)[0]

    def next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def rejected(self) -> Counter[str]:
        return Counter(self.client.stats().rejected)

    def digest(self, offset: int, length: int) -> str:
        return self.client.digest(offset=offset, length=length).sha256

    def handoff(self, offset: int, length: int, chunk_size: int, epoch: int | None = None) -> Window:
        epoch = self.next_epoch() if epoch is None else epoch
        grant = self.client.handoff(epoch=epoch, offset=offset, length=length, chunk_size=chunk_size)
        self.current = Window(epoch, offset, length, chunk_size, grant.provisioning_key,
                              bytes.fromhex(grant.session_id))
        return self.current

    def close(self, w: Window) -> dict[str, Any]:
        return self.call("close_window", epoch=w.epoch)

    def close_any(self) -> None:
        status = self.client.window_status()
        if status.open and status.epoch is not None:
            self.client.close_window(epoch=status.epoch)

    def fill(self, w: Window, data: bytes) -> None:
        """Provision the whole window with genuine chunks (all acknowledged)."""
        with DataConn(self) as conn:
            for seq in range(w.n_chunks):
                conn.expect_ack(*w.seal(seq, data))

    def alive(self) -> bool:
        return self.handle.alive()


def connect_client(handle: DeviceHandle, *, retry_s: float = 0.0) -> DeviceClient:
    deadline = time.monotonic() + retry_s
    while True:
        client = DeviceClient(handle.socket_path, anchors=handle.anchors, timeout=30.0)
        try:
            client.connect()
            return client
        except DeviceError:
            client.close()
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with device_process(tmp_path_factory.mktemp("device-state"), buffer_bytes=BUFFER,
                        allow_fault_injection=True) as dev:
        rig = Rig(dev.handle, dev.client)
        rig.client.configure(_program())
        yield rig
        dev.client = rig.client  # the session the tests left open (one opens a new one) shuts the device down


@pytest.fixture(autouse=True)
def _no_window_left_open(rig: Rig) -> Iterator[None]:
    yield
    if rig.alive():
        rig.close_any()


# --- the data path, by hand ----------------------------------------------------------------------
class DataConn:
    """A raw data connection: DATA_OPEN{session, admit} -> DATA_READY, then frames answered one by one.
    It is admitted for ``window`` (default: the rig's last hand-off), as the holder of that window."""

    def __init__(self, rig: Rig, session: str | None = "current", *, expect_ready: bool = True,
                 window: Window | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10.0)
        self.sock.connect(rig.handle.socket_path)
        self.stream = self.sock.makefile("rb")
        sid = rig.client.session_id.hex() if session == "current" else session
        w = window or rig.current
        head: dict[str, Any] = {} if sid is None else {"session": sid}
        if w is not None and sid is not None:
            head["admit"] = Admission.make(w.key.key, session_id=w.session_id, epoch=w.epoch,
                                           holder="holder").to_wire()
        self.sock.sendall(encode_frame(FrameType.DATA_OPEN, head))
        self.first = read_frame(self.stream)
        if expect_ready:
            assert self.first is not None and self.first.type is FrameType.DATA_READY, self.first

    def __enter__(self) -> DataConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.stream.close()
        self.sock.close()

    def read(self) -> Frame | None:
        """The next frame, or None when the service closed the connection."""
        try:
            return read_frame(self.stream)
        except ConnectionResetError:
            return None

    def send(self, ftype: FrameType, header: dict[str, Any], payload: bytes = b"") -> Frame:
        self.sock.sendall(encode_frame(ftype, header, payload))
        frame = self.read()
        assert frame is not None, "the service closed the data connection"
        return frame

    def expect_ack(self, header: dict[str, Any], payload: bytes) -> Frame:
        frame = self.send(FrameType.CHUNK, header, payload)
        assert frame.type is FrameType.ACK, frame
        assert frame.header["s"] == header["s"] and frame.header["e"] == header["e"]
        return frame

    def expect_error(self, header: dict[str, Any], payload: bytes, code: str) -> Frame:
        frame = self.send(FrameType.CHUNK, header, payload)
        assert frame.type is FrameType.ERROR, frame
        assert frame.header["code"] == code, frame.header
        assert json.dumps(frame.header.get("s")) == json.dumps(header.get("s"))  # echoed as sent (NaN too)
        return frame


def flip(data: bytes, i: int) -> bytes:
    b = bytearray(data)
    b[i] ^= 0x01
    return bytes(b)


# --- 1. genuine chunks ---------------------------------------------------------------------------
def test_genuine_chunks_are_acknowledged_and_land_as_plaintext(rig: Rig) -> None:
    before = rig.rejected()
    w = rig.handoff(offset=4096, length=1000, chunk_size=256)  # last chunk is partial (232 bytes)
    data = plaintext(w.length, seed=1)
    with DataConn(rig) as conn:
        for seq in range(w.n_chunks):
            ack = conn.expect_ack(*w.seal(seq, data))
            assert ack.header["contiguous"] == seq + 1
    assert rig.digest(w.offset, w.length) == sha(data)
    report = rig.close(w)
    assert (report["bytes"], report["chunks"], report["expected_chunks"]) == (1000, 4, 4)
    assert report["complete"] is True and report["contiguous"] == 4
    assert rig.rejected() == before


# --- 2. tampered ciphertext ----------------------------------------------------------------------
def test_tampered_ciphertext_is_refused_zeroed_and_does_not_consume_the_seq(rig: Rig) -> None:
    old_w = rig.handoff(offset=8192, length=512, chunk_size=128)
    old = plaintext(old_w.length, seed=2)
    rig.fill(old_w, old)  # earlier content the attack could try to overwrite
    rig.close(old_w)

    device = rig.call("info")["device"]
    before = rig.rejected()
    w = rig.handoff(offset=8192, length=512, chunk_size=128)
    data = plaintext(w.length, seed=3)
    head, ct = w.seal(0, data)
    off, n = w.slot(0)
    with DataConn(rig) as conn:
        conn.expect_error(head, flip(ct, 5), "tag")  # a flipped ciphertext bit flips that plaintext bit
        assert rig.rejected() - before == Counter({"tag": 1})
        # No unauthenticated plaintext stays behind: on the CPU path the range is zeroed, on the CUDA
        # path it is decrypted into staging memory and the buffer keeps its old content.
        got = rig.digest(off, n)
        assert got not in (sha(flip(data[:n], 5)), sha(data[:n]))
        if device == "cpu":
            assert got == sha(bytes(n))
        else:
            assert got in (sha(bytes(n)), sha(old[:n]))

        conn.expect_error(head, flip(ct, len(ct) - 1), "tag")  # tampered tag
        assert rig.rejected() - before == Counter({"tag": 2})

        for seq in range(w.n_chunks):  # seq 0 was not consumed by the failures
            conn.expect_ack(*w.seal(seq, data))
    assert rig.digest(w.offset, w.length) == sha(data)
    report = rig.close(w)
    assert report["complete"] is True and report["chunks"] == 4 and report["bytes"] == 512
    assert rig.rejected() - before == Counter({"tag": 2})


# --- 3. tampered AAD ------------------------------------------------------------------------------
def test_tampered_aad_header_is_refused(rig: Rig) -> None:
    """Moving a chunk to another legal slot:

    * keeping its ``s`` but pointing ``o`` (and ``n``) at another slot is ``window``: the device
      requires chunk ``s`` at exactly ``offset + s * chunk_size`` before any cryptography;
    * moving ``s`` too, so the geometry is consistent, is ``tag``: seq, offset and length are in the
      AAD, and seq is the nonce, so the tag no longer verifies (and slot 2 is not consumed).
    Changing ``e`` is ``stale-epoch``: only the open window's epoch has a key.
    """
    before = rig.rejected()
    w = rig.handoff(offset=12288, length=500, chunk_size=128)  # slots 0..2 of 128 bytes, slot 3 of 116
    data = plaintext(w.length, seed=4)
    head, ct = w.seal(1, data)
    with DataConn(rig) as conn:
        o2, n2 = w.slot(2)
        conn.expect_error({**head, "o": o2}, ct, "window")
        o3, n3 = w.slot(3)
        conn.expect_error({**head, "o": o3, "n": n3}, ct, "window")
        conn.expect_error({**head, "n": n3}, ct, "window")
        assert rig.rejected() - before == Counter({"window": 3})

        conn.expect_error({**head, "s": 2, "o": o2, "n": n2}, ct, "tag")
        assert rig.rejected() - before == Counter({"window": 3, "tag": 1})

        conn.expect_error({**head, "e": w.epoch + 1}, ct, "stale-epoch")
        conn.expect_error({**head, "e": w.epoch - 1}, ct, "stale-epoch")
        assert rig.rejected() - before == Counter({"window": 3, "tag": 1, "stale-epoch": 2})

        for seq in range(w.n_chunks):  # neither slot 1 nor slot 2 was consumed
            conn.expect_ack(*w.seal(seq, data))
    assert rig.digest(w.offset, w.length) == sha(data)
    report = rig.close(w)
    assert report["complete"] is True and report["bytes"] == 500


# --- 4. replay -------------------------------------------------------------------------------------
def test_replayed_chunk_is_refused(rig: Rig) -> None:
    before = rig.rejected()
    w = rig.handoff(offset=16384, length=384, chunk_size=128)
    data = plaintext(w.length, seed=5)
    with DataConn(rig) as conn:
        first = w.seal(0, data)
        conn.expect_ack(*first)
        conn.expect_error(*first, "replay")
        assert rig.rejected() - before == Counter({"replay": 1})
        conn.expect_ack(*w.seal(1, data))
        conn.expect_ack(*w.seal(2, data))
        conn.expect_error(*first, "replay")
    assert rig.rejected() - before == Counter({"replay": 2})
    assert rig.digest(w.offset, w.length) == sha(data)
    report = rig.close(w)
    assert report["chunks"] == 3 and report["bytes"] == 384 and report["complete"] is True


# --- 5. reordering -------------------------------------------------------------------------------
def test_reorder_inside_the_replay_window_is_accepted_and_far_behind_is_refused(rig: Rig) -> None:
    before = rig.rejected()
    w = rig.handoff(offset=65536, length=4200 * 16, chunk_size=16)  # 4200 chunks > the 4096-chunk window
    data = plaintext(w.length, seed=6)
    with DataConn(rig) as conn:
        conn.expect_ack(*w.seal(4100, data))
        conn.expect_ack(*w.seal(10, data))  # 4090 behind: inside the window
        conn.expect_ack(*w.seal(5, data))  # 4095 behind: the window's last slot
        conn.expect_error(*w.seal(4, data), "replay")  # 4096 behind: past the back edge
        conn.expect_error(*w.seal(0, data), "replay")
        conn.expect_ack(*w.seal(4199, data))  # the window slides on
        conn.expect_error(*w.seal(10, data), "replay")
    assert rig.rejected() - before == Counter({"replay": 3})
    for seq in (4100, 10, 5, 4199):
        off, n = w.slot(seq)
        assert rig.digest(off, n) == sha(data[off - w.offset: off - w.offset + n])
    report = rig.close(w)
    assert report["chunks"] == 4 and report["bytes"] == 64 and report["complete"] is False
    assert report["contiguous"] == 0


# --- 6. stale epoch --------------------------------------------------------------------------------
def test_a_closed_epochs_key_is_dead(rig: Rig) -> None:
    old = rig.handoff(offset=20480, length=512, chunk_size=128)
    data = plaintext(old.length, seed=7)
    before = rig.rejected()
    with DataConn(rig) as conn:
        conn.expect_ack(*old.seal(0, data))
        rig.close(old)
        conn.expect_error(*old.seal(1, data), "stale-epoch")  # no window open at all
        assert rig.rejected() - before == Counter({"stale-epoch": 1})
        with pytest.raises(StaleEpochError):
            rig.close(old)
        with pytest.raises(StaleEpochError):  # an epoch is never reopened
            rig.handoff(offset=20480, length=512, chunk_size=128, epoch=old.epoch)
        refused = DataConn(rig, window=old, expect_ready=False)  # a new connection for the dead window
        assert refused.first is not None and refused.first.header["code"] == "stale-epoch"
        refused.close()

        new = rig.handoff(offset=20480, length=512, chunk_size=128)
        assert new.epoch == old.epoch + 1 and new.key.fingerprint != old.key.fingerprint
        conn.expect_error(*old.seal(1, data), "stale-epoch")  # not admitted for the new window: refused
        readmit = Admission.make(new.key.key, session_id=new.session_id, epoch=new.epoch, holder="holder")
        assert conn.send(FrameType.DATA_OPEN, {"session": new.session_id.hex(),
                                               "admit": readmit.to_wire()}).type is FrameType.DATA_READY
        conn.expect_error(*old.seal(1, data), "stale-epoch")  # the old key, honestly labelled
        conn.expect_error(*old.seal(1, data, claim_epoch=new.epoch), "tag")  # the old key, claiming E+1
        relabelled = replace(old.key, epoch=new.epoch)  # the old key material with E+1 in its AAD
        conn.expect_error(*new.seal(1, data, key=relabelled), "tag")
        # (the new connection for the dead window is charged to it too: its credential proves its holder)
        assert rig.rejected() - before == Counter({"stale-epoch": 4, "tag": 2})

        fresh = plaintext(new.length, seed=8)
        for seq in range(new.n_chunks):  # nothing was consumed in the new window
            conn.expect_ack(*new.seal(seq, fresh))
    assert rig.digest(new.offset, new.length) == sha(fresh)
    report = rig.close(new)
    assert report["complete"] is True and report["chunks"] == 4


# --- 7. writes outside the window ------------------------------------------------------------------
def test_writes_outside_the_window_are_refused(rig: Rig) -> None:
    rig.fill(rig.handoff(offset=0, length=BUFFER, chunk_size=65536), plaintext(BUFFER, seed=9))
    rig.close_any()
    outside = rig.digest(0, 24576), rig.digest(25600, BUFFER - 25600)

    before = rig.rejected()
    w = rig.handoff(offset=24576, length=1024, chunk_size=256)
    data = plaintext(w.length, seed=10)
    _, ct = w.seal(0, data)
    end = w.offset + w.length
    with DataConn(rig) as conn:
        conn.expect_error({"e": w.epoch, "s": 4, "o": end, "n": 256}, ct, "window")  # beyond the window's end
        conn.expect_error({"e": w.epoch, "s": 0, "o": 0, "n": 256}, ct, "window")  # before the window
        conn.expect_error({"e": w.epoch, "s": -1, "o": w.offset - 256, "n": 256}, ct, "window")  # negative seq
        conn.expect_error({"e": w.epoch, "s": 0, "o": -256, "n": 256}, ct, "window")  # negative offset
        conn.expect_error({"e": w.epoch, "s": 3, "o": w.offset + 768, "n": 512}, ct, "window")  # past the end
        conn.expect_error({"e": w.epoch, "s": 0, "o": w.offset, "n": 0}, ct[:TAG_LEN], "window")  # empty
        conn.expect_error({"e": w.epoch, "s": 10**30, "o": BUFFER + 10**12, "n": 256}, ct, "window")
        assert rig.rejected() - before == Counter({"window": 7})

        # hand-off windows outside the buffer are typed errors; they change nothing
        for offset, length in ((BUFFER - 100, 200), (-1, 100), (0, BUFFER + 1), (0, 0), (BUFFER, 1)):
            with pytest.raises(WindowError):
                rig.handoff(offset=offset, length=length, chunk_size=64)
        with pytest.raises(DeviceError):
            rig.handoff(offset=0, length=64, chunk_size=0)
        assert rig.call("window_status")["epoch"] == w.epoch  # the open window survived the refusals

        for seq in range(w.n_chunks):
            conn.expect_ack(*w.seal(seq, data))
    assert rig.digest(w.offset, w.length) == sha(data)
    assert (rig.digest(0, 24576), rig.digest(25600, BUFFER - 25600)) == outside
    assert rig.close(w)["complete"] is True
    assert rig.rejected() - before == Counter({"window": 7})


# --- 8. oversized and truncated frames --------------------------------------------------------------
def test_oversized_frame_is_refused_and_the_connection_closes(rig: Rig) -> None:
    rig.handoff(offset=28672, length=256, chunk_size=128)  # the connections are admitted for it
    before = rig.rejected()
    for prefix in (PREFIX.pack(MAGIC, VERSION, int(FrameType.CHUNK), 2, MAX_PAYLOAD + 1),
                   PREFIX.pack(MAGIC, VERSION, int(FrameType.CHUNK), MAX_HEADER + 1, 16)):
        with DataConn(rig) as conn:
            conn.sock.sendall(prefix)  # only the prefix: the service must not wait for 16 MiB
            err = conn.read()
            assert err is not None and err.type is FrameType.ERROR and err.header["code"] == "frame", err
            assert conn.read() is None  # and it hangs up
    assert rig.rejected() - before == Counter({"frame": 2})
    assert rig.alive()


def test_truncated_frame_is_counted_and_the_service_survives(rig: Rig) -> None:
    w = rig.handoff(offset=28672, length=256, chunk_size=128)
    data = plaintext(w.length, seed=11)
    before = rig.rejected()
    whole = encode_frame(FrameType.CHUNK, *w.seal(0, data))
    for cut in (len(whole) - 5, 3):  # inside the payload; inside the prefix
        with DataConn(rig) as conn:
            conn.sock.sendall(whole[:cut])
            conn.sock.shutdown(socket.SHUT_WR)  # the peer goes away mid-frame
            err = conn.read()
            assert err is not None and err.type is FrameType.ERROR and err.header["code"] == "frame", err
            assert conn.read() is None
    assert rig.rejected() - before == Counter({"frame": 2})

    with DataConn(rig) as conn:  # a new data connection still works, nothing was consumed
        # an unexpected frame type is refused (counted) but the link stays
        assert conn.send(FrameType.SEALED, {}).header["code"] == "frame"
        assert rig.rejected() - before == Counter({"frame": 3})
        assert conn.send(FrameType.PING, {"t": 1}).type is FrameType.PONG
        for seq in range(w.n_chunks):
            conn.expect_ack(*w.seal(seq, data))
    assert rig.digest(w.offset, w.length) == sha(data)
    assert rig.close(w)["complete"] is True


# --- 9. data connection for another session -----------------------------------------------------------
@pytest.mark.parametrize(("session", "code"), [("00" * 16, "stale-epoch"), ("not-hex", "frame"), (None, "frame")])
def test_data_open_with_a_wrong_session_is_refused(rig: Rig, session: str | None, code: str) -> None:
    """Another session's id is a stale one; a session field that is no id at all is a malformed DATA_OPEN."""
    before = rig.rejected()
    conn = DataConn(rig, session, expect_ready=False)
    try:
        assert conn.first is not None and conn.first.type is FrameType.ERROR, conn.first
        assert conn.first.header["code"] == code
        assert conn.read() is None
    finally:
        conn.close()
    # a refused connection is not a refused chunk: the counter is untouched
    assert rig.rejected() == before


def test_a_data_connection_must_start_with_data_open(rig: Rig) -> None:
    w = rig.handoff(offset=32768, length=128, chunk_size=128)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10.0)
    sock.connect(rig.handle.socket_path)
    try:
        sock.sendall(encode_frame(FrameType.CHUNK, *w.seal(0, plaintext(128, seed=12))))
        stream = sock.makefile("rb")
        err = read_frame(stream)
        assert err is not None and err.type is FrameType.ERROR and err.header["code"] == "frame"
        stream.close()
    finally:
        sock.close()
    assert rig.call("window_status")["chunks"] == 0


# --- 10. one control session at a time ---------------------------------------------------------------
def test_second_control_connection_is_refused_and_a_new_session_kills_old_keys(rig: Rig) -> None:
    with pytest.raises(DeviceError, match="control session is active"):
        connect_client(rig.handle)

    w_old = rig.handoff(offset=36864, length=512, chunk_size=128)
    data = plaintext(w_old.length, seed=13)
    old_session = rig.client.session_id
    old_conn = DataConn(rig)
    try:
        old_conn.expect_ack(*w_old.seal(0, data))
        rig.client.close()
        rig.client = connect_client(rig.handle, retry_s=10.0)  # the first has gone: a new session opens
        assert rig.client.session_id != old_session
        before = rig.rejected()

        # the same epoch and geometry in the new session: the old key is still useless
        w_new = rig.handoff(offset=36864, length=512, chunk_size=128, epoch=w_old.epoch)
        assert w_new.key.fingerprint != w_old.key.fingerprint
        old_conn.expect_error(*w_old.seal(1, data), "tag")  # over the old session's data connection

        refused = DataConn(rig, old_session.hex(), expect_ready=False)
        try:
            assert refused.first is not None and refused.first.type is FrameType.ERROR
            assert refused.first.header["code"] == "stale-epoch"
        finally:
            refused.close()

        fresh = plaintext(w_new.length, seed=14)
        with DataConn(rig) as conn:
            conn.expect_error(*w_old.seal(1, data), "tag")
            conn.expect_error(*w_new.seal(1, data, key=w_old.key, session_id=old_session), "tag")
            assert rig.rejected() - before == Counter({"tag": 3})
            for seq in range(w_new.n_chunks):
                conn.expect_ack(*w_new.seal(seq, fresh))
    finally:
        old_conn.close()
    assert rig.digest(w_new.offset, w_new.length) == sha(fresh)
    assert rig.close(w_new)["complete"] is True
    assert rig.rejected() - before == Counter({"tag": 3})


# --- 11. fault injection ------------------------------------------------------------------------------------
def test_tamper_model_changes_the_measured_model_digest(rig: Rig) -> None:
    first = rig.call("measure")
    assert rig.call("tamper", region="model") == {"tampered": "model"}
    second = rig.call("measure")
    assert second["model"] != first["model"] and second["code"] == first["code"]
    assert second["measurement"] != first["measurement"]
    assert rig.call("tamper", region="code") == {"tampered": "code"}
    third = rig.call("measure")
    assert third["code"] != second["code"] and third["model"] == second["model"]
    with pytest.raises(DeviceError, match="unknown region"):
        rig.call("tamper", region="buffer")


def test_tamper_and_digest_are_refused_without_fault_injection(tmp_path_factory: pytest.TempPathFactory) -> None:
    with device_process(tmp_path_factory.mktemp("plain-device"), buffer_bytes=4096) as dev:
        client = dev.client
        client.call("configure", _program())
        measured = client.call("measure")[0]
        for op, args in (("tamper", {"region": "model"}), ("tamper", {"region": "code"}),
                         ("digest", {"offset": 0, "length": 16})):
            with pytest.raises(DeviceError, match="fault injection is disabled"):
                client.call(op, **args)
        again = client.call("measure")[0]
        assert {k: again[k] for k in ("code", "model", "measurement")} == \
            {k: measured[k] for k in ("code", "model", "measurement")}
        assert again["digest_s"] >= 0.0  # the time the device spent hashing (0: this generation's digest reused)


# --- 12. scrub ---------------------------------------------------------------------------------------------------
def test_scrub_zeroes_the_whole_buffer_and_refuses_while_a_window_is_open(rig: Rig) -> None:
    before = rig.rejected()
    w = rig.handoff(offset=40960, length=4096, chunk_size=1024)
    rig.fill(w, plaintext(w.length, seed=15))
    with pytest.raises(DeviceError, match="window is open"):
        rig.call("scrub")
    assert rig.digest(w.offset, w.length) == sha(plaintext(w.length, seed=15))  # the refusal changed nothing
    rig.close(w)
    assert rig.digest(0, BUFFER) != sha(bytes(BUFFER))

    report = rig.call("scrub")
    assert report["verified"] is True and report["bytes"] == BUFFER
    assert rig.digest(0, BUFFER) == sha(bytes(BUFFER))
    assert rig.rejected() == before


# --- 13. fuzzing the chunk header ----------------------------------------------------------------------------
def test_random_chunks_are_all_refused_and_change_nothing(rig: Rig) -> None:
    """Random (epoch, seq, offset, length, payload) against a half-provisioned window: every chunk
    gets an ERROR of a known code, none an ACK, the service stays up, the window is unchanged.

    The buffer is scrubbed first so the unprovisioned half is zeros: a chunk that reaches AES-GCM in a
    free slot fails its tag, and the failure zeroes that slot, which must leave it as it was."""
    rig.call("scrub")
    w = rig.handoff(offset=49152, length=8 * 32 - 7, chunk_size=32)  # 8 slots, the last one 25 bytes
    data = plaintext(w.length, seed=16)
    conn = DataConn(rig)
    for seq in range(4):
        conn.expect_ack(*w.seal(seq, data))
    window_digest = rig.digest(w.offset, w.length)
    before = rig.rejected()
    tally: Counter[str] = Counter()
    state = {"conn": conn}

    junk = st.one_of(st.none(), st.booleans(), st.text(max_size=4), st.floats(),
                     st.integers(-(2**70), 2**70), st.lists(st.integers(), max_size=2))
    near = st.integers(-1, w.epoch + 2)

    @st.composite
    def chunks(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
        mode = draw(st.sampled_from(["slot"] * 5 + ["geometry"] * 3 + ["junk"] * 2))
        if mode == "slot":  # a real slot of the window, right-sized: reaches the replay check or AES-GCM
            e = draw(st.one_of(st.just(w.epoch), st.just(w.epoch), near))
            s = draw(st.integers(0, w.n_chunks - 1))
            o, n = w.slot(s)
            header: dict[str, Any] = {"e": e, "s": s, "o": o, "n": n}
        elif mode == "geometry":  # integers anywhere around the window
            header = {"e": draw(st.one_of(st.just(w.epoch), near)), "s": draw(st.integers(-2, w.n_chunks + 2)),
                      "o": draw(st.integers(w.offset - 64, w.offset + w.length + 64)), "n": draw(st.integers(-1, 64))}
        else:  # anything, with fields missing
            header = {k: draw(st.one_of(st.integers(-2, 2**64), junk)) for k in "esno"}
            for k in draw(st.lists(st.sampled_from("esno"), max_size=2)):
                header.pop(k, None)
        hn = header.get("n")
        if type(hn) is int and 0 <= hn <= 64 and draw(st.integers(0, 3)):
            size = hn + TAG_LEN
        else:
            size = draw(st.integers(0, 128))
        return header, draw(st.binary(min_size=size, max_size=size))

    @settings(max_examples=50, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(chunk=chunks())
    def fuzz(chunk: tuple[dict[str, Any], bytes]) -> None:
        header, payload = chunk
        c = state["conn"]
        c.sock.sendall(encode_frame(FrameType.CHUNK, header, payload))
        frame = c.read()
        if frame is None:  # tolerated only after an ERROR; the next example gets a new connection
            c.close()
            state["conn"] = DataConn(rig)
            raise AssertionError(f"the service hung up without answering {header}")
        assert frame.type is FrameType.ERROR, (header, frame)
        assert frame.header["code"] in KNOWN_CODES, (header, frame.header)
        tally[frame.header["code"]] += 1

    try:
        fuzz()
    finally:
        state["conn"].close()
    assert rig.alive()
    assert rig.rejected() - before == tally
    assert 0 < tally.total() <= 50
    assert rig.digest(w.offset, w.length) == window_digest
    lo = 4 * w.chunk_size
    assert window_digest == sha(data[:lo] + bytes(w.length - lo))
    status = rig.call("window_status")
    assert status["chunks"] == 4 and status["bytes"] == 4 * 32
    report = rig.close(w)
    assert report["chunks"] == 4 and report["complete"] is False


@pytest.mark.parametrize("bad", [None, "x", [1], {"a": 1}, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field", ["e", "s", "o", "n"])
def test_malformed_header_values_are_frame_errors(rig: Rig, field: str, bad: Any) -> None:
    w = rig.handoff(offset=53248, length=128, chunk_size=128)
    head, ct = w.seal(0, plaintext(128, seed=17))
    before = rig.rejected()
    with DataConn(rig) as conn:
        conn.expect_error({**head, field: bad} if bad is not None else {k: v for k, v in head.items() if k != field},
                          ct, "frame")
        assert rig.rejected() - before == Counter({"frame": 1})
        conn.expect_ack(head, ct)


@pytest.mark.parametrize("convert", [str, float, bool], ids=["numeric-string", "float", "bool"])
@pytest.mark.parametrize("field", ["e", "s", "o", "n"])
def test_header_numbers_must_be_json_integers(rig: Rig, field: str, convert: Any) -> None:
    """A right value in the wrong type ("0" for 0, 128.0 for 128) is refused, not coerced."""
    w = rig.handoff(offset=53248, length=128, chunk_size=128)
    head, ct = w.seal(0, plaintext(128, seed=19))
    before = rig.rejected()
    with DataConn(rig) as conn:
        conn.expect_error({**head, field: convert(head[field])}, ct, "frame")
        assert rig.rejected() - before == Counter({"frame": 1})
        conn.expect_ack(head, ct)


# --- 14. fuzzing the hand-off window itself ----------------------------------------------------------------------
FUZZ_SEED = 0x5EED_0614
_JUNK: tuple[Any, ...] = (None, "0", "x", 1.5, True, False, [1], {"a": 1}, float("nan"), float("inf"))


def _expected_code(header: dict[str, Any], payload: bytes, w: Window, accepted: set[int],
                   dead_tags: dict[int, set[bytes]], genuine: bool) -> str:
    """What the device must answer, by the documented order of its checks: types (frame), epoch (stale-epoch,
    or replay for a buried window's accepted chunk), geometry (window), size (frame), replay, then AES-GCM
    (ack only for an unaltered chunk of this window, else tag)."""
    fields = [header.get(k) for k in ("e", "s", "o", "n")]
    if not all(type(v) is int for v in fields):
        return "frame"
    e, s, o, n = fields
    if e != w.epoch:
        return "replay" if len(payload) >= TAG_LEN and payload[-TAG_LEN:] in dead_tags.get(e, set()) else "stale-epoch"
    if s < 0 or n <= 0 or o < w.offset or o + n > w.offset + w.length or (o, n) != w.slot(s):
        return "window"
    if len(payload) != n + TAG_LEN:
        return "frame"
    if s in accepted:
        return "replay"
    return "ack" if genuine else "tag"


def _random_window(rng: random.Random) -> tuple[int, int, int]:
    chunk_size = rng.choice([1, 2, 3, 16, 17, 64, 100, 255, 256, 1000, 1024, 4096, 8191, rng.randint(1, 5000)])
    n = rng.randint(1, 24) if rng.random() < 0.8 else rng.randint(25, 120)
    length = min(BUFFER, rng.randint((n - 1) * chunk_size + 1, n * chunk_size))
    where = rng.random()
    offset = 0 if where < 0.15 else BUFFER - length if where < 0.3 else rng.randint(0, BUFFER - length)
    return offset, length, chunk_size


def test_random_windows_with_hostile_chunks_never_write_outside_the_window(rig: Rig) -> None:
    """Seeded rounds (at least 3, then up to 300 within about 4 s): each opens a hand-off at a random offset, length and chunk size, then sends
    a random mix of genuine, replayed, tampered, misrouted (other offset, other slot, other epoch, old key,
    other session), wrongly sized and malformed chunks. Every answer is the one the check order implies;
    the bytes outside the window keep their digest; an accepted chunk lands exactly in its slot and a slot
    no chunk was accepted for holds its old bytes or zeros (a failed tag zeroes it on the CPU path). The
    window is then completed and the whole buffer must equal the test's model of it."""
    rng = random.Random(FUZZ_SEED)
    rig.close_any()
    w0 = rig.handoff(offset=0, length=BUFFER, chunk_size=65536)
    model = bytearray(plaintext(BUFFER, seed=FUZZ_SEED))
    dead_tags: dict[int, set[bytes]] = {}
    rig.fill(w0, bytes(model))
    rig.close(w0)
    dead_tags[w0.epoch] = {w0.seal(s, bytes(model))[1][-TAG_LEN:] for s in range(w0.n_chunks)}
    assert rig.digest(0, BUFFER) == sha(bytes(model))
    prev, prev_data = w0, bytes(model)

    started_at = time.monotonic()
    rounds = 0
    codes: Counter[str] = Counter()  # every answer the rounds got, for the coverage check at the end
    while rounds < 3 or (rounds < 300 and time.monotonic() - started_at < 4.0):
        rounds += 1
        offset, length, chunk_size = _random_window(rng)
        end = offset + length
        before_outside = (rig.digest(0, offset) if offset else None, rig.digest(end, BUFFER - end) if end < BUFFER else None)
        assert before_outside == (sha(bytes(model[:offset])) if offset else None,
                                  sha(bytes(model[end:])) if end < BUFFER else None)
        before = rig.rejected()
        w = rig.handoff(offset=offset, length=length, chunk_size=chunk_size)
        ctx = f"seed {FUZZ_SEED:#x} round {rounds}: window [{offset}, {end}) chunk {chunk_size}"
        data = rng.randbytes(length)
        old = {s: bytes(model[w.slot(s)[0]: sum(w.slot(s))]) for s in range(w.n_chunks)}
        may_hold = {s: {sha(old[s])} for s in range(w.n_chunks)}  # what each slot may hold now
        accepted: set[int] = set()
        tally: Counter[str] = Counter()

        def any_slot(lo: int = 0, hi: int = 0) -> int:
            return rng.randint(lo, w.n_chunks - 1 + hi)  # noqa: B023 - w is this round's window

        with DataConn(rig) as conn:
            for _ in range(rng.randint(10, 40)):
                s = any_slot()
                head, ct = w.seal(s, data)
                genuine = False
                kind = rng.choice(["genuine"] * 4 + ["tamper", "offset", "moved", "geometry", "malformed", "size",
                                                     "old-window", "old-key", "session", "epoch"])
                if kind == "genuine":  # a new slot, or a replay of an accepted one
                    genuine = True
                elif kind == "tamper":
                    ct = flip(ct, rng.randrange(len(ct)))
                elif kind == "offset":  # the chunk pointed at bytes that are not its slot, in the buffer or not
                    o = rng.choice([rng.randint(offset - 2 * chunk_size, end + 2 * chunk_size), -1, -chunk_size,
                                    0, BUFFER - 1, BUFFER, BUFFER + 10**12, 2**63, 10**30])
                    n = rng.choice([head["n"], head["n"], rng.randint(-1, chunk_size + 2), BUFFER, 10**30])
                    if (o, n) == (head["o"], head["n"]):
                        o += 1
                    head = {**head, "o": o, "n": n}
                elif kind == "moved":  # another slot's consistent geometry, this slot's ciphertext
                    s2 = any_slot(-1, 1)
                    o, n = w.slot(s2)
                    head = {**head, "s": s2, "o": o, "n": n}
                    genuine = s2 == s
                elif kind == "geometry":  # integers anywhere around the window, random bytes
                    head = {"e": rng.choice([w.epoch, w.epoch, w.epoch - 1, w.epoch + 1, 0, -1]),
                            "s": any_slot(-2, 2), "o": rng.randint(offset - 64, end + 64),
                            "n": rng.randint(-1, chunk_size + 1)}
                    size = head["n"] + TAG_LEN if head["n"] >= 0 and rng.random() < 0.7 else rng.randint(0, 64)
                    ct = rng.randbytes(size)
                elif kind == "malformed":
                    field = rng.choice("esno")
                    bad = rng.choice(_JUNK + (str(head[field]), float(head[field])))
                    head = {k: v for k, v in head.items() if k != field} if bad is None else {**head, field: bad}
                elif kind == "size":  # a payload one or more bytes short or long
                    ct = ct[:rng.randrange(len(ct))] if rng.random() < 0.5 else ct + rng.randbytes(rng.randint(1, 9))
                elif kind == "old-window":  # a chunk of the last (closed) window: as sent, or relabelled
                    head, ct = prev.seal(rng.randrange(prev.n_chunks), prev_data)
                    head = {**head, "e": rng.choice([prev.epoch, w.epoch, w.epoch + 1])}
                elif kind == "old-key":  # the last window's key sealing this very slot
                    head, ct = w.seal(s, data, key=prev.key, session_id=prev.session_id,
                                      claim_epoch=rng.choice([prev.epoch, w.epoch]))
                elif kind == "session":
                    head, ct = w.seal(s, data, session_id=rng.randbytes(16))
                else:  # an epoch no window has, or a buried one
                    head = {**head, "e": rng.choice([w.epoch + rng.randint(1, 5), w.epoch - 1, 0, -5, 2**64])}
                want = _expected_code(head, ct, w, accepted, dead_tags, genuine)
                if want == "ack":
                    conn.expect_ack(head, ct)
                    accepted.add(head["s"])
                    may_hold[head["s"]] = {sha(data[w.slot(head["s"])[0] - offset: sum(w.slot(head["s"])) - offset])}
                else:
                    frame = conn.send(FrameType.CHUNK, head, ct)
                    assert frame.type is FrameType.ERROR and frame.header["code"] == want, (ctx, kind, head, frame)
                    tally[want] += 1
                    if want == "tag":  # the failed slot may have been zeroed, and nothing else
                        may_hold[head["s"]].add(sha(bytes(w.slot(head["s"])[1])))

            assert rig.rejected() - before == tally, ctx
            after_outside = (rig.digest(0, offset) if offset else None,
                             rig.digest(end, BUFFER - end) if end < BUFFER else None)
            assert after_outside == before_outside, f"{ctx}: the device wrote outside the window"
            for s in range(w.n_chunks):
                assert rig.digest(*w.slot(s)) in may_hold[s], f"{ctx}: slot {s} (accepted: {s in accepted})"

            for s in sorted(set(range(w.n_chunks)) - accepted):  # complete the window
                conn.expect_ack(*w.seal(s, data))
        report = rig.close(w)
        assert report["complete"] is True and report["chunks"] == w.n_chunks and report["bytes"] == length, ctx
        model[offset:end] = data
        assert rig.digest(0, BUFFER) == sha(bytes(model)), ctx
        dead_tags[w.epoch] = {w.seal(s, data)[1][-TAG_LEN:] for s in range(w.n_chunks)}
        prev, prev_data = w, data
        codes.update(tally)
        codes["ack"] += len(accepted)
    assert rig.alive() and rounds >= 3
    assert all(codes[c] for c in ("ack", "frame", "tag", "replay", "stale-epoch", "window")), codes


def test_aes_rate_is_measured_inside_the_device_process_and_refuses_bad_sizes(rig: Rig) -> None:
    head = rig.call("aes_rate", chunk=64 * 1024, seconds=0.05)
    assert head["chunk"] == 64 * 1024 and head["bytes_per_s"] > 0 and head["threads"] >= 1
    for bad in (0, 8, 1 << 30, "65536", 65536.0):
        with pytest.raises(DeviceError, match="aes_rate needs an integer chunk"):
            rig.call("aes_rate", chunk=bad)


# --- the operation table ---------------------------------------------------------------------------
def test_one_operation_table_answers_every_op_and_refuses_any_other_name(rig: Rig, tmp_path: Any) -> None:
    from gputravel.core.device.service import load_service
    from gputravel.core.protocol.devicelink import Op

    service = load_service(tmp_path / "state", buffer_bytes=4096, device="cpu")
    assert set(service.operations) == set(Op)
    parts = (service.ops, service.windows, service.model, service.streams)  # each handler is one part's own
    assert all(any(getattr(fn, "__self__", None) is part for part in parts) for fn in service.operations.values())
    with pytest.raises(DeviceError, match="unknown operation 'op_info'"):
        rig.call("op_info")
    # the typed client reads the same wire answers
    assert rig.client.info().buffer_bytes == rig.call("info")["buffer_bytes"] == BUFFER
    # the device keeps freed memory (core/allocator.py), read back from its heap after the module's chunks and
    # windows: its threads (control, data plane) all allocated from the one heap (where the C library is glibc)
    info = rig.client.info()
    if info.malloc_arenas:
        assert info.allocator == "keep-freed" and info.malloc_arenas == 1, info.allocator_reason
    assert rig.client.tamper(region="code") == "code"


def test_the_model_is_hashed_again_only_after_a_change_or_a_hand_off(rig: Rig) -> None:
    def digests() -> int:
        return rig.client.stats().counters.get("model_digests", 0)

    rig.client.measure()
    before = digests()
    first = rig.client.measure()
    assert digests() == before  # nothing changed: the digest is reused
    w = rig.handoff(offset=0, length=4096, chunk_size=4096)
    rig.close(w)
    assert first.digest_s == 0.0  # reused: no time spent hashing
    again = rig.client.measure()
    assert (again.model, again.measurement) == (first.model, first.measurement) and digests() == before + 1
    assert again.digest_s > 0.0  # a key was out: hashed afresh, and the time it took is reported
    rig.client.tamper(region="model")
    assert rig.client.measure().model != first.model and digests() == before + 2
