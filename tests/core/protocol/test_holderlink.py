"""core.protocol.holderlink: the typed messages of the holder link and the data connection.

Each message survives its own wire form; each ``from_wire`` refuses, as ``FrameError``, what a hostile or
broken peer could send (a missing field, a wrong type, a number out of range, a key that does not fit);
no message's ``repr`` or ``str`` shows key bytes; fields a peer adds later are ignored.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gputravel.core.protocol import Direction, FrameError, provisioning_key
from gputravel.core.protocol.holderlink import (
    MAX_CHUNK,
    Bye,
    DataEndpoint,
    DataOpen,
    DataReady,
    Done,
    Handoff,
    Hello,
    Progress,
    ProvisioningKey,
    Refusal,
)
from gputravel.core.protocol.shmring import RingSpec

KEY = ProvisioningKey.of(provisioning_key(bytes(range(32)), b"S" * 16, epoch=5, offset=0, length=4096,
                                          direction=Direction.HOLDER_TO_DEVICE))


def handoff(**kw: Any) -> Handoff:
    base: dict[str, Any] = {"epoch": 5, "session_id": "ab" * 16, "key": KEY, "window_offset": 0, "chunk_size": 1024,
                            "train": (0, 3000), "val": (100, 1096), "length": 4096,
                            "data_endpoint": DataEndpoint(path="/run/dev.sock"), "ledger_head": "7:abc"}
    return Handoff(**{**base, **kw})


MESSAGES = [
    Hello(name="alice", version="1", fmt="u16", train_bytes=10, val_bytes=2, files=1, agent_sha256="0f" * 32, pid=9),
    Progress(seq=7, chunks=3),
    Refusal(code="tag", reason="bad tag", seq=4),
    Refusal(code="stale-epoch", reason="no window", ring=True),
    Done(epoch=5, chunks=4, nbytes=4096, retransmits=1, stages={"read_seal_s": 0.5, "wait_s": 0.25}),
    Bye(ledger_head="12:ff"),
    Bye(),
    Bye(ledger_head="9:ee", run_id="r1", rows={3: ((7, "ab" * 32), (8, "cd" * 32)), 5: ((11, "0f" * 32),)}),
    DataOpen(session_id="ab" * 16, rings=True),
    DataOpen(session_id="ab" * 16, ring=RingSpec(5, 8, 1040)),
    DataReady(session_id="ab" * 16, ring=RingSpec(5, 8, 1040), mapped=True),
    handoff(),
    handoff(conventional=True, key=None, data_endpoint=None, ledger_head=None),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_survives_its_wire_form_through_json(msg: Any) -> None:
    wire = json.loads(json.dumps(msg.to_wire()))  # what a peer receives
    assert type(msg).from_wire(wire) == msg


def test_a_handoffs_key_is_typed_checked_and_never_shown() -> None:
    h = handoff()
    wire = json.loads(json.dumps(h.to_wire()))
    back = Handoff.from_wire(wire)
    assert isinstance(back.key, ProvisioningKey) and back.key == KEY and back.key.fingerprint == KEY.fingerprint
    for text in (repr(h), str(h), repr(KEY), str(KEY), repr(back), f"{back}"):
        assert KEY.key.hex() not in text and KEY.prefix.hex() not in text
        assert KEY.fingerprint in text
    # the conventional path: no key goes on the wire at all, even where the orchestrator holds it
    assert "key" not in handoff(conventional=True).to_wire()


def broken(**changes: Any) -> dict[str, Any]:
    wire = json.loads(json.dumps(handoff().to_wire()))
    for k, v in changes.items():
        if v is ...:
            wire.pop(k)
        else:
            wire[k] = v
    return wire


def test_a_windows_handoff_starts_its_window_where_its_keys_bytes_do() -> None:
    """``Handoff.for_window``: the one builder of a window's hand-off (the device's grant and the key the
    orchestrator derives before the window opens): its window starts at ``skip``, covers ``length`` bytes, and
    passes the checks a holder runs on it; a window reaching past the visit's slices is refused."""
    ho = Handoff.for_window(epoch=5, session_id="ab" * 16, key=KEY, skip=4096, length=4096, chunk_size=1024,
                            train=(0, 6000), val=(6000, 2192), ledger_head="3:" + "0" * 64)
    assert (ho.window_offset, ho.skip, ho.window_len, ho.n_chunks) == (4096, 4096, 4096, 4)
    assert Handoff.from_wire(ho.to_wire()).validated() == ho
    with pytest.raises(FrameError, match="outside this visit"):
        Handoff.for_window(epoch=5, session_id="ab" * 16, key=KEY, skip=4096, length=8192, chunk_size=1024,
                           train=(0, 6000), val=(6000, 2192)).validated()


