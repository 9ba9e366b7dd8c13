"""The device service fixes its torch threads for its life (core/device/entry.py ``pin_threads``): MKL's dynamic
thread choice is off, so every GEMM of a run, and of the run resumed from its checkpoint, uses the same threads
and rounds the same way (a resumed run once ended 1 ulp away from the uninterrupted one under CI's load). And it
keeps freed memory (core/allocator.py) from the same entry path, set after torch's import and before its threads:
a training step's blocks then come from one heap that keeps them (read back with ``malloc_info``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.process

#: the device's own entry path (``serve_from_args``), with a build that reports what it found and refuses (exit 2)
SCRIPT = textwrap.dedent("""
    import ctypes, json, sys, threading
    from pathlib import Path
    import torch
    from gputravel.core import allocator
    from gputravel.core.device.entry import device_arg_parser, serve_from_args
    from gputravel.core.errors import ConfigError

    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    get_dynamic = getattr(lib, "mkl_serv_get_dynamic", None)  # MKL's own flag (torch's MKL builds export it)

    def dynamic():
        return None if get_dynamic is None else int(get_dynamic())

    found = {"default": torch.get_num_threads(), "dynamic_before": dynamic()}

    def heap():
        state = allocator.malloc_state()  # None where the C library is not glibc
        return None if state is None else state.to_dict()

    def train_like_a_step():  # on a thread of its own, as the device trains on its control connection's thread
        grads = [torch.ones(16 << 20) for _ in range(2)]  # 2 x 64 MiB, above glibc's largest mmap threshold
        found["during"] = heap()
        del grads
        found["after"] = heap()

    def build(ns):
        found.update(threads=torch.get_num_threads(), dynamic=dynamic(), allocator=allocator.applied().to_dict())
        worker = threading.Thread(target=train_like_a_step)
        worker.start()
        worker.join()
        print(json.dumps(found), flush=True)
        raise ConfigError("refused on purpose: the test reads the threads only")

    parser = device_arg_parser("device", "test")
    serve_from_args(parser.parse_args(["--socket", "unused", "--state-dir", ".", "--buffer-bytes", "1"]), build)
""")


def test_the_device_pins_its_torch_threads_turns_mkls_dynamic_choice_off_and_keeps_freed_memory() -> None:
    env = {**os.environ, "GPUTRAVEL_KEEP_FREED_MEMORY": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]  # the build's ConfigError: ERROR and exit code 2
    found = json.loads(proc.stdout.splitlines()[0])
    assert proc.stdout.splitlines()[1].startswith("ERROR ") and "refused on purpose" in proc.stdout
    if found["during"] is not None:  # glibc (the allocator's setting is glibc's; elsewhere it says so: test_allocator)
        assert found["allocator"]["mode"] == "keep-freed", found["allocator"]
        assert found["during"]["arenas"] == found["after"]["arenas"] == 1  # the worker thread used the main heap
        assert found["during"]["mmap_bytes"] < 64 << 20  # 128 MiB of tensors and not one block an mmap of its own
        assert found["after"]["heap_bytes"] == found["during"]["heap_bytes"]  # freed and kept for the next step
    assert found["threads"] == found["default"] >= 1  # --threads 0: torch's default count, now fixed
    if found["dynamic_before"] is None:
        pytest.skip("this torch build exports no MKL flag to read (no MKL: nothing chooses threads dynamically)")
    assert found["dynamic_before"] == 1  # MKL's default: it may use fewer threads than it is given
    assert found["dynamic"] == 0, "MKL may still choose its threads per call: a resumed run may round otherwise"
