"""The device's typed answers (core/protocol/deviceanswers.py): the hand-off grant carries a typed
``ProvisioningKey``, checked once in ``from_wire``, with the wire format unchanged."""

from __future__ import annotations

import pytest

from gputravel.core.protocol import Direction, FrameError, provisioning_key
from gputravel.core.protocol.deviceanswers import HandoffGrant
from gputravel.core.protocol.holderlink import ProvisioningKey

SESSION = bytes(range(16))
KEY = ProvisioningKey.of(provisioning_key(bytes(range(32)), SESSION, epoch=3, offset=0, length=4096,
                                          direction=Direction.HOLDER_TO_DEVICE))


def wire() -> dict[str, object]:
    return {"session_id": SESSION.hex(), "key_fingerprint": KEY.fingerprint, "provisioning_key": KEY.to_wire()}


def test_a_grant_round_trips_with_its_key_typed_and_the_wire_format_unchanged() -> None:
    grant = HandoffGrant.from_wire(wire())
    assert isinstance(grant.provisioning_key, ProvisioningKey)
    assert grant.provisioning_key == KEY and grant.provisioning_key.epoch == 3
    assert grant.to_wire() == wire()  # the same header the device always sent
    assert set(grant.to_wire()["provisioning_key"]) == {"key", "prefix", "epoch", "direction"}
    assert grant.relayed is False
    # a grant whose window request carried the HANDOFF says so, and reads back the same
    relayed = HandoffGrant.from_wire({**wire(), "relayed": True})
    assert relayed.relayed is True and relayed.to_wire() == {**wire(), "relayed": True}


def test_a_grant_never_shows_its_key() -> None:
    grant = HandoffGrant.from_wire(wire())
    assert KEY.key.hex() not in repr(grant) and KEY.key.hex() not in str(grant)


@pytest.mark.parametrize("change, match", [
    ({"provisioning_key": None}, "HandoffGrant.provisioning_key: expected an object"),
    ({"provisioning_key": {**KEY.to_wire(), "key": "ab" * 16}}, "provisioning_key.key: 32 hex digits, expected 64"),
    ({"provisioning_key": {**KEY.to_wire(), "direction": int(Direction.DEVICE_TO_ORCH)}}, "direction"),
    ({"provisioning_key": {**KEY.to_wire(), "epoch": "3"}}, "integer"),
    ({"key_fingerprint": "00" * 8}, "not the key's"),
    ({"session_id": "not hex"}, "session_id"),
    ({"session_id": 7}, "session_id"),
], ids=["no-key", "short-key", "wrong-direction", "epoch-not-int", "wrong-fingerprint", "session-not-hex",
        "session-not-str"])
def test_a_malformed_grant_is_a_frame_error(change: dict[str, object], match: str) -> None:
    with pytest.raises(FrameError, match=match):
        HandoffGrant.from_wire({**wire(), **change})
