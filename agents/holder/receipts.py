"""A holder's receipts and its witness, per run (issue 30 item 5), in its own folder (``<config>/receipts/RUN/``).

After each hand-off it provisioned, a holder-pinned agent writes one receipt (``epoch-E.json``, 0600): the run,
the epoch, the key's fingerprint, the digests of the evidence it verified and the verdict it gave (its roots,
policy digest, MRTD, TCB status, GPU nonce and measurements result), the chunks and bytes it sent, and the
ledger head the orchestrator stated at that hand-off; at the run's end (BYE) the ledger rows the run wrote for
that visit (``ledger_rows``: ``[seq, hash]`` pairs) are added to it. The ledger heads it was shown (at each hand-off and at
the end of the run) go to ``witness.jsonl`` in the same folder: one witness per run, so a second run never makes
the first look rewritten. ``gputravel holder verify`` checks them against a ledger, offline.

Run ids arrive in the protocol: checked as names (letters, digits, ``._-``), never used as paths as they come.
Standard library and ``core.protocol`` only. ``HolderRecords`` is the agent's part that keeps them (and a managed
agent's ``--witness`` file).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gputravel.core.protocol.holderlink import Attest, Bye, Handoff, Verdict

__all__ = ["HolderRecords", "ReceiptBook", "check_run_id", "read_receipts"]

_RUN_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
WITNESS_NAME = "witness.jsonl"


def check_run_id(run_id: object) -> str:
    """The run id as a safe folder name, or ``ValueError``."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ValueError(f"run id {str(run_id)[:40]!r} is not a name (letters, digits, '.', '_', '-')")
    return run_id


