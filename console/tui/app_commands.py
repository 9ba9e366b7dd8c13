"""The console's ``:`` commands, its command palette entries and its key help: :class:`ConsoleCommands`, a part
that :class:`~gputravel.console.tui.app.GpuTravelConsole` holds. Every control they offer is one of the app's
actions (:class:`ConsoleActions`, what the part asks of the app); the Textual side (notices, the help screen,
timers, the theme) is the app's own."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.notifications import SeverityLevel

from gputravel.console.tui.bridge import Bridge
from gputravel.console.tui.screens.base import ConsoleScreen
from gputravel.console.tui.screens.help import HelpScreen
from gputravel.themes import THEMES, theme_name

__all__ = ["CONTROL_ACTIONS", "EXTRA_KEYS", "SCREENS_IN_ORDER", "VIEW_ACTIONS", "BINDINGS", "ConsoleActions", "ConsoleCommands"]

SCREENS_IN_ORDER = ("travel", "holders", "training", "gpu", "bench", "ledger")
#: Actions that change a run (or start work on this machine); refused in --readonly.
CONTROL_ACTIONS = frozenset({"step", "toggle_pause", "toggle_break", "run", "cancel", "run_bench"})
#: Of those, the ones that only move the view of a recording (play, pause, step): a replay allows them always.
VIEW_ACTIONS = frozenset({"step", "toggle_pause", "run"})
#: The console's keys (the footer shows those with ``show``; ``?`` lists them all with :data:`EXTRA_KEYS`)
BINDINGS: list[Binding | tuple[str, str] | tuple[str, str, str]] = [
    Binding("space", "step", "Step"),
    Binding("p", "toggle_pause", "Pause/resume"),
    Binding("b", "toggle_break", "Break@HANDOFF"),
    Binding("r", "run", "Run"),
    Binding("c", "cancel", "Cancel"),
    Binding("left_square_bracket", "jump_visit(-1)", "Prev visit"),
    Binding("right_square_bracket", "jump_visit(1)", "Next visit"),
    Binding("home", "seek('start')", "Start", show=False),
    Binding("end", "seek('end')", "End", show=False),
    *(Binding(str(i + 1), f"show_screen('{name}')", name.title(), show=False)
      for i, name in enumerate(SCREENS_IN_ORDER)),
    Binding("colon", "command_line", ":cmd"),
    Binding("question_mark,f1", "show_help", "Help"),
    Binding("o", "toggle_log", "Ops log", show=False),
    Binding("f12", "save_screenshot", "Screenshot", show=False),
    Binding("q", "quit", "Quit"),
]
#: Keys the footer leaves out, for the help overlay (the footer shows the rest).
EXTRA_KEYS: tuple[tuple[str, str], ...] = (
    ("1-6", "screens: " + ", ".join(SCREENS_IN_ORDER)),
    ("[ ]", "replay: previous / next visit"),
    ("home end", "replay: start / end of the recording"),
    ("/", "filter this screen's table (travel, holders, bench, ledger)"),
    ("o", "show / hide the operations log"),
    ("f12", "save an SVG of the screen ($GPUTRAVEL_SCREENSHOT_DIR, else the current folder)"),
    ("ctrl+p", "command palette"),
    ("esc", "close the : line, clear a filter, close this help"),
)


class ConsoleActions(Protocol):
    """The app's actions the commands call, and what they read of it (``GpuTravelConsole`` defines them)."""

    bridge: Bridge
    #: --readonly: an observer's console (no controls ever)
    observer: bool

    @property
    def readonly(self) -> bool: ...

    def action_step(self) -> None: ...
    def action_run(self) -> None: ...
    def action_cancel(self) -> None: ...
    def action_toggle_pause(self) -> None: ...
    def action_toggle_break(self) -> None: ...
    def action_toggle_breakpoint(self, phase: str) -> None: ...
    def action_seek(self, where: str) -> None: ...
    def action_show_screen(self, name: str) -> None: ...
    def action_save_screenshot(self, name: str = "") -> None: ...
    def action_verify_ledger(self) -> None: ...
    def action_run_bench(self, name: str) -> None: ...
    def request_quit(self) -> None: ...


