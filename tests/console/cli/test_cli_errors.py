"""The installed CLI reports usage and gputravel errors with their exit codes, never a traceback."""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys

import pytest
from helpers import REPO_ROOT

from gputravel.core.errors import (
    AgentError,
    CollectiveError,
    ConfigError,
    GpuTravelError,
    LinkLostError,
    error_from_code,
)


def gputravel(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gputravel.console.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_a_bad_parameter_exits_2_with_a_message_and_no_traceback() -> None:
    proc = gputravel("bench", "provision", "--path", "foo")
    assert proc.returncode == 2
    assert "unknown path 'foo'" in proc.stderr and "Traceback" not in proc.stderr


def test_an_unknown_option_exits_2() -> None:
    proc = gputravel("run", "--no-such-option")
    assert proc.returncode == 2 and "No such option" in proc.stderr and "Traceback" not in proc.stderr


def test_a_gputravel_error_maps_to_its_exit_code(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = gputravel("ledger", "verify", str(tmp_path / "missing.db"))  # no such ledger: bad input, not a verdict
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert str(tmp_path / "missing.db") in proc.stderr
    not_a_ledger = tmp_path / "notes.db"
    not_a_ledger.write_text("not sqlite")
    proc = gputravel("ledger", "verify", str(not_a_ledger))
    assert proc.returncode == 8 and "Traceback" not in proc.stderr


# --- one error tree, every error with a documented exit code ----------------------------------------
def _every_error_class() -> list[type[GpuTravelError]]:
    """Every ``GpuTravelError`` subclass defined anywhere in gputravel (each module imported first)."""
    import gputravel

    for info in pkgutil.walk_packages(gputravel.__path__, "gputravel."):
        if info.name.rsplit(".", 1)[-1] != "__main__" and ".tests" not in info.name:
            importlib.import_module(info.name)
    seen: list[type[GpuTravelError]] = []
    todo = [GpuTravelError]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("gputravel.") and cls not in seen:
            seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def _readme_exit_codes() -> dict[int, str]:
    """README's exit-code table: code -> the meaning column."""
    text = (REPO_ROOT / "README.md").read_text()
    table = text[text.index("### Exit codes"):].split("\n\n")[1]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"^\| (\d+) \| (.*) \|$", line)
        if m:
            rows[int(m.group(1))] = m.group(2)
    return rows


def test_every_error_class_has_an_exit_code_documented_under_its_own_name_in_the_readme() -> None:
    table = _readme_exit_codes()
    classes = _every_error_class()
    assert len(classes) >= 20  # the walk found the tree, not just its root
    undocumented = [f"{cls.__name__} (exit {cls.exit_code})" for cls in classes
                    if f"`{cls.__name__}`" not in table.get(cls.exit_code, "")]
    assert undocumented == []
    assert {AgentError.exit_code, LinkLostError.exit_code, CollectiveError.exit_code} <= set(table)


def test_every_error_of_the_tree_file_has_its_own_code_and_rebuilds_from_the_wire() -> None:
    from gputravel.core.protocol import errors

    defined = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, GpuTravelError) and c.__module__ == errors.__name__]
    own = [c for c in defined if c not in errors.WIRE_ALIASES]
    assert sorted(c.__name__ for c in own) == sorted(c.__name__ for c in errors.ERRORS_BY_CODE.values())
    assert len({c.code for c in own}) == len(own)  # codes are unique
    for cls in own:
        sent = cls.from_reason("h1: it broke")
        back = error_from_code(sent.code, sent.reason)
        assert type(back) is cls and back.reason == sent.reason, cls
    # a holder-side class travels under its parent's code and exit code, and comes back as the parent
    for alias, parent in errors.WIRE_ALIASES.items():
        sent = alias("h1: it broke")
        assert issubclass(alias, GpuTravelError) and (alias.code, alias.exit_code) == (parent.code, parent.exit_code)
        back = error_from_code(sent.code, sent.reason)
        assert type(back) is parent and str(back).endswith("h1: it broke"), alias
    unknown = error_from_code("from-a-newer-peer", "it broke")
    assert type(unknown) is GpuTravelError and unknown.code == "from-a-newer-peer"
    lost = error_from_code("link-lost", "alice: connection reset")
    assert isinstance(lost, LinkLostError) and lost.host == "alice" and lost.exit_code == 6


def test_the_collectives_raise_named_errors_from_the_tree() -> None:
    from gputravel.core.collectives.bench import parse_variants
    from gputravel.core.collectives.crypto import HostCrypto
    from gputravel.core.collectives.launch import WorkerError
    from gputravel.core.collectives.ring import RingFault, SecureRing

    with pytest.raises(ConfigError, match="unknown variant 'bogus'"):
        parse_variants("plain,bogus")
    with pytest.raises(ConfigError, match="workers"):
        HostCrypto(workers=-1)
    with pytest.raises(ConfigError, match="fault kind"):
        RingFault(kind="melt", rank=0)
    with pytest.raises(CollectiveError, match="not initialized"):
        SecureRing(keys=None)
    assert issubclass(WorkerError, CollectiveError) and WorkerError({1: ("TagError", "bad tag")}).exit_code == 10


def test_a_bad_collective_variant_exits_2_naming_it() -> None:
    proc = gputravel("bench", "allreduce", "--variants", "bogus")
    assert proc.returncode == 2
    assert "unknown variant 'bogus'" in proc.stderr and "Traceback" not in proc.stderr


def test_every_commands_summary_is_one_line_so_the_command_list_never_breaks_it_mid_sentence() -> None:
    """The command list (``gputravel bench --help``) shows a command's first docstring paragraph with its line
    breaks: that paragraph must be one line, the details after a blank line."""
    import ast

    broken = []
    for path in sorted((REPO_ROOT / "console" / "cli" / "commands").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("command" in ast.unparse(d) for d in node.decorator_list):
                summary = (ast.get_docstring(node) or "").split("\n\n")[0]
                if not summary or "\n" in summary:
                    broken.append(f"{path.name}::{node.name}")
    assert not broken, broken
