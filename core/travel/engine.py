"""The travel engine: drives the GPU from holder to holder, one visit at a time.

A visit is ATTEST -> HANDOFF -> PROVISION -> RETURN -> VERIFY -> TRAIN -> SCRUB -> ROTATE. Every
phase emits typed events and a ledger row. The operator controls the run between phases: pause,
resume, step (exactly one phase), breakpoints (pause before a phase), cancel.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gputravel.core import events as ev
from gputravel.core.device.client import DeviceClient
from gputravel.core.errors import (
    AgentError,
    CancelledRunError,
    ConfigError,
    DataError,
    DeviceError,
    GpuTravelError,
    IntegrityError,
    LinkLostError,
    ProtocolError,
)
from gputravel.core.ledger import Ledger, verify_ledger
from gputravel.core.platform.base import DeviceHandle
from gputravel.core.procs import release_free_memory
from gputravel.core.travel.holders import Handoff, HolderInfo, HolderLink
from gputravel.core.travel.phases import Phase, check_transition
from gputravel.core.travel.schedule import UNIT, VisitPlan, plan_digest, plan_visits

EventSink = Callable[[ev.Event], None]


@dataclass
class VisitRecord:
    plan: VisitPlan
    epoch: int = 0
    key_fingerprint: str | None = None
    bytes: int = 0
    chunks: int = 0
    provision_s: float = 0.0
    train_s: float = 0.0
    integrity_ok: bool = False
    scrub_verified: bool = False
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    tokens_per_s: float = 0.0
    outcome: str = "pending"
    error: str | None = None
    failed_phase: str | None = None
    rejected: dict[str, int] = field(default_factory=dict)
    retransmits: int = 0
    phase_s: dict[str, float] = field(default_factory=dict)
    attempts: int = 0
    failures: list[str] = field(default_factory=list)
    attack: dict[str, int] = field(default_factory=dict)

    def reset_for_retry(self) -> None:
        self.failures.append(f"{self.failed_phase}: {self.error}")
        for name in ("key_fingerprint", "error", "failed_phase", "val_loss"):
            setattr(self, name, None)
        self.bytes = self.chunks = self.retransmits = 0
        self.provision_s = self.train_s = self.tokens_per_s = 0.0
        self.integrity_ok = self.scrub_verified = False
        self.losses, self.rejected, self.phase_s = [], {}, {}
        self.outcome = "pending"

    def to_dict(self) -> dict[str, Any]:
        mb_s = self.bytes / self.provision_s / 1e6 if self.provision_s else 0.0
        return {"visit": self.plan.index, "round": self.plan.round, "holder": self.plan.holder,
                "part": f"{self.plan.part + 1}/{self.plan.parts}", "epoch": self.epoch,
                "key_fingerprint": self.key_fingerprint, "bytes": self.bytes, "chunks": self.chunks,
                "provision_s": round(self.provision_s, 6), "provision_mb_s": round(mb_s, 2),
                "train_s": round(self.train_s, 6), "integrity_ok": self.integrity_ok,
                "scrub_verified": self.scrub_verified,
                "loss_first": self.losses[0] if self.losses else None,
                "loss_last": self.losses[-1] if self.losses else None, "val_loss": self.val_loss,
                "tokens_per_s": round(self.tokens_per_s, 1), "outcome": self.outcome, "error": self.error,
                "failed_phase": self.failed_phase, "rejected": self.rejected, "retransmits": self.retransmits,
                "attempts": self.attempts, "earlier_failures": self.failures,
                "attack": bool(self.attack), "attack_attempts": self.attack,
                "phase_s": {k: round(v, 6) for k, v in self.phase_s.items()}}


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """``kill-orchestrator|kill-device|kill-agent@PHASE:VISIT[+SECONDS]``: kill that process when the
    visit's phase begins, or SECONDS into it. Fault injection for the crash study and its tests."""

    target: str
    phase: Phase
    visit: int
    delay: float = 0.0

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        try:
            what, where = text.split("@", 1)
            phase, rest = where.split(":", 1)
            visit, _, delay = rest.partition("+")
            target = what.removeprefix("kill-")
            if target not in ("orchestrator", "device", "agent") or not what.startswith("kill-"):
                raise ValueError(what)
            return cls(target, Phase(phase.upper()), int(visit), float(delay or 0))
        except ValueError as exc:
            raise ConfigError(f"fault plan {text!r} is not kill-orchestrator|kill-device|kill-agent@PHASE:VISIT[+S]: "
                              f"{exc}") from None

    def matches(self, phase: Phase, visit: int, attempt: int) -> bool:
        return phase == self.phase and visit == self.visit and attempt == 1


