"""Proving a whole fleet run (``gputravel ledger verify <fleet folder>``, or ``ledger verify FLEET_LEDGER
--rank-ledgers DIR ...`` from copies of each node's folders: nodes share no folder).

Only the ledger is read: no torch, no torchrun (``core/fleet/run.py`` re-exports :func:`verify_fleet`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from gputravel.core.errors import ConfigError
from gputravel.core.ledger import VerifyResult, read_rows, verify_ledger
from gputravel.core.runfolder.folder import RunFolder

__all__ = ["rank_ledgers", "verify_fleet", "verify_fleet_ledger"]


def verify_fleet(out: Path) -> VerifyResult:
    """Prove a whole fleet run from its folder: the fleet ledger's chain, and every rank ledger's chain there
    against every head the fleet ledger recorded for it (so a rank ledger cut short or rewritten is found too).

    Raises:
        ConfigError: no fleet ledger in the folder: a node's folder without rank 0 (the fleet ledger is on rank
            0's node), or rank 0's before it wrote one. Nothing is broken there, so no verdict (exit 2).
    """
    folder = RunFolder(out)
    if not folder.ledger.exists():
        here = [gpu for gpu, _ in folder.ranks()]
        ranks = ", ".join(str(g) for g in here) or "none"
        one = folder.rank(here[0] if here else 0).ledger  # a rank's own ledger, as RunFolder names it
        if 0 in here:
            raise ConfigError(f"{out}: no fleet ledger here (rank(s) {ranks} ran here): the run stopped before rank 0 "
                              f"wrote it; `gputravel run --resume --out {out}` goes on, or check one rank with "
                              f"`gputravel ledger verify {one}`")
        raise ConfigError(f"{out}: no fleet ledger here: this node's folder holds rank(s) {ranks}, and the fleet "
                          f"ledger is kept on rank 0's node. Check the whole fleet there with `gputravel ledger "
                          f"verify RANK0_NODE_FOLDER --rank-ledgers {out}` (this folder or a copy), or one rank here "
                          f"with `gputravel ledger verify {one}`")
    return verify_fleet_ledger(folder.ledger, [(gpu, rank.ledger) for gpu, rank in folder.ranks()
                                               if rank.ledger.exists()])


def rank_ledgers(dirs: Iterable[Path]) -> list[tuple[int, Path]]:
    """Every rank ledger in ``dirs``: a node's fleet folder (its ``rank-R/``) or one rank's folder.

    Raises:
        ConfigError: a folder with no rank ledger, or one rank given twice.
    """
    found: dict[int, Path] = {}
    for d in dirs:
        here = [(g, r.ledger) for g, r in RunFolder(Path(d)).ranks() if r.ledger.exists()]
        gpu = RunFolder.rank_of(Path(d))
        if not here and gpu is not None and RunFolder(Path(d)).ledger.exists():
            here = [(gpu, RunFolder(Path(d)).ledger)]
        if not here:
            raise ConfigError(f"--rank-ledgers {d}: no rank ledger there (a node's fleet folder or a rank-R folder)")
        for g, path in here:
            if g in found and found[g].resolve() != path.resolve():
                raise ConfigError(f"rank {g}'s ledger is given twice: {found[g]} and {path}")
            found[g] = path
    return sorted(found.items())


def verify_fleet_ledger(fleet_ledger: Path, ranks: list[tuple[int, Path]], *,
                        complete: bool = False) -> VerifyResult:
    """The fleet ledger's chain, and each ``(gpu, ledger)`` against every head the fleet ledger recorded for that
    rank. ``complete``: every rank the fleet ledger names must be among ``ranks`` (a fleet checked from copies)."""
    fleet = verify_ledger(fleet_ledger)
    if not fleet.ok:
        return VerifyResult(ok=False, rows=fleet.rows, head_hash=fleet.head_hash, first_bad_seq=fleet.first_bad_seq,
                            reason=f"fleet ledger: {fleet.reason}")
    heads: dict[int, set[tuple[int, str]]] = {}
    named: set[int] = set()
    for row in read_rows(fleet_ledger):
        if row.kind == "fleet-device":
            named.add(int(row.detail["gpu"]))
            seq, _, digest = str(row.detail.get("ledger_head") or "").partition(":")
            if seq.isdigit() and int(seq) > 0:
                heads.setdefault(int(row.detail["gpu"]), set()).add((int(seq), digest))
    rows = fleet.rows
    for gpu, path in ranks:
        result = verify_ledger(path, expect_heads=heads.get(gpu, ()))
        rows += result.rows
        if not result.ok:
            return VerifyResult(ok=False, rows=rows, head_hash=fleet.head_hash, first_bad_seq=result.first_bad_seq,
                                reason=f"{path.parent.name}/{path.name} (rank {gpu}): {result.reason}")
        if gpu not in heads:
            return VerifyResult(ok=False, rows=rows, head_hash=fleet.head_hash, first_bad_seq=None,
                                reason=f"{path.parent.name}/{path.name} (rank {gpu}): the fleet ledger records no head "
                                       "for it")
    missing = sorted(named - {gpu for gpu, _ in ranks})
    if complete and missing:
        return VerifyResult(ok=False, rows=rows, head_hash=fleet.head_hash, first_bad_seq=None,
                            reason=f"the fleet ledger names rank(s) {missing}, whose ledgers were not given "
                                   "(--rank-ledgers: each node's folder)")
    return VerifyResult(ok=True, rows=fleet.rows, head_hash=fleet.head_hash, first_bad_seq=None, reason=None)
