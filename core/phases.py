"""The visit as an explicit state machine: its phases (``Phase``) and legal transitions. Top level in core: the
settings (breakpoints), the events and the console name phases too, and travel drives them."""

from __future__ import annotations

from enum import StrEnum

from gputravel.core.errors import TransitionError


class Phase(StrEnum):
    ATTEST = "ATTEST"
    HANDOFF = "HANDOFF"
    PROVISION = "PROVISION"
    RETURN = "RETURN"
    VERIFY = "VERIFY"
    TRAIN = "TRAIN"
    SCRUB = "SCRUB"
    ROTATE = "ROTATE"
    DONE = "DONE"
    FAILED = "FAILED"


#: Legal transitions. Any phase may fail; FAILED goes to SCRUB (a partial buffer is always scrubbed)
#: and from SCRUB the visit ends through ROTATE so the next holder gets a fresh epoch.
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.ATTEST: frozenset({Phase.HANDOFF, Phase.FAILED}),
    Phase.HANDOFF: frozenset({Phase.PROVISION, Phase.FAILED}),
    Phase.PROVISION: frozenset({Phase.RETURN, Phase.FAILED}),
    Phase.RETURN: frozenset({Phase.VERIFY, Phase.FAILED}),
    Phase.VERIFY: frozenset({Phase.TRAIN, Phase.FAILED}),
    Phase.TRAIN: frozenset({Phase.SCRUB, Phase.FAILED}),
    Phase.SCRUB: frozenset({Phase.ROTATE, Phase.FAILED}),
    Phase.ROTATE: frozenset({Phase.DONE, Phase.FAILED}),
    Phase.FAILED: frozenset({Phase.SCRUB}),
    Phase.DONE: frozenset(),
}

VISIT_PHASES: tuple[Phase, ...] = (Phase.ATTEST, Phase.HANDOFF, Phase.PROVISION, Phase.RETURN, Phase.VERIFY,
                                   Phase.TRAIN, Phase.SCRUB, Phase.ROTATE)


def check_transition(src: Phase, dst: Phase) -> None:
    if dst not in TRANSITIONS[src]:
        raise TransitionError(f"illegal transition {src} -> {dst}")
