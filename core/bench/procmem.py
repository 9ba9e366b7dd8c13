"""What the benches read of processes from /proc: resident and anonymous memory, open descriptors, the process
tree under one process, memory by role (the orchestrator, the device service, the SSH server, the agents), and
a sampler thread that keeps each role's peak (``bench load``, ``bench soak``). Linux only; a process that is gone
counts 0."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from gputravel.core.procs import name_os_thread

__all__ = ["MemorySampler", "anon_rss", "memory_by_role", "mib", "open_fds", "process_tree", "rss"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss(pid: int | None) -> int:
    """Resident set size of ``pid`` in bytes (0 when it is gone)."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def anon_rss(pid: int | None) -> int:
    """The anonymous part of ``pid``'s resident set (heap, stacks; no mapped files or shared libraries) in
    bytes, from ``RssAnon`` in /proc/PID/status (0 when it is gone): what a leak grows."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0


def _role(pid: int, root: int, roles: Mapping[str, str]) -> str:
    if pid == root:
        return "orchestrator"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
    except OSError:
        return "other"
    if b"gputravel.core.device" in cmd:
        return "device"
    for marker, role in roles.items():  # the caller's programs (Entries.process_roles)
        if marker.encode() in cmd:
            return role
    return "other"


def open_fds(pid: int | str = "self") -> int:
    """File descriptors ``pid`` holds now (from /proc; 0 where there is none)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant (from /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def memory_by_role(root: int | None = None, *, roles: Mapping[str, str] | None = None) -> dict[str, int]:
    """Resident bytes of this process tree, summed per role (shared pages count once per process); ``roles``:
    a command-line marker -> role, for the programs the caller starts (``Entries.process_roles``)."""
    root = os.getpid() if root is None else root
    by: dict[str, int] = {}
    for pid in process_tree(root):
        role = _role(pid, root, roles or {})
        by[role] = by.get(role, 0) + rss(pid)
    by["total"] = sum(by.values())
    return by


class MemorySampler:
    """Samples ``memory_by_role`` in a thread; keeps each role's peak and the peak of the total."""

    def __init__(self, interval: float = 0.1, *, roles: Mapping[str, str] | None = None) -> None:
        self.interval = interval
        self.roles = dict(roles or {})
        self.peak: dict[str, int] = {}
        #: the most file descriptors this process (the orchestrator) held at a sample
        self.peak_fds = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="mem-sampler")

    def _loop(self) -> None:
        name_os_thread()
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> dict[str, int]:
        now = memory_by_role(roles=self.roles)
        for role, n in now.items():
            self.peak[role] = max(self.peak.get(role, 0), n)
        self.peak_fds = max(self.peak_fds, open_fds())
        self.samples += 1
        return now

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def mib(n: float) -> float:
    return round(n / 2**20, 1)
