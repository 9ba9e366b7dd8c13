"""One composition root: every run is built in ``core/compose.py``, and the programs a run starts are named by
the console and passed in (core names no console or agents module)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers import REPO_ROOT

from gputravel.console.entries import ENTRIES, GPU_RANK, HOLDER_AGENT
from gputravel.core import compose
from gputravel.core.config import RunSettings
from gputravel.core.entries import Entries
from gputravel.core.errors import ConfigError
from gputravel.core.travel.local_link import LocalHolderLink

ROOT = REPO_ROOT


def test_core_names_no_console_or_agents_module() -> None:
    named = [f"{path.relative_to(ROOT)}: {word}" for path in sorted((ROOT / "core").rglob("*.py"))
             for word in ("gputravel.console", "gputravel.agents") if word in path.read_text("utf-8")]
    assert named == []


def test_the_console_entries_name_modules_that_exist() -> None:
    assert ENTRIES.holder_agent == ("-m", HOLDER_AGENT) and ENTRIES.rank() == GPU_RANK
    for module in (HOLDER_AGENT, GPU_RANK):
        assert importlib.util.find_spec(module) is not None, module
    assert dict(ENTRIES.process_roles)[HOLDER_AGENT] == "agents"


def test_local_holders_without_an_agent_entry_are_refused_before_the_run_folder_exists(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="holder agent entry"):
        compose.build_engine(RunSettings(out_dir=out, transport="local"))
    assert not out.exists()


def test_a_fleet_without_a_rank_entry_is_refused() -> None:
    with pytest.raises(ConfigError, match="GPU rank entry"):
        Entries(holder_agent=("-m", HOLDER_AGENT)).rank()


def test_a_local_link_starts_the_agent_the_caller_names(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no agent entry"):
        LocalHolderLink("alice", tmp_path, agent=())
    link = LocalHolderLink("alice", tmp_path, agent=ENTRIES.holder_agent)
    assert link.agent == ("-m", HOLDER_AGENT)


def test_the_console_app_asks_the_bridge_what_it_can_do_never_its_type() -> None:
    for name in ("app.py", "app_commands.py"):
        text = (ROOT / "console" / "tui" / name).read_text("utf-8")
        assert "isinstance(self.bridge" not in text, name
