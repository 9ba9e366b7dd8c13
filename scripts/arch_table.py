"""Measure the tree for docs/architecture.md: per package, its modules, lines and largest module; the import
circles (grimp) and the import contracts (pyproject.toml). Prints Markdown.

    python scripts/arch_table.py            # the measured table
    python scripts/arch_table.py --layout   # README's layout: the top level and each package, one line each
    python scripts/arch_table.py --imports  # which packages each package imports (runtime imports)

Counts git-tracked ``*.py`` files (so a clean clone gives the same figures); a package's row counts the modules
directly in its folder, not its subpackages'. Lines are physical lines (``wc -l``). mypy is not measured here.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = "gputravel"
LIMIT = 600


def tracked(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=root, check=True, capture_output=True, text=True).stdout
    return sorted(p for p in out.splitlines() if (root / p).is_file())


def lines_of(path: Path) -> int:
    return len(path.read_bytes().splitlines())


def packages(files: list[str]) -> dict[str, list[str]]:
    """Folder -> the ``*.py`` files directly in it, for every folder outside tests/ holding an ``__init__.py``."""
    found: dict[str, list[str]] = {}
    for f in files:
        if not f.endswith(".py") or f.startswith(("tests/", "scripts/")):
            continue
        folder = os.path.dirname(f) or "."
        found.setdefault(folder, []).append(f)
    return {k: v for k, v in found.items() if any(p.endswith("__init__.py") for p in v)}


def import_graph(root: Path, *, type_checking: bool) -> dict[str, list[str]]:
    """Module -> the project modules it imports (grimp), the tree at ``root`` analysed as package ``gputravel``."""
    import grimp

    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(root, Path(tmp) / TOP)
        sys.path.insert(0, tmp)
        try:
            graph = grimp.build_graph(TOP, cache_dir=None, exclude_type_checking_imports=not type_checking)
        finally:
            sys.path.remove(tmp)
    nodes = set(graph.modules)
    return {m: sorted(graph.find_modules_directly_imported_by(m) & nodes) for m in sorted(nodes)}


def circles(root: Path) -> tuple[int, int, list[list[str]]]:
    """Import circles among the project's modules: (all imports, runtime only, the runtime circles)."""
    counts = []
    groups: list[list[str]] = []
    for type_checking in (True, False):
        edges = import_graph(root, type_checking=type_checking)
        groups = strongly_connected(sorted(edges), edges)
        counts.append(len(groups))
    return counts[0], counts[1], groups


def package_imports(root: Path) -> str:
    """One line per package: the other project packages its modules import at run time."""
    edges = import_graph(root, type_checking=False)
    packages_ = {m for m in edges
                 if (root.joinpath(*m.split(".")[1:]) / "__init__.py").is_file()}

    def pkg(m: str) -> str:
        return m if m in packages_ else m.rsplit(".", 1)[0]

    out: dict[str, set[str]] = {}
    for m, targets in edges.items():
        for t in targets:
            if pkg(m) != pkg(t):
                out.setdefault(pkg(m), set()).add(pkg(t))
    short = lambda m: m.removeprefix(TOP + ".") if m != TOP else "(top level)"  # noqa: E731
    return "\n".join(f"- `{short(a)}` -> {', '.join(short(b) for b in sorted(out[a]))}" for a in sorted(out))


