"""A fleet over nodes that share no folder (issue 36), as one node's folder sees it.

Each node's fleet folder holds its own ranks (``rank-R/``); the fleet's other ranks ran on other nodes and their
folders are there. :func:`fleet_nodes` says which ranks are here and which are elsewhere (the fleet's size is its
``fleet.json``'s), and merges the ranks of other nodes' folders when they are given (copies, or the folders
themselves where one machine can read them): what ``replay``, ``runs show`` and the console's replay read with
``--node-folder DIR``. Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputravel.core.errors import ConfigError
from gputravel.core.runfolder.folder import RunFolder

__all__ = ["FleetNodes", "fleet_nodes"]


def _gpus(folder: RunFolder) -> int:
    try:
        return int(json.loads(folder.fleet_config.read_text())["fleet"]["gpus"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _run_id(folder: RunFolder) -> str | None:
    try:
        run_id = json.loads(folder.report.read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return str(run_id) if run_id else None


@dataclass(frozen=True, slots=True)
class FleetNodes:
    """One node's fleet folder and the other nodes' folders given beside it."""

    folder: Path
    gpus: int  # the fleet's size (its fleet.json); 0: not known
    ranks: dict[int, Path]  # every rank folder found, this node's and the given nodes', by rank
    here: tuple[int, ...]  # the ranks this node's folder holds
    given: tuple[Path, ...] = ()

    @property
    def elsewhere(self) -> tuple[int, ...]:
        """The fleet's ranks whose folders are on other nodes and were not given."""
        return tuple(r for r in range(self.gpus) if r not in self.ranks)

    def recordings(self) -> list[tuple[int, Path]]:
        """Every rank's recording found, in rank order."""
        return [(r, RunFolder(p).recording) for r, p in sorted(self.ranks.items()) if RunFolder(p).recording.exists()]

    def note(self) -> str:
        """One line: where the ranks not here are (empty when every rank is here or given)."""
        if not self.elsewhere:
            return ""
        return (f"rank(s) {', '.join(map(str, self.elsewhere))} of {self.gpus} ran on other nodes: their folders are "
                "not here (give each node's folder, or a copy, with --node-folder DIR)")

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "here": list(self.here), "merged": sorted(set(self.ranks) - set(self.here)),
                "elsewhere": list(self.elsewhere), "node_folders": [str(p) for p in self.given],
                "note": self.note() or None}


def fleet_nodes(folder: Path, others: Iterable[Path] = ()) -> FleetNodes:
    """``folder``'s ranks and those of the other nodes' folders ``others``.

    Raises:
        ConfigError: a folder given is not a fleet node's folder, is another fleet's (its size or run id
            differs), or holds a rank another folder holds too.
    """
    mine = RunFolder(folder)
    gpus, run_id = _gpus(mine), _run_id(mine)
    ranks = {r: f.path for r, f in mine.ranks()}
    here = tuple(sorted(ranks))
    given: list[Path] = []
    for other in others:
        node = RunFolder(Path(other).expanduser())
        if not node.fleet_config.is_file():
            raise ConfigError(f"--node-folder {other}: not a fleet node's folder (no {node.fleet_config.name})")
        theirs = _run_id(node)
        if _gpus(node) != gpus or (run_id and theirs and theirs != run_id):
            raise ConfigError(f"--node-folder {other}: another fleet's folder ({_gpus(node)} GPUs, run {theirs}; "
                              f"this one: {gpus} GPUs, run {run_id})")
        for r, f in node.ranks():
            if r in ranks and ranks[r].resolve() != f.path.resolve():
                raise ConfigError(f"--node-folder {other}: rank {r} is in {ranks[r].parent} too; give each rank's "
                                  "node once")
            ranks[r] = f.path
        given.append(node.path)
    return FleetNodes(folder=mine.path, gpus=gpus, ranks=ranks, here=here, given=tuple(given))
