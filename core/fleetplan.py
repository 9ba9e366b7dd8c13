"""The planner for a fleet of N GPUs (docs/fleet.md), on the transfer planner's model (``core/planner.py``): the
gradient all-reduce's term fitted on ``bench fleet --json`` rows, one round's visits packed into lock-step steps
as ``core.fleet.schedule.plan_fleet`` packs them, and a fleet run's predicted wall time.

Standard library and numpy only (a core module: no console, typer or rich).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gputravel.core.errors import ConfigError
from gputravel.core.planner import Model, Term, VisitShape, fit_term, schedule, transfer_coef

__all__ = ["FleetSample", "fit_allreduce", "fleet_samples_from_report", "fleet_steps", "predict_fleet"]


@dataclass(frozen=True)
class FleetSample:
    """One measured fleet run: per GPU, the gradient all-reduce's seconds over its optimizer steps."""

    gpus: int
    opt_steps: int  # optimizer steps every GPU made (lock-step steps x steps per step)
    allreduce_s: float  # per GPU
    variant: str
    label: str = ""

    @property
    def ring_steps(self) -> float:
        """Optimizer steps weighted by the ring's traffic per rank, 2(N-1)/N of the gradient."""
        return self.opt_steps * 2.0 * (self.gpus - 1) / self.gpus


def fleet_samples_from_report(doc: dict[str, Any], *, source: str = "") -> list[FleetSample]:
    """The rows of a ``bench fleet --json`` document (other documents have none)."""
    if doc.get("benchmark") != "fleet":
        return []
    k = int((doc.get("job") or {}).get("steps_per_visit", 1))
    out = []
    for r in doc.get("rows", []):
        if r.get("status") != "ok" or not r.get("gpus"):
            continue
        out.append(FleetSample(gpus=int(r["gpus"]), opt_steps=int(r["steps"]) * k,
                               allreduce_s=float(r["allreduce_s"]) / int(r["gpus"]), variant=str(r["variant"]),
                               label=f"{source}fleet {r['gpus']} GPU(s) {r['variant']}"))
    return out


def fit_allreduce(samples: Iterable[FleetSample], *, variant: str) -> Term:
    """The all-reduce per GPU: ``e0 * optimizer steps + e1 * optimizer steps * 2(N-1)/N`` (the ring's traffic)."""
    rows = [s for s in samples if s.variant == variant]
    if not rows:
        raise ConfigError(f"no measured fleet runs with the {variant} all-reduce (pass --from a 'bench fleet "
                          "--json' output)")
    x = np.array([[s.opt_steps, s.ring_steps] for s in rows], dtype=float)
    y = np.array([max(s.allreduce_s, 1e-9) for s in rows])
    return fit_term(f"allreduce[{variant}]", ("opt_steps", "ring_opt_steps"), x, y, [s.label for s in rows])


def fleet_steps(visits: Sequence[VisitShape], *, gpus: int) -> list[list[VisitShape]]:
    """One round's visits packed into lock-step steps as ``core.fleet.schedule.plan_fleet`` packs them: at most
    ``gpus`` per step, never two of one holder."""
    if gpus < 1:
        raise ConfigError("--gpus must be >= 1")
    pending, steps = list(visits), []
    while pending:
        chosen: list[VisitShape] = []
        for v in pending:
            if len(chosen) < gpus and all(c.holder != v.holder for c in chosen):
                chosen.append(v)
        for v in chosen:
            pending.remove(v)
        steps.append(chosen)
    return steps


def predict_fleet(model: Model, allreduce: Term, holder_bytes: Sequence[int], *, gpus: int, buffer_bytes: int,
                  steps_per_visit: int, rounds: int = 1, path: str = "travelling", val_fraction: float = 0.1,
                  val_share: float = 0.1) -> dict[str, Any]:
    """A fleet run's wall time: per lock-step step, the slowest visit's transfer, then ``steps_per_visit``
    optimizer steps on every GPU at once with the all-reduce after each."""
    if model.train is None:
        raise ConfigError("no measured training times to predict training from (need 'bench travel' rows)")
    if rounds < 1 or steps_per_visit < 1:
        raise ConfigError("rounds and steps per visit must be >= 1")
    a, b = transfer_coef(model, path)
    c, d = model.train.coef
    visits = schedule(holder_bytes, buffer_bytes=buffer_bytes, val_fraction=val_fraction, val_share=val_share)
    steps = fleet_steps(visits, gpus=gpus)
    ring = steps_per_visit * 2.0 * (gpus - 1) / gpus
    tx = sum(max(a + b * v.window_bytes for v in step) for step in steps) * rounds
    tr = max(0.0, c + d * steps_per_visit) * len(steps) * rounds
    ar = max(0.0, allreduce.predict([steps_per_visit, ring])) * len(steps) * rounds
    total = tx + tr + ar
    return {"gpus": gpus, "holders": len(holder_bytes), "rounds": rounds, "path": path,
            "visits": len(visits) * rounds, "steps": len(steps) * rounds,
            "idle_slots": sum(gpus - len(st) for st in steps) * rounds, "steps_per_visit": steps_per_visit,
            "tx_s": tx, "train_s": tr, "allreduce_s": ar, "total_s": total,
            "allreduce_pct": 100.0 * ar / total if total > 0 else None}
