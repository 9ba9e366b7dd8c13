"""What ``core.protocol`` and the holder agent bundle may import, as an allow-list checked on the source.

The import-linter contracts in pyproject.toml forbid a list of modules; this checks the positive rule the
docs state: ``core.protocol`` uses only the standard library and ``cryptography``; the holder agent
(the package agents/holder/: "standard library, ``cryptography`` and ``gputravel.core.protocol`` only") ships
as ``BUNDLE_FILES`` and must run from that bundle alone; the orchestrator's side of agents/ is never in it. Every import is collected with :mod:`ast`, including
imports inside functions, under ``if TYPE_CHECKING`` and in ``try`` blocks, so a lazy import cannot hide.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from gputravel.agents.holder import BUNDLE_FILES, package_root

ROOT = package_root()
PROTOCOL_DIR = ROOT / "core" / "protocol"
HOLDER_DIR = ROOT / "agents" / "holder"
THIRD_PARTY_ALLOWED = {"cryptography"}
#: the holder bundle may also use dcap_qvl (TDX quotes) and these core.evidence modules (issue 22 item 5)
BUNDLE_THIRD_PARTY = {"cryptography", "dcap_qvl"}
HOLDER_EVIDENCE = ("core/evidence/__init__.py", "core/evidence/azure_snp.py", "core/evidence/bounded.py",
                   "core/evidence/claims.py", "core/evidence/cvm_snp.py", "core/evidence/holder_check.py",
                   "core/evidence/nvidia_spdm.py", "core/evidence/policy.py", "core/evidence/snp.py",
                   "core/evidence/snp_report.py", "core/evidence/spdm_claims.py", "core/evidence/tdx.py",
                   "core/evidence/tdx_family.py")
STDLIB = set(sys.stdlib_module_names)


@dataclass(frozen=True)
class Import:
    file: str
    line: int
    module: str  # absolute dotted name ("gputravel.core.protocol.errors", "struct", "cryptography.x")

    @property
    def top(self) -> str:
        return self.module.split(".")[0]


def module_name(path: Path) -> str:
    """``gputravel.<dotted path>`` of a file under the package root (``__init__`` names the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["gputravel", *parts])