@pytest.mark.parametrize(("wire", "match"), [
    (broken(epoch=...), "Handoff.epoch: missing"),
    (broken(epoch=True), "Handoff.epoch: expected an integer, got bool"),
    (broken(epoch="5"), "Handoff.epoch: expected an integer, got str"),
    (broken(epoch=-1), "Handoff.epoch: -1 is outside"),
    (broken(chunk_size=0), "Handoff.chunk_size: 0 is outside"),
    (broken(chunk_size=MAX_CHUNK + 1), "outside"),
    (broken(chunk_size=1024.0), "Handoff.chunk_size: expected an integer, got float"),
    (broken(train=[0]), "Handoff.train: expected a list of 2 values"),
    (broken(train=[0, "x"]), r"Handoff.train\[1\]: expected an integer"),
    (broken(session="zz"), "Handoff.session: not hex"),
    (broken(length=10_000), "outside this visit"),
    (broken(skip=4000), "outside this visit"),
    (broken(resume_from=5), "resumes at chunk 5 of 4"),
    (broken(key=...), "Handoff.key: missing"),
    (broken(key="00" * 36), "Handoff.key: expected an object"),
    (broken(key={**KEY.to_wire(), "key": "00" * 31}), "Handoff.key.key: 62 hex digits, expected 64"),
    (broken(key={**KEY.to_wire(), "prefix": "zz"}), "Handoff.key.prefix: 2 hex digits"),
    (broken(key={**KEY.to_wire(), "direction": int(Direction.ORCH_TO_DEVICE)}), "not holder -> device"),
    (broken(key={**KEY.to_wire(), "epoch": 4}), "carries a key of epoch 4"),
    (broken(plain=True), "carries a key on the conventional path"),
    (broken(data_endpoint={"host": "h"}), "a socket path or a host and port"),
    (broken(data_endpoint={"host": "h", "port": 70_000}), "Handoff.data_endpoint.port: 70000 is outside 1..65535"),
    (broken(data_endpoint=[1]), "Handoff.data_endpoint: expected an object"),
    (broken(ledger_head=7), "Handoff.ledger_head: expected a string"),
])
def test_a_malformed_handoff_is_a_frame_error_naming_the_field(wire: dict[str, Any], match: str) -> None:
    with pytest.raises(FrameError, match=match) as caught:
        Handoff.from_wire(wire)
    assert caught.value.code == "frame"  # charged to the sender as every malformed frame (the device's counters)


@pytest.mark.parametrize(("cls", "wire", "match"), [
    (Hello, {**MESSAGES[0].to_wire(), "format": "utf8"}, "Hello.format: 'utf8' is not one of"),
    (Hello, {**MESSAGES[0].to_wire(), "train_bytes": -1}, "Hello.train_bytes: -1 is outside"),
    (Hello, {**MESSAGES[0].to_wire(), "agent_sha256": "00"}, "Hello.agent_sha256: 2 hex digits, expected 64"),
    (Hello, {**MESSAGES[0].to_wire(), "name": "x" * 5000}, "Hello.name: 5000 characters, at most 4096"),
    (Progress, {"n": 1}, "Progress.s: missing"),
    (Progress, {"s": 1, "n": 0}, "Progress.n: 0 is outside"),
    (Refusal, {"code": ["x"], "reason": ""}, "Refusal.code: expected a string"),
    (Refusal, {"code": "tag", "reason": "", "s": 1.5}, "Refusal.s: expected an integer"),
    (Done, {"epoch": 1, "chunks": 1, "bytes": 1, "stages": {"wait_s": float("nan")}}, "Done.stages.wait_s: NaN is not a value"),
    (Done, {"epoch": 1, "chunks": 1, "bytes": 1, "stages": [1]}, "Done.stages: expected an object"),
    (Done, {"epoch": 1, "chunks": 1}, "Done.bytes: missing"),
    (DataOpen, {"session": 3}, "DataOpen.session: expected hex digits"),
    (DataOpen, {"session": "ab", "rings": 2}, r"DataOpen.rings: expected a flag \(true/false, 1/0\)"),
    (DataOpen, {"session": "ab", "ring": {"epoch": 1, "slots": 0, "slot_bytes": 64}}, "ring of 0 slots"),
    (DataReady, {"session": "ab", "ring": "x"}, "DataReady.ring: expected an object"),
    (Bye, [], "Bye: expected an object"),
    (Bye, {"rows": [[1, "ab" * 32]]}, "Bye.rows: must be an object of epochs"),
    (Bye, {"rows": {"-1": []}}, "is not EPOCH"),
    (Bye, {"rows": {"1": [[1, "AB" * 32]]}}, "a row is"),
    (Bye, {"rows": {"1": [[True, "ab" * 32]]}}, "a row is"),
    (Bye, {"rows": {str(e): [[e, "ab" * 32]] * 100 for e in range(1, 100)}}, "more than 8192 rows"),
])
def test_a_malformed_message_is_a_frame_error(cls: Any, wire: Any, match: str) -> None:
    with pytest.raises(FrameError, match=match) as caught:
        cls.from_wire(wire)
    assert caught.value.code == "frame"


