"""The run folder as a type: every name in it spelled here once.

A run folder (``runs/run-<time>``, or ``--out``) holds::

    settings.json        the settings the run started with (resume checks them against the checkpoints)
    ledger.db            the hash-chained audit ledger (and its progress state)
    recording.db         the console's and ``gputravel run``'s recording of the run's events
    status.json          the folder's own word on how the run stands (paused) or ended
    orchestrator.pid     the process that drives the run, while it runs
    report.json          the run's JSON report (a fleet's merged one, on every node)
    keys/checkpoint.key  the run's checkpoint key (0600)
    checkpoints/         the sealed checkpoints (``ckpt-NNNNNN.gtc``)
    platform/            the emulated platform's state (vendor PKI, device identity)
    receipts/            what the holders signed for the run (their receipts)
    device.log           the device service's log

A fleet folder (one per node: nodes share no folder) holds ``fleet.json`` (the fleet's settings), its ``ledger.db``
(rank 0's node) and ``report.json``, the fleet's SIM ``vendor/`` PKI and the node's SIM CVM (``sim-cvm/``, both installed
from ``--sim-pki``), and one run folder per GPU of the node, ``rank-N/``. The fleet key lives in memory only. :class:`RunFolder` names all of these as
properties; nothing else in the project spells them (``tests/test_run_folder_names.py`` greps the tree).
Cheap to import: the standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["RUNS_DIR", "RunFolder"]

#: where ``gputravel run`` puts its run folders (``runs/latest`` links the newest)
RUNS_DIR = Path("runs")

_SETTINGS = "settings.json"
_LEDGER = "ledger.db"
_RECORDING = "recording.db"
_STATUS = "status.json"
_STATUS_RESERVE = ".status-reserve"
_PID = "orchestrator.pid"
_REPORT = "report.json"
_FLEET = "fleet.json"
_CVM = "sim-cvm"
_RANK = "rank-"
_KEYS = "keys"
_CHECKPOINT_KEY = "checkpoint.key"
_CHECKPOINTS = "checkpoints"
_CHECKPOINT_GLOB = "ckpt-*.gtc"
_PLATFORM = "platform"
_VENDOR = "vendor"
_RECEIPTS = "receipts"
_DEVICE_LOG = "device.log"
_CONTROL = "control.jsonl"
_LATEST = "latest"
_ELSEWHERE = "elsewhere.txt"

#: any of these in a folder makes it a run folder
_MARKERS = (_SETTINGS, _RECORDING, _LEDGER, _FLEET, _PID, _STATUS)


@dataclass(frozen=True, slots=True)
class RunFolder:
    """A run's (or a fleet's) folder and the names in it. Holds only its path; every property is a path in
    it, never read (the folder may not exist yet)."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @classmethod
    def of(cls, where: RunFolder | Path | str) -> RunFolder:
        """``where`` as a :class:`RunFolder` (a folder given as a path, or one already typed)."""
        return where if isinstance(where, RunFolder) else cls(Path(where))

    @property
    def name(self) -> str:
        return self.path.name

    # -- the files -------------------------------------------------------------------------------------------
    @property
    def settings(self) -> Path:
        return self.path / _SETTINGS

    @property
    def ledger(self) -> Path:
        return self.path / _LEDGER

    @property
    def recording(self) -> Path:
        return self.path / _RECORDING

    @property
    def status_file(self) -> Path:
        return self.path / _STATUS

    @property
    def status_reserve(self) -> Path:
        """Room kept on the run's disk for its last ``status.json`` (``core/runfolder/status.py``)."""
        return self.path / _STATUS_RESERVE

    @property
    def pid_file(self) -> Path:
        return self.path / _PID

    @property
    def report(self) -> Path:
        return self.path / _REPORT

    @property
    def fleet_config(self) -> Path:
        """``fleet.json``: a fleet folder's settings (its presence makes the folder a fleet's)."""
        return self.path / _FLEET

    @property
    def device_log(self) -> Path:
        return self.path / _DEVICE_LOG

    @property
    def control(self) -> Path:
        """``control.jsonl``: the run's control channel, requests an attached console appends and the run
        applies (``console/cli/run_control.py``)."""
        return self.path / _CONTROL

    # -- the folders -----------------------------------------------------------------------------------------
    @property
    def keys(self) -> Path:
        return self.path / _KEYS

    @property
    def checkpoint_key(self) -> Path:
        return self.keys / _CHECKPOINT_KEY

    @property
    def checkpoints(self) -> Path:
        return self.path / _CHECKPOINTS

    def checkpoint_files(self) -> list[Path]:
        """The sealed checkpoint files present (any order; none when the folder is missing)."""
        return list(self.checkpoints.glob(_CHECKPOINT_GLOB)) if self.checkpoints.is_dir() else []

    @property
    def platform(self) -> Path:
        return self.path / _PLATFORM

    @property
    def cvm(self) -> Path:
        """A fleet node's SIM CVM (its TDX guest's PKI and evidence policy, ``vendor-formats/``)."""
        return self.path / _CVM

    @property
    def vendor(self) -> Path:
        """A fleet's emulated vendor PKI, shared by its ranks."""
        return self.path / _VENDOR

    @property
    def receipts(self) -> Path:
        """Where the holders' receipts for this run are kept."""
        return self.path / _RECEIPTS

    # -- a fleet's ranks -------------------------------------------------------------------------------------
    def rank(self, gpu: int) -> RunFolder:
        """GPU ``gpu``'s run folder inside this fleet folder (``rank-N/``)."""
        return RunFolder(self.path / f"{_RANK}{int(gpu)}")

    def ranks(self) -> list[tuple[int, RunFolder]]:
        """The ``rank-N/`` folders present, as (N, folder), in rank order."""
        found: list[tuple[int, RunFolder]] = []
        for p in self.path.glob(f"{_RANK}*"):
            n = p.name.removeprefix(_RANK)
            if n.isdigit() and p.is_dir():
                found.append((int(n), RunFolder(p)))
        return sorted(found, key=lambda x: x[0])

    def rank_recordings(self) -> list[tuple[int, Path]]:
        """The ranks' recordings present, as (N, path), in rank order."""
        return [(n, r.recording) for n, r in self.ranks() if r.recording.exists()]

    @staticmethod
    def rank_of(folder: Path) -> int | None:
        """N for a ``rank-N`` folder, else None."""
        n = Path(folder).name.removeprefix(_RANK)
        return int(n) if Path(folder).name.startswith(_RANK) and n.isdigit() else None

    # -- what the folder is ----------------------------------------------------------------------------------
    @property
    def is_fleet(self) -> bool:
        """A fleet's folder (it holds ``fleet.json``)."""
        return self.fleet_config.exists()

    def looks_like_fleet(self) -> bool:
        """A fleet folder, or one with its ranks' recordings already (before ``fleet.json`` is written)."""
        return self.path.is_dir() and (self.fleet_config.is_file() or bool(self.rank_recordings()))

    def is_run(self) -> bool:
        """Anything a run writes is here (settings, ledger, recording, fleet.json, pid file, status)."""
        try:
            return self.path.is_dir() and any((self.path / name).exists() for name in _MARKERS)
        except OSError:
            return False

    @staticmethod
    def names_ledger(path: Path) -> bool:
        """``path`` is a run's ledger by its name (``ledger.db``)."""
        return Path(path).name == _LEDGER

    @staticmethod
    def names_marker(path: Path) -> bool:
        """``path`` has the name of a file every run writes (settings, ledger, recording, fleet.json, pid, status)."""
        return Path(path).name in _MARKERS

    @staticmethod
    def latest(runs: Path = RUNS_DIR) -> Path:
        """``runs/latest``: the link to the newest run folder."""
        return Path(runs) / _LATEST

    @staticmethod
    def elsewhere(runs: Path = RUNS_DIR) -> Path:
        """``runs/elsewhere.txt``: the index of runs started with ``--out`` outside ``runs/`` (one absolute path
        a line, appended as each is claimed), so ``gputravel runs ls`` lists them too."""
        return Path(runs) / _ELSEWHERE
