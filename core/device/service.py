"""The device service's logic, independent of its transport.

It stands for the GPU package: it owns the code, model and data-buffer regions, its identity key,
the session secrets and every provisioning key. Nothing leaves it in plaintext except what the
protocol says may (evidence, measurements, losses, acknowledgements).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from gputravel.core.attestation import (
    CCMode,
    DeviceIdentity,
    Evidence,
    emulated_measurements,
    make_evidence,
)
from gputravel.core.device.ckpt_ops import CheckpointOps
from gputravel.core.device.dataplane import AUTO_MIN_CORES, DataPlane, default_workers
from gputravel.core.device.intake import ChunkIntake, ProvisionWindow
from gputravel.core.device.memory import Region, best_device
from gputravel.core.device.modelmac import MAC_KEY_BYTES, model_mac
from gputravel.core.device.openers import choose_opener
from gputravel.core.device.reply import Handler, Reply
from gputravel.core.device.spdm import SpdmResponder
from gputravel.core.errors import DeviceError, ProtocolError
from gputravel.core.handshake import SessionSecrets, respond
from gputravel.core.machine import aes_gcm_rate
from gputravel.core.protocol import (
    Direction,
    FrameError,
    RecvState,
    StaleEpochError,
    WindowError,
    provisioning_key,
)
from gputravel.core.protocol.deviceanswers import (
    AesRate,
    BufferDigest,
    Configured,
    DataPathConfig,
    DeviceInfo,
    DeviceStats,
    HandoffGrant,
    Measurement,
    ScrubResult,
    TrainResult,
    WindowClosed,
    WindowStatus,
)
from gputravel.core.protocol.devicelink import Op
from gputravel.core.protocol.holderlink import ProvisioningKey

MAX_CHUNK = 16 * 1024 * 1024
#: epochs one ``stats`` answer lists at most (each up to ~150 bytes of counts: far under the header limit)
STATS_EPOCHS = 64
#: closed windows whose accepted chunks' tags are remembered, so a captured chunk replayed later is named
DEAD_TAG_EPOCHS = 64


class DeviceService(ChunkIntake, CheckpointOps):
    """One emulated confidential GPU."""

    def __init__(self, *, identity: DeviceIdentity, buffer_bytes: int, device: str | None = None,
                 cc_mode: CCMode = CCMode.ON, allow_fault_injection: bool = False,
                 staged: bool | None = None, cipher_engine: str = "auto") -> None:
        """``staged`` opens chunks into staging slots then copies them (default: on CUDA only; on for a CPU
        device in tests, which exercises the CUDA path's slot ring and completion step)."""
        if buffer_bytes <= 0:
            raise DeviceError("buffer size must be positive")
        self.identity = identity
        self.cc_mode = cc_mode
        self.device = best_device(device)
        self.allow_fault_injection = allow_fault_injection
        self.code = Region("code", 0, self.device)
        self.buffer = Region("buffer", buffer_bytes, self.device)
        self.trainer: Any = None
        self.secrets: SessionSecrets | None = None
        self.epoch = 0
        self.window: ProvisionWindow | None = None
        self.dead_epochs: set[int] = set()
        self.dead_tags: dict[int, set[bytes]] = {}
        self.lock = threading.Lock()
        self._settled = threading.Condition(self.lock)  # notified whenever a chunk leaves a window's in-flight set
        self.rejected: Counter[str] = Counter()
        #: rejections attributed to the epoch (so the holder) whose key or window they claimed
        self.rejected_by_epoch: dict[int, Counter[str]] = {}
        #: generation of the last rejection attributed to an epoch, and each epoch's last change (in change
        #: order): ``stats(since=)`` answers only the epochs changed since the caller's last audit
        self.rejection_gen = 0
        #: connections refused before they authenticated, by reason (chunks refused are ``rejected``)
        self.refused: Counter[str] = Counter()
        self._epoch_gen: dict[int, int] = {}
        self.counters: Counter[str] = Counter()
        self.busy_s = 0.0
        self._busy_since: float | None = None
        self.data_opts: dict[str, Any] = {"parallel_auth": False, "overlap": False, "workers": 0}
        #: receive slots, decrypt workers, staging ring and copy stream, shared-memory rings: made once, reused
        self.plane = DataPlane(self.buffer.tensor, staged=staged, stage_ns=self.counters)
        #: who opens provisioning chunks, one strategy (core/device/openers.py): cryptography on a host core
        #: (through the data plane's slots), or the GPU cipher, which takes the ciphertext in as it is
        self.opener = choose_opener(cipher_engine, self.plane)
        self.measurements = emulated_measurements()
        #: the control channel's current epoch (the transport swaps its keys after a ROTATE reply)
        self.control_epoch = 0
        #: the model digest, remembered for the model generation it was taken of: any operation that can
        #: change the model, and any key that comes into being (a hand-off, a new session), starts a new
        #: generation, so a measurement after them hashes afresh; between them the digest is reused
        self._model_gen = 0
        self._digest_memo: tuple[int, str] | None = None
        self.last_digest_s = 0.0
        self._ckpt_stream = None
        self._restore_stream = None
        self._ring_stream = None
        self._snapshot_bufs: list[Any] = []  # a background checkpoint's copy of the state, reused
        self._model_incomplete = False
        #: the SIM GPU's SPDM responder (holders' own attestation, core/device/spdm.py)
        self.spdm = SpdmResponder()
        #: the one operation table: every sealed request is dispatched here, by name
        self.operations: dict[Op, Handler] = {
            Op.ATTEST: self.op_attest, Op.ROTATE: self.op_rotate, Op.SHUTDOWN: self.op_shutdown,
            Op.INFO: self.op_info, Op.CONFIGURE: self.op_configure, Op.MEASURE: self.op_measure,
            Op.HANDOFF: self.op_handoff, Op.CLOSE_WINDOW: self.op_close_window,
            Op.WINDOW_STATUS: self.op_window_status, Op.TRAIN: self.op_train, Op.SCRUB: self.op_scrub,
            Op.CHECKPOINT: self.op_checkpoint, Op.CHECKPOINT_NEXT: self.op_checkpoint_next,
            Op.CHECKPOINT_END: self.op_checkpoint_end,
            Op.RESTORE: self.op_restore, Op.RESTORE_CHUNK: self.op_restore_chunk, Op.RESTORE_END: self.op_restore_end, Op.STATS: self.op_stats,
            Op.AES_RATE: self.op_aes_rate, Op.TAMPER: self.op_tamper, Op.DIGEST: self.op_digest,
            Op.SET_DATA_PATH: self.op_set_data_path,
            Op.GPU_EVIDENCE: self.op_gpu_evidence,
        }

    # --- attestation and session ------------------------------------------------------------
    def evidence(self, nonce: bytes) -> Evidence:
        self.counters["attestations"] += 1
        return make_evidence(self.identity, nonce=nonce, measurements=self.measurements, cc_mode=self.cc_mode)

    def open_session(self, *, initiator_public: bytes, context: bytes) -> tuple[bytes, bytes, SessionSecrets]:
        """Authenticated ECDH; a new session revokes every key of the previous one."""
        pub, sig, secrets = respond(self.identity.key, initiator_public=initiator_public, context=context)
        with self.lock:
            self.secrets = secrets
            self.epoch = 0
            self.window = None
            self.plane.release_rings()  # every ring of the old session is zeroed and released with its keys
            self.dead_epochs.clear()
            self.dead_tags.clear()
            self.control_epoch = 0
            self._model_changed()
        self.counters["sessions"] += 1
        return pub, sig, secrets

    def _session(self) -> SessionSecrets:
        if self.secrets is None:
            raise DeviceError("no session: attest and open a session first")
        return self.secrets

    # --- control operations (already authenticated by the sealed channel) -------------------
    def handle(self, op: str, args: dict[str, Any], payload: bytes) -> Reply:
        """Dispatch one authenticated request through the operation table."""
        try:
            fn = self.operations[Op(op)]
        except ValueError:
            raise DeviceError(f"unknown operation {op!r}") from None
        t0 = self._busy_since = time.perf_counter()
        try:
            reply = fn(payload=payload, **args)
            self.counters["bytes_out"] += len(reply.payload)
            return reply
        except TypeError as exc:
            raise DeviceError(f"bad arguments for {op}: {exc}") from None
        finally:
            self._busy_since = None
            self.busy_s += time.perf_counter() - t0

    def public_counters(self) -> dict[str, Any]:
        """What telemetry may read without a session: totals and rates, never data or keys. Busy time
        includes the operation in progress, so utilisation does not stall during a long TRAIN."""
        since = self._busy_since
        busy = self.busy_s + (time.perf_counter() - since if since is not None else 0.0)
        return {"counters": {k: int(v) for k, v in self.counters.items()}, "busy_s": busy,
                "memory_bytes": self._memory_bytes(),
                "epoch": self.epoch, "rejected": dict(self.rejected), "refused": dict(self.refused),
                "device": str(self.device)}

    def op_attest(self, *, nonce: str, payload: bytes) -> Reply:
        """Fresh evidence over the verifier's nonce, inside the session."""
        return Reply({"evidence": self.evidence(bytes.fromhex(nonce)).to_dict()})

    def op_gpu_evidence(self, *, nonce: str, chain: bool = False, tamper: str | None = None,
                        payload: bytes) -> Reply:
        """SPDM evidence in NVIDIA's format over a holder's nonce (SIM GPU; core/device/spdm.py)."""
        return Reply(self.spdm.answer(nonce=nonce, chain=chain, tamper=tamper))

    def op_rotate(self, *, epoch: int, payload: bytes) -> Reply:
        """Key update of the control channel: the transport swaps keys after sending this answer."""
        rotate_to = int(epoch)
        if rotate_to <= self.control_epoch:
            raise ProtocolError(f"rotate to epoch {rotate_to} is not newer than {self.control_epoch}")
        self.control_epoch = rotate_to
        return Reply({"epoch": rotate_to}, rekey_to=rotate_to)

    def op_shutdown(self, *, payload: bytes) -> Reply:
        return Reply({}, stop=True)

    def op_info(self, *, payload: bytes) -> Reply:
        return Reply(DeviceInfo(device=str(self.device), device_name=self._device_name(),
                                buffer_bytes=self.buffer.nbytes, cc_mode=str(self.cc_mode), platform="emulated",
                                device_id=self.identity.device_id, torch=torch.__version__,
                                cipher_engine=self.opener.label, cipher_reason=self.opener.reason).to_wire())

    def _device_name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return "CPU (emulated GPU memory)"

    def op_configure(self, *, payload: bytes) -> Reply:
        """Upload the code region (the training program) and build the model from it."""
        from gputravel.core.training.model import GPTConfig
        from gputravel.core.training.trainer import Trainer, TrainSettings

        try:
            program = json.loads(payload.decode())
            config = GPTConfig.from_dict(program["model"])
            settings = TrainSettings(**program["train"])
        except (ValueError, KeyError, TypeError) as exc:
            raise DeviceError(f"invalid training program: {exc}") from None
        self.code.write(payload)
        self.trainer = Trainer(config, settings, self.device)
        self._model_changed()
        n_params = sum(p.numel() for p in self.trainer.model.parameters())
        return Reply(Configured(code_digest=self.code.digest(), params=int(n_params)).to_wire())

    def _need_trainer(self) -> Any:
        if self.trainer is None:
            raise DeviceError("no model: configure first")
        return self.trainer

    def _model_changed(self) -> None:
        """A new model generation: the next digest is taken afresh (and an open checkpoint stream, now of a
        model that no longer exists, is dropped)."""
        self._model_gen += 1
        self._ckpt_stream = None

    def model_digest(self) -> str:
        """The model's digest (weights and optimizer state), hashed at most once per model generation, on the
        device's own memory (bounded staging on CUDA, never a full copy to the host). The time of the last
        hash is ``last_digest_s`` (0 when the digest was reused)."""
        memo = self._digest_memo
        if memo is not None and memo[0] == self._model_gen:
            self.last_digest_s = 0.0
            return memo[1]
        t0 = time.perf_counter()
        digest = str(self._need_trainer().model_digest())
        self.last_digest_s = time.perf_counter() - t0
        self.counters["model_digests"] += 1
        self._digest_memo = (self._model_gen, digest)
        return digest

    def _digest_beside(self) -> None:
        """``model_digest`` on a thread of its own; an error is not lost: the caller's ``model_digest()``
        finds no memo and hashes (and raises) again."""
        try:
            self.model_digest()
        except Exception:  # noqa: BLE001, S110 - redone and raised by the caller
            pass

    def _need_whole_model(self) -> Any:
        trainer = self._need_trainer()
        self._settle_live_checkpoint()  # a checkpoint sealing the live state finishes before the model changes
        if self._restore_stream is not None or self._model_incomplete:
            raise DeviceError("the model is incomplete: a restore is open or failed part-way; restore a checkpoint")
        return trainer

    def op_measure(self, *, payload: bytes, digest: bool = True) -> Reply:
        """The code region's SHA-256 and the model's: its SHA-256 digest (``digest``, memoised per model
        generation) and, given a 32-byte key as the payload, its AES-GMAC under that key, computed here on the
        model's own memory (core/device/modelmac.py). VERIFY asks for the MAC alone: cipher speed."""
        trainer = self._need_trainer()
        if not isinstance(digest, bool):
            raise DeviceError(f"measure: digest is true or false, not {digest!r}")
        if payload and len(payload) != MAC_KEY_BYTES:
            raise DeviceError(f"a model MAC key is {MAC_KEY_BYTES} bytes, got {len(payload)}")
        if not payload and not digest:
            raise DeviceError("a measurement needs the model's digest or a MAC key")
        code = self.code.digest()
        model, digest_s = "", 0.0
        if digest:
            model = self.model_digest()
            digest_s = self.last_digest_s
        mac, mac_s, mac_engine = None, 0.0, None
        if payload:
            t0 = time.perf_counter()
            mac, mac_engine = model_mac(trainer.model, trainer.optimizer, bytes(payload))
            mac_s = time.perf_counter() - t0
            self.counters["model_macs"] += 1
        combined = hashlib.sha256(bytes.fromhex(code) + bytes.fromhex(model or mac or "")).hexdigest()
        self.counters["measurements"] += 1
        return Reply(Measurement(code=code, model=model, measurement=combined, digest_s=digest_s, mac=mac,
                                 mac_s=mac_s, mac_engine=mac_engine).to_wire())

    def op_handoff(self, *, epoch: int, offset: int, length: int, chunk_size: int, payload: bytes) -> Reply:
        """Derive the provisioning key for one window and one epoch; any earlier key dies."""
        s = self._session()
        if epoch <= self.epoch or epoch in self.dead_epochs:
            raise StaleEpochError(f"epoch {epoch} is not newer than the current epoch {self.epoch}")
        if not (0 <= offset and 0 < length and offset + length <= self.buffer.nbytes):
            raise WindowError(f"window [{offset}, {offset + length}) is outside the {self.buffer.nbytes}-byte buffer")
        if not 0 < chunk_size <= MAX_CHUNK:
            raise DeviceError(f"chunk size {chunk_size} outside 1..{MAX_CHUNK}")
        key = provisioning_key(s.master, s.session_id, epoch=epoch, offset=offset, length=length,
                               direction=Direction.HOLDER_TO_DEVICE)
        with self.lock:
            if self.window is not None:
                self._bury(self.window)
            self.window = ProvisionWindow(epoch, offset, length, chunk_size, key.fingerprint,
                                          RecvState(key, session_id=s.session_id, window=4096), key=key)
            self.epoch = epoch
            self._model_changed()  # a key is out: the measurement after its return hashes afresh
        self.counters["handoffs"] += 1
        return Reply(HandoffGrant(session_id=s.session_id.hex(), key_fingerprint=key.fingerprint,
                                  provisioning_key=ProvisioningKey.of(key)).to_wire())

    def op_close_window(self, *, epoch: int, payload: bytes) -> Reply:
        """The holder returned the GPU: its key is dead from here on."""
        with self.lock:
            w = self.window
            if w is None or w.epoch != epoch:
                raise StaleEpochError(f"no open window for epoch {epoch}")
            self.window = None  # no new chunk is admitted from here on
            # chunks admitted before RETURN finish (their copies reach device memory) before the key dies
            self._settled.wait_for(lambda: not w.inflight, timeout=60)
            self._bury(w)
        self.plane.flush()  # the copy stream is idle: every acknowledged byte is in device memory
        self.plane.close_window(epoch)  # its rings zeroed and released, its data connections admitted for nothing
        return Reply(WindowClosed(epoch=epoch, bytes=w.bytes_in, chunks=len(w.accepted), expected_chunks=w.n_chunks,
                                  contiguous=w.contiguous(), complete=len(w.accepted) == w.n_chunks,
                                  rejected=dict(self.rejected),
                                  rejected_in_window=dict(self.rejected_by_epoch.get(epoch, {}))).to_wire())

    def _bury(self, w: ProvisionWindow) -> None:
        """A window's key is dead; the tags of its chunks are kept a while to recognise replays."""
        self.dead_epochs.add(w.epoch)
        self.opener.forget(w.fingerprint)
        w.key = None
        self.dead_tags[w.epoch] = w.tags
        while len(self.dead_tags) > DEAD_TAG_EPOCHS:
            self.dead_tags.pop(next(iter(self.dead_tags)))

    def op_window_status(self, *, payload: bytes) -> Reply:
        w = self.window
        if w is None:
            return Reply(WindowStatus(open=False).to_wire())
        return Reply(WindowStatus(open=True, epoch=w.epoch, contiguous=w.contiguous(), chunks=len(w.accepted),
                                  bytes=w.bytes_in).to_wire())

    def op_train(self, *, train_off: int, train_len: int, val_off: int, val_len: int, fmt: str,
                 steps: int | None = None, budget_s: float | None = None, payload: bytes) -> Reply:
        """A slice of TRAIN: ``steps``, cut short after ``budget_s``; a whole slice validates and hashes."""
        trainer, buf = self._need_whole_model(), self.buffer.tensor
        if self.window is not None:
            raise DeviceError("cannot train while a provisioning window is open")
        for off, n in ((train_off, train_len), (val_off, val_len)):
            if off < 0 or n < 0 or off + n > self.buffer.nbytes:
                raise WindowError(f"range [{off}, {off + n}) is outside the buffer")
        self._model_changed()
        self.plane.make_current_wait()  # training's stream waits for the provisioning copy stream
        res = trainer.train_on_window(buf, train_off=train_off, train_len=train_len, fmt=fmt, steps=steps,
                                      budget_s=budget_s)
        done = len(res.losses) == (steps or trainer.settings.steps_per_visit)
        val = None
        if done and val_len:
            # the model digest (SHA-256 of the whole state, the GIL released) is taken beside the held-out
            # evaluation, which only reads the model: on a free core the visit's hash costs no time; a failed
            # hash is redone (and raised) by the model_digest() below
            hashing = threading.Thread(target=self._digest_beside, name="model-digest", daemon=True)
            hashing.start()
            try:
                val = trainer.eval_on_window(buf, val_off=val_off, val_len=val_len, fmt=fmt)
            finally:
                hashing.join()
        self.counters["train_steps"] += len(res.losses)
        result = TrainResult(losses=res.losses, tokens=res.tokens, seconds=res.seconds, tokens_per_s=res.tokens_per_s,
                             val_loss=val, model_digest=self.model_digest() if done else "", done=done)
        return Reply(result.header_without_losses(), result.losses_payload())

    def op_scrub(self, *, payload: bytes) -> Reply:
        if self.window is not None:
            raise DeviceError("cannot scrub while a provisioning window is open")
        t0 = time.perf_counter()
        ok = self.buffer.zero_and_check()
        self.plane.scrub()  # the staging slots held plaintext on its way into device memory
        self.opener.scrub()
        self.counters["scrubs"] += 1
        return Reply(ScrubResult(verified=ok, bytes=self.buffer.nbytes, seconds=time.perf_counter() - t0).to_wire())

    def _memory_bytes(self) -> int:
        """Device memory in use: buffer, code region, model parameters."""
        mem = self.buffer.nbytes + self.code.nbytes
        if self.trainer is not None:
            mem += sum(p.numel() * p.element_size() for p in self.trainer.model.parameters())
        return int(mem)

    def op_stats(self, *, since: int = 0, payload: bytes) -> Reply:
        """The counters in the header; the per-epoch rejection counts of the epochs changed after generation
        ``since`` (the ``rejection_gen`` of the caller's last answer) as JSON in the payload: at most
        ``STATS_EPOCHS`` of them, oldest change first, with ``more`` set when others wait for the next call.
        An answer stays small however long the run, and each audit reads only what is new."""
        if type(since) is not int or since < 0:
            raise FrameError("stats: since must be a non-negative integer")
        changed = [(e, g) for e, g in self._epoch_gen.items() if g > since][:STATS_EPOCHS]
        more = sum(1 for g in self._epoch_gen.values() if g > since) > len(changed)
        upto = changed[-1][1] if more else self.rejection_gen
        wire = DeviceStats(counters=dict(self.counters), rejected=dict(self.rejected), busy_s=self.busy_s,
                           rejected_by_epoch={str(e): dict(self.rejected_by_epoch[e]) for e, _ in changed},
                           memory_bytes=self._memory_bytes(), epoch=self.epoch, rejection_gen=upto, more=more,
                           refused=dict(self.refused)).to_wire()
        by_epoch = wire.pop("rejected_by_epoch")
        return Reply(wire, json.dumps({"rejected_by_epoch": by_epoch}, separators=(",", ":")).encode())

    def op_aes_rate(self, *, chunk: int, seconds: float = 0.3, payload: bytes) -> Reply:
        """AES-256-GCM decrypt rate measured inside this process (random key and data; nothing secret).

        The data path's AEAD calls share this process's GIL: a busy Python thread here (an event loop,
        a poller) would make every call wait and pull this below the same measurement in a quiet
        process, which ``bench provision`` prints next to it."""
        if type(chunk) is not int or not 16 <= chunk <= 64 << 20:
            raise DeviceError("aes_rate needs an integer chunk of 16 B to 64 MiB")
        seconds = min(max(float(seconds), 0.05), 2.0)
        return Reply(AesRate(bytes_per_s=aes_gcm_rate(chunk, seconds=seconds), chunk=chunk,
                             threads=threading.active_count()).to_wire())

    def op_tamper(self, *, region: str, payload: bytes) -> Reply:
        """Fault injection (emulated platform, only when enabled): corrupt a region."""
        if not self.allow_fault_injection:
            raise DeviceError("fault injection is disabled on this device")
        if region == "model":
            with torch.no_grad():
                p = next(self._need_trainer().model.parameters())
                p.view(-1)[0] += 1.0
            self._model_changed()
        elif region == "code":
            self.code.tensor[0] ^= 0xFF
        else:
            raise DeviceError(f"unknown region {region!r}")
        return Reply({"tampered": region})

    def op_digest(self, *, offset: int, length: int, payload: bytes) -> Reply:
        """Test/debug op (emulated platform, only with fault injection on): SHA-256 of the buffer
        bytes ``[offset, offset + length)``.

        It lets a test check, from outside the process, that refused chunks left the buffer as it
        was. A digest of plaintext is a confirmation oracle on the holders' data, so a production
        device (fault injection off) refuses it like ``op_tamper``.
        """
        if not self.allow_fault_injection:
            raise DeviceError("the digest op is a debug op: fault injection is disabled on this device")
        offset, length = int(offset), int(length)
        if offset < 0 or length < 0 or offset + length > self.buffer.nbytes:
            raise WindowError(f"range [{offset}, {offset + length}) is outside the {self.buffer.nbytes}-byte buffer")
        with self.lock:
            data = self.buffer.tensor[offset: offset + length].cpu().numpy().tobytes()
        return Reply(BufferDigest(sha256=hashlib.sha256(data).hexdigest(), offset=offset, length=length).to_wire())

    def op_set_data_path(self, *, parallel_auth: bool | None = None, overlap: bool | None = None, workers: int = 0,
                         payload: bytes) -> Reply:
        """Switch the provisioning optimisations (for ablation): decryption on a worker pool, and
        decryption overlapped with receiving. ``None`` chooses by the cores this device has
        (``dataplane.default_workers``: measured, not ``cores - 1``)."""
        cores = os.cpu_count() or 2
        auto_n = default_workers(cores)
        auto = auto_n > 0
        reason = "set explicitly"
        if parallel_auth is None or overlap is None:
            reason = (f"auto: {cores} cores" + (f", {auto_n} decrypt workers" if auto else
                                                f" (< {AUTO_MIN_CORES}: measured slower here, so off)"))
        par = auto if parallel_auth is None else bool(parallel_auth)
        ovl = auto if overlap is None else bool(overlap)
        n = workers or ((auto_n or 2) if par else 1)
        config = DataPathConfig(parallel_auth=par, overlap=ovl or par, workers=n if (par or ovl) else 0, reason=reason)
        self.data_opts = config.to_wire()
        # below AUTO_MIN_CORES (no decrypt workers), chunks that arrive in socket frames (the TCP data port,
        # the Unix socket without a ring) are still opened on one thread while the next frame is received:
        # receiving a frame costs a kernel copy as long as opening it (docs/provisioning.md); ring chunks,
        # with nothing to receive, stay inline. Off where set explicitly without overlap (the ablation)
        frame_overlap = ovl if parallel_auth is not None and overlap is not None else True
        self.plane.configure(workers=config.workers, frame_overlap=frame_overlap)
        return Reply(config.to_wire())


def load_service(state_dir: Path, *, buffer_bytes: int, device: str | None = None, cc_mode: str = "on",
                 allow_fault_injection: bool = False, staged: bool | None = None,
                 cipher_engine: str = "auto") -> DeviceService:
    """Provision (or load) the emulated identity under ``state_dir`` and build the service."""
    from gputravel.core.attestation import provision_emulated

    _, identity = provision_emulated(state_dir)
    service = DeviceService(identity=identity, buffer_bytes=buffer_bytes, device=device, cc_mode=CCMode(cc_mode),
                            allow_fault_injection=allow_fault_injection, staged=staged,
                            cipher_engine=cipher_engine)
    service.spdm.state_dir = Path(state_dir)  # the SIM GPU's identity lives with the platform's
    return service


__all__ = ["DeviceService", "Handler", "ProvisionWindow", "Reply", "load_service"]
