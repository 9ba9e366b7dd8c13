"""Questions over the current screen: yes/no (``c`` and ``:cancel`` ask before a run is cancelled) and
leaving a run this console steers (``q``: detach, cancel the run, or stay)."""

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


class QuitScreen(ModalScreen[str]):
    """``q`` on a run this console steers (it runs in its own process): ``d`` detaches (the run goes on), ``c``
    cancels the run and leaves, ``esc`` stays (any other key is ignored)."""

    BINDINGS = [Binding("d", "answer('detach')", "Detach"), Binding("c", "answer('cancel')", "Cancel the run"),
                Binding("escape", "answer('stay')", "Stay")]

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box"):
            yield Static(Content.assemble(("Leave the console?", "bold"), "\n",
                                          "The run goes on in its own process if you detach; come back with "
                                          "gputravel-console --attach RUN."), id="confirm-text")
            yield Static(Content.assemble(("d", "bold $accent"), " detach    ", ("c", "bold $accent"),
                                          " cancel the run    ", ("esc", "bold $accent"), " stay"),
                         id="confirm-keys")

    def action_answer(self, how: str) -> None:
        self.dismiss(how)
