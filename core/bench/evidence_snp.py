"""The SEV-SNP rows of ``bench evidence`` and the memory a bounded evidence read costs (issue 31's numbers)."""

from __future__ import annotations

import tempfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gputravel.core.evidence.azure_snp import verify_azure_snp
from gputravel.core.evidence.bounded import EVIDENCE_CAP, read_hex_or_raw
from gputravel.core.evidence.policy import SnpPolicy
from gputravel.core.evidence.sim_snp import SimAzureVm
from gputravel.core.evidence.snp import verify_snp_report

__all__ = ["memory_per_file", "snp_checks"]

# virtee/sev's real Milan report and VCEK, where the repository's tests carry them (not in a wheel)
REAL = Path(__file__).resolve().parents[2] / "tests" / "data" / "amd-snp"


def snp_checks() -> tuple[dict[str, Callable[[], bool]], list[str]]:
    """``{row: check}``: each a whole verification that must pass; and notes (a row left out, and why)."""
    notes: list[str] = []
    checks: dict[str, Callable[[], bool]] = {}
    if (REAL / "report_milan.hex").is_file():
        report = (REAL / "report_milan.hex").read_bytes()
        vcek = (REAL / "vcek_milan.der").read_bytes()
        checks["snp_report_real_milan"] = lambda: verify_snp_report(report, vcek).ok
    else:
        notes.append(f"snp_report_real_milan: no sample at {REAL} (an installed wheel carries no tests)")
    vm = SimAzureVm.generate()
    folder = Path(tempfile.mkdtemp(prefix="gputravel-bench-snp-"))
    ark, ask = vm.chip.roots_pem()
    (folder / "ark.crt").write_bytes(ark)
    (folder / "ask.crt").write_bytes(ask)
    policy = SnpPolicy(ark=folder / "ark.crt", ask=folder / "ask.crt")
    sim_report, vcek_der = vm.chip.report(b"\x01" * 64), vm.chip.vcek_der()
    nonce = b"\x02" * 32
    hcl, quote = vm.hcl_report(), vm.quote(nonce)
    checks["snp_report_sim"] = lambda: verify_snp_report(sim_report, vcek_der, policy=policy).ok
    checks["azure_hcl_and_quote_sim"] = lambda: verify_azure_snp(hcl, vcek_der, quote, nonce, policy=policy).ok
    return checks, notes


def memory_per_file() -> dict[str, Any]:
    """tracemalloc's peak while decoding hex evidence at the cap (the largest file a reader decodes)."""
    text = b"0a" * (EVIDENCE_CAP // 2)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        read_hex_or_raw(text)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return {"cap_bytes": EVIDENCE_CAP, "decode_at_cap_peak_bytes": peak,
            "ratio_to_size": round(peak / len(text), 2), "target_ratio": 4, "target_max_bytes": 64 * 1024 * 1024}
