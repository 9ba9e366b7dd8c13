"""The agent bundle: the files uploaded to a holder and the SHA-256 over them.

The deployer (``agents/deploy.py``) uploads exactly ``bundle_contents()`` and checks the hash the
holder recomputes; the agent reports ``agent_sha256()`` of its own copy in HELLO. Standard library only.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: The files of the agent bundle, relative to the ``gputravel`` package root: this package (the agent),
#: the protocol it speaks, and the SPDM/TDX part of ``core.evidence`` it attests with (issue 22 item 5; no
#: RIM/XML part: the holder's golden measurements are its operator's), nothing else. Every ``.py`` file of ``agents/holder/`` is here: the holder
#: recomputes the hash over every ``.py`` file it was sent (``deploy.REMOTE_HASH_SCRIPT``).
BUNDLE_FILES: tuple[str, ...] = (
    "__init__.py",
    "core/__init__.py",
    "core/protocol/__init__.py",
    "core/protocol/admission.py",
    "core/protocol/ckptring.py",
    "core/protocol/cipher.py",
    "core/protocol/deviceanswers.py",
    "core/protocol/devicelink.py",
    "core/protocol/errors.py",
    "core/protocol/frames.py",
    "core/protocol/holderattest.py",
    "core/protocol/holderlink.py",
    "core/protocol/keys.py",
    "core/protocol/keywrap.py",
    "core/protocol/shards.py",
    "core/protocol/shmring.py",
    "core/protocol/stream.py",
    "core/protocol/wire.py",
    "core/protocol/wirejson.py",
    "core/evidence/__init__.py",
    "core/evidence/azure_snp.py",
    "core/evidence/bounded.py",
    "core/evidence/claims.py",
    "core/evidence/cvm_snp.py",
    "core/evidence/holder_check.py",
    "core/evidence/nvidia_spdm.py",
    "core/evidence/policy.py",
    "core/evidence/snp.py",
    "core/evidence/snp_report.py",
    "core/evidence/spdm_claims.py",
    "core/evidence/tdx.py",
    "core/evidence/tdx_family.py",
    "agents/__init__.py",
    "agents/holder/__init__.py",
    "agents/holder/__main__.py",
    "agents/holder/agent.py",
    "agents/holder/attest.py",
    "agents/holder/authorize.py",
    "agents/holder/bundle.py",
    "agents/holder/config.py",
    "agents/holder/dataconn.py",
    "agents/holder/dataset.py",
    "agents/holder/link.py",
    "agents/holder/provision.py",
    "agents/holder/receipts.py",
    "agents/holder/relayed.py",
    "agents/holder/ring_bind.py",
    "agents/holder/serve.py",
)


def digest_files(files: list[tuple[str, bytes]]) -> str:
    """SHA-256 over (relative path, length, contents) of each file, in path order."""
    h = hashlib.sha256(b"gputravel-bundle-v1")
    for rel, data in sorted(files):
        h.update(rel.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


def package_root() -> Path:
    """The folder that is the ``gputravel`` package (the repository root in a checkout)."""
    return Path(__file__).resolve().parents[2]


def bundle_contents(root: Path | None = None) -> list[tuple[str, bytes]]:
    base = root or package_root()
    return [(f"gputravel/{rel}", (base / rel).read_bytes()) for rel in BUNDLE_FILES]


def agent_sha256() -> str:
    """Hash of the agent's own bundle, as the deployer computes it before upload."""
    return digest_files(bundle_contents())
