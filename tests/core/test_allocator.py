"""Freed memory is kept in a training process (core/allocator.py), read back from glibc's own account of its heap
(``malloc_info``), in a fresh interpreter each (a setting is the process's for good); the off switch leaves
glibc's defaults; a C library that is not glibc is left alone and said so; a bad switch value is refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gputravel.core import allocator
from gputravel.core.errors import ConfigError

#: sets the allocator as a process does at start, then has a new thread allocate 100 MiB (above glibc's largest
#: mmap threshold) and free it, and prints the heap before, during and after
SCRIPT = textwrap.dedent("""
    import ctypes, json, threading
    from gputravel.core import allocator

    setting = allocator.keep_freed_memory()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    seen = {"setting": setting.to_dict(), "before": allocator.malloc_state().to_dict()}

    def work():
        block = libc.malloc(100 << 20)
        seen["during"] = allocator.malloc_state().to_dict()
        libc.free(block)
        seen["after"] = allocator.malloc_state().to_dict()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    print(json.dumps(seen))
""")

glibc_only = pytest.mark.skipif(allocator.malloc_state() is None, reason="the C library here is not glibc")


def _heap(switch: str) -> dict[str, dict[str, int]]:
    env = {**os.environ, allocator.ENV: switch}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen: dict[str, dict[str, int]] = json.loads(proc.stdout)
    return seen


@pytest.mark.process
@glibc_only
def test_kept_freed_memory_serves_a_threads_big_block_from_the_one_heap_and_keeps_it_after_free() -> None:
    seen = _heap("1")
    assert seen["setting"]["mode"] == allocator.KEEP_FREED
    assert "M_ARENA_MAX=1 M_MMAP_MAX=0 M_TRIM_THRESHOLD=-1" in seen["setting"]["reason"]
    assert "checked" in seen["setting"]["reason"]
    assert seen["during"]["arenas"] == seen["after"]["arenas"] == 1  # the new thread allocated from the main heap
    assert seen["during"]["mmap_bytes"] == seen["before"]["mmap_bytes"]  # 100 MiB and not an mmap of its own
    assert seen["during"]["heap_bytes"] >= seen["before"]["heap_bytes"] + (100 << 20) - (64 << 20)  # probe's reuse
    assert seen["after"]["heap_bytes"] == seen["during"]["heap_bytes"]  # freed, and still the process's


@pytest.mark.process
@glibc_only
def test_the_off_switch_leaves_glibcs_defaults_a_big_block_is_an_mmap_given_back_on_free() -> None:
    seen = _heap("0")
    assert seen["setting"] == {"mode": allocator.SYSTEM, "reason": f"glibc's defaults: {allocator.ENV}=0"}
    assert seen["during"]["mmap_bytes"] >= seen["before"]["mmap_bytes"] + (100 << 20)
    assert seen["after"]["mmap_bytes"] == seen["before"]["mmap_bytes"]  # unmapped on free


def test_a_c_library_that_is_not_glibc_is_left_alone_and_the_setting_says_so() -> None:
    setting = allocator.set_allocator(True, None)
    assert setting.mode == allocator.SYSTEM and "not glibc" in setting.reason
    assert allocator.set_allocator(False, None).mode == allocator.SYSTEM


def test_a_bad_switch_value_is_refused_by_name_before_a_device_starts(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from gputravel.core.platform.emulated import EmulatedPlatform

    assert allocator.wanted({}) and allocator.wanted({allocator.ENV: "1"}) and not allocator.wanted({allocator.ENV: "0"})
    monkeypatch.setenv(allocator.ENV, "off")
    with pytest.raises(ConfigError, match=f"{allocator.ENV} is 0 .* or 1 .*, not 'off'") as info:
        EmulatedPlatform(tmp_path / "platform").start(buffer_bytes=4096)
    assert info.value.exit_code == 2
    assert not (tmp_path / "platform").exists()  # refused before anything was provisioned or started


#: trimming off and no block its own mmap (so a freed 64 MiB block stays in the heap), then malloc_trim on request
TRIM_SCRIPT = textwrap.dedent("""
    import ctypes, json
    from gputravel.core import allocator

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallopt(allocator.M_MMAP_MAX, 0)
    libc.mallopt(allocator.M_TRIM_THRESHOLD, -1)
    block = libc.malloc(64 << 20)
    ctypes.memset(block, 1, 64 << 20)
    libc.free(block)
    kept = allocator.malloc_state().to_dict()
    released = allocator.release_free_memory()
    print(json.dumps({"kept": kept, "released": released, "after": allocator.malloc_state().to_dict()}))
""")


@pytest.mark.process
@glibc_only
def test_release_free_memory_hands_a_kept_free_heap_back_to_the_system() -> None:
    proc = subprocess.run([sys.executable, "-c", TRIM_SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout)
    assert seen["released"] is True
    assert seen["kept"]["heap_bytes"] - seen["after"]["heap_bytes"] >= 60 << 20  # the freed block left the heap


def test_release_free_memory_is_a_no_op_where_the_c_library_is_not_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "_LIBC", [None])  # this process's C library, as a non-glibc system loads it
    assert allocator.release_free_memory() is False
