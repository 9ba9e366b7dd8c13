"""Every name in a run folder is spelled in one module: ``core/runfolder/folder.py`` (``RunFolder``).

The tree's string literals are read with ``ast`` (docstrings left out: prose may name a file); a literal
spells a name when it is the name, or a path with the name as one of its parts (``"rank-*/ledger.db"``,
``f"rank-{n}"``). Messages with spaces ("no ledger.db (removed?)") are prose, not a path.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("core", "agents", "console")
HOME = "core/runfolder/folder.py"
NAMES = ("settings.json", "ledger.db", "recording.db", "status.json", "orchestrator.pid", "report.json",
         "fleet.json", "sim-cvm", "checkpoint.key", "device.log", "rank-")
#: literals that spell a name but mean something else, each with its reason
NOT_A_RUN_FOLDER = {
    ("core/collectives/keys.py", "rank-"): "the ring's device certificate names its rank (rank-N), no folder",
    ("core/protocol/errors.py", "rank-"): "the error code rank-report names a rank's report, no folder",
}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _spells(text: str, name: str) -> bool:
    if any(c.isspace() for c in text):
        return False
    parts = text.split("/")
    if name.endswith("-"):
        return any(p.startswith(name) for p in parts)
    return name in parts


def spellings(root: Path = ROOT) -> dict[str, set[str]]:
    """Each name and the modules whose string literals spell it."""
    found: dict[str, set[str]] = {n: set() for n in NAMES}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                    for name in NAMES:
                        if _spells(node.value, name) and (rel, name) not in NOT_A_RUN_FOLDER:
                            found[name].add(rel)
    return found


@pytest.mark.parametrize("name", NAMES)
def test_each_run_folder_name_is_spelled_in_one_module(name: str) -> None:
    assert spellings()[name] == {HOME}, f"{name!r} is spelled outside {HOME}: use RunFolder's property"


def test_the_grep_finds_a_name_spelled_elsewhere(tmp_path: Path) -> None:
    """The check itself: a literal path spelled outside the home module is found; a message is not."""
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "x.py").write_text('"""ledger.db in a docstring."""\n'
                                           'A = out / "ledger.db"\nB = f"rank-{3}"\nC = "no ledger.db here"\n')
    found = spellings(tmp_path)
    assert found["ledger.db"] == {"core/x.py"} and found["rank-"] == {"core/x.py"}
    assert found["recording.db"] == set()
