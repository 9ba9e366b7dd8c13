"""How long ``gputravel holder verify`` takes on a long run (issue 30: a 1,000-visit ledger in <= 2 s).

Builds a ledger the way a run writes one (``core.ledger.Ledger``: per visit its ATTEST, HANDOFF, holder-state,
holder-attestation, PROVISION, RETURN, VERIFY, TRAIN, SCRUB, ROTATE and visit-completed rows; holders taking
turns) and one holder's receipts for its visits (with the visit's ledger rows, as BYE returns them), then times the check itself (``verify_receipts``) and the whole
command in a fresh process (``gputravel holder verify RECEIPT... --ledger``, Python's start included); the check's
CPU time beside its wall time (on a loaded shared machine, wall time is mostly waiting for a core). Prints JSON.

    .venv/bin/python scripts/holder_verify_bench.py --visits 1000 --holders 2 --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gputravel.agents.receipts_check import verify_receipts
from gputravel.core.ledger import Ledger


def _hex(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def build(folder: Path, visits: int, holders: int) -> tuple[Path, list[Path]]:
    """A ledger of ``visits`` visits and the receipts of holder ``h0`` (written as its agent writes them)."""
    path = folder / "ledger.db"
    receipts: list[Path] = []
    roots = {"gpu": "sha256:" + _hex("gpu"), "tdx": "sha256:" + _hex("tdx")}
    with Ledger.open(path, run_id="bench-run") as ledger:
        for v in range(visits):
            holder, epoch, fp = f"h{v % holders}", v + 1, _hex("key", v)[:16]
            report = {"cvm": {"ok": True, "tcb_status": "UpToDate", "mr_td": _hex("mrtd") + _hex("x")[:32]},
                      "gpu": {"ok": True, "nonce": _hex("nonce", v), "claims_failed": [], "measres": "success"},
                      "ms": 0.6, "failed_claim": None, "policy_source": "holder", "policy_sha256": _hex("policy"),
                      "roots": roots, "mr_td_policy": "pinned",
                      "evidence_sha256": {k: _hex(k, v) for k in ("quote", "collateral", "gpu_report", "gpu_chain")}}
            mine = [ledger.append(kind="phase", phase="ATTEST", holder=holder, epoch=epoch, outcome="ok",
                                  detail={"visit": v}),
                    ledger.append(kind="phase", phase="HANDOFF", holder=holder, epoch=epoch, key_fp=fp, outcome="ok",
                                  detail={"visit": v})]
            seq, head = ledger.head()
            ledger.append(kind="holder-state", holder=holder, outcome="provisioning", detail={"detail": f"epoch {epoch}"})
            mine.append(ledger.append(kind="holder-attestation", phase="PROVISION", holder=holder, epoch=epoch,
                                      outcome="ok", duration_s=0.0006, detail={"claim": None, **report}))
            ledger.append(kind="holder-state", holder=holder, outcome="returned", detail={"detail": f"epoch {epoch}"})
            for phase in ("PROVISION", "RETURN", "VERIFY", "TRAIN", "SCRUB", "ROTATE"):
                mine.append(ledger.append(kind="phase", phase=phase, holder=holder, epoch=epoch, key_fp=fp,
                                          nbytes=1 << 20, outcome="ok", detail={"visit": v}))
            mine.append(ledger.append(kind="visit-completed", holder=holder, epoch=epoch, key_fp=fp, outcome="ok",
                                      detail={"visit": v}))
            if holder == "h0":
                receipt = {"v": 1, "run": "bench-run", "epoch": epoch, "holder": "h0", "key_fp": fp, "path": "direct",
                           "evidence_sha256": report["evidence_sha256"], "verdict": {"ok": True, **report},
                           "chunks": 64, "bytes": 1 << 20, "resume_from": 0, "ledger_head": f"{seq}:{head}",
                           "ledger_rows": [[row.seq, row.hash] for row in mine]}
                rpath = folder / "receipts" / f"epoch-{epoch}.json"
                rpath.parent.mkdir(exist_ok=True)
                rpath.write_text(json.dumps(receipt))
                receipts.append(rpath)
    return path, receipts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--visits", type=int, default=1000)
    parser.add_argument("--holders", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ledger, receipts = build(Path(tmp), ns.visits, ns.holders)
        docs = [(p, json.loads(p.read_text())) for p in receipts]
        inner, cpu = [], []
        for _ in range(ns.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            result = verify_receipts(ledger, docs)
            inner.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            assert result.ok, result.difference
        whole = []
        for _ in range(ns.repeats):
            t0 = time.perf_counter()
            res = subprocess.run([sys.executable, "-m", "gputravel.console.cli", "holder", "verify",
                                  *map(str, receipts), "--ledger", str(ledger), "--json"], capture_output=True,
                                 text=True)
            whole.append(time.perf_counter() - t0)
            assert res.returncode == 0, res.stdout + res.stderr
        rows = json.loads(res.stdout)["ledger_rows"]
    out = {"visits": ns.visits, "holders": ns.holders, "receipts": len(receipts), "ledger_rows": rows,
           "verify_s": {"min": round(min(inner), 3), "median": round(sorted(inner)[len(inner) // 2], 3)},
           "verify_cpu_s": {"min": round(min(cpu), 3), "median": round(sorted(cpu)[len(cpu) // 2], 3)},
           "command_s": {"min": round(min(whole), 3), "median": round(sorted(whole)[len(whole) // 2], 3)},
           "target_s": 2.0}
    print(json.dumps(out, indent=2 if ns.json else None))


if __name__ == "__main__":
    main()
