"""``gputravel run``'s bars at the terminal's width (operator walk, session 15: at 80 columns rich cut the counts
and times to ``76…`` and ``0:0…``): the count, the rate and the time are whole at every width an operator has;
what does not fit goes first (the bar's length, the holder's name, the bar, the info)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import wait_for
from rich.console import Console

from gputravel.console.cli.run_bars import BAR_MIN, Label, fit
from gputravel.console.cli.run_view import RunView
from gputravel.core import events as ev

HOLDER = "holder-0-comedies"


def _bars_at(width: int, *, provisioning: bool = False) -> list[str]:
    """The bars a RunView draws in ``width`` columns, mid-TRAIN of visit 1 (or mid-PROVISION), as lines."""
    screen = io.StringIO()
    console = Console(file=screen, width=width, force_terminal=True, color_system=None)
    view = RunView(console, run_name="r")
    t = time.time()
    view(ev.RunStarted(t, "1f2183f9d3b0", {}, ("a", "b", "c"), 3))
    view(ev.PhaseStarted(t, 0, HOLDER, "ATTEST", 1))
    view(ev.PhaseStarted(t + 1, 0, HOLDER, "PROVISION", 1))
    view(ev.ProvisionProgressed(t + 3, 0, HOLDER, 1, 3 * 2**20, 7 * 2**20))
    if not provisioning:
        view(ev.PhaseStarted(t + 4, 0, HOLDER, "TRAIN", 1))
        view(ev.TrainingProgressed(t + 5, 0, HOLDER, 76, 200, 2.618, 1348.0))
    view.progress.console.print(view.progress.make_tasks_table(view.progress.tasks))
    return [line.rstrip() for line in screen.getvalue().splitlines()]


def test_at_80_columns_every_count_rate_and_time_is_whole() -> None:
    lines = _bars_at(80)
    assert len(lines) == 3 and all(len(line) <= 80 for line in lines), lines
    visits, phase, steps = lines
    assert visits.startswith("visits") and " 0/3 " in visits and "run 1f2183f9d3b0" in visits
    assert "visit 1 holder-0-c… · TRAIN" in phase and " 0/8 " in phase and "epoch 1" in phase
    assert " 76/200 " in steps and "loss 2.618 · 1,348 tok/s" in steps
    assert all(re.search(r" \d:\d\d:\d\d$", line) for line in lines), lines  # the time, uncut, last
    assert "…" not in visits + steps  # only the holder's name may be cut
    assert "━" * 3 in steps  # and the bars are still there (76/200 of 10 columns)


def test_provisioning_shows_its_mib_and_its_rate() -> None:
    _, _, provisioning = _bars_at(80, provisioning=True)
    # 3 MiB in the 2 s since PROVISION began
    assert " 3.0/7.0 MiB " in provisioning and f"{3 * 2**20 / 2 / 1e6:,.1f} MB/s" in provisioning


def test_at_160_columns_nothing_is_cut() -> None:
    lines = _bars_at(160)
    assert "visit 1 holder-0-comedies · TRAIN" in lines[1] and "…" not in "".join(lines)
    assert "━" * 15 in lines[2]  # 76/200 of a 40-column bar (the part still to do is blank without colour)


@pytest.mark.parametrize("width", [60, 50, 40, 32])
def test_narrower_the_bar_then_the_info_go_never_the_numbers(width: int) -> None:
    lines = _bars_at(width)
    assert all(len(line) <= width for line in lines), lines
    assert " 76/200 " in lines[2] and " 0/3 " in lines[0] and " 0/8 " in lines[1]
    assert all(re.search(r" \d:\d\d:\d\d$", line) for line in lines), lines
    assert "TRAIN" in lines[1] or width < 40


def test_fit_drops_in_order_bar_length_name_bar_info() -> None:
    labels = [Label("visits"), Label("visit 1", HOLDER, "· TRAIN"), Label("training steps")]
    wide = fit(160, labels, count=7, info=24, time=7)
    assert wide.bar == 40 and wide.info and wide.name_max is None
    at_80 = fit(80, labels, count=7, info=24, time=7)
    assert at_80.bar == BAR_MIN and at_80.info and at_80.label < labels[1].width(10**6)
    no_bar = fit(60, labels, count=7, info=24, time=7)
    assert no_bar.bar is None and no_bar.info
    no_info = fit(40, labels, count=7, info=24, time=7)
    assert no_info.bar is None and not no_info.info
    for layout, width in ((at_80, 80), (no_bar, 60), (no_info, 40)):
        used = layout.label + (layout.bar + 1 if layout.bar else 0) + 7 + (25 if layout.info else 0) + 7 + 2
        assert used <= width, (layout, width)


def test_a_label_cuts_the_name_first_and_keeps_the_phase() -> None:
    label = Label("visit 1", HOLDER, "· PROVISION")
    assert label.text(80) == "visit 1 holder-0-comedies · PROVISION"
    assert label.text(28) == "visit 1 holder-… · PROVISION"
    assert label.text(10) == "visit 1 h…"


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("columns", [80, 160])
def test_a_run_in_tmux_shows_whole_counts_and_times(columns: int, tmp_path: Path) -> None:
    """As an operator sees it: ``gputravel run`` in a tmux window of 80 (and 160) columns, its screen read with
    ``capture-pane`` while TRAIN runs."""
    tmux = "/usr/bin/tmux"
    if not os.path.exists(tmux):
        pytest.skip("tmux is not installed")
    sock, gputravel = str(tmp_path / "tmux.sock"), str(Path(sys.executable).with_name("gputravel"))
    command = (f"OMP_NUM_THREADS=1 {gputravel} run --rounds 1 --holders 1 --steps-per-visit 400 "
               f"--transport local --out {tmp_path / 'run'}; sleep 60")
    subprocess.run([tmux, "-S", sock, "new-session", "-d", "-x", str(columns), "-y", "24", command], check=True,
                   env={**os.environ, "TERM": "xterm-256color"})
    screen = ""

    def training_shown() -> bool:
        nonlocal screen
        screen = subprocess.run([tmux, "-S", sock, "capture-pane", "-p"], capture_output=True, text=True).stdout
        return re.search(r"training steps .* \d+/400 ", screen) is not None and "tok/s" in screen

    try:
        wait_for(training_shown, timeout=240)
        bars = [line.rstrip() for line in screen.splitlines()
                if line.startswith(("visits", "visit 1", "training steps"))]
        assert len(bars) == 3, screen
        assert all(len(line) <= columns for line in bars), screen
        assert all(re.search(r" \d+/\d+ .* \d:\d\d:\d\d$", line) for line in bars), screen
        assert re.search(r"loss \d+\.\d{3} · [\d,]+ tok/s", bars[2]), screen
        assert "visit 1 holder-0-" in bars[1] and "· TRAIN" in bars[1], screen  # the name cut, if at all, not the phase
        assert columns < 120 or "visit 1 holder-0-mixed · TRAIN" in bars[1], screen
    finally:
        subprocess.run([tmux, "-S", sock, "kill-server"], check=False)
