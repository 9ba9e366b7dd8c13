"""The run options ``gputravel run`` and ``gputravel-console`` share: one default and one help text each,
and one builder (:class:`RunOptions`) from the command line to :class:`RunSettings`.

Cheap to import (no engine, no torch, no Textual): the console builds its settings with it before its screen
opens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from gputravel.console.cli.options import DataPathChoice, PhaseChoice, TransportChoice
from gputravel.core.config import RunSettings
from gputravel.core.errors import ConfigError
from gputravel.core.runfolder import RUNS_DIR, RunClaim, RunFolder

__all__ = ["BUFFER_MIB_DEFAULT", "CHUNK_KIB_DEFAULT", "CHUNK_KIB_HELP", "DATA_HOST_DEFAULT", "DATA_HOST_HELP",
           "DATA_PATH_DEFAULT", "DATA_PATH_HELP", "HOLDERS_FILE_HELP", "ROUNDS_HELP", "STEPS_PER_VISIT_DEFAULT",
           "STEPS_PER_VISIT_HELP", "TRANSPORT_DEFAULT", "TRANSPORT_HELP", "RunOptions", "default_holders",
           "holder_settings", "parse_breakpoints", "resolve_out_dir"]

# The holder options ``gputravel run`` and ``gputravel-console`` share: one default, one help text.
HOLDERS_FILE_HELP = "Inventory (TOML) of SSH holders (sets the transport to inventory)."
TRANSPORT_DEFAULT = TransportChoice.SSH
TRANSPORT_HELP = ("ssh: agents deployed through a loopback SSH server (embedded default) or the --holders-file "
                  "hosts; local: agent subprocesses.")
DATA_PATH_DEFAULT = DataPathChoice.DIRECT
DATA_PATH_HELP = ("direct: agents send sealed chunks straight to the device's data port; channel (or ssh): "
                  "chunks ride the holder link (SSH channel); conventional: plaintext over SSH, re-encrypted by "
                  "the orchestrator for the GPU's bounce buffer (the baseline without Travelling).")
DATA_HOST_DEFAULT = "127.0.0.1"
DATA_HOST_HELP = ("Address the device's TCP data port binds to; inventory holders with data_route = \"network\" "
                  "connect to it, the default route forwards it through their SSH connection.")


# The run options both commands declare with the same help (and, but for --rounds, the same default).
ROUNDS_HELP = "Rounds over all holders' data."
STEPS_PER_VISIT_DEFAULT = 20
STEPS_PER_VISIT_HELP = "Training steps per visit."
BUFFER_MIB_DEFAULT = 4.0
CHUNK_KIB_DEFAULT = 1024
CHUNK_KIB_HELP = "Provisioning chunk size (KiB)."

def default_holders(data: Path | None) -> int:
    """``--holders`` left out: one holder per ``--data`` subfolder (3 without ``--data``: the embedded corpus)."""
    if data is None:
        return 3
    try:
        return max(1, sum(1 for p in Path(data).iterdir() if p.is_dir() and not p.name.startswith(".")))
    except OSError:
        return 1  # the data folder's own error comes when it is read (DataError, exit 2)


def holder_settings(*, holders_file: Path | None, transport: str, data_path: str,
                    data_host: str) -> dict[str, Any]:
    """The :class:`RunSettings` fields of the holder options (an inventory file means transport inventory)."""
    return {"transport": "inventory" if holders_file else str(transport), "holders_file": holders_file,
            "data_path": str(data_path), "data_host": data_host}


def parse_breakpoints(values: Sequence[PhaseChoice | str]) -> tuple[str, ...]:
    """``--break-before`` values as phase names; a name that is no phase is a usage error naming them."""
    out = []
    for value in values:
        try:
            out.append(str(PhaseChoice(str(value).upper())))
        except ValueError:
            raise typer.BadParameter(f"{value!r} is no phase: choose {', '.join(p.value for p in PhaseChoice)}",
                                     param_hint="--break-before") from None
    return tuple(out)


def resolve_out_dir(out: Path | None, *, resume: bool, runs: Path = RUNS_DIR, create: bool = True) -> Path:
    """A fresh ``runs/run-<time>`` (linked as ``runs/latest``) unless ``--out`` names one;
    ``--resume`` without ``--out`` continues ``runs/latest``. With ``create=False`` the fresh folder is only
    named: nothing is created and ``runs/latest`` stays (see :class:`RunClaim`)."""
    if out is not None:
        return out
    latest = RunFolder.latest(runs)
    if resume:
        if not latest.exists():
            raise ConfigError("--resume without --out continues runs/latest, and there is none")
        return latest.resolve()
    stamp = time.strftime("run-%Y%m%d-%H%M%S")
    out = runs / stamp
    n = 1
    while out.exists():
        n += 1
        out = runs / f"{stamp}-{n}"
    if create:
        RunClaim(out, runs=runs, link_latest=True).claim()
    return out



@dataclass(frozen=True, slots=True)
class RunOptions:
    """The run options both commands take, as given (``holders`` None: one per ``--data`` subfolder), and the
    settings they make: :meth:`settings_fields` are :class:`RunSettings` fields; ``extra`` holds the fields one
    command adds (``gputravel run``'s model and training options)."""

    data: Path | None = None
    holders: int | None = None
    holders_file: Path | None = None
    transport: str = TRANSPORT_DEFAULT.value
    data_path: str = DATA_PATH_DEFAULT.value
    data_host: str = DATA_HOST_DEFAULT
    rounds: int = 2
    steps_per_visit: int = 20
    buffer_mib: float = 4.0
    chunk_kib: int = 1024
    break_before: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def given(cls, *, data: Path | None, holders: int | None, holders_file: Path | None, transport: str,
              data_path: str, data_host: str, rounds: int, steps_per_visit: int, buffer_mib: float, chunk_kib: int,
              break_before: Sequence[PhaseChoice | str] = (), extra: dict[str, Any] | None = None) -> RunOptions:
        """From the command line: enum choices (``TransportChoice``, ``DataPathChoice``: ``StrEnum``) as their
        values, ``--break-before`` checked (a usage error naming the phases)."""
        return cls(data=data, holders=holders, holders_file=holders_file, transport=str(transport),
                   data_path=str(data_path), data_host=data_host, rounds=rounds, steps_per_visit=steps_per_visit,
                   buffer_mib=buffer_mib, chunk_kib=chunk_kib, break_before=parse_breakpoints(break_before),
                   extra=dict(extra or {}))

    def settings_fields(self) -> dict[str, Any]:
        """The :class:`RunSettings` fields (less ``out_dir``)."""
        return {"holders": self.holders if self.holders is not None else default_holders(self.data),
                "rounds": self.rounds, "steps_per_visit": self.steps_per_visit, "buffer_mib": self.buffer_mib,
                "chunk_kib": self.chunk_kib, "data_dir": self.data, "breakpoints": self.break_before,
                **holder_settings(holders_file=self.holders_file, transport=self.transport,
                                  data_path=self.data_path, data_host=self.data_host),
                **self.extra}

    def settings(self, out_dir: Path, **overrides: Any) -> RunSettings:
        """The run's settings in ``out_dir`` (validated: a bad option is a ``ConfigError``, exit 2)."""
        return RunSettings(out_dir=out_dir, **{**self.settings_fields(), **overrides})
