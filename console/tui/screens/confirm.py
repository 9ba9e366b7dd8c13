"""A yes/no question over the current screen (``c`` and ``:cancel`` ask before a run is cancelled)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static


class ConfirmScreen(ModalScreen[bool]):
    """``y`` / ``enter`` answers yes, ``n`` / ``escape`` no (any other key is ignored: a stray key typed after
    ``c`` cancels nothing)."""

    BINDINGS = [Binding("y,enter", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str, detail: str = "") -> None:
        super().__init__()
        self.question = question
        self.detail = detail

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box"):
            yield Static(Content.assemble((self.question, "bold"), "\n", self.detail), id="confirm-text")
            yield Static(Content.assemble(("y", "bold $accent"), " yes    ", ("n", "bold $accent"), " / ",
                                          ("esc", "bold $accent"), " no"), id="confirm-keys")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