def imports_of(path: Path) -> list[Import]:
    """Every module ``path`` imports, relative imports resolved against its package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    rel = str(path.relative_to(ROOT))
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(rel, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                assert node.level - 1 < len(base), f"{rel}:{node.lineno}: relative import beyond gputravel"
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append(Import(rel, node.lineno, target))
            # ``from pkg import sub`` may name a submodule: count it too, so a bundle check sees it
            found += [Import(rel, node.lineno, f"{target}.{alias.name}") for alias in node.names
                      if alias.name != "*" and target.startswith("gputravel")]
        elif isinstance(node, ast.Call):
            # importlib.import_module("x") / __import__("x") with a literal name
            fn = node.func
            callee = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if callee in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                assert isinstance(arg, ast.Constant) and isinstance(arg.value, str), \
                    f"{rel}:{node.lineno}: dynamic import with a computed name cannot be checked"
                found.append(Import(rel, node.lineno, arg.value))
    return found


def is_module_or_package(dotted: str) -> bool:
    """Whether ``dotted`` (under gputravel) is a module file or a package folder in this checkout."""
    rel = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def protocol_files() -> list[Path]:
    files = sorted(PROTOCOL_DIR.rglob("*.py"))
    assert files, f"no sources under {PROTOCOL_DIR}"
    return files


def holder_files() -> list[Path]:
    """The holder side of agents/: every source of the agents/holder package."""
    files = sorted(HOLDER_DIR.rglob("*.py"))
    assert files, f"no sources under {HOLDER_DIR}"
    return files


# --- core.protocol: stdlib + cryptography (+ itself) ------------------------------------------------------
@pytest.mark.parametrize("path", protocol_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_protocol_imports_only_stdlib_cryptography_and_itself(path: Path) -> None:
    bad = []
    for imp in imports_of(path):
        if imp.top in STDLIB or imp.top in THIRD_PARTY_ALLOWED:
            continue
        if imp.module == "gputravel.core.protocol" or imp.module.startswith("gputravel.core.protocol."):
            continue
        bad.append(f"{imp.file}:{imp.line}: {imp.module}")
    assert bad == [], "core.protocol must import only the standard library and cryptography:\n" + "\n".join(bad)


# --- the holder agent bundle --------------------------------------------------------------------------------
def test_the_bundle_is_the_agent_and_the_protocol() -> None:
    """BUNDLE_FILES holds every source of the agents/holder package, every core.protocol source, and the
    package __init__ files on the way to them; nothing else (so the rule below is about exactly what gets
    deployed, and no orchestrator-side module of agents/ is uploaded)."""
    listed = set(BUNDLE_FILES)
    assert all((ROOT / rel).is_file() for rel in listed), sorted(r for r in listed if not (ROOT / r).is_file())
    protocol = {str(p.relative_to(ROOT)) for p in protocol_files()}
    assert protocol <= listed, f"core.protocol sources missing from the bundle: {sorted(protocol - listed)}"
    parents = {"__init__.py", "core/__init__.py", "agents/__init__.py"}
    holder = {str(p.relative_to(ROOT)) for p in holder_files()}
    assert listed == protocol | parents | holder | set(HOLDER_EVIDENCE)
    assert not any(rel.startswith("agents/") and not rel.startswith("agents/holder/") and rel != "agents/__init__.py"
                   for rel in listed)


@pytest.mark.parametrize("rel", BUNDLE_FILES)
def test_every_bundle_file_imports_only_stdlib_cryptography_and_the_bundle(rel: str) -> None:
    bundled = {module_name(ROOT / f) for f in BUNDLE_FILES}
    bad = []
    for imp in imports_of(ROOT / rel):
        if imp.top in STDLIB or imp.top in BUNDLE_THIRD_PARTY:
            continue
        if imp.top == "gputravel":
            if imp.module in bundled:
                continue
            if not is_module_or_package(imp.module):
                continue  # a name imported from a bundled module (``from ...errors import DataError``)
            if rel.startswith("agents/holder/") and not imp.module.startswith(("gputravel.core.protocol",
                                                                               "gputravel.agents.holder",
                                                                               "gputravel.core.evidence.holder_check")):
                bad.append(f"{imp.file}:{imp.line}: {imp.module} (the agent uses core only through core.protocol)")
                continue
        bad.append(f"{imp.file}:{imp.line}: {imp.module}")
    assert bad == [], "the holder agent bundle must need only the stdlib, cryptography and itself:\n" + "\n".join(bad)


def test_the_agent_uses_core_only_through_core_protocol() -> None:
    mods = {imp.module for path in holder_files() for imp in imports_of(path) if imp.top == "gputravel"}
    assert any(m.startswith("gputravel.core.protocol") for m in mods), "the agent should import the protocol it speaks"
    outside = sorted(m for m in mods if not m.startswith(("gputravel.core.protocol", "gputravel.agents.holder",
                                                          "gputravel.core.evidence.holder_check")))
    assert outside == []


# --- the checker itself ---------------------------------------------------------------------------------------
def test_the_checker_sees_lazy_relative_and_dynamic_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_root = tmp_path / "gputravel"
    pkg = fake_root / "core" / "protocol"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import cipher\n")
    (pkg / "cipher.py").write_text(
        "import struct\n"
        "from ..errors import GpuTravelError\n"
        "from .keys import DirectionKey\n"
        "def f():\n"
        "    import numpy as np\n"
        "    import importlib\n"
        "    return importlib.import_module('torch')\n"
        "try:\n"
        "    import yaml\n"
        "except ImportError:\n"
        "    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)
    mods = {i.module for i in imports_of(pkg / "cipher.py")}
    assert {"struct", "gputravel.core.errors", "gputravel.core.protocol.keys", "numpy", "importlib", "torch",
            "yaml"} <= mods
    assert "gputravel.core.protocol.cipher" in {i.module for i in imports_of(pkg / "__init__.py")}


# --- no import circles ------------------------------------------------------------------------------------
#: No circle is left: the travel engine's helpers take the parts of the run they use (DeviceSession,
#: TrainingLog, Checkpointer, Audit, Itinerary), not the engine (issue 26). A new circle fails this test.
KNOWN_CIRCLES: list[frozenset[str]] = []


def import_circles() -> list[frozenset[str]]:
    """Strongly connected groups of more than one module in gputravel's import graph (grimp's: imports in
    functions and under TYPE_CHECKING count too), found by the architecture table's own Tarjan
    (``scripts/arch_table.py``: ``strongly_connected``)."""
    import grimp

    from scripts.arch_table import strongly_connected

    graph = grimp.build_graph("gputravel")
    adj = {m: sorted(graph.find_modules_directly_imported_by(m) & graph.modules) for m in graph.modules}
    return [frozenset(group) for group in strongly_connected(sorted(adj), adj) if len(group) > 1]


def test_no_import_circle() -> None:
    circles = import_circles()
    new = [sorted(c) for c in circles if not any(c <= known for known in KNOWN_CIRCLES)]
    assert new == [], f"new import circles: {new}"
