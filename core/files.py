"""Writing files that must never be seen half-written or with a wider mode than intended, and reading private
files (keys) only when no one else can read them."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
from pathlib import Path

from gputravel.core.errors import ConfigError, DiskFullError, InsecureKeyError, StorageError
from gputravel.core.procs import name_os_thread

__all__ = ["PRIVATE_UMASK", "WRITEBACK_BYTES", "InsecureKeyError", "Writeback", "check_private", "close_folder", "fsync_dir", "keep_private",
           "make_tree_private", "read_private", "storage_error", "write_atomic"]

#: errnos that mean "no space": the disk is full, or the user's quota is
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_SQLITE_FULL = 13  # sqlite3.SQLITE_FULL: "database or disk is full" (the extended code's low byte)


def _strerror(exc: BaseException) -> str | None:
    """An ``OSError``'s own reason (``strerror``, without its errno and path), else None."""
    return exc.strerror if isinstance(exc, OSError) else None


def storage_error(exc: BaseException, what: str) -> StorageError:
    """``exc``, an ``OSError`` or ``sqlite3.Error`` met while writing ``what`` (the ledger, the recording, a
    checkpoint), as the run's named error: ``DiskFullError`` for no space (ENOSPC, EDQUOT, SQLite's
    SQLITE_FULL), else ``StorageError``. Raise it ``from exc``."""
    full = (isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS) or (
        (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF == _SQLITE_FULL)  # not on an error made by hand
    reason = _strerror(exc) or str(exc) or type(exc).__name__
    if full:
        return DiskFullError(f"{what}: no space left ({reason}); what was committed is kept: free space, then "
                             "`gputravel run --resume` continues")
    return StorageError(f"{what}: write failed ({reason}); what was committed is kept: `gputravel run --resume` "
                        "continues once it can write")


#: the umask of a process that writes a run: folders 0700, files 0600 (SQLite's -wal/-shm included)
PRIVATE_UMASK = 0o077


def _refuse_unless_private(st: os.stat_result, path: Path, what: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} {path} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    for bits, who in ((0o007, "world"), (0o070, "group")):
        if mode & bits:
            raise InsecureKeyError(f"{what} {path} is {who}-readable (mode {mode:04o}); run `chmod 600 {path}`")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise InsecureKeyError(f"{what} {path} belongs to uid {st.st_uid}, not to this user")


def check_private(path: Path, *, what: str = "private key") -> None:
    """Refuse a private file others could read, the same rule as the checkpoint key's.

    Raises:
        InsecureKeyError: ``path`` is group- or world-accessible (the message names it and says
            ``chmod 600``) or belongs to another user.
        ConfigError: ``path`` cannot be examined or is not a regular file.
    """
    path = Path(path)
    try:
        st = os.stat(path)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise ConfigError(f"cannot read {what} {path}: {_strerror(exc) or exc}") from None
    _refuse_unless_private(st, path, what)


def read_private(path: Path, *, what: str = "private key") -> bytes:
    """The contents of ``path`` after :func:`check_private`'s checks, made on the opened file itself (no
    window between the check and the read; a FIFO is refused instead of blocking)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {what} {path}: {_strerror(exc) or exc}") from None
    try:
        _refuse_unless_private(os.fstat(fd), path, what)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: bytes a large file gets written between two starts of its writeback (:class:`Writeback`)
WRITEBACK_BYTES = 64 << 20


class Writeback:
    """The disk writes a large file's bytes while more are still being written, not all of them at its fsync.

    Left alone, Linux keeps a freshly written gigabyte dirty in the page cache (below ``dirty_background_ratio``
    nothing writes it back for 30 s) and the final ``fsync`` writes all of it while the writer waits. Here a
    thread of its own asks the kernel to start writing back every ``every`` bytes as they are written
    (``posix_fadvise(POSIX_FADV_DONTNEED)`` on the range just written: Linux starts the range's writeback
    without waiting for it and drops only pages that are already clean, so the range stays cached). The call
    may block while the disk's queue is full, hence the thread: the writer goes on copying into the page
    cache meanwhile. It is advice only: it changes nothing of what is written or when it is durable (that is
    still the caller's ``fsync``); where the call is missing or refused the fsync does it all, as before.

    The writer calls :meth:`wrote` after each write and :meth:`close` before its fsync (and before closing the
    file descriptor, which the thread uses)."""

    def __init__(self, fd: int, *, every: int = WRITEBACK_BYTES) -> None:
        self._fd = fd
        self._every = max(1, every)
        self._written = 0  # bytes the writer wrote
        self._started = 0  # bytes whose writeback this object started
        self._stop = not hasattr(os, "posix_fadvise") or every <= 0
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        #: ranges whose writeback was started (a test's and a study's account)
        self.calls = 0

    def wrote(self, n: int) -> None:
        """``n`` more bytes were written (appended after the previous ones)."""
        with self._cv:
            self._written += n
            if self._stop or self._written - self._started < self._every:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="checkpoint-writeback", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        name_os_thread()
        while True:
            with self._cv:
                while not self._stop and self._written - self._started < self._every:
                    self._cv.wait()
                if self._stop:
                    return
                lo, hi = self._started, self._written
            try:
                os.posix_fadvise(self._fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
            except OSError:  # refused here (not a regular file, an old kernel): the fsync writes it all
                with self._cv:
                    self._stop = True
                return
            with self._cv:
                self._started = hi
                self.calls += 1

    def close(self) -> None:
        """Stop (idempotent): returns once the thread no longer uses the file descriptor."""
        with self._cv:
            self._stop = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join()


def write_atomic(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` atomically: a temp file created with ``mode`` (0600 by default, so a key is
    never readable by others, not even for a moment) in the same folder, fsync, rename, fsync the folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's contents, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def keep_private() -> int:
    """From now on this process creates nothing others can read (umask 0077): the run folder, its ledger and
    recording with SQLite's -wal/-shm files (created with the database's mode), settings and logs, and
    whatever the device service and agents it starts write there. Returns the previous umask."""
    old = os.umask(PRIVATE_UMASK)
    os.umask(old | PRIVATE_UMASK)
    return old


def close_folder(folder: Path) -> None:
    """Group and other bits off ``folder`` itself (0755 becomes 0700): nobody else reaches what is in it."""
    try:
        mode = stat.S_IMODE(os.stat(folder).st_mode)
        if mode & 0o077:
            os.chmod(folder, mode & ~0o077)
    except OSError:
        pass


def make_tree_private(root: Path) -> None:
    """Take group and other bits off ``root`` and everything under it (a folder 0755 becomes 0700, a file 0644
    0600; the owner's bits stay): a run folder made before runs were private, or what a part wrote with its
    own mode. Symlinks are not followed; other users' files are left alone."""
    root = Path(root)
    uid = os.getuid() if hasattr(os, "getuid") else None
    for entry in [root, *root.rglob("*")]:
        try:
            st = os.lstat(entry)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode) or (uid is not None and st.st_uid != uid):
            continue
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            try:
                os.chmod(entry, mode & ~0o077, follow_symlinks=False)
            except (OSError, NotImplementedError):
                continue
