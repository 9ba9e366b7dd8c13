"""Device identity, attestation evidence and its verification.

The emulated GPU owns an ECDSA P-384 identity key certified by an emulated vendor PKI
(root CA -> device CA -> device leaf). It signs a report over the verifier's fresh nonce, its
measurements and its confidential-computing mode. The verifier checks the chain against the pinned
vendor root, the vendor's revocation list, the report signature, the nonce and its age, the
measurements against a policy (the reference-integrity manifest) and the mode. Verification fails
closed: bad evidence yields failed claims, never an exception.

Keys are never printed, logged or put in messages: only ``fingerprint``s are.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import hashlib
import hmac
import importlib.resources
import json
import math
import os
import re
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gputravel.core.errors import AttestationError, ConfigError
from gputravel.core.files import read_private, write_atomic
from gputravel.core.protocol.keys import fingerprint

__all__ = [
    "EMULATED_DRIVER",
    "EMULATED_FIRMWARE",
    "INJECTIONS",
    "AttestationResult",
    "AttestationToken",
    "CCMode",
    "Claim",
    "DeviceIdentity",
    "Evidence",
    "Injection",
    "Measurements",
    "Policy",
    "VendorCA",
    "code_measurement",
    "emulated_measurements",
    "fingerprint",
    "load_policy",
    "make_evidence",
    "provision_emulated",
    "run_emulated_attestation",
    "verify_evidence",
]

REPORT_VERSION = 1
PLATFORM_EMULATED = "emulated"
MAX_CLOCK_SKEW_S = 30.0
"""How far in the future a report timestamp may lie before the nonce claim fails."""

CLAIM_NAMES = ("chain", "revocation", "signature", "nonce", "measurements", "mode", "overall")

_CURVE = ec.SECP384R1
_SIG_HASH = hashes.SHA384
_HEX64 = re.compile(r"[0-9a-f]{64}")


def public_key_fingerprint(key: ec.EllipticCurvePublicKey) -> str:
    """``fingerprint`` of a public key's DER SubjectPublicKeyInfo."""
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return fingerprint(der)


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class CCMode(StrEnum):
    """The GPU's confidential-computing mode."""

    ON = "on"
    OFF = "off"
    DEVTOOLS = "devtools"


# --- measurements -----------------------------------------------------------------------------------
EMULATED_FIRMWARE = _sha256_hex(b"gputravel emulated GPU firmware 1.0")
EMULATED_DRIVER = _sha256_hex(b"gputravel emulated GPU driver 1.0")

_CODE_PACKAGES = ("device", "training")  # under gputravel.core


@dataclass(frozen=True, slots=True)
class Measurements:
    """What the device measured: firmware, driver and the device-side code (hex SHA-256 each)."""

    firmware: str
    driver: str
    code: str

    def to_dict(self) -> dict[str, str]:
        return {"firmware": self.firmware, "driver": self.driver, "code": self.code}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measurements:
        """Parse and validate; raises ``AttestationError`` on anything but three hex SHA-256 strings."""
        if not isinstance(data, Mapping) or set(data) != {"firmware", "driver", "code"}:
            raise AttestationError("malformed measurements: expected exactly firmware, driver, code")
        for key in ("firmware", "driver", "code"):
            value = data[key]
            if not isinstance(value, str) or not _HEX64.fullmatch(value):
                raise AttestationError(f"malformed measurements: {key} is not a lowercase hex SHA-256")
        return cls(firmware=data["firmware"], driver=data["driver"], code=data["code"])

    def digest(self) -> str:
        return _sha256_hex(_canonical_json(self.to_dict()))


def _default_code_files() -> tuple[Path, list[Path]]:
    core_dir = Path(__file__).resolve().parent
    files: list[Path] = []
    for name in _CODE_PACKAGES:
        pkg = core_dir / name
        if pkg.is_dir():
            files.extend(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)
    return core_dir.parent, files


