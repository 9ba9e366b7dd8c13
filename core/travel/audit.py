"""The run's audit: every fact is one call that writes its ledger row and emits its event together."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gputravel.core import events as ev
from gputravel.core.ledger import Ledger
from gputravel.core.protocol.holderlink import MAX_BYE_ROWS
from gputravel.core.travel.control import EventSink
from gputravel.core.travel.visits import VisitRecord

__all__ = ["ATTACK_CODES", "Audit"]

#: Rejections that only a misbehaving holder causes with a valid key: writes outside its window, its key
#: used after return or in another epoch, replays, frames the data port does not take (reading back).
ATTACK_CODES = frozenset({"window", "stale-epoch", "replay", "frame"})


class Audit:
    """The hash-chained ledger and the event stream of one run.

    ``record(event, kind, ...)`` is one fact: the ledger row is appended first (so whoever hears the
    event can already read the row), then the event goes out. ``row`` is a fact with no event (plans,
    retries, state commits) and ``emit`` an event with no row (progress, phase starts). ``tags`` join every
    row's detail (a fleet rank's rows name their device and GPU)."""

    def __init__(self, ledger: Ledger, emit: EventSink) -> None:
        self.ledger = ledger
        self._emit = emit
        self.tags: dict[str, Any] = {}
        self._rejections_seen: dict[tuple[str, str], int] = {}  # (epoch, code) -> count already audited

    def record(self, event: ev.Event, kind: str, **row: Any) -> None:
        self.row(kind, **row)
        self._emit(event)

    def row(self, kind: str, **row: Any) -> None:
        if self.tags:
            row = {**row, "detail": {**(row.get("detail") or {}), **self.tags}}
        self.ledger.append(kind=kind, **row)

    def emit(self, event: ev.Event) -> None:
        self._emit(event)

    def flush(self) -> None:
        """Every row so far on disk (``Ledger.flush``)."""
        self.ledger.flush()

    def head(self) -> str | None:
        """``"SEQ:HASH"`` of the ledger now (``None`` while empty), for the holders' witnesses."""
        seq, digest = self.ledger.head()
        return f"{seq}:{digest}" if seq else None

    def visit_rows(self) -> dict[str, dict[int, tuple[tuple[int, str], ...]]]:
        """Each holder's rows that name an epoch, by epoch, as ``(seq, hash)``: what a holder's receipts record
        after its visits (sent with BYE), so ``holder verify`` names a changed row even where the chain after
        it was rewritten to match. A holder's rows past ``MAX_BYE_ROWS`` (a BYE's bound): its latest epochs' whole."""
        found: dict[str, dict[int, list[tuple[int, str]]]] = {}
        for row in self.ledger.rows():
            if row.holder is not None and row.epoch is not None:
                found.setdefault(row.holder, {}).setdefault(row.epoch, []).append((row.seq, row.hash))
        return {holder: _latest(epochs, MAX_BYE_ROWS) for holder, epochs in found.items()}

    def rejections(self, by_epoch: dict[str, dict[str, int]], records: Iterable[VisitRecord]) -> None:
        """Attribute the device's new rejections to the visit whose epoch they claimed; attacks get a row."""
        seen = self._rejections_seen
        by_visit = {r.epoch: r for r in records if r.epoch}
        for epoch_s, counts in by_epoch.items():
            rec = by_visit.get(int(epoch_s))
            for code, n in counts.items():
                new = n - seen.get((epoch_s, code), 0)
                if new <= 0:
                    continue
                seen[(epoch_s, code)] = n
                if rec is None or code not in ATTACK_CODES:
                    continue
                rec.attack[code] = rec.attack.get(code, 0) + new
                self.row("attack-detected", holder=rec.plan.holder, epoch=rec.epoch, key_fp=rec.key_fingerprint,
                         outcome=code, detail={"visit": rec.plan.index, "count": new,
                                               "after_return": rec.outcome.startswith("done")})


def _latest(epochs: dict[int, list[tuple[int, str]]], limit: int) -> dict[int, tuple[tuple[int, str], ...]]:
    """The latest epochs whose rows fit ``limit`` in all (whole epochs; older ones' receipts keep the heads)."""
    kept: dict[int, tuple[tuple[int, str], ...]] = {}
    count = 0
    for epoch in sorted(epochs, reverse=True):
        count += len(epochs[epoch])
        if count > limit:
            break
        kept[epoch] = tuple(epochs[epoch])
    return kept