def test_fields_a_peer_adds_later_are_ignored_so_a_data_open_can_grow_a_credential() -> None:
    assert DataOpen.from_wire({"session": "ab", "rings": 1, "credential": "mac:00"}) == DataOpen("ab", rings=True)
    assert Progress.from_wire({"s": 2, "n": 1, "later": {"x": 1}}) == Progress(2, 1)


def test_a_data_endpoint_is_a_socket_path_or_a_host_and_port() -> None:
    assert DataEndpoint.from_wire({"path": "/s", "ring": False}) == DataEndpoint(path="/s", ring=False)
    assert DataEndpoint.from_wire({"host": "10.0.0.1", "port": 9}).to_wire() == {"host": "10.0.0.1", "port": 9}
    with pytest.raises(FrameError, match="a socket path or a host and port"):
        DataEndpoint()


def test_the_orchestrator_charges_a_hostile_chunk_header_to_the_holder_not_the_device() -> None:
    """On the channel and conventional paths the orchestrator relays chunk headers the agent wrote: a
    conventional chunk with a malformed header is an ``AgentError`` naming the holder, and the device's
    refusal that echoes a hostile sequence number still counts as a refusal (not a device failure)."""
    from gputravel.core.errors import AgentError
    from gputravel.core.travel.framed_link import _BounceSealer, _device_refusal

    sealer = _BounceSealer(handoff(conventional=True))  # the orchestrator's own hand-off keeps the key
    with pytest.raises(AgentError, match="mallory: sent a malformed CHUNK"):
        sealer.seal("mallory", {"plain": 1, "e": 5, "s": "0", "o": 0, "n": 4}, b"abcd")
    head, ct = sealer.seal("mallory", {"plain": 1, "e": 5, "s": 0, "o": 0, "n": 4}, b"abcd")
    assert head == {"e": 5, "s": 0, "o": 0, "n": 4} and len(ct) == 4 + 16
    assert _device_refusal({"ok": False, "code": "frame", "reason": "bad", "s": "x"}) == Refusal("frame", "bad")
    assert _device_refusal({"ok": False, "code": "tag", "reason": "t", "s": 3}) == Refusal("tag", "t", seq=3)


#: headers as the hand-written forms wrote them (before the messages moved onto core/protocol/wire.py), byte
#: for byte: key order, short names, flags as 1, optional fields left off
WRITTEN_BEFORE = [
    (handoff(key=None, wrapped_key="ab" * 40, key_fp="fp"),
     '{"epoch":5,"session":"abababababababababababababababab","window_offset":0,"chunk_size":1024,"train":[0,3000],'
     '"val":[100,1096],"resume_from":0,"skip":0,"length":4096,"wrapped_key":"' + "ab" * 40 + '","key_fp":"fp",'
     '"data_endpoint":{"path":"/run/dev.sock"},"ledger_head":"7:abc"}'),
    (MESSAGES[3], '{"code":"stale-epoch","reason":"no window","ring":1}'),
    (MESSAGES[9], '{"session":"abababababababababababababababab","ring":{"epoch":5,"slots":8,"slot_bytes":1040}}'),
    (Bye(run_id="r1", rows={3: ((7, "ab" * 32),)}), '{"run":"r1","rows":{"3":[[7,"' + "ab" * 32 + '"]]}}'),
    (DataEndpoint(host="h", port=9, ring=False), '{"host":"h","port":9,"ring":false}'),
]


@pytest.mark.parametrize(("msg", "text"), WRITTEN_BEFORE, ids=lambda m: type(m).__name__)
def test_the_declared_messages_write_the_same_headers_as_before(msg: Any, text: str) -> None:
    assert json.dumps(msg.to_wire(), separators=(",", ":")) == text
