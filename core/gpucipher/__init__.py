"""AES-256-GCM on the GPU: batch seal/open kernels byte-compatible with ``cryptography``'s AESGCM.

The kernels (numba-cuda) run on a CUDA device where one exists and in numba's CUDA simulator
everywhere else (``backend()`` says which); see docs/gpu-cipher.md. Importing this package is cheap:
numba is imported at first use.
"""

from __future__ import annotations

from gputravel.core.gpucipher.backend import GpuCipherError, backend
from gputravel.core.gpucipher.engine import (
    CUDA_SHAPE,
    SIM_SHAPE,
    BatchPlan,
    GpuAesGcm,
    LaunchShape,
    open_batch,
    seal_batch,
)
from gputravel.core.gpucipher.torch_io import open_into_tensor, seal_from_tensor

__all__ = [
    "CUDA_SHAPE",
    "SIM_SHAPE",
    "BatchPlan",
    "GpuAesGcm",
    "GpuCipherError",
    "LaunchShape",
    "backend",
    "open_batch",
    "open_into_tensor",
    "seal_batch",
    "seal_from_tensor",
]
