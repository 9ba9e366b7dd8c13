"""The device service's logic, independent of its transport.

It stands for the GPU package: it owns the code, model and data-buffer regions, its identity key,
the session secrets and every provisioning key. Nothing leaves it in plaintext except what the
protocol says may (evidence, measurements, losses, acknowledgements).
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

from gputravel.core.attestation import CCMode, DeviceIdentity, Evidence
from gputravel.core.device.ckpt_ops import StateStreams
from gputravel.core.device.counters import Counters
from gputravel.core.device.dataconn import DataPath
from gputravel.core.device.dataplane import DataPlane
from gputravel.core.device.intake import ChunkIntake
from gputravel.core.device.memory import Region, best_device
from gputravel.core.device.model import ModelSlot
from gputravel.core.device.openers import choose_opener
from gputravel.core.device.operations import STATS_EPOCHS, DeviceOps
from gputravel.core.device.reply import Handler, Reply
from gputravel.core.device.session_keys import DeviceSecrets
from gputravel.core.device.spdm import SpdmResponder
from gputravel.core.device.window import MAX_CHUNK, BufferWindows, ProvisionWindow
from gputravel.core.errors import DeviceError
from gputravel.core.handshake import SessionSecrets, respond


class DeviceService:
    """One emulated confidential GPU: the composition root of its parts (no mixin; each part owns its state and
    is given, at construction, the narrow references it needs):

    ``keys`` (:class:`DeviceSecrets`, session_keys.py) the session secrets and control epoch; ``counts``
    (:class:`Counters`, counters.py) every count; ``windows`` (:class:`BufferWindows`, window.py) the buffer's
    provisioning windows; ``intake`` (:class:`ChunkIntake`, intake.py) the chunks into them; ``model``
    (:class:`ModelSlot`, model.py) the code region and the model; ``streams`` (:class:`StateStreams`,
    ckpt_ops.py) checkpoints and restores; ``ops`` (:class:`DeviceOps`, operations.py) the service's own
    operations. Each adds its entries to the one operation table, ``operations``, as a part from outside does
    (``add_part``: the fleet's, core/fleet/device.py)."""

    def __init__(self, *, identity: DeviceIdentity, buffer_bytes: int, device: str | None = None,
                 cc_mode: CCMode = CCMode.ON, allow_fault_injection: bool = False,
                 staged: bool | None = None, cipher_engine: str = "auto") -> None:
        """``staged`` opens chunks into staging slots then copies them (default: on CUDA only; on for a CPU
        device in tests, which exercises the CUDA path's slot ring and completion step)."""
        if buffer_bytes <= 0:
            raise DeviceError("buffer size must be positive")
        self.identity = identity
        self.device = best_device(device)
        self.allow_fault_injection = allow_fault_injection
        self.buffer = Region("buffer", buffer_bytes, self.device)
        self.lock = threading.Lock()
        self.keys = DeviceSecrets()
        self.counts = Counters(self.lock)
        #: receive slots, decrypt workers, staging ring and copy stream, shared-memory rings: made once, reused
        self.plane = DataPlane(self.buffer.tensor, staged=staged, stage_ns=self.counts.counters)
        #: who opens provisioning chunks, one strategy (core/device/openers.py): cryptography on a host core
        #: (through the data plane's slots), or the GPU cipher, which takes the ciphertext in as it is
        self.opener = choose_opener(cipher_engine, self.plane)
        #: the SIM GPU's SPDM responder (holders' own attestation, core/device/spdm.py)
        self.spdm = SpdmResponder()
        self.windows = BufferWindows(keys=self.keys, buffer=self.buffer, plane=self.plane, opener=self.opener,
                                     counts=self.counts, lock=self.lock, allow_fault_injection=allow_fault_injection)
        self.intake = ChunkIntake(windows=self.windows, counts=self.counts, opener=self.opener, plane=self.plane)
        self.model = ModelSlot(device=self.device, buffer=self.buffer, plane=self.plane, windows=self.windows,
                               counts=self.counts, allow_fault_injection=allow_fault_injection)
        self.streams = StateStreams(model=self.model, windows=self.windows, device=self.device, counts=self.counts)
        self.ops = DeviceOps(identity=identity, cc_mode=cc_mode, device=self.device, buffer=self.buffer,
                             keys=self.keys, counts=self.counts, windows=self.windows, model=self.model,
                             plane=self.plane, opener=self.opener, spdm=self.spdm)
        #: the one operation table, wire name -> handler: every sealed request is dispatched here, by name
        self.operations: dict[str, Handler] = {}
        for part in (self.ops, self.windows, self.model, self.streams):
            self.add_part(part.operations())

    def add_part(self, entries: dict[str, Handler]) -> None:
        """Add a part's entries to the one operation table (the fleet's part, core/fleet/device.py); a wire
        name already in the table is refused, so a part cannot shadow another's operation."""
        clash = sorted(set(entries) & set(self.operations))
        if clash:
            raise DeviceError(f"operations already in the table: {', '.join(clash)}")
        self.operations.update(entries)

    # --- attestation and session ------------------------------------------------------------
    def evidence(self, nonce: bytes) -> Evidence:
        return self.ops.evidence(nonce)

    def open_session(self, *, initiator_public: bytes, context: bytes) -> tuple[bytes, bytes, SessionSecrets]:
        """Authenticated ECDH; a new session revokes every key of the previous one."""
        pub, sig, secrets = respond(self.identity.key, initiator_public=initiator_public, context=context)
        with self.lock:
            self.keys.start(secrets)
            self.windows.new_session()
            self.model.model_changed()
        self.counts.counters["sessions"] += 1
        return pub, sig, secrets

    @property
    def secrets(self) -> SessionSecrets | None:
        """The session's secrets (None before the first session): the session part's."""
        return self.keys.secrets

    # --- control operations (already authenticated by the sealed channel) -------------------
    def handle(self, op: str, args: dict[str, Any], payload: bytes) -> Reply:
        """Dispatch one authenticated request through the operation table."""
        fn = self.operations.get(op) if isinstance(op, str) else None
        if fn is None:
            raise DeviceError(f"unknown operation {op!r}")
        with self.counts.busy():
            try:
                reply = fn(payload=payload, **args)
            except TypeError as exc:
                raise DeviceError(f"bad arguments for {op}: {exc}") from None
            self.counts.counters["bytes_out"] += len(reply.payload)
            return reply

    def public_counters(self) -> dict[str, Any]:
        """What telemetry may read without a session: totals and rates, never data or keys. Busy time
        includes the operation in progress, so utilisation does not stall during a long TRAIN."""
        public = self.counts.public()
        return {"counters": public["counters"], "busy_s": public["busy_s"], "memory_bytes": self.model.memory_bytes(),
                "epoch": self.windows.epoch, "rejected": public["rejected"], "refused": public["refused"],
                "device": str(self.device)}

    def data_path(self) -> DataPath:
        """The parts a data connection reaches (core/device/dataconn.py), no more."""
        return DataPath(keys=self.keys, counts=self.counts, windows=self.windows, intake=self.intake,
                        plane=self.plane)

    # --- the narrow view a part added from outside reads (the fleet's: core/fleet/device.py) -
    @property
    def counters(self) -> Counter[str]:
        """The counts part's totals."""
        return self.counts.counters

    def need_trainer(self) -> Any:
        """The model part's trainer (a named error before CONFIGURE)."""
        return self.model.need_trainer()

    def check_train_ranges(self, *, train_off: int, train_len: int, val_off: int, val_len: int) -> None:
        """The guards every training operation shares (the model part's, ``train``'s)."""
        self.model.check_train_ranges(train_off=train_off, train_len=train_len, val_off=val_off, val_len=val_len)

    def model_changed(self) -> None:
        """A new model generation (the model part's)."""
        self.model.model_changed()

    def model_digest(self) -> str:
        """The model's digest, memoised per generation (the model part's)."""
        return self.model.model_digest()


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
