"""The holder inventory (``holders.toml``): which holders exist and how to reach them.

Example::

    [defaults]                      # optional; any holder field except name/host/data
    user = "gputravel"
    python = "python3"

    [[holder]]
    name = "hospital-a"
    host = "10.0.0.5"
    port = 22
    user = "holder-a"
    client_key = "keys/holder-a"    # relative paths are relative to this file
    host_key = "ssh-ed25519 AAAAC3..."   # pinned host key, or:
    # known_hosts = "known_hosts"
    data = "/srv/holder-a/data"     # dataset folder on the holder
    python = "/usr/bin/python3"

A holder-pinned holder (issue 30) says ``managed = false``: it installed gputravel itself, ran ``gputravel holder
init`` and authorized the orchestrator's key with a forced ``holder serve`` (``gputravel holder authorize``). Its
``data``, ``python``, ``attest_policy`` and ``golden`` are its own business and may be absent; given, they are
ignored with a warning (``HolderSpec.ignored``): nothing here changes what such a holder checks.

Host keys are always checked: each holder needs ``host_key`` or ``known_hosts``; nothing is
accepted on first use. A ``client_key`` that is group- or world-readable (or not this user's) is refused
with ``InsecureKeyError`` naming the file: ``chmod 600`` it.
"""

from __future__ import annotations

import math
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh

from gputravel.core.errors import ConfigError
from gputravel.core.files import read_private

REQUIRED = ("name", "host", "user", "client_key", "data")
#: what a holder-pinned holder (``managed = false``) decides itself: ignored here, with a warning
HOLDER_OWNED = ("data", "python", "attest_policy", "golden", "val_fraction", "remote_dir")
OPTIONAL: dict[str, Any] = {
    "port": 22,
    "host_key": None,
    "known_hosts": None,
    "python": "python3",
    "connect_timeout": 10.0,
    "keepalive_interval": 5.0,
    "keepalive_count_max": 3,
    "remote_dir": ".gputravel",
    "val_fraction": 0.1,
    "data_route": "forward",
    "attest_policy": None,
    "golden": None,
    "managed": True,
}
ALLOWED = set(REQUIRED) | set(OPTIONAL)


@dataclass(frozen=True, slots=True)
class HolderSpec:
    name: str
    host: str
    port: int
    user: str
    client_key: Path
    host_key: str | None
    known_hosts: Path | None
    data: str
    python: str
    connect_timeout: float
    keepalive_interval: float
    keepalive_count_max: int
    remote_dir: str
    val_fraction: float
    #: how the agent reaches the device's data port on the direct path: "forward" through an SSH remote
    #: port forward on this holder's connection (works wherever SSH does), or "network" straight to the
    #: address the device's data port is bound to (``--data-host``, which the holder must be able to reach)
    data_route: str = "forward"
    #: the holder attests the CVM and the GPU before each key (issue 22 item 5): its own evidence policy (pinned
    #: roots) and approved golden measurements, paths on the holder's machine; None: it does not attest
    attest_policy: str | None = None
    golden: str | None = None
    #: False: a holder-pinned holder (issue 30): nothing is uploaded, its key runs ``gputravel holder serve``, its
    #: own configuration decides what it trusts; ``ignored`` names the fields given here that it does not take
    managed: bool = True
    ignored: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "host": self.host, "port": self.port, "user": self.user,
                "client_key": str(self.client_key), "host_key_pinned": self.host_key is not None,
                "known_hosts": str(self.known_hosts) if self.known_hosts else None, "data": self.data,
                "python": self.python, "managed": self.managed}


def _check_type(where: str, key: str, value: Any, kind: type | tuple[type, ...]) -> None:
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{where}: '{key}' must be {names}, got {type(value).__name__}")


#: numeric fields: (lowest, highest, whether each bound is allowed itself); every value must also be finite
RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "port": (1, 65535, True, True),
    "connect_timeout": (0, 3600, False, True),  # seconds; asyncssh refuses a negative one only once it connects
    "keepalive_interval": (0, 86_400, True, True),  # 0: no keepalives
    "keepalive_count_max": (1, 1000, True, True),
    "val_fraction": (0, 0.5, False, False),  # as a run's --val-fraction
}


def _check_ranges(where: str, entry: dict[str, Any]) -> None:
    """Every number finite and inside its range, every name and path a non-empty line without control
    characters: checked when the inventory is read, before a run creates anything."""
    for key, (lo, hi, lo_ok, hi_ok) in RANGES.items():
        value = entry[key]
        inside = (lo <= value if lo_ok else lo < value) and (value <= hi if hi_ok else value < hi)
        if not math.isfinite(value) or not inside:
            span = f"{'[' if lo_ok else '('}{lo:g}, {hi:g}{']' if hi_ok else ')'}"
            raise ConfigError(f"{where}: {key} {value!r} out of range: '{key}' must be a finite number in {span}")
    for key in ("name", "host", "user", "client_key", "data", "python", "remote_dir"):
        value = entry[key]
        if not value.strip() or any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ConfigError(f"{where}: '{key}' must be a non-empty line without control characters, "
                              f"not {value!r}")


