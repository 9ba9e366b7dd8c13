"""``gputravel fleet pki export FILE`` (SIM only) and ``run --nnodes H`` asking for ``--sim-pki`` (issue 36)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from gputravel.console.cli.main import app
from gputravel.core.fleet.keyagree import FleetCvm
from gputravel.core.fleet.pki import install_sim_pki
from gputravel.core.runfolder.folder import RunFolder


def test_pki_export_writes_the_sim_vendors_once_privately_and_says_sim(tmp_path: Path) -> None:
    file = tmp_path / "sim-pki.json"
    result = CliRunner().invoke(app, ["fleet", "pki", "export", str(file)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert said.startswith("SIM vendor PKI") and "Not for real hardware" in said
    assert file.stat().st_mode & 0o777 == 0o600
    doc = json.loads(file.read_text())
    assert doc["sim"] is True and "root.pem" in doc["vendor"] and "tdx-root.crt" in doc["cvm"]
    again = CliRunner().invoke(app, ["fleet", "pki", "export", str(file), "--json"])
    assert again.exit_code == 2 and json.loads(file.read_text()) == doc  # refused, the file kept
    # two nodes that install it trust the same CVM image and vendor
    nodes = [RunFolder(tmp_path / f"node-{i}") for i in (0, 1)]
    for node in nodes:
        install_sim_pki(file, node)
    assert (nodes[0].vendor / "root.pem").read_bytes() == (nodes[1].vendor / "root.pem").read_bytes()
    assert FleetCvm.sim(nodes[0].cvm).policy.tdx.mr_td == FleetCvm.sim(nodes[1].cvm).policy.tdx.mr_td == (doc["mr_td"],)


def test_a_multi_node_fleet_without_sim_pki_is_refused_with_exit_2(tmp_path: Path) -> None:
    data = tmp_path / "data"
    for name in ("a", "b"):
        (data / name).mkdir(parents=True)
        (data / name / "t.txt").write_text("to be or not to be " * 200)
    result = CliRunner().invoke(app, ["run", "--gpus", "2", "--nnodes", "2", "--data", str(data), "--holders", "2",
                                      "--out", str(tmp_path / "out"), "--rdzv-endpoint", "127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert "--sim-pki" in result.output
    # an SEV-SNP CVM in the fleet's key agreement: refused by name, before the run's folder holds anything
    snp = CliRunner().invoke(app, ["run", "--gpus", "2", "--data", str(data), "--holders", "2", "--cvm-kind", "snp",
                                   "--out", str(tmp_path / "snp"), "--rdzv-endpoint", "127.0.0.1:1"])
    assert snp.exit_code == 2, snp.output
    assert "--cvm-kind snp is refused for a fleet" in snp.output
    assert not (tmp_path / "snp" / "fleet.json").exists()


def test_a_sim_pki_file_that_is_not_one_is_refused_with_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something else"}))
    result = CliRunner().invoke(app, ["run", "--gpus", "2", "--nnodes", "2", "--sim-pki", str(bad),
                                      "--out", str(tmp_path / "out"), "--rdzv-endpoint", "127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert "not a gputravel-sim-pki-v1 file" in result.output
