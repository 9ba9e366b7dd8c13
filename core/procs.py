"""Child processes of the orchestrator, and who a process is (``/proc``)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
#: the kernel keeps a thread's name in 16 bytes, the last one a NUL
THREAD_NAME_BYTES = 15


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


#: why a process cannot be tied to its parent's life where ``prctl`` is missing (off Linux): what
#: :func:`end_with_parent` returns there, doing nothing
NO_PARENT_DEATH_SIGNAL = ("not tied to its parent's life: no prctl(PR_SET_PDEATHSIG) on this platform (Linux only), "
                          "so a parent killed outright (kill -9, the OOM killer) leaves this process running")


def parent_pid(pid: int) -> int | None:
    """The parent of the live process ``pid`` (field 4 of ``/proc/<pid>/stat``); None: gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().decode("utf-8", "replace").rsplit(")", 1)[1].split()
        return int(fields[1]) if fields[0] not in ("Z", "X") else None
    except (OSError, IndexError, ValueError):
        return None


def end_with_parent(*, grandparent: int | None) -> str | None:
    """For a process a program that is not ours started (each of torchrun's workers), from its own first lines:
    the kernel kills it (SIGKILL) when its parent dies, as :func:`die_with_parent` does for our own children.
    ``grandparent``: the pid its parent's parent must have (the process that started that program), the check
    against the race in which the parent died before this call (its children then belong to init or a
    subreaper): such a process ends itself here. None: only a parent that is init is taken for a dead one.
    Returns None once armed, else why nothing could be armed here (``NO_PARENT_DEATH_SIGNAL``; a no-op)."""
    if _prctl is None:
        return NO_PARENT_DEATH_SIGNAL
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    parent = os.getppid()
    if parent <= 1 or (grandparent is not None and parent_pid(parent) != grandparent):
        os.kill(os.getpid(), signal.SIGKILL)  # the parent (or the one that started it) died first
    return None


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


#: how far below its process's other threads a background thread runs (a thread's own nice value, Linux): the
#: device's checkpoint seal yields the cores to what a visit waits for (the training step, the model's MACs and
#: digest) and takes what those leave. The orchestrator's drain of the ring stays at normal priority, so the seal
#: seldom waits for a free slot (that wait polls, and each look takes the device's GIL from the training thread)
BACKGROUND_NICE = 5


def run_in_background() -> bool:
    """Lower the calling thread's priority by ``BACKGROUND_NICE`` (its own nice value: on Linux each thread has
    one; the process's other threads keep theirs). False where the system does not allow it: elsewhere
    ``setpriority`` on a thread id would name a process, or nothing."""
    if not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except OSError:  # e.g. a seccomp profile that refuses it
        return False
    return True


def name_os_thread(name: str | None = None) -> bool:
    """Give the calling thread's name (``name``, else its Python name) to the kernel, so a per-thread account
    (``/proc/<pid>/task/<tid>/comm``: ``scripts/thread_cpu.py``, ``top -H``, ``perf``) can say which of the
    orchestrator's or the device's threads spent what; without it every thread shows its process's name.
    Usable as a ``ThreadPoolExecutor`` initializer (each worker then shows its prefix and number). The kernel
    keeps the first ``THREAD_NAME_BYTES`` bytes. False off Linux or where ``prctl`` refused."""
    if _prctl is None:
        return False
    raw = (name if name is not None else threading.current_thread().name).encode("utf-8", "replace")
    return int(_prctl(PR_SET_NAME, ctypes.c_char_p(raw[:THREAD_NAME_BYTES]), 0, 0, 0)) == 0


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """Who a pid is, as far as the kernel says (``/proc``): the pid, when the process started (clock ticks
    after boot, field 22 of ``/proc/<pid>/stat``) and its command line. A pid the kernel reuses after the
    process died gets another start time, so pid + start time name one process for as long as the machine
    runs; the command line is checked too."""

    pid: int
    start_ticks: int
    cmdline: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_ticks": self.start_ticks, "cmdline": list(self.cmdline)}


def process_identity(pid: int) -> ProcessIdentity | None:
    """The identity of the live process ``pid`` (None: gone, a zombie, unreadable, or no ``/proc`` here)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("utf-8", "replace")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime field 22
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    try:
        start = int(fields[19])
    except ValueError:
        return None
    args = tuple(a.decode("utf-8", "replace") for a in raw.split(b"\0")[:-1]) if raw else ()
    return ProcessIdentity(pid, start, args)


def identity_matches(record: dict[str, Any]) -> ProcessIdentity | None:
    """The live process a record (``{"pid", "start_ticks", "cmdline"}``) names, or None when that pid is gone
    or is now another process (other start time or command line), or the record does not say who it was."""
    pid, start, cmdline = record.get("pid"), record.get("start_ticks"), record.get("cmdline")
    if not isinstance(pid, int) or not isinstance(start, int) or not isinstance(cmdline, list):
        return None
    now = process_identity(pid)
    if now is None or now.start_ticks != start or list(now.cmdline) != cmdline:
        return None
    return now
