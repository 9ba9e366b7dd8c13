"""A data holder's own configuration (issue 30): what it trusts, written by the holder, read by ``holder serve``.

The folder is the holder's XDG config folder (``$XDG_CONFIG_HOME/gputravel/holder``, by default
``~/.config/gputravel/holder``), 0700, every file in it 0600::

    holder.toml      name, data folder, val_fraction, accepted hand-offs, accept_any_td
    evidence.toml    the evidence policy (``core.evidence.policy``), its roots named by the files below
    roots/*.pem      the pinned roots that are files (a SIM platform's); "nvidia" is copied from the install
    golden.json      the GPU's golden measurements the holder approved
    receipts/RUN/    what each visit sent, with the verdict it gave (``receipts``)

Nothing the orchestrator sends changes any of it: ``holder serve`` reads this folder and nothing else decides
what it trusts. ``policy_sha256`` is the SHA-256 over a canonical description of everything trust-relevant
(the evidence policy with its roots by fingerprint, the golden measurements, the accepted hand-offs), so two
holders with the same digest check the same things. Standard library and ``cryptography`` only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from gputravel.core.evidence.holder_check import (
    NVIDIA_DEVICE_ROOT,
    EvidencePolicy,
    PolicyError,
    load_evidence_policy,
    load_golden,
)
from gputravel.core.protocol.errors import ConfigError

__all__ = ["CONFIG_NAME", "HolderConfig", "default_config_dir", "init_config",
           "policy_summary"]

CONFIG_NAME = "holder.toml"
POLICY_NAME = "evidence.toml"
GOLDEN_NAME = "golden.json"
ROOTS_DIR = "roots"
RECEIPTS_DIR = "receipts"
#: what the holder's key may be asked for: the sealed paths always; "conventional" only where allowed
HANDOFFS = ("direct", "channel", "conventional")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def default_config_dir() -> Path:
    """``$XDG_CONFIG_HOME/gputravel/holder`` (``~/.config/gputravel/holder`` when unset or relative)."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".config"
    return root / "gputravel" / "holder"


def _fingerprint(pem_or_der: bytes) -> str:
    """``sha256:`` + hex of the certificate's DER."""
    if b"-----BEGIN CERTIFICATE-----" in pem_or_der:
        der = x509.load_pem_x509_certificate(pem_or_der).public_bytes(Encoding.DER)
    else:
        der = x509.load_der_x509_certificate(pem_or_der).public_bytes(Encoding.DER)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def _subject(pem_or_der: bytes) -> str:
    if b"-----BEGIN CERTIFICATE-----" in pem_or_der:
        return x509.load_pem_x509_certificate(pem_or_der).subject.rfc4514_string()
    return x509.load_der_x509_certificate(pem_or_der).subject.rfc4514_string()


def _root_fp(path: Path | None, vendor: str) -> str:
    return _fingerprint(path.read_bytes()) if path is not None else vendor


def policy_summary(policy: EvidencePolicy, golden: dict[int, tuple[bytes, ...]], *, allow_conventional: bool,
                   accept_any_td: bool) -> tuple[str, dict[str, str]]:
    """``(policy_sha256, roots)``: the digest over everything a verdict depends on, and the pinned roots by
    fingerprint (``{"gpu": "sha256:...", "tdx": "sha256:..." or "intel (dcap-qvl built-in)"}``). Version 2 covers
    ``[amd-snp]`` too (an SNP orchestrator CVM is checked under it)."""
    gpu_root = policy.gpu.device_root or NVIDIA_DEVICE_ROOT
    roots = {"gpu": _fingerprint(gpu_root.read_bytes()),
             "tdx": _fingerprint(policy.tdx.root_ca.read_bytes()) if policy.tdx.root_ca is not None
             else "intel (dcap-qvl built-in Intel SGX Root CA)"}
    snp = policy.snp
    doc = {"v": 2, "roots": roots, "gpu": {"expected_arch": list(policy.gpu.expected_arch)},
           "tdx": {"tcb_status": list(policy.tdx.tcb_status), "mr_td": list(policy.tdx.mr_td),
                   "rtmrs": [list(r) for r in policy.tdx.rtmrs], "min_tee_tcb_svn": policy.tdx.min_tee_tcb_svn,
                   "max_collateral_age_days": policy.tdx.max_collateral_age_days},
           "snp": {"ark": _root_fp(snp.ark, "amd"), "ask": _root_fp(snp.ask, "amd"),
                   "asvk": _root_fp(snp.asvk, "none"), "vmpl": list(snp.vmpl), "min_tcb": dict(snp.min_tcb),
                   "measurement": list(snp.measurement), "host_data": list(snp.host_data),
                   "id_key_digest": list(snp.id_key_digest), "allow_smt": snp.allow_smt,
                   "allow_migration_agent": snp.allow_migration_agent, "require_crl": snp.require_crl,
                   "crl": "sha256:" + hashlib.sha256(snp.crl.read_bytes()).hexdigest() if snp.crl else None},
           "golden": {str(i): [v.hex() for v in vs] for i, vs in sorted(golden.items())},
           "allow_conventional": allow_conventional, "accept_any_td": accept_any_td}
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return digest, roots