def emulated_measurements() -> Measurements:
    """What the emulated device measures about itself: its fixed firmware and driver, and the code it runs."""
    return Measurements(firmware=EMULATED_FIRMWARE, driver=EMULATED_DRIVER, code=code_measurement())


def code_measurement(paths: Iterable[Path] | None = None) -> str:
    """SHA-256 over device-side source files: each file's relative path and contents, sorted by path.

    With ``paths`` None, the ``*.py`` files of ``gputravel.core.device`` and ``gputravel.core.training``
    (whichever exist; none is a valid, if empty, measurement) named relative to the package root, so the
    value does not depend on where the package is installed. Explicit ``paths`` may be files or
    directories (expanded to their ``*.py`` files) and are named relative to their common parent.
    """
    if paths is None:
        base, files = _default_code_files()
    else:
        files = []
        for p in paths:
            p = Path(p).resolve()
            if p.is_dir():
                files.extend(f for f in p.rglob("*.py") if "__pycache__" not in f.parts)
            elif p.is_file():
                files.append(p)
            else:
                raise ConfigError(f"code measurement: {p} does not exist")
        base = Path(os.path.commonpath([f.parent for f in files])) if files else Path(".")
    h = hashlib.sha256(b"gputravel code measurement v1\0")
    for rel, f in sorted((f.relative_to(base).as_posix(), f) for f in set(files)):
        name = rel.encode()
        data = f.read_bytes()
        h.update(len(name).to_bytes(4, "big") + name + len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


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
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, _CURVE):
        raise ConfigError(f"{path} is not a P-384 EC private key")
    return key


def _load_certs(path: Path) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(_read_file(path))
    except ValueError:
        raise ConfigError(f"{path} does not hold PEM certificates") from None


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


# --- vendor PKI ------------------------------------------------------------------------------------
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
    return builder.sign(issuer_key, _SIG_HASH())


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
        root_key = ec.generate_private_key(_CURVE())
        root_name = _name(f"{name} Root CA", name)
        root_cert = _issue(
            subject=root_name, public_key=root_key.public_key(), issuer=root_name, issuer_key=root_key,
            ca=True, path_length=1, years=20,
        )
        ca_key = ec.generate_private_key(_CURVE())
        ca_cert = _issue(
            subject=_name(f"{name} Device CA", name), public_key=ca_key.public_key(), issuer=root_name,
            issuer_key=root_key, ca=True, path_length=0, years=15,
        )
        return cls(name=name, root_key=root_key, root_cert=root_cert, ca_key=ca_key, ca_cert=ca_cert)

    def issue_device(self, device_id: str) -> DeviceIdentity:
        """Generate a device identity key and certify it under the device CA."""
        if not device_id or not device_id.isprintable():
            raise ConfigError("device_id must be a non-empty printable string")
        key = ec.generate_private_key(_CURVE())
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
        return builder.sign(self.root_key, _SIG_HASH())

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
        crl_path = directory / "crl.pem"
        revoked: dict[int, dt.datetime] = {}
        if crl_path.exists():
            try:
                crl = x509.load_pem_x509_crl(_read_file(crl_path))
            except ValueError:
                raise ConfigError(f"{crl_path} is not a PEM CRL") from None
            if not crl.is_signature_valid(_ec_public(root_cert)):
                raise ConfigError(f"{crl_path} is not signed by the vendor root")
            revoked = {r.serial_number: r.revocation_date_utc for r in crl}
        orgs = root_cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
        name = str(orgs[0].value) if orgs else "Emulated GPU Vendor"
        return cls(name=name, root_key=root_key, root_cert=root_cert, ca_key=ca_key, ca_cert=ca_cert,
                   revoked=revoked)


def _single_cert(path: Path) -> x509.Certificate:
    certs = _load_certs(path)
    if len(certs) != 1:
        raise ConfigError(f"{path} must hold exactly one certificate")
    return certs[0]


def _ec_public(cert: x509.Certificate) -> ec.EllipticCurvePublicKey:
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, _CURVE):
        raise ValueError("certificate key is not P-384")
    return key


