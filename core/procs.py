"""Child processes of the orchestrator."""

from __future__ import annotations


def die_with_parent() -> None:
    """In the child before exec: the kernel kills it when the orchestrator dies (even by kill -9),
    so a crashed run never leaves a device service holding keys and model behind."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


_libc_trim: list[object] = []


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``); False where unavailable.

    Each visit moves megabytes through the orchestrator (the sealed checkpoint, on a worker thread with its
    own malloc arena). glibc keeps freed blocks for reuse, and the arenas' footprint crept up in steps over
    a long run (``bench soak``); trimming once per visit keeps it flat.
    """
    if not _libc_trim:
        try:
            import ctypes

            _libc_trim.append(ctypes.CDLL("libc.so.6").malloc_trim)
        except (OSError, AttributeError):  # not glibc
            _libc_trim.append(None)
    trim = _libc_trim[0]
    if trim is None:
        return False
    trim(0)  # type: ignore[operator]
    return True
