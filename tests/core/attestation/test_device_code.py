"""The code measurement covers exactly the device's code (issue 26 item 3): the declared list
(``core/attestation/device_code.py``) is what the device's entry points import, statically (function-level
imports included) and in a fresh process; a change to a device module changes the measurement, a change to
the orchestrator's side (the device client, the travel engine) does not."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gputravel.core.attestation import code_measurement
from gputravel.core.attestation.device_code import DEVICE_CODE, DEVICE_ENTRIES, package_root
from gputravel.core.errors import ConfigError

ROOT = package_root()
#: orchestrator-side files a test edits to show they are not measured
ORCHESTRATOR_FILES = ("core/deviceclient/client.py", "core/deviceclient/anchors.py", "core/travel/engine.py",
                      "core/api.py", "core/ledger/__init__.py")


def file_of(module: str) -> Path | None:
    """The source file of a ``gputravel`` module under ROOT (a package's ``__init__.py``), or None."""
    path = ROOT.joinpath(*module.split(".")[1:])
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_by(module: str) -> set[str]:
    """Every ``gputravel`` module ``module`` imports anywhere in its body (functions too; not under
    ``TYPE_CHECKING``), with the packages the import runs on the way."""
    path = file_of(module)
    assert path is not None, module
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # ``from pkg import submodule``
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found: set[str] = set()
    for name in names:
        if name.split(".")[0] != "gputravel" or file_of(name) is None:
            continue
        parts = name.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if file_of(".".join(parts[:i])))
    return found


def device_closure() -> set[str]:
    todo = [".".join(e.split(".")[:i]) for e in DEVICE_ENTRIES for i in range(1, e.count(".") + 2)]
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(imported_by(module) - seen)
    return seen


def relative(module: str) -> str:
    path = file_of(module)
    assert path is not None, module
    return path.relative_to(ROOT).as_posix()


def test_the_declared_device_code_is_exactly_what_the_device_entries_import() -> None:
    walked = {relative(m) for m in device_closure()}
    declared = set(DEVICE_CODE)
    assert len(declared) == len(DEVICE_CODE), "DEVICE_CODE names a file twice"
    assert walked - declared == set(), f"the device imports files DEVICE_CODE does not name: {sorted(walked - declared)}"
    assert declared - walked == set(), f"DEVICE_CODE names files the device never imports: {sorted(declared - walked)}"


PROBE = """
import json, sys
for name in json.loads(sys.argv[1]):
    __import__(name)
print(json.dumps(sorted(m for m in sys.modules if m == "gputravel" or m.startswith("gputravel."))))
"""


def test_a_fresh_device_process_loads_only_declared_device_code() -> None:
    # the entries' modules (``__main__`` only calls ``entry.main``: importing it would start a device)
    entries = ["gputravel.core.device.entry", "gputravel.core.device.service", "gputravel.core.fleet.device"]
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(entries)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    loaded = {relative(m) for m in json.loads(out.strip().splitlines()[-1])}
    assert "core/device/service.py" in loaded and "core/fleet/device.py" in loaded
    assert loaded - set(DEVICE_CODE) == set(), f"loaded but not measured: {sorted(loaded - set(DEVICE_CODE))}"
    assert not any(f.startswith(("core/deviceclient/", "core/travel/")) for f in loaded)


def test_no_orchestrator_module_is_measured() -> None:
    orchestrator = ("core/deviceclient/", "core/travel/", "core/ledger/", "core/api.py", "core/runfolder.py",
                    "core/session.py", "core/platform/", "console/", "agents/")
    assert [f for f in DEVICE_CODE if f.startswith(orchestrator)] == []
    assert {"core/device/server.py", "core/device/service.py", "core/training/trainer.py",
            "core/protocol/devicelink.py"} <= set(DEVICE_CODE)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the device's code and of a few orchestrator files, to edit."""
    for rel in (*DEVICE_CODE, *ORCHESTRATOR_FILES):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, tmp_path / rel)
    return tmp_path


def test_the_copy_measures_as_the_installed_package(tree: Path) -> None:
    assert code_measurement(root=tree) == code_measurement()


@pytest.mark.parametrize("rel", ["core/device/server.py", "core/device/openers.py", "core/training/trainer.py",
                                 "core/protocol/deviceanswers.py", "core/fleet/device.py"])
def test_changing_a_device_module_changes_the_measurement(tree: Path, rel: str) -> None:
    before = code_measurement(root=tree)
    with (tree / rel).open("a") as f:
        f.write("\n# one more line\n")
    assert code_measurement(root=tree) != before


@pytest.mark.parametrize("rel", ORCHESTRATOR_FILES)
def test_changing_an_orchestrator_module_leaves_the_measurement(tree: Path, rel: str) -> None:
    before = code_measurement(root=tree)
    with (tree / rel).open("a") as f:
        f.write("\n# one more line\n")
    assert code_measurement(root=tree) == before


def test_a_device_file_missing_from_the_tree_is_a_config_error(tree: Path) -> None:
    (tree / "core/device/intake.py").unlink()
    with pytest.raises(ConfigError, match="core/device/intake.py"):
        code_measurement(root=tree)
