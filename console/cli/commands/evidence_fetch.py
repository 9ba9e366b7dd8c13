"""Collateral for ``gputravel attest`` and ``gputravel evidence bundle`` from the vendors' services, through the
user cache (``<user cache>/gputravel/collateral``) or, with ``--offline DIR``, from a bundle only."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import platformdirs

from gputravel.core.errors import AttestationError
from gputravel.core.evidence.collateral_cache import CollateralCache, CollateralUnavailable
from gputravel.core.evidence.services import ServiceError

__all__ = ["cache_for", "fetched"]

T = TypeVar("T")


def cache_for(offline: Path | None) -> CollateralCache:
    """The bundle at ``offline`` (nothing fetched), else the user cache."""
    if offline is not None:
        return CollateralCache(offline, offline=True)
    return CollateralCache(Path(platformdirs.user_cache_dir("gputravel")) / "collateral")


def fetched(fn: Callable[[], T]) -> T:
    """``fn()``, a service's or a bundle's refusal turned into ``AttestationError`` (exit 3) naming the claim."""
    try:
        return fn()
    except (ServiceError, CollateralUnavailable) as exc:
        raise AttestationError(str(exc)) from exc
