"""The holder sees what it accepts (task policy16 item 1, the session-15 holder walk's "left" list): ``holder init``
names each waiver it wrote and how to tighten it, ``holder policy show`` lists every check of the holder's own
policy, and the written policy keeps the ``[amd-snp]`` section its agent checks an SNP orchestrator CVM under.

Real parts: the holder's configuration on disk (``init_config``, ``HolderConfig.load``), the SIM platform's
policy and roots (``sim_store``), the CLI through typer's runner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import write_holder
from typer.testing import CliRunner

from gputravel.agents.holder.config import HolderConfig, init_config
from gputravel.console.cli.commands.holder_policy import ANY, STATUSES, policy_rows
from gputravel.console.cli.main import app
from gputravel.core.errors import ConfigError
from gputravel.core.evidence import sim_store

runner = CliRunner()
WORDS = "what the holder accepts is what its own policy says".split()
WIDE = {"COLUMNS": "200"}


def _data(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    write_holder(data, 1, WORDS, 200)
    return data


def _rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"[{r['section']}] {r['key']}": r for r in doc["checks"]}


def test_init_names_each_waiver_it_wrote_and_how_to_tighten_it(tmp_path: Path) -> None:
    base = ["holder", "init", "--data", str(_data(tmp_path)), "--accept-any-td"]
    made = runner.invoke(app, [*base, "--config", str(tmp_path / "a"), "--json"])
    assert made.exit_code == 0, made.output
    doc = json.loads(made.stdout)
    waived = {w["key"]: w for w in doc["waivers"]}
    assert set(waived) == {"accept_ocsp_not_checked", "mr_td", "require_crl"}
    assert "[amd-snp] crl" in waived["require_crl"]["tighten"]
    assert "--ocsp-url" in waived["accept_ocsp_not_checked"]["tighten"]
    assert "accept_any_td = false" in waived["mr_td"]["tighten"] and "verdict.cvm.mr_td" in waived["mr_td"]["tighten"]
    assert {r["key"] for r in doc["not_checked"]} >= {"rtmr0", "rtmr3", "measurement", "min_tcb"}
    assert all(r["tighten"] for r in doc["not_checked"])
    text = runner.invoke(app, [*base, "--config", str(tmp_path / "b")], env=WIDE)
    assert text.exit_code == 0, text.output
    line = next(x for x in text.stdout.splitlines() if "accept_ocsp_not_checked" in x)
    assert "waived" in line and "to tighten" in line
    assert "holder policy show" in text.stdout
    written = (tmp_path / "b" / "evidence.toml").read_text()  # the file says it too
    assert "# WAIVER" in written and "accept_ocsp_not_checked = true" in written


def test_policy_show_lists_every_check_with_what_it_accepts(tmp_path: Path) -> None:
    platform = tmp_path / "platform"
    sim_store.load_or_create(platform)
    sim_store.load_or_create_snp(platform)
    sim = platform / "vendor-formats"
    pinned = tmp_path / "pinned.toml"
    text = (sim / "sim-evidence.toml").read_text().replace("[amd-snp]", 'mr_td = ["' + "ab" * 48 + '"]\n\n[amd-snp]')
    pinned.write_text(text + 'measurement = ["' + "cd" * 48 + '"]\nmin_tcb = {snp = 8}\n')
    for f in ("gpu-root.crt", "rim-root.crt", "tdx-root.crt", "snp-ark.crt", "snp-ask.crt"):
        (tmp_path / f).write_bytes((sim / f).read_bytes())
    folder = tmp_path / "config"
    init_config(data=_data(tmp_path), folder=folder, policy=pinned, golden=sim / "gpu.json")
    out = runner.invoke(app, ["holder", "policy", "show", "--config", str(folder), "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    rows = _rows(doc)
    assert {r["status"] for r in rows.values()} <= set(STATUSES)
    assert rows["[intel-tdx] mr_td"]["status"] == "checked" and rows["[intel-tdx] mr_td"]["value"] == ["ab" * 48]
    assert rows["[intel-tdx] rtmr0"]["status"] == "not checked" and rows["[intel-tdx] rtmr0"]["detail"] == ANY
    assert rows["[amd-snp] measurement"]["value"] == ["cd" * 48] and rows["[amd-snp] measurement"]["status"] == "checked"
    assert rows["[amd-snp] min_tcb"]["value"] == {"snp": 8}
    assert rows["[amd-snp] ark"]["value"].endswith("roots/snp-ark.crt")  # the SIM ARK, copied with the config
    assert rows["[amd-snp] (debug)"]["status"] == "always" and rows["[intel-tdx] (debug)"]["status"] == "always"
    assert rows["[nvidia-gpu] require_rims"]["status"] == "not used"
    # MRTD pinned: the waivers left are the ones init cannot lift (OCSP) and AMD's CRL, not named here
    assert doc["waivers"] == ["[nvidia-gpu] accept_ocsp_not_checked", "[amd-snp] require_crl"]
    assert "[intel-tdx] rtmr0" in doc["not_checked"] and "[intel-tdx] mr_td" not in doc["not_checked"]
    assert doc["policy_sha256"] == HolderConfig.load(folder).policy_sha256
    table = runner.invoke(app, ["holder", "policy", "show", "--config", str(folder)], env=WIDE)
    assert table.exit_code == 0, table.output
    rtmr = next(x for x in table.stdout.splitlines() if "[intel-tdx] rtmr1" in x)
    assert "not checked" in rtmr and "any value accepted" in rtmr
    assert "2 waiver(s)" in table.stdout


def test_the_holders_policy_keeps_amd_snp_and_its_digest_covers_it(tmp_path: Path) -> None:
    """Until session 16 init dropped ``[amd-snp]``: an SNP orchestrator CVM was checked under AMD's roots and no
    allow-list, whatever the holder's policy file said, and the digest did not cover it."""
    platform = tmp_path / "platform"
    sim_store.load_or_create(platform)
    sim_store.load_or_create_snp(platform)
    sim = platform / "vendor-formats"
    data = _data(tmp_path)
    plain = init_config(data=data, folder=tmp_path / "c0", policy=sim / "sim-evidence.toml", accept_any_td=True)
    assert plain.policy.snp.ark is not None and plain.policy.snp.ark.read_bytes() == (sim / "snp-ark.crt").read_bytes()
    assert plain.policy.snp.ark.parent == tmp_path / "c0" / "roots"
    measured = tmp_path / "measured.toml"
    measured.write_text((sim / "sim-evidence.toml").read_text() + 'measurement = ["' + "cd" * 48 + '"]\n')
    for f in ("gpu-root.crt", "rim-root.crt", "tdx-root.crt", "snp-ark.crt", "snp-ask.crt"):
        (tmp_path / f).write_bytes((sim / f).read_bytes())
    other = init_config(data=data, folder=tmp_path / "c1", policy=measured, accept_any_td=True)
    assert other.policy.snp.measurement == ("cd" * 48,)
    assert other.policy_sha256 != plain.policy_sha256


