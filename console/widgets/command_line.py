"""The ``:`` command line (k9s style): type a command, enter runs it, escape leaves."""

from __future__ import annotations

from textual import on
from textual.binding import Binding
from textual.message import Message
from textual.widgets import Input

COMMANDS: dict[str, str] = {
    "run": "start the run (r)",
    "step": "run exactly one phase (space)",
    "pause": "pause before the next phase",
    "resume": "resume (p toggles)",
    "break PHASE": "toggle a breakpoint before PHASE (b: HANDOFF)",
    "cancel": "cancel the run (c)",
    "travel|holders|training|gpu|bench|ledger": "switch screen (1-6)",
    "verify": "verify the audit ledger's hash chain",
    "bench NAME": "run a benchmark (gputravel bench NAME --json)",
    "jump VISIT": "replay: jump to the start of a visit (1-based); 'jump start', 'jump end'",
    "theme NAME": "dark, light or high-contrast",
    "screenshot [NAME]": "save an SVG of the screen (f12)",
    "help": "key help (? or f1)",
    "quit": "leave the console (q)",
}


class CommandLine(Input):
    """An input that posts :class:`CommandLine.CommandEntered` and hides itself."""

    DEFAULT_CSS = """
    CommandLine {
        display: none;
        height: 1;
        border: none;
        padding: 0 1;
    }
    CommandLine.-textual-compact {
        padding: 0 1;
    }
    CommandLine:focus {
        border: none;  /* Input:focus draws a tall border, which left one row of ▔ and hid the text */
        height: 1;
    }
    CommandLine.-open {
        display: block;
    }
    """

    BINDINGS = [
        Binding("escape", "close", "Close", show=False),
        Binding("up", "history(-1)", "Previous", show=False),
        Binding("down", "history(1)", "Next", show=False),
    ]

    class CommandEntered(Message):
        """The operator entered a command line (without the leading ``:``)."""

        def __init__(self, command: str) -> None:
            super().__init__()
            self.command = command

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(placeholder=":command   (help lists them; escape closes)", id=id, classes=classes,
                         compact=True)
        self._history: list[str] = []
        self._cursor = 0
        self.can_focus = False  # only while open: a hidden input must not take the keys

    def open(self) -> None:
        self.value = ""
        self.can_focus = True
        self.add_class("-open")
        self.focus()

    def action_close(self) -> None:
        self.can_focus = False
        self.remove_class("-open")
        self.value = ""
        self.screen.set_focus(None)

    def action_history(self, delta: int) -> None:
        if not self._history:
            return
        self._cursor = max(0, min(len(self._history), self._cursor + delta))
        self.value = self._history[self._cursor] if self._cursor < len(self._history) else ""
        self.cursor_position = len(self.value)

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        command = event.value.strip().lstrip(":").strip()
        self.action_close()
        if command:
            self._history.append(command)
            self._cursor = len(self._history)
            self.post_message(self.CommandEntered(command))
