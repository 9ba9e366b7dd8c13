"""What the device attests to: its measurements, its CC mode, and the signed report that carries them.

The report is canonical JSON (version 1) over the verifier's nonce, the measurements, the mode, a
timestamp and the platform; the device identity key signs it, and the evidence adds the chain that
vouches for that key. ``Report.parse`` is the one reader of that format.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from gputravel.core.attestation.device_code import device_code_files, package_root
from gputravel.core.attestation.pki import DeviceIdentity
from gputravel.core.errors import AttestationError, ConfigError, FrameError
from gputravel.core.protocol.wirejson import loads_bounded

__all__ = [
    "EMULATED_DRIVER",
    "EMULATED_FIRMWARE",
    "HEX64",
    "PLATFORM_EMULATED",
    "REPORT_VERSION",
    "CCMode",
    "Evidence",
    "Measurements",
    "Report",
    "canonical_json",
    "code_measurement",
    "emulated_measurements",
    "make_evidence",
    "sha256_hex",
]

REPORT_VERSION = 1
PLATFORM_EMULATED = "emulated"
HEX64 = re.compile(r"[0-9a-f]{64}")
"""A lowercase hex SHA-256: the form of every measurement."""


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no spaces, ASCII, no NaN: the bytes that are signed, MACed and hashed."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class CCMode(StrEnum):
    """The GPU's confidential-computing mode."""

    ON = "on"
    OFF = "off"
    DEVTOOLS = "devtools"


# --- measurements -----------------------------------------------------------------------------------
EMULATED_FIRMWARE = sha256_hex(b"gputravel emulated GPU firmware 1.0")
EMULATED_DRIVER = sha256_hex(b"gputravel emulated GPU driver 1.0")


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
            if not isinstance(value, str) or not HEX64.fullmatch(value):
                raise AttestationError(f"malformed measurements: {key} is not a lowercase hex SHA-256")
        return cls(firmware=data["firmware"], driver=data["driver"], code=data["code"])

    def digest(self) -> str:
        return sha256_hex(canonical_json(self.to_dict()))


def _explicit_code_files(paths: Iterable[Path]) -> tuple[Path, list[Path]]:
    files: list[Path] = []
    for p in paths:
        p = Path(p).resolve()
        if p.is_dir():
            files.extend(f for f in p.rglob("*.py") if "__pycache__" not in f.parts)
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError(f"code measurement: {p} does not exist")
    base = Path(os.path.commonpath([f.parent for f in files])) if files else Path(".")
    return base, files


def emulated_measurements() -> Measurements:
    """What the emulated device measures about itself: its fixed firmware and driver, and the code it runs."""
    return Measurements(firmware=EMULATED_FIRMWARE, driver=EMULATED_DRIVER, code=code_measurement())


def code_measurement(paths: Iterable[Path] | None = None, *, root: Path | None = None) -> str:
    """SHA-256 over the device's source files: each file's relative path and contents, sorted by path.

    With ``paths`` None, exactly the device's code (``device_code.DEVICE_CODE``: what the device process runs,
    nothing only the orchestrator runs) under ``root`` (default: the installed package), named relative to the
    package root, so the value does not depend on where the package is installed. Explicit ``paths`` may be
    files or directories (expanded to their ``*.py`` files) and are named relative to their common parent.
    """
    if paths is None:
        base = package_root() if root is None else Path(root)
        files = device_code_files(base)
    else:
        base, files = _explicit_code_files(paths)
    h = hashlib.sha256(b"gputravel code measurement v1\0")
    for rel, f in sorted((f.relative_to(base).as_posix(), f) for f in set(files)):
        name = rel.encode()
        data = f.read_bytes()
        h.update(len(name).to_bytes(4, "big") + name + len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


# --- the report ------------------------------------------------------------------------------------
_REPORT_FIELDS = frozenset({"version", "device_id", "nonce", "measurements", "cc_mode", "timestamp", "platform"})


@dataclass(frozen=True, slots=True)
class Report:
    """The signed statement: the verifier's nonce, the measurements and the mode, at a time, on a platform."""

    device_id: str
    nonce: bytes
    measurements: Measurements
    cc_mode: CCMode
    timestamp: float
    platform: str

    def to_bytes(self) -> bytes:
        """The canonical JSON the device signs (version ``REPORT_VERSION``)."""
        return canonical_json(
            {
                "version": REPORT_VERSION,
                "device_id": self.device_id,
                "nonce": self.nonce.hex(),
                "measurements": self.measurements.to_dict(),
                "cc_mode": CCMode(self.cc_mode).value,
                "timestamp": float(self.timestamp),
                "platform": self.platform,
            }
        )

    @classmethod
    def parse(cls, report: bytes) -> Report:
        """Read signed report bytes; ``AttestationError`` unless they are exactly a canonical version-1 report."""
        data = _report_object(report)
        if not isinstance(data["device_id"], str) or not isinstance(data["platform"], str):
            raise AttestationError("report device_id/platform are not strings")
        if not isinstance(data["nonce"], str):
            raise AttestationError("report nonce is not hex")
        try:
            nonce = bytes.fromhex(data["nonce"])
        except ValueError:
            raise AttestationError("report nonce is not hex") from None
        measurements = Measurements.from_dict(data["measurements"])
        try:
            mode = CCMode(data["cc_mode"])
        except ValueError:
            raise AttestationError(f"report names unknown cc_mode {data['cc_mode']!r}") from None
        ts = data["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, int | float):
            raise AttestationError("report timestamp is not a number")
        return cls(data["device_id"], nonce, measurements, mode, float(ts), data["platform"])


def _report_object(report: bytes) -> dict[str, Any]:
    """The report's JSON object, checked for its field set, canonical form and version."""
    try:
        data = loads_bounded(report, what="report")  # a peer's bytes: bounded in size and depth
    except FrameError:
        raise AttestationError("report is not JSON") from None
    if not isinstance(data, dict):
        raise AttestationError("report is not a JSON object")
    if set(data) != _REPORT_FIELDS:
        raise AttestationError("report fields differ from version 1")
    if canonical_json(data) != report:
        raise AttestationError("report is not canonical JSON")
    if data["version"] != REPORT_VERSION:
        raise AttestationError(f"unsupported report version {data['version']!r}")
    return data


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
    report = Report(
        device_id=identity.device_id,
        nonce=nonce,
        measurements=measurements,
        cc_mode=CCMode(cc_mode),
        timestamp=float(time.time() if timestamp is None else timestamp),
        platform=platform,
    ).to_bytes()
    return Evidence(report=report, signature=identity.sign(report), chain_pem=identity.chain_pem())
