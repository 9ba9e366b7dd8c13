"""``gputravel holder policy show``: every check of the holder's own policy, what it accepts, and the waivers.

The rows are read from the holder's configuration as ``holder serve`` loads it (``agents.holder.config``), never
from anything the orchestrator sends: what a row says is what the holder's agent checks. A row's ``status`` is
one of :data:`STATUSES`: ``checked`` (the value is compared), ``always`` (no key can turn it off), ``not checked``
(an empty allow-list or an unset key: any value is accepted), ``waived`` (the holder accepts something it cannot
check, named with how to tighten it) and ``not used`` (a key of the shared policy format the agent does not read).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from gputravel.agents.holder.config import HolderConfig

__all__ = ["STATUSES", "policy_app", "policy_doc", "policy_rows", "waivers"]

STATUSES = ("checked", "always", "not checked", "waived", "not used")
ANY = "any value accepted (not checked)"

policy_app = typer.Typer(help="The holder's own evidence policy: every check, what it accepts, the waivers.",
                         no_args_is_help=True)


def _row(section: str, key: str, claim: str, value: Any, status: str, detail: str = "",
         tighten: str = "") -> dict[str, Any]:
    return {"section": section, "key": key, "claim": claim, "value": value, "status": status, "detail": detail,
            "tighten": tighten}


def _allow_list(section: str, key: str, claim: str, values: tuple[str, ...], *, what: str) -> dict[str, Any]:
    if values:
        return _row(section, key, claim, list(values), "checked", f"the {what} must be one of these")
    return _row(section, key, claim, [], "not checked", ANY,
                f"add the {what}(s) you accept to [{section}] {key} (lowercase hex)")


def _root(path: Path | None, vendor: str) -> str:
    return str(path) if path is not None else vendor


def _snp_bit(key: str, claim: str, allowed: bool | None, what: str) -> dict[str, Any]:
    if allowed is False:
        return _row("amd-snp", key, claim, False, "checked", f"a guest that allows {what} is refused")
    return _row("amd-snp", key, claim, allowed, "not checked", f"a guest that allows {what} is accepted",
                f"set [amd-snp] {key} = false")


def _crl_row(crl: Path | None, required: bool) -> dict[str, Any]:
    if crl is not None:
        return _row("amd-snp", "crl", "cert-chain-not-revoked", str(crl), "checked",
                    "AMD's CRL: its ARK signature and dates are checked, the ASK and VCEK must not be in it; "
                    "replace the file before its next update")
    if required:
        return _row("amd-snp", "require_crl", "cert-chain-not-revoked", True, "checked",
                    "no crl is named: every SNP report is refused until one is")
    return _row("amd-snp", "require_crl", "cert-chain-not-revoked", False, "waived",
                "the SNP chain's revocation (AMD's CRL) is not checked: a revoked VCEK or ASK passes",
                "fetch AMD's CRL (https://kdsintf.amd.com/vcek/v1/<Product>/crl), name it in [amd-snp] crl, and set "
                "require_crl = true")


def waivers(cfg: HolderConfig) -> list[dict[str, Any]]:
    """What the holder accepts without checking it, each with how to tighten it (``holder init`` names them)."""
    return [r for r in policy_rows(cfg) if r["status"] == "waived"]


def policy_rows(cfg: HolderConfig) -> list[dict[str, Any]]:
    """One row per check of the holder's policy, in the order its agent makes them (GPU, TDX CVM, SNP CVM)."""
    g, t, s = cfg.policy.gpu, cfg.policy.tdx, cfg.policy.snp
    golden = sum(len(v) for v in cfg.golden.values())
    rows = [
        _row("nvidia-gpu", "device_root", "x-nvidia-gpu-attestation-report-cert-chain", cfg.roots["gpu"],
             "checked", "the GPU's certificate chain must end at this root (its DER's SHA-256)"),
        _row("nvidia-gpu", "expected_arch", "x-nvidia-gpu-arch-check", list(g.expected_arch), "checked"),
        _row("nvidia-gpu", "accept_ocsp_not_checked", "x-nvidia-gpu-attestation-report-cert-chain",
             g.accept_ocsp_not_checked, "waived",
             "the GPU chain's revocation (NVIDIA's OCSP) is not checked: the holder's agent reaches no NVIDIA service",
             "check it yourself on the orchestrator's GPU evidence: gputravel attest --evidence ... --ocsp-url URL "
             "(the agent cannot; false is refused)"),
        _row("golden.json", "measurements", "measres", f"{golden} value(s) at {len(cfg.golden)} index(es)",
             "checked",
             "each must match (gputravel attest --rim approves them)" if golden
             else "none approved: every GPU is refused (measres)"),
        _row("nvidia-gpu", "require_rims", "", g.require_rims, "not used",
             "the agent compares golden.json's values, not RIMs"),
        _row("nvidia-gpu", "rim_root", "", _root(g.rim_root, "nvidia"), "not used", "the agent reads no RIMs"),
        _row("intel-tdx", "root_ca", "quote-verified", cfg.roots["tdx"], "checked",
             "the quote and its collateral must chain to this root"),
        _row("intel-tdx", "(debug)", "td-not-debug", False, "always", "a debuggable TD is refused; no key allows it"),
        _row("intel-tdx", "tcb_status", "tcb-status", list(t.tcb_status), "checked"),
    ]
    mr_td = _allow_list("intel-tdx", "mr_td", "mr-td", t.mr_td, what="orchestrator CVM's MRTD")
    if not t.mr_td:  # only served with accept_any_td (HolderConfig.load refuses it otherwise)
        mr_td = _row("intel-tdx", "mr_td", "mr-td", [], "waived",
                     "any TD image passes (holder.toml: accept_any_td = true; every verdict says mr_td_policy any)",
                     "pin the orchestrator CVM's MRTD in [intel-tdx] mr_td (the one it reported is in each receipt, "
                     "receipts/RUN/*: verdict.cvm.mr_td) and set accept_any_td = false in holder.toml")
    rows.append(mr_td)
    rows += [_allow_list("intel-tdx", f"rtmr{i}", f"rtmr{i}", r, what=f"RTMR{i}") for i, r in enumerate(t.rtmrs)]
    rows += [
        _row("intel-tdx", "min_tee_tcb_svn", "tee-tcb-svn", t.min_tee_tcb_svn, "checked",
             "each byte of the TD's TEE_TCB_SVN must be at least this one's") if t.min_tee_tcb_svn else
        _row("intel-tdx", "min_tee_tcb_svn", "tee-tcb-svn", None, "not checked", ANY + "; tcb_status still applies",
             'set [intel-tdx] min_tee_tcb_svn = "<32 hex digits>" (a verdict\'s tee_tcb_svn shows the format)'),
        _row("intel-tdx", "max_collateral_age_days", "collateral-age", t.max_collateral_age_days, "checked",
             "the TCB info's issueDate must be at most this many days before the check")
        if t.max_collateral_age_days is not None else
        _row("intel-tdx", "max_collateral_age_days", "collateral-age", None, "not checked",
             "collateral of any age inside its validity window (issueDate to nextUpdate) accepted",
             "set [intel-tdx] max_collateral_age_days = N"),
    ]
    rows += [
        _row("amd-snp", "ark", "cert-chain-validated", _root(s.ark, "amd"), "checked",
             "AMD's ARK for the report's product" if s.ark is None else "the VCEK's chain must end at this root"),
        _row("amd-snp", "ask", "cert-chain-validated", _root(s.ask, "amd"), "checked"),
        _row("amd-snp", "asvk", "cert-chain-validated", _root(s.asvk, "none"), "checked",
             "" if s.asvk else "a VLEK-signed report is refused"),
        _row("amd-snp", "(debug)", "guest-not-debug", False, "always",
             "a guest whose policy allows debugging is refused; no key allows it"),
        _row("amd-snp", "vmpl", "vmpl", list(s.vmpl), "checked"),
        _row("amd-snp", "min_tcb", "min-tcb", dict(s.min_tcb), "checked") if s.min_tcb else
        _row("amd-snp", "min_tcb", "min-tcb", {}, "not checked", "any TCB accepted",
             "set [amd-snp] min_tcb = {boot_loader = N, tee = N, snp = N, microcode = N}"),
        _allow_list("amd-snp", "measurement", "measurement", s.measurement, what="launch measurement"),
        _allow_list("amd-snp", "host_data", "host-data", s.host_data, what="host data"),
        _allow_list("amd-snp", "id_key_digest", "id-key-digest", s.id_key_digest, what="ID key digest"),
        *(_snp_bit(key, claim, allowed, what) for key, claim, allowed, what in (
            ("allow_smt", "guest-no-smt", s.allow_smt, "SMT (guest policy bit 16)"),
            ("allow_migration_agent", "guest-no-migration-agent", s.allow_migration_agent,
             "a migration agent (guest policy bit 18)"))),
        _crl_row(s.crl, s.require_crl),
        _row("holder.toml", "handoffs", "", cfg.handoffs, "checked", "the hand-off paths the agent accepts"),
    ]
    return rows


