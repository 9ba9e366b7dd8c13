"""The SIM platform's vendor-format identities, kept between runs in the emulated state folder.

``<state>/vendor-formats/`` holds the SIM GPU's 5-certificate chain and leaf key, the SIM RIM root and signer,
the SIM TDX PKI (root, PCK platform CA, PCK, TCB signer) and attestation key, the SIM SEV-SNP chip (ARK, ASK,
VCEK and its key) with an Azure-style vTPM attestation key, and ``sim-evidence.toml``: an
evidence policy that pins the SIM roots (so ``gputravel attest --evidence ... --policy`` it verifies SIM evidence,
and the shipped policy, which pins NVIDIA's and Intel's, refuses it). Private keys are written 0600 in a 0700
folder, never in the repository. A folder that is incomplete or unreadable is made anew.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from .sim_gpu import SimGpu, SimGpuPki
from .sim_snp import SimAzureVm, SimSnp
from .sim_tdx import TEMPLATE_DIR, SimTdx, SimTdxPki
from .snp import load_certificate
from .snp_report import Tcb

__all__ = ["SIM_POLICY_NAME", "load_or_create", "load_or_create_snp"]

SIM_POLICY_NAME = "sim-evidence.toml"
_SIM_POLICY = """# Evidence policy for the SIM platform's vendor-format evidence (written by gputravel; SIM roots pinned).
[nvidia-gpu]
expected_arch = ["HOPPER"]
require_rims = true
device_root = "gpu-root.crt"
rim_root = "rim-root.crt"

