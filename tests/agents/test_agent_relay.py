"""The agent's side of the hand-off's relay (issue 34 item 2): a HANDOFF the device relays on the parked data
connection is taken only by an attesting agent, for the epoch and key its last ok verdict attested, wrapped for it;
anything else relayed (another holder's, a stale epoch, a bare key, a malformed header) is ignored and counted,
nothing is answered, and the holder link's copy decides. Of the two copies of one HANDOFF (the same ``relay_id``)
the first is taken and the other skipped. Unit level: a real ``Agent`` on a real dataset, its link a byte buffer;
the attestation is a fake holding the verdict's outcome (its ``expects`` is the real one)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from gputravel.agents.holder import Agent, open_dataset
from gputravel.agents.holder.attest import HolderAttestation
from gputravel.core.protocol import FrameType, read_frame
from gputravel.core.protocol.cipher import Direction
from gputravel.core.protocol.errors import HolderAttestationError
from gputravel.core.protocol.holderlink import Handoff, ProvisioningKey
from gputravel.core.protocol.keys import KEY_LEN, PREFIX_LEN


class FakeHolderAttestation:
    """Isolates the agent's choice from evidence checking: ``attested`` is what an ok VERDICT left; ``accept``
    records the hand-off it was given and refuses it (so no provisioning starts: the choice is what is tested)."""

    expects = HolderAttestation.expects

    def __init__(self, epoch: int, key_fp: str) -> None:
        self.attested: tuple[int, str, str, bytes] | None = (epoch, key_fp, "run", b"")
        self.accepted: list[Handoff] = []
        self.last = None

    def accept(self, h: Handoff) -> Handoff:
        self.accepted.append(h)
        raise HolderAttestationError("the fake stops here")


def header(epoch: int = 5, key_fp: str = "f" * 16, relay: str | None = "01" * 8, **extra: Any) -> dict[str, Any]:
    h: dict[str, Any] = {"epoch": epoch, "session": "aa" * 16, "window_offset": 0, "chunk_size": 1024,
                         "train": [0, 1024], "val": [0, 0], "wrapped_key": "ab" * 40, "key_fp": key_fp, **extra}
    if relay is not None:
        h["relay"] = relay
    return h


@pytest.fixture
def agent(tmp_path: Path) -> tuple[Agent, io.BytesIO]:
    folder = tmp_path / "alice"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"hello world " * 200)
    out = io.BytesIO()
    return Agent("alice", open_dataset(folder), out, io.BytesIO()), out


def frames(out: io.BytesIO) -> list[Any]:
    got, stream = [], io.BytesIO(out.getvalue())
    while (f := read_frame(stream)) is not None:
        got.append(f)
    return got


def test_a_relayed_handoff_not_this_agents_attested_one_is_ignored_and_the_links_copy_decides(
        agent: tuple[Agent, io.BytesIO]) -> None:
    a, out = agent
    a.handoff(header(), relayed=True)  # an agent that does not attest takes no relayed hand-off
    fake = FakeHolderAttestation(5, "f" * 16)
    a.attestation = fake  # type: ignore[assignment]
    a.handoff(header(epoch=6), relayed=True)  # not the epoch its verdict is for (another holder's, or stale)
    a.handoff(header(key_fp="e" * 16), relayed=True)  # not the key it attested
    a.handoff(header(relay=None), relayed=True)  # no relay id: not a relayed hand-off
    key = ProvisioningKey(bytes(KEY_LEN), bytes(PREFIX_LEN), 5, int(Direction.HOLDER_TO_DEVICE))
    bare = Handoff(epoch=5, session_id="aa" * 16, window_offset=0, chunk_size=1024, train=(0, 1024), val=(0, 0),
                   key=key, relay_id="01" * 8).to_wire()
    assert Handoff.from_wire(bare).key == key  # a well-formed hand-off, with its key bare
    a.handoff(bare, relayed=True)
    a.handoff({"epoch": "five"}, relayed=True)  # malformed
    assert a.relays.ignored == 6 and fake.accepted == [] and frames(out) == []  # nothing answered, nothing taken
    a.handoff(header(epoch=6), relayed=False)  # the holder link's copy decides: checked, and refused by name
    [refusal] = frames(out)
    assert refusal.type is FrameType.ERROR and refusal.header["code"] == "attestation"
    assert [h.epoch for h in fake.accepted] == [6]


def test_of_the_two_copies_of_one_handoff_the_first_is_taken_and_the_other_skipped(
        agent: tuple[Agent, io.BytesIO]) -> None:
    a, out = agent
    fake = FakeHolderAttestation(5, "f" * 16)
    a.attestation = fake  # type: ignore[assignment]
    a.handoff(header(), relayed=True)  # the device's copy came first: taken (the fake refuses it: one ERROR)
    a.handoff(header(), relayed=False)  # the holder link's copy of the same HANDOFF: skipped
    assert [h.relay_id for h in fake.accepted] == ["01" * 8] and len(frames(out)) == 1
    a.handoff(header(relay="02" * 8), relayed=False)  # the link's copy first (the relay was slower or lost)
    fake.attested = (5, "f" * 16, "run", b"")
    a.handoff(header(relay="02" * 8), relayed=True)  # the late relayed copy: skipped, not counted as ignored
    a.handoff(header(relay="03" * 8, resume_from=1), relayed=False)  # a resumed hand-off has an id of its own
    assert [h.relay_id for h in fake.accepted] == ["01" * 8, "02" * 8, "03" * 8] and a.relays.ignored == 0