def policy_doc(cfg: HolderConfig) -> dict[str, Any]:
    """What ``holder policy show --json`` prints."""
    rows = policy_rows(cfg)
    return {"folder": str(cfg.folder), "policy": str(cfg.policy_path), "policy_sha256": cfg.policy_sha256,
            "checks": rows, "waivers": [f"[{r['section']}] {r['key']}" for r in rows if r["status"] == "waived"],
            "not_checked": [f"[{r['section']}] {r['key']}" for r in rows if r["status"] == "not checked"]}


def _text(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {v}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return ", ".join(map(str, value)) if value else "[]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def render_rows(rows: list[dict[str, Any]], *, title: str) -> None:
    """The rows as a table: key, value, status and why (with how to tighten a waiver or an unchecked key)."""
    table = Table(title=title, title_justify="left")
    for col in ("check", "value", "status", "what it means"):
        table.add_column(col, overflow="fold")
    style = {"checked": "green", "always": "green", "not checked": "yellow", "waived": "bold yellow",
             "not used": "dim"}
    for r in rows:
        why = r["detail"] + (f"; to tighten: {r['tighten']}" if r["tighten"] else "")
        table.add_row(escape(f"[{r['section']}] {r['key']}"), escape(_text(r["value"])),
                      f"[{style[r['status']]}]{r['status']}[/]", escape(why))
    Console().print(table)


@policy_app.command("show")
def show(
    config: Annotated[Path | None, typer.Option(
        "--config", metavar="DIR", help="The holder's configuration folder (default: $XDG_CONFIG_HOME/gputravel/"
                                        "holder, ~/.config/gputravel/holder).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List every check of the holder's policy: its value, 'any value accepted (not checked)', the waivers."""
    from gputravel.agents.holder.config import HolderConfig

    cfg = HolderConfig.load(config)
    if as_json:
        typer.echo(json.dumps(policy_doc(cfg), indent=2))
        return
    rows = policy_rows(cfg)
    render_rows(rows, title=f"the holder's policy ({cfg.policy_path}), policy_sha256 {cfg.policy_sha256[:16]}...")
    loose = [r for r in rows if r["status"] in ("waived", "not checked")]
    Console().print(f"{sum(r['status'] == 'waived' for r in rows)} waiver(s), "
                    f"{sum(r['status'] == 'not checked' for r in rows)} check(s) accepting any value"
                    + (": tighten them in " + escape(str(cfg.policy_path)) if loose else ""), soft_wrap=True)