[intel-tdx]
root_ca = "tdx-root.crt"
tcb_status = ["UpToDate"]
"""
_SIM_SNP_POLICY = """
[amd-snp]
ark = "snp-ark.crt"
ask = "snp-ask.crt"
"""


def _write(path: Path, data: bytes, *, secret: bool = False) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _pem(*certs: x509.Certificate) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


def _certs(path: Path) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(path.read_bytes())


def _key(folder: Path, name: str) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key((folder / f"{name}.key").read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{name}.key is not an EC key")
    return key


def _save(folder: Path, gpu: SimGpu, tdx: SimTdx) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    keys = {"gpu-leaf": gpu.pki.leaf_key, "rim-signer": gpu.pki.rim_key, "tdx-root": tdx.pki.root_key,
            "tdx-pck-ca": tdx.pki.pck_ca_key, "tdx-pck": tdx.pki.pck_key, "tdx-tcb": tdx.pki.tcb_key,
            "tdx-attestation": tdx.attestation_key}
    for name, key in keys.items():
        _write(folder / f"{name}.key", key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()), secret=True)
    _write(folder / "gpu-chain.pem", _pem(*gpu.pki.chain))
    _write(folder / "rim-chain.pem", _pem(*gpu.pki.rim_chain))
    _write(folder / "tdx-pki.pem", _pem(tdx.pki.root, tdx.pki.pck_ca, tdx.pki.pck, tdx.pki.tcb_signer))
    _write(folder / "gpu-root.crt", _pem(gpu.pki.device_root))
    _write(folder / "rim-root.crt", _pem(gpu.pki.rim_root))
    _write(folder / "tdx-root.crt", _pem(tdx.pki.root))
    _write(folder / "gpu.json", json.dumps({"fwid": gpu.fwid.hex(), "measurements": [m.hex() for m in
                                                                                      gpu.measurements]}).encode())
    _write(folder / SIM_POLICY_NAME, _SIM_POLICY.encode())
    _ensure_policy(folder)


def _load(folder: Path) -> tuple[SimGpu, SimTdx]:
    gpu_doc = json.loads((folder / "gpu.json").read_text())
    chain = _certs(folder / "gpu-chain.pem")
    pki = SimGpuPki(chain=chain, leaf_key=_key(folder, "gpu-leaf"), rim_chain=_certs(folder / "rim-chain.pem"),
                    rim_key=_key(folder, "rim-signer"))
    gpu = SimGpu(pki=pki, fwid=bytes.fromhex(gpu_doc["fwid"]),
                 measurements=[bytes.fromhex(m) for m in gpu_doc["measurements"]])
    root, pck_ca, pck, tcb = _certs(folder / "tdx-pki.pem")
    tdx_pki = SimTdxPki(root=root, root_key=_key(folder, "tdx-root"), pck_ca=pck_ca,
                        pck_ca_key=_key(folder, "tdx-pck-ca"), pck=pck, pck_key=_key(folder, "tdx-pck"),
                        tcb_signer=tcb, tcb_key=_key(folder, "tdx-tcb"))
    tdx = SimTdx(pki=tdx_pki, template_quote=(TEMPLATE_DIR / "tdx_quote").read_bytes(),
                 template_collateral=json.loads((TEMPLATE_DIR / "tdx_quote_collateral.json").read_text()),
                 attestation_key=_key(folder, "tdx-attestation"))
    return gpu, tdx


def _private(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _save_snp(folder: Path, vm: SimAzureVm) -> None:
    chip = vm.chip
    _write(folder / "snp-vcek.key", _private(chip.vcek_key), secret=True)
    _write(folder / "snp-ak.key", _private(vm.ak), secret=True)
    _write(folder / "snp-vcek.pem", _pem(chip.vcek))
    _write(folder / "snp.json", json.dumps({"product": chip.product, "tcb": chip.tcb.to_json(),
                                            "chip_id": chip.chip_id.hex()}).encode())
    _write(folder / "snp-ark.crt", _pem(chip.ark))  # written last: the policy names them
    _write(folder / "snp-ask.crt", _pem(chip.ask))


def _load_snp(folder: Path) -> SimAzureVm:
    doc = json.loads((folder / "snp.json").read_text())
    ak = serialization.load_pem_private_key((folder / "snp-ak.key").read_bytes(), password=None)
    if not isinstance(ak, rsa.RSAPrivateKey):
        raise ValueError("snp-ak.key is not an RSA key")
    chip = SimSnp(product=str(doc["product"]), tcb=Tcb(**doc["tcb"]), chip_id=bytes.fromhex(doc["chip_id"]),
                  ark=load_certificate((folder / "snp-ark.crt").read_bytes()),
                  ask=load_certificate((folder / "snp-ask.crt").read_bytes()),
                  vcek=load_certificate((folder / "snp-vcek.pem").read_bytes()), vcek_key=_key(folder, "snp-vcek"))
    return SimAzureVm(chip=chip, ak=ak)


def _ensure_policy(folder: Path) -> Path:
    """The SIM policy, written if missing; its ``[amd-snp]`` section added once the SIM SNP chip exists (the
    policy names only files that exist: a root that is not a file is a policy error)."""
    policy = folder / SIM_POLICY_NAME
    if not policy.is_file():
        _write(policy, _SIM_POLICY.encode())
    text = policy.read_text(encoding="utf-8")
    if "[amd-snp]" not in text and (folder / "snp-ark.crt").is_file() and (folder / "snp-ask.crt").is_file():
        _write(policy, (text.rstrip("\n") + "\n" + _SIM_SNP_POLICY).encode())
    return policy


def load_or_create_snp(state_dir: Path) -> SimAzureVm:
    """The SIM SEV-SNP chip and Azure-style vTPM key of this state folder (made on first use: only runs with an
    SNP CVM pay for its RSA keys; a raw SNP CVM uses ``.chip``); the SIM policy's ``[amd-snp]`` then pins its ARK
    and ASK."""
    folder = Path(state_dir) / "vendor-formats"
    try:
        vm = _load_snp(folder)
    except (OSError, ValueError, KeyError, TypeError):
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        vm = SimAzureVm.generate()
        _save_snp(folder, vm)
    _ensure_policy(folder)
    return vm


def load_or_create(state_dir: Path) -> tuple[SimGpu, SimTdx, Path]:
    """The SIM GPU and TDX guest of this state folder (made on first use) and the SIM evidence policy's path."""
    folder = Path(state_dir) / "vendor-formats"
    try:
        gpu, tdx = _load(folder)
    except (OSError, ValueError, KeyError, TypeError):
        gpu, tdx = SimGpu.generate(), SimTdx.generate()
        _save(folder, gpu, tdx)
    return gpu, tdx, _ensure_policy(folder)
