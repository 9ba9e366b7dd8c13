"""Which engine runs the kernels: a CUDA GPU, or numba's CUDA simulator on the CPU.

Chosen once per process, automatically: ``cuda`` where the CUDA driver reports a device, ``simulator``
everywhere else (CI, the build machines). ``GPUTRAVEL_GPU_CIPHER=simulator|cuda`` forces one (for
instance to run the simulator tests on a GPU machine). The simulator flag (``NUMBA_ENABLE_CUDASIM``)
must be set before ``numba.cuda`` is imported, so the kernels are imported only through :func:`kernels`.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import sys
import threading
import traceback
from typing import Any, Literal

from gputravel.core.protocol.errors import GpuCipherError

Backend = Literal["cuda", "simulator"]
ENV_FORCE = "GPUTRAVEL_GPU_CIPHER"


def cuda_device_present() -> bool:
    """True when the CUDA driver loads and reports at least one device (no torch import needed)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    try:
        return bool(lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0)
    except AttributeError:
        return False


@functools.cache
def gpu_cipher_on_cuda() -> bool:
    """Whether the GPU cipher would run on a CUDA device here (numba-cuda installed, a device present)."""
    return importlib.util.find_spec("numba_cuda") is not None and cuda_device_present()


@functools.cache
def backend() -> Backend:
    """``cuda`` or ``simulator``, fixed for the process at first use."""
    forced = os.environ.get(ENV_FORCE, "").strip().lower()
    if forced not in ("", "cuda", "simulator"):
        raise GpuCipherError(f"{ENV_FORCE} must be 'cuda' or 'simulator', not {forced!r}")
    if "numba.cuda" in sys.modules:  # someone imported it already: its mode stands
        from numba import config  # type: ignore[import-untyped,unused-ignore]

        return "simulator" if getattr(config, "ENABLE_CUDASIM", 0) else "cuda"
    if forced:
        choice: Backend = "cuda" if forced == "cuda" else "simulator"
    elif os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        choice = "simulator"
    else:
        choice = "cuda" if cuda_device_present() else "simulator"
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1" if choice == "simulator" else "0"
    if "numba" in sys.modules:  # numba read its configuration at import: read it again
        from numba.core import config as numba_config  # type: ignore[import-untyped,unused-ignore]

        getattr(numba_config, "reload_config")()  # noqa: B009 (numba is untyped)
    return choice


def patch_simulator_shared_arrays() -> None:
    """Make the simulator's ``cuda.shared.array`` thread-safe.

    numba-cuda's simulator (0.30) looks a shared array up by the caller's file and line and creates it
    on a miss without a lock: two threads of a block that miss at once would get two different
    arrays, and one of them then reads a table the others never filled (the suspected cause of one
    wrong CAVP result in 3000 here, which did not recur in 1500 reruns of that vector). This replaces
    that method with the same logic under a lock. Simulator only; a GPU has real
    shared memory."""
    import numpy as np
    from numba.core import types as nb_types  # type: ignore[import-untyped,unused-ignore]
    from numba.cuda.simulator import kernelapi  # type: ignore[import-untyped,unused-ignore]
    from numba.np import numpy_support  # type: ignore[import-untyped,unused-ignore]

    shared_cls: Any = getattr(kernelapi, "FakeCUDAShared", None)
    if shared_cls is None or getattr(shared_cls, "_gputravel_locked", False):
        return
    original = shared_cls.array
    lock = threading.Lock()

    def array(self: Any, shape: Any, dtype: Any, alignment: Any = None) -> Any:
        if shape == 0 or alignment is not None:  # dynamic shared memory, errors: unchanged
            return original(self, shape, dtype, alignment)
        caller = tuple(traceback.extract_stack(sys._getframe(1), limit=1)[0])[0:2]
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                np_dtype = numpy_support.as_dtype(dtype) if isinstance(dtype, nb_types.Type) else dtype
                res = np.empty(shape, np_dtype)
                self._allocations[caller] = res
        return res

    shared_cls.array = array
    shared_cls._gputravel_locked = True
