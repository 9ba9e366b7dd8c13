"""The orchestrator's hold on one device: its process handle, the attested session, the key epochs, and what
its code and model regions must hold.

A run speaks to its device through one ``DeviceSession``. It connects (attest, open the session, read the
device's facts, set the data path), uploads the training program, checks the measurements (the expected
code and model digests, and the model MAC reference that makes VERIFY cheap), restores and loads model
state, re-keys (a fresh attested session when the epoch limit is reached) and restarts a dead device (a new
process, attested, the same program). What a visit does with the device (hand-off windows, TRAIN, SCRUB)
stays in the engine; the bookkeeping of checkpoints stays in ``core.travel.checkpoints``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gputravel.core.attestation import AttestationResult
from gputravel.core.config import RunSettings
from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.errors import DeviceError, GpuTravelError, IntegrityError
from gputravel.core.platform.base import DeviceHandle
from gputravel.core.protocol.deviceanswers import DeviceState
from gputravel.core.protocol.devicelink import MAC_KEY_BYTES
from gputravel.core.training.store import CheckpointStore

__all__ = ["DeviceSession", "restored_model"]

#: how often the device may be restarted in one run before its death ends the run
MAX_RESTARTS = 3


class DeviceSession:
    """One device service and the attested session to it (replaced whole on a re-key or a restart)."""

    def __init__(self, handle: DeviceHandle, *, settings: RunSettings,
                 restart: Callable[[], DeviceHandle] | None = None) -> None:
        self.handle = handle
        self.settings = settings
        #: starts a new device service for a dead one (None: a dead device ends the run)
        self.restart_device = restart
        self.client = self.new_client()
        #: the key epoch last handed out (never reused in a run, across re-keys, restarts and resumes)
        self.epoch = 0
        #: the epoch the current session started at (``--epoch-limit`` counts from here)
        self.epoch_base = 0
        self.rekeys = 0
        self.restarts = 0
        #: the training program the code region holds (uploaded again after a restart)
        self.program: dict[str, Any] = {}
        self.expected_code: str | None = None
        self.expected_model: str | None = None
        #: the model MAC reference of the last full measurement: (the expected digest it was taken for, its
        #: one-use key, its tag); VERIFY compares the device's MAC under that key with the tag
        self._mac_ref: tuple[str, bytes, str] | None = None
        self.attestation: dict[str, Any] = {}
        self.device_info: dict[str, Any] = {}
        self._rejection_gen = 0  # the device's rejection generation audited so far
        #: a LoRA run's frozen base (--init-from, its run key and run id): a restarted device gets it again before
        #: the caller restores the adapters' checkpoint
        self._lora_base: tuple[Path, bytes, str] | None = None

    # --- the session -----------------------------------------------------------------------------------------
    def new_client(self) -> DeviceClient:
        """A client for the device service this session drives now (not yet connected)."""
        return DeviceClient(self.handle.socket_path, anchors=self.handle.anchors)

    def session_fp(self) -> str | None:
        """The session's fingerprint (never its key), None before it is open."""
        return self.client.secrets.fingerprint() if self.client.secrets else None

    async def connect(self) -> AttestationResult:
        """Attest the device and open the session."""
        result = await asyncio.to_thread(self.client.connect)
        self.attestation = result.to_dict()
        return result

    async def describe(self) -> None:
        """The device's facts (name, torch device, CC mode, cipher engine), then the data path."""
        self.device_info = (await asyncio.to_thread(self.client.info)).to_wire()
        await self.configure_data_path()

    async def configure_data_path(self) -> None:
        """Tell the device which provisioning optimisations are on (ablation switches)."""
        s = self.settings
        config = await asyncio.to_thread(self.client.set_data_path, parallel_auth=s.parallel_auth,
                                         overlap=s.overlap, workers=s.auth_workers)
        self.device_info["data_path"] = {"path": s.data_path, **config.to_wire()}

    async def rekey(self) -> str | None:
        """A fresh attested session (new ECDH, new master): every key of the old one is dead. Returns the old
        session's fingerprint."""
        old_fp = self.session_fp()
        self.client.close()
        self.client = self.new_client()
        for attempt in range(50):  # the device frees its control slot when it sees the old connection close
            try:
                await asyncio.to_thread(self.client.connect)
                break
            except DeviceError:
                if attempt == 49:
                    raise
                await asyncio.sleep(0.1)
                self.client = self.new_client()
        return old_fp

    def rekeyed(self) -> None:
        """The new session counts its epochs from here."""
        self.epoch_base = self.epoch
        self.rekeys += 1

    @property
    def can_restart(self) -> bool:
        return self.restart_device is not None and self.restarts < MAX_RESTARTS

    async def restart(self) -> AttestationResult:
        """A new device for a dead one: attested, a fresh session (new keys: no nonce can repeat), the same
        program and data path. The model is the caller's to restore."""
        restart = self.restart_device
        assert restart is not None  # the callers check ``can_restart``
        self.client.close()
        self.handle.stop()
        self.handle = await asyncio.to_thread(restart)
        self.client = self.new_client()
        self._rejection_gen = 0  # a new device counts its rejections from the start
        result = await asyncio.to_thread(self.client.connect)
        await self.upload_program()
        if self._lora_base is not None:  # the adapters' checkpoint holds no base: the weights go in first
            await self.load_weights(*self._lora_base)
        await self.configure_data_path()
        return result

    def last_error(self) -> str | None:
        """When the device service has died: the last line of its log (``<run>/device.log``), else None."""
        if self.handle.alive():
            return None
        h = self.handle
        return h.last_error() or f"exit status {h.process.returncode if h.process else '?'}"

    async def close(self) -> None:
        """Shut the device service down and stop its process; safe after a failure and more than once."""
        try:
            if self.handle.alive() and self.client.secrets:
                await asyncio.to_thread(self.client.shutdown)
        except (GpuTravelError, OSError):
            pass  # the device may already be gone
        self.client.close()
        self.handle.stop()

    # --- code and model ----------------------------------------------------------------------------------------
    async def upload_program(self) -> str:
        """Upload the training program into the device's code region; the device must report exactly its
        digest (and, after a device restart, the digest the run started with)."""
        program = json.dumps(self.program, sort_keys=True).encode()
        configured = await asyncio.to_thread(self.client.configure, program)
        digest = hashlib.sha256(program).hexdigest()
        if configured.code_digest != digest or (self.expected_code and digest != self.expected_code):
            raise IntegrityError("the code region does not hold the program that was uploaded")
        self.device_info["params"] = configured.params
        self.device_info["model"] = model_info(self.program, configured.params)
        return digest

    async def measure_model(self) -> str | None:
        """The model the device holds now becomes the one expected."""
        self.expected_model = (await asyncio.to_thread(self.client.measure)).model
        return self.expected_model

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

    async def restore(self, store: CheckpointStore, seq: int, *, run_id: str, want: str | None) -> str:
        """Stream checkpoint ``seq``'s sealed chunks (of the run ``run_id``) into the device; the model it then
        holds must have the digest ``want`` (else the file's meta record's) and becomes the one expected."""
        key = store.run_key(run_id)

        def stream() -> tuple[Any, dict[str, Any]]:
            with store.open(seq, run_id=run_id) as f:
                restored = self.client.restore(key, f.header, f.records())
                return restored, dict(f.meta or {})

        restored, meta = await asyncio.to_thread(stream)
        self.expected_model = restored_model(restored, seq, want or meta.get("model_digest"))
        return self.expected_model

    async def load_weights(self, path: Path, key: bytes, run_id: str) -> tuple[str, dict[str, Any]]:
        """Pretrained weights (``--init-from``) into the device's model, before any step: read here, sealed under
        the run key as a ``weights`` stream and opened by the device into its model; the model it then holds
        must have the digest of exactly these weights. Returns that digest and the model's config."""
        from gputravel.core.training.weights_upload import upload_weights

        state, want, config = await asyncio.to_thread(
            upload_weights, path, program_model=self.program["model"], key=key, run_id=run_id,
            restore=self.client.restore, program_train=self.program["train"])
        if state.model_digest != want:
            raise IntegrityError(f"--init-from {path}: the device's model differs from the file's weights")
        if dict(self.program.get("train") or {}).get("lora_rank"):
            self._lora_base = (Path(path), key, run_id)
        return want, config

    async def new_rejections(self, take: Callable[[dict[str, dict[str, int]]], None]) -> None:
        """The device's rejections by epoch since the last call, page by page (the device answers at most a
        few dozen epochs at a time) into ``take``."""
        for _ in range(10_000):
            stats = await asyncio.to_thread(self.client.stats, since=self._rejection_gen)
            take(stats.rejected_by_epoch)
            self._rejection_gen = stats.rejection_gen
            if not stats.more:
                break


