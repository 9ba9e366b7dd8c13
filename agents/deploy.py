"""Deploying holder agents over SSH (asyncssh): connecting, uploading the bundle, checking its hash. The link that
speaks to a deployed agent is ``agents/ssh_holder.py`` (``SshHolderLink``).

SSH stays at this edge: ``(OSError, asyncssh.Error)`` become ``AgentError(host, reason)`` here.
Host keys are always checked (pinned key or known_hosts), clients authenticate with their key,
connections have a timeout and keepalives. The agent bundle (the holder agent and
``core.protocol``, nothing else) is uploaded over SFTP into a folder named by its SHA-256, its hash
is recomputed on the holder by a script that does not import the bundle, and the agent's own report
of its hash must match before the engine releases any key to it.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath
from shlex import quote
from typing import Any

import asyncssh

from gputravel.agents.holder.bundle import bundle_contents, digest_files
from gputravel.agents.inventory import HolderSpec
from gputravel.core.errors import AgentError, ConfigError
from gputravel.core.travel.holders import HolderState

#: Runs on the holder with its own python; hashes what is on disk without importing it.
REMOTE_HASH_SCRIPT = r"""
import hashlib, os, sys
root = sys.argv[1]
if not os.path.isdir(os.path.join(root, "gputravel")):
    sys.exit(3)
files = []
for base, dirs, names in os.walk(os.path.join(root, "gputravel")):
    dirs[:] = [d for d in dirs if d != "__pycache__"]
    for n in names:
        if n.endswith(".py"):
            p = os.path.join(base, n)
            files.append((os.path.relpath(p, root).replace(os.sep, "/"), open(p, "rb").read()))
