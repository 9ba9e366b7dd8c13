"""The travel engine: drives the GPU from holder to holder, one visit at a time.

A visit is ATTEST -> HANDOFF -> PROVISION -> RETURN -> VERIFY -> TRAIN -> SCRUB -> ROTATE. This module
holds the run and the phase walk; its parts live beside it: ``control`` (pause, step, breakpoints,
the fault plan), ``handoff`` (one hand-off, shared with ``bench provision``), ``audit`` (a fact's ledger
row and event in one call), ``recovery`` (failed visits, dead devices and agents, re-keying),
``report`` (visit records and the run's report) and ``probes`` (the public timing hook).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gputravel.core import events as ev
from gputravel.core.config import RunSettings
from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.errors import (
    AgentError,
    CancelledRunError,
    DataError,
    DeviceError,
    GpuTravelError,
    IntegrityError,
    LinkLostError,
    ProtocolError,
)
from gputravel.core.ledger import Ledger
from gputravel.core.platform.base import DeviceHandle
from gputravel.core.procs import release_free_memory
from gputravel.core.protocol.ckptring import RingAborted
from gputravel.core.protocol.deviceanswers import WindowStatus
from gputravel.core.protocol.devicelink import MAC_KEY_BYTES
from gputravel.core.runfolder import sealed_settings_digest
from gputravel.core.training.store import CheckpointStore
from gputravel.core.travel import handoff as ho
from gputravel.core.travel import holder_attest, training
from gputravel.core.travel.audit import ATTACK_CODES, Audit
from gputravel.core.travel.checkpoints import Checkpointer
from gputravel.core.travel.control import Control, EventSink, FaultPlan
from gputravel.core.travel.holders import Handoff, HolderInfo, HolderLink
from gputravel.core.travel.phases import Phase, check_transition
from gputravel.core.travel.probes import EngineProbe
from gputravel.core.travel.recovery import Recovery
from gputravel.core.travel.report import VisitRecord, build_report
from gputravel.core.travel.schedule import UNIT, VisitPlan, plan_digest, plan_visits

__all__ = ["Control", "EngineProbe", "FaultPlan", "TravelEngine", "VisitRecord"]


@dataclass(slots=True)
class _Visit:
    """What one visit's phases hand each other."""

    rec: VisitRecord
    link: HolderLink
    subs: list[tuple[int, int]]
    handoff: Handoff | None = None
    window_open: bool = False


#: one phase's outcome for its PhaseCompleted event and ledger row: (bytes, detail)
_Outcome = tuple[int, dict[str, Any]]


