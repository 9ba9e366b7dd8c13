"""Proving a whole fleet run from its folder (``gputravel ledger verify <fleet folder>``).

Only the ledger is read: no torch, no torchrun (``core/fleet/run.py`` re-exports :func:`verify_fleet`).
"""

from __future__ import annotations

from pathlib import Path

from gputravel.core.ledger import VerifyResult, read_rows, verify_ledger
from gputravel.core.runfolder.folder import RunFolder

__all__ = ["verify_fleet"]


def verify_fleet(out: Path) -> VerifyResult:
    """Prove a whole fleet run: the fleet ledger's chain, and every rank ledger's chain against every head the
    fleet ledger recorded for it (so a rank ledger cut short or rewritten is found too)."""
    folder = RunFolder(out)
    fleet = verify_ledger(folder.ledger)
    if not fleet.ok:
        return VerifyResult(ok=False, rows=fleet.rows, head_hash=fleet.head_hash, first_bad_seq=fleet.first_bad_seq,
                            reason=f"fleet ledger: {fleet.reason}")
    heads: dict[int, set[tuple[int, str]]] = {}
    for row in read_rows(folder.ledger):
        if row.kind == "fleet-device" and row.detail.get("ledger_head"):
            seq, _, digest = str(row.detail["ledger_head"]).partition(":")
            if seq.isdigit() and int(seq) > 0:
                heads.setdefault(int(row.detail["gpu"]), set()).add((int(seq), digest))
    rows = fleet.rows
    for gpu, rank in folder.ranks():
        path = rank.ledger
        if not path.exists():
            continue
        result = verify_ledger(path, expect_heads=heads.get(gpu, ()))
        rows += result.rows
        if not result.ok:
            return VerifyResult(ok=False, rows=rows, head_hash=fleet.head_hash, first_bad_seq=result.first_bad_seq,
                                reason=f"{rank.name}/{path.name}: {result.reason}")
        if gpu not in heads:
            return VerifyResult(ok=False, rows=rows, head_hash=fleet.head_hash, first_bad_seq=None,
                                reason=f"{rank.name}/{path.name}: the fleet ledger records no head for it")
    return VerifyResult(ok=True, rows=fleet.rows, head_hash=fleet.head_hash, first_bad_seq=None, reason=None)
