"""``gputravel holder verify``: a holder's receipts against a run's ledger, offline (issue 30 item 5).

What it checks, in this order, and names the first difference:

1. the chain is intact (``core.ledger.verify_ledger``), and holds every head this holder was shown for the run
   (each receipt's ``ledger_head`` and the run's witness), unchanged;
2. every receipt belongs to the ledger's run;
3. for each receipt, the ledger's ``holder-attestation`` row of its epoch says ``ok`` with the same verdict: the
   same evidence digests, policy digest, roots, MRTD, TCB status, GPU nonce and measurements result; the ledger's
   ``key-handed-over``/visit rows of that epoch name the same key fingerprint;
4. no ``holder-attestation`` row of the holder (the name the ledger gives it at the receipts' epochs) lacks a
   receipt: the ledger claims no visit of this holder it has no receipt for.

What it proves, and what not: that the orchestrator's ledger records exactly the verdicts this holder gave (on the
evidence it saw, under its own policy) for the visits it made, and was not rewritten since it was shown its heads.
It does not prove what the GPU did with the data (that is the attestation's part), nor anything of a visit whose
receipt the holder lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputravel.core.ledger import LedgerRow, check_heads, parse_head, read_run_id, verify_ledger_select
from gputravel.core.ledger.reading import RawRow

__all__ = ["ReceiptCheck", "verify_receipts"]

#: the verdict fields a receipt and its ledger row must agree on
_COMPARED = (("policy_sha256",), ("roots",), ("mr_td_policy",), ("cvm", "mr_td"), ("cvm", "tcb_status"),
             ("gpu", "nonce"), ("gpu", "measres"), ("evidence_sha256",))


@dataclass(slots=True)
class ReceiptCheck:
    """The outcome: ``ok``, or the first ``difference``; what was compared."""

    ok: bool
    ledger: str
    run_id: str | None
    receipts: int
    rows: int
    holder: str | None = None
    difference: str | None = None
    epochs: list[int] = field(default_factory=list)
    #: what held but was checked less than it could be (a receipt without the rows BYE returns)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "ledger": self.ledger, "run_id": self.run_id, "holder": self.holder,
                "receipts": self.receipts, "epochs": self.epochs, "ledger_rows": self.rows,
                "difference": self.difference, "warnings": self.warnings}


def _get(doc: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        doc = doc.get(key) if isinstance(doc, dict) else None
    return doc


def verify_receipts(ledger: Path, receipts: list[tuple[Path, dict[str, Any]]],
                    witness: Sequence[tuple[int, str]] = ()) -> ReceiptCheck:
    """Check ``receipts`` (path, receipt) against the ledger file ``ledger``; never raises for a difference."""
    run_id = read_run_id(ledger)
    result = ReceiptCheck(ok=False, ledger=str(ledger), run_id=run_id, receipts=len(receipts), rows=0,
                          epochs=sorted(int(r.get("epoch", -1)) for _, r in receipts))

    def differs(text: str) -> ReceiptCheck:
        result.difference = text
        return result

    if not receipts:
        return differs(f"no receipt of run {run_id} to check (this holder made no visit of it, or lost its receipts)")
    heads: list[tuple[int, str]] = list(witness)
    for path, rec in receipts:
        if rec.get("run") != run_id:
            return differs(f"{path.name}: receipt of run {rec.get('run')}, the ledger is run {run_id}")
        if rec.get("ledger_head"):
            try:
                heads.append(parse_head(str(rec["ledger_head"])))
            except ValueError:
                return differs(f"{path.name}: ledger_head {rec['ledger_head']!r} is not SEQ:HASH")
    returned: dict[int, tuple[str, int, str]] = {}  # seq -> (receipt name, epoch, hash returned after the visit)
    for path, rec in receipts:
        pairs = rec.get("ledger_rows") or []
        if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and type(p[0]) is int and isinstance(p[1], str) for p in pairs):
            return differs(f"{path.name}: ledger_rows is not a list of [SEQ, HASH]")
        for seq, digest in pairs:
            returned.setdefault(seq, (path.name, int(rec.get("epoch", -1)), digest))
    wanted = set(returned) | {seq for seq, _ in heads}
    hashes: dict[int, str] = {}
    key_fps: dict[int, set[str]] = {}

    def select(record: RawRow) -> bool:
        """In the chain's one walk: note the hashes of the rows the receipts name, each epoch's key
        fingerprints, and keep (parsed) its ok verdict rows."""
        if record["seq"] in wanted:
            hashes[record["seq"]] = record["hash"]
        epoch = record["epoch"]
        if epoch is None:
            return False
        if record["key_fp"]:
            key_fps.setdefault(epoch, set()).add(record["key_fp"])
        return bool(record["kind"] == "holder-attestation" and record["outcome"] == "ok")

    chain, rows = verify_ledger_select(ledger, select=select)
    result.rows = chain.rows
    if not chain.ok:
        return differs(f"ledger chain: {chain.reason} (row {chain.first_bad_seq})")
    for seq in sorted(returned):  # before the heads: a row changed and the chain after it rewritten is named
        name, epoch, digest = returned[seq]
        if seq not in hashes:
            return differs(f"{name}: epoch {epoch}: ledger row {seq}, returned after the visit, is gone (the ledger "
                           f"ends at row {chain.rows})")
        if hashes[seq] != digest:
            return differs(f"{name}: epoch {epoch}: ledger row {seq} differs from the row returned after the visit "
                           f"(hash {digest[:16]}..., the ledger's {hashes[seq][:16]}...)")
    chain = check_heads(chain, hashes, heads)
    if not chain.ok:
        return differs(f"ledger chain: {chain.reason} (row {chain.first_bad_seq})")
    verdict_rows: dict[int, LedgerRow] = {row.epoch: row for row in rows if row.epoch is not None}
    names: set[str] = set()
    for path, rec in receipts:
        epoch = int(rec["epoch"])
        found = verdict_rows.get(epoch)
        if found is None:
            return differs(f"{path.name}: the ledger has no ok holder-attestation row for epoch {epoch} "
                           "(the visit this receipt records is missing)")
        row = found
        names.add(str(row.holder))
        verdict = rec.get("verdict") or {}
        for key in _COMPARED:
            mine, theirs = _get(verdict, key), _get(row.detail, key)
            if mine != theirs:
                return differs(f"{path.name}: epoch {epoch} {'.'.join(key)}: receipt {mine!r}, ledger row "
                               f"{row.seq} {theirs!r}")
        fps = key_fps.get(epoch, set())
        if fps and rec.get("key_fp") not in fps:
            return differs(f"{path.name}: epoch {epoch} key {rec.get('key_fp')}: the ledger names {sorted(fps)}")
    if len(names) != 1:
        return differs(f"the receipts' visits are under several names in the ledger: {sorted(names)}")
    holder = names.pop()
    result.holder = holder
    mine = {int(r["epoch"]) for _, r in receipts}
    for row in rows:  # the ok holder-attestation rows
        if row.holder == holder and row.epoch not in mine:
            return differs(f"ledger row {row.seq} claims a visit of {holder} (epoch {row.epoch}) with no receipt")
    result.ok = True
    result.warnings = [f"{path.name}: no ledger_rows (the run's farewell never reached your agent): the rows of "
                       f"epoch {rec.get('epoch')} after its hand-off head {str(rec.get('ledger_head'))[:24]} are "
                       "checked by later heads alone, and a chain rewritten after them would pass"
                       for path, rec in receipts if not rec.get("ledger_rows")]
    return result
