"""The device service's own operations: attestation inside the session (``attest``, ``gpu_evidence``), the
control channel (``rotate``, ``shutdown``), what the device is and does (``info``, ``stats``, ``aes_rate``) and the
data path's settings (``set_data_path``).

:class:`DeviceOps` is one part of :class:`~gputravel.core.device.service.DeviceService`: it owns the device's
identity and its evidence, and the data path's settings (``data_opts``); everything else it answers it reads
from the parts given at construction (the session, the counts, the windows' epoch, the model's memory)."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import torch

from gputravel.core import allocator
from gputravel.core.attestation import CCMode, DeviceIdentity, Evidence, emulated_measurements, make_evidence
from gputravel.core.device.counters import Counters
from gputravel.core.device.dataplane import AUTO_MIN_CORES, DataPlane, default_workers
from gputravel.core.device.memory import Region
from gputravel.core.device.model import ModelSlot
from gputravel.core.device.openers import ChunkOpener
from gputravel.core.device.reply import Handler, Reply
from gputravel.core.device.session_keys import DeviceSecrets
from gputravel.core.device.spdm import SpdmResponder
from gputravel.core.device.window import BufferWindows
from gputravel.core.errors import DeviceError
from gputravel.core.machine import aes_gcm_rate
from gputravel.core.protocol import FrameError
from gputravel.core.protocol.deviceanswers import AesRate, DataPathConfig, DeviceInfo, DeviceStats
from gputravel.core.protocol.devicelink import Op

__all__ = ["STATS_EPOCHS", "DeviceOps"]

#: epochs one ``stats`` answer lists at most (each up to ~150 bytes of counts: far under the header limit)
STATS_EPOCHS = 64


class DeviceOps:
    """The service's own operations. Given at construction: the identity and CC mode it attests, the torch
    device and buffer it describes, the session part (``rotate``), the counts, the windows part (the epoch), the
    model part (memory in use), the data plane and opener (the data path's settings) and the SPDM responder."""

    def __init__(self, *, identity: DeviceIdentity, cc_mode: CCMode, device: torch.device, buffer: Region,
                 keys: DeviceSecrets, counts: Counters, windows: BufferWindows, model: ModelSlot, plane: DataPlane,
                 opener: ChunkOpener, spdm: SpdmResponder) -> None:
        self.identity, self.cc_mode, self._device, self._buffer = identity, cc_mode, device, buffer
        self._keys, self._counts, self._windows, self._model = keys, counts, windows, model
        self._plane, self._opener, self._spdm = plane, opener, spdm
        self.measurements = emulated_measurements()
        self.data_opts: dict[str, Any] = {"parallel_auth": False, "overlap": False, "workers": 0}

    def operations(self) -> dict[str, Handler]:
        """This part's entries: attestation, the control channel, telemetry and the data path."""
        return {Op.ATTEST: self.op_attest, Op.GPU_EVIDENCE: self.op_gpu_evidence, Op.ROTATE: self.op_rotate,
                Op.SHUTDOWN: self.op_shutdown, Op.INFO: self.op_info, Op.STATS: self.op_stats,
                Op.AES_RATE: self.op_aes_rate, Op.SET_DATA_PATH: self.op_set_data_path}

    def evidence(self, nonce: bytes) -> Evidence:
        """Evidence of this device's measurements over ``nonce`` (before a session, and inside one)."""
        self._counts.counters["attestations"] += 1
        return make_evidence(self.identity, nonce=nonce, measurements=self.measurements, cc_mode=self.cc_mode)

    def op_attest(self, *, nonce: str, payload: bytes) -> Reply:
        """Fresh evidence over the verifier's nonce, inside the session."""
        return Reply({"evidence": self.evidence(bytes.fromhex(nonce)).to_dict()})

    def op_gpu_evidence(self, *, nonce: str, chain: bool = False, tamper: str | None = None,
                        payload: bytes) -> Reply:
        """SPDM evidence in NVIDIA's format over a holder's nonce (SIM GPU; core/device/spdm.py)."""
        return Reply(self._spdm.answer(nonce=nonce, chain=chain, tamper=tamper))

    def op_rotate(self, *, epoch: int, payload: bytes) -> Reply:
        """Key update of the control channel: the transport swaps keys after sending this answer."""
        rotate_to = self._keys.rotate(epoch)
        return Reply({"epoch": rotate_to}, rekey_to=rotate_to)

    def op_shutdown(self, *, payload: bytes) -> Reply:
        return Reply({}, stop=True)

    def op_info(self, *, payload: bytes) -> Reply:
        alloc, heap = allocator.applied(), allocator.malloc_state()
        return Reply(DeviceInfo(device=str(self._device), device_name=self._device_name(),
                                buffer_bytes=self._buffer.nbytes, cc_mode=str(self.cc_mode), platform="emulated",
                                device_id=self.identity.device_id, torch=torch.__version__,
                                cipher_engine=self._opener.label, cipher_reason=self._opener.reason,
                                allocator=alloc.mode, allocator_reason=alloc.reason,
                                malloc_arenas=heap.arenas if heap else 0, malloc_mmap_bytes=heap.mmap_bytes if heap else 0,
                                malloc_heap_bytes=heap.heap_bytes if heap else 0).to_wire())

    def _device_name(self) -> str:
        if self._device.type == "cuda":
            return torch.cuda.get_device_name(self._device)
        return "CPU (emulated GPU memory)"

    def op_stats(self, *, since: int = 0, payload: bytes) -> Reply:
        """The counters in the header; the per-epoch rejection counts of the epochs changed after generation
        ``since`` (the ``rejection_gen`` of the caller's last answer) as JSON in the payload: at most
        ``STATS_EPOCHS`` of them, oldest change first, with ``more`` set when others wait for the next call.
        An answer stays small however long the run, and each audit reads only what is new."""
        if type(since) is not int or since < 0:
            raise FrameError("stats: since must be a non-negative integer")
        c = self._counts
        changed, upto, more = c.changed_since(since, STATS_EPOCHS)
        # ``cpu_ns``: the service's CPU time so far, every thread (``bench provision`` accounts a hand-off's CPU by end)
        wire = DeviceStats(counters={**c.counters, "cpu_ns": time.process_time_ns()}, rejected=dict(c.rejected), busy_s=c.busy_s,
                           rejected_by_epoch={str(e): dict(c.rejected_by_epoch[e]) for e in changed},
                           memory_bytes=self._model.memory_bytes(), epoch=self._windows.epoch, rejection_gen=upto,
                           more=more, refused=dict(c.refused)).to_wire()
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
        self._plane.configure(workers=config.workers, frame_overlap=frame_overlap)
        return Reply(config.to_wire())