@dataclass(frozen=True, slots=True)
class HolderConfig:
    """The holder's configuration as ``holder serve`` uses it."""

    folder: Path
    name: str
    data: Path
    val_fraction: float
    allow_conventional: bool
    accept_any_td: bool
    policy: EvidencePolicy
    golden: dict[int, tuple[bytes, ...]]
    policy_sha256: str
    roots: dict[str, str]

    @property
    def policy_path(self) -> Path:
        return self.folder / POLICY_NAME

    @property
    def golden_path(self) -> Path:
        return self.folder / GOLDEN_NAME

    @property
    def receipts(self) -> Path:
        return self.folder / RECEIPTS_DIR

    @property
    def mr_td_policy(self) -> str:
        """``"any"`` (the holder accepted any TD image) or ``"pinned"``."""
        return "pinned" if self.policy.tdx.mr_td else "any"

    @property
    def handoffs(self) -> list[str]:
        return [h for h in HANDOFFS if h != "conventional" or self.allow_conventional]

    @classmethod
    def load(cls, folder: Path | None = None) -> HolderConfig:
        """Read and check the folder: 0700 and the holder's own, files 0600, the policy and golden parse, an
        empty MRTD allow-list only with ``accept_any_td``. Raises ``ConfigError`` naming the problem."""
        folder = Path(folder or default_config_dir())
        path = folder / CONFIG_NAME
        try:
            st = folder.stat()
        except OSError:
            raise ConfigError(f"no holder configuration at {folder}: run `gputravel holder init --data DIR` "
                                    "first") from None
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ConfigError(f"{folder} must be this user's and 0700 (it is {st.st_mode & 0o777:o}): "
                                    f"chmod 700 {folder}")
        for f in (path, folder / POLICY_NAME, folder / GOLDEN_NAME):
            try:
                fst = f.stat()
            except OSError:
                raise ConfigError(f"{f} is missing: run `gputravel holder init` again") from None
            if fst.st_uid != os.getuid() or fst.st_mode & 0o077:
                raise ConfigError(f"{f} must be this user's and 0600 (it is {fst.st_mode & 0o777:o})")
        try:
            doc = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: not readable TOML ({exc})") from None
        unknown = set(doc) - {"name", "data", "val_fraction", "allow_conventional", "accept_any_td"}
        if unknown:
            raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}")
        try:
            name, data = str(doc["name"]), Path(str(doc["data"]))
            val_fraction = float(doc.get("val_fraction", 0.1))
            allow_conv, any_td = bool(doc.get("allow_conventional", False)), bool(doc.get("accept_any_td", False))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: missing or malformed field ({exc})") from None
        try:
            policy = load_evidence_policy(folder / POLICY_NAME)
            golden = load_golden(folder / GOLDEN_NAME)
        except ValueError as exc:  # PolicyError too
            raise ConfigError(str(exc)) from None
        if not policy.gpu.accept_ocsp_not_checked:
            raise ConfigError(f"{folder / POLICY_NAME}: accept_ocsp_not_checked = false, but the holder's agent "
                              "does no OCSP (it reaches no NVIDIA service): every GPU would be refused. Set it "
                              "back to true (the waiver `gputravel holder policy show` names) and check the GPU "
                              "chain's revocation yourself: `gputravel attest --evidence ... --ocsp-url URL`")
        if not policy.tdx.mr_td and not any_td:
            raise ConfigError(f"{folder / POLICY_NAME}: the MRTD allow-list is empty (any TD image would pass): "
                                    "pin the orchestrator CVM's MRTD, or init again with --accept-any-td")
        digest, roots = policy_summary(policy, golden, allow_conventional=allow_conv, accept_any_td=any_td)
        return cls(folder=folder, name=name, data=data, val_fraction=val_fraction, allow_conventional=allow_conv,
                   accept_any_td=any_td, policy=policy, golden=golden, policy_sha256=digest, roots=roots)

    def to_dict(self) -> dict[str, Any]:
        """What ``holder show --json`` prints."""
        return {"folder": str(self.folder), "name": self.name, "data": str(self.data),
                "val_fraction": self.val_fraction, "handoffs": self.handoffs,
                "allow_conventional": self.allow_conventional, "mr_td_policy": self.mr_td_policy,
                "mr_td": list(self.policy.tdx.mr_td), "tcb_status": list(self.policy.tdx.tcb_status),
                "expected_arch": list(self.policy.gpu.expected_arch),
                "golden_measurements": sum(len(v) for v in self.golden.values()),
                "policy_sha256": self.policy_sha256, "roots": self.roots,
                "root_subjects": self._root_subjects(), "receipts": str(self.receipts)}

    def _root_subjects(self) -> dict[str, str]:
        gpu = self.policy.gpu.device_root or NVIDIA_DEVICE_ROOT
        out = {"gpu": _subject(gpu.read_bytes())}
        out["tdx"] = (_subject(self.policy.tdx.root_ca.read_bytes()) if self.policy.tdx.root_ca is not None
                      else "Intel SGX Root CA (built into dcap-qvl)")
        return out


