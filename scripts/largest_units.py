#!/usr/bin/env python3
"""Print the N largest units (classes and functions, nested ones included) of a tree's Python files.

A unit's size is its line span, decorators included (``end_lineno - first line + 1``). Only the files git
tracks are read when the folder is a git checkout (the tests, a virtual environment and build output are
left out unless asked for), so the figure is the same on any clone of a commit.

    python scripts/largest_units.py [--root DIR] [-n 5] [--kind class|function|all] [--with-tests]
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from collections.abc import Iterator
from pathlib import Path

Unit = tuple[int, str, str, str]  # (lines, kind, qualified name, path:first line)


def python_files(root: Path, *, with_tests: bool) -> list[Path]:
    """The Python files under ``root``: git's tracked ones in a checkout, else every ``*.py`` file."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "*.py"], capture_output=True, text=True,
                             check=True).stdout
        files = [root / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):
        files = sorted(root.rglob("*.py"))
    return [f for f in files if with_tests or "tests" not in f.relative_to(root).parts]


def units(tree: ast.AST, rel: str, prefix: str = "") -> Iterator[Unit]:
    """Every class and function below ``tree``, with its qualified name and line span."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            name = f"{prefix}{node.name}"
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            yield (node.end_lineno or node.lineno) - first + 1, kind, name, f"{rel}:{first}"
            yield from units(node, rel, f"{name}.")
        else:
            yield from units(node, rel, prefix)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("."))
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--kind", choices=("class", "function", "all"), default="all")
    ap.add_argument("--with-tests", action="store_true", help="count tests/ too")
    args = ap.parse_args()
    root = args.root.resolve()
    found: list[Unit] = []
    for path in python_files(root, with_tests=args.with_tests):
        rel = str(path.relative_to(root))
        found.extend(u for u in units(ast.parse(path.read_text(), rel), rel) if args.kind in ("all", u[1]))
    found.sort(key=lambda u: (-u[0], u[3]))
    for lines, kind, name, where in found[: args.n]:
        print(f"{lines:5d}  {kind:8s}  {name:40s}  {where}")


if __name__ == "__main__":
    main()
