"""The emulated vendor PKI: root CA, device CA, revocation list, and the device identity it certifies.

Chain: vendor root (self-signed) -> device CA -> device leaf, all ECDSA P-384 with SHA-384. Private
keys are written 0600 and read only from files others cannot read; they are never printed or
logged, only their ``fingerprint``s are.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gputravel.core.errors import ConfigError
from gputravel.core.files import read_private, write_atomic
from gputravel.core.protocol.keys import fingerprint

__all__ = [
    "CURVE",
    "SIG_HASH",
    "DeviceIdentity",
    "VendorCA",
    "common_name",
    "ec_public",
    "fingerprint",
    "provision_emulated",
    "public_key_fingerprint",
]

CURVE = ec.SECP384R1
"""The curve of every key in the PKI (root, device CA, device identity)."""
SIG_HASH = hashes.SHA384
"""The hash of every ECDSA signature: certificates, CRLs and attestation reports."""


def public_key_fingerprint(key: ec.EllipticCurvePublicKey) -> str:
    """``fingerprint`` of a public key's DER SubjectPublicKeyInfo."""
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return fingerprint(der)


def ec_public(cert: x509.Certificate) -> ec.EllipticCurvePublicKey:
    """The certificate's P-384 public key; ``ValueError`` for any other key."""
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, CURVE):
        raise ValueError("certificate key is not P-384")
    return key


def common_name(cert: x509.Certificate) -> str:
    """The subject's single common name (the device id of a leaf); ``ValueError`` otherwise."""
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(attrs) != 1:
        raise ValueError("certificate subject has no single common name")
    return str(attrs[0].value)


# --- files -----------------------------------------------------------------------------------------
def _write_file(path: Path, data: bytes, *, private: bool = False) -> None:
    """Write atomically; private files are created 0600 and never exist with a wider mode."""
    write_atomic(path, data, mode=0o600 if private else 0o644)


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_key(path: Path, what: str) -> ec.EllipticCurvePrivateKey:
    """The P-384 key at ``path``; ``InsecureKeyError`` if others can read the file (like the checkpoint key)."""
    try:
        key = serialization.load_pem_private_key(read_private(path, what=what), password=None)
    except (ValueError, TypeError):
        raise ConfigError(f"{path} is not a PEM private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, CURVE):
        raise ConfigError(f"{path} is not a P-384 EC private key")
    return key


def _load_certs(path: Path) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(_read_file(path))
    except ValueError:
        raise ConfigError(f"{path} does not hold PEM certificates") from None


def _single_cert(path: Path) -> x509.Certificate:
    certs = _load_certs(path)
    if len(certs) != 1:
        raise ConfigError(f"{path} must hold exactly one certificate")
    return certs[0]


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _load_revoked(crl_path: Path, root_cert: x509.Certificate) -> dict[int, dt.datetime]:
    """The revocation list ``save`` wrote, checked against the root; empty when there is none."""
    if not crl_path.exists():
        return {}
    try:
        crl = x509.load_pem_x509_crl(_read_file(crl_path))
    except ValueError:
        raise ConfigError(f"{crl_path} is not a PEM CRL") from None
    if not crl.is_signature_valid(ec_public(root_cert)):
        raise ConfigError(f"{crl_path} is not signed by the vendor root")
    return {r.serial_number: r.revocation_date_utc for r in crl}


# --- certificates ----------------------------------------------------------------------------------
def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _name(common_name: str, org: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign,
        encipher_only=False, decipher_only=False,
    )


def _issue(
    *,
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    ca: bool,
    path_length: int | None,
    years: int,
) -> x509.Certificate:
    now = _now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=365 * years))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=path_length), critical=True)
        .add_extension(_key_usage(cert_sign=ca), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
    )
    return builder.sign(issuer_key, SIG_HASH())


