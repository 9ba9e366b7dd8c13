"""A failed or cancelled visit's scrub receipt, which no event carries, read from the run's ledger."""

from __future__ import annotations

from pathlib import Path

from gputravel.console.view.model import RunState
from gputravel.core.errors import GpuTravelError
from gputravel.core.ledger import LedgerRow, read_rows

__all__ = ["fill_scrub_receipts"]


def fill_scrub_receipts(state: RunState, ledger: Path | None) -> None:
    """Each failed or cancelled visit's ``scrub_verified`` as its ledger row has it (``visit-failed``,
    ``visit-cancelled``: the abort scrubs the buffer and says whether it read back as zero). The k-th failed
    attempt of a visit is the k-th such row of that visit. A fleet's state, a missing or unreadable ledger: no
    change."""
    open_rows = [v for v in state.visits.values() if v.outcome in ("failed", "cancelled")
                 and v.scrub_verified is None]
    if ledger is None or not open_rows or state.fleet or not Path(ledger).is_file():
        return
    try:
        rows = [r for r in read_rows(Path(ledger)) if r.kind in ("visit-failed", "visit-cancelled")]
    except GpuTravelError:
        return
    by_visit: dict[int, list[LedgerRow]] = {}
    for r in rows:
        if isinstance(r.detail.get("visit"), int):
            by_visit.setdefault(r.detail["visit"], []).append(r)
    for visit in open_rows:
        ended = [v for v in state.visits.values() if v.visit == visit.visit and v.outcome in ("failed", "cancelled")]
        found = by_visit.get(visit.visit, [])
        k = ended.index(visit)
        if k < len(found) and isinstance(found[k].detail.get("scrub_verified"), bool):
            visit.scrub_verified = found[k].detail["scrub_verified"]
