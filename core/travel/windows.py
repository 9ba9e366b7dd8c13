"""A visit's hand-off windows: HANDOFF, PROVISION and RETURN over the run's device session.

A visit's window is cut into sub-windows, one provisioning key each (a key's nonce budget,
``handoff.sub_windows``). HANDOFF opens the first for a holder that is verified-ready; PROVISION has the holder
write its ciphertext into each in turn (closing one and handing over the next key when a key's budget is
spent; a lost link resumes from the last contiguous chunk); RETURN closes the last, and the holder's keys are
dead. Every key is a new epoch of the device session; at ``--epoch-limit`` the session is re-keyed first.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, replace
from typing import Any

from gputravel.core import events as ev
from gputravel.core.config import RunSettings
from gputravel.core.errors import LinkLostError, ProtocolError
from gputravel.core.phases import Phase
from gputravel.core.protocol import Direction, provisioning_key
from gputravel.core.protocol.deviceanswers import WindowStatus
from gputravel.core.protocol.holderlink import ProvisioningKey
from gputravel.core.travel import handoff as ho
from gputravel.core.travel.audit import Audit
from gputravel.core.travel.completion import Closing, Pending, ask, provision_visit
from gputravel.core.travel.control import Control
from gputravel.core.travel.device_session import DeviceSession
from gputravel.core.travel.framed_link import FramedLink
from gputravel.core.travel.handoff_relay import Early
from gputravel.core.travel.holders import Handoff, HolderInfo, HolderLink, ProvisionStats
from gputravel.core.travel.visits import Itinerary, VisitRecord

__all__ = ["HandoffWindows", "Visit"]

#: one phase's outcome for its PhaseCompleted event and ledger row: (bytes, detail)
Outcome = tuple[int, dict[str, Any]]


@dataclass(slots=True)
class Visit:
    """What one visit's phases hand each other: its record, its holder's link, its sub-windows, the open one."""

    rec: VisitRecord
    link: HolderLink
    subs: list[tuple[int, int]]
    handoff: Handoff | None = None
    window_open: bool = False
    #: the open window's ``perf_counter_ns`` before its key was asked for and when it came back, and what its
    #: provisioning's link saw (``handoff.fixed_stages``)
    window_ns: tuple[int, int] = (0, 0)
    #: the run's ``Control.paused_ns`` as the visit's first window was asked for: the operator's pauses since are
    #: not the visit's Tx
    paused_ns: int = 0
    stats: ProvisionStats | None = None
    #: the open window's request, carrying its HANDOFF, to be answered at the window's completion
    #: (``RunSettings.grant_at_completion``, core/travel/completion.py), and then its provisioning (``closing``: the
    #: device's ``WindowClosed``, the holder's DONE still to be read)
    pending: Pending | None = None
    closing: Closing | None = None

    def abandon(self) -> None:
        """The visit failed: an answer or a holder's DONE still to come is no longer waited for."""
        if self.pending is not None:
            self.pending.abandon()
        if self.closing is not None:
            self.closing.abandon()
        self.pending = self.closing = None


