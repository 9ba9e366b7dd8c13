"""``gputravel run``'s bars laid out for the terminal's width: :class:`RunBars`, a rich ``Progress`` whose
columns are the label, the bar, the count (``76/200``, ``1.2/1.7 MiB``), the info (the rate: ``loss 2.618 ·
1,348 tok/s``, ``35 MB/s``) and the elapsed time.

rich lays a progress table out by shrinking every column alike, so at 80 columns the counts and times were cut
(``76…``, ``0:0…``; operator walk, session 15). Here the count and the time are never cut; what does not fit goes
first, in this order (:func:`fit`): the bar shrinks to :data:`BAR_MIN`, the holder's name in a label is cut with
``…`` down to :data:`NAME_MIN`, the bar goes, the name is cut further, the info goes, and last the label is cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from rich.console import Console, RenderableType
from rich.progress import BarColumn, Progress, Task
from rich.table import Column, Table
from rich.text import Text

__all__ = ["BAR_MAX", "BAR_MIN", "NAME_MIN", "Label", "Layout", "RunBars", "count_text", "fit", "time_text"]

BAR_MAX = 40
BAR_MIN = 10
NAME_MIN = 8


@dataclass(frozen=True, slots=True)
class Label:
    """A bar's label in three parts, joined by spaces: ``head`` and ``tail`` are kept whole as long as they fit,
    ``name`` (a holder's, the longest and least needed part) is cut with ``…`` first."""

    head: str
    name: str = ""
    tail: str = ""

    @property
    def full(self) -> str:
        return " ".join(part for part in (self.head, self.name, self.tail) if part)

    def width(self, name_max: int) -> int:
        return len(self.text(len(self.full), name_max=name_max))

    def text(self, width: int, *, name_max: int | None = None) -> str:
        """The label in at most ``width`` characters, its name cut to ``name_max`` (and further if it must)."""
        name = self.name
        if name_max is not None and len(name) > name_max:
            name = name[:max(1, name_max - 1)] + "…"
        shown = Label(self.head, name, self.tail).full
        if len(shown) > width and name:
            room = width - (len(shown) - len(name))  # what the name may take, the rest whole
            if room >= 2:
                shown = Label(self.head, name[:room - 1] + "…", self.tail).full
        if len(shown) > width:
            shown = shown[:max(0, width - 1)] + "…" if width > 0 else ""
        return shown


@dataclass(frozen=True, slots=True)
class Layout:
    """How the bars fit a width: the label's width, the bar's (None: no bar), whether the info column shows, and
    how far holder names are cut (None: whole)."""

    label: int
    bar: int | None
    info: bool
    name_max: int | None


def fit(width: int, labels: Sequence[Label], *, count: int, info: int, time: int) -> Layout:
    """The layout of the bars in ``width`` columns (one space between columns) when the widest count, info and
    time are ``count``, ``info`` and ``time`` characters: count and time are never cut."""
    full = max((label.width(10**6) for label in labels), default=0)
    cut = max((label.width(NAME_MIN) for label in labels), default=0)
    shortest = max((label.width(1) for label in labels), default=0)
    room = width - count - time - info - 4  # label and bar, with four gaps between the five columns
    if room - 1 - full >= BAR_MIN:
        return Layout(full, min(BAR_MAX, room - 1 - full), True, None)
    if room - 1 - BAR_MIN >= cut:
        return Layout(room - 1 - BAR_MIN, BAR_MIN, True, None)  # each name cut only as far as its label must
    room += 1  # no bar: one gap fewer, the label takes the bar's room
    if room >= shortest:
        return Layout(min(room, full), None, True, None)
    room = width - count - time - 2  # label, count and time
    return Layout(max(1, min(room, full)), None, False, 1)


def count_text(task: Task) -> tuple[str, int]:
    """The task's count (its ``count`` field where it has one, else done/total) and the width it will need
    at its end, so the bars do not move as the count grows."""
    own = task.fields.get("count")
    if isinstance(own, tuple):
        return str(own[0]), len(str(own[1]))
    total = "?" if task.total is None else f"{int(task.total)}"
    return f"{int(task.completed)}/{total}", len(f"{total}/{total}")


def time_text(task: Task) -> str:
    """As rich's ``TimeElapsedColumn`` writes it: ``0:01:05``, ``-:--:--`` before the task started."""
    elapsed = task.finished_time if task.finished else task.elapsed
    return "-:--:--" if elapsed is None else str(timedelta(seconds=max(0, int(elapsed))))


class RunBars(Progress):
    """The run's bars, laid out anew for the console's width at each refresh (a resized terminal too). Each task
    carries a ``label`` (:class:`Label`), an ``info`` (str) and may carry a ``count`` (shown, at its widest)."""

    def __init__(self, console: Console) -> None:
        self._bar = BarColumn(bar_width=BAR_MAX)
        self._screen = console  # rich's Live draws a first frame inside Progress.__init__, before self.console
        super().__init__(self._bar, console=console, transient=False)

    def make_tasks_table(self, tasks: Iterable[Task]) -> Table:
        shown = [task for task in tasks if task.visible]
        counts = [count_text(task) for task in shown]
        times = [time_text(task) for task in shown]
        infos = [str(task.fields.get("info", "")) for task in shown]
        labels = [label if isinstance(label := task.fields.get("label"), Label) else Label(task.description)
                  for task in shown]
        count_w = max((max(len(text), end) for text, end in counts), default=0)
        layout = fit(self._screen.width, labels, count=count_w, info=max(map(len, infos), default=0),
                     time=max(map(len, times), default=0))
        columns = [Column(width=layout.label, no_wrap=True)]
        if layout.bar is not None:
            columns.append(Column(width=layout.bar, no_wrap=True))
            self._bar.bar_width = layout.bar
        columns.append(Column(width=count_w, no_wrap=True, justify="right"))
        if layout.info:
            columns.append(Column(no_wrap=True, overflow="ellipsis"))
        columns.append(Column(no_wrap=True))
        table = Table.grid(*columns, padding=(0, 1))
        for task, label, (count, _), info, elapsed in zip(shown, labels, counts, infos, times, strict=True):
            row: list[RenderableType] = [Text(label.text(layout.label, name_max=layout.name_max))]
            if layout.bar is not None:
                row.append(self._bar.render(task))
            row.append(Text(count, style="progress.download"))
            if layout.info:
                row.append(Text(info))
            row.append(Text(elapsed, style="progress.elapsed"))
            table.add_row(*row)
        return table
