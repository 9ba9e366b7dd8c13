"""Deploying holder agents over SSH (asyncssh), and the SSH holder link.

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
from pathlib import Path, PurePosixPath
from shlex import quote
from typing import Any

import asyncssh

from gputravel.agents.holder.bundle import bundle_contents, digest_files
from gputravel.agents.inventory import HolderSpec
from gputravel.core.errors import AgentError, ConfigError, GpuTravelError, LinkLostError
from gputravel.core.protocol import FrameType
from gputravel.core.protocol.holderlink import DataEndpoint
from gputravel.core.travel.framed_link import FramedHolderLink
from gputravel.core.travel.holders import (
    Handoff,
    HolderInfo,
    HolderState,
    ProgressFn,
    RejectFn,
)

#: Runs on the holder with its own python; hashes what is on disk without importing it.
#: The agent channel's receive window and largest packet we accept (asyncssh's defaults: 2 MiB and 32 KiB).
#: The ssh data path moves megabytes of chunk frames from the agent's stdout; a wider window and bigger
#: packets cut the per-packet work (measured: see docs/provisioning.md). OpenSSH's sshd caps a channel's
#: packets at its own limit whatever we offer.
CHANNEL_WINDOW = 16 * 1024 * 1024
CHANNEL_MAX_PKTSIZE = 256 * 1024

#: Where an SSH holder's agent keeps its witness of the ledger (the head stated at each hand-off), in the
#: holder's own home, outside the bundle folder (bundles are replaced) and outside the dataset.
WITNESS_PATH = "~/.gputravel/witness.jsonl"
#: what the orchestrator asks a holder-pinned holder to run (issue 30); its key's forced command runs the holder's
#: own ``holder serve`` whatever is asked, so this is only a name for a holder that has not restricted its key yet
SERVE_COMMAND = "gputravel holder serve"

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


async def _run(conn: asyncssh.SSHClientConnection, spec: HolderSpec, command: str, *,
               timeout: float = 60.0) -> asyncssh.SSHCompletedProcess:
    try:
        return await asyncio.wait_for(conn.run(command, check=False), timeout)
    except (OSError, asyncssh.Error, TimeoutError) as exc:
        raise AgentError(spec.name, f"remote command failed: {exc}") from None


def bundle_dir(spec: HolderSpec, sha256: str) -> str:
    """The folder on the holder that holds the bundle with this hash."""
    return str(PurePosixPath(spec.remote_dir) / f"agent-{sha256[:16]}")


async def remote_hash(conn: asyncssh.SSHClientConnection, spec: HolderSpec, folder: str) -> str | None:
    """The bundle hash of ``folder`` on the holder, or None when there is no bundle there."""
    res = await _run(conn, spec, f"{quote(spec.python)} -c {quote(REMOTE_HASH_SCRIPT)} {quote(folder)}")
    if res.exit_status != 0:
        return None
    return str(res.stdout).strip() or None


async def deploy(conn: asyncssh.SSHClientConnection, spec: HolderSpec, *,
                 on_state: Callable[[str, str], None] | None = None) -> DeployReport:
    """Upload the bundle unless the holder already has it (same hash), then verify it there."""
    t0 = time.perf_counter()
    files = bundle_contents()
    want = digest_files(files)
    folder = bundle_dir(spec, want)
    crypto = await _run(conn, spec, f"{quote(spec.python)} -c {quote(CRYPTO_CHECK)}")
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
        # Upload into a private folder, then move it into place with one rename: a folder named by a
        # hash is either complete or absent, so one whose contents differ was changed after upload.
        if on_state:
            on_state(HolderState.DEPLOYING, folder)
        staging = f"{folder}.part-{secrets.token_hex(4)}"
        try:
            async with conn.start_sftp_client() as sftp:
                for rel, data in files:
                    path = PurePosixPath(staging) / rel
                    await sftp.makedirs(str(path.parent), exist_ok=True)
                    async with sftp.open(str(path), "wb") as f:
                        await f.write(data)
                    await sftp.chmod(str(path), 0o600)
                try:
                    await sftp.rename(staging, folder)
                except asyncssh.SFTPError:  # another deployer got there first: its folder is checked below
                    await sftp.rmtree(staging, ignore_errors=True)
        except (OSError, asyncssh.Error) as exc:
            raise AgentError(spec.name, f"upload failed: {exc}") from None
        uploaded = True
        have = await remote_hash(conn, spec, folder)
    if have != want:
        raise AgentError(spec.name, f"agent bundle hash mismatch on the holder (refused, no key released): {folder} "
                                    f"holds {have}, want {want}; it changed after upload (remove it to redeploy)")
    if on_state:
        on_state(HolderState.VERIFIED, want)
    return DeployReport(spec.name, spec.host, spec.port, want, folder, uploaded, crypto_version,
                        time.perf_counter() - t0)


class SshHolderLink(FramedHolderLink):
    """A holder reached over SSH: deploy, verify, start the agent, speak frames through the channel."""

    transport = "ssh"

    def __init__(self, spec: HolderSpec, *, on_state: Callable[[str, str, str], None] | None = None,
                 max_reconnects: int = 3) -> None:
        super().__init__(spec.name)
        self.spec = spec
        self.conn: asyncssh.SSHClientConnection | None = None
        self.process: asyncssh.SSHClientProcess[bytes] | None = None
        self.deploy_report: DeployReport | None = None
        self.on_state = on_state
        self.max_reconnects = max_reconnects
        self.history: list[tuple[float, str, str]] = []
        self._forward: asyncssh.SSHListener | None = None
        self._watch: asyncio.Task[None] | None = None
        self._closing = False  # set while we close the agent ourselves: its exit is then no loss
        #: the agent attests (issue 22 item 5): its policy and golden-measurement files, paths on the holder's host
        #: (the engine sets the SIM platform's for the embedded server, which runs on this host)
        self.attest_files: tuple[Path, Path] | None = (
            (Path(spec.attest_policy), Path(spec.golden)) if spec.attest_policy and spec.golden else None)

    def set_state(self, state: str, detail: str = "") -> None:
        self.history.append((time.time(), state, detail))
        super().set_state(state, detail)

    async def start(self) -> HolderInfo:
        self.set_state(HolderState.CONNECTING, f"{self.spec.host}:{self.spec.port}")
        if not self.spec.managed:
            return await self._start_pinned()
        try:
            self.conn = await connect(self.spec)
            self.deploy_report = await deploy(self.conn, self.spec,
                                              on_state=self.set_state)
            await self._start_agent()
            info = await self._hello()
        except GpuTravelError as exc:
            self.set_state(HolderState.FAILED, exc.reason)
            await self._drop()
            raise
        if info.agent_sha256 != self.deploy_report.bundle_sha256:  # = agent_sha256(): deploy() built it from the bundle
            self.set_state(HolderState.FAILED, "agent reported another bundle hash")
            await self._drop()
            raise AgentError(self.name, f"agent bundle hash mismatch: the running agent reports {info.agent_sha256[:16]}, "
                                        f"deployed {self.deploy_report.bundle_sha256[:16]} (refused, no key released)")
        detail = {"host": self.spec.host, "port": self.spec.port, "user": self.spec.user,
                  "bundle_sha256": self.deploy_report.bundle_sha256, "remote_dir": self.deploy_report.remote_dir,
                  "uploaded": self.deploy_report.uploaded, "deploy_s": round(self.deploy_report.seconds, 3)}
        self.info = HolderInfo(info.name, info.fmt, info.train_bytes, info.val_bytes, info.files, info.agent_sha256,
                               "ssh", detail)
        self.set_state(HolderState.READY, self.deploy_report.bundle_sha256[:16])
        assert self.conn is not None and self.process is not None  # set by the start above
        self._watch = asyncio.ensure_future(self._watch_agent(self.conn, self.process))
        return self.info

    async def _start_pinned(self) -> HolderInfo:
        """A holder-pinned holder (``managed = false``, issue 30): nothing uploaded, nothing passed. Its key's forced
        command runs the holder's own ``gputravel holder serve`` whatever command is asked for; its HELLO states its
        version, code SHA-256 and policy digest, and it must attest (no verdict, no data)."""
        try:
            self.conn = await connect(self.spec)
            try:
                self.process = await self.conn.create_process(SERVE_COMMAND, encoding=None, window=CHANNEL_WINDOW,
                                                              max_pktsize=CHANNEL_MAX_PKTSIZE)
            except (OSError, asyncssh.Error) as exc:
                raise AgentError(self.name, f"cannot start the holder's agent: {exc}") from None
            self.reader, self.writer = self.process.stdout, self.process.stdin
            info = await self._hello()
            hello = self.hello
            if (hello is None or hello.nonce is None or hello.link_pub is None or hello.policy_sha256 is None
                    or hello.policy_source != "holder"):
                raise AgentError(self.name, "a holder-pinned holder's agent must attest with its own policy; this one "
                                            "states none (is its key's forced command `gputravel holder serve`?)")
        except GpuTravelError as exc:
            self.set_state(HolderState.FAILED, exc.reason)
            await self._drop()
            raise
        self.policy_source = "holder"
        detail = {"host": self.spec.host, "port": self.spec.port, "user": self.spec.user, "managed": False,
                  "agent_version": hello.version, "agent_sha256": hello.agent_sha256,
                  "policy_sha256": hello.policy_sha256, "policy_source": "holder",
                  "stated_name": hello.name, "ignored": list(self.spec.ignored)}
        self.info = HolderInfo(info.name, info.fmt, info.train_bytes, info.val_bytes, info.files, info.agent_sha256,
                               "ssh", detail)
        self.set_state(HolderState.VERIFIED, f"holder-pinned, policy {hello.policy_sha256[:16]}")
        self.set_state(HolderState.READY, info.agent_sha256[:16])
        assert self.conn is not None and self.process is not None
        self._watch = asyncio.ensure_future(self._watch_agent(self.conn, self.process))
        return self.info

    @property
    def ready(self) -> bool:
        """Verified-ready: the deployed bundle's hash checked, the agent that reported it still running on
        a live connection, and no transfer under way. Only such a holder is handed a key."""
        return (self.state in (HolderState.READY, HolderState.RETURNED) and self.conn is not None
                and not self.conn.is_closed() and self.process is not None
                and self.process.exit_status is None and self.process.exit_signal is None
                and self._watch is not None and not self._watch.done())

    async def _watch_agent(self, conn: asyncssh.SSHClientConnection, process: asyncssh.SSHClientProcess[bytes]) -> None:
        """While the holder waits between visits, its agent or its SSH session may die: mark it offline
        (an event and a ledger row through ``on_state``) so that no key is handed to it until a reconnect
        has verified a fresh agent. Failures during a transfer are ``provision``'s to report."""
        lost = asyncio.ensure_future(conn.wait_closed())
        exited = asyncio.ensure_future(process.wait_closed())
        try:
            await asyncio.wait({lost, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            exited.cancel()
        if self._closing or self.process is not process:
            return
        await asyncio.sleep(0.05)  # a dropping connection closes its channels first: tell which it was
        self._mark_offline()

    def _mark_offline(self) -> None:
        """A holder that was waiting and lost its agent or session goes offline, saying which."""
        if self.state not in (HolderState.READY, HolderState.RETURNED):
            return
        process = self.process
        if self.conn is None or self.conn.is_closed():
            reason = "SSH connection lost while waiting"
        elif process is None:
            reason = "agent not running"
        else:
            sig = process.exit_signal
            how = (f"killed by {sig[0]}" if sig else f"exit status {process.exit_status}"
                   if process.exit_status is not None else "its channel closed")
            reason = f"agent exited while waiting ({how})"
        self.set_state(HolderState.OFFLINE, reason)

    async def ensure_ready(self) -> HolderInfo:
        """This holder, verified-ready: reconnected with backoff (redeploying and re-verifying the agent's
        hash) when its agent or session died. Raises ``LinkLostError`` when it does not come back."""
        if self.ready and self.info is not None:
            return self.info
        self._mark_offline()
        try:
            return await self.reconnect()
        except AgentError as exc:
            raise LinkLostError(self.name, f"offline, reconnect failed: {exc.reason}") from None

    def _send(self, ftype: FrameType, header: dict[str, Any], payload: bytes = b"") -> None:
        """A write on a channel that closed under us is the agent or its session gone: a named error."""
        try:
            super()._send(ftype, header, payload)
        except (OSError, RuntimeError, asyncssh.Error) as exc:
            raise AgentError(self.name, f"link failed: {exc or type(exc).__name__}") from None

    async def _start_agent(self) -> None:
        assert self.conn is not None and self.deploy_report is not None
        folder = self.deploy_report.remote_dir
        cmd = (f"cd {quote(folder)} && exec env PYTHONPATH=. PYTHONDONTWRITEBYTECODE=1 {quote(self.spec.python)} "
               f"-m gputravel.agents.holder --name {quote(self.name)} --data {quote(self.spec.data)} "
               f"--val-fraction {self.spec.val_fraction} --witness {quote(WITNESS_PATH)}")
        if self.attest_files is not None:
            cmd += f" --attest-policy {quote(str(self.attest_files[0]))} --golden {quote(str(self.attest_files[1]))}"
        try:
            self.process = await self.conn.create_process(cmd, encoding=None, window=CHANNEL_WINDOW,
                                                          max_pktsize=CHANNEL_MAX_PKTSIZE)
        except (OSError, asyncssh.Error) as exc:
            raise AgentError(self.name, f"cannot start the agent: {exc}") from None
        self.reader, self.writer = self.process.stdout, self.process.stdin

    async def provision(self, handoff: Handoff, *, device_socket: str, on_progress: ProgressFn | None = None,
                        on_reject: RejectFn | None = None, data_endpoint: DataEndpoint | None = None) -> Any:
        if not self.ready:  # checked before the hand-off (and its key) is written anywhere
            self._mark_offline()
            raise LinkLostError(self.name, f"holder not verified-ready ({self.state}: {self.state_detail or '-'}); "
                                           f"no key released")
        self.set_state(HolderState.PROVISIONING, f"epoch {handoff.epoch}" +
                       (f", resuming at chunk {handoff.resume_from}" if handoff.resume_from else ""))
        try:
            stats = await super().provision(handoff, device_socket=device_socket, on_progress=on_progress,
                                            on_reject=on_reject, data_endpoint=await self._route(data_endpoint))
        except (AgentError, asyncssh.Error) as exc:  # asyncssh.Error: e.g. ConnectionLost on a keepalive timeout
            reason = exc.reason if isinstance(exc, AgentError) else f"link failed: {exc}"
            await asyncio.sleep(0.05)  # let a dropping connection finish closing before we tell which it was
            if self.conn is None or self.conn.is_closed():
                self.set_state(HolderState.OFFLINE, reason)
                raise LinkLostError(self.name, f"connection lost: {reason}") from None
            self.set_state(HolderState.FAILED, reason)
            if isinstance(exc, AgentError):
                raise
            raise AgentError(self.name, reason) from None
        self.set_state(HolderState.RETURNED, f"epoch {handoff.epoch}")
        return stats

    async def _route(self, endpoint: DataEndpoint | None) -> DataEndpoint | None:
        """The device's TCP data port as this holder reaches it. With ``data_route = "forward"`` that is a
        remote port forward on this SSH connection (listening on the holder's loopback, opened once per
        connection): the chunks stay sealed under the GPU key end to end, SSH only carries them across a
        network the holder could not otherwise cross."""
        if endpoint is None or endpoint.port is None or self.spec.data_route != "forward":
            return endpoint
        if self.conn is None:
            raise AgentError(self.name, "not connected")
        if self._forward is None:
            try:
                self._forward = await self.conn.forward_remote_port("127.0.0.1", 0, str(endpoint.host),
                                                                    endpoint.port)
            except (OSError, asyncssh.Error) as exc:
                raise AgentError(self.name, f"cannot forward the device's data port through SSH: {exc}") from None
        return DataEndpoint(host="127.0.0.1", port=self._forward.get_port())

    @property
    def can_reconnect(self) -> bool:
        return True

    async def reconnect(self) -> HolderInfo:
        """Reconnect with backoff (0.5, 1, 2, ... s) and restart the agent."""
        await self._drop()
        delay = 0.5
        last: GpuTravelError | None = None
        for _ in range(self.max_reconnects):
            try:
                return await self.start()
            except AgentError as exc:
                last = exc
                await asyncio.sleep(delay)
                delay *= 2
        self.set_state(HolderState.OFFLINE, last.reason if last else "reconnect failed")
        raise last or AgentError(self.name, "reconnect failed")

    async def kill(self) -> None:
        """Fault injection: kill the agent process on the holder; the SSH connection stays up."""
        if self.conn is not None and self.agent_pid:
            process = self.process
            await _run(self.conn, self.spec, f"kill -9 {int(self.agent_pid)}")
            if process is not None:  # dead when this returns: its channel closed
                try:
                    await asyncio.wait_for(process.wait_closed(), 5)
                except (TimeoutError, OSError, asyncssh.Error):
                    pass

    async def drop_connection(self) -> None:
        """Fault injection: the SSH connection drops (the agent is killed with it)."""
        if self.conn is not None:
            self.conn.abort()

    async def _drop(self) -> None:
        self._closing = True
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._forward is not None:
            self._forward.close()
            self._forward = None
        if self.process is not None:
            self.process.close()
            self.process = None
        if self.conn is not None:
            self.conn.close()
            try:
                await asyncio.wait_for(self.conn.wait_closed(), 5)
            except (TimeoutError, OSError, asyncssh.Error):
                pass
            self.conn = None
        self._closing = False

    async def close(self) -> None:
        self._closing = True
        if self.process is not None:
            try:
                await self.stop()
            except GpuTravelError:
                pass  # the agent is already gone: nothing to say goodbye to
        await self._drop()
        if self.state not in (HolderState.FAILED, HolderState.OFFLINE):
            self.set_state(HolderState.STOPPED)

