"""The device service's model part: the code region and the model built from it, its measurement, TRAIN and
fault injection on the model.

:class:`ModelSlot` is one part of :class:`~gputravel.core.device.service.DeviceService`: it owns the code region,
the trainer, the model generation and the digest memoised for it, and whether the model is whole (a restore open
or failed part-way leaves it incomplete); it adds ``configure``, ``measure``, ``train`` and ``tamper`` to the one
operation table. The state streams part (core/device/ckpt_ops.py) reads and writes the model through it; the
fleet's part shares its range guards (``check_train_ranges``)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from gputravel.core.device.counters import Counters
from gputravel.core.device.dataplane import DataPlane
from gputravel.core.device.memory import Region
from gputravel.core.device.modelmac import MAC_KEY_BYTES, model_mac
from gputravel.core.device.reply import Handler, Reply
from gputravel.core.device.window import BufferWindows
from gputravel.core.errors import DeviceError, WindowError
from gputravel.core.procs import name_os_thread
from gputravel.core.protocol.deviceanswers import Configured, Measurement, TrainResult
from gputravel.core.protocol.devicelink import Op

__all__ = ["ModelSlot"]


class ModelSlot:
    """The model and its operations: configure, measure, train, tamper. Given at construction: the torch device,
    the data buffer (training reads it), the data plane (training waits for its copies), the windows part (no
    training while a window is open; a hand-off starts a new model generation) and the counts."""

    def __init__(self, *, device: torch.device, buffer: Region, plane: DataPlane, windows: BufferWindows,
                 counts: Counters, allow_fault_injection: bool) -> None:
        self._device, self._buffer, self._plane, self._windows, self._counts = device, buffer, plane, windows, counts
        self._allow_fault_injection = allow_fault_injection
        self.code = Region("code", 0, device)
        self.trainer: Any = None
        #: the model digest, remembered for the model generation it was taken of: any operation that can
        #: change the model, and any key that comes into being (a hand-off, a new session), starts a new
        #: generation, so a measurement after them hashes afresh; between them the digest is reused
        self._gen = 0
        self._digest_memo: tuple[tuple[int, int], str] | None = None
        self.last_digest_s = 0.0
        #: a restore open, or one that failed part-way: training and checkpoints are refused until one succeeds
        self.incomplete = False
        #: a reader of the live model to wait for before it changes (a checkpoint sealing the live state)
        self._reader: Callable[[], None] | None = None

    def operations(self) -> dict[str, Handler]:
        """This part's entries of the operation table."""
        return {Op.CONFIGURE: self.op_configure, Op.MEASURE: self.op_measure, Op.TRAIN: self.op_train,
                Op.TAMPER: self.op_tamper}

    @property
    def generation(self) -> tuple[int, int]:
        """The model generation: a change of the model, or a key out (a hand-off), starts a new one."""
        return self._gen, self._windows.keys_out

    def read_live(self, wait: Callable[[], None] | None) -> None:
        """A reader of the live state (a checkpoint sealed without a snapshot): ``wait`` is called before the
        model next changes (None: no reader of the live state)."""
        self._reader = wait

    def settle(self) -> None:
        """Before the model changes: the live state's reader, if any, finishes."""
        if self._reader is not None:
            self._reader()

    def memory_bytes(self) -> int:
        """Device memory in use: buffer, code region, model parameters."""
        mem = self._buffer.nbytes + self.code.nbytes
        if self.trainer is not None:
            mem += sum(p.numel() * p.element_size() for p in self.trainer.model.parameters())
        return int(mem)

    def op_configure(self, *, payload: bytes) -> Reply:
        """Upload the code region (the training program) and build the model from it."""
        from gputravel.core.training.model import model_config_from_dict
        from gputravel.core.training.trainer import Trainer, TrainSettings

        try:
            program = json.loads(payload.decode())
            config = model_config_from_dict(program["model"])
            settings = TrainSettings.from_dict(program["train"])
        except (ValueError, KeyError, TypeError) as exc:
            raise DeviceError(f"invalid training program: {exc}") from None
        self.code.write(payload)
        self.trainer = Trainer(config, settings, self._device)
        self.model_changed()
        n_params = sum(p.numel() for p in self.trainer.model.parameters())
        return Reply(Configured(code_digest=self.code.digest(), params=int(n_params)).to_wire())

    def need_trainer(self) -> Any:
        """The configured trainer (a part added to the service reads it too); a named error before CONFIGURE."""
        if self.trainer is None:
            raise DeviceError("no model: configure first")
        return self.trainer

    def model_changed(self) -> None:
        """A new model generation: the next digest is taken afresh (and an open checkpoint stream, now of a
        model that no longer exists, is refused: the streams part compares generations)."""
        self._gen += 1

    def model_digest(self) -> str:
        """The model's digest (weights and optimizer state), hashed at most once per model generation, on the
        device's own memory (bounded staging on CUDA, never a full copy to the host). The time of the last
        hash is ``last_digest_s`` (0 when the digest was reused)."""
        memo, gen = self._digest_memo, self.generation
        if memo is not None and memo[0] == gen:
            self.last_digest_s = 0.0
            return memo[1]
        t0 = time.perf_counter()
        digest = str(self.need_trainer().model_digest())
        self.last_digest_s = time.perf_counter() - t0
        self._counts.counters["model_digests"] += 1
        self._digest_memo = (gen, digest)
        return digest

    def _digest_beside(self) -> None:
        """``model_digest`` on a thread of its own; an error is not lost: the caller's ``model_digest()``
        finds no memo and hashes (and raises) again."""
        name_os_thread()
        try:
            self.model_digest()
        except Exception:  # noqa: BLE001, S110 - redone and raised by the caller
            pass

    def need_whole_model(self) -> Any:
        """The trainer of a whole model (a named error while a restore is open or after one failed)."""
        trainer = self.need_trainer()
        self.settle()  # a checkpoint sealing the live state finishes before the model changes
        if self.incomplete:
            raise DeviceError("the model is incomplete: a restore is open or failed part-way; restore a checkpoint")
        return trainer

    def op_measure(self, *, payload: bytes, digest: bool = True) -> Reply:
        """The code region's SHA-256 and the model's: its digest (``digest``, ``v3``, memoised per model
        generation) and, given a 32-byte key as the payload, its AES-GMAC under that key, computed here on the
        model's own memory (core/device/modelmac.py). VERIFY asks for the MAC alone: cipher speed."""
        trainer = self.need_trainer()
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
            self._counts.counters["model_macs"] += 1
        combined = hashlib.sha256(bytes.fromhex(code) + bytes.fromhex(model or mac or "")).hexdigest()
        self._counts.counters["measurements"] += 1
        return Reply(Measurement(code=code, model=model, measurement=combined, digest_s=digest_s, mac=mac,
                                 mac_s=mac_s, mac_engine=mac_engine).to_wire())

    def check_train_ranges(self, *, train_off: int, train_len: int, val_off: int, val_len: int) -> None:
        """The guards every training operation shares (``train`` here, the fleet part's ``fleet_train``): no
        provisioning window open, both byte ranges inside the buffer."""
        if self._windows.is_open():
            raise DeviceError("cannot train while a provisioning window is open")
        for off, n in ((train_off, train_len), (val_off, val_len)):
            if off < 0 or n < 0 or off + n > self._buffer.nbytes:
                raise WindowError(f"range [{off}, {off + n}) is outside the buffer")

    def op_train(self, *, train_off: int, train_len: int, val_off: int, val_len: int, fmt: str,
                 steps: int | None = None, budget_s: float | None = None, payload: bytes) -> Reply:
        """A slice of TRAIN: ``steps``, cut short after ``budget_s``; a whole slice validates and hashes."""
        trainer, buf = self.need_whole_model(), self._buffer.tensor
        self.check_train_ranges(train_off=train_off, train_len=train_len, val_off=val_off, val_len=val_len)
        self.model_changed()
        self._plane.make_current_wait()  # training's stream waits for the provisioning copy stream
        res = trainer.train_on_window(buf, train_off=train_off, train_len=train_len, fmt=fmt, steps=steps,
                                      budget_s=budget_s)
        done = len(res.losses) == (steps or trainer.settings.steps_per_visit)
        val = None
        if done and val_len:
            # the model digest (BLAKE3 of the whole state, the GIL released) is taken beside the held-out
            # evaluation, which only reads the model: on a free core the visit's hash costs no time; a failed
            # hash is redone (and raised) by the model_digest() below
            hashing = threading.Thread(target=self._digest_beside, name="model-digest", daemon=True)
            hashing.start()
            try:
                val = trainer.eval_on_window(buf, val_off=val_off, val_len=val_len, fmt=fmt)
            finally:
                hashing.join()
        self._counts.counters["train_steps"] += len(res.losses)
        result = TrainResult(losses=res.losses, tokens=res.tokens, seconds=res.seconds, tokens_per_s=res.tokens_per_s,
                             val_loss=val, model_digest=self.model_digest() if done else "", done=done)
        return Reply(result.header_without_losses(), result.losses_payload())

    def op_tamper(self, *, region: str, payload: bytes) -> Reply:
        """Fault injection (emulated platform, only when enabled): corrupt a region."""
        if not self._allow_fault_injection:
            raise DeviceError("fault injection is disabled on this device")
        if region == "model":
            with torch.no_grad():
                p = next(self.need_trainer().model.parameters())
                p.view(-1)[0] += 1.0
            self.model_changed()
        elif region == "code":
            self.code.tensor[0] ^= 0xFF
        else:
            raise DeviceError(f"unknown region {region!r}")
        return Reply({"tampered": region})
