"""The device service's logic, independent of its transport.

It stands for the GPU package: it owns the code, model and data-buffer regions, its identity key,
the session secrets and every provisioning key. Nothing leaves it in plaintext except what the
protocol says may (evidence, measurements, losses, acknowledgements).
"""

from __future__ import annotations

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
from gputravel.core.device.model import ModelOps
from gputravel.core.device.openers import choose_opener
from gputravel.core.device.reply import Handler, Reply
from gputravel.core.device.spdm import SpdmResponder
from gputravel.core.device.window import MAX_CHUNK, WindowOps
from gputravel.core.errors import DeviceError, ProtocolError
from gputravel.core.handshake import SessionSecrets, respond
from gputravel.core.machine import aes_gcm_rate
from gputravel.core.protocol import FrameError
from gputravel.core.protocol.deviceanswers import AesRate, DataPathConfig, DeviceInfo, DeviceStats
from gputravel.core.protocol.devicelink import Op

#: epochs one ``stats`` answer lists at most (each up to ~150 bytes of counts: far under the header limit)
STATS_EPOCHS = 64


class DeviceService(ChunkIntake, WindowOps, ModelOps, CheckpointOps):
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
        #: the one operation table, wire name -> handler, assembled from the concerns' entries (window.py,
        #: model.py, ckpt_ops.py and this module's own); every sealed request is dispatched here, by name,
        #: and a service that adds operations (the fleet's) adds its entries here
        self.operations: dict[str, Handler] = {
            **self.service_operations(), **self.window_operations(), **self.model_operations(),
            **self.checkpoint_operations(),
        }

    def service_operations(self) -> dict[str, Handler]:
        """The service's own entries: attestation, the control channel, telemetry and the data path."""
        return {Op.ATTEST: self.op_attest, Op.GPU_EVIDENCE: self.op_gpu_evidence, Op.ROTATE: self.op_rotate,
                Op.SHUTDOWN: self.op_shutdown, Op.INFO: self.op_info, Op.STATS: self.op_stats,
                Op.AES_RATE: self.op_aes_rate, Op.SET_DATA_PATH: self.op_set_data_path}

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
        fn = self.operations.get(op) if isinstance(op, str) else None
        if fn is None:
            raise DeviceError(f"unknown operation {op!r}")
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


__all__ = ["MAX_CHUNK", "STATS_EPOCHS", "DeviceService", "Handler", "ProvisionWindow", "Reply", "load_service"]
