"""scripts/arch_numbers.py (issue 33 item 3): the figures docs/architecture.md quotes, counted on a small tracked
tree whose answers are known by construction."""

from __future__ import annotations

import subprocess
from pathlib import Path

from helpers import load_script


def test_counts_modules_markers_and_classes_with_their_project_bases(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    base = "class Base:\n" + "    x = 1\n" * 299  # 300 lines
    (pkg / "base.py").write_text(base)
    child = "from pkg.base import Base\n\n\nclass Child(Base, dict):\n" + "    y = 2\n" * 149  # 150 own lines
    (pkg / "child.py").write_text(child + "z = getattr(object, 'a')  # type: ignore[misc]  # noqa: B009\n")
    (pkg / "big.py").write_text("a = 1\n" * 700)
    (pkg / "untracked.py").write_text("b = 1\n" * 900)  # not in git: not counted
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("c = getattr(1, 'real')\n" * 500)  # tests are not counted
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "pkg/__init__.py", "pkg/base.py", "pkg/child.py", "pkg/big.py", "tests"],
                   cwd=tmp_path, check=True)
    got = load_script("arch_numbers").numbers(tmp_path)
    assert got["modules"] == 4
    assert got["modules_over_400"] == 1 and got["modules_over_600"] == 1
    assert got["over_400"] == {"pkg/big.py": 700}
    assert (got["type_ignore"], got["noqa"], got["getattr"]) == (1, 1, 1)
    assert got["longest_classes_with_bases"] == {"pkg/child.py:Child": 450, "pkg/base.py:Base": 300}
    assert got["classes_over_400_with_bases"] == 1
