"""The device service's counts part: what it did (``counters``), what it refused and whom it charged.

:class:`Counters` is one part of :class:`~gputravel.core.device.service.DeviceService` and owns every count the
device keeps: the totals (``counters``: chunks, bytes, hand-offs, digests, ...), the chunks refused (``rejected``,
and by the epoch, so the holder, they were charged to: ``rejected_by_epoch``, with a change generation so that
``stats(since=)`` answers only what changed), the connections refused before they authenticated (``refused``), and
the time spent in operations (``busy_s``). It adds no operation of its own: ``stats`` (core/device/operations.py)
reads it. Nothing here is secret: telemetry reads it without a session (``public``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Counters"]


class Counters:
    """Every count of one device service; ``lock`` is the service's lock (``count_refused`` takes it)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.counters: Counter[str] = Counter()
        #: chunks refused, by reason
        self.rejected: Counter[str] = Counter()
        #: rejections attributed to the epoch (so the holder) whose key or window they claimed
        self.rejected_by_epoch: dict[int, Counter[str]] = {}
        #: generation of the last rejection attributed to an epoch, and each epoch's last change (in change
        #: order): ``stats(since=)`` answers only the epochs changed since the caller's last audit
        self.rejection_gen = 0
        self.epoch_gen: dict[int, int] = {}
        #: connections refused before they authenticated, by reason (chunks refused are ``rejected``)
        self.refused: Counter[str] = Counter()
        self.busy_s = 0.0
        self._busy_since: float | None = None

    def count_refused(self, code: str) -> None:
        """A connection refused before it authenticated (a garbage first frame, a stall past the hand-shake
        timeout, one too many waiting, a session that does not exist): counted, attributed to no epoch."""
        with self._lock:
            self.refused[code] += 1

    def count_rejection(self, code: str, charge: Any = None) -> None:
        """Count a rejection, charged to epoch ``charge`` (the window an admitted data connection speaks for,
        so its holder) when given; else anonymous (``rejected_anonymous``): never blamed on a holder."""
        self.rejected[code] += 1
        epoch = charge if isinstance(charge, int) and not isinstance(charge, bool) else None
        if epoch is None:
            self.counters["rejected_anonymous"] += 1
            return
        self.rejected_by_epoch.setdefault(epoch, Counter())[code] += 1
        self.rejection_gen += 1
        self.epoch_gen.pop(epoch, None)  # re-inserted: the dict stays in change order
        self.epoch_gen[epoch] = self.rejection_gen

    def changed_since(self, since: int, limit: int) -> tuple[list[int], int, bool]:
        """The epochs whose rejections changed after generation ``since``, oldest change first, at most
        ``limit``; the generation the answer covers up to; whether others wait for the next call."""
        changed = [(e, g) for e, g in self.epoch_gen.items() if g > since][:limit]
        more = sum(1 for g in self.epoch_gen.values() if g > since) > len(changed)
        upto = changed[-1][1] if more else self.rejection_gen
        return [e for e, _ in changed], upto, more

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Time one operation into ``busy_s`` (``busy_now`` includes the one in progress)."""
        t0 = self._busy_since = time.perf_counter()
        try:
            yield
        finally:
            self._busy_since = None
            self.busy_s += time.perf_counter() - t0

    def busy_now(self) -> float:
        """Busy time, the operation in progress included (utilisation does not stall during a long TRAIN)."""
        since = self._busy_since
        return self.busy_s + (time.perf_counter() - since if since is not None else 0.0)

    def public(self) -> dict[str, Any]:
        """The counts telemetry may read without a session: totals and refusals, never data or keys."""
        return {"counters": {k: int(v) for k, v in self.counters.items()}, "busy_s": self.busy_now(),
                "rejected": dict(self.rejected), "refused": dict(self.refused)}
