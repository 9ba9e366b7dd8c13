"""Attestation: the emulated vendor PKI, evidence, the verifier's claims, injected faults and the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from typer.testing import CliRunner

from gputravel.console.cli.main import app
from gputravel.core.attestation import (
    EMULATED_DRIVER,
    EMULATED_FIRMWARE,
    INJECTIONS,
    CCMode,
    DeviceIdentity,
    Evidence,
    Measurements,
    Policy,
    VendorCA,
    code_measurement,
    load_policy,
    make_evidence,
    provision_emulated,
    run_emulated_attestation,
    verify_evidence,
)
from gputravel.core.attestation.evidence import Report
from gputravel.core.attestation.inject import TARGET, Injection, stage_emulated_attestation
from gputravel.core.attestation.verify import (
    CHECKS,
    CLAIM_NAMES,
    ClaimCheck,
    ClaimFailed,
    VerifyContext,
    verify_context,
)
from gputravel.core.errors import AttestationError, ConfigError
from gputravel.core.files import InsecureKeyError

CODE = "c0de" * 16
MEASUREMENTS = Measurements(firmware=EMULATED_FIRMWARE, driver=EMULATED_DRIVER, code=CODE)
POLICY = Policy(firmware=EMULATED_FIRMWARE, driver=EMULATED_DRIVER, code=CODE)
NONCE = bytes(range(32))


@dataclasses.dataclass
class Pki:
    state_dir: Path
    ca: VendorCA
    identity: DeviceIdentity


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    state_dir = tmp_path_factory.mktemp("attest-state")
    ca, identity = provision_emulated(state_dir)
    return Pki(state_dir, ca, identity)


def _evidence(identity: DeviceIdentity, **overrides: object) -> Evidence:
    kwargs: dict[str, object] = {"nonce": NONCE, "measurements": MEASUREMENTS, "cc_mode": CCMode.ON}
    kwargs.update(overrides)
    return make_evidence(identity, **kwargs)  # type: ignore[arg-type]


def _verify(pki: Pki, evidence: Evidence, **overrides: object):
    kwargs: dict[str, object] = {
        "nonce": NONCE, "root": pki.ca.root, "crl": pki.ca.crl(), "policy": POLICY,
    }
    kwargs.update(overrides)
    return verify_evidence(evidence, **kwargs)  # type: ignore[arg-type]


def _failed(result) -> set[str]:
    return {c.name for c in result.claims if not c.ok}


# --- the good path -----------------------------------------------------------------------------------
def test_good_evidence_passes_every_claim_and_issues_an_expiring_token(pki: Pki) -> None:
    now = time.time()
    result = _verify(pki, _evidence(pki.identity, timestamp=now), now=now, verifier_secret=b"s" * 32)

    assert [c.name for c in result.claims] == [
        "chain", "revocation", "signature", "nonce", "measurements", "mode", "overall",
    ]
    assert all(c.ok for c in result.claims) and result.ok
    assert result.device_id == "emu-gpu-0" and result.cc_mode is CCMode.ON
    assert result.measurements == MEASUREMENTS
    assert result.device_public_key == pki.identity.key.public_key()
    token = result.token
    assert token is not None
    assert token.verify(b"s" * 32, now=now + 1)
    assert not token.verify(b"x" * 32, now=now + 1)
    assert token.expires_at == pytest.approx(now + POLICY.token_ttl_s)
    assert not token.is_valid(token.expires_at + 1)
    result.raise_for_failure()  # returns quietly


def test_run_emulated_attestation_passes_with_the_default_policy(tmp_path: Path) -> None:
    result = run_emulated_attestation(tmp_path)

    assert result.ok and result.token is not None and result.platform == "emulated"


def test_provisioning_is_idempotent(pki: Pki) -> None:
    ca, identity = provision_emulated(pki.state_dir)

    assert ca.root == pki.ca.root
    assert identity.leaf == pki.identity.leaf


# --- injected faults -----------------------------------------------------------------------------------
EXPECTED_FAILURE = {
    "revoked-cert": "revocation",
    "bad-chain": "chain",
    "stale-nonce": "nonce",
    "measurement-mismatch": "measurements",
    "devtools": "mode",
}


@pytest.mark.parametrize("inject", INJECTIONS)
def test_each_injection_fails_exactly_its_claim_and_overall(pki: Pki, inject: str) -> None:
    result = run_emulated_attestation(pki.state_dir, inject=inject)

    assert _failed(result) == {EXPECTED_FAILURE[inject], "overall"}
    assert not result.ok and result.token is None and result.device_public_key is None
    with pytest.raises(AttestationError, match=EXPECTED_FAILURE[inject]):
        result.raise_for_failure()


def test_injections_leave_the_persisted_pki_untouched(pki: Pki) -> None:
    before = {p.name: p.read_bytes() for p in (pki.state_dir / "device").iterdir()}
    before_ca = VendorCA.load(pki.state_dir / "vendor")
    for inject in INJECTIONS:
        run_emulated_attestation(pki.state_dir, inject=inject)

    assert {p.name: p.read_bytes() for p in (pki.state_dir / "device").iterdir()} == before
    assert VendorCA.load(pki.state_dir / "vendor").revoked_serials == before_ca.revoked_serials == frozenset()
    assert run_emulated_attestation(pki.state_dir).ok


def test_unknown_injection_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown injection"):
        run_emulated_attestation(tmp_path, inject="melt-the-gpu")


def test_revoked_device_certificate_fails_revocation(pki: Pki) -> None:
    ca = VendorCA.load(pki.state_dir / "vendor")
    ca.revoke(pki.identity.leaf.serial_number)

    result = _verify(pki, _evidence(pki.identity), crl=ca.crl())

    assert _failed(result) == {"revocation", "overall"}
    assert "revoked" in result.claim("revocation").detail


def test_missing_crl_fails_revocation(pki: Pki) -> None:
    result = _verify(pki, _evidence(pki.identity), crl=None)

    assert _failed(result) == {"revocation", "overall"}


def test_crl_signed_by_another_root_fails_revocation(pki: Pki) -> None:
    result = _verify(pki, _evidence(pki.identity), crl=VendorCA.generate().crl())

    assert _failed(result) == {"revocation", "overall"}


def test_fake_device_certificate_from_a_rogue_root_fails_chain(pki: Pki) -> None:
    rogue = VendorCA.generate(pki.ca.name).issue_device(pki.identity.device_id)

    result = _verify(pki, _evidence(rogue))

    assert _failed(result) == {"chain", "overall"}
    assert "pinned" in result.claim("chain").detail


def test_rogue_leaf_spliced_into_the_genuine_chain_fails_chain(pki: Pki) -> None:
    rogue = VendorCA.generate(pki.ca.name).issue_device(pki.identity.device_id)
    spliced = DeviceIdentity(rogue.device_id, rogue.key, (rogue.leaf, pki.ca.ca_cert, pki.ca.root))

    result = _verify(pki, _evidence(spliced))

    assert _failed(result) == {"chain", "overall"}
    assert "device CA" in result.claim("chain").detail


def test_old_nonce_fails_nonce(pki: Pki) -> None:
    result = _verify(pki, _evidence(pki.identity, nonce=b"\x01" * 32))

    assert _failed(result) == {"nonce", "overall"}
    assert "fresh nonce" in result.claim("nonce").detail


def test_report_older_than_max_age_fails_nonce(pki: Pki) -> None:
    now = time.time()
    evidence = _evidence(pki.identity, timestamp=now - POLICY.max_report_age_s - 1)

    result = _verify(pki, evidence, now=now)

    assert _failed(result) == {"nonce", "overall"}
    assert "old" in result.claim("nonce").detail


def test_firmware_mismatch_fails_measurements_and_names_firmware(pki: Pki) -> None:
    tampered = dataclasses.replace(MEASUREMENTS, firmware="ff" * 32)

    result = _verify(pki, _evidence(pki.identity, measurements=tampered))

    assert _failed(result) == {"measurements", "overall"}
    detail = result.claim("measurements").detail
    assert "firmware" in detail and "driver" not in detail and "code" not in detail


def test_devtools_mode_fails_mode(pki: Pki) -> None:
    result = _verify(pki, _evidence(pki.identity, cc_mode=CCMode.DEVTOOLS))

    assert _failed(result) == {"mode", "overall"}
    assert result.cc_mode is CCMode.DEVTOOLS


# --- tampering and garbage -------------------------------------------------------------------------------
def test_tampered_report_byte_fails_signature(pki: Pki) -> None:
    evidence = _evidence(pki.identity)
    report = bytearray(evidence.report)
    i = report.index(b'"on"') + 1
    report[i:i + 2] = b"of"  # "on" -> "of": still JSON, no longer signed
    tampered = dataclasses.replace(evidence, report=bytes(report))

    result = _verify(pki, tampered)

    assert not result.claim("signature").ok and not result.ok
    assert result.claim("chain").ok


def test_garbage_chain_fails_closed_without_raising(pki: Pki) -> None:
    evidence = dataclasses.replace(_evidence(pki.identity), chain_pem=(b"not a certificate", b"", b"\x00" * 7))

    result = _verify(pki, evidence)

    assert {"chain", "revocation", "signature", "overall"} <= _failed(result)
    assert not result.ok and result.token is None and result.device_public_key is None


def test_garbage_report_fails_closed_without_raising(pki: Pki) -> None:
    evidence = dataclasses.replace(_evidence(pki.identity), report=b"\xff{not json", signature=b"junk")

    result = _verify(pki, evidence)

    assert {"signature", "nonce", "measurements", "mode", "overall"} <= _failed(result)
    assert result.claim("chain").ok and not result.ok


def test_evidence_round_trips_through_json(pki: Pki) -> None:
    evidence = _evidence(pki.identity)

    again = Evidence.from_dict(json.loads(json.dumps(evidence.to_dict())))

    assert again == evidence and again.digest() == evidence.digest()
    assert _verify(pki, again).ok


def test_malformed_evidence_dict_raises_attestation_error() -> None:
    with pytest.raises(AttestationError, match="malformed evidence"):
        Evidence.from_dict({"report": "!!", "signature": "", "chain_pem": []})


# --- policy ------------------------------------------------------------------------------------------------
def test_default_policy_is_the_emulated_reference_manifest() -> None:
    policy = load_policy()

    assert (policy.firmware, policy.driver, policy.code) == (EMULATED_FIRMWARE, EMULATED_DRIVER, "auto")
    assert policy.allowed_modes == (CCMode.ON,)
    assert policy.expected(code=CODE).code == CODE


def _policy_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return path


GOOD_POLICY = f'firmware = "{EMULATED_FIRMWARE}"\ndriver = "{EMULATED_DRIVER}"\ncode = "auto"\n'


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (GOOD_POLICY + 'colour = "blue"\n', "colour"),
        (f'firmware = "{EMULATED_FIRMWARE}"\ncode = "auto"\n', "driver"),
        (GOOD_POLICY.replace(EMULATED_DRIVER, "xyz"), "driver"),
        (GOOD_POLICY.replace('"auto"', '"' + "0" * 63 + '"'), "code"),
        (GOOD_POLICY + 'allowed_modes = ["on", "maybe"]\n', "allowed_modes"),
        (GOOD_POLICY + "max_report_age_s = \"soon\"\n", "max_report_age_s"),
        (GOOD_POLICY + "token_ttl_s = -5\n", "token_ttl_s"),
    ],
    ids=["unknown-key", "missing-key", "bad-hex", "short-hex", "bad-mode", "wrong-type", "negative"],
)
def test_policy_errors_raise_config_error_naming_the_key(tmp_path: Path, text: str, names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        load_policy(_policy_file(tmp_path, text))


def test_policy_file_with_explicit_values_loads(tmp_path: Path) -> None:
    policy = load_policy(_policy_file(tmp_path, GOOD_POLICY + 'allowed_modes = ["on", "devtools"]\n'))

    assert policy.allowed_modes == (CCMode.ON, CCMode.DEVTOOLS)
    assert policy.max_report_age_s == 60.0


# --- code measurement ---------------------------------------------------------------------------------------
def test_code_measurement_depends_on_names_and_contents_not_location(tmp_path: Path) -> None:
    def tree(root: Path, body: str, name: str = "a.py") -> Path:
        (root / "pkg").mkdir(parents=True)
        (root / "pkg" / name).write_text(body)
        (root / "pkg" / "b.py").write_text("y = 2\n")
        return root / "pkg"

    one = code_measurement([tree(tmp_path / "one", "x = 1\n")])
    two = code_measurement([tree(tmp_path / "two", "x = 1\n")])
    changed = code_measurement([tree(tmp_path / "three", "x = 3\n")])
    renamed = code_measurement([tree(tmp_path / "four", "x = 1\n", name="c.py")])

    assert one == two
    assert len({one, changed, renamed}) == 3
    assert len(code_measurement()) == 64


def test_code_measurement_of_a_missing_path_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        code_measurement([tmp_path / "nope.py"])


# --- secrets on disk and in output ----------------------------------------------------------------------------
def test_private_key_files_are_0600(pki: Pki) -> None:
    for path in (pki.state_dir / "vendor" / "root.key", pki.state_dir / "vendor" / "ca.key",
                 pki.state_dir / "device" / "key.pem"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path


@pytest.mark.parametrize(("rel", "mode", "who"), [
    ("device/key.pem", 0o644, "world"), ("device/key.pem", 0o640, "group"), ("device/key.pem", 0o602, "world"),
    ("vendor/ca.key", 0o604, "world"), ("vendor/root.key", 0o660, "group"),
])
def test_a_private_key_others_can_read_is_refused_naming_the_file(tmp_path: Path, rel: str, mode: int,
                                                                  who: str) -> None:
    """Like the checkpoint key: a group- or world-readable identity or vendor CA key is not used."""
    provision_emulated(tmp_path)
    path = tmp_path / rel
    path.chmod(mode)

    with pytest.raises(InsecureKeyError) as info:
        provision_emulated(tmp_path)
    message = str(info.value)
    assert str(path) in message and f"{who}-readable" in message and f"chmod 600 {path}" in message
    assert isinstance(info.value, ConfigError) and info.value.exit_code == ConfigError.exit_code
    with pytest.raises(InsecureKeyError, match="chmod 600"):
        run_emulated_attestation(tmp_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode  # refused, not silently fixed

    path.chmod(0o600)  # 0600 is accepted again
    assert run_emulated_attestation(tmp_path).ok


def test_the_device_identity_key_must_be_a_regular_file(tmp_path: Path) -> None:
    provision_emulated(tmp_path)
    key = tmp_path / "device" / "key.pem"
    key.unlink()
    os.mkfifo(key, 0o600)  # would block a plain read

    with pytest.raises(ConfigError, match="not a regular file"):
        DeviceIdentity.load(tmp_path / "device")


def test_cli_attest_refuses_a_world_readable_identity_key(tmp_path: Path) -> None:
    provision_emulated(tmp_path)
    (tmp_path / "device" / "key.pem").chmod(0o644)

    out = CliRunner().invoke(app, ["attest", "--json", "--state-dir", str(tmp_path)])

    # the CLI reports it as "error: InsecureKeyError: ..." (the JSON error object under --json), exit 2
    assert out.exit_code == InsecureKeyError.exit_code == 2
    error = json.loads(out.stdout)["error"]
    assert error["type"] == "InsecureKeyError" and "chmod 600" in error["message"]


def test_result_dict_and_reprs_hold_no_private_key_material(pki: Pki) -> None:
    result = _verify(pki, _evidence(pki.identity))
    text = json.dumps(result.to_dict()) + repr(result) + repr(pki.identity) + repr(pki.ca)

    for key in (pki.identity.key, pki.ca.root_key, pki.ca.ca_key):
        der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        secret = key.private_numbers().private_value
        assert "PRIVATE KEY" not in text
        assert der.hex() not in text and format(secret, "x") not in text and str(secret) not in text
    assert result.to_dict()["device_key_fingerprint"] == pki.identity.fingerprint()


# --- CLI ----------------------------------------------------------------------------------------------------
def test_cli_attest_json_passes_and_says_it_is_simulated(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["attest", "--json", "--state-dir", str(tmp_path)])

    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["platform"] == {"kind": "emulated", "sim": True, "label": "SIM"}
    assert doc["ok"] is True and doc["token"] is not None
    assert all(c["ok"] for c in doc["claims"].values())


def test_cli_attest_with_revoked_cert_exits_3(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["attest", "--inject", "revoked-cert", "--state-dir", str(tmp_path)])

    assert out.exit_code == AttestationError.exit_code == 3
    assert "SIM" in out.output and "revoked" in out.output


def test_cli_attest_with_bad_policy_is_a_config_error(tmp_path: Path) -> None:
    bad = _policy_file(tmp_path, 'colour = "blue"\n')

    out = CliRunner().invoke(app, ["attest", "--state-dir", str(tmp_path / "s"), "--policy", str(bad)])

    assert out.exit_code == ConfigError.exit_code and "ConfigError" in out.output


# --- one check per claim ------------------------------------------------------------------------------------
def _failing_checks(ctx: VerifyContext) -> dict[str, str]:
    """Call every check function directly (not through verify_evidence): the claims that fail, with why."""
    failing: dict[str, str] = {}
    for check in CHECKS:
        try:
            detail = check.check(ctx)
        except ClaimFailed as exc:
            failing[check.name] = str(exc)
        else:
            assert isinstance(detail, str) and detail, check.name
    return failing


def _context(pki: Pki, evidence: Evidence, **overrides: object) -> VerifyContext:
    kwargs: dict[str, object] = {"nonce": NONCE, "root": pki.ca.root, "crl": pki.ca.crl(), "policy": POLICY}
    kwargs.update(overrides)
    return verify_context(evidence, **kwargs)  # type: ignore[arg-type]


def test_the_check_table_is_the_claim_order_that_attest_prints() -> None:
    assert [c.name for c in CHECKS] + ["overall"] == list(CLAIM_NAMES) == [
        "chain", "revocation", "signature", "nonce", "measurements", "mode", "overall",
    ]
    assert [c.name for c in CHECKS] == [f.__name__.removeprefix("check_") for f in (c.check for c in CHECKS)]


def test_every_check_passes_on_good_evidence(pki: Pki) -> None:
    assert _failing_checks(_context(pki, _evidence(pki.identity))) == {}


@pytest.mark.parametrize("inject", INJECTIONS)
def test_each_injection_fails_exactly_its_own_check_function(pki: Pki, inject: str) -> None:
    staged = stage_emulated_attestation(pki.state_dir, inject=inject)

    failing = _failing_checks(staged.context())

    assert set(failing) == {EXPECTED_FAILURE[inject]} == {TARGET[Injection(inject)]}
    result = staged.verify()
    assert [c.name for c in result.claims if not c.ok] == [EXPECTED_FAILURE[inject], "overall"]
    assert result.claim(EXPECTED_FAILURE[inject]).detail == failing[EXPECTED_FAILURE[inject]]


def test_an_uninjected_staged_attestation_passes_every_check(pki: Pki) -> None:
    staged = stage_emulated_attestation(pki.state_dir)

    assert _failing_checks(staged.context()) == {}
    assert staged.verify().ok


def _signed_by_a_rogue_key(pki: Pki) -> Evidence:
    evidence = _evidence(pki.identity)
    rogue = VendorCA.generate(pki.ca.name).issue_device(pki.identity.device_id)
    return dataclasses.replace(evidence, signature=rogue.sign(evidence.report))


ISOLATED_FAULTS = {
    "chain": lambda pki: _context(pki, _evidence(VendorCA.generate(pki.ca.name).issue_device("emu-gpu-0"))),
    "revocation": lambda pki: _context(pki, _evidence(pki.identity), crl=None),
    "signature": lambda pki: _context(pki, _signed_by_a_rogue_key(pki)),
    "nonce": lambda pki: _context(pki, _evidence(pki.identity), nonce=b"\x02" * 32),
    "measurements": lambda pki: _context(pki, _evidence(pki.identity),
                                         policy=dataclasses.replace(POLICY, driver="dd" * 32)),
    "mode": lambda pki: _context(pki, _evidence(pki.identity),
                                 policy=dataclasses.replace(POLICY, allowed_modes=(CCMode.DEVTOOLS,))),
}


@pytest.mark.parametrize("claim", list(ISOLATED_FAULTS))
def test_each_check_catches_its_own_claim_failing_in_isolation(pki: Pki, claim: str) -> None:
    ctx = ISOLATED_FAULTS[claim](pki)

    failing = _failing_checks(ctx)

    assert list(failing) == [claim]
    claims = [check.run(ctx) for check in CHECKS]
    assert [c.name for c in claims if not c.ok] == [claim]
    assert next(c for c in claims if not c.ok).detail == failing[claim]


def test_a_check_that_raises_anything_else_fails_its_claim_closed(pki: Pki) -> None:
    def broken(ctx: VerifyContext) -> str:
        return str(1 // 0)

    claim = ClaimCheck("broken", broken).run(_context(pki, _evidence(pki.identity)))

    assert (claim.name, claim.ok) == ("broken", False)
    assert claim.detail == "ZeroDivisionError: integer division or modulo by zero"


def test_an_unreadable_report_fails_every_check_that_reads_it_with_the_parse_error(pki: Pki) -> None:
    evidence = dataclasses.replace(_evidence(pki.identity), report=b"[1, 2]")

    failing = _failing_checks(_context(pki, evidence))

    assert failing == {name: "report is not a JSON object" for name in ("nonce", "measurements", "mode")} | {
        "signature": "report signature does not verify under the device key"}


def test_the_report_format_round_trips_through_its_one_reader(pki: Pki) -> None:
    evidence = _evidence(pki.identity, timestamp=1234.5)

    report = Report.parse(evidence.report)

    assert (report.device_id, report.nonce, report.measurements, report.cc_mode, report.timestamp) == (
        "emu-gpu-0", NONCE, MEASUREMENTS, CCMode.ON, 1234.5)
    assert report.to_bytes() == evidence.report
    with pytest.raises(AttestationError, match="canonical"):
        Report.parse(evidence.report.replace(b",", b", ", 1))
