"""A relayed HANDOFF's window request answered at the window's completion (issue 34 item 2, task complete14).

Where the window's request carries the HANDOFF (``handoff_relay``'s ``Early``), the device may hold its answer
until the window is complete: its grant and its ``WindowClosed`` in one answer (``LoopCaller.handoff_until_complete``).
Then no grant crosses back to the orchestrator's loop during the data and no close request reaches the device during
it: the device's control thread relays the HANDOFF, sleeps on the window's ``completed`` condition (notified once, as
the last chunk lands, or as a data connection ends) and answers. The hand-off ends on that answer; the holder's DONE
over its link is read after, off the path (``Closing.finish``: before RETURN ends and before that link's next key),
its stats kept in the report.

Everything else stays: the HANDOFF goes over the holder link too, once the answer is in (the record and the fallback:
an agent that took the relayed copy skips it by its ``relay`` id); nothing of the holder link is written or read during
the data, its progress and refusals are read after the answer, in order. A HANDOFF the device did not relay is
answered at once and the hand-off ends on DONE; so does a window not complete within the bound (``answer_bound_s``) or
whose holder's data connection went (the answer is then the open window's status, RETURN closes it); a holder link
lost mid-window resumes from the device's last contiguous chunk, and one lost after the window completed resumes
nothing (the link is brought back). On by default since session 14 (``RunSettings.grant_at_completion``):
docs/performance.md, "task complete14" and "Session 14".
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.deviceclient.onloop import Completion
from gputravel.core.errors import DeviceError, LinkLostError
from gputravel.core.protocol.deviceanswers import WindowClosed
from gputravel.core.protocol.holderlink import DataEndpoint, Handoff
from gputravel.core.travel import handoff as ho
from gputravel.core.travel.handoff_relay import Early
from gputravel.core.travel.holders import HolderLink, ProgressFn, ProvisionStats, RejectFn

__all__ = ["ANSWER_BASE_S", "ANSWER_MAX_S", "ANSWER_MB_S", "Closing", "Pending", "answer_bound_s", "ask",
           "provision_visit"]

#: how long the device may hold the answer: a base plus the window's bytes at a rate far below any path's, at most
#: ``ANSWER_MAX_S``. Every other device call waits behind the held request that long at most (a window slower than
#: that only loses the shortcut: its hand-off ends on DONE)
ANSWER_BASE_S = 0.25
ANSWER_MB_S = 200.0
ANSWER_MAX_S = 2.0


def answer_bound_s(nbytes: int) -> float:
    """The ``when_complete`` bound for a window of ``nbytes``."""
    return min(ANSWER_MAX_S, ANSWER_BASE_S + nbytes / (ANSWER_MB_S * 1e6))


@dataclass(slots=True)
class Pending:
    """A window's request on its way, answered at completion: ``base`` the hand-off it opens, ``early`` the HANDOFF it
    carries, ``asked_ns`` when it was written (``perf_counter_ns``)."""

    base: Handoff
    early: Early
    answer: asyncio.Task[Completion]
    asked_ns: int

    def abandon(self) -> None:
        """The visit failed before the answer was taken: stop waiting (the device client reads it in a thread)."""
        self.answer.cancel()


async def ask(client: DeviceClient, base: Handoff, early: Early, *, holder: str, asked_ns: int) -> Pending:
    """The window's request for ``base`` carrying ``early.outgoing``, answered at completion; returns once it is
    written (the loop's first step of the call), its answer still to come (``early.delivered`` is set from it; the
    link's copy, sent after the answer, is that very HANDOFF). ``asked_ns``: the moment the caller's account of the
    window's request starts (``perf_counter_ns``; the window's ``window_ns``), the HANDOFF's wrap included."""
    answer = asyncio.ensure_future(client.on_loop.handoff_until_complete(
        epoch=base.epoch, offset=base.skip, length=base.window_len, chunk_size=base.chunk_size,
        relay=(holder, early.outgoing.to_wire()), within=answer_bound_s(base.window_len)))
    await asyncio.sleep(0)  # the call's first step seals and writes the request
    return Pending(base, early, answer, asked_ns)


