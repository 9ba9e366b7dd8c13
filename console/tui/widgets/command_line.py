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
    "take": "attached: steer the run another console steers",
    "travel|holders|training|gpu|bench|ledger": "switch screen (1-6)",
    "verify": "verify the audit ledger's hash chain",
    "bench NAME": "run a benchmark (gputravel bench NAME --json)",
    "jump VISIT": "replay: jump to the start of a visit (1-based); 'jump start', 'jump end'",
    "theme NAME": "dark, light or high-contrast",
    "screenshot [NAME]": "save an SVG of the screen (f12)",
    "help": "key help (? or f1)",
    "quit": "leave the console (q)",
}


#: What Tab completes the first word to (every command, the screens one by one).
COMMAND_WORDS: tuple[str, ...] = tuple(sorted({w for key in COMMANDS for w in key.split()[0].split("|")}))
#: ... and the second word of the commands that take one.
ARGUMENT_WORDS: dict[str, tuple[str, ...]] = {
    "break": ("ATTEST", "HANDOFF", "PROVISION", "RETURN", "VERIFY", "TRAIN", "SCRUB", "ROTATE"),
    "jump": ("start", "end"),
    "theme": ("dark", "light", "high-contrast"),
}


def complete(line: str, words: dict[str, tuple[str, ...]] | None = None) -> tuple[str, tuple[str, ...]]:
    """Tab in the ``:`` line: ``line`` completed as far as it is unambiguous (a space after a whole word),
    and the candidates that remain (more than one: the operator types on)."""
    args = {**ARGUMENT_WORDS, **(words or {})}
    head, _, last = line.rpartition(" ")
    before = head.split()
    if not before:
        pool = COMMAND_WORDS
    elif len(before) == 1:
        pool = args.get(before[0].lower(), ())
    else:
        pool = ()
    hits = tuple(w for w in pool if w.lower().startswith(last.lower()))
    if not hits:
        return line, ()
    prefix = hits[0]
    for w in hits[1:]:
        while not w.lower().startswith(prefix.lower()):
            prefix = prefix[:-1]
    done = prefix + (" " if len(hits) == 1 and pool is COMMAND_WORDS and prefix in _TAKES_ARGUMENT else "")
    return (f"{head} " if head else "") + done, hits if len(hits) > 1 else ()


_TAKES_ARGUMENT = frozenset(key.split()[0] for key in COMMANDS if " " in key)


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
        Binding("tab", "complete", "Complete", show=False, priority=True),  # never moves the focus away
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
        #: second words Tab completes beyond ARGUMENT_WORDS (the app adds the benchmarks it offers)
        self.extra_words: dict[str, tuple[str, ...]] = {}
        self._cursor = 0
        self.can_focus = False  # only while open: a hidden input must not take the keys

    def open(self) -> None:
        self.value = ""
        self.can_focus = True
        self.add_class("-open")
        self.screen.set_focus(self)  # at once (focus() waits a tick): keys typed right after ':' land here

    def action_close(self) -> None:
        self.can_focus = False
        self.remove_class("-open")
        self.value = ""
        self.screen.set_focus(None)

    def action_complete(self) -> None:
        """Tab: complete the word before the cursor; several candidates are listed, one is filled in."""
        if not self.has_class("-open"):
            return
        line, hits = complete(self.value, self.extra_words)
        self.value = line
        self.cursor_position = len(line)
        if hits:
            self.notify("  ".join(hits), title="Tab: one of", timeout=3, markup=False)

    def on_blur(self) -> None:
        """Focus gone (a click elsewhere): the line closes, so no half-typed text stays under the log."""
        if self.has_class("-open"):
            self.action_close()

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