def _common_name(cert: x509.Certificate) -> str:
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(attrs) != 1:
        raise ValueError("certificate subject has no single common name")
    return str(attrs[0].value)


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
        return self.key.sign(data, ec.ECDSA(_SIG_HASH()))

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
            device_id = _common_name(chain[0])
        except ValueError:
            raise ConfigError(f"{directory / 'chain.pem'}: the leaf names no device") from None
        return cls(device_id=device_id, key=key, chain=chain)


def provision_emulated(state_dir: Path, *, device_id: str = "emu-gpu-0") -> tuple[VendorCA, DeviceIdentity]:
    """Create, or load if present, the emulated vendor PKI (``vendor/``) and device identity (``device/``)."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    vendor_dir, device_dir = state_dir / "vendor", state_dir / "device"
    if (vendor_dir / "root.pem").exists():
        ca = VendorCA.load(vendor_dir)
    else:
        if (device_dir / "chain.pem").exists():
            raise ConfigError(f"{device_dir} holds a device identity but {vendor_dir} has no vendor PKI")
        ca = VendorCA.generate()
        ca.save(vendor_dir)
    if (device_dir / "chain.pem").exists():
        identity = DeviceIdentity.load(device_dir)
        if identity.device_id != device_id:
            raise ConfigError(
                f"{device_dir} holds device {identity.device_id!r}, not {device_id!r}; use another state dir"
            )
        try:
            identity.leaf.verify_directly_issued_by(ca.ca_cert)
        except (ValueError, TypeError, InvalidSignature):
            raise ConfigError(f"{device_dir}: the device certificate was not issued by {vendor_dir}") from None
    else:
        identity = ca.issue_device(device_id)
        identity.save(device_dir)
    return ca, identity


# --- evidence --------------------------------------------------------------------------------------
def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise AttestationError(f"malformed evidence: {what} is not a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise AttestationError(f"malformed evidence: {what} is not valid base64") from None


@dataclass(frozen=True, slots=True)
class Evidence:
    """A signed attestation report and the certificate chain (PEM, leaf first) that vouches for the signer."""

    report: bytes
    signature: bytes
    chain_pem: tuple[bytes, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "report": _b64(self.report),
            "signature": _b64(self.signature),
            "chain_pem": [_b64(c) for c in self.chain_pem],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Evidence:
        """Parse the wire form; raises ``AttestationError`` when it is not shaped like evidence."""
        if not isinstance(data, Mapping) or set(data) != {"report", "signature", "chain_pem"}:
            raise AttestationError("malformed evidence: expected exactly report, signature, chain_pem")
        chain = data["chain_pem"]
        if not isinstance(chain, list | tuple):
            raise AttestationError("malformed evidence: chain_pem is not a list")
        return cls(
            report=_unb64(data["report"], "report"),
            signature=_unb64(data["signature"], "signature"),
            chain_pem=tuple(_unb64(c, "chain_pem entry") for c in chain),
        )

    def digest(self) -> bytes:
        """SHA-256 over report and signature (length-prefixed); sessions bind it into their transcript."""
        h = hashlib.sha256()
        for part in (self.report, self.signature):
            h.update(len(part).to_bytes(4, "big") + part)
        return h.digest()


def make_evidence(
    identity: DeviceIdentity,
    *,
    nonce: bytes,
    measurements: Measurements,
    cc_mode: CCMode,
    timestamp: float | None = None,
    platform: str = PLATFORM_EMULATED,
) -> Evidence:
    """The device side: sign a report over the verifier's nonce, the measurements and the CC mode."""
    report = _canonical_json(
        {
            "version": REPORT_VERSION,
            "device_id": identity.device_id,
            "nonce": nonce.hex(),
            "measurements": measurements.to_dict(),
            "cc_mode": CCMode(cc_mode).value,
            "timestamp": float(time.time() if timestamp is None else timestamp),
            "platform": platform,
        }
    )
    return Evidence(report=report, signature=identity.sign(report), chain_pem=identity.chain_pem())


