"""The ok verdict a HANDOFF was given on, logged once the HANDOFF is on its way: a part of ``FramedSession``.

The ledger row and report field (``on_verdict``) are written in a worker thread while the agent takes its key and
sends its data (a row is a synchronous SQLite commit, a disk flush: on the hand-off's path it cost milliseconds,
issue 34; the ledger serialises its writers). The hand-off waits for the row before it returns, so the row
precedes the visit's PROVISION row as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gputravel.core.protocol.holderlink import Verdict

__all__ = ["VerdictLog"]


class VerdictLog:
    """The verdict of the HANDOFF being sent (``pending``) and its row being written (``log``, ``logged``)."""

    __slots__ = ("_task", "pending")

    def __init__(self) -> None:
        self.pending: Verdict | None = None
        self._task: asyncio.Future[None] | None = None

    def log(self, holder: str, on_verdict: Callable[[str, Verdict], None] | None) -> None:
        """The pending verdict's row, in a worker thread. Also called when sending the HANDOFF failed: the verdict
        was given all the same."""
        verdict, self.pending = self.pending, None
        if verdict is not None and on_verdict is not None:
            task = asyncio.ensure_future(asyncio.to_thread(on_verdict, holder, verdict))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # raised by ``logged``
            self._task = task

    async def logged(self, *, failing: bool = False) -> None:
        """Wait for the verdict's row; its error is raised unless the hand-off is ``failing`` already (that error
        goes first)."""
        task, self._task = self._task, None
        if task is None:
            return
        await asyncio.wait({task})
        error = None if task.cancelled() else task.exception()
        if error is not None and not failing:
            raise error
