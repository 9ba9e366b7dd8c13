"""One run address for every command that takes a run: ``runs *``, ``replay``, ``ledger verify|show`` and
``gputravel-console --replay``.

An address is any of: a run folder, a fleet folder (``fleet.json``; its ranks' recordings under ``rank-N/``), a
recording or ledger file, a run name as ``gputravel runs ls`` prints it (or an unambiguous prefix or suffix of
one), or ``latest``. :func:`resolve_run` turns it into a :class:`RunAddress`; nothing else parses one. Cheap to
import: no engine, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gputravel.core.errors import ConfigError, RecordingError
from gputravel.core.runfolder.folder import RUNS_DIR, RunFolder
from gputravel.core.runfolder.nodes import FleetNodes, fleet_nodes

__all__ = ["RUN_ADDRESS_HELP", "RunAddress", "find_run", "is_run_folder", "replay_target", "resolve_run"]

RUN_ADDRESS_HELP = ("A run: its name as `gputravel runs ls` prints it (an unambiguous prefix will do), latest, "
                    "a run or fleet folder, or a recording file.")


def is_run_folder(path: Path) -> bool:
    """Anything a run writes is in ``path`` (:meth:`RunFolder.is_run`)."""
    return RunFolder(path).is_run()


@dataclass(frozen=True, slots=True)
class RunAddress:
    """Where a run lives: its folder (None for a lone recording or ledger file) and the file it was named by."""

    given: str
    folder: Path | None
    file: Path | None = None  # the recording or ledger file the address named directly
    #: a fleet node's folder: the other nodes' folders (or copies) whose ranks merge with its own (``--node-folder``)
    nodes: tuple[Path, ...] = ()

    @property
    def run(self) -> RunFolder | None:
        """The run folder, typed (None for a lone file)."""
        return RunFolder(self.folder) if self.folder is not None else None

    @property
    def name(self) -> str:
        return self.folder.name if self.folder is not None else (self.file.name if self.file else self.given)

    @property
    def fleet(self) -> bool:
        return self.folder is not None and RunFolder(self.folder).is_fleet

    def recordings(self) -> list[tuple[int | None, Path]]:
        """The run's recordings as (fleet GPU or None, path): a fleet's one per rank, in rank order."""
        if self.file is not None and not RunFolder.names_ledger(self.file):
            return [(None, self.file)]
        if self.folder is None:
            return []
        run = RunFolder(self.folder)
        if run.is_fleet:
            return list(self.fleet_nodes().recordings())
        return [(None, run.recording)] if run.recording.exists() else []

    def fleet_nodes(self) -> FleetNodes:
        """A fleet folder's ranks: its own and the given nodes' (``nodes``), and which are on other nodes.

        Raises:
            ConfigError: not a fleet's folder, or a node folder given that does not fit it (named).
        """
        if self.folder is None or not RunFolder(self.folder).is_fleet:
            raise ConfigError(f"{self.given}: not a fleet's folder (--node-folder merges a fleet's nodes)")
        return fleet_nodes(self.folder, self.nodes)

    @property
    def ledger(self) -> Path:
        """The ledger to verify or show: the named file, else the folder's ``ledger.db`` (a fleet's own). A file
        named by another run file's name (its recording, settings) names its folder's ledger; any other file is
        the ledger itself, wherever it lies (a holder's ``~/run-7.db`` beside a ``~/ledger.db`` of another run)."""
        if self.file is not None and (RunFolder.names_ledger(self.file) or not RunFolder.names_marker(self.file)) \
                or self.folder is None:
            return self.file if self.file is not None else Path(self.given)
        return RunFolder(self.folder).ledger


def resolve_run(address: str | Path, root: Path = RUNS_DIR) -> RunAddress:
    """The run ``address`` names (see the module's docstring).

    Raises:
        ConfigError: nothing by that address, or a name prefix that fits several runs (they are named).
    """
    given = str(address)
    direct = Path(address).expanduser()
    if direct.is_file():
        parent = direct.parent
        return RunAddress(given, parent if is_run_folder(parent) else None, direct)
    if is_run_folder(direct):
        return RunAddress(given, direct.resolve() if direct.is_symlink() else direct)
    root = Path(root)
    named = root / given
    if "/" not in given and is_run_folder(named):
        return RunAddress(given, named.resolve() if named.is_symlink() else named)
    if given == RunFolder.latest(root).name:
        raise ConfigError(f"no latest run under {root}/ (gputravel run starts one)")
    if "/" not in given and given and root.is_dir():
        matches = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()
                         and (p.name.startswith(given) or p.name.endswith(given) or p.name == f"run-{given}"))
        if len(matches) == 1:
            return RunAddress(given, matches[0])
        if len(matches) > 1:
            raise ConfigError(f"run {given!r} is ambiguous: {', '.join(p.name for p in matches)}")
    if direct.exists():
        raise ConfigError(f"{given}: not a run folder, fleet folder, recording or ledger")
    if "/" in given:  # a path: what is missing is the path (it was reported as a run's name under runs/)
        raise ConfigError(f"no run {given!r}: {direct.absolute()} does not exist (a run folder, a recording, a "
                          f"ledger, or a run's name under {root}/: gputravel runs ls lists them)")
    raise ConfigError(f"no run {given!r} under {root}/ (gputravel runs ls lists them)")


def find_run(name: str, root: Path = RUNS_DIR) -> Path:
    """The run folder ``name`` addresses (:func:`resolve_run`: a folder, a fleet folder, a recording in a run
    folder, a name or unambiguous prefix under ``runs/``, or ``latest``)."""
    address = resolve_run(name, root)
    if address.folder is None:
        raise ConfigError(f"{name}: a file outside any run folder (gputravel replay reads a lone recording)")
    return address.folder


def replay_target(address: str | Path, root: Path = RUNS_DIR) -> Path:
    """What ``gputravel-console --replay`` plays for ``address``: a fleet folder as it is (its ranks' recordings,
    merged), otherwise the run's recording file."""
    found = resolve_run(address, root)
    if found.fleet and found.file is None:
        assert found.folder is not None
        return found.folder
    recordings = found.recordings()
    if not recordings:
        raise RecordingError(f"{address}: no recording to replay (the run was started with --no-record)")
    return recordings[0][1]