# --- init ---------------------------------------------------------------------------------------------------------
def _toml_str(value: str) -> str:
    return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's


def _toml_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(_toml_str(v) for v in values) + "]"


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _toml_table(items: tuple[tuple[str, int], ...]) -> str:
    return "{" + ", ".join(f"{k} = {v}" for k, v in items) + "}"


def _policy_text(policy: EvidencePolicy, roots: dict[str, str]) -> str:
    """The holder's ``evidence.toml``: every key the agent reads, its roots as files under ``roots/`` (or the
    vendor's), with the waivers it holds said in comments (``gputravel holder policy show`` lists them all)."""
    t, s = policy.tdx, policy.snp
    lines = ["# The holder's own evidence policy (gputravel holder init). Roots: files under roots/, or the vendor's.",
             "# `gputravel holder policy show` lists every check below, what it accepts, and the waivers.",
             "[nvidia-gpu]", f"expected_arch = {_toml_list(policy.gpu.expected_arch)}",
             "# not read by the holder's agent: it compares golden.json's values, not RIMs",
             f"require_rims = {str(policy.gpu.require_rims).lower()}",
             "# WAIVER: the agent does no OCSP (it reaches no NVIDIA service), so the GPU chain's revocation is not",
             "# checked; false is refused. Check it yourself: gputravel attest --evidence ... --ocsp-url URL",
             "accept_ocsp_not_checked = true",
             f"device_root = {_toml_str(roots['gpu'])}", 'rim_root = "nvidia"', "", "[intel-tdx]",
             f"root_ca = {_toml_str(roots['tdx'])}", f"tcb_status = {_toml_list(t.tcb_status)}",
             "# allow-lists, lowercase hex; empty = any value accepted (not checked)",
             f"mr_td = {_toml_list(t.mr_td)}"]
    lines += [f"rtmr{i} = {_toml_list(r)}" for i, r in enumerate(t.rtmrs)]
    lines.append("# unset = any value accepted (not checked): min_tee_tcb_svn = \"<32 hex digits>\" (byte by byte), "
                 "max_collateral_age_days = N")
    if t.min_tee_tcb_svn:
        lines.append(f"min_tee_tcb_svn = {_toml_str(t.min_tee_tcb_svn)}")
    if t.max_collateral_age_days is not None:
        lines.append(f"max_collateral_age_days = {t.max_collateral_age_days}")
    lines += ["", "[amd-snp]", f"ark = {_toml_str(roots['snp_ark'])}", f"ask = {_toml_str(roots['snp_ask'])}"]
    if "snp_asvk" in roots:
        lines.append(f"asvk = {_toml_str(roots['snp_asvk'])}")
    lines += [f"vmpl = [{', '.join(map(str, s.vmpl))}]", f"min_tcb = {_toml_table(s.min_tcb)}",
              "# allow-lists, lowercase hex; empty = any value accepted (not checked)",
              f"measurement = {_toml_list(s.measurement)}", f"host_data = {_toml_list(s.host_data)}",
              f"id_key_digest = {_toml_list(s.id_key_digest)}",
              "# guest policy bits 16 (SMT) and 18 (migration agent): false refuses a guest that allows it; "
              "unset = accepted (not checked)"]
    lines += [f"{key} = {str(value).lower()}" for key, value in (("allow_smt", s.allow_smt),
                                                                 ("allow_migration_agent", s.allow_migration_agent))
              if value is not None]
    lines += ["# AMD's CRL (KDS /vcek/v1/<product>/crl, signed by the ARK): checked when named; require_crl = false",
              "# accepts a report whose revocation is not checked (a WAIVER when no crl is named)",
              f"require_crl = {str(s.require_crl).lower()}"]
    if "snp_crl" in roots:
        lines.append(f"crl = {_toml_str(roots['snp_crl'])}")
    return "\n".join(lines) + "\n"


