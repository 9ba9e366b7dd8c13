"""The AMD SEV-SNP attestation report (AMD's SEV-SNP ABI spec, ATTESTATION_REPORT; versions 2 and 3).

1,184 bytes, integers little-endian; offsets in hex::

    000 version (4)  004 guest_svn (4)  008 guest policy (8)  010 family_id (16)  020 image_id (16)
    030 vmpl (4)  034 signature_algo (4, 1 = ECDSA P-384 with SHA-384)  038 current_tcb (8)
    040 platform_info (8)  048 key info (4: bit 0 author_key_en, bit 1 mask_chip_key, bits 2-4 signing key
        0 = VCEK, 1 = VLEK, 7 = none)  04C reserved (4)  050 report_data (64)  090 measurement (48)
    0C0 host_data (32)  0E0 id_key_digest (48)  110 author_key_digest (48)  140 report_id (32)
    160 report_id_ma (32)  180 reported_tcb (8)  188 cpuid family, model, stepping (3, version 3; else 0)
    1A0 chip_id (64)  1E0 committed_tcb (8)  1E8 current build/minor/major (4)  1EC committed (4)
    1F0 launch_tcb (8)  2A0 signature: r (72, little-endian), s (72), reserved to 4A0

The signature covers bytes 0..0x29F. A TCB version packs security patch levels (SPLs) into 8 bytes: on Milan and
Genoa byte 0 boot loader, 1 TEE, 6 SNP, 7 microcode; on Turin byte 0 FMC, 1 boot loader, 2 TEE, 3 SNP, 7
microcode. Guest policy bits: 0-7 ABI minor, 8-15 ABI major, 16 SMT allowed, 17 reserved (1), 18 migration
agent allowed, 19 debug allowed, 20 single socket.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

__all__ = ["PRODUCTS", "REPORT_SIZE", "SIGNED_SIZE", "SnpFormatError", "SnpReport", "Tcb", "parse_snp_report"]

REPORT_SIZE = 0x4A0
SIGNED_SIZE = 0x2A0
REPORT_VERSIONS = (2, 3)
SIG_ALGO_ECDSA_P384_SHA384 = 1
PRODUCTS = ("milan", "genoa", "turin")
POLICY_SMT_BIT = 16  # SMT allowed (AMD's SEV-SNP firmware ABI, guest policy; Linux's SNP_POLICY_MASK_SMT)
POLICY_MIGRATE_MA_BIT = 18  # a migration agent allowed (SNP_POLICY_MASK_MIGRATE_MA)
POLICY_DEBUG_BIT = 19
SIGNING_KEYS = {0: "vcek", 1: "vlek", 7: "none"}


class SnpFormatError(ValueError):
    """The bytes are not an SEV-SNP attestation report this verifier reads (claim ``report-parsed``)."""


@dataclass(frozen=True, slots=True)
class Tcb:
    """One TCB version's security patch levels (``fmc`` only on Turin)."""

    boot_loader: int
    tee: int
    snp: int
    microcode: int
    fmc: int | None = None

    @classmethod
    def from_raw(cls, raw: int, product: str) -> Tcb:
        b = raw.to_bytes(8, "little")
        if product == "turin":
            return cls(boot_loader=b[1], tee=b[2], snp=b[3], microcode=b[7], fmc=b[0])
        return cls(boot_loader=b[0], tee=b[1], snp=b[6], microcode=b[7])

    def to_json(self) -> dict[str, int]:
        doc = {"boot_loader": self.boot_loader, "tee": self.tee, "snp": self.snp, "microcode": self.microcode}
        if self.fmc is not None:
            doc["fmc"] = self.fmc
        return doc

    def below(self, minimum: dict[str, int]) -> list[str]:
        """The components under ``minimum`` (``{name: spl}``; names of :meth:`to_json`)."""
        have = self.to_json()
        return [f"{k} {have.get(k, 0)} < {v}" for k, v in minimum.items() if have.get(k, 0) < v]