# --- policy ----------------------------------------------------------------------------------------
_POLICY_REQUIRED = ("firmware", "driver", "code")
_POLICY_OPTIONAL = ("allowed_modes", "max_report_age_s", "token_ttl_s")


@dataclass(frozen=True, slots=True)
class Policy:
    """Reference values the verifier compares evidence against (a reference-integrity manifest).

    ``code`` may be ``"auto"``: the ``code_measurement()`` of the installed package.
    """

    firmware: str
    driver: str
    code: str
    allowed_modes: tuple[CCMode, ...] = (CCMode.ON,)
    max_report_age_s: float = 60.0
    token_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        for key in _POLICY_REQUIRED:
            value = getattr(self, key)
            if not isinstance(value, str) or not (_HEX64.fullmatch(value) or (key == "code" and value == "auto")):
                allowed = 'lowercase hex SHA-256 or "auto"' if key == "code" else "lowercase hex SHA-256"
                raise ConfigError(f"policy: {key} must be a {allowed}")
        if isinstance(self.allowed_modes, str | bytes) or not self.allowed_modes:
            raise ConfigError("policy: allowed_modes must be a non-empty list of modes")
        try:
            modes = tuple(CCMode(m) for m in self.allowed_modes)
        except (ValueError, TypeError):
            raise ConfigError(
                f"policy: allowed_modes must hold only {', '.join(m.value for m in CCMode)}"
            ) from None
        object.__setattr__(self, "allowed_modes", modes)
        for key in ("max_report_age_s", "token_ttl_s"):
            value = getattr(self, key)
            try:  # an integer beyond float range (TOML readers take any size) is not a number of seconds
                seconds = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
            except OverflowError:
                seconds = None
            if seconds is None or not (math.isfinite(seconds) and seconds > 0):
                raise ConfigError(f"policy: {key} must be a positive number of seconds")
            object.__setattr__(self, key, seconds)

    def expected(self, *, code: str | None = None) -> Measurements:
        """The reference measurements, with ``"auto"`` resolved (to ``code`` if given)."""
        if self.code == "auto":
            resolved = code if code is not None else code_measurement()
        else:
            resolved = self.code
        return Measurements(firmware=self.firmware, driver=self.driver, code=resolved)


def load_policy(path: Path | None = None) -> Policy:
    """Read a policy TOML; ``None`` reads the shipped ``core/policy/default.toml``.

    Raises ``ConfigError`` naming the key for unknown, missing, mistyped or malformed entries.
    """
    if path is None:
        where = "default policy"
        text = importlib.resources.files("gputravel.core").joinpath("policy/default.toml").read_text("utf-8")
    else:
        where = str(path)
        try:
            text = Path(path).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"policy {where}: cannot read: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"policy {where}: invalid TOML: {exc}") from None
    unknown = sorted(set(data) - set(_POLICY_REQUIRED) - set(_POLICY_OPTIONAL))
    if unknown:
        raise ConfigError(f"policy {where}: unknown key(s): {', '.join(unknown)}")
    missing = [k for k in _POLICY_REQUIRED if k not in data]
    if missing:
        raise ConfigError(f"policy {where}: missing key(s): {', '.join(missing)}")
    kwargs = dict(data)
    if "allowed_modes" in kwargs:
        modes = kwargs["allowed_modes"]
        if not isinstance(modes, list) or not all(isinstance(m, str) for m in modes):
            raise ConfigError(f"policy {where}: allowed_modes must be a list of strings")
        kwargs["allowed_modes"] = tuple(modes)
    try:
        return Policy(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"policy {where}: {exc.reason.removeprefix('policy: ')}") from None


