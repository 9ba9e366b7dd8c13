"""RunSettings and the holder inventory: the engine's defaults are the fast pipeline, and bad values are named
ConfigErrors, found before anything is created."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gputravel.core.config import RunSettings
from gputravel.core.errors import ConfigError


def test_the_optimised_data_path_is_the_default() -> None:
    settings = RunSettings()
    # issue 5: direct on by default; parallel auth and overlap decided per machine (None = auto)
    assert settings.data_path == "direct"
    assert settings.parallel_auth is None and settings.overlap is None


def test_ssh_is_an_alias_of_the_channel_path() -> None:
    assert RunSettings(data_path="ssh").data_path == "channel"
    assert RunSettings(data_path="ssh").to_dict()["data_path"] == "channel"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("data_path", "carrier-pigeon", "data path is direct, channel (ssh) or conventional"),
    ("transport", "ftp", "transport is local, ssh or inventory"),
    ("chunk_kib", 2, "chunk-kib must be in"),
    ("holders", 0, "holders must be >= 1"),
    ("visit_attempts", 0, "visit-attempts must be >= 1"),
])
def test_bad_values_are_named_config_errors(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunSettings(**{field: value})


# --- issue 24.7: settings and inventory validated fully before anything is created --------------------------
@pytest.mark.parametrize(("field", "value"), [("lr", math.nan), ("lr", math.inf), ("buffer_mib", math.nan),
                                              ("val_fraction", 1.5), ("val_share", -math.inf)])
def test_non_finite_and_out_of_range_numbers_are_named_config_errors(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field.replace("_", "-")):
        RunSettings(**{field: value})


def _inventory(tmp_path: Path, extra: str) -> Path:
    import asyncssh

    key = asyncssh.generate_private_key("ssh-ed25519")
    key.write_private_key(str(tmp_path / "client"))
    (tmp_path / "client").chmod(0o600)
    pub = key.export_public_key().decode().strip()
    path = tmp_path / "holders.toml"
    path.write_text(f'[[holder]]\nname = "alice"\nhost = "127.0.0.1"\nuser = "u"\nclient_key = "client"\n'
                    f'data = "/srv/a"\nhost_key = "{pub}"\n{extra}\n')
    return path


@pytest.mark.parametrize(("line", "field"), [
    ("connect_timeout = -1", "connect_timeout"), ("connect_timeout = nan", "connect_timeout"),
    ("connect_timeout = inf", "connect_timeout"), ("keepalive_interval = -inf", "keepalive_interval"),
    ("val_fraction = 1.5", "val_fraction"), ("val_fraction = nan", "val_fraction"),
    ("keepalive_count_max = 0", "keepalive_count_max"), ("port = 0", "port"), ('python = ""', "python"),
    ('user = "u\\nx"', "user"),
])
def test_inventory_numbers_must_be_finite_and_in_range(tmp_path: Path, line: str, field: str) -> None:
    from gputravel.agents.inventory import load_inventory

    text = _inventory(tmp_path, "").read_text()
    key = line.split(" =")[0]
    text = "\n".join(x for x in text.splitlines() if not x.startswith(f"{key} =")) + f"\n{line}\n"
    (tmp_path / "holders.toml").write_text(text)
    with pytest.raises(ConfigError, match=f"'{field}'"):
        load_inventory(tmp_path / "holders.toml")


@pytest.mark.process
def test_a_negative_connect_timeout_exits_2_with_the_json_error_and_no_run_folder(tmp_path: Path) -> None:
    _inventory(tmp_path, "connect_timeout = -1")
    proc = subprocess.run([sys.executable, "-m", "gputravel.console.cli", "run", "--holders-file", "holders.toml",
                           "--json"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and doc["error"]["type"] == "ConfigError" and doc["error"]["exit_code"] == 2
    assert "connect_timeout" in doc["error"]["message"]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("field", "value"), [
    ("model", 5), ("device", ""), ("resume", "yes"), ("parallel_auth", 1), ("data_host", "a\nb"),
    ("breakpoints", "TRAIN"),
])
def test_settings_of_the_wrong_type_are_named_config_errors(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field.replace("_", "-").replace("breakpoints", "break-before")):
        RunSettings(**{field: value})


def test_a_settings_json_of_the_wrong_types_is_refused_by_name() -> None:
    saved = RunSettings().to_dict()
    with pytest.raises(ConfigError, match="cc-mode must be a string"):
        RunSettings.from_dict({**saved, "cc_mode": ["on"]})
