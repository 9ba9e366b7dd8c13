"""Keep freed memory in a training process: glibc's ``malloc`` set to one heap that never gives pages back.

A training step allocates and frees its activations and gradients (0.2-1.6 GB for a 135M model). With glibc's
defaults a block of 32 MiB or more (the dynamic ``mmap`` threshold) is its own ``mmap`` and goes back to the
kernel on ``free``, and the heap's top is trimmed past 128 KiB, so the next step faults the same amount of fresh,
zeroed pages in again: 150,000-390,000 page faults a step, 15-20 % of its CPU (docs/models.md). Kept instead:

* ``M_MMAP_MAX`` 0: no block is its own ``mmap``; every block comes from the heap;
* ``M_TRIM_THRESHOLD`` -1: the heap's free top is never handed back (``mallopt(3)``: -1 turns trimming off);
* ``M_ARENA_MAX`` 1: every thread allocates from the one main heap (a second arena's heaps are ``mmap``s of their
  own that glibc unmaps when they empty).

The process's resident set then stays at its high-water mark instead of following each step up and down; the
step reuses its pages. Applied with ``mallopt`` through ``ctypes`` by the process itself, first thing (the device
service in ``serve_from_args`` before its threads start, ``bench train`` before its plain loop), so every process
that trains gets the same setting whoever started it. ``GPUTRAVEL_KEEP_FREED_MEMORY=0`` in the environment turns it
off (the device service inherits its parent's environment); anything but ``0`` or ``1`` is refused by name. Off
Linux/glibc (musl, macOS) nothing is changed and :class:`AllocatorSetting` says so.

:func:`malloc_state` reads the heap back (``malloc_info``): how many arenas, how many blocks are ``mmap``s, how big
the heap is; ``apply`` checks the setting on a 64 MiB block (from the heap, kept after ``free``) before it reports
``keep-freed``. :func:`release_free_memory` does the opposite on request (``malloc_trim``): the orchestrator after
each visit's checkpoint, a fleet rank after each round, ``bench train`` after each plain pass. This module is the
one place that loads the C library for its allocator. Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gputravel.core.errors import ConfigError

__all__ = ["ENV", "KEEP_FREED", "SYSTEM", "AllocatorSetting", "MallocState", "applied", "keep_freed_memory",
           "malloc_state", "release_free_memory", "set_allocator", "wanted"]

#: the off switch: ``0`` leaves glibc's defaults, ``1`` (or unset) keeps freed memory
ENV = "GPUTRAVEL_KEEP_FREED_MEMORY"
KEEP_FREED = "keep-freed"
SYSTEM = "system"

# mallopt(3)'s parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
#: what ``keep-freed`` sets, by mallopt's names
SETTINGS = (("M_ARENA_MAX", M_ARENA_MAX, 1), ("M_MMAP_MAX", M_MMAP_MAX, 0), ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, -1))
#: the block ``apply`` checks the setting on: above glibc's largest mmap threshold (32 MiB), never touched
PROBE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class MallocState:
    """glibc's heap as ``malloc_info`` reports it: ``arenas`` (the main heap and any per-thread arena),
    ``mmap_blocks``/``mmap_bytes`` (blocks that are ``mmap``s of their own), ``heap_bytes`` (what all arenas
    hold from the system now)."""

    arenas: int
    mmap_blocks: int
    mmap_bytes: int
    heap_bytes: int

    def to_dict(self) -> dict[str, int]:
        return {"arenas": self.arenas, "mmap_blocks": self.mmap_blocks, "mmap_bytes": self.mmap_bytes,
                "heap_bytes": self.heap_bytes}


@dataclass(frozen=True, slots=True)
class AllocatorSetting:
    """What this process's allocator runs with: ``mode`` ``keep-freed`` or ``system`` (glibc's defaults, or not
    glibc), and why, in words (``reason``)."""

    mode: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"mode": self.mode, "reason": self.reason}


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks to keep freed memory (``GPUTRAVEL_KEEP_FREED_MEMORY``: unset or ``1`` yes,
    ``0`` no); any other value is a ``ConfigError`` naming the variable (exit 2)."""
    value = (os.environ if environ is None else environ).get(ENV, "1").strip()
    if value not in ("0", "1"):
        raise ConfigError(f"{ENV} is 0 (glibc's defaults) or 1 (keep freed memory), not {value[:40]!r}")
    return value == "1"


