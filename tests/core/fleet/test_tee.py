"""torchrun's output teed (``core/fleet/tee.py``), with real child processes: shown live, its tail bounded, a
terminal kept a terminal, and an interrupt that SIGTERMs the child first."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import user_terminal, wait_for

from gputravel.core.fleet.tee import Teed, run_teed

pytestmark = pytest.mark.process


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_output_is_shown_while_the_child_runs_and_only_the_last_part_is_kept(tmp_path: Path) -> None:
    """The child says "started", then waits for the test to have seen it on the shown file (it could not, were the
    output passed on only at the end), then writes 300 KiB, far past a pipe's 64 KiB, over stdout and stderr."""
    shown_path, go = tmp_path / "shown.txt", tmp_path / "go"
    child = _python(f"""
import os, sys, time
print("started", file=sys.stderr, flush=True)
deadline = time.monotonic() + 60  # the test fails by then; the child ends anyway
while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
    time.sleep(0.01)
for i in range(3000):
    print(f"line {{i:05d}} " + "x" * 90, file=sys.stdout if i % 2 else sys.stderr, flush=True)
print("Root Cause: the end", file=sys.stderr)
sys.exit(3)
""")
    result: list[Teed] = []
    with shown_path.open("w") as shown:
        runner = threading.Thread(target=lambda: result.append(run_teed(child, env=dict(os.environ), show=shown,
                                                                        tail_bytes=4096)),
                                  daemon=True)
        runner.start()
        assert wait_for(lambda: "started" in shown_path.read_text(), timeout=60), "nothing was shown while it ran"
        go.touch()
        runner.join(120)
    assert not runner.is_alive()
    teed = result[0]
    assert teed.returncode == 3
    text = shown_path.read_text().splitlines()
    assert len(text) == 3002 and text[0] == "started" and text[-1] == "Root Cause: the end"
    assert text[1:3001] == [f"line {i:05d} " + "x" * 90 for i in range(3000)]  # all of it, in order
    assert len(teed.tail) == 4096 and teed.tail.endswith(b"line 02999 " + b"x" * 90 + b"\nRoot Cause: the end\n")


def test_a_quiet_run_shows_nothing_and_still_keeps_the_tail(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    teed = run_teed(_python("import sys\nsys.stdout.write('o' * 200_000)\nprint('the end', file=sys.stderr)"),
                    env=dict(os.environ), show=None)
    assert teed.returncode == 0 and teed.text.endswith("o" * 1000 + "the end\n") and len(teed.tail) == 64 * 1024
    out, err = capfd.readouterr()
    assert "the end" not in out + err


def test_a_captured_stream_without_a_descriptor_gets_the_text() -> None:
    stream = io.StringIO()  # a stream with no fileno, as pytest's capsys makes sys.stderr
    teed = run_teed(_python("print('grüße', flush=True)\nraise SystemExit(4)"), env=dict(os.environ), show=stream)
    assert teed.returncode == 4 and stream.getvalue() == "grüße\n" and teed.text == "grüße\n"


def test_where_the_user_has_a_terminal_the_child_has_one_too(tmp_path: Path) -> None:
    """Shown on a pseudo-terminal (the user's, here the test's): the child's stdout and stderr are terminals, of the
    same width, and its bytes reach the user unchanged; shown on a file, they are not terminals."""
    probe = _python("import os, sys\nprint(sys.stdout.isatty(), sys.stderr.isatty(), os.get_terminal_size(2).columns)")
    with user_terminal(columns=123) as (terminal, seen):
        teed = run_teed(probe, env=dict(os.environ), show=terminal)
    assert teed.returncode == 0 and teed.text == "True True 123\n"  # no "\r" added on the child's side
    assert b"True True 123" in seen
    with (tmp_path / "shown").open("w") as file:
        teed = run_teed(_python("import sys\nprint(sys.stdout.isatty(), sys.stderr.isatty())"),
                        env=dict(os.environ), show=file)
    assert teed.text == "False False\n" and (tmp_path / "shown").read_text() == "False False\n"


def _launcher(child: list[str], shown: Path, **kw: float) -> subprocess.Popen[bytes]:
    """A launcher process running ``run_teed(child)`` shown on its stderr (the file ``shown``), to be interrupted
    as Ctrl-C interrupts ``gputravel run``: SIGINT to the launcher (here to it alone, so what reaches the child is
    the launcher's doing)."""
    # Ctrl-C's default action restored: a shell that starts the tests in the background (CI, nohup ... &) leaves
    # SIGINT ignored in every process it starts, and Python then installs no handler of its own
    code = ("import os, signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from gputravel.core.fleet.tee import run_teed\n"
            f"run_teed({child!r}, env=dict(os.environ), show=sys.stderr, **{kw!r})")
    with shown.open("wb") as out:
        return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=out, stderr=out)


def test_an_interrupt_terminates_the_child_first_and_its_last_words_are_still_read(tmp_path: Path) -> None:
    """Ctrl-C in the launcher (a caller's timeout raised in its thread is the same): the child gets SIGTERM, not
    SIGKILL, its answer to it is still shown, and the interrupt goes on (KeyboardInterrupt)."""
    shown = tmp_path / "shown.txt"
    child = _python("""
import signal, sys, time
def stop(signum, frame):
    print(f"stopping on signal {signum}", file=sys.stderr, flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print("running", flush=True)
time.sleep(120)
""")
    launcher = _launcher(child, shown)
    try:
        assert wait_for(lambda: "running" in shown.read_text(), timeout=60), shown.read_text()
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(60) != 0
    finally:
        launcher.kill()
    lines = shown.read_text().splitlines()
    assert lines[:2] == ["running", "stopping on signal 15"] and lines[-1] == "KeyboardInterrupt", lines


def test_a_child_deaf_to_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    shown = tmp_path / "shown.txt"
    child = _python("import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                    "print('deaf', os.getpid(), flush=True)\ntime.sleep(120)")
    launcher = _launcher(child, shown, stop_grace_s=1.0)
    try:
        assert wait_for(lambda: "deaf" in shown.read_text(), timeout=60), shown.read_text()
        pid = int(shown.read_text().split()[1])
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(60) != 0
    finally:
        launcher.kill()
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped, not left running
    assert shown.read_text().splitlines()[-1] == "KeyboardInterrupt"
