"""An SSH holder's link lets its agent finish after BYE before it closes the channel (session 15's holder walk).

Over Debian's sshd a completed run left the holder's receipt without its ``ledger_rows`` and its witness without
the run's end head in 3 of 4 runs: the link sent BYE, then closed the channel and the connection at once, and
sshd, gone with the connection, never handed the BYE to the agent. Without them a rewrite of the visit's rows
(rehashed to the end) passed ``holder verify`` and ``ledger verify --witness``. The end-to-end check is in
``test_openssh_holder.py`` (real sshd, where the loss was seen); here the link's order is isolated with a stand-in
for asyncssh's process (``_AgentProcessStandIn``), the one fake: BYE, then the agent's exit, then the close.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

import asyncssh

from gputravel.agents.inventory import HolderSpec
from gputravel.agents.ssh_holder import BYE_EXIT_S, SshHolderLink


class _AgentProcessStandIn:
    """What the link uses of asyncssh's ``SSHClientProcess`` at close: the agent exits ``exit_after`` s after BYE."""

    def __init__(self, log: list[str], exit_after: float) -> None:
        self.log, self.exit_after = log, exit_after

    async def wait_closed(self) -> None:
        await asyncio.sleep(self.exit_after)
        self.log.append("agent exited")

    def close(self) -> None:
        self.log.append("channel closed")


def _link(tmp_path: Path) -> SshHolderLink:
    key = tmp_path / "key"
    key.write_text("-")
    spec = HolderSpec(name="alice", host="127.0.0.1", port=22, user="alice", client_key=key, host_key="-",
                      known_hosts=None, data="/srv/alice", python="python3", connect_timeout=5.0,
                      keepalive_interval=5.0, keepalive_count_max=3, remote_dir=".gputravel", val_fraction=0.1)
    return SshHolderLink(spec)


async def test_close_waits_for_the_agent_to_exit_after_bye_before_closing_its_channel(tmp_path: Path) -> None:
    log: list[str] = []
    link = _link(tmp_path)
    link.process = cast("asyncssh.SSHClientProcess[bytes]", _AgentProcessStandIn(log, exit_after=0.3))
    await link.close()
    assert log == ["agent exited", "channel closed"]


async def test_an_agent_that_never_exits_holds_the_close_only_for_its_bound(tmp_path: Path) -> None:
    log: list[str] = []
    link = _link(tmp_path)
    link.process = cast("asyncssh.SSHClientProcess[bytes]", _AgentProcessStandIn(log, exit_after=3600))
    loop = asyncio.get_running_loop()
    start = loop.time()
    await link.close()
    assert log == ["channel closed"] and loop.time() - start < BYE_EXIT_S + 2
