"""Child processes of the orchestrator."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1


def _load_prctl() -> Any:
    """libc's ``prctl``, resolved once in the parent (None off Linux/glibc): nothing may be imported or
    looked up between fork and exec, where another thread of the parent may hold the import or loader lock."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()
#: the pid of the process that forks, set in it just before each fork (``os.register_at_fork``)
_forking_pid = [os.getpid()]
os.register_at_fork(before=lambda: _forking_pid.__setitem__(0, os.getpid()))


def die_with_parent() -> None:
    """``preexec_fn`` of every child of the orchestrator: the kernel kills the child (SIGKILL) when the
    orchestrator dies, even by kill -9, so a crashed run never leaves a device service holding keys, model
    and GPU memory behind, nor agents or an SSH server holding the orchestrator's pipes open.

    Safe between fork and exec in a threaded parent: it only calls the ``prctl`` resolved at import and
    reads the pid recorded before the fork (an ``import`` or ``dlopen`` here could deadlock on a lock
    another thread held at fork time, leaving a forked copy of the orchestrator that never execs and
    never dies). If the parent already died before ``prctl`` took effect, the child ends itself.
    The signal follows the forking *thread*: fork children from long-lived threads (the event loop,
    the default executor), not from a thread that ends while the child should live."""
    if _prctl is None:
        return
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != _forking_pid[0]:  # the parent died between fork and prctl
        os.kill(os.getpid(), signal.SIGKILL)


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
