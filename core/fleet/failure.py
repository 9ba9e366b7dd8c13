"""How a failed fleet job is named: the ranks' reported errors, read once and typed, and torchrun's own account.

Each rank leaves ``<out>/rank-R/report.json`` (rank 0 also ``<out>/report.json``); a rank that failed puts its
typed error there as ``{"error": {"code", "reason"}}``. :func:`read_report` reads one such file into its data and
a :class:`RankError`; a file that is not what a rank writes is a :class:`RankReportError` naming the file.
:func:`job_failure` then decides the job's error from them and the tail of torchrun's output.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputravel.core.errors import GpuTravelError, RankReportError, error_from_code

__all__ = ["RankError", "RankReport", "job_failure", "read_report"]


@dataclass(frozen=True, slots=True)
class RankError:
    """A rank's error as its report carries it: the code of its typed error and its reason."""

    code: str
    reason: str

    @classmethod
    def parse(cls, value: object, *, where: str) -> RankError:
        """The ``{"code", "reason"}`` object of a report (``where``: the file, for the error); anything else is a
        :class:`RankReportError`."""
        if not isinstance(value, dict):
            raise RankReportError(f"{where}: its error is {type(value).__name__}, not an object with code and reason")
        code, reason = value.get("code"), value.get("reason")
        if not isinstance(code, str) or not code or not isinstance(reason, str):
            raise RankReportError(f"{where}: its error needs a non-empty string code and a string reason, "
                                  f"got code {code!r} and reason {type(reason).__name__}")
        return cls(code, reason)

    def to_error(self) -> GpuTravelError:
        """The typed error it names."""
        return error_from_code(self.code, self.reason)


@dataclass(frozen=True, slots=True)
class RankReport:
    """One report file read: its data and the error it carries (None: the rank ended without one)."""

    data: dict[str, Any]
    error: RankError | None


def read_report(path: Path) -> RankReport:
    """Read a rank's (or the merged) report; not JSON, not an object, or an error of another shape:
    :class:`RankReportError` naming ``path``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise RankReportError(f"{path}: not a report ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise RankReportError(f"{path}: a report is a JSON object, this is {type(data).__name__}")
    error = data.get("error")
    return RankReport(data, None if error is None else RankError.parse(error, where=str(path)))


def job_failure(returncode: int, text: str, *, errors: Sequence[RankError], silent: Sequence[int]) -> GpuTravelError:
    """The named error of a failed torchrun job, from the ranks' reported errors, the ranks that left none
    (``silent``) and torchrun's own account (``text``: the tail of its output, kept in every run, quiet or not;
    its "Root Cause" names the rank that failed first).

    A survivor that saw its peer's socket close before torchrun stopped it reports a ``collective`` error. When
    torchrun names the rank that failed first killed by a signal, and that rank wrote no report, the kill is the
    job's failure (a WorkerError naming it, whichever the survivor or torchrun's SIGTERM came first), the survivor's
    words kept after it. Without torchrun's account (it never got as far as writing one) the ranks' own errors
    stand (both exit 10)."""
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", text, re.DOTALL)
    first, failed_first = "", False
    if root:  # a kill: a negative exit code, the signal
        rank, code = int(root.group(1)), int(root.group(2))
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        first = f"; rank {rank} failed first ({how}), torchrun stopped the others"
        failed_first = code < 0 and rank in silent
    if errors and failed_first and all(e.code == "collective" for e in errors):
        return error_from_code("worker", f"the fleet's torchrun job exited with {returncode} and no report{first}; "
                                         f"the others saw: {errors[0].reason}")
    if errors:
        return errors[0].to_error()
    return error_from_code("worker", f"the fleet's torchrun job exited with {returncode} and no report{first} "
                                     f"{text[-600:]}")