def restored_model(restored: DeviceState, seq: int, recorded: object) -> str:
    """The digest expected of the model after checkpoint ``seq`` was restored (the device's, in the current
    format), once the device's digest in the format the checkpoint was sealed in (``v2`` for one written before
    ``v3``) equals the run's ``recorded`` one (the ledger's, else the meta record's, written in that format);
    else ``IntegrityError``."""
    sealed = restored.sealed_digest or restored.model_digest  # a device that predates sealed_digest: one format
    if sealed != recorded:
        raise IntegrityError(f"checkpoint {seq} restored to a model whose digest"
                             f"{f' ({restored.sealed_format})' if restored.sealed_format else ''} differs from the "
                             f"run's record of it")
    return str(restored.model_digest)


def model_info(program: dict[str, Any], params: int) -> dict[str, Any]:
    """What the run trains, for its report (``training.model``) and ``runs ls``: the Hugging Face architecture,
    the parameter count, where the weights came from, LoRA's settings (``None``: the whole model trains)."""
    from gputravel.core.training.families import DEFAULT_LORA_TARGETS, architecture_of

    model, train = dict(program.get("model") or {}), dict(program.get("train") or {})
    rank = int(train.get("lora_rank") or 0)
    lora = None if not rank else {"rank": rank, "alpha": train.get("lora_alpha") or float(rank),
                                  "targets": list(train.get("lora_targets") or
                                                  DEFAULT_LORA_TARGETS["llama" if "arch" in model else "gpt2"])}
    return {"architecture": architecture_of(model), "params": int(params),
            "source": program.get("source"), "lora": lora}
