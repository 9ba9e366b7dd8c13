"""The architecture's numbers as JSON, for docs/architecture.md and issue 33's targets: modules over 400 and over
600 lines, the ``type: ignore`` / ``noqa`` / ``getattr(`` counts, and the classes longest once their bases from
the project are counted in.

    python scripts/arch_numbers.py          # JSON on stdout

Counts git-tracked ``*.py`` files outside ``tests/`` and ``scripts/`` (the figures docs/architecture.md quotes;
a clean clone gives the same). Lines are physical lines. A marker is counted once per occurrence, as
``grep -o`` counts it. A class's length is its own lines plus those of every base class defined in the project
(followed by name, recursively; a base from outside the project, torch's or the stdlib's, counts nothing).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKERS = {"type_ignore": "type: ignore", "noqa": "noqa", "getattr": "getattr("}


def sources(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=root, check=True, capture_output=True, text=True).stdout
    return sorted(p for p in out.splitlines()
                  if not p.startswith(("tests/", "scripts/")) and (root / p).is_file())


def class_lengths(root: Path, files: list[str]) -> dict[str, int]:
    """``path:Class`` -> its lines counting its project bases (a base is found by its name, first definition)."""
    own: dict[str, tuple[str, int, list[str]]] = {}  # class name -> (where, own lines, base names)
    for f in files:
        tree = ast.parse((root / f).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases]
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                own.setdefault(node.name, (f"{f}:{node.name}", n, bases))

    def total(name: str, seen: frozenset[str]) -> int:
        if name not in own or name in seen:
            return 0
        _, n, bases = own[name]
        return n + sum(total(b, seen | {name}) for b in bases)

    return {where: total(name, frozenset()) for name, (where, _, _) in own.items()}


def numbers(root: Path, *, over: int = 400, limit: int = 600) -> dict[str, object]:
    files = sources(root)
    texts = {f: (root / f).read_text(encoding="utf-8") for f in files}
    lengths = {f: len(t.splitlines()) for f, t in texts.items()}
    big = sorted((f for f, n in lengths.items() if n > over), key=lambda f: -lengths[f])
    classes = class_lengths(root, files)
    longest = sorted(classes.items(), key=lambda kv: -kv[1])[:5]
    return {
        "modules": len(files),
        f"modules_over_{over}": len(big),
        f"modules_over_{limit}": sum(1 for n in lengths.values() if n > limit),
        f"over_{over}": {f: lengths[f] for f in big},
        **{key: sum(t.count(marker) for t in texts.values()) for key, marker in MARKERS.items()},
        f"classes_over_{over}_with_bases": sum(1 for n in classes.values() if n > over),
        "longest_classes_with_bases": dict(longest),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT)
    ns = parser.parse_args()
    print(json.dumps(numbers(ns.root), indent=2))


if __name__ == "__main__":
    main()