h = hashlib.sha256(b"gputravel-bundle-v1")
for rel, data in sorted(files):
    h.update(rel.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
print(h.hexdigest())
"""

#: Exit 0: usable; 5: a cryptography too old for the agent (no ``AESGCM.encrypt_into``).
CRYPTO_CHECK = ("import cryptography, sys; from cryptography.hazmat.primitives.ciphers.aead import AESGCM; "
                "print(cryptography.__version__); sys.exit(0 if hasattr(AESGCM, 'encrypt_into') else 5)")


@dataclass(slots=True)
class DeployReport:
    holder: str
    host: str
    port: int
    bundle_sha256: str
    remote_dir: str
    uploaded: bool
    cryptography: str
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"holder": self.holder, "host": self.host, "port": self.port, "bundle_sha256": self.bundle_sha256,
                "remote_dir": self.remote_dir, "uploaded": self.uploaded, "cryptography": self.cryptography,
                "seconds": round(self.seconds, 3)}


def _known_hosts(spec: HolderSpec) -> Any:
    if spec.host_key is not None:
        try:
            key = asyncssh.import_public_key(spec.host_key)
        except (asyncssh.KeyImportError, ValueError) as exc:
            raise AgentError(spec.name, f"pinned host_key does not parse: {exc}") from None
        return ([key], [], [])
    return str(spec.known_hosts)


async def connect(spec: HolderSpec) -> asyncssh.SSHClientConnection:
    """Connect with host-key checking, client-key auth, a timeout and keepalives."""
    try:
        return await asyncio.wait_for(asyncssh.connect(
            spec.host, spec.port, username=spec.user, client_keys=[str(spec.client_key)],
            known_hosts=_known_hosts(spec), agent_path=None, password=None, kbdint_auth=False,
            keepalive_interval=spec.keepalive_interval, keepalive_count_max=spec.keepalive_count_max,
            connect_timeout=spec.connect_timeout, encryption_algs=["aes256-gcm@openssh.com", "aes128-gcm@openssh.com",
                                                                   "chacha20-poly1305@openssh.com", "aes256-ctr"],
            config=None), spec.connect_timeout + 5)
    except asyncssh.HostKeyNotVerifiable as exc:
        raise AgentError(spec.name, f"host key not verified (refused, no key released): {exc.reason}") from None
    except asyncssh.PermissionDenied as exc:
        raise AgentError(spec.name, f"authentication failed: {exc.reason}") from None
    except asyncssh.KeyImportError as exc:  # the inventory checks it; a spec built elsewhere may not have
        raise ConfigError(f"{spec.name}: client_key {spec.client_key} is not a private key: {exc}") from None
    except TimeoutError:
        raise AgentError(spec.name, f"{spec.host}:{spec.port} unreachable: connect timeout") from None
    except (OSError, asyncssh.Error) as exc:
        raise AgentError(spec.name, f"{spec.host}:{spec.port} unreachable: {exc}") from None


async def run_remote(conn: asyncssh.SSHClientConnection, spec: HolderSpec, command: str, *,
                     timeout: float = 60.0) -> asyncssh.SSHCompletedProcess:
    """``command`` on the holder (no check of its exit status); a failure to run it is ``AgentError``."""
    try:
        return await asyncio.wait_for(conn.run(command, check=False), timeout)
    except (OSError, asyncssh.Error, TimeoutError) as exc:
        raise AgentError(spec.name, f"remote command failed: {exc}") from None


def bundle_dir(spec: HolderSpec, sha256: str) -> str:
    """The folder on the holder that holds the bundle with this hash."""
    return str(PurePosixPath(spec.remote_dir) / f"agent-{sha256[:16]}")


async def remote_hash(conn: asyncssh.SSHClientConnection, spec: HolderSpec, folder: str) -> str | None:
    """The bundle hash of ``folder`` on the holder, or None when there is no bundle there."""
    res = await run_remote(conn, spec, f"{quote(spec.python)} -c {quote(REMOTE_HASH_SCRIPT)} {quote(folder)}")
    if res.exit_status != 0:
        return None
    return str(res.stdout).strip() or None


#: The bundle's upload (a few hundred KB) must finish within this many seconds: an SFTP server that accepts
#: the channel and then stops answering would otherwise hold the run at its deploy step for ever (the SSH
#: keepalive only notices a dead connection, not a live one whose SFTP subsystem stalls).
UPLOAD_TIMEOUT_S = 120.0


async def upload_bundle(conn: asyncssh.SSHClientConnection, spec: HolderSpec, files: list[tuple[str, bytes]],
                        folder: str, *, timeout: float | None = None) -> None:
    """Upload ``files`` into a private folder, then move it into place as ``folder`` with one rename: a folder
    named by a hash is either complete or absent, so one whose contents differ was changed after upload. A
    failed or stalled upload is ``AgentError`` (a stalled one after ``timeout`` seconds, default
    ``UPLOAD_TIMEOUT_S`` read at the call; its private ``.part-*`` folder may stay behind on the holder)."""
    timeout = UPLOAD_TIMEOUT_S if timeout is None else timeout
    staging = f"{folder}.part-{secrets.token_hex(4)}"

    async def upload() -> None:
        async with conn.start_sftp_client() as sftp:
            for rel, data in files:
                path = PurePosixPath(staging) / rel
                await sftp.makedirs(str(path.parent), exist_ok=True)
                async with sftp.open(str(path), "wb") as f:
                    await f.write(data)
                await sftp.chmod(str(path), 0o600)
            try:
                await sftp.rename(staging, folder)
            except asyncssh.SFTPError:  # another deployer got there first: its folder is checked by the caller
                await sftp.rmtree(staging, ignore_errors=True)

    try:
        await asyncio.wait_for(upload(), timeout)
    except TimeoutError:
        raise AgentError(spec.name, f"upload stalled: not done after {timeout:g} s (the holder's SFTP server "
                                    f"stopped answering)") from None
    except (OSError, asyncssh.Error) as exc:
        raise AgentError(spec.name, f"upload failed: {exc}") from None


async def deploy(conn: asyncssh.SSHClientConnection, spec: HolderSpec, *,
                 on_state: Callable[[str, str], None] | None = None) -> DeployReport:
    """Upload the bundle unless the holder already has it (same hash), then verify it there."""
    t0 = time.perf_counter()
    files = bundle_contents()
    want = digest_files(files)
    folder = bundle_dir(spec, want)
    crypto = await run_remote(conn, spec, f"{quote(spec.python)} -c {quote(CRYPTO_CHECK)}")
    crypto_version = str(crypto.stdout).strip()
    if crypto.exit_status == 5:
        version = crypto_version
        raise AgentError(spec.name, f"remote python {spec.python!r} has cryptography {version}, which lacks "
                                    f"AESGCM.encrypt_into (install a newer one: {spec.python} -m pip install -U "
                                    f"cryptography)")
    if crypto.exit_status != 0:
        err = str(crypto.stderr)
        # 127: the shell found no such command (its message on stderr may not have arrived before the exit status)
        missing = ("python itself" if crypto.exit_status == 127 or "not found" in err or "No such file" in err
                   else "the 'cryptography' package")
        raise AgentError(spec.name, f"remote python {spec.python!r} lacks {missing} "
                                    f"(install it: {spec.python} -m pip install 'cryptography>=47'): "
                                    f"{err.strip().splitlines()[-1] if err.strip() else 'exit ' + str(crypto.exit_status)}")
    uploaded = False
    have = await remote_hash(conn, spec, folder)
    if have is None:
        if on_state:
            on_state(HolderState.DEPLOYING, folder)
        await upload_bundle(conn, spec, files, folder)
        uploaded = True
        have = await remote_hash(conn, spec, folder)
    if have != want:
        raise AgentError(spec.name, f"agent bundle hash mismatch on the holder (refused, no key released): {folder} "
                                    f"holds {have}, want {want}; it changed after upload (remove it to redeploy)")
    if on_state:
        on_state(HolderState.VERIFIED, want)
    return DeployReport(spec.name, spec.host, spec.port, want, folder, uploaded, crypto_version,
                        time.perf_counter() - t0)