def _copy_roots(pol: EvidencePolicy, roots: Path) -> dict[str, str]:
    """Copy the policy's root files into ``roots/``; ``{name: what evidence.toml says}`` (a file or the vendor)."""
    if roots.exists():
        shutil.rmtree(roots)
    roots.mkdir(mode=0o700)
    named: dict[str, str] = {}
    for name, path, file, vendor in (("gpu", pol.gpu.device_root or NVIDIA_DEVICE_ROOT, "gpu-device-root.pem", ""),
                                     ("tdx", pol.tdx.root_ca, "tdx-root.crt", "intel"),
                                     ("snp_ark", pol.snp.ark, "snp-ark.crt", "amd"),
                                     ("snp_ask", pol.snp.ask, "snp-ask.crt", "amd"),
                                     ("snp_asvk", pol.snp.asvk, "snp-asvk.crt", ""),
                                     ("snp_crl", pol.snp.crl, "snp.crl", "")):
        if path is None:
            if vendor:
                named[name] = vendor
            continue
        _write_private(roots / file, path.read_bytes())
        named[name] = f"{ROOTS_DIR}/{file}"
    return named


def init_config(*, data: Path, folder: Path | None = None, name: str | None = None, policy: Path | None = None,
                golden: Path | None = None, allow_conventional: bool = False, accept_any_td: bool = False,
                val_fraction: float = 0.1) -> HolderConfig:
    """Write the holder's configuration (0600 files in a 0700 folder) and return it as ``holder serve`` reads it.

    ``policy``: an evidence policy file (default: the shipped one, NVIDIA's and Intel's roots); its root files are
    copied into ``roots/`` so that the configuration stands alone. ``golden``: the GPU measurements the holder
    approved (without it every GPU fails ``measres``: refused unless the policy... is the holder's to fix).
    Raises ``ConfigError``: an unreadable policy or golden file, a data folder that does not exist, an
    empty MRTD allow-list without ``accept_any_td``."""
    folder = Path(folder or default_config_dir())
    data = Path(data).expanduser().resolve()
    try:
        if not data.is_dir():
            raise ConfigError(f"--data {data}: not a folder")
        next(data.iterdir(), None)
    except PermissionError:
        raise ConfigError(f"--data {data}: this user ({_login_name()}) cannot read it; the agent runs as this "
                          "user: give it read access (or run init as the data's owner)") from None
    who = name or _login_name()
    if not _NAME.match(who):
        raise ConfigError(f"--name {who!r}: letters, digits, '.', '_', '-' only (at most 64)")
    if not 0 < val_fraction < 0.5:
        raise ConfigError(f"--val-fraction {val_fraction}: must be in (0, 0.5)")
    try:
        pol = load_evidence_policy(policy.expanduser() if policy else None)
    except PolicyError as exc:
        raise ConfigError(f"--policy: {exc}") from None
    if not pol.tdx.mr_td and not accept_any_td:
        raise ConfigError(f"the evidence policy {policy or 'shipped with gputravel'} has an empty MRTD "
                                "allow-list: any TD image would pass. Pin the orchestrator CVM's MRTD "
                                "([intel-tdx] mr_td) or pass --accept-any-td (every verdict then says "
                                '"mr_td_policy": "any")')
    golden_bytes = b'{"measurements": []}\n'
    if golden is not None:
        try:
            load_golden(golden.expanduser())
            golden_bytes = golden.expanduser().read_bytes()
        except (ValueError, OSError) as exc:
            raise ConfigError(f"--golden: {exc}") from None
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    named = _copy_roots(pol, folder / ROOTS_DIR)
    _write_private(folder / POLICY_NAME, _policy_text(pol, named).encode())
    _write_private(folder / GOLDEN_NAME, golden_bytes)
    text = "\n".join([
        "# The holder's own configuration (gputravel holder init); read by `gputravel holder serve` only.",
        f"name = {_toml_str(who)}", f"data = {_toml_str(str(data))}", f"val_fraction = {val_fraction!r}",
        f"allow_conventional = {str(allow_conventional).lower()}", f"accept_any_td = {str(accept_any_td).lower()}"])
    _write_private(folder / CONFIG_NAME, (text + "\n").encode())
    (folder / RECEIPTS_DIR).mkdir(mode=0o700, exist_ok=True)
    return HolderConfig.load(folder)


def _login_name() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return os.environ.get("USER", "holder")
