"""The emulated GPU's SPDM responder (SIM): GET_MEASUREMENTS in NVIDIA's format over a requester's nonce.

A holder verifies the GPU itself before it takes a key (issue 22 item 5): the orchestrator asks the device
(operation ``gpu_evidence``) for a report under the holder's nonce, bound to the window's key, and forwards it.
The SIM GPU (``core.evidence.sim_gpu``) signs under its 5-level SIM chain, kept with the platform's other SIM
identities in ``<state>/vendor-formats/`` (``core.evidence.sim_store``, made on first use). ``tamper``
(fault injection, SIM only: ``run --inject gpu-measurement``) signs a report whose measurement block 1 is not the
firmware's, as a GPU running other firmware would.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from gputravel.core.errors import DeviceError

__all__ = ["SpdmResponder"]


class SpdmResponder:
    """Answers ``gpu_evidence``; the SIM GPU is loaded (or made) on the first request."""

    def __init__(self, state_dir: Path | None = None) -> None:
        self.state_dir = state_dir
        self._gpu: Any = None
        self._lock = threading.Lock()

    def _sim_gpu(self) -> Any:
        with self._lock:
            if self._gpu is None:
                from gputravel.core.evidence import sim_gpu, sim_store

                if self.state_dir is not None:
                    self._gpu = sim_store.load_or_create(self.state_dir)[0]
                else:  # a service without a state folder (tests): an identity in memory only
                    self._gpu = sim_gpu.SimGpu.generate()
            return self._gpu

    def answer(self, *, nonce: str, chain: bool = False, tamper: str | None = None) -> dict[str, Any]:
        """``{"report": hex}`` (and ``"chain"``: the PEM chain, when asked) for a 32-byte hex nonce."""
        try:
            raw = bytes.fromhex(nonce)
        except (ValueError, TypeError):
            raise DeviceError("gpu_evidence: the nonce is not hex") from None
        if len(raw) != 32:
            raise DeviceError(f"gpu_evidence: the SPDM nonce is 32 bytes, not {len(raw)}")
        gpu = self._sim_gpu()
        if tamper == "measurement":
            changed = list(gpu.measurements)
            changed[0] = bytes(b ^ 0xFF for b in changed[0])
            gpu = replace(gpu, measurements=changed)
        elif tamper is not None:
            raise DeviceError(f"gpu_evidence: unknown tamper {tamper!r}")
        out: dict[str, Any] = {"report": gpu.report(raw).hex(), "sim": True}
        if chain:
            out["chain"] = gpu.cert_chain_pem().decode()
        return out
