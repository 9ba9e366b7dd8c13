"""Checkpoints off the critical path: the device snapshots its state and seals it in the background while
the next visit goes on; a visit is committed (its ``visit-completed`` row, the resume point) only once the
checkpoint holding it is durable.

The way asynchronous checkpointing does it (PyTorch DCP's ``async_save``, CheckFreq): snapshot, then
persist in the background. At ROTATE the device copies its state in its own memory (``snapshot``: device
memory on a GPU) and seals that copy on a thread of its own into a shared-memory ring, which a thread here
drains into the checkpoint's temporary file; the ROTATE phase waits only for the copy. When the ring is
drained the file is fsynced, the device's account of the stream is asked for over the control link
(``checkpoint_end``: the tag digest, checked against the tags written), the meta record is written, the
file renamed into place; then the visits it holds get their ``visit-completed`` rows, which move the
ledger's resume point, and only then are old checkpoints pruned (the last ``keep``, never the one the
ledger names).

One checkpoint is in flight at a time: the next ROTATE, a restore, a failed visit and the run's end all
wait for it first (``settle``). ``--checkpoint-every N`` checkpoints every N-th visit (and the last), so a
checkpoint may hold several visits; if one is lost (the device died with its snapshot) or the model is
restored from an older one, the visits it held are undone and redone (``rewind``), so resume semantics
stay exact: no visit is repeated or skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gputravel.core.allocator import release_free_memory
from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.deviceclient.ringckpt import RingCheckpoint
from gputravel.core.errors import GpuTravelError, IntegrityError
from gputravel.core.protocol.deviceanswers import StreamEnded
from gputravel.core.training.store import CheckpointStore, CheckpointWriter
from gputravel.core.travel.audit import Audit
from gputravel.core.travel.control import Faults
from gputravel.core.travel.device_session import DeviceSession
from gputravel.core.travel.probes import EngineProbe
from gputravel.core.travel.training_log import TrainingLog
from gputravel.core.travel.visits import Itinerary, VisitRecord

__all__ = ["BackgroundCommit", "Checkpointer", "VisitCommit", "seal_to_file"]


def seal_to_file(client: DeviceClient, pending: RingCheckpoint, writer: CheckpointWriter, *,
                 alive: Callable[[], bool] | None = None,
                 add: Callable[[int, memoryview], None] | None = None) -> StreamEnded:
    """A ring checkpoint's sealed chunks into ``writer``'s file, on the disk (fsynced): the way every ring
    checkpoint goes, a run's (in the background) and ``bench checkpoint``'s. The device seals chunk ``i + 1``
    into the ring while this thread writes chunk ``i`` from its slot (no copy), and the disk writes back what
    was written while more comes (:class:`~gputravel.core.files.Writeback`). Returns the device's account
    (``checkpoint_end``) once its tag digest matched the tags written; the caller commits the file (its meta
    record, the rename). ``add`` (default ``writer.add``) takes each chunk; ``alive`` says whether the device
    still lives while the drain waits."""
    try:
        pending.drain(add or writer.add, alive=alive)
        writer.sync()  # the bulk reaches the disk here, off the control link
    except BaseException:
        with contextlib.suppress(Exception):  # the device's account; the drain's error is the one told
            client.checkpoint_end(pending)
        raise
    done = client.checkpoint_end(pending)
    if done.tag_digest != writer.tag_digest:
        raise IntegrityError(f"checkpoint {writer.header.seq}: the chunks written differ from those the device sealed")
    return done


@dataclass
class _Pending:
    seq: int
    visits: list[VisitRecord]
    state: dict[str, Any]
    task: asyncio.Task[None]
    t0: float = field(default_factory=time.perf_counter)


class Checkpointer:
    """The run's checkpoints: written at once (set-up, a fleet) or in the background (a visit's ROTATE), and
    restored; which one is the last good one and the model digest of each."""

    def __init__(self, *, store: CheckpointStore, device: DeviceSession, log: TrainingLog, audit: Audit,
                 walk: Itinerary, faults: Faults, timing: EngineProbe, run_id: str, every: int = 1,
                 settings_sha256: str | None = None) -> None:
        self.store = store
        self.device = device
        self.log = log
        self.audit = audit
        self.walk = walk
        self.faults = faults
        self.timing = timing
        #: checkpoints are bound to the run that started them (a resumed run keeps its first run's id)
        self.run_id = run_id
        self.every = every
        self.settings_sha256 = settings_sha256
        #: the last durable (or restored) checkpoint, the model digest of each this run wrote (as the device
        #: reported it, and the ledger records), and the last one's figures
        self.last_good: int | None = None
        self.digests: dict[int, str] = {}
        self.last: dict[str, Any] = {}
        self.pending: _Pending | None = None
        #: visits done since the last durable checkpoint, oldest first (committed with the next one)
        self.uncommitted: list[VisitRecord] = []
        #: of those, the ones no checkpoint holds yet (the next one started will)
        self.unclaimed: list[VisitRecord] = []
        self.background_s = 0.0  # seconds checkpoints spent in the background (off the critical path)
        self._committed: set[int] = set()  # visits whose rows a checkpoint's commit wrote
        self.final_wait_s = 0.0

    def done(self, rec: VisitRecord) -> None:
        """``rec`` is done: it is committed with the next checkpoint begun (and once that is durable)."""
        self.uncommitted.append(rec)
        self.unclaimed.append(rec)

    def claim(self) -> list[VisitRecord]:
        """The visits the checkpoint about to begin holds."""
        claimed, self.unclaimed = self.unclaimed, []
        return claimed

    def owns(self, rec: VisitRecord) -> bool:
        """Whether ``rec`` is committed by a checkpoint (so its row is written when that one is durable)."""
        return rec in self.uncommitted or rec.plan.index in self._committed

    async def finish(self) -> None:
        """The run's end: the checkpoint in flight, and one for any visit done since, durable before it ends.
        The wait (``final_wait_s``) is protocol time after the last visit's phases."""
        t0 = time.perf_counter()
        await self.settle()
        if self.unclaimed:
            await self.write(self.unclaimed[-1].plan.index + 1, visits=self.claim())
        self.final_wait_s += time.perf_counter() - t0

    def summary(self) -> dict[str, Any]:
        """For the run's report: the cadence, what was kept, and the time spent in the background and waiting."""
        return {"every": self.every, "keep": self.store.keep,
                "kept": [seq for seq, _ in self.store.checkpoints()], "background_s": round(self.background_s, 6),
                "final_wait_s": round(self.final_wait_s, 6), "last": self.last}

    async def checkpoint(self, seq: int, *, note: str = "") -> None:
        """Checkpoint ``seq`` now, durable on return; its model is the one expected from here."""
        await self.write(seq, note=note)
        self.device.expected_model = self.digests[seq]

    async def restore(self, seq: int) -> None:
        """Checkpoint ``seq`` into the device (after the one in flight: it may be the one restored); the model
        must have the digest this run recorded for it (the ledger's, else the file's meta record)."""
        await self.settle()
        await self.device.restore(self.store, seq, run_id=self.run_id, want=self.digests.get(seq))
        self.last_good = seq

    # --- writing ------------------------------------------------------------------------------------
    async def write(self, seq: int, *, note: str = "", visits: list[VisitRecord] | None = None,
                    background: bool = False) -> None:
        """Checkpoint ``seq`` of the device's state now; with ``background``, return once the device holds its
        snapshot (the rest goes on while the caller does). ``visits`` are committed when it is durable."""
        await self.settle()
        t0 = time.perf_counter()
        header = self.store.new_header(run_id=self.run_id, seq=seq)
        key = self.store.run_key(self.run_id)
        writer = self.store.writer(header)
        try:
            pending = await asyncio.to_thread(self.device.client.checkpoint_begin, key, header, snapshot=background)
        except BaseException:
            writer.abort()
            raise
        state = {"steps": self.log.step_count, "epoch": self.device.epoch, "note": note}
        covered = list(visits or [])
        task = asyncio.ensure_future(self._persist(seq, writer, pending, state, covered, t0))
        self.pending = _Pending(seq, covered, state, task, t0)
        if not background:
            await self.settle()

    async def _persist(self, seq: int, writer: CheckpointWriter, pending: RingCheckpoint, state: dict[str, Any],
                       covered: list[VisitRecord], t0: float) -> None:
        device = self.device
        plan = self.faults.plan
        armed = plan is not None and plan.matches("CHECKPOINT", seq - 1, 1)

        def add(kind: int, sealed: memoryview) -> None:
            writer.add(kind, sealed)
            if armed and writer.chunks == 1 and plan is not None:  # fault injection: die mid-write
                self.faults.plan = None
                self.faults.fire(plan, None)

        try:
            done = await asyncio.to_thread(seal_to_file, device.client, pending, writer, alive=device.handle.alive,
                                           add=add)
            # with the state: the ledger head and the settings this checkpoint continues (the meta record is
            # MACed under the run key), so a resume can prove the ledger was neither cut nor rewritten and
            # the settings not changed behind its back
            seq_now, hash_now = self.audit.ledger.head()
            meta = {"model_digest": done.model_digest, "seq": seq, "epoch": state["epoch"], "note": state["note"],
                    "steps": state["steps"], "bytes": done.bytes, "chunks": done.chunks,
                    "ledger_head": [seq_now, hash_now] if seq_now else None, "settings_sha256": self.settings_sha256}
            await asyncio.to_thread(writer.commit, meta, prune=False)
        except BaseException:
            writer.abort()
            raise
        seconds = time.perf_counter() - t0
        self.last_good = seq
        self.digests[seq] = done.model_digest
        self.last = {"seq": seq, "bytes": done.bytes, "chunks": done.chunks, "seconds": round(seconds, 6),
                             "digest_s": round(done.digest_s, 6), "model_digest": done.model_digest,
                             "snapshot_s": round(done.snapshot_s, 6), "seal_s": round(done.seal_s, 6)}
        self.timing.on_checkpoint(seq, seconds)
        self._commit(seq, covered, state)

    def _commit(self, seq: int, covered: list[VisitRecord], state: dict[str, Any]) -> None:
        """The checkpoint is durable: its visits are committed (their rows move the resume point), then the
        checkpoints beyond the last ``keep`` go (never the one the ledger now names)."""
        for i, rec in enumerate(covered):
            last = i == len(covered) - 1
            done = sorted({r.plan.index for r in self.walk.records
                           if r.outcome.startswith("done") and r not in self.uncommitted}
                          | {r.plan.index for r in covered})
            self.audit.row("visit-completed", holder=rec.plan.holder, epoch=rec.epoch, key_fp=rec.key_fingerprint,
                           nbytes=rec.bytes, duration_s=sum(rec.phase_s.values()), outcome="ok",
                           detail={"visit": rec.plan.index, "part": rec.plan.part_id, "checkpoint_seq": seq},
                           state=None if not last else {
                               "visits_done": done, "epoch": max(self.device.epoch, int(state["epoch"])),
                               "checkpoint_seq": seq, "checkpoint_digest": self.digests.get(seq),
                               "steps": state["steps"]})
        self.uncommitted = [r for r in self.uncommitted if r not in covered]
        self._committed.update(r.plan.index for r in covered)
        self.store.prune(protect=seq)

    async def settle(self) -> None:
        """Wait for the checkpoint in flight (if any); its failure is raised here."""
        p = self.pending
        if p is None:
            return
        try:
            await asyncio.shield(p.task)
        finally:
            if p.task.done():
                self.pending = None
                self.background_s += time.perf_counter() - p.t0

    async def drop(self) -> BaseException | None:
        """The device died: the checkpoint in flight (if any) is lost with its snapshot; returns why."""
        try:
            await self.settle()
        except (GpuTravelError, OSError) as exc:
            return exc
        return None

    def rewind(self) -> list[VisitRecord]:
        """The model went back to the last durable checkpoint: the visits done since are undone (their
        training history rolled back, newest first) and will be redone. Returns them."""
        undone = [r for r in self.uncommitted if r.outcome.startswith("done")]  # a failed one was undone already
        for rec in reversed(undone):
            self.log.rollback(rec)
            rec.failed_phase, rec.error = "ROTATE", "its checkpoint was lost or rolled back; redone"
            rec.reset_for_retry()
            self.audit.row("visit-undone", holder=rec.plan.holder, epoch=rec.epoch, outcome="redo",
                           detail={"visit": rec.plan.index, "restored_checkpoint": self.last_good})
        self.uncommitted, self.unclaimed = [], []
        return undone