@dataclass(slots=True)
class Closing:
    """One hand-off's provisioning when its window's request was answered at completion: ended by the device
    (``closed`` set, the holder's DONE ``done`` still to be read) or by the DONE (``stats`` set)."""

    #: ``perf_counter_ns`` when the answer came back (the window's request's ``window_ns`` end)
    answered_ns: int
    stats: ProvisionStats | None = None
    closed: WindowClosed | None = None
    done: asyncio.Future[ProvisionStats] | None = None
    relayed: bool = field(default=False)
    #: the holder link whose DONE is still to be read (brought back if it dropped after the window completed)
    link: HolderLink | None = None

    async def finish(self) -> ProvisionStats:
        """The hand-off's stats once the holder's DONE is read (its errors raised). Where the device's answer ended it,
        ``done`` is that answer's moment (``handoff.fixed_stages``: the ``done`` stage ends at the device's answer) and
        ``done_read`` the DONE's."""
        if self.stats is None:
            assert self.done is not None
            try:
                stats = await self.done
            except LinkLostError:
                if self.link is None or self.closed is None or not self.closed.complete:
                    raise
                # the link dropped after the window completed: nothing to resume, only the link to bring back
                await self.link.reconnect()
                stats = ProvisionStats(marks_ns={"done": self.answered_ns})
            stats.marks_ns["done_read"] = stats.marks_ns.get("done", self.answered_ns)
            stats.marks_ns["done"] = self.answered_ns
            self.stats = stats
        self.stats.relayed = self.stats.relayed or self.relayed
        return self.stats

    def abandon(self) -> None:
        """The visit failed before DONE was read: stop reading it."""
        if self.done is not None and not self.done.done():
            self.done.cancel()


def _taken(p: Pending) -> tuple[WindowClosed | None, bool]:
    """The device's answer, checked: the window closed (None: it answered the grant alone or the open window's
    status) and whether it relayed the HANDOFF; a grant of another key than ``base``'s is ``DeviceError``."""
    grant, end = p.answer.result()
    base = p.base
    if base.key is None or grant.provisioning_key != base.key or grant.session_id != base.session_id:
        raise DeviceError(f"the device granted key {grant.key_fingerprint} for epoch {base.epoch}, not the one the "
                          f"session's secrets derive ({base.key.fingerprint if base.key else '-'})")
    p.early.delivered = grant.relayed
    return (end if isinstance(end, WindowClosed) else None), grant.relayed


async def provision_completing(p: Pending, link: HolderLink, *, device_socket: str, endpoint: DataEndpoint | None,
                               on_progress: ProgressFn | None = None, on_reject: RejectFn | None = None) -> Closing:
    """The device's answer first, then ``link.provision`` of ``p.base`` (the HANDOFF's copy over the holder link, which
    an agent that took the relayed one skips, its progress, its DONE). With the window closed in the answer the
    hand-off ends there and the DONE is read after (``Closing.finish``); else it ends on DONE. Nothing of the holder
    link is read or written during the data: the progress and any refusals are read after the answer, in order.
    The link's errors are raised as ``link.provision`` raises them (``provision_visit`` resumes a dropped link)."""
    try:
        await asyncio.wait({p.answer})
    except asyncio.CancelledError:
        p.abandon()
        raise
    now = time.perf_counter_ns()
    closed, relayed = _taken(p)  # the device's error, if it failed, is the hand-off's
    done = asyncio.get_running_loop().create_task(link.provision(
        p.base, device_socket=device_socket, on_progress=on_progress, on_reject=on_reject, data_endpoint=endpoint))
    if closed is not None:
        return Closing(now, closed=closed, done=done, relayed=relayed, link=link)
    stats = await done  # not relayed, not complete in time, or the agent's connection went: DONE ends it
    return Closing(now, stats=stats, relayed=relayed)


async def provision_visit(client: DeviceClient, p: Pending, link: HolderLink, *, device_socket: str,
                          endpoint: DataEndpoint | None, on_progress: ProgressFn | None = None,
                          on_reject: RejectFn | None = None, on_resume: ho.ResumeFn | None = None) -> Closing:
    """``provision_completing``, and after a dropped link ``handoff.provision``'s resumption (which ends on DONE)."""
    try:
        return await provision_completing(p, link, device_socket=device_socket, endpoint=endpoint,
                                          on_progress=on_progress, on_reject=on_reject)
    except LinkLostError as exc:
        resumed = await ho.resume(client, link, p.base, exc, 1, on_resume)
    stats = await ho.provision(client, link, resumed, device_socket=device_socket, endpoint=endpoint,
                               on_progress=on_progress, on_reject=on_reject, on_resume=on_resume, attempt=1)
    return Closing(time.perf_counter_ns(), stats=stats)