def parse_inventory(text: str, *, base: Path, source: str = "holders.toml") -> list[HolderSpec]:
    """Parse and validate an inventory; every problem is a ``ConfigError`` naming the field."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    unknown_top = set(doc) - {"defaults", "holder"}
    if unknown_top:
        raise ConfigError(f"{source}: unknown section(s) {', '.join(sorted(unknown_top))}")
    defaults = doc.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ConfigError(f"{source}: [defaults] must be a table")
    for key in defaults:
        if key not in ALLOWED or key in ("name", "host", "data"):
            raise ConfigError(f"{source}: [defaults] has unknown or per-holder key '{key}'")
    holders = doc.get("holder")
    if not isinstance(holders, list) or not holders:
        raise ConfigError(f"{source}: no [[holder]] entries")
    specs: list[HolderSpec] = []
    seen: set[str] = set()
    for i, raw in enumerate(holders):
        where = f"{source}: holder #{i + 1}"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: must be a table")
        unknown = set(raw) - ALLOWED
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        entry = {**OPTIONAL, **defaults, **raw}
        _check_type(f"{where}", "managed", entry["managed"], bool)
        ignored: tuple[str, ...] = ()
        if not entry["managed"]:  # the holder's own business: ignored, said once (issue 30)
            ignored = tuple(k for k in HOLDER_OWNED if k in raw or k in defaults)
            entry = {**entry, **{k: OPTIONAL.get(k) for k in HOLDER_OWNED}, "data": "(the holder's own)"}
            if ignored:
                print(f"gputravel: warning: {where} ({raw.get('name', '?')}) is holder-pinned (managed = false): its "
                      f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} the holder's own and ignored here",
                      file=sys.stderr)
        for key in REQUIRED:
            if key not in entry:
                raise ConfigError(f"{where}: missing field '{key}'")
        where = f"{source}: holder '{entry['name']}'"
        for key in ("name", "host", "user", "client_key", "data", "python", "remote_dir", "data_route"):
            _check_type(where, key, entry[key], str)
        _check_type(where, "port", entry["port"], int)
        _check_type(where, "keepalive_count_max", entry["keepalive_count_max"], int)
        for key in ("connect_timeout", "keepalive_interval", "val_fraction"):
            _check_type(where, key, entry[key], (int, float))
        if entry["data_route"] not in ("forward", "network"):
            raise ConfigError(f"{where}: data_route must be 'forward' or 'network', not {entry['data_route']!r}")
        _check_ranges(where, entry)
        if entry["name"] in seen:
            raise ConfigError(f"{where}: duplicate holder name")
        seen.add(entry["name"])
        key_path = (base / entry["client_key"]).expanduser()
        key_bytes = read_private(key_path, what=f"{where}: client_key")  # readable; like ssh: no key others can read
        check_client_key(key_bytes, key_path, where=where)
        known = None
        if entry["known_hosts"] is not None:
            _check_type(where, "known_hosts", entry["known_hosts"], str)
            known = (base / entry["known_hosts"]).expanduser()
            try:
                exists = known.is_file()
            except (OSError, ValueError):  # e.g. a name too long
                exists = False
            if not exists:
                raise ConfigError(f"{where}: known_hosts {known} does not exist")
        if entry["host_key"] is not None:
            _check_type(where, "host_key", entry["host_key"], str)
        for key in ("attest_policy", "golden"):
            if entry[key] is not None:
                _check_type(where, key, entry[key], str)
        if (entry["attest_policy"] is None) != (entry["golden"] is None):
            raise ConfigError(f"{where}: attest_policy and golden go together (the holder's pinned roots and its "
                              "approved GPU measurements)")
        if entry["host_key"] is None and known is None:
            raise ConfigError(f"{where}: needs 'host_key' or 'known_hosts' (host keys are never accepted blindly)")
        specs.append(HolderSpec(
            name=entry["name"], host=entry["host"], port=entry["port"], user=entry["user"], client_key=key_path,
            host_key=entry["host_key"], known_hosts=known, data=entry["data"], python=entry["python"],
            connect_timeout=float(entry["connect_timeout"]), keepalive_interval=float(entry["keepalive_interval"]),
            keepalive_count_max=entry["keepalive_count_max"], remote_dir=entry["remote_dir"],
            val_fraction=float(entry["val_fraction"]), data_route=entry["data_route"],
            attest_policy=entry["attest_policy"], golden=entry["golden"], managed=entry["managed"],
            ignored=ignored))
    return specs


def check_client_key(data: bytes, path: Path, *, where: str) -> None:
    """A ``client_key`` must be a private key asyncssh reads without a passphrase (none is ever asked for)."""
    try:
        asyncssh.import_private_key(data)
    except (asyncssh.KeyImportError, ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: client_key {path} is not a private key without a passphrase "
                          f"(OpenSSH or PEM): {exc}") from None


def load_inventory(path: Path) -> list[HolderSpec]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the inventory {path}: {exc.strerror}") from None
    return parse_inventory(text, base=Path(path).resolve().parent, source=str(path))