class Control:
    """Pause / resume / step / breakpoints / cancel, checked between phases."""

    def __init__(self, breakpoints: set[Phase] | None = None) -> None:
        self.breakpoints: set[Phase] = set(breakpoints or ())
        self._running = asyncio.Event()
        self._running.set()
        self._steps = 0  # phases allowed while paused
        self.cancelled = False
        self.paused_at: Phase | None = None
        self._stepped = False

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def pause(self) -> None:
        self._steps = 0
        self._running.clear()

    def resume(self) -> None:
        self._steps = 0
        self._running.set()

    def step(self) -> None:
        """Run exactly one more phase, then pause again."""
        self._steps += 1
        self._running.set()

    def cancel(self) -> None:
        self.cancelled = True
        self._running.set()

    def toggle_breakpoint(self, phase: Phase) -> bool:
        if phase in self.breakpoints:
            self.breakpoints.discard(phase)
            return False
        self.breakpoints.add(phase)
        return True

    async def gate(self, phase: Phase, emit: EventSink) -> None:
        """Between phases: honour cancel, breakpoints, pause and step. Every pause is a ``RunPaused``
        event (reason: breakpoint, step or paused) and every resume a ``RunResumed``."""
        if self.cancelled:
            raise CancelledRunError("cancelled by the operator")
        reason = "paused" if self.paused else None
        if phase in self.breakpoints and self._steps == 0 and not self.paused:
            self._running.clear()
            reason = "breakpoint"
        elif reason and self._stepped:
            reason = "step"
        if self.paused:
            self.paused_at = phase
            emit(ev.RunPaused(time.time(), reason or "paused", str(phase)))
            await self._running.wait()
            self.paused_at = None
            emit(ev.RunResumed(time.time()))
            if self.cancelled:
                raise CancelledRunError("cancelled by the operator")
        self._stepped = False
        if self._steps:
            self._steps -= 1
            if self._steps == 0:
                self._running.clear()  # the phase that now runs is the last one of this step
                self._stepped = True


