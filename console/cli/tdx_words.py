"""A TDX verifier's refusal in words (``gputravel attest --tdx-quote``): dcap-qvl reports some failures as Rust
debug strings (``CrlExpired { time: UnixTime(1795795842), next_update: UnixTime(1775215317) }``); an operator
reads ``collateral expired 2026-04-03 11:21:55 UTC (a CRL's next update; verified as of 2026-11-27 ...)`` and, for
every failure that depends on the time, the window in which the collateral is valid and the ``--at`` that checks
it there."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime

__all__ = ["collateral_window", "tdx_reason_in_words"]

_UNIX = re.compile(r"UnixTime\((\d+)\)")
_DEBUG = re.compile(r"^(\w+) \{ (.*) \}$")
_WORDS = {
    "CrlExpired": ("collateral expired {next_update} (a certificate revocation list's next update; verified as "
                   "of {time})"),
    "CertExpired": "a certificate of the collateral expired {not_after} (verified as of {time})",
    "CertNotValidYet": "a certificate of the collateral is valid only from {not_before} (verified as of {time})",
}
_TIMELY = ("expired", "in the future", "not valid", "notvalid", "valid only")


def _date(unix: int) -> str:
    return datetime.fromtimestamp(unix, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def collateral_window(collateral: bytes | str) -> tuple[datetime, datetime] | None:
    """The TCB info's ``issueDate`` and ``nextUpdate``: when the collateral is valid (None when unreadable)."""
    try:
        doc = json.loads(collateral)
        tcb = json.loads(doc["tcb_info"])
        return (datetime.fromisoformat(tcb["issueDate"].replace("Z", "+00:00")),
                datetime.fromisoformat(tcb["nextUpdate"].replace("Z", "+00:00")))
    except (ValueError, KeyError, TypeError):
        return None


def tdx_reason_in_words(reason: str, *, at: int, collateral: bytes | str) -> str:
    """``reason`` with debug strings named in words and Unix times as dates; a failure that depends on the
    time gets the collateral's validity window and an ``--at`` inside it."""
    found = _DEBUG.match(reason.strip())
    words = reason
    if found and found.group(1) in _WORDS:
        fields = {k.strip(): v.strip() for k, _, v in (part.partition(":") for part in found.group(2).split(","))}
        dates = {k: _date(int(m.group(1))) if (m := _UNIX.fullmatch(v)) else v for k, v in fields.items()}
        try:
            words = _WORDS[found.group(1)].format(**dates)
        except KeyError:
            words = reason
    words = _UNIX.sub(lambda m: _date(int(m.group(1))), words)
    if "in the future" in words:
        words += f" (verified as of {_date(at)})"
    if not any(mark in words.lower() for mark in _TIMELY):
        return words
    window = collateral_window(collateral)
    if window is None:
        return f"{words}; verify at another time with --at UNIX_SECONDS"
    start, end = window
    inside = int(start.timestamp()) + 3600
    return (f"{words}; its TCB info is valid from {start:%Y-%m-%d %H:%M:%S} to {end:%Y-%m-%d %H:%M:%S} UTC: "
            f"verify at another time with --at (e.g. --at {inside}, {_date(inside)})")
