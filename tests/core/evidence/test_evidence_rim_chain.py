"""The forged-RIM hole (issue 31): a RIM whose own chain does not reach NVIDIA's pinned root through NVIDIA's issuer
levels, each signature checked, is refused on both ``-rim-cert-chain`` (claims 2.0: ``-rim-cert-validated``) and ``-rim-signature-verified``.

Before, the chain's top was replaced by the pinned root, so a one-certificate chain with a self-made certificate
became "the pinned root alone" and the XML signature was checked with the attacker's key: golden values could be
forged. NVIDIA's verifier (2.7.3) appends its root and has signxml check the signer against it; both refuse."""

from __future__ import annotations

import datetime as dt

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from evidence_samples import (  # noqa: F401 (the *_fixture names are pytest fixtures)
    RIM_VALID_AT,
    NvidiaSample,
    make_rim_signer,
    nv_wheel_fixture,
    resign_rim,
    sample_fixture,
)

from gputravel.core.evidence.nvidia_rim import NVIDIA_RIM_LEVELS, rim_root, verify_rim
from gputravel.core.evidence.sim_rim import make_rim

P = "x-nvidia-gpu-driver-rim"
GOLDEN = {0: [b"\x01" * 48], 1: [b"\x02" * 48]}


def _cert(cn: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name | None,
          issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    start = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    return (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start)
            .not_valid_after(start + dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .sign(issuer_key, hashes.SHA384()))


def test_a_one_certificate_chain_with_a_self_made_certificate_is_refused() -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    forged = make_rim("550.90.07", GOLDEN, [_cert("HCC RIM L4 Signer", key, None, key, ca=False)], key)
    claims, rim = verify_rim(forged, expected_version="550.90.07", at=RIM_VALID_AT)
    assert rim is None
    assert claims[f"{P}-cert-chain"].ok is False and "at least 4" in claims[f"{P}-cert-chain"].detail
    assert claims[f"{P}-signature-verified"].ok is False


def test_a_self_made_chain_topped_with_nvidias_root_is_refused() -> None:
    keys = [ec.generate_private_key(ec.SECP384R1()) for _ in range(3)]
    ca = _cert("NVIDIA Reference Value GH100 CA", keys[0], rim_root().subject, keys[0], ca=True)  # not NVIDIA's key
    l3 = _cert("NVIDIA Reference Value L3 GH100 001", keys[1], ca.subject, keys[0], ca=True)
    leaf = _cert("HCC RIM L4 Signer", keys[2], l3.subject, keys[1], ca=False)
    forged = make_rim("550.90.07", GOLDEN, [leaf, l3, ca, rim_root()], keys[2])
    claims, rim = verify_rim(forged, expected_version="550.90.07", at=RIM_VALID_AT)
    assert rim is None
    assert claims[f"{P}-cert-chain"].ok is False and "not signed by" in claims[f"{P}-cert-chain"].detail
    assert claims[f"{P}-signature-verified"].ok is False


def test_a_chain_without_the_pinned_root_on_top_is_refused_under_a_test_root(sample: NvidiaSample) -> None:
    signer = make_rim_signer()
    key = ec.generate_private_key(ec.SECP384R1())
    forged = make_rim("550.90.07", GOLDEN, [_cert("self", key, None, key, ca=False)], key)
    claims, rim = verify_rim(forged, expected_version="550.90.07", root=signer.root, at=RIM_VALID_AT)
    assert rim is None and claims[f"{P}-signature-verified"].ok is False
    genuine = resign_rim(sample.driver_rim, signer, version="550.90.07", values={})
    claims, rim = verify_rim(genuine, expected_version="550.90.07", root=signer.root)
    assert rim is not None and claims[f"{P}-signature-verified"].ok is True


def test_nvidias_own_rim_chain_has_nvidias_levels_and_verifies(sample: NvidiaSample) -> None:
    claims, rim = verify_rim(sample.vbios_rim, expected_version="96.00.5E.00.01", at=RIM_VALID_AT)
    p = "x-nvidia-gpu-vbios-rim"
    chain = claims[f"{p}-cert-chain"]
    assert chain.value["x-nvidia-cert-status"] == "valid" and f"{NVIDIA_RIM_LEVELS} certificates" in chain.detail
    assert claims[f"{p}-signature-verified"].ok is True and rim is not None and rim.ok