class VisitCommit(Protocol):
    """How ROTATE ends a visit (a strategy the engine is given): marks it done and checkpoints as the run's
    cadence says; returns the phase's detail. ``BackgroundCommit`` on one device; a fleet rank checkpoints
    every step at once (``core.fleet.rank.StepCommit``)."""

    async def rotated(self, rec: VisitRecord) -> dict[str, Any]: ...


class BackgroundCommit:
    """One device's ROTATE: the visit is done, and committed once the checkpoint holding it is durable: every
    ``checkpoint_every``-th visit (and the last) starts one, in the background (the device snapshots its
    state and the phase waits only for that)."""

    def __init__(self, ckpts: Checkpointer, trainer: object = None) -> None:
        self.ckpts = ckpts

    async def rotated(self, rec: VisitRecord) -> dict[str, Any]:
        c = self.ckpts
        rec.outcome = "done"
        c.done(rec)  # committed when the checkpoint holding it is durable
        if rec is c.walk.records[-1] or len(c.unclaimed) >= max(1, c.every):
            seq = rec.plan.index + 1
            await c.write(seq, visits=c.claim(), background=True)
            release_free_memory()  # the previous checkpoint's megabytes are freed: keep the heap flat
            return {"checkpoint_seq": seq, "background": True, "model_digest": c.device.expected_model,
                    "previous_checkpoint": c.last}
        return {}