def _glibc() -> Any:
    """This process's C library when it is glibc (it has ``gnu_get_libc_version``, ``mallopt``, ``malloc_info``
    and ``malloc_trim``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        for name in ("mallopt", "malloc_info", "malloc_trim", "open_memstream", "malloc", "free", "fclose"):
            getattr(libc, name)
    except (OSError, AttributeError):
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


_LIBC: list[Any] = []
_APPLIED: list[AllocatorSetting] = []
_LOCK = threading.Lock()


def _libc() -> Any:
    if not _LIBC:
        _LIBC.append(_glibc())
    return _LIBC[0]


def malloc_state(libc: Any = None) -> MallocState | None:
    """glibc's heap now (``malloc_info``), or None where the C library is not glibc."""
    libc = libc or _libc()
    if libc is None:
        return None
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        return None
    try:
        libc.malloc_info(0, stream)
    finally:
        libc.fclose(stream)  # flushes: buf and size are set now
    try:
        text = ctypes.string_at(buf.value, size.value).decode("ascii", "replace") if buf.value else ""
    finally:
        libc.free(buf)
    mmap = re.search(r'<total type="mmap" count="(\d+)" size="(\d+)"/>', text)
    # the per-heap <system type="current"> come first, inside each <heap>; the last one is all arenas together
    current = re.findall(r'<system type="current" size="(\d+)"/>', text)
    return MallocState(arenas=len(re.findall(r'<heap nr="\d+">', text)),
                       mmap_blocks=int(mmap.group(1)) if mmap else 0, mmap_bytes=int(mmap.group(2)) if mmap else 0,
                       heap_bytes=int(current[-1]) if current else 0)


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim(0)``, every arena, whatever
    ``M_TRIM_THRESHOLD`` says); False, and nothing done, where the C library is not glibc.

    Each visit moves megabytes through the orchestrator (the sealed checkpoint, on a worker thread with its
    own malloc arena). glibc keeps freed blocks for reuse, and the arenas' footprint crept up in steps over
    a long run (``bench soak``); trimming once per visit keeps it flat (docs/robustness.md).
    """
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def _check(libc: Any) -> str | None:
    """Allocate and free a ``PROBE_BYTES`` block (never touched: no page is faulted in): None when it came from
    the heap and the heap kept it after ``free``, else what glibc did instead."""
    before = malloc_state(libc)
    block = libc.malloc(PROBE_BYTES)
    if not block:
        return "a 64 MiB block could not be allocated"
    during = malloc_state(libc)
    libc.free(block)
    after = malloc_state(libc)
    if before is None or during is None or after is None:
        return "malloc_info gave no answer"
    if during.mmap_blocks > before.mmap_blocks:
        return "a 64 MiB block was still an mmap of its own"
    if after.heap_bytes < during.heap_bytes:
        return "the heap gave the 64 MiB block back on free"
    return None


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> AllocatorSetting:
    """Keep freed memory in this process (module docstring), unless ``GPUTRAVEL_KEEP_FREED_MEMORY=0``; call it
    first thing, before the process starts threads. Once per process (a setting cannot be taken back: glibc's
    dynamic mmap threshold is gone once set): later calls return the first call's setting."""
    with _LOCK:
        if _APPLIED:
            return _APPLIED[0]
        setting = set_allocator(wanted(environ), _libc())
        _APPLIED.append(setting)
        return setting


def set_allocator(keep: bool, libc: Any) -> AllocatorSetting:
    """Set ``libc``'s malloc (None: a C library that is not glibc, left alone) to keep freed memory when ``keep``,
    check it, and say what it runs with; records nothing (:func:`keep_freed_memory` is the process's call)."""
    if not keep:
        return AllocatorSetting(SYSTEM, f"glibc's defaults: {ENV}=0")
    if libc is None:
        return AllocatorSetting(SYSTEM, "unchanged: the C library is not glibc (mallopt's settings are glibc's)")
    refused = [name for name, param, value in SETTINGS if libc.mallopt(param, value) != 1]
    if refused:
        return AllocatorSetting(SYSTEM, f"glibc refused mallopt {', '.join(refused)}")
    failed = _check(libc)
    if failed is not None:
        return AllocatorSetting(SYSTEM, f"mallopt set, but {failed}")
    version = libc.gnu_get_libc_version().decode()
    return AllocatorSetting(KEEP_FREED, f"glibc {version} mallopt M_ARENA_MAX=1 M_MMAP_MAX=0 M_TRIM_THRESHOLD=-1 "
                                        f"(checked: a 64 MiB block came from the heap and stayed after free)")


def applied() -> AllocatorSetting:
    """This process's setting: what :func:`keep_freed_memory` applied, or ``system`` where it was never called."""
    with _LOCK:
        return _APPLIED[0] if _APPLIED else AllocatorSetting(SYSTEM, "glibc's defaults: never set in this process")