# --- verification ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Claim:
    """One checked property of the evidence."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True, slots=True)
class AttestationToken:
    """The verifier's statement that a device passed attestation, MACed with the verifier's secret."""

    device_id: str
    measurement_digest: str
    claims_digest: str
    evidence_digest: str
    issued_at: float
    expires_at: float
    signature: bytes = field(repr=False)

    def _payload(self) -> bytes:
        body = self.to_dict()
        del body["signature"]
        return _canonical_json(body)

    @classmethod
    def issue(
        cls,
        secret: bytes,
        *,
        device_id: str,
        measurement_digest: str,
        claims_digest: str,
        evidence_digest: str,
        issued_at: float,
        ttl_s: float,
    ) -> AttestationToken:
        unsigned = cls(device_id, measurement_digest, claims_digest, evidence_digest, issued_at,
                       issued_at + ttl_s, b"")
        return dataclasses.replace(unsigned, signature=hmac.digest(secret, unsigned._payload(), "sha256"))

    def is_valid(self, now: float | None = None) -> bool:
        """True while ``issued_at <= now < expires_at`` (the MAC is checked by ``verify``)."""
        now = time.time() if now is None else now
        return self.issued_at <= now < self.expires_at

    def verify(self, secret: bytes, *, now: float | None = None) -> bool:
        """True when the MAC matches ``secret`` and the token has not expired."""
        good = hmac.compare_digest(hmac.digest(secret, self._payload(), "sha256"), self.signature)
        return good and self.is_valid(now)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_id": self.device_id,
            "measurement_digest": self.measurement_digest,
            "claims_digest": self.claims_digest,
            "evidence_digest": self.evidence_digest,
            "issued_at": self.issued_at,
            "expires_at": self.expires_at,
            "signature": self.signature.hex(),
        }


@dataclass(frozen=True)
class AttestationResult:
    """Every claim, the verdict, and (only when ``ok``) a token and the device's public key."""

    claims: tuple[Claim, ...]
    ok: bool
    token: AttestationToken | None
    device_public_key: ec.EllipticCurvePublicKey | None = field(repr=False)
    device_id: str | None
    measurements: Measurements | None
    cc_mode: CCMode | None
    platform: str = PLATFORM_EMULATED
    device_key_fingerprint: str | None = None

    def claim(self, name: str) -> Claim:
        for c in self.claims:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def failed(self) -> tuple[Claim, ...]:
        return tuple(c for c in self.claims if not c.ok and c.name != "overall")

    def raise_for_failure(self) -> None:
        """Raise ``AttestationError`` naming every failed claim, or return when all passed."""
        if self.ok:
            return
        failed = self.failed or tuple(c for c in self.claims if not c.ok)
        reasons = "; ".join(f"{c.name}: {c.detail}" for c in failed)
        raise AttestationError(f"attestation of {self.device_id or 'unknown device'} failed: {reasons}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe summary; public-key fingerprint only, no key material."""
        return {
            "ok": self.ok,
            "platform": self.platform,
            "device_id": self.device_id,
            "device_key_fingerprint": self.device_key_fingerprint,
            "cc_mode": None if self.cc_mode is None else self.cc_mode.value,
            "measurements": None if self.measurements is None else self.measurements.to_dict(),
            "claims": {c.name: {"ok": c.ok, "detail": c.detail} for c in self.claims},
            "token": None if self.token is None else self.token.to_dict(),
        }


class _Fail(Exception):
    """A claim failed for a stated reason."""


def _check(name: str, fn: Callable[[], str]) -> Claim:
    """Run one check; anything it raises makes the claim false (fail closed)."""
    try:
        return Claim(name, True, fn())
    except _Fail as exc:
        return Claim(name, False, str(exc))
    except Exception as exc:  # noqa: BLE001 - fail closed on anything unexpected
        text = str(exc) or "no detail"
        return Claim(name, False, f"{type(exc).__name__}: {text}"[:200])


def _parse_chain(chain_pem: tuple[bytes, ...]) -> tuple[x509.Certificate, ...]:
    if len(chain_pem) != 3:
        raise _Fail(f"expected 3 certificates (leaf, device CA, root), got {len(chain_pem)}")
    try:
        return tuple(x509.load_pem_x509_certificate(p) for p in chain_pem)
    except (ValueError, TypeError):
        raise _Fail("a certificate in the chain is not valid PEM") from None


@dataclass(frozen=True, slots=True)
class _Report:
    device_id: str
    nonce: bytes
    measurements: Measurements
    cc_mode: CCMode
    timestamp: float
    platform: str


def _parse_report(report: bytes) -> _Report:
    try:
        data = json.loads(report)
    except (ValueError, UnicodeDecodeError):
        raise _Fail("report is not JSON") from None
    if not isinstance(data, dict):
        raise _Fail("report is not a JSON object")
    expected = {"version", "device_id", "nonce", "measurements", "cc_mode", "timestamp", "platform"}
    if set(data) != expected:
        raise _Fail("report fields differ from version 1")
    if _canonical_json(data) != report:
        raise _Fail("report is not canonical JSON")
    if data["version"] != REPORT_VERSION:
        raise _Fail(f"unsupported report version {data['version']!r}")
    if not isinstance(data["device_id"], str) or not isinstance(data["platform"], str):
        raise _Fail("report device_id/platform are not strings")
    if not isinstance(data["nonce"], str):
        raise _Fail("report nonce is not hex")
    try:
        nonce = bytes.fromhex(data["nonce"])
    except ValueError:
        raise _Fail("report nonce is not hex") from None
    try:
        measurements = Measurements.from_dict(data["measurements"])
    except AttestationError as exc:
        raise _Fail(exc.reason) from None
    try:
        mode = CCMode(data["cc_mode"])
    except ValueError:
        raise _Fail(f"report names unknown cc_mode {data['cc_mode']!r}") from None
    ts = data["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise _Fail("report timestamp is not a number")
    return _Report(data["device_id"], nonce, measurements, mode, float(ts), data["platform"])


def _require_ca(cert: x509.Certificate, what: str) -> None:
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        raise _Fail(f"{what} has no basicConstraints") from None
    if not bc.ca:
        raise _Fail(f"{what} is not a CA")
    try:
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return
    if not ku.key_cert_sign:
        raise _Fail(f"{what} may not sign certificates")


def verify_evidence(
    evidence: Evidence,
    *,
    nonce: bytes,
    root: x509.Certificate,
    crl: x509.CertificateRevocationList | None,
    policy: Policy,
    now: float | None = None,
    verifier_secret: bytes | None = None,
    expected_code: str | None = None,
) -> AttestationResult:
    """Check evidence against the pinned root, the CRL, the fresh ``nonce`` and the policy.

    Never raises for bad evidence: each failure is a false claim with its reason. ``verifier_secret``
    MACs the token (a random one is used when absent); ``expected_code`` resolves a policy ``code`` of
    ``"auto"`` (default: ``code_measurement()``).
    """
    now = time.time() if now is None else now
    when = dt.datetime.fromtimestamp(now, dt.UTC)
    chain: tuple[x509.Certificate, ...] = ()
    chain_error = ""
    try:
        chain = _parse_chain(tuple(evidence.chain_pem))
    except _Fail as exc:
        chain_error = str(exc)
    except Exception as exc:  # noqa: BLE001
        chain_error = f"chain unreadable: {type(exc).__name__}"
    report: _Report | None = None
    report_error = ""
    try:
        report = _parse_report(evidence.report)
    except _Fail as exc:
        report_error = str(exc)
    except Exception as exc:  # noqa: BLE001
        report_error = f"report unreadable: {type(exc).__name__}"

    def need_chain() -> tuple[x509.Certificate, ...]:
        if not chain:
            raise _Fail(chain_error)
        return chain

    def need_report() -> _Report:
        if report is None:
            raise _Fail(report_error)
        return report

    def check_chain() -> str:
        leaf, inter, top = need_chain()
        if top.public_bytes(serialization.Encoding.DER) != root.public_bytes(serialization.Encoding.DER):
            raise _Fail("chain does not end at the pinned vendor root")
        try:
            leaf.verify_directly_issued_by(inter)
        except (ValueError, TypeError, InvalidSignature):
            raise _Fail("device certificate is not signed by the device CA") from None
        try:
            inter.verify_directly_issued_by(root)
            root.verify_directly_issued_by(root)
        except (ValueError, TypeError, InvalidSignature):
            raise _Fail("device CA is not signed by the pinned vendor root") from None
        for cert, what in ((leaf, "device certificate"), (inter, "device CA"), (root, "vendor root")):
            if not cert.not_valid_before_utc <= when <= cert.not_valid_after_utc:
                raise _Fail(f"{what} is not valid at {when:%Y-%m-%dT%H:%M:%SZ}")
        _require_ca(inter, "device CA")
        _require_ca(root, "vendor root")
        try:
            leaf_bc = leaf.extensions.get_extension_for_class(x509.BasicConstraints).value
            if leaf_bc.ca:
                raise _Fail("device certificate is a CA")
        except x509.ExtensionNotFound:
            pass
        try:
            _ec_public(leaf)
        except ValueError:
            raise _Fail("device key is not P-384") from None
        return f"device certificate -> device CA -> pinned root {public_key_fingerprint(_ec_public(root))}"

    def check_revocation() -> str:
        certs = need_chain()
        if crl is None:
            raise _Fail("no revocation list available")
        if crl.issuer != root.subject or not crl.is_signature_valid(_ec_public(root)):
            raise _Fail("revocation list is not signed by the pinned root")
        next_update = crl.next_update_utc
        if next_update is not None and next_update < when:
            raise _Fail("revocation list is out of date")
        for cert, what in zip(certs, ("device certificate", "device CA", "vendor root"), strict=True):
            if crl.get_revoked_certificate_by_serial_number(cert.serial_number) is not None:
                raise _Fail(f"{what} (serial {cert.serial_number:x}) is revoked")
        return f"none of 3 certificates revoked ({len(crl)} on the list)"

    def check_signature() -> str:
        leaf = need_chain()[0]
        key = leaf.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise _Fail("device key is not an EC key")
        try:
            key.verify(evidence.signature, evidence.report, ec.ECDSA(_SIG_HASH()))
        except InvalidSignature:
            raise _Fail("report signature does not verify under the device key") from None
        rep = need_report()
        if rep.device_id != _common_name(leaf):
            raise _Fail(f"report names device {rep.device_id!r}, certificate names {_common_name(leaf)!r}")
        return f"signed by device key {public_key_fingerprint(key)}"

    def check_nonce() -> str:
        rep = need_report()
        if not nonce or not hmac.compare_digest(rep.nonce, nonce):
            raise _Fail("report nonce is not the verifier's fresh nonce")
        age = now - rep.timestamp
        if age > policy.max_report_age_s:
            raise _Fail(f"report is {age:.1f} s old (max {policy.max_report_age_s:g} s)")
        if age < -MAX_CLOCK_SKEW_S:
            raise _Fail(f"report timestamp is {-age:.1f} s in the future")
        return f"fresh nonce, report {max(age, 0.0):.1f} s old"

    def check_measurements() -> str:
        rep = need_report()
        want = policy.expected(code=expected_code)
        differ = [k for k in ("firmware", "driver", "code") if getattr(rep.measurements, k) != getattr(want, k)]
        if differ:
            raise _Fail(
                "differ from policy: "
                + ", ".join(f"{k} {getattr(rep.measurements, k)[:12]}… != {getattr(want, k)[:12]}…" for k in differ)
            )
        return "firmware, driver and code match policy"

    def check_mode() -> str:
        rep = need_report()
        if rep.cc_mode not in policy.allowed_modes:
            allowed = ", ".join(m.value for m in policy.allowed_modes)
            raise _Fail(f"cc_mode {rep.cc_mode.value!r} not allowed (allowed: {allowed})")
        return f"cc_mode {rep.cc_mode.value!r}"

    claims = [
        _check("chain", check_chain),
        _check("revocation", check_revocation),
        _check("signature", check_signature),
        _check("nonce", check_nonce),
        _check("measurements", check_measurements),
        _check("mode", check_mode),
    ]
    failed = [c.name for c in claims if not c.ok]
    ok = not failed
    claims.append(Claim("overall", ok, "all claims hold" if ok else f"failed: {', '.join(failed)}"))

    leaf_key: ec.EllipticCurvePublicKey | None = None
    if chain:
        try:
            leaf_key = _ec_public(chain[0])
        except ValueError:
            leaf_key = None
    token = None
    if ok and report is not None:
        claims_digest = _sha256_hex(_canonical_json([[c.name, c.ok, c.detail] for c in claims]))
        token = AttestationToken.issue(
            verifier_secret if verifier_secret is not None else os.urandom(32),
            device_id=report.device_id,
            measurement_digest=report.measurements.digest(),
            claims_digest=claims_digest,
            evidence_digest=evidence.digest().hex(),
            issued_at=now,
            ttl_s=policy.token_ttl_s,
        )
    return AttestationResult(
        claims=tuple(claims),
        ok=ok,
        token=token,
        device_public_key=leaf_key if ok else None,
        device_id=report.device_id if report is not None else None,
        measurements=report.measurements if report is not None else None,
        cc_mode=report.cc_mode if report is not None else None,
        platform=report.platform if report is not None else PLATFORM_EMULATED,
        device_key_fingerprint=public_key_fingerprint(leaf_key) if leaf_key is not None else None,
    )


# --- the emulated run, with fault injection ---------------------------------------------------------
class Injection(StrEnum):
    """Faults ``run_emulated_attestation`` can inject (in memory only; the saved PKI is untouched)."""

    REVOKED_CERT = "revoked-cert"
    BAD_CHAIN = "bad-chain"
    STALE_NONCE = "stale-nonce"
    MEASUREMENT_MISMATCH = "measurement-mismatch"
    DEVTOOLS = "devtools"


INJECTIONS: tuple[str, ...] = tuple(i.value for i in Injection)


def run_emulated_attestation(
    state_dir: Path,
    *,
    inject: str | None = None,
    policy: Policy | None = None,
    verifier_secret: bytes | None = None,
) -> AttestationResult:
    """Provision (or load) the emulated vendor and device, attest with a fresh nonce, and verify.

    ``inject`` (one of ``INJECTIONS``) makes the device or the vendor misbehave in memory; the
    persisted PKI under ``state_dir`` is never changed by it.
    """
    if inject is not None:
        try:
            fault: Injection | None = Injection(inject)
        except ValueError:
            raise ConfigError(f"unknown injection {inject!r} (choose from {', '.join(INJECTIONS)})") from None
    else:
        fault = None
    policy = load_policy() if policy is None else policy
    ca, identity = provision_emulated(state_dir)
    measurements = emulated_measurements()
    code = measurements.code
    nonce = os.urandom(32)
    signed_nonce, timestamp, mode = nonce, time.time(), CCMode.ON

    if fault is Injection.REVOKED_CERT:
        ca.revoke(identity.leaf.serial_number)  # this in-memory copy is never saved
    elif fault is Injection.BAD_CHAIN:
        # A fake device certificate: same vendor name and device id, but a rogue root.
        identity = VendorCA.generate(ca.name).issue_device(identity.device_id)
    elif fault is Injection.STALE_NONCE:
        signed_nonce = os.urandom(32)  # an earlier session's nonce, replayed
        timestamp -= policy.max_report_age_s + 300
    elif fault is Injection.MEASUREMENT_MISMATCH:
        measurements = dataclasses.replace(measurements, firmware=_sha256_hex(b"gputravel tampered firmware"))
    elif fault is Injection.DEVTOOLS:
        mode = CCMode.DEVTOOLS

    evidence = make_evidence(identity, nonce=signed_nonce, measurements=measurements, cc_mode=mode,
                             timestamp=timestamp)
    return verify_evidence(evidence, nonce=nonce, root=ca.root, crl=ca.crl(), policy=policy,
                           verifier_secret=verifier_secret, expected_code=code)
