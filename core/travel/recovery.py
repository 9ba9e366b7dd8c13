"""When a visit goes wrong: abort or fail it, undo its training, restart a dead device or agent, re-key.

Every path leaves the run where the next visit may start: the holder's window closed, the buffer
scrubbed, the model restored from the last good checkpoint when it may be suspect, a fresh epoch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from gputravel.core import events as ev
from gputravel.core.errors import AgentError, CancelledRunError, DeviceError, GpuTravelError, IntegrityError
from gputravel.core.phases import Phase
from gputravel.core.travel.audit import Audit
from gputravel.core.travel.checkpoints import Checkpointer
from gputravel.core.travel.device_session import DeviceSession
from gputravel.core.travel.holders import HolderInfo, HolderLink
from gputravel.core.travel.training_log import TrainingLog
from gputravel.core.travel.visits import Itinerary, VisitRecord

__all__ = ["Recovery"]


class Recovery:
    """The run's recovery paths (one instance per run), over the parts they act on."""

    def __init__(self, *, device: DeviceSession, ckpts: Checkpointer, log: TrainingLog, audit: Audit,
                 walk: Itinerary, links: Mapping[str, HolderLink], infos: MutableMapping[str, HolderInfo]) -> None:
        self.device = device
        self.ckpts = ckpts
        self.log = log
        self.audit = audit
        self.walk = walk
        self.links = links
        self.infos = infos

    async def rekey_session(self, *, reason: str) -> None:
        """A fresh attested session (new ECDH, new master): every key of the old one is dead."""
        d = self.device
        await self.ckpts.settle()  # its end is asked over this session
        old_fp = await d.rekey()
        if self.walk.current is not None:  # the model and code stayed in device memory across the re-key
            await d.check_measurement("after re-keying")
        d.rekeyed()
        self.audit.row("session-rekeyed", epoch=d.epoch, outcome="ok",
                       detail={"reason": reason, "old_session_fp": old_fp, "new_session_fp": d.session_fp()})

    def _failed(self, rec: VisitRecord, error: str, *, outcome: str = "failed") -> str:
        """``rec`` ended in the phase walked now; returns that phase's name."""
        phase = str(self.walk.phase) if self.walk.phase else "?"
        rec.outcome, rec.error, rec.failed_phase = outcome, error, phase
        self.walk.phase = Phase.FAILED
        return phase

    async def recover_device(self, rec: VisitRecord, exc: GpuTravelError) -> None:
        """The device service died mid-visit: start a new one, attest it, open a fresh session (new keys:
        no nonce can repeat), upload the same program, restore the last sealed checkpoint, and let the
        visit be redone. Its partial buffer died with the old device's memory."""
        d = self.device
        last = d.last_error()
        reason = f"{exc.reason} (device: {last})" if last else exc.reason
        error = f"device died: {reason}"
        phase = self._failed(rec, error)
        if not d.can_restart:
            raise DeviceError(f"the device service died: {reason}") from None
        self.log.rollback(rec)
        lost, result, redo = await self._restart_device()
        d.epoch = max(d.epoch, rec.epoch)
        self.audit.record(ev.VisitFailed(time.time(), rec.plan.index, rec.plan.holder, rec.epoch, phase, error,
                                         "device"),
                          "device-restarted", phase=phase, holder=rec.plan.holder, epoch=rec.epoch, outcome="device",
                          detail=self._restarted(rec.plan.index, error, lost, result, redo), state={"epoch": d.epoch})
        self.walk.phase = Phase.DONE
        await self.restart_agent(rec.plan.holder)  # agents mid-transfer to the dead device, for the redo

    async def recover_device_between_visits(self, exc: GpuTravelError) -> bool:
        """The device died between visits (writing the run's last checkpoint in the background): restart it
        as ``recover_device`` does; the visits its lost snapshot held are undone and walked again. False when
        no restart is possible (the caller raises)."""
        d = self.device
        if not d.can_restart:
            return False
        last = d.last_error()
        lost, result, redo = await self._restart_device()
        error = f"{exc.reason}" + (f" (device: {last})" if last else "")
        self.audit.row("device-restarted", outcome="device", detail=self._restarted(None, error, lost, result, redo),
                       state={"epoch": d.epoch})
        return True

    def _restarted(self, visit: int | None, error: str | None, lost: BaseException | None, result: Any,
                   redo: list[VisitRecord]) -> dict[str, Any]:
        """A ``device-restarted`` row's detail."""
        return {"visit": visit, "error": error, "restored_checkpoint": self.ckpts.last_good,
                "redo": [r.plan.index for r in redo], **({"lost_checkpoint": str(lost)} if lost is not None else {}),
                "device_id": result.device_id, "session_fp": self.device.session_fp()}

    async def _restart_device(self) -> tuple[BaseException | None, Any, list[VisitRecord]]:
        """A new device for a dead one: attested, a fresh session, the program, the last durable checkpoint;
        returns why the checkpoint in flight was lost, the new session's answer and the visits undone."""
        self.device.restarts += 1
        lost = await self.ckpts.drop()  # a checkpoint in flight died with the device's snapshot
        result = await self.device.restart()
        if self.ckpts.last_good is not None:
            await self.ckpts.restore(self.ckpts.last_good)
        redo = self.ckpts.rewind()  # visits the restored model does not hold are walked again
        return lost, result, redo

    async def abort_visit(self, rec: VisitRecord, window_open: bool, *, restore: bool) -> dict[str, Any]:
        """Close the window, scrub the partial buffer, restore the model if it is suspect, rotate."""
        client = self.device.client
        out: dict[str, Any] = {}
        if window_open:
            try:
                await asyncio.to_thread(client.close_window, epoch=rec.epoch)
            except GpuTravelError:
                pass
        scrub = await asyncio.to_thread(client.scrub)
        rec.scrub_verified = bool(scrub.verified)
        out["scrub_verified"] = rec.scrub_verified
        if restore:
            # the checkpoint in flight first: once durable it is the last good one (and its visits committed).
            # Reading ``last_good`` before it settles restored the checkpoint before it while the visits it
            # held stayed committed: their training was lost (seen as another final digest under load)
            await self.ckpts.settle()
        last_good = self.ckpts.last_good
        if restore and last_good is not None:
            await self.ckpts.restore(last_good)
            out["restored_checkpoint"] = last_good
            redo = self.ckpts.rewind()  # visits since it (--checkpoint-every > 1) are walked again
            if redo:
                out["redo"] = [r.plan.index for r in redo]
        await asyncio.to_thread(self.device.client.rotate)
        self.device.epoch = max(self.device.epoch, rec.epoch)
        return out

    async def cancel_visit(self, rec: VisitRecord, exc: CancelledRunError, window_open: bool) -> None:
        """The operator cancelled: the visit is aborted (the model was not at risk) and recorded."""
        phase = str(self.walk.phase) if self.walk.phase else None  # the last phase that ran, if any
        out = await self.abort_visit(rec, window_open, restore=False)
        rec.outcome, rec.error, rec.failed_phase = "cancelled", str(exc), phase
        self.walk.phase = Phase.DONE
        steps = len(rec.losses)  # optimizer steps this visit ran before the cancel landed (between two of them)
        self.audit.record(ev.VisitCancelled(time.time(), rec.plan.index, rec.plan.holder, rec.epoch, phase, steps,
                                            bool(out.get("scrub_verified"))),
                          "visit-cancelled", phase=phase, holder=rec.plan.holder, epoch=rec.epoch,
                          key_fp=rec.key_fingerprint, outcome=exc.code,
                          detail={"visit": rec.plan.index, "error": str(exc), "steps": steps, **out},
                          state={"epoch": self.device.epoch})

    async def fail_visit(self, rec: VisitRecord, exc: GpuTravelError, window_open: bool) -> None:
        phase = self._failed(rec, str(exc))
        trained = bool(rec.losses)
        self.log.rollback(rec)
        out = await self.abort_visit(rec, window_open, restore=isinstance(exc, IntegrityError) or trained)
        self.audit.record(ev.VisitFailed(time.time(), rec.plan.index, rec.plan.holder, rec.epoch, phase, str(exc),
                                         exc.code),
                          "visit-failed", phase=phase, holder=rec.plan.holder, epoch=rec.epoch,
                          key_fp=rec.key_fingerprint, outcome=exc.code,
                          detail={"visit": rec.plan.index, "error": str(exc), **out}, state={"epoch": self.device.epoch})
        self.walk.phase = Phase.DONE
        if isinstance(exc, AgentError):
            await self.restart_agent(rec.plan.holder)  # a holder whose agent died, for its next visit

    async def restart_agent(self, holder: str) -> None:
        """Stop the holder's agent and start a fresh one; a failure here surfaces at its next visit."""
        link = self.links[holder]
        try:
            await link.close()
            self.infos[holder] = await link.start()
        except GpuTravelError:
            pass
