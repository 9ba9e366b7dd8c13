"""The emulated GPU's SPDM responder (SIM): GET_MEASUREMENTS in NVIDIA's format over a requester's nonce.

A holder verifies the GPU itself before it takes a key (issue 22 item 5): the orchestrator asks the device
(operation ``gpu_evidence``) for a report under the holder's nonce, bound to the window's key, and forwards it.
The SIM GPU (``core.evidence.sim_gpu``) signs under its 5-level SIM chain, kept with the platform's other SIM
identities in ``<state>/vendor-formats/`` (``core.evidence.sim_store``, made on first use). ``tamper``
(fault injection, SIM only: ``run --inject gpu-measurement``) signs a report whose measurement block 1 is not the
firmware's, as a GPU running other firmware would.

Where NVML reports the system's CC mode ``on`` (a CC-mode H100), the answer is the driver's own: the report
from ``nvmlDeviceGetConfComputeGpuAttestationReport`` under the same nonce and the chain from
``nvmlDeviceGetConfComputeGpuCertificate`` (``core.attestation.hardware_evidence``), marked ``sim: false``;
the holders then verify it against NVIDIA's roots (their policy). Not observed here: no CC-mode GPU was
available; the path is covered with NVIDIA's recorded sample inside NVML's structures.
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

    def __init__(self, state_dir: Path | None = None, *, nvml: Any = None, gpu_index: int = 0) -> None:
        self.state_dir = state_dir
        self.gpu_index = gpu_index
        self._gpu: Any = None
        self._lock = threading.Lock()
        #: NVML when a CC-mode GPU answers for real (given, or found on first use); False: none here
        self._nvml: Any = nvml

    def hardware(self) -> Any:
        """NVML, initialised, when the system's CC mode is ``on``; else None (the SIM GPU answers)."""
        with self._lock:
            if self._nvml is None:
                self._nvml = False
                try:
                    import pynvml

                    from gputravel.core.attestation.hardware_evidence import nvml_cc_mode

                    pynvml.nvmlInit()
                    if nvml_cc_mode(pynvml) == "on":
                        self._nvml = pynvml
                except Exception:  # no driver, no GPU, no CC queries: the SIM GPU answers
                    self._nvml = False
            return self._nvml or None

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
        nvml = self.hardware()
        if nvml is not None:
            from gputravel.core.attestation.hardware_evidence import gpu_evidence_from_nvml

            if tamper is not None:
                raise DeviceError("gpu_evidence: tampering is for the SIM GPU only")
            real = gpu_evidence_from_nvml(nvml, self.gpu_index, raw)
            answer: dict[str, Any] = {"report": real.report.hex(), "sim": False}
            if chain:
                answer["chain"] = real.cert_chain.decode("ascii", errors="replace")
            return answer
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