def _append(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class ReceiptBook:
    """Where one holder's agent writes its receipts and witness (``folder``: ``<config>/receipts``)."""

    def __init__(self, folder: Path, holder: str) -> None:
        self.folder = Path(folder)
        self.holder = holder

    def run_dir(self, run_id: str) -> Path:
        return self.folder / check_run_id(run_id)

    def witness(self, run_id: str | None, head: str | None, *, at: str, epoch: int | None) -> None:
        """The ledger head the orchestrator stated, appended to this run's witness (failures are reported, the
        hand-off goes on: the witness is the holder's record, not the protocol's)."""
        if run_id is None or head is None:
            return
        line = json.dumps({"ts": round(time.time(), 3), "run": run_id, "holder": self.holder, "at": at,
                           "epoch": epoch, "ledger_head": head}) + "\n"
        try:
            _append(self.run_dir(run_id) / WITNESS_NAME, line)
        except (OSError, ValueError) as exc:
            print(f"gputravel holder {self.holder}: cannot write the witness: {exc}", file=sys.stderr)

    def add_rows(self, run_id: str, rows: Mapping[int, Sequence[tuple[int, str]]]) -> int:
        """The ledger rows the run returned after the visits (BYE ``rows``: epoch -> ``(seq, hash)``), added to
        each of this run's receipts of those epochs as ``ledger_rows``; how many receipts were updated (a
        failure is reported, the run's end goes on)."""
        try:
            return _add_rows(self, run_id, rows)
        except (OSError, ValueError) as exc:
            print(f"gputravel holder {self.holder}: cannot add the ledger rows to the receipts: {exc}",
                  file=sys.stderr)
            return 0

    def write(self, receipt: dict[str, Any]) -> Path | None:
        """One hand-off's receipt, written whole (0600, atomically)."""
        try:
            folder = self.run_dir(str(receipt["run"]))
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            path = folder / f"epoch-{int(receipt['epoch'])}.json"
            tmp = folder / f".{path.name}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, (json.dumps(receipt, indent=1, sort_keys=True) + "\n").encode())
            finally:
                os.close(fd)
            os.replace(tmp, path)
            return path
        except (OSError, ValueError, KeyError) as exc:
            print(f"gputravel holder {self.holder}: cannot write a receipt: {exc}", file=sys.stderr)
            return None


class HolderRecords:
    """The agent's records of what it was shown and what it sent: the ledger heads (its ``--witness`` file, and a
    holder-pinned agent's per-run witness) and a holder-pinned agent's receipts (``book``)."""

    def __init__(self, name: str, *, witness: Path | None = None, receipts: ReceiptBook | None = None) -> None:
        self.name = name
        self.witness = witness
        self.receipts = receipts

    def keep_witness(self, msg: Handoff | Bye, *, at: str = "hand-off") -> None:
        """Append the audit ledger's head, as the orchestrator stated it at this hand-off, to the holder's own
        witness file (JSON lines, 0600). With it the holder can later show that the ledger still holds that
        row unchanged (``gputravel ledger verify --witness``): no truncation, no rewrite behind its back."""
        head = msg.ledger_head
        epoch = msg.epoch if isinstance(msg, Handoff) else None
        if self.receipts is not None:
            self.receipts.witness(msg.run_id, head, at=at, epoch=epoch)
        if self.witness is None or head is None:
            return
        record: dict[str, object] = {"ts": round(time.time(), 3), "holder": self.name, "at": at, "epoch": epoch,
                                     "ledger_head": head}
        if msg.run_id is not None:  # heads are per run: `ledger verify --witness` takes only the ledger's run's
            record["run"] = msg.run_id
        try:
            _append(self.witness, json.dumps(record) + "\n")
        except OSError as exc:  # the hand-off goes on: the witness is the holder's record, not the protocol's
            print(f"gputravel agent {self.name}: cannot write the witness {self.witness}: {exc}", file=sys.stderr)

    def keep_receipt(self, h: Handoff, last: tuple[Attest, Verdict] | None) -> None:
        """A holder-pinned agent's receipt of the hand-off it just sent, on the verdict ``last`` given for it."""
        if self.receipts is None or last is None or h.run_id is None:
            return
        msg, verdict = last
        path = "conventional" if h.conventional else "direct" if h.data_endpoint is not None else "channel"
        self.receipts.write({
            "v": 1, "run": h.run_id, "epoch": h.epoch, "holder": self.name, "ts": round(time.time(), 3),
            "key_fp": msg.key_fp, "path": path, "evidence_sha256": dict(verdict.evidence),
            "verdict": {"ok": verdict.ok, **verdict.report()}, "chunks": h.n_chunks - h.resume_from,
            "bytes": h.window_len - min(h.window_len, h.resume_from * h.chunk_size),
            "resume_from": h.resume_from, "ledger_head": h.ledger_head})

    def keep_rows(self, bye: Bye) -> None:
        """The run's ledger rows of this holder's visits (BYE), added to its receipts."""
        if self.receipts is not None and bye.run_id is not None and bye.rows:
            self.receipts.add_rows(bye.run_id, bye.rows)


def _add_rows(book: ReceiptBook, run_id: str, rows: Mapping[int, Sequence[tuple[int, str]]]) -> int:
    updated = 0
    for epoch, pairs in rows.items():
        path = book.run_dir(run_id) / f"epoch-{int(epoch)}.json"
        if not path.is_file():  # a visit this holder has no receipt of (it refused, or lost it): nothing to add
            continue
        receipt = read_receipt(path)
        receipt["ledger_rows"] = [[int(seq), str(digest)] for seq, digest in pairs]
        if book.write(receipt) is not None:
            updated += 1
    return updated


def read_receipts(folder: Path, run_id: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """The receipts under ``folder`` (``<config>/receipts``), of one run or of all, oldest run first, by epoch.

    Raises:
        ValueError: a receipt file that is not a JSON object (named).
    """
    runs = [Path(folder) / check_run_id(run_id)] if run_id else sorted(
        (d for d in Path(folder).iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime) if Path(
        folder).is_dir() else []
    out: list[tuple[Path, dict[str, Any]]] = []
    for run in runs:
        if not run.is_dir():
            continue
        found = []
        for path in run.glob("epoch-*.json"):
            found.append((path, read_receipt(path)))
        out += sorted(found, key=lambda pr: int(pr[1].get("epoch", 0)))
    return out


def read_receipt(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a receipt ({exc})") from None
    if not isinstance(doc, dict) or "run" not in doc or "epoch" not in doc:
        raise ValueError(f"{path}: not a receipt (no run or epoch)")
    return doc