def strongly_connected(nodes: list[str], edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; returns the components that are circles (more than one module, or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            recurse = False
            for j in range(i, len(edges[node])):
                nxt = edges[node][j]
                if nxt not in index:
                    work.append((node, j + 1))
                    work.append((nxt, 0))
                    recurse = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if recurse:
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1 or node in edges[node]:
                    result.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return result


def contracts(root: Path) -> int:
    with open(root / "pyproject.toml", "rb") as fh:
        data = tomllib.load(fh)
    return len(data.get("tool", {}).get("importlinter", {}).get("contracts", []))


def table(root: Path) -> str:
    files = tracked(root)
    pkgs = packages(files)
    rows = ["| package | modules | lines | largest module (lines) |", "| --- | ---: | ---: | --- |"]
    total_m = total_l = 0
    over: list[str] = []
    for folder in sorted(pkgs):
        sizes = {f: lines_of(root / f) for f in pkgs[folder]}
        big = max(sizes, key=lambda f: sizes[f])
        total_m += len(sizes)
        total_l += sum(sizes.values())
        over += [f"{f} ({n})" for f, n in sizes.items() if n > LIMIT]
        name = "top level" if folder == "." else f"`{folder}/`"
        rows.append(f"| {name} | {len(sizes)} | {sum(sizes.values()):,} | `{os.path.basename(big)}` ({sizes[big]}) |")
    rows.append(f"| **all packages** | **{total_m}** | **{total_l:,}** | |")
    tests = [f for f in files if f.startswith("tests/") and f.endswith(".py")]
    test_lines = sum(lines_of(root / f) for f in tests)
    all_tc, runtime, groups = circles(root)
    out = ["\n".join(rows), ""]
    out.append(f"- tests: {len(tests)} `*.py` files, {test_lines:,} lines")
    out.append(f"- modules over {LIMIT} lines: {len(over)}" + (f" ({', '.join(over)})" if over else ""))
    out.append(f"- import circles (grimp, strongly connected groups of modules): {all_tc} counting imports under "
               f"`if TYPE_CHECKING`, {runtime} without them")
    for g in groups:
        out.append(f"  - {' <-> '.join(m.removeprefix(TOP + '.') for m in g)}")
    out.append(f"- import contracts in pyproject.toml: {contracts(root)} (kept by `lint-imports`)")
    return "\n".join(out)


#: what the top level holds besides the packages (whose lines are their docstrings' first sentences)
TOP_LEVEL = {
    ".ci/": "The CI entry point: `make test` on a clean clone.",
    "Makefile": "`make setup`, `make lint` (ruff, import contracts, mypy --strict), `make test` (lint, the tests, "
                "then the slow set), `test-fast`, `test-slow`, `demo`.",
    "README.md": "What the product does, its commands, exit codes and measurements.",
    "__init__.py": "The `gputravel` namespace: every folder below maps onto `gputravel.<folder>`.",
    "docs/": "Design notes and studies (architecture, provisioning, checkpoints, collectives, fleet, GPU cipher, "
             "robustness, console, testing) with screenshots.",
    "pyproject.toml": "The one distribution, its dependencies, ruff, mypy, pytest markers and the import contracts.",
    "scripts/": "Developer tools: this measurement (`arch_table.py`), the largest units, the console smoke test, "
                "GPU checks.",
    "tests/": "Tests in folders mirroring the packages, plus `tests/security/`; shared fixtures in "
              "`tests/conftest.py` and `tests/helpers.py`; the `process` marker and the tiers: `docs/testing.md`.",
}


def first_sentence(path: Path) -> str:
    doc = " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split())
    end = doc.find(". ")
    return (doc if end < 0 else doc[: end + 1]).replace("``", "`")


def layout_rows(root: Path) -> list[tuple[str, str]]:
    files = tracked(root)
    pkgs = {f"{folder}/" for folder in packages(files) if folder != "."}
    tops = sorted({f.split("/")[0] + ("/" if "/" in f else "") for f in files} - {".gitignore", "py.typed"})
    rows = []
    for top in tops:
        if top in pkgs:
            rows += [(p, first_sentence(root / p / "__init__.py")) for p in sorted(pkgs) if p.startswith(top)]
        else:
            rows.append((top, TOP_LEVEL.get(top, "(undescribed: add it to TOP_LEVEL in scripts/arch_table.py)")))
    return rows


def layout(root: Path) -> str:
    rows = ["| path | what it holds |", "| --- | --- |"]
    rows += [f"| `{path}` | {text} |" for path, text in layout_rows(root)]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--layout", action="store_true", help="print README's layout rows instead")
    parser.add_argument("--imports", action="store_true", help="print which packages each package imports")
    args = parser.parse_args()
    if args.layout:
        print(layout(args.root))
    elif args.imports:
        print(package_imports(args.root))
    else:
        print(table(args.root))


if __name__ == "__main__":
    main()
