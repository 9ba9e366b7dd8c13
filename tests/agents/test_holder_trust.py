"""The holder owns its trust (issue 30): its own configuration, a restricted key, a policy the orchestrator cannot
touch, attestation that is not optional, receipts it verifies offline.

Real parts: the holder's configuration on disk, real agents (``gputravel holder serve`` as a process), a real
device service, SIM TDX quotes checked by dcap-qvl, SIM SPDM reports, X25519 + AES-GCM, a real SQLite ledger.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from helpers import small_settings, write_holder
from typer.testing import CliRunner

from gputravel.agents.holder.authorize import authorize, revoke
from gputravel.agents.holder.config import HolderConfig, init_config
from gputravel.agents.holder.receipts import read_receipts
from gputravel.console.cli.main import app
from gputravel.core import api
from gputravel.core.errors import ConfigError
from gputravel.core.evidence import sim_store
from gputravel.core.evidence.holder_check import NVIDIA_DEVICE_ROOT
from gputravel.core.ledger import read_rows, row_hash
from gputravel.core.protocol import FrameType
from gputravel.core.travel import framed_link
from gputravel.core.travel.local_link import LocalHolderLink

runner = CliRunner()
SERVE = ("-m", "gputravel.console.cli", "holder", "serve", "--config")
WORDS = "the holder owns its trust and the orchestrator cannot change what it checks".split()


def _der_fp(pem: bytes) -> str:
    return "sha256:" + hashlib.sha256(x509.load_pem_x509_certificate(pem).public_bytes(Encoding.DER)).hexdigest()


# --- the configuration ------------------------------------------------------------------------------------------
def test_init_refuses_an_empty_mrtd_allow_list_unless_any_td_is_accepted(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_holder(data, 1, WORDS, 200)
    folder = tmp_path / "config"
    with pytest.raises(ConfigError, match="empty MRTD allow-list"):
        init_config(data=data, folder=folder)
    assert not (folder / "holder.toml").exists()  # nothing written

    cfg = init_config(data=data, folder=folder, accept_any_td=True)
    assert folder.stat().st_mode & 0o777 == 0o700
    assert {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir() if p.is_file()} == {
        "holder.toml": 0o600, "evidence.toml": 0o600, "golden.json": 0o600}
    shown = cfg.to_dict()
    assert shown["mr_td_policy"] == "any" and shown["handoffs"] == ["direct", "channel"]
    assert shown["roots"]["gpu"] == _der_fp(NVIDIA_DEVICE_ROOT.read_bytes())  # vendor roots by default
    assert shown["roots"]["tdx"].startswith("intel")
    assert len(shown["policy_sha256"]) == 64 and HolderConfig.load(folder).policy_sha256 == shown["policy_sha256"]


def test_the_digest_covers_mrtd_golden_roots_and_hand_offs(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_holder(data, 1, WORDS, 200)
    platform = tmp_path / "platform"
    sim = sim_store.load_or_create(platform)[2].parent
    pinned = tmp_path / "pinned.toml"
    pinned.write_text((sim / "sim-evidence.toml").read_text() + 'mr_td = ["' + "ab" * 48 + '"]\n')
    for f in ("gpu-root.crt", "rim-root.crt", "tdx-root.crt"):
        (tmp_path / f).write_bytes((sim / f).read_bytes())
    digests = set()
    for i, kw in enumerate([dict(policy=sim / "sim-evidence.toml", accept_any_td=True),
                            dict(policy=sim / "sim-evidence.toml", accept_any_td=True, golden=sim / "gpu.json"),
                            dict(policy=sim / "sim-evidence.toml", accept_any_td=True, golden=sim / "gpu.json",
                                 allow_conventional=True),
                            dict(policy=pinned, golden=sim / "gpu.json")]):
        cfg = init_config(data=data, folder=tmp_path / f"c{i}", **kw)  # type: ignore[arg-type]
        digests.add(cfg.policy_sha256)
        assert cfg.roots["gpu"] == _der_fp((sim / "gpu-root.crt").read_bytes())
        assert cfg.roots["tdx"] == _der_fp((sim / "tdx-root.crt").read_bytes())
    assert len(digests) == 4
    assert cfg.mr_td_policy == "pinned" and cfg.to_dict()["mr_td"] == ["ab" * 48]
    # the configuration stands alone: its roots were copied, the originals may go
    (sim / "gpu-root.crt").unlink()
    assert HolderConfig.load(tmp_path / "c3").policy_sha256 == cfg.policy_sha256


def test_a_configuration_others_can_read_or_edit_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_holder(data, 1, WORDS, 200)
    folder = tmp_path / "config"
    init_config(data=data, folder=folder, accept_any_td=True)
    os.chmod(folder / "evidence.toml", 0o644)
    with pytest.raises(ConfigError, match="0600"):
        HolderConfig.load(folder)
    os.chmod(folder / "evidence.toml", 0o600)
    os.chmod(folder, 0o755)
    with pytest.raises(ConfigError, match="0700"):
        HolderConfig.load(folder)
    os.chmod(folder, 0o700)
    # an empty MRTD list written by hand, without accept_any_td, does not serve either
    text = (folder / "holder.toml").read_text().replace("accept_any_td = true", "accept_any_td = false")
    (folder / "holder.toml").write_text(text)
    with pytest.raises(ConfigError, match="MRTD allow-list is empty"):
        HolderConfig.load(folder)


def test_cli_init_and_show_print_the_digest_and_root_fingerprints(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_holder(data, 1, WORDS, 200)
    folder = tmp_path / "config"
    refused = runner.invoke(app, ["holder", "init", "--data", str(data), "--config", str(folder)])
    assert refused.exit_code == 2 and "--accept-any-td" in refused.output
    made = runner.invoke(app, ["holder", "init", "--data", str(data), "--config", str(folder), "--accept-any-td",
                               "--json"])
    assert made.exit_code == 0, made.output
    shown = runner.invoke(app, ["holder", "show", "--config", str(folder), "--json"])
    assert shown.exit_code == 0
    doc = json.loads(shown.output)
    assert doc["policy_sha256"] == json.loads(made.output.split("\n", 1)[1] if made.output.startswith(
        "gputravel:") else made.output)["policy_sha256"]
    assert doc["roots"]["gpu"].startswith("sha256:") and doc["mr_td_policy"] == "any"


# --- the restricted key -----------------------------------------------------------------------------------------
def test_authorize_writes_one_restricted_line_and_replaces_an_open_one(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBq6bmE0iLRqxIdCnkGv8x6qmvmUUv0ecuQ2Wq9I4jXk orchestrator"
    other = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIH4Q1KZ8V5mZdx/RbmbA3h9mXz1zuq2z4o3sX2HhWWm4 mine"
    (home / ".ssh" / "authorized_keys").write_text(f"{key}\n{other}\n")  # an old, unrestricted line
    path, line, replaced = authorize(key, config_dir=tmp_path / "cfg", home=home, command="/opt/gt holder serve")
    lines = path.read_text().splitlines()
    assert replaced == 1 and lines == [other, line]
    assert line.startswith('restrict,command="/opt/gt holder serve" ssh-ed25519 ') and "permitopen" not in line
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    _, line, _ = authorize(key, config_dir=tmp_path / "cfg", home=home, permit_open="127.0.0.1:7001",
                           command="/opt/gt holder serve")
    assert ',port-forwarding,permitlisten="127.0.0.1:*",permitopen="127.0.0.1:7001" ' in line
    assert len(path.read_text().splitlines()) == 2
    # the direct path's forward: listening on the holder's loopback only, no useful local forward (session 15:
    # --permit-open let the key listen on any address sshd allowed, and was the only way to get the forward)
    _, line, _ = authorize(key, config_dir=tmp_path / "cfg", home=home, data_forward=True,
                           command="/opt/gt holder serve")
    assert ',port-forwarding,permitlisten="127.0.0.1:*",permitopen="127.0.0.1:1" ' in line
    with pytest.raises(ConfigError, match="HOST:PORT"):
        authorize(key, config_dir=tmp_path / "cfg", home=home, permit_open="127.0.0.1:99999")
    with pytest.raises(ConfigError, match="not an OpenSSH public key"):
        authorize('command="sh" ' + key, config_dir=tmp_path / "cfg", home=home)  # no options smuggled in
    assert revoke(key, home=home) == (path, 1)
    assert path.read_text().splitlines() == [other]
    with pytest.raises(ConfigError, match="not authorized"):
        revoke(key, home=home)


def test_the_forced_command_names_this_installation_and_the_config_folder(tmp_path: Path) -> None:
    from gputravel.agents.holder.authorize import forced_command

    cmd = forced_command(tmp_path / "my config")
    assert cmd.endswith(f"holder serve --config '{tmp_path / 'my config'}'")
    assert cmd.startswith(str(Path(sys.executable).parent))


# --- runs against holder serve ----------------------------------------------------------------------------------
@pytest.fixture
def tap(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, FrameType, dict[str, Any]]]:
    sent: list[tuple[str, FrameType, dict[str, Any]]] = []
    original = framed_link.FramedSession._send

    def recording(self: framed_link.FramedSession, ftype: FrameType, header: dict[str, Any],
                  payload: bytes = b"") -> None:
        sent.append((self.name, ftype, dict(header)))
        original(self, ftype, header, payload)

    monkeypatch.setattr(framed_link.FramedSession, "_send", recording)
    return sent


def _holders(tmp_path: Path, out: Path, **kw: Any) -> dict[str, Path]:
    """alice and bob, each with its own configuration trusting the SIM platform of run folder ``out`` (what
    ``gputravel attest --sim-formats --state-dir out/platform`` makes): the SIM policy, roots and gpu.json."""
    sim = sim_store.load_or_create(out / "platform")[2].parent
    folders = {}
    for i, name in enumerate(("alice", "bob")):
        write_holder(tmp_path / "data" / name, 20 + i, WORDS)
        args: dict[str, Any] = dict(policy=sim / "sim-evidence.toml", golden=sim / "gpu.json", accept_any_td=True)
        args.update(kw.get(name, {}))
        folders[name] = tmp_path / "holders" / name
        init_config(data=tmp_path / "data" / name, folder=folders[name], name=name, **args)
    return folders


def _links(folders: dict[str, Path]) -> list[LocalHolderLink]:
    return [LocalHolderLink(name, Path("-"), agent=(*SERVE, str(folder)), pinned=True)
            for name, folder in folders.items()]


@pytest.mark.process
async def test_a_holder_pinned_run_completes_with_receipts_that_verify_offline(
        tmp_path: Path, tap: list[tuple[str, FrameType, dict[str, Any]]]) -> None:
    out = tmp_path / "run"
    folders = _holders(tmp_path, out)
    report = (await api.run(small_settings(None, out, transport="local"), links=_links(folders))).to_json()
    assert report["failed_visits"] == 0 and [v["outcome"] for v in report["visits"]] == ["done", "done"]
    for v in report["visits"]:
        att = v["holder_attestation"]
        cfg = HolderConfig.load(folders[v["holder"]])
        assert att["policy_source"] == "holder" and att["policy_sha256"] == cfg.policy_sha256
        assert att["roots"] == cfg.roots and att["mr_td_policy"] == "any" and att["gpu"]["measres"] == "success"
    rows = read_rows(out / "ledger.db")
    verdicts = [r for r in rows if r.kind == "holder-attestation"]
    assert {r.detail["policy_source"] for r in verdicts} == {"holder"}
    assert all("key" not in h for _, t, h in tap if t is FrameType.HANDOFF)  # never a key in the clear

    ledger = out / "ledger.db"
    for name, folder in folders.items():
        found = read_receipts(folder / "receipts")
        assert [r["run"] for _, r in found] == [rows[0].run_id]
        assert {p.stat().st_mode & 0o777 for p, _ in found} == {0o600}
        for _, rec in found:  # the rows the run returned after the visit (BYE): every row of its epoch, as stored
            assert rec["ledger_rows"] == [[r.seq, r.hash] for r in rows if r.holder == name and r.epoch == rec["epoch"]]
            assert len(rec["ledger_rows"]) >= 3
        ok = runner.invoke(app, ["holder", "verify", "--ledger", str(out), "--config", str(folder), "--json"])
        assert ok.exit_code == 0, ok.output
        assert json.loads(ok.output)["holder"] == name and json.loads(ok.output)["warnings"] == []

    # a receipt without the rows BYE returns (its farewell lost) still matches, and verify says what it could not
    # check (session 15: it said only "receipts match")
    path, rec = read_receipts(folders["alice"] / "receipts")[0]
    bare = tmp_path / "bare-receipt.json"
    bare.write_text(json.dumps({k: v for k, v in rec.items() if k != "ledger_rows"}))
    weak = runner.invoke(app, ["holder", "verify", str(bare), "--ledger", str(ledger)])
    assert weak.exit_code == 0 and "no ledger_rows" in weak.output and "bare-receipt.json" in weak.output, weak.output

    # a changed receipt is named
    path, rec = read_receipts(folders["alice"] / "receipts")[0]
    rec["verdict"]["cvm"]["tcb_status"] = "OutOfDate"
    path.write_text(json.dumps(rec))
    bad = runner.invoke(app, ["holder", "verify", str(path), "--ledger", str(ledger)])
    assert bad.exit_code == 8 and "cvm.tcb_status" in bad.output, bad.output
    assert "Keep this copy of the ledger and your receipts" in " ".join(bad.output.split())  # and what to do
    # a changed ledger row is named (the chain breaks at it)
    seq = next(r.seq for r in verdicts if r.holder == "bob")
    with sqlite3.connect(ledger) as con:
        con.execute("UPDATE events SET outcome = 'refused' WHERE seq = ?", (seq,))
    con.close()
    broken = runner.invoke(app, ["holder", "verify", "--ledger", str(ledger), "--config", str(folders["bob"])])
    assert broken.exit_code == 8 and f"row {seq}" in broken.output, broken.output
    # ... and still named when the forger rehashes the chain from it on: by the row hashes bob's receipt was given
    with sqlite3.connect(ledger) as con:
        prev = con.execute("SELECT hash FROM events WHERE seq = ?", (seq - 1,)).fetchone()[0]
        for values in con.execute("SELECT seq, ts, run_id, kind, phase, holder, epoch, key_fp, nbytes, duration_s, "
                                  "outcome, detail FROM events WHERE seq >= ? ORDER BY seq", (seq,)).fetchall():
            fields = dict(zip(("seq", "ts", "run_id", "kind", "phase", "holder", "epoch", "key_fp", "nbytes",
                               "duration_s", "outcome", "detail"), values, strict=True))
            digest = row_hash(prev, fields)
            con.execute("UPDATE events SET prev_hash = ?, hash = ? WHERE seq = ?", (prev, digest, fields["seq"]))
            prev = digest
    con.close()
    forged = runner.invoke(app, ["holder", "verify", "--ledger", str(ledger), "--config", str(folders["bob"])])
    assert forged.exit_code == 8, forged.output
    assert f"ledger row {seq} differs from the row returned after the visit" in forged.output, forged.output


@pytest.mark.process
async def test_a_holder_that_pins_another_mrtd_refuses_and_sends_nothing(
        tmp_path: Path, tap: list[tuple[str, FrameType, dict[str, Any]]]) -> None:
    out = tmp_path / "run"
    sim = sim_store.load_or_create(out / "platform")[2].parent
    pinned = tmp_path / "pinned" / "policy.toml"
    pinned.parent.mkdir()
    for f in ("gpu-root.crt", "rim-root.crt", "tdx-root.crt"):
        (pinned.parent / f).write_bytes((sim / f).read_bytes())
    pinned.write_text((sim / "sim-evidence.toml").read_text() + 'mr_td = ["' + "ab" * 48 + '"]\n')
    folders = _holders(tmp_path, out, bob={"policy": pinned, "accept_any_td": False})
    report = (await api.run(small_settings(None, out, transport="local", visit_attempts=1),
                           links=_links(folders))).to_json()
    by = {v["holder"]: v for v in report["visits"]}
    assert by["alice"]["outcome"] == "done"
    assert by["bob"]["outcome"] == "failed" and by["bob"]["bytes"] == 0
    assert by["bob"]["holder_attestation"]["failed_claim"] == "mr-td"
    assert [h for n, t, h in tap if t is FrameType.HANDOFF and n == "bob"] == []  # no key, wrapped or not
    assert read_receipts(folders["bob"] / "receipts") == []


@pytest.mark.process
async def test_conventional_is_refused_unless_allowed_and_then_never_plaintext(
        tmp_path: Path, tap: list[tuple[str, FrameType, dict[str, Any]]]) -> None:
    out = tmp_path / "run"
    folders = _holders(tmp_path, out, alice={"allow_conventional": True})
    chunks: list[dict[str, Any]] = []
    original = framed_link._BounceSealer.seal

    def seen(self: Any, holder: str, header: dict[str, Any], plain: Any) -> Any:
        chunks.append({**header, "_holder": holder, "_len": len(plain)})
        return original(self, holder, header, plain)

    import unittest.mock
    with unittest.mock.patch.object(framed_link._BounceSealer, "seal", seen):
        report = (await api.run(small_settings(None, out, transport="local", data_path="conventional",
                                               visit_attempts=1), links=_links(folders))).to_json()
    by = {v["holder"]: v for v in report["visits"]}
    assert by["alice"]["outcome"] == "done" and by["alice"]["bytes"] > 0
    assert by["bob"]["outcome"] == "failed" and by["bob"]["bytes"] == 0
    assert "conventional hand-off is refused" in str(by["bob"]["error"])
    assert chunks and all(c["_holder"] == "alice" for c in chunks)
    assert all(c.get("cv") == 1 and "plain" not in c and c["_len"] == c["n"] + 16 for c in chunks)  # sealed


@pytest.mark.process
@pytest.mark.parametrize("entry", ["agent", "serve"])
def test_an_agent_exits_0_after_bye_though_its_stdin_stays_open(entry: str, tmp_path: Path) -> None:
    """Issue 30 item 7: the agent used to abort at interpreter shutdown (SIGABRT on stdin's lock) when the
    orchestrator kept the link open after BYE."""
    import subprocess

    from gputravel.core.protocol import encode_frame, read_frame

    data = tmp_path / "data"
    write_holder(data, 5, WORDS, 200)
    folder = tmp_path / "config"
    init_config(data=data, folder=folder, accept_any_td=True)
    argv = ["-m", "gputravel.agents.holder", "--name", "x", "--data", str(data)] if entry == "agent" else \
        [*SERVE, str(folder)]
    proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        hello = read_frame(proc.stdout)
        assert hello is not None and hello.type is FrameType.HELLO
        proc.stdin.write(encode_frame(FrameType.BYE, {}))
        proc.stdin.flush()  # and the pipe stays open
        assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_a_bye_returns_a_holders_latest_whole_epochs_within_its_bound() -> None:
    """A long run's BYE stays within ``MAX_BYE_ROWS`` (a receiver refuses more): the latest epochs, whole."""
    from gputravel.core.protocol.holderlink import MAX_BYE_ROWS
    from gputravel.core.travel.audit import _latest

    epochs = {e: [(10 * e + k, f"{e:02x}" * 32) for k in range(10)] for e in range(1, 1001)}  # 10,000 rows
    kept = _latest(epochs, MAX_BYE_ROWS)
    assert sorted(kept) == list(range(1001 - MAX_BYE_ROWS // 10, 1001))
    assert all(len(rows) == 10 for rows in kept.values()) and sum(map(len, kept.values())) <= MAX_BYE_ROWS



def test_verify_says_its_ledger_is_required() -> None:
    """Session 15: `holder verify --help` showed --ledger as optional; only running it said it was required."""
    shown = runner.invoke(app, ["holder", "verify", "--help"], env={"COLUMNS": "160"})
    assert shown.exit_code == 0 and "required" in shown.output.split("--ledger", 1)[1].split("--config", 1)[0]
    missing = runner.invoke(app, ["holder", "verify"])
    assert missing.exit_code == 2 and "--ledger" in missing.output
