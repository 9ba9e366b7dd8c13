"""SSH holder links: from an inventory, or the embedded default (a loopback SSH server, one account per
holder), to a list of ``SshHolderLink``s the engine drives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import asyncssh

from gputravel.agents.inventory import OPTIONAL, HolderSpec, load_inventory
from gputravel.agents.ssh_holder import SshHolderLink
from gputravel.core.errors import AgentError
from gputravel.core.files import write_atomic
from gputravel.core.procs import die_with_parent


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_atomic(path, data)


class EmbeddedSshServer:
    """``python -m gputravel.agents.sshserver`` on 127.0.0.1 with fresh keys in a private folder."""

    def __init__(self, holders: list[tuple[str, Path]], *, workdir: Path | None = None,
                 keepalive_interval: float = 0.0, data_route: str = "forward") -> None:
        self.holders = holders
        self.data_route = data_route  # the holders' inventory ``data_route``: how they reach the TCP data port
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if not workdir:
            self._tmp = tempfile.TemporaryDirectory(prefix="gputravel-ssh-")
            workdir = Path(self._tmp.name)
        self.workdir = Path(workdir)
        os.chmod(self.workdir, 0o700)
        self.keepalive_interval = keepalive_interval
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.host_public = ""

    def start(self, *, timeout: float = 30.0) -> list[HolderSpec]:
        host_key = asyncssh.generate_private_key("ssh-ed25519")
        host_path = self.workdir / "host_ed25519"
        _write_private(host_path, host_key.export_private_key())
        self.host_public = host_key.export_public_key().decode().strip()
        users = {}
        specs_args = []
        for name, data in self.holders:
            client = asyncssh.generate_private_key("ssh-ed25519")
            key_path = self.workdir / "clients" / name
            _write_private(key_path, client.export_private_key())
            home = self.workdir / "homes" / name
            home.mkdir(parents=True, exist_ok=True, mode=0o700)
            users[name] = {"home": str(home), "authorized_key": client.export_public_key().decode()}
            specs_args.append((name, key_path, data))
        config = self.workdir / "sshd.json"
        config.write_text(json.dumps({"host_key": str(host_path), "listen": "127.0.0.1", "port": 0,
                                      "users": users, "keepalive_interval": self.keepalive_interval}))
        self.proc = subprocess.Popen([sys.executable, "-m", "gputravel.agents.sshserver", str(config)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent)
        line = self._wait_ready(timeout)
        self.port = int(line.split()[1])
        return [HolderSpec(**{**OPTIONAL, "name": name, "host": "127.0.0.1", "port": self.port, "user": name,
                              "client_key": key, "host_key": self.host_public, "data": str(Path(data).resolve()),
                              "python": sys.executable, "keepalive_interval": 2.0,
                              "data_route": self.data_route})
                for name, key, data in specs_args]

    def _wait_ready(self, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        result: list[str] = []

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            result.append(self.proc.stdout.readline().decode().strip())

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        if not result or not result[0].startswith("READY"):
            err = b""
            if self.proc.poll() is not None and self.proc.stderr is not None:
                err = self.proc.stderr.read()
            self.stop()
            raise AgentError("ssh-server", f"the embedded SSH server did not start: {err.decode(errors='replace')[-500:]}")
        threading.Thread(target=lambda: self.proc and self.proc.stderr and self.proc.stderr.read(), daemon=True).start()
        return result[0]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


StateFn = Callable[[str, str, str], None]


def links_from_inventory(path: Path, *, on_state: StateFn | None = None) -> list[SshHolderLink]:
    return [SshHolderLink(spec, on_state=on_state) for spec in load_inventory(path)]


def links_from_specs(specs: list[HolderSpec], *, on_state: StateFn | None = None) -> list[SshHolderLink]:
    return [SshHolderLink(spec, on_state=on_state) for spec in specs]

