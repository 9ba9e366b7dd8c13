"""The Training screen: loss and validation loss over steps, tokens per second."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from textual.widget import Widget
from textual.widgets import Static

from gputravel.console.tui.screens.base import ConsoleScreen
from gputravel.console.tui.widgets.plot import BraillePlot, PlotSeries
from gputravel.console.tui.widgets.text import esc, spark
from gputravel.console.view.model import RunState
from gputravel.console.view.training import pending_label


class TrainingScreen(ConsoleScreen):
    """Training progress on the travelling GPU."""

    SCREEN_NAME = "training"
    HELP = ("Training loss of every step (each visit trains k steps on one holder's buffer) and the validation "
            "loss on the held-out slice of each visit, plotted over the global step. Steps arrive while TRAIN "
            "runs (step k/K); a loss above 1.75x its running mean is flagged as a spike.")

    def compose_body(self) -> Iterable[Widget]:
        yield Static(id="training-summary")
        yield BraillePlot(id="loss-plot")
        yield Static(id="val-by-holder")

    def show_state(self, state: RunState, context: dict[str, Any]) -> None:
        plot = self.query_one(BraillePlot)
        plot.series = (
            PlotSeries("loss", tuple((float(s), v) for s, v in state.loss), "$primary"),
            PlotSeries("val loss", tuple((float(s), v) for s, _, v in state.val), "$accent"),
        )
        if state.loss:
            first, last = state.loss[0][1], state.loss[-1][1]
            val = f"{state.val[-1][2]:.3f}" if state.val else "-"
            tps = f"{state.tokens_per_s:,.0f}" if state.tokens_per_s else "-"
            summary = (f"[b]steps[/b] {state.loss[-1][0]}   [b]loss[/b] {first:.3f} → {last:.3f}   "
                       f"[b]val[/b] {val}   [b]tokens/s[/b] {tps}")
        elif state.current_phase == "TRAIN":
            summary = "[$text-muted]training: the first steps are on their way[/]"
        else:
            summary = "[$text-muted]no training steps yet[/]"
        if state.train_progress is not None:  # a TRAIN is running: this visit's step k of K
            k, n = state.train_progress
            summary += f"\n[b]TRAIN[/b] visit {(state.current_visit or 0) + 1}: step {k}/{n}"
        if state.pending:
            summary += f"   [b $warning]{esc(pending_label(state.pending) or '').upper()}[/]"
        if state.spikes:
            step, loss, mean = state.spikes[-1]
            summary += (f"\n[$warning]loss spikes: {len(state.spikes)}[/] (last at step {step}: {loss:.3f}, "
                        f"running mean {mean:.3f})")
        self.query_one("#training-summary", Static).update(summary)
        by_holder: dict[str, list[float]] = {}
        for _, holder, v in state.val:
            by_holder.setdefault(holder, []).append(v)
        rows = [f"{esc(h):<14} [$accent]{spark(vs, 30)}[/] {vs[-1]:.3f}" for h, vs in by_holder.items()]
        self.query_one("#val-by-holder", Static).update("[b]val loss by holder[/b]\n" + "\n".join(rows) if rows else "")
