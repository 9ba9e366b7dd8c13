"""The device service's logic, independent of its transport.

It stands for the GPU package: it owns the code, model and data-buffer regions, its identity key,
the session secrets and every provisioning key. Nothing leaves it in plaintext except what the
protocol says may (evidence, measurements, losses, acknowledgements).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from gputravel.core.attestation import (
    CCMode,
    DeviceIdentity,
    Evidence,
    emulated_measurements,
    make_evidence,
)
from gputravel.core.device.ckpt_ops import CheckpointOps
from gputravel.core.device.dataplane import DataPlane
from gputravel.core.device.intake import ChunkIntake, ProvisionWindow
from gputravel.core.device.memory import Region, best_device
from gputravel.core.device.model import ModelOps
from gputravel.core.device.openers import choose_opener
from gputravel.core.device.operations import STATS_EPOCHS, ServiceOps
from gputravel.core.device.reply import Handler, Reply
from gputravel.core.device.session_keys import DeviceSecrets
from gputravel.core.device.spdm import SpdmResponder
from gputravel.core.device.window import MAX_CHUNK, WindowOps
from gputravel.core.errors import DeviceError
from gputravel.core.handshake import SessionSecrets, respond


class DeviceService(ServiceOps, ChunkIntake, WindowOps, ModelOps, CheckpointOps):
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
        #: the session part: the session secrets and the control channel's epoch (core/device/session_keys.py)
        self.keys = DeviceSecrets()
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
        #: and a part that adds operations (the fleet's) adds its entries here (add_part)
        self.operations: dict[str, Handler] = {
            **self.service_operations(), **self.window_operations(), **self.model_operations(),
            **self.checkpoint_operations(),
        }

    def add_part(self, entries: dict[str, Handler]) -> None:
        """Add a part's entries to the one operation table (the fleet's part, core/fleet/device.py); a wire
        name already in the table is refused, so a part cannot shadow another's operation."""
        clash = sorted(set(entries) & set(self.operations))
        if clash:
            raise DeviceError(f"operations already in the table: {', '.join(clash)}")
        self.operations.update(entries)

    # --- attestation and session ------------------------------------------------------------
    def evidence(self, nonce: bytes) -> Evidence:
        self.counters["attestations"] += 1
        return make_evidence(self.identity, nonce=nonce, measurements=self.measurements, cc_mode=self.cc_mode)

    def open_session(self, *, initiator_public: bytes, context: bytes) -> tuple[bytes, bytes, SessionSecrets]:
        """Authenticated ECDH; a new session revokes every key of the previous one."""
        pub, sig, secrets = respond(self.identity.key, initiator_public=initiator_public, context=context)
        with self.lock:
            self.keys.start(secrets)
            self.epoch = 0
            self.window = None
            self.plane.release_rings()  # every ring of the old session is zeroed and released with its keys
            self.dead_epochs.clear()
            self.dead_tags.clear()
            self.model_changed()
        self.counters["sessions"] += 1
        return pub, sig, secrets

    @property
    def secrets(self) -> SessionSecrets | None:
        """The session's secrets (None before the first session): the session part's."""
        return self.keys.secrets

    @property
    def control_epoch(self) -> int:
        """The control channel's current epoch: the session part's."""
        return self.keys.control_epoch

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
