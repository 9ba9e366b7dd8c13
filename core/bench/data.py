"""The synthetic holder datasets the studies run on (written to a temporary folder, never shipped)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["make_dataset", "make_holders"]


def make_dataset(folder: Path, nbytes: int) -> None:
    """A holder folder whose single .txt file holds ``nbytes`` of printable pseudo-random text."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "data.txt", "wb") as f:
        left = nbytes
        while left:
            block = os.urandom(min(left, 1 << 22) // 2 + 1).hex().encode()[: min(left, 1 << 22)]
            f.write(block)
            left -= len(block)


def make_holders(root: Path, holders: int, nbytes: int) -> Path:
    """``holders`` folders ``h00``.. under ``root``, each a ``make_dataset`` of ``nbytes``."""
    for i in range(holders):
        make_dataset(root / f"h{i:02d}", nbytes)
    return root
