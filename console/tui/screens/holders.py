"""The Holders screen: each holder's state, provisioning progress and throughput, rejected chunks, its log."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from textual import on
from textual.binding import Binding
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import DataTable, Static

from gputravel.console.tui.screens.base import ConsoleScreen
from gputravel.console.tui.widgets.ops_log import OpsLog
from gputravel.console.tui.widgets.route_map import STATE_TOKENS
from gputravel.console.tui.widgets.table_filter import TableFilter, row_matches
from gputravel.console.tui.widgets.text import bar, esc, fmt_bytes
from gputravel.console.view.model import HolderView, RunState

#: (label, width); the holder column is as wide as the longest name (up to 28), so no name is cut short.
COLUMNS = (("holder", 0), ("state", 14), ("agent sha256", 12), ("data", 10), ("provisioning", 26),
           ("MB/s", 5), ("rejected", 10), ("visits", 6))
#: Below 110 columns: no agent hash (the log names it), narrower columns.
NARROW = frozenset({"agent sha256"})
NARROW_WIDTHS = {"state": 12, "data": 9, "provisioning": 17, "rejected": 9}


def holder_cells(h: HolderView, *, narrow: bool = False) -> dict[str, Content]:
    token = STATE_TOKENS.get(h.state, "$foreground")
    frac = h.provisioned / h.total if h.total else None
    progress = (f"{bar(frac, 6 if narrow else 12, token='$primary')} {fmt_bytes(h.provisioned)}" if h.total
                else "[$text-disabled]–[/]")
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(h.rejected.items())) or "0"
    visits = f"{h.visits_done}" + (f" [$error]{h.visits_failed}✗[/]" if h.visits_failed else "")
    mb_s = (f"{h.mb_s:.1f}" if h.mb_s < 10 else f"{h.mb_s:.0f}") if h.mb_s else "-"
    cells = {"holder": f"[b]{esc(h.name)}[/b]", "state": f"[{token}]{esc(h.state_label)}[/]",
             "agent sha256": esc((h.agent_sha256 or "-")[:12]),
             "data": esc(fmt_bytes(h.data_bytes) if h.data_bytes else "-"), "provisioning": progress,
             "MB/s": mb_s, "rejected": f"[$warning]{esc(rejected)}[/]" if h.rejected else "0", "visits": visits}
    return {k: Content.from_markup(v) for k, v in cells.items()}


class HoldersScreen(ConsoleScreen):
    """Holders and their agents. ``/`` filters the table and the log, ``f`` follows the log (or freezes it)."""

    SCREEN_NAME = "holders"
    AUTO_FOCUS = "#holders-table"
    HELP = ("One row per data holder: connecting → deploying → verified(hash) → ready → provisioning → returned, "
            "or failed / offline. The log below shows the selected holder's operations.")
    BINDINGS = [
        Binding("slash", "filter", "Filter"),
        Binding("f", "toggle_follow", "Follow"),
    ]

    follow: reactive[bool] = reactive(True)

    def compose_body(self) -> Iterable[Widget]:
        yield TableFilter(placeholder="filter holders and their log (enter keeps, escape clears)",
                          id="holders-filter")
        table: DataTable[Content] = DataTable(id="holders-table", cursor_type="row", zebra_stripes=True)
        yield table
        yield Static(id="holder-log-title")
        yield OpsLog(id="holder-log")

    def on_mount(self) -> None:
        self._layout: tuple[int, bool] | None = None
        self.query_one("#holder-log", OpsLog).border_title = "holder log"

    def _columns(self, table: DataTable[Content], names: list[str]) -> list[str]:
        """(Re)build the columns when the longest name or the terminal's width class changed."""
        narrow = self.size.width < 110
        name_w = min(28, max([6, *(len(n) for n in names)]))
        labels = [label for label, _ in COLUMNS if not (narrow and label in NARROW)]
        if self._layout != (name_w, narrow):
            self._layout = (name_w, narrow)
            table.clear(columns=True)
            for label, width in COLUMNS:
                if label in labels:
                    width = NARROW_WIDTHS.get(label, width) if narrow else width
                    table.add_column(label, width=width or min(name_w, 16 if narrow else 28), key=label)
        return labels

    def action_toggle_follow(self) -> None:
        self.follow = not self.follow

    def watch_follow(self, follow: bool) -> None:
        self.set_class(not follow, "-frozen")
        self.post_message(self.Shown())

    @on(DataTable.RowHighlighted)
    def _selected(self) -> None:
        self.post_message(self.Shown())

    def selected_holder(self) -> str | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        try:
            key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
        except Exception:  # no row under the cursor yet
            return None
        return str(key.value) if key.value is not None else None

    def show_state(self, state: RunState, context: dict[str, Any]) -> None:
        table = self.query_one(DataTable)
        needle = self.needle
        labels = self._columns(table, list(state.holders))
        narrow = "agent sha256" not in labels
        shown = [h for h in state.holders.values()
                 if row_matches(needle, (h.name, h.state_label, h.agent_sha256 or "", h.error or ""))]
        if [str(k.value) for k in table.rows] != [h.name for h in shown]:
            table.clear()
        for h in shown:
            cells = holder_cells(h, narrow=narrow)
            if h.name in table.rows:
                for label in labels:
                    table.update_cell(h.name, label, cells[label])
            else:
                table.add_row(*(cells[label] for label in labels), key=h.name)
        name = self.selected_holder()
        follow = "following" if self.follow else "frozen (f follows)"
        self.query_one("#holder-log-title", Static).update(
            f"[b]log[/b] {esc(name or '-')} · {follow}" + (f" · filter [b]{esc(needle)}[/b] (escape clears)"
                                                          if needle else " · / filters"))
        if self.follow:
            lines = []
            if name is not None and name in state.holders:
                lines = [line for line in state.holders[name].log if row_matches(needle, (line.render(),))]
            self.query_one("#holder-log", OpsLog).lines = tuple(lines)
