"""The fleet's lock-step schedule: N GPUs visit H holders in steps, one round covers every holder once.

It takes the single-GPU visit list (:func:`gputravel.core.travel.schedule.plan_visits`: each round
visits every holder's data once, a holder bigger than the buffer in parts) and packs each round's
visits into steps of at most N, so that

* in a step every GPU visits a different holder (no holder hosts two GPUs at once; two parts of one
  holder go to different steps),
* every visit of a round happens in exactly one step of that round, in the round's order where it can,
* with H not a multiple of N the last step of a round leaves GPUs **idle**: an idle GPU takes part in
  the step's gradient all-reduce with weight 0 (a zero gradient), so the ring stays whole and every
  replica applies the same averaged update,
* who is idle rotates, and so does which GPU sees which holder, from step to step.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from gputravel.core.errors import ConfigError
from gputravel.core.travel.schedule import VisitPlan

__all__ = ["FleetPlan", "FleetStep", "plan_fleet"]


@dataclass(frozen=True, slots=True)
class FleetStep:
    """One lock-step step: ``slots[g]`` is the visit GPU g makes, or ``None`` (idle, weight 0)."""

    index: int
    round: int
    slots: tuple[VisitPlan | None, ...]

    @property
    def holders(self) -> tuple[str | None, ...]:
        return tuple(v.holder if v else None for v in self.slots)

    @property
    def busy(self) -> int:
        return sum(1 for v in self.slots if v is not None)


@dataclass(frozen=True, slots=True)
class FleetPlan:
    gpus: int
    steps: tuple[FleetStep, ...]

    @property
    def rounds(self) -> int:
        return len({s.round for s in self.steps})

    def for_gpu(self, gpu: int) -> list[tuple[FleetStep, VisitPlan | None]]:
        """GPU ``gpu``'s part: every step, with its visit or ``None``."""
        if not 0 <= gpu < self.gpus:
            raise ConfigError(f"gpu {gpu} outside 0..{self.gpus - 1}")
        return [(s, s.slots[gpu]) for s in self.steps]

    def visits(self) -> list[VisitPlan]:
        return [v for s in self.steps for v in s.slots if v is not None]

    def digest(self) -> str:
        """Names the schedule, so a resumed fleet can prove it continues the same one."""
        rows = [[s.index, s.round, [asdict(v) if v else None for v in s.slots]] for s in self.steps]
        return hashlib.sha256(json.dumps([self.gpus, rows], sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict[str, object]:
        return {"gpus": self.gpus, "rounds": self.rounds, "steps": len(self.steps),
                "idle_slots": sum(self.gpus - s.busy for s in self.steps),
                "table": [list(s.holders) for s in self.steps]}


def plan_fleet(visits: list[VisitPlan], *, gpus: int) -> FleetPlan:
    """Pack ``visits`` (in round order) into lock-step steps for ``gpus`` GPUs."""
    if gpus < 1:
        raise ConfigError("a fleet needs at least one GPU")
    by_round: dict[int, list[VisitPlan]] = {}
    for v in visits:
        by_round.setdefault(v.round, []).append(v)
    steps: list[FleetStep] = []
    for rnd in sorted(by_round):
        pending = list(by_round[rnd])
        k = 0  # step within the round
        while pending:
            chosen: list[VisitPlan] = []
            for v in pending:  # greedy, in order: one visit per holder per step
                if len(chosen) < gpus and all(c.holder != v.holder for c in chosen):
                    chosen.append(v)
            for v in chosen:
                pending.remove(v)
            index = len(steps)
            slots: list[VisitPlan | None] = [None] * gpus
            for i, v in enumerate(chosen):  # rotate GPUs over holders, and the idle slot, by round and step
                slots[(i + rnd + k) % gpus] = v
            steps.append(FleetStep(index, rnd, tuple(slots)))
            k += 1
    return FleetPlan(gpus, tuple(steps))
