"""Contextual key help (``?`` / ``f1``): the keys that work here, the ``:`` commands, what the screen shows."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static

from gputravel.console.tui.widgets.command_line import COMMANDS


class HelpScreen(ModalScreen[None]):
    """Keys of the screen it was opened from, then the app's, then the command line's commands."""

    BINDINGS = [Binding("escape,q,question_mark,f1", "dismiss", "Close"),
                Binding("f12", "app.save_screenshot('help')", "Screenshot", show=False)]

    def __init__(self, *, title: str, about: str, keys: list[tuple[str, str]]) -> None:
        super().__init__()
        self.title_text = title
        self.about = about
        self.keys = keys

    def compose(self) -> ComposeResult:
        # two-column grids: a long description wraps under itself, never back to column 0
        accent = self.app.current_theme.accent or "cyan"
        keys = Table.grid(padding=(0, 1))
        keys.add_column(no_wrap=True, style=f"bold {accent}")
        keys.add_column(ratio=1)
        for k, d in self.keys:
            keys.add_row(k, d)
        commands = Table.grid(padding=(0, 1))
        commands.add_column(style="bold", max_width=22)  # the long one (the six screens) wraps in its column
        commands.add_column(ratio=1)
        for c, d in COMMANDS.items():
            commands.add_row(f":{c}", d)
        yield VerticalScroll(
            Static(Text(self.title_text, style="bold"), classes="help-head"),
            Static(Text(self.about), classes="help-about"),
            Static(Text("keys", style="bold"), classes="help-head"),
            Static(keys, id="help-keys"),
            Static(Text.assemble(("commands", "bold"), " (: opens the command line, tab completes; ctrl+p the "
                                 "palette)"), classes="help-head"),
            Static(commands, id="help-commands"),
            Static(Content.assemble(("escape closes", "$text-muted")), classes="help-head"),
            id="help-box")