# --- vendor PKI ------------------------------------------------------------------------------------
class VendorCA:
    """The emulated vendor PKI: a self-signed root, a device CA under it, and the revocation list.

    ``revoke`` changes this object only; ``save`` persists it.
    """

    __slots__ = ("name", "root_key", "root_cert", "ca_key", "ca_cert", "_revoked")

    def __init__(
        self,
        *,
        name: str,
        root_key: ec.EllipticCurvePrivateKey,
        root_cert: x509.Certificate,
        ca_key: ec.EllipticCurvePrivateKey,
        ca_cert: x509.Certificate,
        revoked: Mapping[int, dt.datetime] | None = None,
    ) -> None:
        self.name = name
        self.root_key = root_key
        self.root_cert = root_cert
        self.ca_key = ca_key
        self.ca_cert = ca_cert
        self._revoked: dict[int, dt.datetime] = dict(revoked or {})

    def __repr__(self) -> str:
        return f"VendorCA(name={self.name!r}, root={public_key_fingerprint(self.root_key.public_key())})"

    @property
    def root(self) -> x509.Certificate:
        """The root certificate verifiers pin."""
        return self.root_cert

    @property
    def revoked_serials(self) -> frozenset[int]:
        return frozenset(self._revoked)

    @classmethod
    def generate(cls, name: str = "Emulated GPU Vendor") -> VendorCA:
        """Create a fresh root CA and device CA (P-384, ECDSA-SHA384)."""
        root_key = ec.generate_private_key(CURVE())
        root_name = _name(f"{name} Root CA", name)
        root_cert = _issue(
            subject=root_name, public_key=root_key.public_key(), issuer=root_name, issuer_key=root_key,
            ca=True, path_length=1, years=20,
        )
        ca_key = ec.generate_private_key(CURVE())
        ca_cert = _issue(
            subject=_name(f"{name} Device CA", name), public_key=ca_key.public_key(), issuer=root_name,
            issuer_key=root_key, ca=True, path_length=0, years=15,
        )
        return cls(name=name, root_key=root_key, root_cert=root_cert, ca_key=ca_key, ca_cert=ca_cert)

    def issue_device(self, device_id: str) -> DeviceIdentity:
        """Generate a device identity key and certify it under the device CA."""
        if not device_id or not device_id.isprintable():
            raise ConfigError("device_id must be a non-empty printable string")
        key = ec.generate_private_key(CURVE())
        leaf = _issue(
            subject=_name(device_id, self.name), public_key=key.public_key(), issuer=self.ca_cert.subject,
            issuer_key=self.ca_key, ca=False, path_length=None, years=10,
        )
        return DeviceIdentity(device_id=device_id, key=key, chain=(leaf, self.ca_cert, self.root_cert))

    def revoke(self, serial: int) -> None:
        """Put a certificate serial on the revocation list (in memory until ``save``)."""
        self._revoked.setdefault(serial, _now())

    def crl(self) -> x509.CertificateRevocationList:
        """A fresh CRL signed by the root; it stands for the vendor's OCSP service."""
        now = _now()
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.root_cert.subject)
            .last_update(now - dt.timedelta(minutes=1))
            .next_update(now + dt.timedelta(days=1))
        )
        for serial, when in sorted(self._revoked.items()):
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build()
            )
        return builder.sign(self.root_key, SIG_HASH())

    def save(self, directory: Path) -> None:
        """Write root/device-CA certificates, their keys (0600) and the CRL as PEM files."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        _write_file(directory / "root.pem", _cert_pem(self.root_cert))
        _write_file(directory / "root.key", _key_pem(self.root_key), private=True)
        _write_file(directory / "ca.pem", _cert_pem(self.ca_cert))
        _write_file(directory / "ca.key", _key_pem(self.ca_key), private=True)
        _write_file(directory / "crl.pem", self.crl().public_bytes(serialization.Encoding.PEM))

    @classmethod
    def load(cls, directory: Path) -> VendorCA:
        """Read what ``save`` wrote; raises ``ConfigError`` naming the file that is missing or bad."""
        directory = Path(directory)
        root_cert = _single_cert(directory / "root.pem")
        ca_cert = _single_cert(directory / "ca.pem")
        root_key = _load_key(directory / "root.key", "vendor root CA key")
        ca_key = _load_key(directory / "ca.key", "vendor device-CA key")
        if root_key.public_key() != root_cert.public_key() or ca_key.public_key() != ca_cert.public_key():
            raise ConfigError(f"{directory}: a CA key does not match its certificate")
        revoked = _load_revoked(directory / "crl.pem", root_cert)
        orgs = root_cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
        name = str(orgs[0].value) if orgs else "Emulated GPU Vendor"
        return cls(name=name, root_key=root_key, root_cert=root_cert, ca_key=ca_key, ca_cert=ca_cert,
                   revoked=revoked)


# --- device identity -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DeviceIdentity:
    """The device's identity key and its certificate chain (leaf, device CA, root)."""

    device_id: str
    key: ec.EllipticCurvePrivateKey = field(repr=False)
    chain: tuple[x509.Certificate, ...] = field(repr=False)

    def __repr__(self) -> str:
        return f"DeviceIdentity(device_id={self.device_id!r}, key={self.fingerprint()})"

    @property
    def leaf(self) -> x509.Certificate:
        return self.chain[0]

    def fingerprint(self) -> str:
        return public_key_fingerprint(self.key.public_key())

    def sign(self, data: bytes) -> bytes:
        """ECDSA-SHA384 signature (DER) by the identity key."""
        return self.key.sign(data, ec.ECDSA(SIG_HASH()))

    def chain_pem(self) -> tuple[bytes, ...]:
        return tuple(_cert_pem(c) for c in self.chain)

    def save(self, directory: Path) -> None:
        """Write ``key.pem`` (0600) and ``chain.pem`` (leaf first)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        _write_file(directory / "key.pem", _key_pem(self.key), private=True)
        _write_file(directory / "chain.pem", b"".join(self.chain_pem()))

    @classmethod
    def load(cls, directory: Path) -> DeviceIdentity:
        directory = Path(directory)
        key = _load_key(directory / "key.pem", "device identity key")
        chain = tuple(_load_certs(directory / "chain.pem"))
        if len(chain) != 3:
            raise ConfigError(f"{directory / 'chain.pem'} must hold leaf, device CA and root")
        if chain[0].public_key() != key.public_key():
            raise ConfigError(f"{directory}: the device key does not match its certificate")
        try:
            device_id = common_name(chain[0])
        except ValueError:
            raise ConfigError(f"{directory / 'chain.pem'}: the leaf names no device") from None
        return cls(device_id=device_id, key=key, chain=chain)


def _load_or_create_vendor(vendor_dir: Path, device_dir: Path) -> VendorCA:
    if (vendor_dir / "root.pem").exists():
        return VendorCA.load(vendor_dir)
    if (device_dir / "chain.pem").exists():
        raise ConfigError(f"{device_dir} holds a device identity but {vendor_dir} has no vendor PKI")
    ca = VendorCA.generate()
    ca.save(vendor_dir)
    return ca


def _load_device(device_dir: Path, vendor_dir: Path, ca: VendorCA, device_id: str) -> DeviceIdentity:
    """The saved identity, refused unless it is ``device_id`` and was issued by ``ca``."""
    identity = DeviceIdentity.load(device_dir)
    if identity.device_id != device_id:
        raise ConfigError(
            f"{device_dir} holds device {identity.device_id!r}, not {device_id!r}; use another state dir"
        )
    try:
        identity.leaf.verify_directly_issued_by(ca.ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        raise ConfigError(f"{device_dir}: the device certificate was not issued by {vendor_dir}") from None
    return identity


def provision_emulated(state_dir: Path, *, device_id: str = "emu-gpu-0") -> tuple[VendorCA, DeviceIdentity]:
    """Create, or load if present, the emulated vendor PKI (``vendor/``) and device identity (``device/``)."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    vendor_dir, device_dir = state_dir / "vendor", state_dir / "device"
    ca = _load_or_create_vendor(vendor_dir, device_dir)
    if (device_dir / "chain.pem").exists():
        return ca, _load_device(device_dir, vendor_dir, ca, device_id)
    identity = ca.issue_device(device_id)
    identity.save(device_dir)
    return ca, identity
