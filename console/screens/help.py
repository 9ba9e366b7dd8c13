"""Contextual key help (``?`` / ``f1``): the keys that work here, the ``:`` commands, what the screen shows."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static

from gputravel.console.widgets.command_line import COMMANDS


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
        # assembled, not markup: a key such as "[" would open a tag in markup
        parts: list[str | tuple[str, str] | Content] = [
            (self.title_text, "bold"), "\n", self.about, "\n\n", ("keys", "bold"), "\n"]
        for k, d in self.keys:
            parts += ["  ", (f"{k:<12}", "bold $accent"), f" {d}\n"]
        parts += ["\n", ("commands", "bold"), " (: opens the command line; ctrl+p the palette)\n"]
        for c, d in COMMANDS.items():
            parts += ["  ", (f":{c:<44}", "bold"), f" {d}\n"]
        parts += ["\n", ("escape closes", "$text-muted")]
        yield VerticalScroll(Static(Content.assemble(*parts), id="help-text"), id="help-box")
