"""The evidence policy (``core/policy/evidence.toml``): which unchecked claims are acceptable, allow-lists.

Read with the standard library only (``tomllib``), so a holder can load it without the rest of core.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_POLICY_PATH", "EvidencePolicy", "GpuPolicy", "PolicyError", "SnpPolicy", "TdxPolicy",
           "load_evidence_policy"]

DEFAULT_POLICY_PATH = Path(__file__).resolve().parent.parent / "policy" / "evidence.toml"
TCB_STATUSES = ("UpToDate", "SWHardeningNeeded", "ConfigurationNeeded", "ConfigurationAndSWHardeningNeeded",
                "OutOfDate", "OutOfDateConfigurationNeeded", "Revoked")


class PolicyError(ValueError):
    """The policy file is missing, not TOML, or has an unknown key or a wrong type."""


@dataclass(frozen=True, slots=True)
class GpuPolicy:
    expected_arch: tuple[str, ...] = ("HOPPER",)
    require_rims: bool = True
    accept_ocsp_not_checked: bool = True
    device_root: Path | None = None  # None: NVIDIA's Device Identity CA (shipped); else a PEM file (the SIM root)
    rim_root: Path | None = None  # None: NVIDIA's RIM root (shipped); else a PEM file


@dataclass(frozen=True, slots=True)
class TdxPolicy:
    tcb_status: tuple[str, ...] = ("UpToDate",)
    root_ca: Path | None = None  # None: Intel's SGX root CA (inside dcap-qvl); else a DER or PEM file
    mr_td: tuple[str, ...] = ()
    rtmrs: tuple[tuple[str, ...], ...] = ((), (), (), ())
    #: the minimum TEE_TCB_SVN (16 bytes, lowercase hex), compared byte by byte; "" = any (claim tee-tcb-svn)
    min_tee_tcb_svn: str = ""
    #: the most days since the TCB info's issueDate at the verification time; None = any (claim collateral-age)
    max_collateral_age_days: int | None = None


SNP_TCB_PARTS = ("boot_loader", "tee", "snp", "microcode", "fmc")


@dataclass(frozen=True, slots=True)
class SnpPolicy:
    ark: Path | None = None  # None: AMD's ARK for the product (shipped); else a DER or PEM file (the SIM root)
    ask: Path | None = None  # None: AMD's ASK for the product (shipped); else a file
    asvk: Path | None = None  # the ASVK that signs VLEKs (none shipped); a file
    vmpl: tuple[int, ...] = (0,)
    min_tcb: tuple[tuple[str, int], ...] = ()
    measurement: tuple[str, ...] = ()
    host_data: tuple[str, ...] = ()
    id_key_digest: tuple[str, ...] = ()
    #: guest policy bit 16 (SMT allowed) / bit 18 (migration agent allowed): False refuses a guest that allows it,
    #: True accepts it, None (unset) accepts it and says so (claims guest-no-smt, guest-no-migration-agent)
    allow_smt: bool | None = None
    allow_migration_agent: bool | None = None
    #: AMD's CRL for the product (KDS ``/vcek/v1/<product>/crl``, DER or PEM, signed by the ARK): a file, or None
    crl: Path | None = None
    #: True: a report is refused unless ``crl`` is given and checked; False (default): unchecked revocation is
    #: accepted, a waiver the verdict names (claim cert-chain-not-revoked)
    require_crl: bool = False


@dataclass(frozen=True, slots=True)
class EvidencePolicy:
    gpu: GpuPolicy = field(default_factory=GpuPolicy)
    tdx: TdxPolicy = field(default_factory=TdxPolicy)
    snp: SnpPolicy = field(default_factory=SnpPolicy)


def _strs(section: str, key: str, value: Any, *, lower: bool = False) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PolicyError(f"[{section}] {key} must be a list of strings")
    return tuple(v.lower() for v in value) if lower else tuple(value)


def _bool(section: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise PolicyError(f"[{section}] {key} must be true or false")
    return value


def _root(section: str, key: str, value: Any, base: Path) -> Path | None:
    """``"nvidia"``/``"intel"`` (the vendor's root) or a certificate file, relative to the policy file."""
    if not isinstance(value, str) or not value:
        raise PolicyError(f"[{section}] {key} must be a string: the vendor's name or a certificate file")
    if value in ("nvidia", "intel", "amd"):
        return None
    path = (base / value).resolve()
    if not path.is_file():
        raise PolicyError(f"[{section}] {key}: no certificate file at {path}")
    return path


def load_evidence_policy(path: Path | None = None) -> EvidencePolicy:
    """Parse the policy file (default: the shipped one).

    Raises:
        PolicyError: unreadable, not TOML, unknown section or key, wrong type, unknown TCB status.
    """
    path = path or DEFAULT_POLICY_PATH
    try:
        doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read ({exc.strerror})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{path}: not TOML ({exc})") from exc
    unknown = set(doc) - {"nvidia-gpu", "intel-tdx", "amd-snp"}
    if unknown:
        raise PolicyError(f"{path}: unknown section(s) {sorted(unknown)}")
    base = Path(path).resolve().parent
    g = dict(doc.get("nvidia-gpu", {}))
    t = dict(doc.get("intel-tdx", {}))
    bad = (set(g) - {"expected_arch", "require_rims", "accept_ocsp_not_checked", "device_root", "rim_root"}) | \
          (set(t) - {"tcb_status", "mr_td", "rtmr0", "rtmr1", "rtmr2", "rtmr3", "root_ca", "min_tee_tcb_svn",
                     "max_collateral_age_days"})
    if bad:
        raise PolicyError(f"{path}: unknown key(s) {sorted(bad)}")
    gpu = GpuPolicy(
        expected_arch=_strs("nvidia-gpu", "expected_arch", g.get("expected_arch", ["HOPPER"])),
        require_rims=_bool("nvidia-gpu", "require_rims", g.get("require_rims", True)),
        accept_ocsp_not_checked=_bool("nvidia-gpu", "accept_ocsp_not_checked", g.get("accept_ocsp_not_checked", True)),
        device_root=_root("nvidia-gpu", "device_root", g.get("device_root", "nvidia"), base),
        rim_root=_root("nvidia-gpu", "rim_root", g.get("rim_root", "nvidia"), base),
    )
    statuses = _strs("intel-tdx", "tcb_status", t.get("tcb_status", ["UpToDate"]))
    if set(statuses) - set(TCB_STATUSES):
        raise PolicyError(f"{path}: unknown TCB status(es) {sorted(set(statuses) - set(TCB_STATUSES))}")
    tdx = TdxPolicy(
        tcb_status=statuses,
        mr_td=_strs("intel-tdx", "mr_td", t.get("mr_td", []), lower=True),
        rtmrs=tuple(_strs("intel-tdx", f"rtmr{i}", t.get(f"rtmr{i}", []), lower=True) for i in range(4)),
        root_ca=_root("intel-tdx", "root_ca", t.get("root_ca", "intel"), base),
        min_tee_tcb_svn=_tee_tcb_svn(t.get("min_tee_tcb_svn", "")),
        max_collateral_age_days=_days(t.get("max_collateral_age_days")),
    )
    return EvidencePolicy(gpu=gpu, tdx=tdx, snp=_snp_policy(dict(doc.get("amd-snp", {})), path, base))


def _tee_tcb_svn(value: Any) -> str:
    """``min_tee_tcb_svn``: 16 bytes as 32 hex digits ('' when unset)."""
    if not isinstance(value, str) or (value and (len(value) != 32 or any(c not in "0123456789abcdefABCDEF"
                                                                        for c in value))):
        raise PolicyError("[intel-tdx] min_tee_tcb_svn must be 16 bytes as 32 hex digits (the TD report's "
                          "TEE_TCB_SVN, byte by byte: e.g. \"06010300000000000000000000000000\")")
    return value.lower()


def _days(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PolicyError("[intel-tdx] max_collateral_age_days must be a whole number of days, 0 or more")
    return value


def _allow(key: str, value: Any) -> bool | None:
    return None if value is None else _bool("amd-snp", key, value)


def _snp_policy(s: dict[str, Any], path: Path, base: Path) -> SnpPolicy:
    """``[amd-snp]``: roots, VMPLs, minimum TCB (an inline table of SPLs), allow-lists."""
    bad = set(s) - {"ark", "ask", "asvk", "vmpl", "min_tcb", "measurement", "host_data", "id_key_digest",
                    "allow_smt", "allow_migration_agent", "crl", "require_crl"}
    if bad:
        raise PolicyError(f"{path}: unknown key(s) {sorted(bad)}")
    vmpl = s.get("vmpl", [0])
    if not isinstance(vmpl, list) or not all(isinstance(v, int) and 0 <= v <= 3 for v in vmpl):
        raise PolicyError("[amd-snp] vmpl must be a list of VMPLs 0..3")
    tcb = s.get("min_tcb", {})
    if not isinstance(tcb, dict) or set(tcb) - set(SNP_TCB_PARTS) or \
            not all(isinstance(v, int) and 0 <= v <= 255 for v in tcb.values()):
        raise PolicyError(f"[amd-snp] min_tcb must be a table of SPLs 0..255 named {', '.join(SNP_TCB_PARTS)}")
    asvk, crl = s.get("asvk"), s.get("crl")
    if crl is not None and (not isinstance(crl, str) or not (base / crl).is_file()):
        raise PolicyError(f"[amd-snp] crl: no CRL file at {base / str(crl)} (AMD's, from KDS /vcek/v1/<product>/crl)")
    return SnpPolicy(
        ark=_root("amd-snp", "ark", s.get("ark", "amd"), base),
        ask=_root("amd-snp", "ask", s.get("ask", "amd"), base),
        asvk=None if asvk is None else _root("amd-snp", "asvk", asvk, base),
        vmpl=tuple(vmpl),
        min_tcb=tuple(sorted(tcb.items())),
        measurement=_strs("amd-snp", "measurement", s.get("measurement", []), lower=True),
        host_data=_strs("amd-snp", "host_data", s.get("host_data", []), lower=True),
        id_key_digest=_strs("amd-snp", "id_key_digest", s.get("id_key_digest", []), lower=True),
        allow_smt=_allow("allow_smt", s.get("allow_smt")),
        allow_migration_agent=_allow("allow_migration_agent", s.get("allow_migration_agent")),
        crl=None if crl is None else (base / crl).resolve(),
        require_crl=_bool("amd-snp", "require_crl", s.get("require_crl", False)),
    )
