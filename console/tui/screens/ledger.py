"""The Ledger screen: browse the audit ledger, verify its hash chain, see the row that breaks it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from textual import on, work
from textual.binding import Binding
from textual.widget import Widget
from textual.widgets import DataTable, Static

from gputravel.console.tui.screens.base import ConsoleScreen
from gputravel.console.tui.widgets.table_filter import TableFilter, row_matches
from gputravel.console.tui.widgets.text import esc
from gputravel.console.view.model import RunState
from gputravel.core.errors import LedgerError
from gputravel.core.ledger import LedgerRow, VerifyResult, read_rows, verify_ledger

COLUMNS = ("seq", "kind", "visit", "phase", "holder", "epoch", "key fp", "bytes", "outcome", "hash")


def visit_label(detail: dict[str, Any]) -> str:
    """A row's visit as the console numbers visits everywhere: from 1 (the ledger's ``detail.visit`` is the
    0-based index: ``visit`` 0 is the console's visit 1)."""
    visit = detail.get("visit")
    return str(visit + 1) if isinstance(visit, int) and not isinstance(visit, bool) else ""


class LedgerScreen(ConsoleScreen):
    """The hash-chained ledger, read-only. ``v`` verifies the chain, ``R`` reloads."""

    SCREEN_NAME = "ledger"
    AUTO_FOCUS = "#ledger-table"
    HELP = ("Every phase of every visit is a row, chained by SHA-256 to the one before. Verify recomputes every "
            "hash and link; a broken chain names (and selects) the first row that does not hold.")
    BINDINGS = [Binding("v", "verify", "Verify chain"), Binding("R", "reload", "Reload")]

    def __init__(self) -> None:
        super().__init__()
        self.path: Path | None = None
        self.rows: list[LedgerRow] = []
        self.result: VerifyResult | None = None
        self._filled_with = ""

    def compose_body(self) -> Iterable[Widget]:
        yield Static("[$text-muted]no ledger yet: it is written as the run goes[/]", id="ledger-status")
        yield TableFilter(placeholder="filter rows: kind, phase, holder, outcome, key (enter keeps, escape clears)",
                          id="ledger-filter")
        yield DataTable(id="ledger-table", cursor_type="row", zebra_stripes=True)
        yield Static(id="ledger-detail")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for col in COLUMNS:
            table.add_column(col, key=col)

    def show_state(self, state: RunState, context: dict[str, Any]) -> None:
        path = context.get("ledger_path")
        if path is not None and (self.path != Path(path) or len(self.rows) < _ledger_hint(state)):
            self.path = Path(path)
            self.load()
        elif self.needle != self._filled_with:
            self._fill()

    def action_reload(self) -> None:
        self.load()

    def action_verify(self) -> None:
        self.verify()

    @work(exclusive=True, group="ledger-load", exit_on_error=False)
    async def load(self) -> None:
        if self.path is None or not self.path.exists():
            self.query_one("#ledger-status", Static).update(f"[$text-muted]no ledger at {esc(self.path)}[/]")
            return
        try:
            rows = await asyncio.to_thread(read_rows, self.path)
        except LedgerError as exc:
            self.query_one("#ledger-status", Static).update(f"[$error]{esc(exc)}[/]")
            return
        self.rows = rows
        self._fill()

    def _fill(self) -> None:
        """The table: every row the ``/`` filter keeps."""
        table = self.query_one(DataTable)
        table.clear()
        self._filled_with = self.needle
        for r in self.rows:
            cells = (str(r.seq), r.kind, visit_label(r.detail), r.phase or "", r.holder or "",
                     "" if r.epoch is None else str(r.epoch),
                     (r.key_fp or "")[:8], "" if r.nbytes is None else f"{r.nbytes:,}", r.outcome, r.hash[:12])
            if row_matches(self.needle, cells):
                table.add_row(*cells, key=str(r.seq))
        self._status()

    @work(exclusive=True, group="ledger-verify", exit_on_error=False)
    async def verify(self) -> VerifyResult | None:
        if self.path is None:
            return None
        self.result = await asyncio.to_thread(verify_ledger, self.path)
        self.set_class(not self.result.ok, "-broken")
        if not self.result.ok and self.result.first_bad_seq is not None:
            table = self.query_one(DataTable)
            if str(self.result.first_bad_seq) in table.rows:
                table.move_cursor(row=table.get_row_index(str(self.result.first_bad_seq)))
        self._status()
        return self.result

    def _status(self) -> None:
        text = f"[b]ledger[/b] {esc(self.path)} · {len(self.rows)} rows"
        if self.needle:
            shown = self.query_one(DataTable).row_count
            text += f" · [b]{shown}[/b] match [b]{esc(self.needle)}[/b] (escape clears)"
        r = self.result
        if r is not None:
            if r.ok:
                text += f" · [b $success]chain verified[/] head {esc((r.head_hash or '')[:16])}"
            else:
                text += f" · [b $error]BROKEN at row {r.first_bad_seq}[/]: {esc(r.reason)}"
        else:
            text += " · v verifies the chain"
        self.query_one("#ledger-status", Static).update(text)

    @on(DataTable.RowHighlighted, "#ledger-table")
    def _row(self, event: DataTable.RowHighlighted) -> None:
        seq = int(str(event.row_key.value))
        row = next((r for r in self.rows if r.seq == seq), None)
        if row is None:
            return
        bad = self.result is not None and self.result.first_bad_seq == seq
        head = f"[b $error]row {seq} breaks the chain[/]\n" if bad else ""
        self.query_one("#ledger-detail", Static).update(
            head + f"[b]row {seq}[/b] prev {esc(row.prev_hash[:16])} → hash {esc(row.hash[:16])}"
            + (f" · visit {visit_label(row.detail)} (detail.visit {row.detail['visit']} counts from 0)\n"
               if visit_label(row.detail) else "\n")
            + esc(json.dumps(row.detail, sort_keys=True))[:400])


def _ledger_hint(state: RunState) -> int:
    """Reload when the run has moved on: a rough lower bound of rows the ledger holds by now."""
    return state.phases_completed
