"""When a visit goes wrong: abort or fail it, undo its training, restart a dead device or agent, re-key.

Every path leaves the run where the next visit may start: the holder's window closed, the buffer
scrubbed, the model restored from the last good checkpoint when it may be suspect, a fresh epoch.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from gputravel.core import events as ev
from gputravel.core.errors import AgentError, CancelledRunError, DeviceError, GpuTravelError, IntegrityError
from gputravel.core.travel.phases import Phase
from gputravel.core.travel.report import VisitRecord

if TYPE_CHECKING:
    from gputravel.core.travel.engine import TravelEngine

__all__ = ["Recovery"]


class Recovery:
    """The engine's recovery paths (one instance per engine)."""

    def __init__(self, engine: TravelEngine) -> None:
        self.engine = engine

    async def rekey_session(self, *, reason: str) -> None:
        """A fresh attested session (new ECDH, new master): every key of the old one is dead."""
        e = self.engine
        await e.ckpts.settle()  # its end is asked over this session
        old_fp = e.client.secrets.fingerprint() if e.client.secrets else None
        e.client.close()
        e.client = e.new_client()
        for attempt in range(50):  # the device frees its control slot when it sees the old connection close
            try:
                await asyncio.to_thread(e.client.connect)
                break
            except DeviceError:
                if attempt == 49:
                    raise
                await asyncio.sleep(0.1)
                e.client = e.new_client()
        if e.current is not None:  # the model and code stayed in device memory across the re-key
            await e.check_measurement("after re-keying")
        e.session_epoch_base = e.epoch
        e.session_rekeys += 1
        e.audit.row("session-rekeyed", epoch=e.epoch, outcome="ok",
                    detail={"reason": reason, "old_session_fp": old_fp,
                            "new_session_fp": e.client.secrets.fingerprint() if e.client.secrets else None})

    async def recover_device(self, rec: VisitRecord, exc: GpuTravelError) -> None:
        """The device service died mid-visit: start a new one, attest it, open a fresh session (new keys:
        no nonce can repeat), upload the same program, restore the last sealed checkpoint, and let the
        visit be redone. Its partial buffer died with the old device's memory."""
        e = self.engine
        phase = str(e.phase) if e.phase else "?"
        last = e.device_last_error()
        reason = f"{exc.reason} (device: {last})" if last else exc.reason
        rec.outcome, rec.error, rec.failed_phase = "failed", f"device died: {reason}", phase
        e.phase = Phase.FAILED
        if e.restart_device is None or e.device_restarts >= 3:
            raise DeviceError(f"the device service died: {reason}") from None
        self.rollback_training(rec)
        lost, result, redo = await self._restart_device()
        e.epoch = max(e.epoch, rec.epoch)
        e.audit.record(ev.VisitFailed(time.time(), rec.plan.index, rec.plan.holder, rec.epoch, phase, rec.error,
                                      "device"),
                       "device-restarted", phase=phase, holder=rec.plan.holder, epoch=rec.epoch, outcome="device",
                       detail={"visit": rec.plan.index, "error": rec.error, "restored_checkpoint": e.last_good_ckpt,
                               "redo": [r.plan.index for r in redo],
                               **({"lost_checkpoint": str(lost)} if lost is not None else {}),
                               "device_id": result.device_id,
                               "session_fp": e.client.secrets.fingerprint() if e.client.secrets else None},
                       state={"epoch": e.epoch})
        e.phase = Phase.DONE
        await self.restart_agent(rec.plan.holder)  # agents mid-transfer to the dead device, for the redo

    async def recover_device_between_visits(self, exc: GpuTravelError) -> bool:
        """The device died between visits (writing the run's last checkpoint in the background): restart it
        as ``recover_device`` does; the visits its lost snapshot held are undone and walked again. False when
        no restart is possible (the caller raises)."""
        e = self.engine
        if e.restart_device is None or e.device_restarts >= 3:
            return False
        last = e.device_last_error()
        lost, result, redo = await self._restart_device()
        e.audit.row("device-restarted", outcome="device",
                    detail={"visit": None, "error": f"{exc.reason}" + (f" (device: {last})" if last else ""),
                            "restored_checkpoint": e.last_good_ckpt, "redo": [r.plan.index for r in redo],
                            **({"lost_checkpoint": str(lost)} if lost is not None else {}),
                            "device_id": result.device_id,
                            "session_fp": e.client.secrets.fingerprint() if e.client.secrets else None},
                    state={"epoch": e.epoch})
        return True

    async def _restart_device(self) -> tuple[BaseException | None, Any, list[VisitRecord]]:
        """A new device for a dead one: attested, a fresh session, the program, the last durable checkpoint;
        returns why the checkpoint in flight was lost, the new session's answer and the visits undone."""
        e = self.engine
        restart = e.restart_device
        assert restart is not None  # the callers check it
        e.device_restarts += 1
        lost = await e.ckpts.drop()  # a checkpoint in flight died with the device's snapshot
        e.client.close()
        e.handle.stop()
        e.handle = await asyncio.to_thread(restart)
        e.client = e.new_client()
        e._rejection_gen = 0  # a new device counts its rejections from the start
        result = await asyncio.to_thread(e.client.connect)
        await e.upload_program()
        await e.configure_data_path()
        if e.last_good_ckpt is not None:
            await e.restore(e.last_good_ckpt)
        redo = e.ckpts.rewind()  # visits the restored model does not hold are walked again
        return lost, result, redo

    def rollback_training(self, rec: VisitRecord) -> None:
        """A visit that trained and then failed is undone (the model is restored from the checkpoint)."""
        e = self.engine
        if rec.losses:
            del e.loss_history[len(e.loss_history) - len(rec.losses):]
            e.step_count -= len(rec.losses)
            e.val_history = [v for v in e.val_history if v[0] <= e.step_count]

    async def abort_visit(self, rec: VisitRecord, window_open: bool, *, restore: bool) -> dict[str, Any]:
        """Close the window, scrub the partial buffer, restore the model if it is suspect, rotate."""
        e = self.engine
        out: dict[str, Any] = {}
        if window_open:
            try:
                await asyncio.to_thread(e.client.close_window, epoch=rec.epoch)
            except GpuTravelError:
                pass
        scrub = await asyncio.to_thread(e.client.scrub)
        rec.scrub_verified = bool(scrub.verified)
        out["scrub_verified"] = rec.scrub_verified
        if restore and e.last_good_ckpt is not None:
            await e.restore(e.last_good_ckpt)  # after the checkpoint in flight (it may be the one restored)
            out["restored_checkpoint"] = e.last_good_ckpt
            redo = e.ckpts.rewind()  # visits since it (--checkpoint-every > 1) are walked again
            if redo:
                out["redo"] = [r.plan.index for r in redo]
        await asyncio.to_thread(e.client.rotate)
        e.epoch = max(e.epoch, rec.epoch)
        return out

    async def cancel_visit(self, rec: VisitRecord, exc: CancelledRunError, window_open: bool) -> None:
        """The operator cancelled: the visit is aborted (the model was not at risk) and recorded."""
        e = self.engine
        phase = str(e.phase) if e.phase else None  # the last phase that ran, if any
        out = await self.abort_visit(rec, window_open, restore=False)
        rec.outcome, rec.error, rec.failed_phase = "cancelled", str(exc), phase
        e.phase = Phase.DONE
        steps = len(rec.losses)  # optimizer steps this visit ran before the cancel landed (between two of them)
        e.audit.record(ev.VisitCancelled(time.time(), rec.plan.index, rec.plan.holder, rec.epoch, phase, steps,
                                         bool(out.get("scrub_verified"))),
                       "visit-cancelled", phase=phase, holder=rec.plan.holder, epoch=rec.epoch,
                       key_fp=rec.key_fingerprint, outcome=exc.code,
                       detail={"visit": rec.plan.index, "error": str(exc), "steps": steps, **out},
                       state={"epoch": e.epoch})

    async def fail_visit(self, rec: VisitRecord, exc: GpuTravelError, window_open: bool) -> None:
        e = self.engine
        phase = str(e.phase) if e.phase else "?"
        rec.outcome, rec.error, rec.failed_phase = "failed", str(exc), phase
        e.phase = Phase.FAILED
        trained = bool(rec.losses)
        self.rollback_training(rec)
        out = await self.abort_visit(rec, window_open, restore=isinstance(exc, IntegrityError) or trained)
        e.audit.record(ev.VisitFailed(time.time(), rec.plan.index, rec.plan.holder, rec.epoch, phase, str(exc),
                                      exc.code),
                       "visit-failed", phase=phase, holder=rec.plan.holder, epoch=rec.epoch,
                       key_fp=rec.key_fingerprint, outcome=exc.code,
                       detail={"visit": rec.plan.index, "error": str(exc), **out}, state={"epoch": e.epoch})
        e.phase = Phase.DONE
        if isinstance(exc, AgentError):
            await self.restart_agent(rec.plan.holder)  # a holder whose agent died, for its next visit

    async def restart_agent(self, holder: str) -> None:
        """Stop the holder's agent and start a fresh one; a failure here surfaces at its next visit."""
        e = self.engine
        link = e.links[holder]
        try:
            await link.close()
            e.infos[holder] = await link.start()
        except GpuTravelError:
            pass
