"""A child process's output teed: shown live where the user looks, its last part kept for the launcher.

``launch_fleet`` runs torchrun with this: in a run that is not quiet the ranks' progress and torchrun's own account
reach the user's stderr as they are written, and the launcher still reads torchrun's "Root Cause" from the tail
(``core.fleet.failure.job_failure``). Where the user's stderr is a terminal the child writes to a pseudo-terminal
whose output is passed on byte for byte (no output processing of its own, the terminal's window size), so
``isatty`` and Python's line-buffered stdout in torchrun and its ranks answer as they did when they wrote to the
terminal itself; elsewhere (a file, a pipe, a quiet run) to a pipe. One loop in the calling thread reads the
child's output as it comes, so no pipe fills, and an interrupt (Ctrl-C, a caller's timeout) reaches it there:
the child gets SIGTERM first, its last words are still read, and only a child that outlives the grace is killed.
A launcher killed outright (kill -9, the OOM killer) runs none of that: the kernel kills the child (SIGKILL,
``PR_SET_PDEATHSIG``, set between fork and exec) and the child's own children see to theirs (torchrun's
workers arm their own, ``core.fleet.lifeline.end_with_launcher``).
"""

from __future__ import annotations

import codecs
import errno
import fcntl
import os
import pty
import select
import subprocess
import termios
import time
import tty
from dataclasses import dataclass
from typing import TextIO

from gputravel.core.procs import die_with_parent

__all__ = ["TAIL_BYTES", "Teed", "run_teed"]

#: how much of the child's output the launcher keeps (torchrun's account of a failure is a few KiB at its end)
TAIL_BYTES = 64 * 1024
#: after the child exits, how long output still held open by what it left behind is read
DRAIN_S = 5.0
#: how long a child given SIGTERM has before it is killed
STOP_GRACE_S = 20.0
_READ_BYTES = 64 * 1024
_POLL_MS = 200


@dataclass(frozen=True, slots=True)
class Teed:
    """How the child ended and the last ``TAIL_BYTES`` of its stdout and stderr, interleaved as written."""

    returncode: int
    tail: bytes

    @property
    def text(self) -> str:
        return self.tail.decode(errors="replace")


class _Tail:
    """The last ``limit`` bytes written to it (trimmed in batches: a copy per ``limit`` bytes, not per chunk)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()

    def add(self, chunk: bytes) -> None:
        self._buf += chunk
        if len(self._buf) > 2 * self.limit:
            del self._buf[:-self.limit]

    def value(self) -> bytes:
        return bytes(self._buf[-self.limit:]) if self.limit else b""


class _Shown:
    """Where the output is shown live: a file descriptor (the user's terminal or file), or a text stream without
    one (a captured ``sys.stderr``), or nowhere (quiet). Once the user's side refuses a write (closed, a broken
    pipe) nothing more is shown there; the tail is still kept and the child runs on."""

    def __init__(self, show: TextIO | None) -> None:
        self.stream = show
        self.fd: int | None = None
        self.terminal = False
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if show is None:
            return
        try:
            show.flush()  # what we wrote there before comes first
            self.fd = show.fileno()
            self.terminal = os.isatty(self.fd)
        except (AttributeError, OSError, ValueError):  # a captured stream: write text to it
            self.fd = None

    def write(self, chunk: bytes) -> None:
        try:
            if self.fd is not None:
                view = memoryview(chunk)
                while view:
                    try:
                        view = view[os.write(self.fd, view):]
                    except BlockingIOError:  # a terminal left non-blocking by another program: wait, as a write would
                        select.select([], [self.fd], [], 1.0)
            elif self.stream is not None:
                self.stream.write(self._decoder.decode(chunk))
                self.stream.flush()
        except (OSError, ValueError):
            self.fd, self.stream = None, None


def _channel(shown: _Shown) -> tuple[int, int]:
    """(read end, the child's end): a pseudo-terminal like the user's where the user's stderr is a terminal."""
    if not shown.terminal or shown.fd is None:
        return os.pipe()
    parent, child = pty.openpty()
    try:
        # raw: bytes pass unchanged (the user's terminal turns "\n" into "\r\n" as before); the pty only carries
        # output (stdin is /dev/null), so its input modes matter to no one
        tty.setraw(child, termios.TCSANOW)
        size = fcntl.ioctl(shown.fd, termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(child, termios.TIOCSWINSZ, size)
    except OSError:  # a terminal without a size: the pty's default
        pass
    return parent, child


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, _READ_BYTES)
    except OSError as exc:
        if exc.errno == errno.EIO:  # a pty whose every writer has closed: its end
            return b""
        raise


def _pump(fd: int, proc: subprocess.Popen[bytes], shown: _Shown, tail: _Tail, *, until: float | None = None) -> None:
    """Read the child's output to its end: every writer closed, or ``DRAIN_S`` after the child exited (a process it
    left behind may hold the pipe open), or the monotonic time ``until``."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    exited: float | None = None
    while True:
        now = time.monotonic()
        if exited is None and proc.poll() is not None:
            exited = now
        if (until is not None and now >= until) or (exited is not None and now >= exited + DRAIN_S):
            return
        if poller.poll(_POLL_MS):
            chunk = _read(fd)
            if not chunk:
                return
            tail.add(chunk)
            shown.write(chunk)


def run_teed(cmd: list[str], *, env: dict[str, str], show: TextIO | None, tail_bytes: int = TAIL_BYTES,
             stop_grace_s: float = STOP_GRACE_S) -> Teed:
    """Run ``cmd`` to its end, its stdout and stderr shown live on ``show`` (None: nowhere) and the last
    ``tail_bytes`` kept. Interrupted (KeyboardInterrupt, a caller's timeout raised in this thread), the child gets
    SIGTERM, its output is still read for ``stop_grace_s``, then it is killed if it lives; the interrupt goes on."""
    shown = _Shown(show)
    tail = _Tail(tail_bytes)
    fd, child_end = _channel(shown)
    try:
        try:
            # the child dies with this process (SIGKILL, kill -9 and the OOM killer included; core.procs)
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=child_end, stderr=child_end,
                                    preexec_fn=die_with_parent)
        finally:
            os.close(child_end)  # the child holds its own: its end (EOF, EIO) is when every writer has closed
        with proc:
            try:
                _pump(fd, proc, shown, tail)
                returncode = proc.wait()
            except BaseException:  # SIGTERM first: torchrun's agent stops the ranks, they their devices and agents
                proc.terminate()
                until = time.monotonic() + stop_grace_s
                try:
                    _pump(fd, proc, shown, tail, until=until)
                    proc.wait(timeout=max(0.0, until - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                finally:  # past the grace, or interrupted again: killed
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                raise
        return Teed(returncode, tail.value())
    finally:
        os.close(fd)