class ConsoleCommands:
    """The ``:`` line, the palette and ``?`` of one console: ``app`` its Textual side, ``actions`` the same app's
    actions (typed apart, so this part reads only what it calls)."""

    def __init__(self, app: App[None], actions: ConsoleActions) -> None:
        self.app = app
        self.actions = actions

    @property
    def bridge(self) -> Bridge:
        return self.actions.bridge

    def notify(self, message: str, *, severity: SeverityLevel = "information", timeout: float | None = None,
               markup: bool = True) -> None:
        self.app.notify(message, severity=severity, timeout=timeout, markup=markup)

    def show_help(self) -> None:
        screen = self.app.screen
        if isinstance(screen, HelpScreen):
            return
        keys: list[tuple[str, str]] = []
        seen: set[str] = set()
        for _key, active in self.app.active_bindings.items():
            b = active.binding
            if b.action in seen or not active.enabled or not b.show:
                continue
            seen.add(b.action)
            keys.append((self.app.get_key_display(b), b.description or b.action))
        about = screen.HELP if isinstance(screen, ConsoleScreen) else ""
        if isinstance(screen, ConsoleScreen) and self.bridge.merges_gpus and screen.FLEET_HELP:
            about = f"{about} {screen.FLEET_HELP}"
        name = screen.SCREEN_NAME if isinstance(screen, ConsoleScreen) else "console"
        replay = self.bridge.replay
        shown = {k for k, _ in keys}
        keys.extend((k, d) for k, d in EXTRA_KEYS
                    if (replay or not d.startswith("replay")) and not set(k.split()) <= shown)
        self.app.push_screen(HelpScreen(title=f"{name} screen", about=about, keys=keys))

    # --- the : line and the palette -----------------------------------------------------------
    def execute(self, line: str) -> None:
        """Run one ``:`` command (see ``widgets.command_line.COMMANDS``)."""
        try:
            words = shlex.split(line)
        except ValueError as exc:
            self.notify(str(exc), severity="error")
            return
        if not words:
            return
        cmd, args = words[0].lower(), words[1:]
        simple: dict[str, Callable[[], Any]] = {
            "run": self.actions.action_run, "step": self.actions.action_step, "cancel": self.actions.action_cancel,
            "help": self.show_help, "verify": self.actions.action_verify_ledger, "quit": self.actions.request_quit,
            "q": self.actions.request_quit}
        if self.bridge.watching and cmd in CONTROL_ACTIONS | {"pause", "resume", "break", "cancel"}:
            self.notify("another console steers this run: :take takes control", severity="warning")
            return
        view_only = self.bridge.replay and not self.bridge.attached and cmd in {"run", "step", "pause", "resume"}
        if cmd == "take":
            self.take_control()
            return
        if cmd in CONTROL_ACTIONS | {"pause", "resume", "break", "bench", "cancel"} and self.actions.readonly and not view_only:
            self.notify("read-only console: no controls", severity="warning")
            return
        if cmd in simple:
            simple[cmd]()
        elif cmd in ("pause", "resume"):
            paused = self.bridge.paused
            if (cmd == "pause") != paused:
                self.actions.action_toggle_pause()
        elif cmd == "break":
            if self.bridge.replay and not self.bridge.attached:
                self.notify("breakpoints belong to a live run", severity="warning")
            else:
                self.actions.action_toggle_breakpoint(args[0] if args else "HANDOFF")
        elif cmd in SCREENS_IN_ORDER:
            self.actions.action_show_screen(cmd)
        elif cmd == "bench":
            if args:
                self.actions.action_run_bench(args[0])
            else:
                from gputravel.console.tui.bench_args import BENCH_ARGS

                self.notify(f"bench NAME: {', '.join(BENCH_ARGS)} (tab completes)", severity="error")
        elif cmd == "screenshot":  # after the command line has closed, so it is not in the picture
            name = args[0] if args else ""
            self.app.set_timer(0.3, lambda: self.actions.action_save_screenshot(name))
        elif cmd == "theme":
            try:
                self.app.theme = theme_name(args[0] if args else "")
            except KeyError as exc:
                self.notify(str(exc.args[0]), severity="error", markup=False)
        elif cmd == "jump":
            self._jump(args)
        else:
            self.notify(f"unknown command {line!r}: :help lists the commands", severity="error", markup=False)

    def take_control(self) -> None:
        """``:take``: steer an attached run that another console steers (that one turns read-only)."""
        if not self.bridge.attached or self.actions.observer or self.bridge.folder is None:
            self.notify("nothing to take: :take steers a run attached with --attach (not --readonly)",
                        severity="warning")
            return
        if self.bridge.in_control:
            self.notify("this console already steers the run", timeout=2)
            return
        self.bridge.take()
        self.notify("control taken: this console steers the run", timeout=3)
        self.bridge.post_state()

    def _jump(self, args: list[str]) -> None:
        playback = self.bridge.playback
        if playback is None:
            self.notify("jump works in a replay (gputravel-console --replay FILE)", severity="warning")
        elif args and args[0] == "end":
            self.actions.action_seek("end")
        elif args and args[0] == "start":
            self.actions.action_seek("start")
        elif args and args[0].isdigit() and int(args[0]) >= 1:
            playback.playing = False
            playback.jump_visit(int(args[0]) - 1)
        else:
            self.notify("jump VISIT (1-based), jump start or jump end", severity="error")

    def palette(self) -> Iterable[SystemCommand]:
        """The console's palette entries (after Textual's own, less its "Theme": the console's "Theme: NAME"
        offers only those --theme and :theme accept)."""
        if not self.actions.readonly:
            yield SystemCommand("Run", "Start the run (or resume it)", self.actions.action_run)
            yield SystemCommand("Step one phase", "Run exactly one protocol phase, then pause", self.actions.action_step)
            yield SystemCommand("Pause / resume", "Pause before the next phase, or resume", self.actions.action_toggle_pause)
            if self.bridge.live:
                yield SystemCommand("Break before HANDOFF", "Toggle the breakpoint before the hand-off",
                                    self.actions.action_toggle_break)
            yield SystemCommand("Cancel run", "Abort the visit (the buffer is scrubbed) and stop", self.actions.action_cancel)
        for name in SCREENS_IN_ORDER:
            yield SystemCommand(f"Screen: {name}", f"Show the {name} screen",
                                lambda name=name: self.actions.action_show_screen(name))
        yield SystemCommand("Verify ledger", "Recompute the audit ledger's hash chain", self.actions.action_verify_ledger)
        for choice in THEMES:
            yield SystemCommand(f"Theme: {choice}", f"Switch to the {choice} theme",
                                lambda c=choice: setattr(self.app, "theme", theme_name(c)))
