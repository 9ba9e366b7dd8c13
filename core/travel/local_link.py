"""The holder agent as a local subprocess on stdin/stdout (``python -m <agent module>``, the module named by the
caller: core never names it), spoken to through the ``FramedSession`` it holds (``--transport local``, tests and benches)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from gputravel.core.errors import AgentError, ConfigError, GpuTravelError
from gputravel.core.procs import die_with_parent
from gputravel.core.protocol.holderlink import DataEndpoint, Handoff
from gputravel.core.travel.framed_link import STREAM_LIMIT, FramedSession
from gputravel.core.travel.holders import (
    HolderInfo,
    HolderLink,
    HolderState,
    ProgressFn,
    ProvisionStats,
    RejectFn,
)

__all__ = ["LocalHolderLink"]


class LocalHolderLink(HolderLink):
    """The agent as a local subprocess on stdin/stdout: ``python *agent`` (``agent``: the caller's entry, e.g.
    ``("-m", "<the holder agent's module>")``, :class:`gputravel.core.compose.Entries`)."""

    def __init__(self, name: str, data_dir: Path, *, agent: Sequence[str], val_fraction: float = 0.1,
                 python: str | None = None, witness: Path | None = None, pinned: bool = False) -> None:
        self.name = name
        #: the framed protocol with the agent, over its pipes
        self.session = FramedSession(name, transport="local", kill=lambda: self.kill())
        self.info: HolderInfo | None = None
        #: a holder-pinned agent (issue 30: ``agent`` runs the holder's ``holder serve``): it is passed nothing,
        #: its own configuration names its data and what it trusts
        self.pinned = pinned
        if pinned:
            self.session.policy_source = "holder"
        if not agent:
            raise ConfigError(f"holder {name}: no agent entry to start (argv after the interpreter)")
        self.agent = tuple(agent)
        self.data_dir = Path(data_dir)
        self.val_fraction = val_fraction
        self.python = python or sys.executable
        self.witness = witness  # the agent appends the ledger head of each hand-off here
        #: the agent attests (``--attest-policy``, ``--golden``): set by the engine on the SIM platform
        self.attest_files: tuple[Path, Path] | None = None
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> HolderInfo:
        self.set_state(HolderState.CONNECTING, "local subprocess")
        args = () if self.pinned else self._args()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                self.python, *self.agent, *args, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, limit=STREAM_LIMIT,
                preexec_fn=die_with_parent)
        except OSError as exc:
            raise AgentError(self.name, f"cannot start the agent: {exc}") from None
        self.session.attach(self.proc.stdout, self.proc.stdin)
        try:
            info = self.info = await self.session.greet()
            hello = self.session.hello
            if self.pinned and (hello is None or hello.policy_source != "holder"):
                raise AgentError(self.name, "a holder-pinned agent must state its own policy in HELLO")
        except GpuTravelError as exc:
            self.set_state(HolderState.FAILED, exc.reason)
            await self.close()
            raise
        self.set_state(HolderState.READY, info.agent_sha256[:16])
        return info

    def _args(self) -> tuple[str, ...]:
        """What a managed local agent is told: its name, data, and (on the SIM platform) what to attest with."""
        return ("--name", self.name, "--data", str(self.data_dir),
                "--val-fraction", str(self.val_fraction),
                *(("--witness", str(self.witness)) if self.witness is not None else ()),
                *(("--attest-policy", str(self.attest_files[0]), "--golden", str(self.attest_files[1]))
                  if self.attest_files is not None else ()))

    async def provision(self, handoff: Handoff, *, device_socket: str, on_progress: ProgressFn | None = None,
                        on_reject: RejectFn | None = None,
                        data_endpoint: DataEndpoint | None = None) -> ProvisionStats:
        self.set_state(HolderState.PROVISIONING, f"epoch {handoff.epoch}")
        try:
            stats = await self.session.provision(handoff, device_socket=device_socket, on_progress=on_progress,
                                                 on_reject=on_reject, data_endpoint=data_endpoint)
        except GpuTravelError as exc:
            self.set_state(HolderState.FAILED, exc.reason)
            raise
        self.set_state(HolderState.RETURNED, f"epoch {handoff.epoch}")
        return stats

    def prefetch_attestation(self, *, epoch: int, key_fp: str) -> None:
        self.session.prefetch_attestation(epoch=epoch, key_fp=key_fp)

    async def settle_attestation(self) -> None:
        await self.session.settle_attestation()

    @property
    def ready(self) -> bool:
        """The agent answered HELLO, is still running and did not fail a transfer."""
        return (self.proc is not None and self.proc.returncode is None and self.info is not None
                and self.state not in (HolderState.FAILED, HolderState.STOPPED, HolderState.PROVISIONING))

    async def ensure_ready(self) -> HolderInfo | None:
        """A local agent that died while waiting is marked offline and started again."""
        if self.ready:
            return None
        if self.state not in (HolderState.OFFLINE, HolderState.FAILED):
            rc = self.proc.returncode if self.proc is not None else None
            self.set_state(HolderState.OFFLINE, f"agent exited while waiting (status {rc})")
        await self.close()
        return await self.start()

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    async def close(self) -> None:
        if self.proc is None:
            return
        if self.state not in (HolderState.FAILED, HolderState.OFFLINE):
            self.set_state(HolderState.STOPPED)
        if self.proc.returncode is None:
            await self.session.stop(self.farewell_head, self.farewell_rows)
            try:
                if self.session.writer is not None:
                    self.session.writer.close()
                await asyncio.wait_for(self.proc.wait(), 5)
            except (TimeoutError, OSError, RuntimeError, ConnectionError):
                self.proc.kill()
                await self.proc.wait()