def test_a_hand_written_ocsp_requirement_is_refused_by_name(tmp_path: Path) -> None:
    """The agent does no OCSP: ``accept_ocsp_not_checked = false`` would be read and ignored, so it is refused."""
    folder = tmp_path / "config"
    init_config(data=_data(tmp_path), folder=folder, accept_any_td=True)
    path = folder / "evidence.toml"
    path.write_text(path.read_text().replace("accept_ocsp_not_checked = true", "accept_ocsp_not_checked = false"))
    with pytest.raises(ConfigError, match="does no OCSP"):
        HolderConfig.load(folder)
    out = runner.invoke(app, ["holder", "policy", "show", "--config", str(folder)])
    assert out.exit_code == 2 and "--ocsp-url" in out.output


def test_every_row_names_a_known_status(tmp_path: Path) -> None:
    cfg = init_config(data=_data(tmp_path), folder=tmp_path / "config", accept_any_td=True)
    rows = policy_rows(cfg)
    assert rows and all(r["status"] in STATUSES for r in rows)
    assert all(r["tighten"] for r in rows if r["status"] in ("waived", "not checked"))


def test_the_new_keys_and_amds_crl_travel_into_the_holders_policy(tmp_path: Path) -> None:
    """Keys the auditor could not express (policy16 items 2, 3) are the holder's own: init writes them into its
    policy (the CRL copied beside its roots), the digest covers them and ``policy show`` says they are checked."""
    platform = tmp_path / "platform"
    sim_store.load_or_create(platform)
    sim_store.load_or_create_snp(platform)
    sim = platform / "vendor-formats"
    for f in ("gpu-root.crt", "rim-root.crt", "tdx-root.crt", "snp-ark.crt", "snp-ask.crt"):
        (tmp_path / f).write_bytes((sim / f).read_bytes())
    (tmp_path / "amd.crl").write_bytes(b"a CRL file (its contents are checked at attestation, not here)")
    base = (sim / "sim-evidence.toml").read_text()
    strict = tmp_path / "strict.toml"
    strict.write_text(base.replace("[amd-snp]", 'min_tee_tcb_svn = "' + "01" * 16 + '"\nmax_collateral_age_days = 7\n'
                                   "\n[amd-snp]") + 'allow_smt = false\nallow_migration_agent = false\n'
                      'crl = "amd.crl"\nrequire_crl = true\n')
    data = _data(tmp_path)
    loose = init_config(data=data, folder=tmp_path / "c0", policy=sim / "sim-evidence.toml", accept_any_td=True)
    cfg = init_config(data=data, folder=tmp_path / "c1", policy=strict, accept_any_td=True)
    assert cfg.policy_sha256 != loose.policy_sha256
    assert cfg.policy.tdx.min_tee_tcb_svn == "01" * 16 and cfg.policy.tdx.max_collateral_age_days == 7
    assert cfg.policy.snp.allow_smt is False and cfg.policy.snp.allow_migration_agent is False
    assert cfg.policy.snp.crl == tmp_path / "c1" / "roots" / "snp.crl" and cfg.policy.snp.require_crl is True
    rows = {f"[{r['section']}] {r['key']}": r for r in policy_rows(cfg)}
    for key in ("[intel-tdx] min_tee_tcb_svn", "[intel-tdx] max_collateral_age_days", "[amd-snp] allow_smt",
                "[amd-snp] allow_migration_agent", "[amd-snp] crl"):
        assert rows[key]["status"] == "checked", key
    loose_rows = {f"[{r['section']}] {r['key']}": r for r in policy_rows(loose)}
    assert loose_rows["[intel-tdx] min_tee_tcb_svn"]["status"] == "not checked"
    assert loose_rows["[amd-snp] allow_smt"]["status"] == "not checked"
    assert loose_rows["[amd-snp] require_crl"]["status"] == "waived"