@dataclass(frozen=True, slots=True)
class SnpReport:
    """A parsed report; byte fields as bytes, TCBs raw (their meaning depends on the product)."""

    raw: bytes
    version: int
    guest_svn: int
    policy: int
    family_id: bytes
    image_id: bytes
    vmpl: int
    signature_algo: int
    current_tcb: int
    platform_info: int
    key_info: int
    report_data: bytes
    measurement: bytes
    host_data: bytes
    id_key_digest: bytes
    author_key_digest: bytes
    report_id: bytes
    reported_tcb: int
    cpuid: tuple[int, int, int]
    chip_id: bytes
    committed_tcb: int
    launch_tcb: int
    r: int
    s: int

    @property
    def signed_bytes(self) -> bytes:
        return self.raw[:SIGNED_SIZE]

    @property
    def debug(self) -> bool:
        return bool(self.policy >> POLICY_DEBUG_BIT & 1)

    @property
    def signing_key(self) -> str:
        return SIGNING_KEYS.get(self.key_info >> 2 & 7, "reserved")

    @property
    def mask_chip_key(self) -> bool:
        return bool(self.key_info >> 1 & 1)

    def policy_json(self) -> dict[str, Any]:
        """The guest policy decoded (``debug`` is what the verifier refuses)."""
        p = self.policy
        return {"raw": f"{p:#018x}", "abi": f"{p >> 8 & 0xFF}.{p & 0xFF}", "smt": bool(p >> POLICY_SMT_BIT & 1),
                "migrate_ma": bool(p >> POLICY_MIGRATE_MA_BIT & 1), "debug": self.debug, "single_socket": bool(p >> 20 & 1)}


def _zero(data: bytes, start: int, end: int, what: str) -> None:
    if any(data[start:end]):
        raise SnpFormatError(f"{what} (bytes {start:#x}..{end:#x}) must be zero")


def parse_snp_report(data: bytes) -> SnpReport:
    """Parse exactly one report; a shorter input, trailing bytes or an unknown version are refused.

    Raises:
        SnpFormatError: not a version-2/3 report of 1,184 bytes signed with ECDSA P-384.
    """
    if len(data) != REPORT_SIZE:
        extra = "trailing bytes after the report" if len(data) > REPORT_SIZE else "truncated"
        raise SnpFormatError(f"an SNP report is {REPORT_SIZE} bytes, got {len(data)} ({extra})")
    version, guest_svn, policy = struct.unpack_from("<IIQ", data, 0)
    if version not in REPORT_VERSIONS:
        raise SnpFormatError(f"report version {version} (this verifier reads versions 2 and 3)")
    vmpl, sig_algo, current_tcb, platform_info, key_info = struct.unpack_from("<IIQQI", data, 0x30)
    if sig_algo != SIG_ALGO_ECDSA_P384_SHA384:
        raise SnpFormatError(f"signature algorithm {sig_algo} (only 1, ECDSA P-384 with SHA-384, is defined)")
    if vmpl > 3:
        raise SnpFormatError(f"VMPL {vmpl} (0..3)")
    cpuid = tuple(data[0x188:0x18B]) if version >= 3 else (0, 0, 0)
    r_le, s_le = data[0x2A0:0x2E8], data[0x2E8:0x330]
    _zero(r_le, 48, 72, "the signature's r above 384 bits")
    _zero(s_le, 48, 72, "the signature's s above 384 bits")
    _zero(data, 0x330, REPORT_SIZE, "the signature's reserved tail")
    return SnpReport(
        raw=bytes(data), version=version, guest_svn=guest_svn, policy=policy, family_id=data[0x10:0x20],
        image_id=data[0x20:0x30], vmpl=vmpl, signature_algo=sig_algo, current_tcb=current_tcb,
        platform_info=platform_info, key_info=key_info, report_data=data[0x50:0x90], measurement=data[0x90:0xC0],
        host_data=data[0xC0:0xE0], id_key_digest=data[0xE0:0x110], author_key_digest=data[0x110:0x140],
        report_id=data[0x140:0x160], reported_tcb=struct.unpack_from("<Q", data, 0x180)[0],
        cpuid=(cpuid[0], cpuid[1], cpuid[2]), chip_id=data[0x1A0:0x1E0],
        committed_tcb=struct.unpack_from("<Q", data, 0x1E0)[0], launch_tcb=struct.unpack_from("<Q", data, 0x1F0)[0],
        r=int.from_bytes(r_le, "little"), s=int.from_bytes(s_le, "little"),
    )


def product_of_cpuid(family: int, model: int) -> str | None:
    """The product a version-3 report's CPUID family and model name (None when unknown or version 2)."""
    if family == 0x19 and model <= 0x0F:
        return "milan"
    if family == 0x19 and (0x10 <= model <= 0x1F or 0xA0 <= model <= 0xAF):
        return "genoa"
    if family == 0x1A and model <= 0x11:
        return "turin"
    return None
