"""The Holders screen: each holder's state, provisioning progress and throughput, rejected chunks, its log."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from textual import on
from textual.binding import Binding
from textual.containers import Horizontal
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import DataTable, Input, Static

from gputravel.console.screens.base import ConsoleScreen
from gputravel.console.view_model import HolderView, RunState
from gputravel.console.widgets.ops_log import OpsLog
from gputravel.console.widgets.route_map import STATE_TOKENS
from gputravel.console.widgets.text import bar, esc, fmt_bytes

COLUMNS = (("holder", 18), ("state", 14), ("agent sha256", 12), ("data", 10), ("provisioning", 26),
           ("MB/s", 5), ("rejected", 10), ("visits", 6))


def holder_cells(h: HolderView) -> list[Content]:
    token = STATE_TOKENS.get(h.state, "$foreground")
    frac = h.provisioned / h.total if h.total else None
    progress = (f"{bar(frac, 12, token='$primary')} {fmt_bytes(h.provisioned)}" if h.total
                else "[$text-disabled]–[/]")
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(h.rejected.items())) or "0"
    visits = f"{h.visits_done}" + (f" [$error]{h.visits_failed}✗[/]" if h.visits_failed else "")
    cells = [f"[b]{esc(h.name)}[/b]", f"[{token}]{esc(h.state_label)}[/]", esc((h.agent_sha256 or "-")[:12]),
             esc(fmt_bytes(h.data_bytes) if h.data_bytes else "-"), progress,
             (f"{h.mb_s:.1f}" if h.mb_s < 10 else f"{h.mb_s:.0f}") if h.mb_s else "-", f"[$warning]{esc(rejected)}[/]" if h.rejected else "0", visits]
    return [Content.from_markup(c) for c in cells]


class HoldersScreen(ConsoleScreen):
    """Holders and their agents. ``/`` filters the log, ``f`` follows it (or freezes it)."""

    SCREEN_NAME = "holders"
    AUTO_FOCUS = "#holders-table"
    HELP = ("One row per data holder: connecting → deploying → verified(hash) → ready → provisioning → returned, "
            "or failed / offline. The log below shows the selected holder's operations.")
    BINDINGS = [
        Binding("slash", "filter", "Filter log"),
        Binding("f", "toggle_follow", "Follow"),
    ]

    follow: reactive[bool] = reactive(True)

    def compose_body(self) -> Iterable[Widget]:
        table: DataTable[Content] = DataTable(id="holders-table", cursor_type="row", zebra_stripes=True)
        yield table
        yield Horizontal(Static(id="holder-log-title"), Input(placeholder="filter the log (enter)",
                                                               id="holder-log-filter"), id="holder-log-bar")
        yield OpsLog(id="holder-log")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for label, width in COLUMNS:
            table.add_column(label, width=width, key=label)
        self.query_one("#holder-log", OpsLog).border_title = "holder log"

    def action_filter(self) -> None:
        self.query_one("#holder-log-filter", Input).focus()

    def action_toggle_follow(self) -> None:
        self.follow = not self.follow

    def watch_follow(self, follow: bool) -> None:
        self.set_class(not follow, "-frozen")
        self.post_message(self.Shown())

    @on(Input.Submitted, "#holder-log-filter")
    def _filtered(self, event: Input.Submitted) -> None:
        event.stop()
        self.set_focus(self.query_one(DataTable))
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
        except Exception:  # noqa: BLE001 - no row under the cursor yet
            return None
        return str(key.value) if key.value is not None else None

    def show_state(self, state: RunState, context: dict[str, Any]) -> None:
        table = self.query_one(DataTable)
        for h in state.holders.values():
            cells = holder_cells(h)
            if h.name in table.rows:
                for (label, _), cell in zip(COLUMNS, cells, strict=True):
                    table.update_cell(h.name, label, cell)
            else:
                table.add_row(*cells, key=h.name)
        name = self.selected_holder()
        needle = self.query_one("#holder-log-filter", Input).value.strip().lower()
        follow = "following" if self.follow else "frozen (f follows)"
        self.query_one("#holder-log-title", Static).update(
            f"[b]log[/b] {esc(name or '-')} · {follow}" + (f" · filter [b]{esc(needle)}[/b]" if needle else ""))
        if self.follow and name is not None and name in state.holders:
            lines = [line for line in state.holders[name].log if needle in line.render().lower()]
            self.query_one("#holder-log", OpsLog).lines = tuple(lines)