class TravelEngine:
    """One run: a device service, holder links, a schedule, a ledger, checkpoints."""

    #: kept for readers of the engine: the rejection codes that count as an attack
    ATTACK_CODES = ATTACK_CODES
    #: a visit interrupted by SIGTERM or Ctrl-C is cancelled as by the operator (scrub, ``visit-cancelled``)
    scrub_when_interrupted = True

    def __init__(self, *, settings: RunSettings, device: DeviceHandle, links: list[HolderLink],
                 out_dir: Path, checkpoint_store: CheckpointStore,
                 make_program: Callable[..., dict[str, Any]], run_id: str | None = None,
                 restart_device: Callable[[], DeviceHandle] | None = None) -> None:
        self.settings = settings
        self.handle = device
        self.links = {link.name: link for link in links}
        self.out_dir = Path(out_dir)
        self.ckpt = checkpoint_store
        self.make_program = make_program
        self.train_program: dict[str, Any] = {}
        self.control = Control({Phase(b) for b in settings.breakpoints}, on_request=self.emit)
        self.subscribers: list[asyncio.Queue[ev.Event]] = []
        self.sinks: list[EventSink] = []
        #: timing hooks (``EngineProbe``): benchmarks attach theirs here
        self.probes: list[EngineProbe] = []
        self.client = self.new_client()
        for link in links:
            if link.on_state is None:
                link.on_state = self.on_holder_state
        self.infos: dict[str, HolderInfo] = {}
        self.plans: list[VisitPlan] = []
        self.records: list[VisitRecord] = []
        self.epoch = 0
        self.phase: Phase | None = None
        self.current: VisitRecord | None = None
        self.expected_code: str | None = None
        self.expected_model: str | None = None
        #: the model MAC reference of the last full measurement: (the expected digest it was taken for, its
        #: one-use key, its tag); VERIFY compares the device's MAC under that key with the tag
        self._mac_ref: tuple[str, bytes, str] | None = None
        self.last_good_ckpt: int | None = None
        #: model digest of each checkpoint this run wrote, as the device reported it (and the ledger records)
        self.checkpoint_digests: dict[int, str] = {}
        self.last_checkpoint: dict[str, Any] = {}
        self.rejected_total: Counter[str] = Counter()
        self.attestation: dict[str, Any] = {}
        self.device_info: dict[str, Any] = {}
        self.ledger = Ledger.open(self.out_dir / "ledger.db", run_id=run_id or uuid.uuid4().hex[:12])
        self.audit = Audit(self.ledger, lambda event: self.emit(event))
        self.recovery = Recovery(self)
        self.ckpts = Checkpointer(self)
        self.run_id = self.ledger.run_id
        self.first_run_id = self.run_id  # checkpoints are bound to the run that started them
        self.started = 0.0
        self.loss_history: list[tuple[int, float]] = []
        self.val_history: list[tuple[int, str, float]] = []
        self.step_count = 0
        #: how TRAIN is cut into device requests, and the loss-spike watch over the run's steps
        self.train_slices = training.SliceSettings()
        self.spikes = training.SpikeWatch()
        #: fault injection (tests, the crash study): phase name -> action run when that phase begins
        self.fault: dict[str, Callable[[TravelEngine], Any]] = {}
        self.restart_device = restart_device
        self.fault_plan = FaultPlan.parse(settings.fault) if settings.fault else None
        self.device_restarts = 0
        self.session_epoch_base = 0
        self.session_rekeys = 0
        self.settings_sha256 = sealed_settings_digest(self.out_dir)
        self._rejection_gen = 0  # the device's rejection generation audited so far
        #: the phase walk of one visit: each step returns its outcome (bytes, detail)
        self._steps: tuple[tuple[Phase, Callable[[_Visit], Awaitable[_Outcome]]], ...] = (
            (Phase.ATTEST, self._attest), (Phase.HANDOFF, self._handoff), (Phase.PROVISION, self._provision),
            (Phase.RETURN, self._return), (Phase.VERIFY, self._verify), (Phase.TRAIN, self._train),
            (Phase.SCRUB, self._scrub), (Phase.ROTATE, self._rotate))

    # --- events ------------------------------------------------------------------------------
    def subscribe(self) -> asyncio.Queue[ev.Event]:
        q: asyncio.Queue[ev.Event] = asyncio.Queue()
        self.subscribers.append(q)
        return q

    def emit(self, event: ev.Event) -> None:
        for q in self.subscribers:
            q.put_nowait(event)
        for sink in self.sinks:
            sink(event)

    def on_holder_state(self, holder: str, state: str, detail: str) -> None:
        """Per-host states from the holder links, as events and ledger rows."""
        self.audit.record(ev.HolderStateChanged(time.time(), holder, state, detail),
                          "holder-state", holder=holder, outcome=state, detail={"detail": detail})

    # --- the device ------------------------------------------------------------------------------
    def new_client(self) -> DeviceClient:
        """A client for the device service this engine drives now (not yet connected)."""
        return DeviceClient(self.handle.socket_path, anchors=self.handle.anchors)

    async def upload_program(self) -> str:
        """Upload the training program into the device's code region; the device must report exactly its
        digest (and, after a device restart, the digest the run started with)."""
        program = json.dumps(self.train_program, sort_keys=True).encode()
        configured = await asyncio.to_thread(self.client.configure, program)
        digest = hashlib.sha256(program).hexdigest()
        if configured.code_digest != digest or (self.expected_code and digest != self.expected_code):
            raise IntegrityError("the code region does not hold the program that was uploaded")
        self.device_info["params"] = configured.params
        return digest

    async def configure_data_path(self) -> None:
        """Tell the device which provisioning optimisations are on (ablation switches)."""
        s = self.settings
        config = await asyncio.to_thread(self.client.set_data_path, parallel_auth=s.parallel_auth,
                                         overlap=s.overlap, workers=s.auth_workers)
        self.device_info["data_path"] = {"path": s.data_path, **config.to_wire()}

    async def check_measurement(self, when: str, *, mac_only: bool = False) -> dict[str, Any]:
        """The code and model regions are what the engine left there, or ``IntegrityError``.

        A full check compares the model's SHA-256 digest with the one expected and takes the model's AES-GMAC
        under a fresh key as the reference. ``mac_only`` (VERIFY: after a holder's key was out) asks the device
        for the GMAC under that reference's key alone and compares tags: cipher speed, where the model lives
        (core/device/modelmac.py). Without a reference for the expected model, it checks in full."""
        ref = self._mac_ref if mac_only and self._mac_ref and self._mac_ref[0] == self.expected_model else None
        if ref is not None:
            key = ref[1]
            m = await asyncio.to_thread(self.client.measure, mac_key=key, digest=False)
            model_ok = m.mac is not None and hmac.compare_digest(m.mac, ref[2])
        else:
            key = os.urandom(MAC_KEY_BYTES)
            m = await asyncio.to_thread(self.client.measure, mac_key=key)
            model_ok = m.model == self.expected_model
        bad = [name for name, ok in (("code", m.code == self.expected_code), ("model", model_ok)) if not ok]
        if bad:
            self._mac_ref = None
            raise IntegrityError(f"measurement mismatch {when}: {', '.join(bad)} region changed")
        if ref is None and m.mac is not None and self.expected_model is not None:
            self._mac_ref = (self.expected_model, key, m.mac)
        return {"check": "mac" if ref is not None else "digest", "mac_s": round(m.mac_s, 6),
                "digest_s": round(m.digest_s, 6), "mac_engine": m.mac_engine}

    async def checkpoint(self, seq: int, *, note: str = "") -> None:
        """Checkpoint ``seq`` now, durable on return (set-up, a fleet step): the device seals its state into a
        shared-memory ring, the chunks go to a temporary file unopened, which becomes the checkpoint only once
        the device's tag digest matches what was written (then fsync and rename: a kill mid-way keeps the
        previous checkpoint). A visit's ROTATE checkpoints in the background instead (``core.travel.checkpoints``)."""
        await self.ckpts.write(seq, note=note)
        self.expected_model = self.checkpoint_digests[seq]

    async def restore(self, seq: int) -> None:
        """Stream checkpoint ``seq``'s sealed chunks into the device; the model it then holds must have the digest
        this run recorded for that checkpoint (the ledger's, else the file's meta record)."""
        await self.ckpts.settle()  # the checkpoint in flight first: it may be the one restored
        key = self.ckpt.run_key(self.first_run_id)

        def stream() -> tuple[Any, dict[str, Any]]:
            with self.ckpt.open(seq, run_id=self.first_run_id) as f:
                restored = self.client.restore(key, f.header, f.records())
                return restored, dict(f.meta or {})

        restored, meta = await asyncio.to_thread(stream)
        want = self.checkpoint_digests.get(seq) or meta.get("model_digest")
        if restored.model_digest != want:
            raise IntegrityError(f"checkpoint {seq} restored to a model whose digest differs")
        self.expected_model = restored.model_digest
        self.last_good_ckpt = seq

    async def load_weights(self, path: Path) -> None:
        """Pretrained weights (``--init-from``) into the device's model, before any step: read here, sealed under
        the run key as a ``weights`` stream and opened by the device into its model; the model it then holds
        must have the digest of exactly these weights."""
        from gputravel.core.training.weights import upload_weights

        state, want, config = await asyncio.to_thread(
            upload_weights, path, program_model=self.train_program["model"],
            key=self.ckpt.run_key(self.first_run_id), run_id=self.first_run_id, restore=self.client.restore)
        if state.model_digest != want:
            raise IntegrityError(f"--init-from {path}: the device's model differs from the file's weights")
        self.audit.row("weights-loaded", detail={"path": str(path), "model_digest": want, "model": config})

    async def _audit_from_device(self) -> None:
        """The device's rejections since the last audit, attributed to their visits (in pages: the device
        answers at most a few dozen epochs at a time)."""
        for _ in range(10_000):
            stats = await asyncio.to_thread(self.client.stats, since=self._rejection_gen)
            self.audit.rejections(stats.rejected_by_epoch, self.records)
            self._rejection_gen = stats.rejection_gen
            if not stats.more:
                break

    # --- set-up -----------------------------------------------------------------------------------
    async def setup(self) -> None:
        result = await asyncio.to_thread(self.client.connect)
        self.attestation = result.to_dict()
        claims = {c.name: c.ok for c in result.claims}
        self.audit.record(ev.DeviceAttested(time.time(), result.device_id or "?", result.ok, claims, True),
                          "attested", phase="SETUP", outcome="ok",
                          detail={"device_id": result.device_id, "claims": claims, "platform": "emulated",
                                  "session_fp": self.client.secrets.fingerprint() if self.client.secrets else None})
        self.device_info = (await asyncio.to_thread(self.client.info)).to_wire()
        await self.configure_data_path()
        await asyncio.to_thread(holder_attest.attach, self)  # holders verify the CVM and the GPU themselves
        # agents are deployed and started in parallel; holders keep their given order
        started = await asyncio.gather(*(self._start_link(link) for link in self.links.values()),
                                       return_exceptions=True)
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        for name, info in zip(self.links, started, strict=True):
            assert isinstance(info, HolderInfo)
            self.infos[name] = info
            self.audit.record(ev.HolderConnected(time.time(), name, info.fmt, info.train_bytes, info.val_bytes,
                                                 info.agent_sha256),
                              "holder-connected", holder=name, nbytes=info.train_bytes + info.val_bytes,
                              detail={"format": info.fmt, "agent_sha256": info.agent_sha256,
                                      "transport": info.transport})
        fmts = {i.fmt for i in self.infos.values()}
        if len(fmts) > 1:
            raise DataError(f"holders disagree on the token format: {sorted(fmts)}")
        fmt = fmts.pop()
        min_train = (self.settings.seq_len + 2) * UNIT[fmt]
        self.plans = plan_visits(list(self.infos.values()), rounds=self.settings.rounds,
                                 buffer_bytes=self.settings.buffer_bytes, val_share=self.settings.val_share,
                                 min_train_bytes=min_train)
        self.records = [VisitRecord(p) for p in self.plans]
        self.train_program = self.make_program(fmt=fmt, total_steps=len(self.plans) * self.settings.steps_per_visit)
        self.expected_code = await self.upload_program()
        await self._restore_or_initial()

    async def _start_link(self, link: HolderLink) -> HolderInfo:
        t0 = time.perf_counter()
        info = await link.start()
        t1 = time.perf_counter()
        for probe in self.probes:
            probe.on_holder_started(link.name, t0, t1)
        return info

    async def _restore_or_initial(self) -> None:
        digest = plan_digest(self.plans)
        state = self.ledger.state_items()
        if self.settings.resume and state.get("plan_digest"):
            if state["plan_digest"] != digest:
                raise DataError("--resume: the holders' data or the settings changed; the schedule differs")
            # never reuse an epoch number, even one whose visit was cut off before its progress was committed
            self.epoch = max(int(state.get("epoch", 0)), self.ledger.max_epoch())
            self.first_run_id = str(state.get("run_id", self.run_id))
            done = {int(k) for k in state.get("visits_done", [])}
            for rec in self.records:
                if rec.plan.index in done:
                    rec.outcome = "done (earlier run)"
            seq = state.get("checkpoint_seq")
            if seq is not None and state.get("checkpoint_digest"):
                self.checkpoint_digests[int(seq)] = str(state["checkpoint_digest"])
            if seq is not None:
                await self.restore(int(seq))
            self.step_count = int(state.get("steps", 0))
            self.audit.row("resumed", detail={"visits_done": sorted(done), "epoch": self.epoch, "checkpoint_seq": seq})
        else:
            if self.settings.init_from is not None:
                await self.load_weights(Path(self.settings.init_from))
            self.expected_model = (await asyncio.to_thread(self.client.measure)).model
            await self.checkpoint(0, note="initial")
            self.audit.row("planned", detail={"visits": len(self.plans), "plan_digest": digest},
                           state={"plan_digest": digest, "visits_done": [], "epoch": 0, "checkpoint_seq": 0,
                                  "checkpoint_digest": self.checkpoint_digests[0], "steps": 0, "run_id": self.run_id})

    # --- the run ----------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        return await self.run_guarded(self._walk_visits, planned=lambda: len(self.plans))

    async def _walk_visits(self) -> None:
        """Every visit not done yet, in order, each retried by the policy (``visit_attempts``); a visit undone
        because its checkpoint was lost or rolled back (``Checkpointer.rewind``) is walked again. The run
        ends once its last checkpoint is durable."""
        given_up: set[int] = set()
        while True:
            rec = next((r for r in self.records if not r.outcome.startswith("done") and r.plan.index not in given_up),
                       None)
            if rec is None:
                break
            while True:
                rec.attempts += 1
                t_visit = time.perf_counter()
                try:
                    await self.visit(rec)
                finally:
                    for probe in self.probes:
                        probe.on_visit(rec.plan.index, time.perf_counter() - t_visit)
                if rec.outcome != "failed" or rec.attempts >= self.settings.visit_attempts:
                    break
                self.audit.row("visit-retry", holder=rec.plan.holder, outcome="retry",
                               detail={"visit": rec.plan.index, "attempt": rec.attempts + 1,
                                       "after": f"{rec.failed_phase}: {rec.error}"})
                rec.reset_for_retry()
                if self._undone_before(rec, given_up):
                    break  # an earlier visit was undone (its checkpoint died with the device): it is redone first
            if not rec.outcome.startswith("done") and not self._undone_before(rec, given_up):
                given_up.add(rec.plan.index)
        try:
            await self.ckpts.finish()
        except (DeviceError, RingAborted) as exc:  # the device died writing the last checkpoint: restart, redo
            if not await self.recovery.recover_device_between_visits(exc):
                raise
            await self._walk_visits()

    def _undone_before(self, rec: VisitRecord, given_up: set[int]) -> bool:
        """Whether a visit before ``rec`` is no longer done (undone by ``Checkpointer.rewind``): visits are
        walked in order, so it goes before ``rec``'s next attempt, as in a run that never lost it."""
        return any(not r.outcome.startswith("done") and r.plan.index not in given_up
                   for r in self.records if r.plan.index < rec.plan.index)

    async def run_guarded(self, body: Callable[[], Awaitable[None]], *,
                          planned: Callable[[], int]) -> dict[str, Any]:
        """Set up, run ``body`` (the walk: visits here, lock-step steps in a fleet), and end the run the one
        way every run ends: a final ledger row and event for every ending (an error, Ctrl-C, a bug), the
        holders let go first, then the device's audit, ``run-completed`` and the report. ``planned`` counts
        the visits once set-up has planned them."""
        self.started = time.time()
        t0 = time.perf_counter()
        ended: tuple[str, str] | None = None
        try:
            await self.setup()
            self.audit.emit(ev.RunStarted(time.time(), self.run_id, self.handle.info.to_dict(), tuple(self.links),
                                          planned()))
            await body()
        except GpuTravelError as exc:
            last = self.device_last_error()
            if last is not None and isinstance(exc, DeviceError):
                # the device died: its own last words say why (the link only saw a reset or a broken pipe);
                # the error keeps its class (a fleet's FleetDeviceLostError stays one: its ranks act on it)
                exc = type(exc)(f"{exc.reason}; the device service died: {last}", code=exc.code)
            ended = (str(exc), exc.code)
            raise exc from None
        except (asyncio.CancelledError, KeyboardInterrupt):  # Ctrl-C: committed progress stays resumable
            ended = ("cancelled (interrupted)", CancelledRunError.code)
            raise
        except Exception as exc:  # a bug: still a final row, then the traceback
            ended = (f"{type(exc).__name__}: {exc}", "internal")
            raise
        finally:
            if ended is not None:  # a checkpoint in flight becomes durable (and commits its visits) if it can
                with contextlib.suppress(BaseException):
                    await self.ckpts.drop()
            await self._shutdown_links()
            if ended is not None:  # after the holders' own last rows: the run's row is the final one
                self._final_row(*ended)
        try:
            await self._audit_from_device()
        except GpuTravelError:
            pass
        failed = sum(1 for r in self.records if r.outcome == "failed")
        seconds = time.perf_counter() - t0
        self.audit.record(ev.RunCompleted(time.time(), self.run_id, len(self.records), failed, seconds),
                          "run-completed", outcome="ok" if not failed else "partial", duration_s=seconds,
                          detail={"visits": len(self.records), "failed": failed})
        return self.report(seconds=time.perf_counter() - t0)

    def device_last_error(self) -> str | None:
        """When the device service has died: the last line of its log (``<run>/device.log``), else None."""
        if self.handle.alive():
            return None
        return self.handle.last_error() or f"exit status {self.handle.process.returncode if self.handle.process else '?'}"

    def _final_row(self, error: str, code: str) -> None:
        """Every way a run ends writes a final ledger row and a final event (``run-failed`` with the error's
        code; ``run-completed`` on the way out of a finished run). A ledger that cannot take it any more
        (``LedgerError``) does not hide the run's own error."""
        last = self.device_last_error()
        detail = {"error": error, **({"device_last_error": last} if last else {})}
        try:
            self.audit.record(ev.RunFailed(time.time(), self.run_id, error, code),
                              "run-failed", outcome=code, detail=detail)
        except GpuTravelError:
            self.audit.emit(ev.RunFailed(time.time(), self.run_id, error, code))

    def report(self, *, seconds: float) -> dict[str, Any]:
        rep = build_report(self, seconds=seconds)
        rep["checkpoints"] = {**rep.get("checkpoints", {}), **self.ckpts.summary()}
        return rep

    async def _shutdown_links(self) -> None:
        head = self.audit.head()
        for link in self.links.values():
            link.farewell_head = head  # every visit's rows, for the witnesses
            try:
                await link.close()
            except Exception:  # noqa: BLE001 - closing must not hide the run's own error
                pass

    async def aclose(self) -> None:
        """Shut the device service down (it scrubs nothing more: the run is over), stop its process and
        close the ledger. Safe to call after a failed or cancelled run, and more than once."""
        try:
            if self.handle.alive() and self.client.secrets:
                await asyncio.to_thread(self.client.shutdown)
        except (GpuTravelError, OSError):
            pass  # the device may already be gone
        self.client.close()
        self.handle.stop()
        self.ledger.close()

    # --- one visit: the phase walk ------------------------------------------------------------------
    async def visit(self, rec: VisitRecord) -> None:
        plan = rec.plan
        self.current = rec
        rec.epoch = self.epoch + 1
        rec.key_fingerprint = None
        self.phase = None
        v = _Visit(rec, self.links[plan.holder],
                   ho.sub_windows(plan.window_len, chunk_size=self.settings.chunk_size,
                                  key_chunk_budget=self.settings.key_chunk_budget))
        try:
            for phase, step in self._steps:
                t = await self._enter(rec, phase)
                nbytes, detail = await step(v)
                self._done(rec, phase, t, nbytes=nbytes, detail=detail)
            if not self.ckpts.owns(rec):  # committed here (a fleet step's checkpoint), else when it is durable
                self.audit.row("visit-completed", holder=plan.holder, epoch=rec.epoch, key_fp=rec.key_fingerprint,
                               nbytes=rec.bytes, duration_s=sum(rec.phase_s.values()), outcome="ok",
                               detail={"visit": plan.index, "part": plan.part_id},
                               state={"visits_done": [r.plan.index for r in self.records
                                                      if r.outcome.startswith("done")],
                                      "epoch": self.epoch, "checkpoint_seq": plan.index + 1,
                                      "checkpoint_digest": self.checkpoint_digests.get(plan.index + 1),
                                      "steps": self.step_count})
            self.phase = Phase.DONE
            self.audit.emit(ev.VisitCompleted(time.time(), plan.index, plan.holder, rec.epoch, rec.to_dict()))
        except CancelledRunError as exc:
            await self.recovery.cancel_visit(rec, exc, v.window_open)
            raise
        except asyncio.CancelledError:  # SIGTERM (runs stop) or Ctrl-C: within a training slice, and scrubbed
            if self.scrub_when_interrupted:
                with contextlib.suppress(GpuTravelError, OSError):
                    await self.recovery.cancel_visit(rec, CancelledRunError("interrupted (SIGTERM or Ctrl-C)"),
                                                     v.window_open)
            raise
        except (AgentError, ProtocolError, IntegrityError, DataError, DeviceError) as exc:
            if not self.handle.alive():
                await self.recovery.recover_device(rec, exc)
                return
            await self.recovery.fail_visit(rec, exc, v.window_open)

    async def _attest(self, v: _Visit) -> _Outcome:
        """Fresh evidence, and the code and model are what we left there."""
        await self._audit_from_device()
        result = await asyncio.to_thread(self.client.attest)
        await self.check_measurement("before hand-off")
        return 0, {"device_id": result.device_id, "ok": result.ok}

    async def _handoff(self, v: _Visit) -> _Outcome:
        """A provisioning key for this window and epoch only, for a holder that is verified-ready."""
        await self._require_ready(v.link)
        v.handoff = await self._open_window(v.rec, v.subs[0])
        v.window_open = True
        return 0, {"window": [0, v.rec.plan.window_len], "part": v.rec.plan.part_id, "n_windows": len(v.subs)}

    async def _provision(self, v: _Visit) -> _Outcome:
        """Ciphertext from the holder straight into the buffer window, one key per sub-window."""
        rec, plan = v.rec, v.rec.plan
        chunk_size = self.settings.chunk_size
        n_chunks = -(-plan.window_len // chunk_size)
        acked = [0]

        def progress(_seq: int) -> None:
            acked[0] += 1
            if acked[0] == n_chunks or acked[0] % 4 == 0:
                done = min(plan.window_len, acked[0] * chunk_size)
                self.audit.emit(ev.ProvisionProgressed(time.time(), plan.index, plan.holder, rec.epoch, done,
                                                       plan.window_len))

        def rejected(seq: int | None, code: str, reason: str) -> None:
            self.rejected_total[code] += 1
            rec.rejected[code] = rec.rejected.get(code, 0) + 1
            self.audit.record(ev.ChunkRejected(time.time(), plan.index, plan.holder, self.epoch, seq, code, reason),
                              "chunk-rejected", phase="PROVISION", holder=plan.holder, epoch=self.epoch,
                              outcome=code, detail={"seq": seq, "reason": reason})

        def resumed(exc: LinkLostError, attempt: int, status: WindowStatus) -> None:
            self.audit.record(ev.ProvisionResumed(time.time(), plan.index, plan.holder, rec.epoch,
                                                  status.contiguous, attempt),
                              "provision-interrupted", phase="PROVISION", holder=plan.holder, epoch=rec.epoch,
                              key_fp=rec.key_fingerprint, nbytes=status.bytes, outcome="link-lost",
                              detail={"error": exc.reason, "resume_from": status.contiguous, "attempt": attempt})

        total_s = 0.0
        assert v.handoff is not None
        for i, sub in enumerate(v.subs):
            if i:  # the previous key's nonce budget is spent: close its window, hand over the next key
                await self._close_window(rec, v.handoff, sub_total=v.subs[i - 1][1])
                v.handoff = await self._open_window(rec, sub)
            stats = await ho.provision(self.client, v.link, v.handoff, device_socket=self.handle.socket_path,
                                       endpoint=ho.data_endpoint(self.handle, data_path=self.settings.data_path,
                                                                 transport=self.settings.transport),
                                       on_progress=progress, on_reject=rejected, on_resume=resumed)
            total_s += stats.seconds
            rec.retransmits += stats.retransmits
        rec.provision_s = total_s
        return plan.window_len, {"mb_s": round(plan.window_len / max(total_s, 1e-9) / 1e6, 2),
                                 "retransmits": rec.retransmits}

    async def _return(self, v: _Visit) -> _Outcome:
        """The holder's key dies."""
        rec = v.rec
        assert v.handoff is not None
        await self._close_window(rec, v.handoff, sub_total=v.subs[-1][1])
        v.window_open = False
        v.handoff = None
        if rec.bytes != rec.plan.window_len:
            raise ProtocolError(f"holder returned with {rec.bytes} of {rec.plan.window_len} bytes provisioned")
        return rec.bytes, {"chunks": rec.chunks}

    async def _verify(self, v: _Visit) -> _Outcome:
        """Nobody touched code or model while the holder held a key."""
        checked = await self.check_measurement("after return", mac_only=True)
        v.rec.integrity_ok = True
        return 0, {"model": self.expected_model, **checked}

    async def _train(self, v: _Visit) -> _Outcome:
        """k steps on the buffer in slices (progress, spikes, control between steps), validation on the
        held-out slice, on the device (``training``)."""
        return 0, await training.train_visit(self, v.rec)

    def _trained(self, rec: VisitRecord, *, losses: Sequence[float], val_loss: float | None, seconds: float,
                 tokens_per_s: float) -> dict[str, Any]:
        """A TRAIN that ran in one piece (a fleet's weighted step): the visit's record, the run's loss
        history, the TrainingStepped event, and the phase's detail."""
        rec.losses = []
        training.record_losses(self, rec, [float(x) for x in losses])
        return training.finish_training(self, rec, val_loss=val_loss, seconds=seconds, tokens_per_s=tokens_per_s)

    async def _scrub(self, v: _Visit) -> _Outcome:
        """Zero the buffer and check it before anyone else gets a key."""
        scrub = await asyncio.to_thread(self.client.scrub)
        v.rec.scrub_verified = bool(scrub.verified)
        if not v.rec.scrub_verified:
            raise DeviceError("the buffer did not read back as zero after the scrub")
        return scrub.bytes, {}

    async def _rotate(self, v: _Visit) -> _Outcome:
        """New control-channel epoch; the visit is done, and committed once the checkpoint holding it is
        durable: every ``checkpoint_every``-th visit (and the last) starts one, in the background (the device
        snapshots its state and this phase waits only for that)."""
        rec = v.rec
        await asyncio.to_thread(self.client.rotate)
        rec.outcome = "done"
        detail: dict[str, Any] = {}
        self.ckpts.done(rec)  # committed when the checkpoint holding it is durable
        if rec is self.records[-1] or len(self.ckpts.unclaimed) >= max(1, self.settings.checkpoint_every):
            seq = rec.plan.index + 1
            await self.ckpts.write(seq, visits=self.ckpts.claim(), background=True)
            release_free_memory()  # the previous checkpoint's megabytes are freed: keep the heap flat
            detail = {"checkpoint_seq": seq, "background": True, "model_digest": self.expected_model,
                      "previous_checkpoint": self.last_checkpoint}
        self.audit.emit(ev.KeyRotated(time.time(), rec.epoch, rec.key_fingerprint or ""))
        return 0, detail

    # --- between phases -----------------------------------------------------------------------------
    async def _enter(self, rec: VisitRecord, phase: Phase) -> float:
        if self.phase is not None and self.phase not in (Phase.DONE,):
            check_transition(self.phase, phase)
        await self.control.gate(phase, self.emit)
        self.phase = self.control.phase = phase
        self.audit.emit(ev.PhaseStarted(time.time(), rec.plan.index, rec.plan.holder, str(phase), rec.epoch))
        self._fault_point(phase)
        if self.fault_plan is not None and self.fault_plan.matches(phase, rec.plan.index, rec.attempts):
            killed = self._arm_fault(self.fault_plan, rec)
            if killed is not None:  # an agent killed as the phase begins is dead before the phase goes on
                await killed
        return time.perf_counter()

    def _done(self, rec: VisitRecord, phase: Phase, t0: float, *, nbytes: int = 0, outcome: str = "ok",
              detail: dict[str, Any] | None = None) -> None:
        dt = time.perf_counter() - t0
        rec.phase_s[str(phase)] = dt
        fp = rec.key_fingerprint if phase in (Phase.HANDOFF, Phase.PROVISION, Phase.RETURN) else None
        self.audit.record(ev.PhaseCompleted(time.time(), rec.plan.index, rec.plan.holder, str(phase), rec.epoch, dt,
                                            outcome, nbytes, fp, detail or {}),
                          "phase", phase=str(phase), holder=rec.plan.holder, epoch=rec.epoch, key_fp=fp, nbytes=nbytes,
                          duration_s=dt, outcome=outcome, detail={"visit": rec.plan.index, **(detail or {})})
        for probe in self.probes:
            probe.on_phase(rec.plan.index, phase, dt)

    def _fault_point(self, phase: Phase) -> None:
        """Fault injection hook (tests and the crash study): act when ``phase`` begins."""
        action = self.fault.pop(str(phase), None)
        if action is not None:
            action(self)

    def _arm_fault(self, plan: FaultPlan, rec: VisitRecord) -> asyncio.Future[None] | None:
        """Fault injection (crash study and tests): kill a process now or ``plan.delay`` s into the phase;
        an agent killed now is returned as the future of its death."""
        self.fault_plan = None  # once per run
        if plan.delay <= 0:
            return self._fire_fault(plan, rec)
        asyncio.get_running_loop().call_later(plan.delay, self._fire_fault, plan, rec)
        return None

    def _fire_fault(self, plan: FaultPlan, rec: VisitRecord | None) -> asyncio.Future[None] | None:
        if plan.target == "orchestrator":
            os.kill(os.getpid(), signal.SIGKILL)
        elif plan.target == "device":
            self.handle.kill()
        elif plan.target == "agent" and rec is not None:
            return asyncio.ensure_future(self.links[rec.plan.holder].kill())
        return None

    # --- hand-off windows ---------------------------------------------------------------------------
    async def _require_ready(self, link: HolderLink) -> None:
        """No key to a holder that is not verified-ready: one whose agent or session died while it waited
        is brought back first (the link marks it offline, reconnects with backoff and verifies the agent's
        hash again); if it does not come back, the visit fails here, before any window is opened."""
        if link.ready:
            return
        info = await link.ensure_ready()
        if not link.ready:
            raise LinkLostError(link.name, f"not verified-ready ({getattr(link, 'state', '?')}); no key released")
        if info is not None:
            self.infos[link.name] = info

    async def _open_window(self, rec: VisitRecord, sub: tuple[int, int]) -> Handoff:
        """A new epoch and a provisioning key for bytes [skip, skip+length) of the visit's window."""
        epoch = self.epoch + 1
        limit = self.settings.epoch_limit
        if limit and epoch - self.session_epoch_base > limit:
            await self.recovery.rekey_session(reason=f"epoch limit {limit} reached")
        skip, length = sub
        plan = rec.plan
        handoff, key_fp = await ho.open_window(
            self.client, epoch=epoch, skip=skip, length=length, chunk_size=self.settings.chunk_size,
            train=(plan.train_start, plan.train_len), val=(plan.val_start, plan.val_len),
            conventional=self.settings.data_path == "conventional", ledger_head=None)
        self.epoch = epoch
        if not rec.key_fingerprint:
            rec.epoch, rec.key_fingerprint = epoch, key_fp
        else:
            self.audit.row("key-handed-over", phase="PROVISION", holder=rec.plan.holder, epoch=epoch, key_fp=key_fp,
                           nbytes=length, detail={"visit": rec.plan.index, "skip": skip})
        return replace(handoff, ledger_head=self.audit.head())  # the head after this hand-off's own rows

    async def _close_window(self, rec: VisitRecord, handoff: Handoff, *, sub_total: int) -> None:
        closed = await ho.close_window(self.client, handoff)
        self.audit.rejections({str(handoff.epoch): closed.rejected_in_window}, self.records)
        rec.bytes += closed.bytes
        rec.chunks += closed.chunks
        ho.require_complete(closed, sub_total)
