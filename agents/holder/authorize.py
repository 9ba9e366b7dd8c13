"""The orchestrator's key on a holder's account, restricted (issue 30 item 2): ``gputravel holder authorize|revoke``.

One ``authorized_keys`` line per orchestrator key::

    restrict,command="<the holder's own gputravel> holder serve --config <its folder>" ssh-ed25519 AAAA... gputravel-holder

``restrict`` turns off every forwarding, the agent, X11 and the pty; the forced command runs the holder's own
``holder serve`` whatever command the client asks for (OpenSSH then runs no shell and no SFTP subsystem for this
key: an SFTP request is that command too, and speaks no SFTP). ``--data-forward`` adds ``port-forwarding``,
``permitlisten="127.0.0.1:*"`` and ``permitopen="127.0.0.1:1"``: the key may then listen on the holder's loopback
only (the direct data path's forward: a remote forward to the device's data port) and open no useful local
forward. ``--permit-open HOST:PORT`` puts that one address in ``permitopen`` instead (a local forward may reach it,
and nothing else). Every line
already there for the same key (an old unrestricted one included) is replaced, so the restricted line is the only
one OpenSSH can match. Standard library and ``cryptography`` only.
"""

from __future__ import annotations

import base64
import os
import re
import shlex
import sys
from pathlib import Path

from cryptography.hazmat.primitives.serialization import load_ssh_public_key

from gputravel.core.protocol.errors import ConfigError

__all__ = ["KEY_COMMENT", "authorize", "forced_command", "key_blob", "revoke"]

KEY_COMMENT = "gputravel-holder"
_HOSTPORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):([0-9]{1,5})$")
_KEY_TYPES = re.compile(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh.com|"
                        r"sk-ecdsa-sha2-nistp256@openssh.com)$")


def key_blob(text: str, *, where: str = "--key") -> tuple[str, str]:
    """``(type, base64)`` of one OpenSSH public key line (``type base64 [comment]``); ``ConfigError`` otherwise."""
    parts = text.strip().split()
    if len(parts) < 2 or not _KEY_TYPES.match(parts[0]):
        raise ConfigError(f"{where}: not an OpenSSH public key line (`ssh-ed25519 AAAA... comment`)")
    try:
        raw = base64.b64decode(parts[1], validate=True)
        if not parts[0].startswith("sk-"):
            load_ssh_public_key(f"{parts[0]} {parts[1]}".encode())
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: the public key does not parse ({exc})") from None
    if not raw:
        raise ConfigError(f"{where}: empty key")
    return parts[0], parts[1]


def forced_command(config_dir: Path) -> str:
    """The holder's own ``gputravel holder serve`` (this installation), with its configuration folder."""
    exe = Path(sys.executable).parent / "gputravel"
    head = [str(exe)] if exe.is_file() and os.access(exe, os.X_OK) else [sys.executable, "-m", "gputravel.console.cli"]
    return shlex.join([*head, "holder", "serve", "--config", str(config_dir)])


#: the only listen address a key allowed forwarding may ask for: the holder's loopback, any port (OpenSSH takes no
#: port 0 here, and the data route asks for port 0: a free one)
PERMIT_LISTEN = "127.0.0.1:*"
#: authorized_keys cannot allow remote forwards alone (``port-forwarding`` opens both ways, and ``permitopen`` has no
#: "none" there), so a key allowed only the data route's forward may open local forwards to this one address: the
#: holder's loopback port 1, where nothing listens unless the holder's root puts it there (checked, OpenSSH 9.2)
NO_OPEN = "127.0.0.1:1"


def _line(kind: str, blob: str, command: str, permit_open: str | None, data_forward: bool = False) -> str:
    quoted = command.replace("\\", "\\\\").replace('"', '\\"')
    options = f'restrict,command="{quoted}"'
    if permit_open is not None or data_forward:
        options += f',port-forwarding,permitlisten="{PERMIT_LISTEN}",permitopen="{permit_open or NO_OPEN}"'
    return f"{options} {kind} {blob} {KEY_COMMENT}"


def _matches(line: str, blob: str) -> bool:
    return blob in line.split()


def _authorized_keys(home: Path | None) -> Path:
    return (home or Path.home()) / ".ssh" / "authorized_keys"


def _read(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None


def _write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.gputravel-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, ("\n".join(lines) + "\n" if lines else "").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def authorize(key_text: str, *, config_dir: Path, permit_open: str | None = None, home: Path | None = None,
              command: str | None = None, data_forward: bool = False) -> tuple[Path, str, int]:
    """Add (or replace) the orchestrator key's one restricted line; ``(authorized_keys, the line, lines replaced)``.
    ``data_forward``: the key may listen on the holder's loopback (the direct data path's ``data_route =
    "forward"``: a remote forward whose far end is the device's data port); ``permit_open``: the one address its
    local forwards may reach. Either allows the other's minimum only (``PERMIT_LISTEN``, ``NO_OPEN``).

    Raises ``ConfigError``: not a public key, a malformed ``HOST:PORT``."""
    kind, blob = key_blob(key_text)
    if permit_open is not None:
        m = _HOSTPORT.match(permit_open)
        if not m or not 1 <= int(m.group(2)) <= 65535:
            raise ConfigError(f"--permit-open {permit_open!r}: must be HOST:PORT (a port in 1..65535)")
    path = _authorized_keys(home)
    lines = _read(path)
    kept = [ln for ln in lines if not _matches(ln, blob)]
    line = _line(kind, blob, command or forced_command(config_dir), permit_open, data_forward)
    _write(path, [*kept, line])
    return path, line, len(lines) - len(kept)


def revoke(key_text: str, *, home: Path | None = None) -> tuple[Path, int]:
    """Remove every line of this key; ``(authorized_keys, lines removed)``. ``ConfigError`` when there was none."""
    _kind, blob = key_blob(key_text)
    path = _authorized_keys(home)
    lines = _read(path)
    kept = [ln for ln in lines if not _matches(ln, blob)]
    if len(kept) == len(lines):
        raise ConfigError(f"{path}: this key is not authorized (nothing to revoke)")
    _write(path, kept)
    return path, len(lines) - len(kept)
