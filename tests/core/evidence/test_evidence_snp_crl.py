"""AMD's CRL (task policy16 item 3): ``cert-chain-not-revoked`` is checked when the policy names a CRL file (KDS's
``/vcek/v1/<product>/crl``, DER, signed by the ARK with RSASSA-PSS), and ``require_crl`` refuses a report without.

AMD's real CRL is not in the recorded evidence, and only AMD holds the ARK's key: the CRLs that must verify are
signed by a SIM chain's ARK (``sim_snp.SimSnp``, a named fake chain for this unit, RSASSA-PSS as AMD signs); with
the real Milan report and VCEK (tests/data), a CRL not signed by AMD's Milan ARK, though it names it as issuer,
is refused."""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import Encoding
from helpers import MILAN_REPORT as REPORT
from helpers import MILAN_VCEK as VCEK

from gputravel.core.evidence.policy import PolicyError, SnpPolicy, load_evidence_policy
from gputravel.core.evidence.sim_snp import SimSnp
from gputravel.core.evidence.snp import PSS_SHA384, amd_roots, verify_snp_report

AT = 1750331763  # 2025-06-19, inside the Milan VCEK's validity
NOW = dt.datetime.fromtimestamp(AT, dt.UTC)


def _crl(issuer: x509.Name, key: rsa.RSAPrivateKey, revoked: tuple[int, ...] = (), *, days: int = 7) -> bytes:
    builder = (x509.CertificateRevocationListBuilder().issuer_name(issuer)
               .last_update(NOW - dt.timedelta(days=1)).next_update(NOW + dt.timedelta(days=days)))
    for serial in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(NOW - dt.timedelta(hours=1)).build())
    return builder.sign(key, hashes.SHA384(), rsa_padding=PSS_SHA384).public_bytes(Encoding.DER)


@pytest.fixture(scope="module")
def sim() -> SimSnp:
    return SimSnp.generate()


def _policy(sim: SimSnp, folder: Path, crl: bytes | None, **kw: object) -> SnpPolicy:
    ark, ask = sim.roots_pem()
    (folder / "ark.crt").write_bytes(ark)
    (folder / "ask.crt").write_bytes(ask)
    if crl is not None:
        (folder / "amd.crl").write_bytes(crl)
    return dataclasses.replace(SnpPolicy(ark=folder / "ark.crt", ask=folder / "ask.crt",
                                         crl=folder / "amd.crl" if crl is not None else None), **kw)


def test_a_current_crl_signed_by_the_ark_clears_the_chain(sim: SimSnp, tmp_path: Path) -> None:
    assert sim.ark_key is not None
    policy = _policy(sim, tmp_path, _crl(sim.ark.subject, sim.ark_key, revoked=(12345,)), require_crl=True)
    verdict = verify_snp_report(sim.report(b""), sim.vcek_der(), policy=policy, now=AT)
    assert verdict.ok, verdict.reason
    assert verdict.checks["cert-chain-not-revoked"] is True and "cert-chain-not-revoked" not in verdict.not_checked


@pytest.mark.parametrize("which", ["vcek", "ask"])
def test_a_revoked_vcek_or_ask_is_refused_by_name(sim: SimSnp, tmp_path: Path, which: str) -> None:
    assert sim.ark_key is not None
    serial = (sim.vcek if which == "vcek" else sim.ask).serial_number
    policy = _policy(sim, tmp_path, _crl(sim.ark.subject, sim.ark_key, revoked=(serial,)))
    verdict = verify_snp_report(sim.report(b""), sim.vcek_der(), policy=policy, now=AT)
    assert not verdict.ok and verdict.failed == "cert-chain-not-revoked"
    assert f"the {which.upper()}" in verdict.reason and "is revoked since" in verdict.reason


def test_a_crl_past_its_next_update_is_refused(sim: SimSnp, tmp_path: Path) -> None:
    assert sim.ark_key is not None
    policy = _policy(sim, tmp_path, _crl(sim.ark.subject, sim.ark_key, days=7))
    verdict = verify_snp_report(sim.report(b""), sim.vcek_der(), policy=policy, now=AT + 30 * 86400)
    assert not verdict.ok and verdict.failed == "cert-chain-not-revoked"
    assert "fetch a current one" in verdict.reason and "kdsintf.amd.com/vcek/v1/Milan/crl" in verdict.reason


def test_a_crl_not_signed_by_the_real_milan_ark_is_refused(tmp_path: Path) -> None:
    """The real report and VCEK; a CRL naming AMD's Milan ARK as issuer, signed by another key."""
    ark = amd_roots("milan")[0]
    forged = _crl(ark.subject, rsa.generate_private_key(public_exponent=65537, key_size=2048))
    (tmp_path / "milan.crl").write_bytes(forged)
    verdict = verify_snp_report(REPORT, VCEK, policy=SnpPolicy(crl=tmp_path / "milan.crl"), now=AT)
    assert not verdict.ok and verdict.failed == "cert-chain-not-revoked"
    assert "does not verify with the pinned ARK 'ARK-Milan'" in verdict.reason
    sim = SimSnp.generate()  # a CRL by another issuer altogether
    assert sim.ark_key is not None
    (tmp_path / "other.crl").write_bytes(_crl(sim.ark.subject, sim.ark_key))
    other = verify_snp_report(REPORT, VCEK, policy=SnpPolicy(crl=tmp_path / "other.crl"), now=AT)
    assert other.failed == "cert-chain-not-revoked" and "not by the pinned ARK" in other.reason
    (tmp_path / "junk.crl").write_bytes(b"not a crl")
    junk = verify_snp_report(REPORT, VCEK, policy=SnpPolicy(crl=tmp_path / "junk.crl"), now=AT)
    assert junk.failed == "cert-chain-not-revoked" and "not a CRL" in junk.reason


def test_without_a_crl_require_crl_refuses_and_the_default_names_the_waiver() -> None:
    waived = verify_snp_report(REPORT, VCEK, now=AT)
    assert waived.ok and "require_crl = false" in waived.not_checked["cert-chain-not-revoked"]
    required = verify_snp_report(REPORT, VCEK, policy=SnpPolicy(require_crl=True), now=AT)
    assert not required.ok and required.failed == "cert-chain-not-revoked"
    assert "require_crl = true" in required.reason and "[amd-snp] crl" in required.reason


def test_the_policy_file_names_the_crl_relative_to_itself(tmp_path: Path) -> None:
    (tmp_path / "amd.crl").write_bytes(b"x")
    (tmp_path / "p.toml").write_text('[amd-snp]\ncrl = "amd.crl"\nrequire_crl = true\n')
    policy = load_evidence_policy(tmp_path / "p.toml")
    assert policy.snp.crl == (tmp_path / "amd.crl").resolve() and policy.snp.require_crl is True
    (tmp_path / "q.toml").write_text('[amd-snp]\ncrl = "missing.crl"\n')
    with pytest.raises(PolicyError, match="no CRL file"):
        load_evidence_policy(tmp_path / "q.toml")
    (tmp_path / "r.toml").write_text('[amd-snp]\nrequire_crl = "yes"\n')
    with pytest.raises(PolicyError, match="require_crl must be true or false"):
        load_evidence_policy(tmp_path / "r.toml")
