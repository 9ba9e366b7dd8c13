"""A fleet's chain of processes ends with its launcher however the launcher ends (core/fleet/lifeline.py).

Real processes, small stand-ins for the two programs that take seconds to start: ``LAUNCHER`` runs the launcher's
own ``run_teed`` over ``TORCHRUN``, a stand-in for torchrun that starts its worker as torch's elastic agent does
(``start_new_session=True``, so no group kill reaches it), and the worker runs ``end_with_launcher`` as
``fleet_rank`` does first. The whole chain with torchrun itself is tested in test_fleet_run.py (slow)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import descendants, still_alive, wait_for

from gputravel.core import procs
from gputravel.core.fleet.lifeline import LAUNCHER_PID_ENV, end_with_launcher

pytestmark = [pytest.mark.process,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")]

#: the launcher: its pid in the environment, as launch_fleet puts it, then run_teed over the torchrun stand-in
LAUNCHER = """
import os, sys
from gputravel.core.fleet.lifeline import LAUNCHER_PID_ENV, end_with_launcher
from gputravel.core.fleet.tee import run_teed
env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid())}
run_teed([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], env=env, show=None)
"""

#: a stand-in for torchrun: the worker in a session of its own (torch's SubprocessHandler), then it waits
TORCHRUN = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], start_new_session=True)
time.sleep(600)
"""

#: the worker: waits for ``go`` (to open the race on purpose), arms as fleet_rank does, then says so and waits
WORKER = """
import pathlib, sys, time
folder = pathlib.Path(sys.argv[1])
while not (folder / "go").exists():
    time.sleep(0.02)
from gputravel.core.fleet.lifeline import end_with_launcher
untied = end_with_launcher()
(folder / "armed.tmp").write_text(repr(untied))
(folder / "armed.tmp").rename(folder / "armed")
time.sleep(600)
"""


@contextlib.contextmanager
def _chain(folder: Path) -> Iterator[tuple[subprocess.Popen[bytes], dict[int, str]]]:
    """The launcher, its torchrun stand-in and worker started, and the pids the test saw of them (pid -> command
    line; filled by ``_torchrun_and_worker``); whatever of them is left is killed at the end, by pid."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, TORCHRUN, WORKER, str(folder)],
                                stdin=subprocess.DEVNULL, start_new_session=True)
    seen: dict[int, str] = {}
    try:
        yield launcher, seen
    finally:
        seen.update(descendants(launcher.pid))
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
        for pid in still_alive(seen):  # only what this test started
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _torchrun_and_worker(launcher: int, seen: dict[int, str]) -> tuple[int, int]:
    """The pids of the torchrun stand-in (its command line holds TORCHRUN's text) and of its worker."""
    tree: dict[int, str] = {}

    def up() -> bool:
        tree.clear()
        tree.update(descendants(launcher))
        return len(tree) >= 2

    assert wait_for(up, timeout=60, interval=0.2), f"the chain never started: {tree}"
    seen.update(tree)
    torchrun = next(pid for pid, cmd in tree.items() if "start_new_session" in cmd)
    worker = next(pid for pid, cmd in tree.items() if "start_new_session" not in cmd)
    return torchrun, worker


def test_a_launcher_killed_outright_takes_torchrun_and_its_worker_with_it(tmp_path: Path) -> None:
    (tmp_path / "go").touch()
    with _chain(tmp_path) as (launcher, seen):
        torchrun, worker = _torchrun_and_worker(launcher.pid, seen)
        assert wait_for(lambda: (tmp_path / "armed").exists(), timeout=60)
        assert (tmp_path / "armed").read_text() == "None"  # armed: no reason why not
        assert os.getsid(worker) == worker != os.getsid(torchrun)  # a session of its own: no group kill reaches it
        tree = dict(seen)
        os.kill(launcher.pid, signal.SIGKILL)
        assert launcher.wait(timeout=10) == -signal.SIGKILL
        assert wait_for(lambda: not still_alive(tree), timeout=10), f"outlived the launcher: {still_alive(tree)}"


def test_a_worker_whose_torchrun_is_killed_ends_with_it(tmp_path: Path) -> None:
    """torchrun itself killed (the OOM killer's pick): its worker dies too, though torchrun stopped nothing."""
    (tmp_path / "go").touch()
    with _chain(tmp_path) as (launcher, seen):
        torchrun, worker = _torchrun_and_worker(launcher.pid, seen)
        assert wait_for(lambda: (tmp_path / "armed").exists(), timeout=60)
        tree = {worker: seen[worker]}
        os.kill(torchrun, signal.SIGKILL)
        assert wait_for(lambda: not still_alive(tree), timeout=10), "the worker outlived its torchrun"


def test_a_worker_whose_torchrun_died_before_it_armed_ends_itself(tmp_path: Path) -> None:
    """The race: torchrun dies while its worker is still importing (no parent-death signal armed yet), so the
    worker now belongs to init or a subreaper; once it arms, its parent is not the launcher's child: it ends
    itself rather than train alone."""
    with _chain(tmp_path) as (launcher, seen):
        torchrun, worker = _torchrun_and_worker(launcher.pid, seen)
        tree = {worker: seen[worker]}
        os.kill(torchrun, signal.SIGKILL)
        assert wait_for(lambda: procs.parent_pid(worker) not in (None, torchrun), timeout=10)
        assert still_alive(tree), "the worker died before it armed: the race was not opened"
        (tmp_path / "go").touch()
        assert wait_for(lambda: not still_alive(tree), timeout=30), "an orphaned worker armed and ran on"
        assert not (tmp_path / "armed").exists()


def test_without_prctl_arming_is_a_no_op_that_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "_prctl", None)  # a platform without prctl (not Linux)
    monkeypatch.setenv(LAUNCHER_PID_ENV, "1")  # a launcher this process is not under: would end it, were it armed
    assert end_with_launcher() == procs.NO_PARENT_DEATH_SIGNAL
    assert "PR_SET_PDEATHSIG" in procs.NO_PARENT_DEATH_SIGNAL and "Linux only" in procs.NO_PARENT_DEATH_SIGNAL