class TravelEngine:
    """One run: a device service, holder links, a schedule, a ledger, checkpoints."""

    def __init__(self, *, settings: Any, device: DeviceHandle, links: list[HolderLink],
                 out_dir: Path, checkpoint_store: Any,
                 make_program: Callable[..., dict[str, Any]], run_id: str | None = None,
                 restart_device: Callable[[], DeviceHandle] | None = None) -> None:
        self.settings = settings
        self.handle = device
        self.links = {link.name: link for link in links}
        self.out_dir = Path(out_dir)
        self.ckpt = checkpoint_store
        self.make_program = make_program
        self.train_program: dict[str, Any] = {}
        self.control = Control({Phase(b) for b in settings.breakpoints})
        self.subscribers: list[asyncio.Queue[ev.Event]] = []
        self.sinks: list[EventSink] = []
        self.client = DeviceClient(device.socket_path, anchors=device.anchors)
        for link in links:
            if getattr(link, "on_state", None) is None:
                link.on_state = self.on_holder_state  # type: ignore[attr-defined]
        self.infos: dict[str, HolderInfo] = {}
        self.plans: list[VisitPlan] = []
        self.records: list[VisitRecord] = []
        self.epoch = 0
        self.phase: Phase | None = None
        self.current: VisitRecord | None = None
        self.expected_code: str | None = None
        self.expected_model: str | None = None
        self.last_good_ckpt: int | None = None
        self.rejected_total: Counter[str] = Counter()
        self.attestation: dict[str, Any] = {}
        self.device_info: dict[str, Any] = {}
        self.ledger = Ledger.open(self.out_dir / "ledger.db", run_id=run_id or uuid.uuid4().hex[:12])
        self.run_id = self.ledger.run_id
        self.first_run_id = self.run_id  # checkpoints are bound to the run that started them
        self.started = 0.0
        self.loss_history: list[tuple[int, float]] = []
        self.val_history: list[tuple[int, str, float]] = []
        self.step_count = 0
        self.fault: dict[str, Any] = {}
        self.restart_device = restart_device
        self.fault_plan = FaultPlan.parse(settings.fault) if getattr(settings, "fault", None) else None
        self.device_restarts = 0
        self.session_epoch_base = 0
        self.session_rekeys = 0
        self._rejections_seen: dict[tuple[str, str], int] = {}  # (epoch, code) -> count already audited

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

    def _ledger(self, kind: str, **kw: Any) -> None:
        self.ledger.append(kind=kind, **kw)

    # --- device calls (blocking: off the event loop) ------------------------------------------
    async def _dev(self, op: str, payload: bytes = b"", **args: Any) -> tuple[dict[str, Any], bytes]:
        return await asyncio.to_thread(self.client.call, op, payload, **args)

    # --- set-up -----------------------------------------------------------------------------------
    async def setup(self) -> None:
        result = await asyncio.to_thread(self.client.connect)
        self.attestation = result.to_dict()
        claims = {c.name: c.ok for c in result.claims}
        self.emit(ev.DeviceAttested(time.time(), result.device_id or "?", result.ok, claims, True))
        self._ledger("attested", phase="SETUP", outcome="ok",
                     detail={"device_id": result.device_id, "claims": claims, "platform": "emulated",
                             "session_fp": self.client.secrets.fingerprint() if self.client.secrets else None})
        self.device_info, _ = await self._dev("info")
        await self._configure_data_path()
        # agents are deployed and started in parallel; holders keep their given order
        started = await asyncio.gather(*(link.start() for link in self.links.values()), return_exceptions=True)
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        for name, info in zip(self.links, started, strict=True):
            assert isinstance(info, HolderInfo)
            self.infos[name] = info
            self.emit(ev.HolderConnected(time.time(), name, info.fmt, info.train_bytes, info.val_bytes,
                                         info.agent_sha256))
            self._ledger("holder-connected", holder=name, nbytes=info.train_bytes + info.val_bytes,
                         detail={"format": info.fmt, "agent_sha256": info.agent_sha256, "transport": info.transport})
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
        self.expected_code = await self._upload_program()
        await self._restore_or_initial()

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
            if seq is not None:
                await self._restore(int(seq))
            self.step_count = int(state.get("steps", 0))
            self._ledger("resumed", detail={"visits_done": sorted(done), "epoch": self.epoch,
                                            "checkpoint_seq": seq})
        else:
            head, _ = await self._dev("measure")
            self.expected_model = head["model"]
            await self._checkpoint(0, note="initial")
            self._ledger("planned", detail={"visits": len(self.plans), "plan_digest": digest},
                         state={"plan_digest": digest, "visits_done": [], "epoch": 0, "checkpoint_seq": 0,
                                "steps": 0, "run_id": self.run_id})

    async def _upload_program(self) -> str:
        """Upload the training program into the device's code region; the device must report exactly its
        digest (and, after a device restart, the digest the run started with)."""
        program = json.dumps(self.train_program, sort_keys=True).encode()
        head, _ = await self._dev("configure", program)
        digest = hashlib.sha256(program).hexdigest()
        if head["code_digest"] != digest or (self.expected_code and digest != self.expected_code):
            raise IntegrityError("the code region does not hold the program that was uploaded")
        self.device_info["params"] = head["params"]
        return digest

    async def _checkpoint(self, seq: int, *, note: str = "") -> None:
        import torch

        head, blob = await self._dev("checkpoint")
        # the device's serialised state rides in the checkpoint as one uint8 tensor over ``blob``'s memory
        # (bytearray: the only copy; no clone)
        state = {"device_state": torch.frombuffer(bytearray(blob), dtype=torch.uint8),
                 "model_digest": head["model_digest"], "seq": seq, "epoch": self.epoch, "note": note,
                 "steps": self.step_count}
        await asyncio.to_thread(self.ckpt.save, state, run_id=self.first_run_id, seq=seq)
        self.last_good_ckpt = seq
        self.expected_model = head["model_digest"]

    async def _restore(self, seq: int) -> None:
        state = await asyncio.to_thread(self.ckpt.load, seq, run_id=self.first_run_id)
        blob = state["device_state"].numpy().tobytes()
        head, _ = await self._dev("restore", blob)
        if head["model_digest"] != state["model_digest"]:
            raise IntegrityError(f"checkpoint {seq} restored to a model whose digest differs")
        self.expected_model = head["model_digest"]
        self.last_good_ckpt = seq

    # --- the run ----------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        self.started = time.time()
        t0 = time.perf_counter()
        try:
            await self.setup()
            self.emit(ev.RunStarted(time.time(), self.run_id, self.handle.info.to_dict(), tuple(self.links),
                                    len(self.plans)))
            for rec in self.records:
                if rec.outcome.startswith("done"):
                    continue
                while True:
                    rec.attempts += 1
                    await self.visit(rec)
                    if rec.outcome != "failed" or rec.attempts >= self.settings.visit_attempts:
                        break
                    self._ledger("visit-retry", holder=rec.plan.holder, outcome="retry",
                                 detail={"visit": rec.plan.index, "attempt": rec.attempts + 1,
                                         "after": f"{rec.failed_phase}: {rec.error}"})
                    rec.reset_for_retry()
        except GpuTravelError as exc:
            self.emit(ev.RunFailed(time.time(), self.run_id, str(exc), exc.code))
            self._ledger("run-failed", outcome=exc.code, detail={"error": str(exc)})
            raise
        finally:
            await self._shutdown_links()
        try:
            await self._audit_from_device()
        except GpuTravelError:
            pass
        failed = sum(1 for r in self.records if r.outcome == "failed")
        self._ledger("run-completed", outcome="ok" if not failed else "partial",
                     duration_s=time.perf_counter() - t0, detail={"visits": len(self.records), "failed": failed})
        self.emit(ev.RunCompleted(time.time(), self.run_id, len(self.records), failed, time.perf_counter() - t0))
        return self.report(seconds=time.perf_counter() - t0)

    async def _shutdown_links(self) -> None:
        seq, digest = self.ledger.head()
        for link in self.links.values():
            link.farewell_head = f"{seq}:{digest}" if seq else None  # every visit's rows, for the witnesses
            try:
                await link.close()
            except Exception:  # noqa: BLE001 - closing must not hide the run's own error
                pass

    async def _enter(self, rec: VisitRecord, phase: Phase) -> float:
        if self.phase is not None and self.phase not in (Phase.DONE,):
            check_transition(self.phase, phase)
        await self.control.gate(phase, self.emit)
        self.phase = phase
        self.emit(ev.PhaseStarted(time.time(), rec.plan.index, rec.plan.holder, str(phase), rec.epoch))
        self._fault_point(phase)
        if self.fault_plan is not None and self.fault_plan.matches(phase, rec.plan.index, rec.attempts):
            self._arm_fault(self.fault_plan, rec)
        return time.perf_counter()

    def _arm_fault(self, plan: FaultPlan, rec: VisitRecord) -> None:
        """Fault injection (crash study and tests): kill a process now or ``plan.delay`` s into the phase."""
        self.fault_plan = None  # once per run

        def fire() -> None:
            if plan.target == "orchestrator":
                os.kill(os.getpid(), signal.SIGKILL)
            elif plan.target == "device":
                self.handle.kill()
            elif plan.target == "agent":
                asyncio.ensure_future(self.links[rec.plan.holder].kill())

        if plan.delay <= 0:
            fire()
        else:
            asyncio.get_running_loop().call_later(plan.delay, fire)

    def _done(self, rec: VisitRecord, phase: Phase, t0: float, *, nbytes: int = 0, outcome: str = "ok",
              detail: dict[str, Any] | None = None) -> None:
        dt = time.perf_counter() - t0
        rec.phase_s[str(phase)] = dt
        fp = rec.key_fingerprint if phase in (Phase.HANDOFF, Phase.PROVISION, Phase.RETURN) else None
        self.emit(ev.PhaseCompleted(time.time(), rec.plan.index, rec.plan.holder, str(phase), rec.epoch, dt,
                                    outcome, nbytes, fp, detail or {}))
        self._ledger("phase", phase=str(phase), holder=rec.plan.holder, epoch=rec.epoch, key_fp=fp, nbytes=nbytes,
                     duration_s=dt, outcome=outcome, detail={"visit": rec.plan.index, **(detail or {})})

    def _fault_point(self, phase: Phase) -> None:
        """Fault injection hook (tests and the crash study): act when ``phase`` begins."""
        action = self.fault.get(str(phase))
        if action is not None:
            self.fault.pop(str(phase))
            action(self)

    async def visit(self, rec: VisitRecord) -> None:
        plan = rec.plan
        self.current = rec
        rec.epoch = self.epoch + 1
        rec.key_fingerprint = None
        link = self.links[plan.holder]
        window_open = False
        self.phase = None
        try:
            # ATTEST: fresh evidence, and the code and model are what we left there
            t = await self._enter(rec, Phase.ATTEST)
            await self._audit_from_device()
            result = await asyncio.to_thread(self.client.attest)
            await self._check_measurement(rec, "before hand-off")
            self._done(rec, Phase.ATTEST, t, detail={"device_id": result.device_id, "ok": result.ok})

            # HANDOFF: a provisioning key for this window and epoch only
            t = await self._enter(rec, Phase.HANDOFF)
            subs = self._sub_windows(plan.window_len)
            handoff = await self._open_window(rec, subs[0])
            window_open = True
            self._done(rec, Phase.HANDOFF, t, detail={"window": [0, plan.window_len], "part": plan.part_id,
                                                      "n_windows": len(subs)})

            # PROVISION: ciphertext from the holder straight into the buffer window
            t = await self._enter(rec, Phase.PROVISION)
            n_chunks = -(-plan.window_len // self.settings.chunk_size)
            acked = [0]

            def progress(_seq: int) -> None:
                acked[0] += 1
                if acked[0] == n_chunks or acked[0] % 4 == 0:
                    done = min(plan.window_len, acked[0] * self.settings.chunk_size)
                    self.emit(ev.ProvisionProgressed(time.time(), plan.index, plan.holder, rec.epoch, done,
                                                     plan.window_len))

            def rejected(seq: int | None, code: str, reason: str) -> None:
                self.rejected_total[code] += 1
                rec.rejected[code] = rec.rejected.get(code, 0) + 1
                self.emit(ev.ChunkRejected(time.time(), plan.index, plan.holder, self.epoch, seq, code, reason))
                self._ledger("chunk-rejected", phase="PROVISION", holder=plan.holder, epoch=self.epoch,
                             outcome=code, detail={"seq": seq, "reason": reason})

            total_s = 0.0
            for i, sub in enumerate(subs):
                if i:  # the previous key's nonce budget is spent: close its window, hand over the next key
                    await self._close_window(rec, handoff, sub_total=subs[i - 1][1])
                    handoff = await self._open_window(rec, sub)
                stats = await self._provision_with_resume(rec, link, handoff, progress, rejected)
                total_s += stats.seconds
                rec.retransmits += stats.retransmits
            rec.provision_s = total_s
            self._done(rec, Phase.PROVISION, t, nbytes=plan.window_len,
                       detail={"mb_s": round(plan.window_len / max(total_s, 1e-9) / 1e6, 2),
                               "retransmits": rec.retransmits})

            # RETURN: the holder's key dies
            t = await self._enter(rec, Phase.RETURN)
            await self._close_window(rec, handoff, sub_total=subs[-1][1])
            window_open = False
            del handoff
            if rec.bytes != plan.window_len:
                raise ProtocolError(f"holder returned with {rec.bytes} of {plan.window_len} bytes provisioned")
            self._done(rec, Phase.RETURN, t, nbytes=rec.bytes, detail={"chunks": rec.chunks})

            # VERIFY: nobody touched code or model while the holder held a key
            t = await self._enter(rec, Phase.VERIFY)
            await self._check_measurement(rec, "after return")
            rec.integrity_ok = True
            self._done(rec, Phase.VERIFY, t, detail={"model": self.expected_model})

            # TRAIN: k steps on the buffer, validation on the held-out slice, on the device
            t = await self._enter(rec, Phase.TRAIN)
            head, _ = await self._dev("train", train_off=0, train_len=plan.train_len, val_off=plan.train_len,
                                      val_len=plan.val_len, fmt=self.infos[plan.holder].fmt)
            rec.losses = [float(x) for x in head["losses"]]
            rec.val_loss = head["val_loss"]
            rec.train_s = float(head["seconds"])
            rec.tokens_per_s = float(head["tokens_per_s"])
            self.expected_model = head["model_digest"]
            for loss in rec.losses:
                self.step_count += 1
                self.loss_history.append((self.step_count, loss))
            if rec.val_loss is not None:
                self.val_history.append((self.step_count, plan.holder, float(rec.val_loss)))
            self.emit(ev.TrainingStepped(time.time(), plan.index, plan.holder, self.step_count, tuple(rec.losses),
                                         rec.val_loss, rec.tokens_per_s))
            self._done(rec, Phase.TRAIN, t, detail={"loss_first": rec.losses[0], "loss_last": rec.losses[-1],
                                                    "val_loss": rec.val_loss, "steps": len(rec.losses)})

            # SCRUB: zero the buffer and check it before anyone else gets a key
            t = await self._enter(rec, Phase.SCRUB)
            head, _ = await self._dev("scrub")
            rec.scrub_verified = bool(head["verified"])
            if not rec.scrub_verified:
                raise DeviceError("the buffer did not read back as zero after the scrub")
            self._done(rec, Phase.SCRUB, t, nbytes=int(head["bytes"]))

            # ROTATE: new control-channel epoch; sealed checkpoint; progress committed with the event
            t = await self._enter(rec, Phase.ROTATE)
            await asyncio.to_thread(self.client.rotate)
            await self._checkpoint(plan.index + 1)
            release_free_memory()  # the checkpoint's megabytes are freed: keep the heap flat over long runs
            rec.outcome = "done"
            done_list = [r.plan.index for r in self.records if r.outcome.startswith("done")]
            self.emit(ev.KeyRotated(time.time(), rec.epoch, rec.key_fingerprint or ""))
            self._done(rec, Phase.ROTATE, t, detail={"checkpoint_seq": plan.index + 1})
            self._ledger("visit-completed", holder=plan.holder, epoch=rec.epoch, key_fp=rec.key_fingerprint,
                         nbytes=rec.bytes, duration_s=sum(rec.phase_s.values()), outcome="ok",
                         detail={"visit": plan.index, "part": plan.part_id},
                         state={"visits_done": done_list, "epoch": self.epoch, "checkpoint_seq": plan.index + 1,
                                "steps": self.step_count})
            self.phase = Phase.DONE
            self.emit(ev.VisitCompleted(time.time(), plan.index, plan.holder, rec.epoch, rec.to_dict()))
        except CancelledRunError as exc:
            phase = str(self.phase) if self.phase else None  # the last phase that ran, if any
            out = await self._abort_visit(rec, window_open, restore=False)
            rec.outcome, rec.error, rec.failed_phase = "cancelled", str(exc), phase
            self.phase = Phase.DONE
            self._ledger("visit-cancelled", phase=phase, holder=plan.holder, epoch=rec.epoch,
                         key_fp=rec.key_fingerprint, outcome=exc.code,
                         detail={"visit": plan.index, "error": str(exc), **out}, state={"epoch": self.epoch})
            raise
        except (AgentError, ProtocolError, IntegrityError, DataError, DeviceError) as exc:
            if not self.handle.alive():
                await self._recover_device(rec, exc)
                return
            await self._fail_visit(rec, exc, window_open)

    async def _provision_with_resume(self, rec: VisitRecord, link: HolderLink, handoff: Handoff,
                                     progress: Callable[[int], None], rejected: Any) -> Any:
        """Provision; when the link to the holder drops (not the agent failing), reconnect and resume
        from the device's last contiguous acknowledged chunk: nothing is sent twice into the buffer
        and nothing is lost."""
        attempt = 0
        t0 = time.perf_counter()
        while True:
            try:
                stats = await link.provision(handoff, device_socket=self.handle.socket_path, on_progress=progress,
                                             on_reject=rejected, data_endpoint=self._data_endpoint())
                stats.seconds = time.perf_counter() - t0 if attempt else stats.seconds
                return stats
            except LinkLostError as exc:
                attempt += 1
                if attempt > getattr(link, "max_reconnects", 0):
                    raise
                st, _ = await self._dev("window_status")
                if not st.get("open") or st.get("epoch") != rec.epoch:
                    raise
                resume_from = int(st["contiguous"])
                self._ledger("provision-interrupted", phase="PROVISION", holder=rec.plan.holder, epoch=rec.epoch,
                             key_fp=rec.key_fingerprint, nbytes=int(st["bytes"]), outcome="link-lost",
                             detail={"error": exc.reason, "resume_from": resume_from, "attempt": attempt})
                self.emit(ev.ProvisionResumed(time.time(), rec.plan.index, rec.plan.holder, rec.epoch, resume_from,
                                              attempt))
                await link.reconnect()  # type: ignore[attr-defined]
                handoff = replace(handoff, resume_from=resume_from)

    def _sub_windows(self, length: int) -> list[tuple[int, int]]:
        """Split a visit's window so no provisioning key seals more than ``key_chunk_budget`` chunks."""
        cs = self.settings.chunk_size
        per_key = max(1, int(getattr(self.settings, "key_chunk_budget", 2**32))) * cs
        return [(skip, min(per_key, length - skip)) for skip in range(0, length, per_key)]

    async def _open_window(self, rec: VisitRecord, sub: tuple[int, int]) -> Handoff:
        """A new epoch and a provisioning key for bytes [skip, skip+length) of the visit's window."""
        epoch = self.epoch + 1
        limit = getattr(self.settings, "epoch_limit", None)
        if limit and epoch - self.session_epoch_base > limit:
            await self._rekey_session(reason=f"epoch limit {limit} reached")
        skip, length = sub
        head, _ = await self._dev("handoff", epoch=epoch, offset=skip, length=length,
                                  chunk_size=self.settings.chunk_size)
        self.epoch = epoch
        if not rec.key_fingerprint:
            rec.epoch, rec.key_fingerprint = epoch, head["key_fingerprint"]
        else:
            self._ledger("key-handed-over", phase="PROVISION", holder=rec.plan.holder, epoch=epoch,
                         key_fp=head["key_fingerprint"], nbytes=length, detail={"visit": rec.plan.index, "skip": skip})
        plan = rec.plan
        seq, digest = self.ledger.head()
        return Handoff(epoch=epoch, session_id=head["session_id"], key=head["provisioning_key"], window_offset=skip,
                       chunk_size=self.settings.chunk_size, train=(plan.train_start, plan.train_len),
                       val=(plan.val_start, plan.val_len), skip=skip, length=length,
                       conventional=self.settings.data_path == "conventional",
                       ledger_head=f"{seq}:{digest}" if seq else None)

    async def _close_window(self, rec: VisitRecord, handoff: Handoff, *, sub_total: int) -> None:
        head, _ = await self._dev("close_window", epoch=handoff.epoch)
        self._audit_rejections({str(handoff.epoch): head.get("rejected_in_window", {})})
        rec.bytes += int(head["bytes"])
        rec.chunks += int(head["chunks"])
        if not head["complete"] or int(head["bytes"]) != sub_total:
            raise ProtocolError(f"holder returned with {head['bytes']} of {sub_total} bytes provisioned "
                                f"under epoch {handoff.epoch}")

    async def _rekey_session(self, *, reason: str) -> None:
        """A fresh attested session (new ECDH, new master): every key of the old one is dead."""
        old_fp = self.client.secrets.fingerprint() if self.client.secrets else None
        self.client.close()
        self.client = DeviceClient(self.handle.socket_path, anchors=self.handle.anchors)
        for attempt in range(50):  # the device frees its control slot when it sees the old connection close
            try:
                await asyncio.to_thread(self.client.connect)
                break
            except DeviceError:
                if attempt == 49:
                    raise
                await asyncio.sleep(0.1)
                self.client = DeviceClient(self.handle.socket_path, anchors=self.handle.anchors)
        if self.current is not None:  # the model and code stayed in device memory across the re-key
            await self._check_measurement(self.current, "after re-keying")
        self.session_epoch_base = self.epoch
        self.session_rekeys += 1
        self._ledger("session-rekeyed", epoch=self.epoch, outcome="ok",
                     detail={"reason": reason, "old_session_fp": old_fp,
                             "new_session_fp": self.client.secrets.fingerprint() if self.client.secrets else None})

    async def _configure_data_path(self) -> None:
        """Tell the device which provisioning optimisations are on (ablation switches)."""
        s = self.settings
        head, _ = await self._dev("set_data_path", parallel_auth=getattr(s, "parallel_auth", None),
                                  overlap=getattr(s, "overlap", None), workers=int(getattr(s, "auth_workers", 0)))
        self.device_info["data_path"] = {"path": s.data_path, **head}

    def _data_endpoint(self) -> dict[str, Any] | None:
        """Where a holder sends sealed chunks on the direct path: the device's Unix socket for holders on
        this host (local agents, the embedded SSH server), its TCP data port for inventory hosts (which an
        SSH link reaches through a remote port forward unless the inventory says the network routes it)."""
        if self.settings.data_path != "direct":
            return None
        if self.settings.transport in ("local", "ssh"):
            return {"path": self.handle.socket_path}
        if self.handle.data_port is None:
            raise DeviceError("the direct data path needs the device's data port, which this device has not opened")
        return {"host": self.handle.data_host, "port": self.handle.data_port}

    def on_holder_state(self, holder: str, state: str, detail: str) -> None:
        """Per-host states from the holder links, as events and ledger rows."""
        self.emit(ev.HolderStateChanged(time.time(), holder, state, detail))
        self._ledger("holder-state", holder=holder, outcome=state, detail={"detail": detail})

    async def _check_measurement(self, rec: VisitRecord, when: str) -> None:
        head, _ = await self._dev("measure")
        bad = [name for name, want in (("code", self.expected_code), ("model", self.expected_model))
               if head[name] != want]
        if bad:
            raise IntegrityError(f"measurement mismatch {when}: {', '.join(bad)} region changed")

    #: Rejections that only a misbehaving holder causes with a valid key: writes outside its window, its key
    #: used after return or in another epoch, replays, frames the data port does not take (reading back).
    ATTACK_CODES = frozenset({"window", "stale-epoch", "replay", "frame"})

    def _audit_rejections(self, by_epoch: dict[str, dict[str, int]]) -> None:
        """Attribute new rejections to the visit whose epoch they claimed; attacks go to the ledger."""
        seen = self._rejections_seen
        by_visit = {r.epoch: r for r in self.records if r.epoch}
        for epoch_s, counts in by_epoch.items():
            rec = by_visit.get(int(epoch_s))
            for code, n in counts.items():
                new = n - seen.get((epoch_s, code), 0)
                if new <= 0:
                    continue
                seen[(epoch_s, code)] = n
                if rec is None or code not in self.ATTACK_CODES:
                    continue
                rec.attack[code] = rec.attack.get(code, 0) + new
                self._ledger("attack-detected", holder=rec.plan.holder, epoch=rec.epoch, key_fp=rec.key_fingerprint,
                             outcome=code, detail={"visit": rec.plan.index, "count": new,
                                                   "after_return": rec.outcome.startswith("done")})

    async def _audit_from_device(self) -> None:
        head, _ = await self._dev("stats")
        self._audit_rejections(head.get("rejected_by_epoch", {}))

    async def _recover_device(self, rec: VisitRecord, exc: GpuTravelError) -> None:
        """The device service died mid-visit: start a new one, attest it, open a fresh session (new keys:
        no nonce can repeat), upload the same program, restore the last sealed checkpoint, and let the
        visit be redone. Its partial buffer died with the old device's memory."""
        phase = str(self.phase) if self.phase else "?"
        rec.outcome, rec.error, rec.failed_phase = "failed", f"device died: {exc.reason}", phase
        self.phase = Phase.FAILED
        if self.restart_device is None or self.device_restarts >= 3:
            raise DeviceError(f"the device service died: {exc.reason}") from None
        self.device_restarts += 1
        self._rollback_training(rec)
        self.client.close()
        self.handle.stop()
        self.handle = await asyncio.to_thread(self.restart_device)
        self.client = DeviceClient(self.handle.socket_path, anchors=self.handle.anchors)
        result = await asyncio.to_thread(self.client.connect)
        await self._upload_program()
        await self._configure_data_path()
        if self.last_good_ckpt is not None:
            await self._restore(self.last_good_ckpt)
        self.epoch = max(self.epoch, rec.epoch)
        self.emit(ev.VisitFailed(time.time(), rec.plan.index, rec.plan.holder, rec.epoch, phase, rec.error, "device"))
        self._ledger("device-restarted", phase=phase, holder=rec.plan.holder, epoch=rec.epoch, outcome="device",
                     detail={"visit": rec.plan.index, "error": rec.error, "restored_checkpoint": self.last_good_ckpt,
                             "device_id": result.device_id,
                             "session_fp": self.client.secrets.fingerprint() if self.client.secrets else None},
                     state={"epoch": self.epoch})
        self.phase = Phase.DONE
        await self._restart_agent(rec.plan.holder)  # agents mid-transfer to the dead device, for the redo

    def _rollback_training(self, rec: VisitRecord) -> None:
        """A visit that trained and then failed is undone (the model is restored from the checkpoint)."""
        if rec.losses:
            del self.loss_history[len(self.loss_history) - len(rec.losses):]
            self.step_count -= len(rec.losses)
            self.val_history = [v for v in self.val_history if v[0] <= self.step_count]

    async def _abort_visit(self, rec: VisitRecord, window_open: bool, *, restore: bool) -> dict[str, Any]:
        """Close the window, scrub the partial buffer, restore the model if it is suspect, rotate."""
        out: dict[str, Any] = {}
        if window_open:
            try:
                await self._dev("close_window", epoch=rec.epoch)
            except GpuTravelError:
                pass
        head, _ = await self._dev("scrub")
        rec.scrub_verified = bool(head["verified"])
        out["scrub_verified"] = rec.scrub_verified
        if restore and self.last_good_ckpt is not None:
            await self._restore(self.last_good_ckpt)
            out["restored_checkpoint"] = self.last_good_ckpt
        await asyncio.to_thread(self.client.rotate)
        self.epoch = max(self.epoch, rec.epoch)
        return out

    async def _fail_visit(self, rec: VisitRecord, exc: GpuTravelError, window_open: bool) -> None:
        phase = str(self.phase) if self.phase else "?"
        rec.outcome, rec.error, rec.failed_phase = "failed", str(exc), phase
        self.phase = Phase.FAILED
        trained = bool(rec.losses)
        self._rollback_training(rec)
        out = await self._abort_visit(rec, window_open, restore=isinstance(exc, IntegrityError) or trained)
        self.emit(ev.VisitFailed(time.time(), rec.plan.index, rec.plan.holder, rec.epoch, phase, str(exc), exc.code))
        self._ledger("visit-failed", phase=phase, holder=rec.plan.holder, epoch=rec.epoch, key_fp=rec.key_fingerprint,
                     outcome=exc.code, detail={"visit": rec.plan.index, "error": str(exc), **out},
                     state={"epoch": self.epoch})
        self.phase = Phase.DONE
        if isinstance(exc, AgentError):
            await self._restart_agent(rec.plan.holder)  # a holder whose agent died, for its next visit

    async def _restart_agent(self, holder: str) -> None:
        """Stop the holder's agent and start a fresh one; a failure here surfaces at its next visit."""
        link = self.links[holder]
        try:
            await link.close()
            self.infos[holder] = await link.start()
        except GpuTravelError:
            pass

    async def aclose(self) -> None:
        """Shut the device service down (it scrubs nothing more: the run is over), stop its process and
        close the ledger. Safe to call after a failed or cancelled run, and more than once."""
        try:
            if self.handle.alive() and self.client.secrets:
                await asyncio.to_thread(self.client.call, "shutdown")
        except (GpuTravelError, OSError):
            pass  # the device may already be gone
        self.client.close()
        self.handle.stop()
        self.ledger.close()

    # --- report -----------------------------------------------------------------------------------
    def report(self, *, seconds: float) -> dict[str, Any]:
        self.ledger.close()
        verify = verify_ledger(self.out_dir / "ledger.db")
        visits = [r.to_dict() for r in self.records]
        trained = [r for r in self.records if r.losses]
        total_bytes = sum(r.bytes for r in self.records)
        total_prov = sum(r.provision_s for r in self.records)
        val = [r.val_loss for r in trained if r.val_loss is not None]
        return {
            "run_id": self.run_id,
            "platform": {**self.handle.info.to_dict(), "device": self.device_info.get("device_name", "?"),
                         "torch_device": self.device_info.get("device"), "cc_mode": self.device_info.get("cc_mode")},
            "attestation": {"ok": self.attestation.get("ok"), "device_id": self.attestation.get("device_id"),
                            "claims": self.attestation.get("claims")},
            "holders": [i.to_dict() for i in self.infos.values()],
            "visits": visits,
            "training": {
                "model_params": self.device_info.get("params"),
                "steps": self.step_count,
                "loss_first": trained[0].losses[0] if trained else None,
                "loss_last": trained[-1].losses[-1] if trained else None,
                "val_loss": val[-1] if val else None,
                "val_loss_first": val[0] if val else None,
                "tokens_per_s": round(sum(r.tokens_per_s for r in trained) / len(trained), 1) if trained else None,
                "model_digest": self.expected_model,
                "loss_curve": [round(loss, 5) for _, loss in self.loss_history],
                "val_curve": [{"step": st, "holder": h, "val_loss": round(v, 5)} for st, h, v in self.val_history],
            },
            "provisioning": {"bytes": total_bytes, "seconds": round(total_prov, 6),
                             "data_path": self.device_info.get("data_path"),
                             "mb_s": round(total_bytes / total_prov / 1e6, 2) if total_prov else None,
                             "chunk_kib": self.settings.chunk_kib, "rejected": dict(self.rejected_total)},
            "ledger": {"path": str(self.out_dir / "ledger.db"), "verified": verify.ok, "rows": verify.rows,
                       "head": verify.head_hash, "reason": verify.reason},
            "checkpoints": {"dir": str(self.ckpt.directory), "last_seq": self.last_good_ckpt},
            "failed_visits": sum(1 for r in self.records if r.outcome == "failed"),
            "retried_visits": sum(1 for r in self.records if r.failures),
            "attacks": [{"visit": r.plan.index, "holder": r.plan.holder, "epoch": r.epoch, "attempts": r.attack}
                        for r in self.records if r.attack],
            "device_restarts": self.device_restarts,
            "session_rekeys": self.session_rekeys,
            "control_rotations": self.client.rotations,
            "seconds": round(seconds, 3),
        }
