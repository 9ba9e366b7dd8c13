"""docs/architecture.md names the code a newcomer follows (a provisioning key, a data chunk): every path and
name it cites must exist, so a rename that leaves the document behind fails here (issue 26 item 6)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT

pytestmark = pytest.mark.process  # the checker runs as the script it is (it asks git for the tracked files)


def test_every_name_and_path_docs_architecture_cites_exists() -> None:
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "check_doc_names.py"),
                           str(REPO_ROOT / "docs" / "architecture.md")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 name(s) not found" in proc.stdout + proc.stderr


def test_the_checker_names_a_path_and_a_method_that_do_not_exist(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("See `core/device/no_such_module.py` and `DeviceService.op_no_such_op`.\n")
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "check_doc_names.py"), str(doc)],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode != 0
    assert "no_such_module" in proc.stdout + proc.stderr and "op_no_such_op" in proc.stdout + proc.stderr
