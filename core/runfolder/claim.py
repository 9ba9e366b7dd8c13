"""A run's folder as ``gputravel run`` claims it: only after the settings were validated, and given back
when the run fails before its ledger exists (:class:`RunClaim`)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path

from gputravel.core.errors import ConfigError
from gputravel.core.files import close_folder, keep_private, make_tree_private
from gputravel.core.runfolder.folder import RUNS_DIR, RunFolder

__all__ = ["RunClaim", "check_owner"]


def _empty_folder(path: Path) -> bool:
    try:
        return path.is_dir() and not any(path.iterdir())
    except OSError:
        return False


def check_owner(out: Path) -> None:
    """``--out`` must be this user's (issue 30 item 7): in a folder another user owns, that user could delete,
    rename or replace the run's ledger, keys and checkpoints whatever their modes. ``ConfigError`` (exit 2) names
    the owner; a folder that does not exist yet is made by this user."""
    try:
        st = out.stat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot use it ({exc.strerror})") from None
    if st.st_uid != os.getuid():
        raise ConfigError(f"--out {out} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): its owner "
                          "could change the run's files; choose a folder of your own")


class RunClaim:
    """A run's folder, created only once the settings were validated, and taken back when the run fails
    before its ledger exists (nothing to audit or resume): the folder is removed and ``runs/latest``
    points where it pointed before. A run killed outright keeps its folder, which ``--resume`` then starts."""

    def __init__(self, out: RunFolder | Path, *, runs: Path = RUNS_DIR, link_latest: bool = False) -> None:
        self.folder = RunFolder.of(out)
        self.out = self.folder.path
        self.runs = runs
        self.latest = RunFolder.latest(runs)
        self.link_latest = link_latest
        self.created = not self.out.exists()
        self.runs_created = link_latest and not runs.exists()
        self.previous: str | None = None
        self.ours = self.created

    def claim(self) -> None:
        """Create the folder (0700) and make this process write only private files from now on (umask 0077:
        the ledger, the recording and SQLite's -wal/-shm, the settings, logs, checkpoints: 0600). A folder that
        already exists and is a run's (``--resume``) or empty (``--out``) is closed to others (0700); the files
        in it keep their modes, so a key others could read is still refused by name, never quietly fixed."""
        check_owner(self.out)
        keep_private()
        self.ours = self.created or self.folder.is_run() or _empty_folder(self.out)  # never a user's folder
        self.out.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.tighten()
        if self.link_latest:
            self.runs.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.latest.is_symlink():
                self.previous = os.readlink(self.latest)
            if self.latest.exists() and not self.latest.is_symlink():
                self.latest.unlink()  # a stray file of that name (a folder there is refused, as before)
            _point(self.latest, self.link_target)
            if Path(self.link_target).is_absolute():  # an --out run outside runs/: indexed for `runs ls`
                self._index_elsewhere()

    def _index_elsewhere(self) -> None:
        index = RunFolder.elsewhere(self.runs)
        line = str(self.out.absolute())
        with contextlib.suppress(OSError):
            if line in index.read_text().splitlines():
                return
        fd = os.open(index, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    @property
    def link_target(self) -> str:
        """What ``runs/latest`` points to: the folder's name under ``runs/``, else (``--out`` elsewhere) its
        absolute path, so ``latest`` is the newest run started whatever its folder."""
        with contextlib.suppress(OSError):
            if self.out.absolute().parent.resolve() == self.runs.resolve():
                return self.out.name
        return str(self.out.absolute())

    def tighten(self) -> None:
        """A folder created for this run: group and other bits off it and everything in it (what a part wrote
        with its own mode, e.g. the emulated PKI's public certificates). A run folder that existed before: off
        the folder itself only. An ``--out`` naming some other folder of the user's: nothing (the run's own
        files there are private through the umask)."""
        if not self.ours or not self.out.exists():
            return
        if self.created:
            make_tree_private(self.out)
            return
        close_folder(self.out)

    def release_if_empty(self) -> None:
        """After a failed run: undo :meth:`claim` unless the run got as far as its ledger."""
        if not self.created or self.folder.ledger.exists():
            return
        shutil.rmtree(self.out, ignore_errors=True)
        if self.link_latest and self.latest.is_symlink() and os.readlink(self.latest) == self.link_target:
            if self.previous is not None:
                _point(self.latest, self.previous)
            else:
                self.latest.unlink()
        if self.runs_created:
            try:
                self.runs.rmdir()  # only when empty again
            except OSError:
                pass


def _point(link: Path, target: str) -> None:
    """Make ``link`` a symlink to ``target`` in one step: a fresh link under a name of this process's own, renamed
    over ``link`` (``rename`` replaces it atomically). Two runs started at once in one folder each leave a whole
    link behind, the later one's; unlinking and re-creating in place let one of them fail with "File exists"."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.{secrets.token_hex(4)}")
    tmp.symlink_to(target)
    try:
        os.replace(tmp, link)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise

