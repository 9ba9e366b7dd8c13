"""RunSettings: the engine's defaults are the fast pipeline, and bad values are named ConfigErrors."""

from __future__ import annotations

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
