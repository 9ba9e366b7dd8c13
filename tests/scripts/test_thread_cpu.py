"""scripts/thread_cpu.py: a command's CPU accounted by thread, each thread by the name it gave the kernel
(``core.procs.name_os_thread``), a pool's workers summed under their prefix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT

BUSY = """
import threading, time
from concurrent.futures import ThreadPoolExecutor
from gputravel.core.procs import name_os_thread

def spin(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    time.sleep(1.0)  # alive a while longer: the sampler's last look at a thread is what it counts
    return seconds

def named():
    name_os_thread()
    spin(0.4)

t = threading.Thread(target=named, name="checkpoint-seal")
t.start(); t.join()
with ThreadPoolExecutor(2, thread_name_prefix="ring-crypto", initializer=name_os_thread) as pool:
    list(pool.map(spin, [0.3, 0.3]))
time.sleep(0.3)
"""

GRANDPARENT = """
import subprocess, sys
subprocess.run([sys.executable, "-c", sys.argv[1]], check=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_each_thread_is_accounted_under_its_name_and_a_pool_under_its_prefix(tmp_path: Path) -> None:
    out = tmp_path / "threads.json"
    rc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "thread_cpu.py"), "--every", "0.05", "--out",
                         str(out), "--", sys.executable, "-c", BUSY], capture_output=True, timeout=120).returncode
    assert rc == 0
    result = json.loads(out.read_text())
    names = {r["name"] for r in result["threads"]}
    assert "checkpoint-seal" in names
    by_name = {r["name"]: r["cpu_s"] for r in result["by_name"]}
    # the seal thread spun 0.4 s of its own CPU, the pool's two workers 0.3 s each, summed under the prefix
    assert by_name["checkpoint-seal"] >= 0.3
    assert by_name["ring-crypto"] >= 0.45
    assert "ring-crypto_0" not in by_name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_grandchild_is_accounted_too(tmp_path: Path) -> None:
    """The holders' agents run under the SSH server the command starts: two levels below it."""
    out = tmp_path / "threads.json"
    rc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "thread_cpu.py"), "--every", "0.05", "--out",
                         str(out), "--", sys.executable, "-c", GRANDPARENT, BUSY], capture_output=True,
                        timeout=120).returncode
    assert rc == 0
    by_name = {r["name"]: r["cpu_s"] for r in json.loads(out.read_text())["by_name"]}
    assert by_name["checkpoint-seal"] >= 0.3 and by_name["ring-crypto"] >= 0.45

