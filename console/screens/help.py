"""Contextual key help (``?`` / ``f1``): the keys that work here, the ``:`` commands, what the screen shows."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from gputravel.console.widgets.command_line import COMMANDS
from gputravel.console.widgets.text import esc


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
        keys = "\n".join(f"  [b $accent]{esc(k):<12}[/] {esc(d)}" for k, d in self.keys)
        cmds = "\n".join(f"  [b]:{esc(c):<44}[/b] {esc(d)}" for c, d in COMMANDS.items())
        text = (f"[b]{esc(self.title_text)}[/b]\n{esc(self.about)}\n\n[b]keys[/b]\n{keys}\n\n"
                f"[b]commands[/b] (: opens the command line; ctrl+p the palette)\n{cmds}\n\n"
                "[$text-muted]escape closes[/]")
        yield VerticalScroll(Static(text, id="help-text"), id="help-box")