class HandoffWindows:
    """The run's hand-off windows (one instance per run). ``rejected`` counts the device's rejections by code."""

    def __init__(self, *, device: DeviceSession, audit: Audit, walk: Itinerary, settings: RunSettings,
                 infos: MutableMapping[str, HolderInfo], rekey: Callable[[str], Awaitable[None]],
                 control: Control, emit: Callable[[ev.Event], None]) -> None:
        self.device = device
        self.control = control
        self.emit = emit
        self.audit = audit
        self.walk = walk
        self.settings = settings
        self.infos = infos
        self._rekey = rekey
        self.rejected: Counter[str] = Counter()

    def start(self, rec: VisitRecord, link: HolderLink) -> Visit:
        s = self.settings
        return Visit(rec, link, ho.sub_windows(rec.plan.window_len, chunk_size=s.chunk_size,
                                               key_chunk_budget=s.key_chunk_budget))

    # --- the phases ----------------------------------------------------------------------------------------
    async def handoff(self, v: Visit) -> Outcome:
        """A provisioning key for this window and epoch only, for a holder that is verified-ready."""
        await self.require_ready(v.link)
        v.handoff = await self.open(v, v.subs[0])
        v.window_open = True
        return 0, {"window": [0, v.rec.plan.window_len], "part": v.rec.plan.part_id, "n_windows": len(v.subs)}

    async def provision(self, v: Visit) -> Outcome:
        """Ciphertext from the holder straight into the buffer window, one key per sub-window."""
        rec, plan = v.rec, v.rec.plan
        chunk_size = self.settings.chunk_size
        n_chunks = -(-plan.window_len // chunk_size)
        acked = [0]

        def progress(_seq: int) -> None:
            self.control.check_cancelled()  # a cancel lands between two acknowledged chunks
            acked[0] += 1
            if acked[0] == n_chunks or acked[0] % 4 == 0:
                done = min(plan.window_len, acked[0] * chunk_size)
                self.audit.emit(ev.ProvisionProgressed(time.time(), plan.index, plan.holder, rec.epoch, done,
                                                       plan.window_len))

        def rejected(seq: int | None, code: str, reason: str) -> None:
            self.rejected[code] += 1
            rec.rejected[code] = rec.rejected.get(code, 0) + 1
            epoch = self.device.epoch
            self.audit.record(ev.ChunkRejected(time.time(), plan.index, plan.holder, epoch, seq, code, reason),
                              "chunk-rejected", phase="PROVISION", holder=plan.holder, epoch=epoch,
                              outcome=code, detail={"seq": seq, "reason": reason})

        def resumed(exc: LinkLostError, attempt: int, status: WindowStatus) -> None:
            self.audit.record(ev.ProvisionResumed(time.time(), plan.index, plan.holder, rec.epoch,
                                                  status.contiguous, attempt),
                              "provision-interrupted", phase="PROVISION", holder=plan.holder, epoch=rec.epoch,
                              key_fp=rec.key_fingerprint, nbytes=status.bytes, outcome="link-lost",
                              detail={"error": exc.reason, "resume_from": status.contiguous, "attempt": attempt})

        # the visit's Tx (``provision_s``, the benches' ``tx_s``) is the time its window is open to the holder: from
        # its first key's request (HANDOFF) to the last byte in device memory, whatever the orchestrator did meanwhile
        # (its phase rows and events between HANDOFF and PROVISION, the keys between sub-windows); summing only the
        # link's provisioning left out 6-9 ms a relayed visit while the agent was already sending (task complete14);
        # but not the operator's pauses (a step before PROVISION made a 0.05 s transfer read 2 s: operator walk 15)
        since = v.window_ns[0]
        assert v.handoff is not None
        for i, sub in enumerate(v.subs):
            if i:  # the previous key's nonce budget is spent: close its window, hand over the next key
                await self.close(v, v.handoff, sub_total=v.subs[i - 1][1])
                await self.control.between_steps(Phase.PROVISION, self.emit,
                                                 where=f"PROVISION key {i}/{len(v.subs)}")
                v.handoff = await self.open(v, sub)
            handle = self.device.handle
            endpoint = ho.data_endpoint(handle, data_path=self.settings.data_path, transport=self.settings.transport)
            pending, v.pending = v.pending, None
            if pending is not None:  # its window's request is answered at completion
                v.closing = await provision_visit(self.device.client, pending, v.link, device_socket=handle.socket_path,
                                                  endpoint=endpoint, on_progress=progress, on_reject=rejected,
                                                  on_resume=resumed)
                v.window_ns = (pending.asked_ns, v.closing.answered_ns)
                continue
            stats = await ho.provision(self.device.client, v.link, v.handoff, device_socket=handle.socket_path,
                                       endpoint=endpoint, on_progress=progress, on_reject=rejected,
                                       on_resume=resumed)
            v.stats = stats
            rec.retransmits += stats.retransmits
        rec.provision_s = total_s = (time.perf_counter_ns() - since - (self.control.paused_ns - v.paused_ns)) / 1e9
        return plan.window_len, {"mb_s": round(plan.window_len / max(total_s, 1e-9) / 1e6, 2),
                                 "retransmits": rec.retransmits}

    async def return_(self, v: Visit) -> Outcome:
        """The holder's key dies."""
        rec = v.rec
        assert v.handoff is not None
        await self.close(v, v.handoff, sub_total=v.subs[-1][1])
        v.window_open = False
        v.handoff = None
        if rec.bytes != rec.plan.window_len:
            raise ProtocolError(f"holder returned with {rec.bytes} of {rec.plan.window_len} bytes provisioned")
        return rec.bytes, {"chunks": rec.chunks}

    def prefetch(self, rec: VisitRecord, links: Mapping[str, HolderLink]) -> None:
        """While ``rec`` trains, the next visit's holder attests the key its first window will have: the same
        epoch the device will grant next and the key it derives for that window (``provisioning_key`` of the
        session this orchestrator shares with the device; the key itself never leaves here). Should anything
        move the epoch or the session first (a failed visit, a re-key, a restarted device), the prediction
        misses and that hand-off attests afresh (``FramedSession._attested``)."""
        nxt = next((r for r in self.walk.records if r.plan.index > rec.plan.index
                    and not r.outcome.startswith("done")), None)
        if nxt is not None:
            self.prefetch_for(nxt, links)

    def prefetch_for(self, nxt: VisitRecord, links: Mapping[str, HolderLink]) -> None:
        """``nxt``'s holder attests the key of its first window now, in the background: called as the visit
        before it trains (``prefetch``) and as ``nxt``'s own ATTEST phase begins (a run's first visit, a visit
        after a failed one: its holder checks the evidence while the orchestrator checks the GPU). A link that
        holds that very verdict already keeps it."""
        if not self.settings.attest_prefetch:
            return
        secrets = self.device.client.secrets
        if secrets is None:
            return
        epoch = self.device.epoch + 1
        limit = self.settings.epoch_limit
        if limit and epoch - self.device.epoch_base > limit:
            return  # that hand-off re-keys the session first: a new key
        skip, length = self.start(nxt, links[nxt.plan.holder]).subs[0]
        key = provisioning_key(secrets.master, secrets.session_id, epoch=epoch, offset=skip, length=length,
                               direction=Direction.HOLDER_TO_DEVICE)
        links[nxt.plan.holder].prefetch_attestation(epoch=epoch, key_fp=key.fingerprint)

    # --- one window ------------------------------------------------------------------------------------------
    async def require_ready(self, link: HolderLink) -> None:
        """No key to a holder that is not verified-ready: one whose agent or session died while it waited
        is brought back first (the link marks it offline, reconnects with backoff and verifies the agent's
        hash again); if it does not come back, the visit fails here, before any window is opened."""
        if link.ready:
            return
        await link.settle_attestation()  # nothing may read the link while it is brought back
        info = await link.ensure_ready()
        if not link.ready:
            raise LinkLostError(link.name, f"not verified-ready ({link.state}); no key released")
        if info is not None:
            self.infos[link.name] = info

    async def open(self, v: Visit, sub: tuple[int, int]) -> Handoff:
        """A new epoch and a provisioning key for bytes [skip, skip+length) of the visit's window."""
        rec = v.rec
        epoch = self.device.epoch + 1
        limit = self.settings.epoch_limit
        if limit and epoch - self.device.epoch_base > limit:
            await self._rekey(f"epoch limit {limit} reached")
        skip, length = sub
        plan = rec.plan
        # the rows so far on disk before the key is asked for, so the head a HANDOFF carries (a holder's witness)
        # needs no flush of its own inside the window's time
        self.audit.flush()
        t0 = time.perf_counter_ns()
        if not rec.key_fingerprint:
            v.paused_ns = self.control.paused_ns
        early = None if rec.key_fingerprint else self._with_window(v, epoch, sub)  # a visit's first key only
        if early is not None and self.settings.grant_at_completion:  # answered at completion (completion.py)
            handoff = early[0]
            v.pending = await ask(self.device.client, handoff, early[1], holder=plan.holder, asked_ns=t0)
            key_fp = handoff.key.fingerprint if handoff.key is not None else ""
        elif early is not None:  # the HANDOFF goes with the window's request (core/travel/handoff_relay.py)
            handoff = early[0]
            key_fp = await ho.open_window_relaying(self.device.client, handoff, early[1], holder=plan.holder)
        else:
            handoff, key_fp = await ho.open_window(
                self.device.client, epoch=epoch, skip=skip, length=length, chunk_size=self.settings.chunk_size,
                train=(plan.train_start, plan.train_len), val=(plan.val_start, plan.val_len),
                conventional=self.settings.data_path == "conventional", ledger_head=None)
        v.window_ns, v.stats = (t0, time.perf_counter_ns()), None
        self.device.epoch = epoch
        if not rec.key_fingerprint:
            rec.epoch, rec.key_fingerprint = epoch, key_fp
        else:
            self.audit.row("key-handed-over", phase="PROVISION", holder=rec.plan.holder, epoch=epoch, key_fp=key_fp,
                           nbytes=length, detail={"visit": rec.plan.index, "skip": skip})
        if early is not None:  # the head it was wrapped with: the head now (a visit's first key writes no row here)
            return handoff
        return replace(handoff, ledger_head=self.audit.head())  # the head after this hand-off's own rows

    def _with_window(self, v: Visit, epoch: int, sub: tuple[int, int]) -> tuple[Handoff, Early] | None:
        """The hand-off of ``sub`` in ``epoch``, built before its window opens with the key the device will derive
        (the session's master secret is shared), and the link's HANDOFF wrapped from it for the window's request
        (``FramedSession.prepare_handoff``: only on the holder's ok verdict for that very epoch and key, fetched
        ahead, and a data connection parked at the device); None: the window opens as before."""
        s, secrets, link = self.settings, self.device.client.secrets, v.link
        if not s.handoff_with_window or secrets is None or not isinstance(link, FramedLink) or s.data_path != "direct":
            return None
        skip, length = sub
        plan = v.rec.plan
        key = provisioning_key(secrets.master, secrets.session_id, epoch=epoch, offset=skip, length=length,
                               direction=Direction.HOLDER_TO_DEVICE)
        base = Handoff.for_window(epoch=epoch, session_id=secrets.session_id.hex(), key=ProvisioningKey.of(key),
                                  skip=skip, length=length, chunk_size=s.chunk_size,
                                  train=(plan.train_start, plan.train_len), val=(plan.val_start, plan.val_len),
                                  ledger_head=self.audit.head())
        endpoint = ho.data_endpoint(self.device.handle, data_path=s.data_path, transport=s.transport)
        early = link.session.prepare_handoff(base, data_endpoint=endpoint)
        return None if early is None else (base, early)

    async def close(self, v: Visit, handoff: Handoff, *, sub_total: int) -> None:
        """The window's key dies (unless the device closed it in its answer at completion) and the holder's DONE is
        read (before its link carries anything else): what the window received, its fixed cost by stage."""
        rec = v.rec
        closing, v.closing = v.closing, None
        if closing is not None:
            v.stats = await closing.finish()
            rec.retransmits += v.stats.retransmits
        closed = closing.closed if closing is not None and closing.closed is not None else \
            await ho.close_window(self.device.client, handoff)
        if v.stats is not None:  # the hand-off's fixed cost by stage, summed over the visit's keys
            rec.attest_prefetched = rec.attest_prefetched or v.stats.attest_prefetched
            rec.handoff_relayed = rec.handoff_relayed or v.stats.relayed
            rec.handoff_fixed_ms = ho.add_stages(rec.handoff_fixed_ms, ho.fixed_stages(
                window_ns=v.window_ns, stats=v.stats, closed=closed))
        self.audit.rejections({str(handoff.epoch): closed.rejected_in_window}, self.walk.records)
        rec.bytes += closed.bytes
        rec.chunks += closed.chunks
        ho.require_complete(closed, sub_total)
