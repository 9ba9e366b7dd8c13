"""An SSH server for the embedded default and the tests: asyncssh standing in for sshd.

It runs as its own process on 127.0.0.1 (a free port), with a freshly generated host key. Each holder
is an account with its own client key and home folder; commands run as real subprocesses in that
home, and SFTP is chrooted to it. The demo deploys and runs the holder agents through it exactly
as it would through a holder's OpenSSH server.

What it does not give: isolation between holders. Every account's commands run as the orchestrator's
own user (one uid), so on this server one holder's agent could read another holder's data folder. Only
SFTP is confined to the account's home. Separation between holders comes from real accounts: the
OpenSSH tests (``tests/agents/test_openssh.py``) run two holders as two system users, each unable to read the
other's files, and a real deployment puts each holder on its own machine.

    python -m gputravel.agents.sshserver CONFIG.json      # prints "READY <port>"
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh

from gputravel.core.procs import die_with_parent


@dataclass(frozen=True, slots=True)
class Account:
    name: str
    home: Path
    authorized_key: str


class _Server(asyncssh.SSHServer):
    def __init__(self, accounts: dict[str, Account]) -> None:
        self.accounts = accounts
        self.conn: asyncssh.SSHServerConnection | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.conn = conn

    def begin_auth(self, username: str) -> bool:
        account = self.accounts.get(username)
        assert self.conn is not None
        if account is not None:
            self.conn.set_authorized_keys(asyncssh.import_authorized_keys(account.authorized_key))
        else:
            self.conn.set_authorized_keys(asyncssh.import_authorized_keys(""))
        return True

    def server_requested(self, listen_host: str, listen_port: int) -> bool:
        """Remote port forwards, on the holder's loopback only (the direct data path's tunnel)."""
        return listen_host in ("127.0.0.1", "localhost", "::1")

    def password_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True


def _make_process_handler(accounts: dict[str, Account]) -> Any:
    async def handle(process: asyncssh.SSHServerProcess[bytes]) -> None:
        account = accounts[process.get_extra_info("username")]
        command = process.command
        if not command:
            process.stderr.write(b"this server runs commands only; no interactive shell\n")
            process.exit(1)
            return
        env = {"HOME": str(account.home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        proc = subprocess.Popen(command, shell=True, cwd=account.home, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=die_with_parent)  # ends with this server (which ends with its run)
        try:
            await process.redirect(stdin=proc.stdin, stdout=proc.stdout, stderr=proc.stderr)
            rc = await asyncio.get_running_loop().run_in_executor(None, proc.wait)
            await process.stdout.drain()
            await process.stderr.drain()
        except (asyncssh.Error, OSError, BrokenPipeError):
            rc = 255
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        process.exit(rc)

    return handle


def _sftp_factory(accounts: dict[str, Account]) -> Any:
    def make(chan: asyncssh.SSHServerChannel[bytes]) -> asyncssh.SFTPServer:
        account = accounts[chan.get_extra_info("username")]
        return asyncssh.SFTPServer(chan, chroot=str(account.home).encode())

    return make


async def serve(config: dict[str, Any]) -> None:
    accounts = {name: Account(name, Path(a["home"]), a["authorized_key"]) for name, a in config["users"].items()}
    server = await asyncssh.listen(
        config.get("listen", "127.0.0.1"), int(config.get("port", 0)),
        server_host_keys=[config["host_key"]], server_factory=lambda: _Server(accounts),
        process_factory=_make_process_handler(accounts), sftp_factory=_sftp_factory(accounts),
        encoding=None, allow_scp=False, agent_forwarding=False, x11_forwarding=False,
        keepalive_interval=float(config.get("keepalive_interval", 0)) or None,
        line_editor=False)
    port = server.sockets[0].getsockname()[1]
    print(f"READY {port}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m gputravel.agents.sshserver CONFIG.json", file=sys.stderr)
        sys.exit(2)
    config = json.loads(Path(args[0]).read_text())
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
