"""The emulated vendors' PKI of a fleet, SIM only, carried to every node as one file.

Real GPUs arrive certified by their vendor and real CVMs quote under Intel's root: nothing travels. The emulated
platform has to make those vendors up, once, and every node of a fleet must trust the same ones, so
``gputravel fleet pki export FILE`` writes them (the emulated GPU vendor's root and device CA with their keys, and
the SIM TDX PKI that signs the CVMs' quotes, with its SIM evidence policy) and ``gputravel run --nnodes H
--sim-pki FILE`` installs them into that node's own run folder (``vendor/`` and ``sim-cvm/vendor-formats/``). The file
holds the SIM vendors' private keys (0600): it stands for the vendors' factories, not for anything secret of a run;
the fleet key never touches it (``core/fleet/keyagree.py``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from gputravel.core.errors import ConfigError
from gputravel.core.runfolder.folder import RunFolder

__all__ = ["SIM_PKI_FORMAT", "export_sim_pki", "install_sim_pki", "local_sim_pki"]

SIM_PKI_FORMAT = "gputravel-sim-pki-v1"
_FORMATS = "vendor-formats"


def _files(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")}


def _generate() -> dict[str, Any]:
    from gputravel.core.attestation import VendorCA
    from gputravel.core.evidence import sim_store

    with tempfile.TemporaryDirectory(prefix="gputravel-sim-pki-") as tmp:
        VendorCA.generate().save(Path(tmp) / "vendor")
        _, tdx, _ = sim_store.load_or_create(Path(tmp) / "sim-tdx")
        return {"format": SIM_PKI_FORMAT, "sim": True,
                "note": "SIM: the emulated GPU vendor's and the SIM TDX PKI, with their private keys; "
                        "never real hardware's",
                "vendor": _files(Path(tmp) / "vendor"), "cvm": _files(Path(tmp) / "sim-tdx" / _FORMATS),
                "mr_td": tdx.mr_td.hex()}


def export_sim_pki(path: Path) -> dict[str, Any]:
    """Make the SIM vendors' PKI and write it to ``path`` (0600; an existing file is refused); what it holds."""
    path = Path(path)
    doc = _generate()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} exists: a SIM PKI is made once and carried to every node; not overwritten") from None
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
    return {"path": str(path), "sim": True, "mr_td": doc["mr_td"], "files": sorted([*doc["vendor"], *doc["cvm"]])}


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--sim-pki {path}: not readable as a SIM PKI file ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != SIM_PKI_FORMAT or doc.get("sim") is not True:
        raise ConfigError(f"--sim-pki {path}: not a {SIM_PKI_FORMAT} file (gputravel fleet pki export FILE)")
    for part in ("vendor", "cvm"):
        files = doc.get(part)
        if not isinstance(files, dict) or not all(isinstance(v, str) and "/" not in k and not k.startswith(".")
                                                  for k, v in files.items()):
            raise ConfigError(f"--sim-pki {path}: its {part!r} part is not a set of files")
    return doc


def _install(folder: Path, files: dict[str, str], what: str) -> None:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name, text in files.items():
        target = folder / name
        if target.exists():
            if target.read_text() != text:
                raise ConfigError(f"{target} differs from the --sim-pki file's: this run folder trusts another "
                                  f"{what}; use a fresh --out")
            continue
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if name.endswith(".key") else 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)


def install_sim_pki(path: Path, out: RunFolder) -> None:
    """Install the SIM PKI file into this node's run folder (``vendor/``, ``sim-cvm/vendor-formats/``).

    Raises:
        ConfigError: not a SIM PKI file, or the folder already trusts another one.
    """
    doc = _read(path)
    _install(out.vendor, doc["vendor"], "emulated GPU vendor")
    _install(out.cvm / _FORMATS, doc["cvm"], "SIM TDX PKI")


def local_sim_pki(out: RunFolder) -> None:
    """A one-node fleet without ``--sim-pki``: the SIM PKI made in its own folder (kept on ``--resume``)."""
    if (out.vendor / "root.pem").exists() and (out.cvm / _FORMATS).is_dir():
        return
    doc = _generate()
    _install(out.vendor, doc["vendor"], "emulated GPU vendor")
    _install(out.cvm / _FORMATS, doc["cvm"], "SIM TDX PKI")
