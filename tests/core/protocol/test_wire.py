"""The one wire discipline (core/protocol/wire.py): a message's fields declare their bounds once; ``from_wire``
refuses a field missing, mistyped or out of bounds by name (``WireFormatError``), and ``to_wire`` and
``from_wire`` round-trip. The device's answers (core/protocol/deviceanswers.py) are built on it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest

from gputravel.core.errors import FrameError, WireFormatError, error_from_code
from gputravel.core.protocol.deviceanswers import (
    DeviceStats,
    Measurement,
    StreamEnded,
    TrainResult,
    WindowClosed,
    WindowStatus,
)
from gputravel.core.protocol.wire import (
    Bool,
    Float,
    Hex,
    Int,
    ListOf,
    MapOf,
    Nested,
    Opt,
    Str,
    WireMessage,
    bounds,
)


@dataclass(frozen=True, slots=True)
class Inner(WireMessage):
    tag: str = field(metadata=bounds(Hex(8)))
    n: int = field(default=0, metadata=bounds(Int(0, 9)))


@dataclass(frozen=True, slots=True)
class Outer(WireMessage):
    name: str = field(metadata=bounds(Str(5, choices=frozenset({"alice", "bob"}))))
    ok: bool = field(metadata=bounds(Bool()))
    rate: float = field(metadata=bounds(Float(0.0, 1.0)))
    inner: Inner = field(metadata=bounds(Nested(Inner)))
    items: list[Inner] = field(metadata=bounds(ListOf(Nested(Inner), max_len=2)))
    counts: dict[str, int] = field(metadata=bounds(MapOf(Int(0, 100), max_len=2, key_len=4)))
    note: str | None = field(default=None, metadata=bounds(Opt(Str(3))))


GOOD: dict[str, Any] = {"name": "alice", "ok": True, "rate": 0.5, "inner": {"tag": "0a0b0c0d", "n": 3},
                        "items": [{"tag": "00000000"}], "counts": {"x": 1}, "note": "hi"}


def test_a_message_round_trips_nested_messages_included() -> None:
    msg = Outer.from_wire(GOOD)
    assert msg.inner == Inner("0a0b0c0d", 3) and msg.items == [Inner("00000000", 0)]
    assert msg.to_wire() == {**GOOD, "items": [{"tag": "00000000", "n": 0}]}
    assert Outer.from_wire(msg.to_wire()) == msg


def test_an_integer_is_taken_as_a_float_but_a_bool_is_never_an_integer() -> None:
    assert Outer.from_wire({**GOOD, "rate": 1}).rate == 1.0
    with pytest.raises(WireFormatError, match="Outer.inner.n: expected an integer, got bool"):
        Outer.from_wire({**GOOD, "inner": {"tag": "0a0b0c0d", "n": True}})


def test_unknown_keys_are_ignored_and_defaults_fill_what_is_absent() -> None:
    msg = Outer.from_wire({k: v for k, v in GOOD.items() if k != "note"} | {"newer": 1})
    assert msg.note is None


@pytest.mark.parametrize("change, field, words", [
    ({"name": "carol"}, "Outer.name", "not one of"),
    ({"name": "alice" * 2}, "Outer.name", "at most 5"),
    ({"ok": 1}, "Outer.ok", "true or false"),
    ({"rate": 1.5}, "Outer.rate", "outside"),
    ({"rate": math.nan}, "Outer.rate", "NaN"),
    ({"rate": "0.5"}, "Outer.rate", "a number"),
    ({"inner": {"tag": "0a0b0c"}}, "Outer.inner.tag", "6 hex digits, expected 8"),
    ({"inner": {"tag": "zzzzzzzz"}}, "Outer.inner.tag", "not hex"),
    ({"inner": {"tag": "0a0b0c0d", "n": 10}}, "Outer.inner.n", "outside 0..9"),
    ({"inner": []}, "Outer.inner", "expected an object"),
    ({"items": [{"tag": "00000000"}] * 3}, "Outer.items", "3 items, at most 2"),
    ({"items": [{"tag": "00000000"}, {"tag": 1}]}, "Outer.items[1].tag", "expected hex"),
    ({"counts": {"a": 1, "b": 2, "c": 3}}, "Outer.counts", "3 entries, at most 2"),
    ({"counts": {"toolong": 1}}, "Outer.counts", "key"),
    ({"counts": {"x": -1}}, "Outer.counts.x", "outside"),
    ({"note": "long"}, "Outer.note", "at most 3"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_field_out_of_its_bounds_is_refused_by_name(change: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(WireFormatError, match=words) as caught:
        Outer.from_wire({**GOOD, **change})
    assert caught.value.field == field and str(caught.value.reason).startswith(field)
    assert isinstance(caught.value, FrameError) and caught.value.code == "wire-format"


def test_a_missing_required_field_is_named_and_a_non_object_refused() -> None:
    with pytest.raises(WireFormatError, match="Outer.ok: missing"):
        Outer.from_wire({k: v for k, v in GOOD.items() if k != "ok"})
    with pytest.raises(WireFormatError, match="Outer: expected an object, got list"):
        Outer.from_wire([GOOD])


def test_the_error_travels_as_its_code_and_comes_back_with_its_field() -> None:
    sent = WireFormatError("Outer.rate: 2.0 is outside 0.0..1.0", field="Outer.rate")
    back = error_from_code(sent.code, sent.reason)
    assert isinstance(back, WireFormatError) and back.field == "Outer.rate" and back.exit_code == 4


def test_a_field_without_declared_bounds_is_a_bug_found_on_first_use() -> None:
    @dataclass(frozen=True, slots=True)
    class Careless(WireMessage):
        x: int = 0

    with pytest.raises(TypeError, match="Careless.x declares no wire bounds"):
        Careless.from_wire({"x": 1})


# --- the device's answers, as the orchestrator reads them ----------------------------------------------------
SHA = "ab" * 32


@pytest.mark.parametrize("cls, wire", [
    (Measurement, {"code": SHA, "model": "", "measurement": SHA, "digest_s": 0, "mac": None, "mac_s": 0.0,
                   "mac_engine": None}),
    (WindowClosed, {"epoch": 3, "bytes": 4096, "chunks": 1, "expected_chunks": 1, "contiguous": 1,
                    "complete": True, "rejected": {"tag": 2}, "rejected_in_window": {}}),
    (StreamEnded, {"model_digest": SHA, "tag_digest": SHA, "bytes": 10, "chunks": 1, "seconds": 0.1,
                   "digest_s": 0.0, "seal_s": 0.0, "snapshot_s": 0.0}),
    (DeviceStats, {"counters": {"sessions": 1}, "rejected": {}, "busy_s": 0.5, "rejected_by_epoch": {"1": {"tag": 1}},
                   "memory_bytes": 1, "epoch": 1, "rejection_gen": 2, "more": False, "refused": {}}),
])
def test_a_device_answer_round_trips(cls: type[WireMessage], wire: dict[str, Any]) -> None:
    answer = cls.from_wire(wire)
    assert cls.from_wire(answer.to_wire()) == answer


@pytest.mark.parametrize("cls, wire, field", [
    (Measurement, {"code": "ab", "model": "", "measurement": SHA}, "Measurement.code"),
    (WindowClosed, {"epoch": -1, "bytes": 0, "chunks": 0, "expected_chunks": 0, "contiguous": 0,
                    "complete": True, "rejected": {}, "rejected_in_window": {}}, "WindowClosed.epoch"),
    (WindowStatus, {"open": "yes"}, "WindowStatus.open"),
    (DeviceStats, {"counters": {"sessions": 1.5}, "rejected": {}, "busy_s": 0, "rejected_by_epoch": {},
                   "memory_bytes": 1, "epoch": 1}, "DeviceStats.counters.sessions"),
    (DeviceStats, {"counters": {}, "rejected": {}, "busy_s": 0,
                   "rejected_by_epoch": {str(e): {} for e in range(65)}, "memory_bytes": 1, "epoch": 1},
     "DeviceStats.rejected_by_epoch"),
])
def test_a_device_answer_out_of_bounds_is_refused_by_name(cls: type[WireMessage], wire: dict[str, Any],
                                                          field: str) -> None:
    with pytest.raises(WireFormatError) as caught:
        cls.from_wire(wire)
    assert caught.value.field == field


def test_a_train_answer_refuses_a_loss_count_its_payload_does_not_hold() -> None:
    result = TrainResult(losses=[1.0, 0.5], tokens=8, seconds=0.1, tokens_per_s=80.0, val_loss=None,
                         model_digest=SHA)
    back = TrainResult.from_wire_with_losses(result.header_without_losses(), result.losses_payload())
    assert back == result
    with pytest.raises(FrameError, match="do not hold"):
        TrainResult.from_wire_with_losses({**result.header_without_losses(), "n_losses": 3}, result.losses_payload())
