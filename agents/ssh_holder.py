"""The SSH holder link: a holder reached over SSH (asyncssh), its agent deployed and verified by
``agents/deploy.py``, then started on its channel and spoken to in frames (the ``FramedSession`` it holds).

SSH stays at this edge: ``(OSError, asyncssh.Error)`` become ``AgentError(host, reason)`` here. The link
watches its agent between visits (a lost agent or session goes offline and is reconnected, redeployed and
re-verified before any key is handed to it), routes the device's data port through the connection when
``data_route = "forward"``, and starts a holder-pinned holder's own ``holder serve`` (nothing uploaded).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from shlex import quote

import asyncssh

from gputravel.agents.deploy import DeployReport, connect, deploy, run_remote
from gputravel.agents.inventory import HolderSpec
from gputravel.core.errors import AgentError, GpuTravelError, LinkLostError
from gputravel.core.protocol.holderlink import DataEndpoint
from gputravel.core.travel.framed_link import FramedSession
from gputravel.core.travel.holders import (
    Handoff,
    HolderInfo,
    HolderLink,
    HolderState,
    ProgressFn,
    ProvisionStats,
    RejectFn,
)

__all__ = ["CHANNEL_MAX_PKTSIZE", "CHANNEL_WINDOW", "SERVE_COMMAND", "WITNESS_PATH", "HolderState", "SshHolderLink"]

#: The agent channel's receive window and largest packet we accept (asyncssh's defaults: 2 MiB and 32 KiB).
#: The ssh data path moves megabytes of chunk frames from the agent's stdout; a wider window and bigger
#: packets cut the per-packet work (measured: see docs/provisioning.md). OpenSSH's sshd caps a channel's
#: packets at its own limit whatever we offer.
CHANNEL_WINDOW = 16 * 1024 * 1024
CHANNEL_MAX_PKTSIZE = 256 * 1024
#: after BYE, how long the link waits for the agent to write its witness and receipts and exit before it closes
#: the channel and the connection (sshd drops what it has not yet handed to the agent when the connection goes)
BYE_EXIT_S = 5.0

#: Where an SSH holder's agent keeps its witness of the ledger (the head stated at each hand-off), in the
#: holder's own home, outside the bundle folder (bundles are replaced) and outside the dataset.
WITNESS_PATH = "~/.gputravel/witness.jsonl"
#: what the orchestrator asks a holder-pinned holder to run (issue 30); its key's forced command runs the holder's
#: own ``holder serve`` whatever is asked, so this is only a name for a holder that has not restricted its key yet
SERVE_COMMAND = "gputravel holder serve"


class SshHolderLink(HolderLink):
    """A holder reached over SSH: deploy, verify, start the agent, speak frames through the channel."""

    def __init__(self, spec: HolderSpec, *, on_state: Callable[[str, str, str], None] | None = None,
                 max_reconnects: int = 3) -> None:
        self.name = spec.name
        #: the framed protocol with the agent, over its channel (a write on a channel closed under us: AgentError)
        self.session = FramedSession(spec.name, transport="ssh", kill=lambda: self.kill(),
                                     write_errors=(OSError, RuntimeError, asyncssh.Error))
        self.info: HolderInfo | None = None
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
            info = await self.session.greet()
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
            self.session.attach(self.process.stdout, self.process.stdin)
            info = await self.session.greet()
            hello = self.session.hello
            if (hello is None or hello.nonce is None or hello.link_pub is None or hello.policy_sha256 is None
                    or hello.policy_source != "holder"):
                raise AgentError(self.name, "a holder-pinned holder's agent must attest with its own policy; this one "
                                            "states none (is its key's forced command `gputravel holder serve`?)")
        except GpuTravelError as exc:
            self.set_state(HolderState.FAILED, exc.reason)
            await self._drop()
            raise
        self.session.policy_source = "holder"
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
        self.session.attach(self.process.stdout, self.process.stdin)

    def prefetch_attestation(self, *, epoch: int, key_fp: str) -> None:
        self.session.prefetch_attestation(epoch=epoch, key_fp=key_fp)

    async def settle_attestation(self) -> None:
        await self.session.settle_attestation()

    async def provision(self, handoff: Handoff, *, device_socket: str, on_progress: ProgressFn | None = None,
                        on_reject: RejectFn | None = None, data_endpoint: DataEndpoint | None = None) -> ProvisionStats:
        if not self.ready:  # checked before the hand-off (and its key) is written anywhere
            self._mark_offline()
            raise LinkLostError(self.name, f"holder not verified-ready ({self.state}: {self.state_detail or '-'}); "
                                           f"no key released")
        self.set_state(HolderState.PROVISIONING, f"epoch {handoff.epoch}" +
                       (f", resuming at chunk {handoff.resume_from}" if handoff.resume_from else ""))
        try:
            stats = await self.session.provision(handoff, device_socket=device_socket, on_progress=on_progress,
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
            except asyncssh.ChannelListenError:  # the holder's sshd or its key's options allow no remote forward
                raise AgentError(self.name, self._no_forward()) from None
            except (OSError, asyncssh.Error) as exc:
                raise AgentError(self.name, f"cannot forward the device's data port through SSH: {exc}") from None
        return DataEndpoint(host="127.0.0.1", port=self._forward.get_port())

    def _no_forward(self) -> str:
        """What to do when the holder's SSH server refuses the data route's remote forward."""
        fix = ("the holder authorizes it with `gputravel holder authorize --key ORCH_KEY.pub --data-forward`"
               if not self.spec.managed else "its sshd must allow TCP forwarding (AllowTcpForwarding)")
        return (f"the holder's SSH server refused to forward the device's data port (data_route = \"forward\"): "
                f"{fix}; or set data_route = \"network\" for it in the inventory, or run with --data-path "
                f"channel (no key was released)")

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
        if self.conn is not None and self.session.agent_pid:
            process = self.process
            await run_remote(self.conn, self.spec, f"kill -9 {int(self.session.agent_pid)}")
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

    async def _agent_exit(self) -> None:
        """Wait (``BYE_EXIT_S`` at most) for the agent to exit after BYE: it writes the run's end head to its witness
        and the visits' rows to its receipts first. Closing at once let OpenSSH's sshd drop the BYE still in its
        buffers or end the agent mid-write: a completed run left the holder's receipts without their rows and its
        witness without the end head (session 15's walk), so a rewrite of the visit's rows went unnoticed."""
        process = self.process
        if process is None:
            return
        try:
            await asyncio.wait_for(process.wait_closed(), BYE_EXIT_S)
        except (TimeoutError, OSError, asyncssh.Error):
            pass

    async def close(self) -> None:
        self._closing = True
        if self.process is not None:
            try:
                await self.session.stop(self.farewell_head, self.farewell_rows)
            except GpuTravelError:
                pass  # the agent is already gone: nothing to say goodbye to
            await self._agent_exit()
        await self._drop()
        if self.state not in (HolderState.FAILED, HolderState.OFFLINE):
            self.set_state(HolderState.STOPPED)

