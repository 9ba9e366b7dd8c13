"""The console's ``:`` commands, its command palette entries and its key help (a part of
:class:`~gputravel.console.tui.app.GpuTravelConsole`, kept apart to keep each module short)."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable
from typing import Any

from textual.app import App, SystemCommand
from textual.screen import Screen

from gputravel.console.tui.screens.base import ConsoleScreen
from gputravel.console.tui.screens.help import HelpScreen
from gputravel.themes import THEMES, theme_name

__all__ = ["CONTROL_ACTIONS", "EXTRA_KEYS", "SCREENS_IN_ORDER", "VIEW_ACTIONS", "ConsoleCommands"]

SCREENS_IN_ORDER = ("travel", "holders", "training", "gpu", "bench", "ledger")
#: Actions that change a run (or start work on this machine); refused in --readonly.
CONTROL_ACTIONS = frozenset({"step", "toggle_pause", "toggle_break", "run", "cancel", "run_bench"})
#: Of those, the ones that only move the view of a recording (play, pause, step): a replay allows them always.
VIEW_ACTIONS = frozenset({"step", "toggle_pause", "run"})
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


class ConsoleCommands(App[None]):
    """The ``:`` line, the palette and ``?``: every control they offer is one of the app's actions (the base
    of :class:`~gputravel.console.tui.app.GpuTravelConsole`, which defines the actions named here)."""

    bridge: Any
    #: --readonly: an observer's console (no controls ever)
    observer: bool
    # the app's actions these commands call (defined by GpuTravelConsole)
    action_step: Callable[[], None]
    action_run: Callable[[], None]
    action_cancel: Callable[[], None]
    action_toggle_pause: Callable[[], None]
    action_toggle_break: Callable[[], None]
    action_toggle_breakpoint: Callable[[str], None]
    action_seek: Callable[[str], None]
    action_show_screen: Callable[[str], None]
    action_save_screenshot: Callable[..., None]
    action_verify_ledger: Callable[[], None]
    action_run_bench: Callable[[str], None]
    request_quit: Callable[[], None]

    @property
    def readonly(self) -> bool:
        """No controls: an observer's console, or an attached one while another console steers the run."""
        return self.observer or bool(self.bridge.watching)

    def action_show_help(self) -> None:
        screen = self.screen
        if isinstance(screen, HelpScreen):
            return
        keys: list[tuple[str, str]] = []
        seen: set[str] = set()
        for _key, active in self.active_bindings.items():
            b = active.binding
            if b.action in seen or not active.enabled or not b.show:
                continue
            seen.add(b.action)
            keys.append((self.get_key_display(b), b.description or b.action))
        about = screen.HELP if isinstance(screen, ConsoleScreen) else ""
        if isinstance(screen, ConsoleScreen) and self.bridge.merges_gpus and screen.FLEET_HELP:
            about = f"{about} {screen.FLEET_HELP}"
        name = screen.SCREEN_NAME if isinstance(screen, ConsoleScreen) else "console"
        replay = self.bridge.replay
        shown = {k for k, _ in keys}
        keys.extend((k, d) for k, d in EXTRA_KEYS
                    if (replay or not d.startswith("replay")) and not set(k.split()) <= shown)
        self.push_screen(HelpScreen(title=f"{name} screen", about=about, keys=keys))

    # --- the : line and the palette -----------------------------------------------------------
    def on_command_line_command_entered(self, message: Any) -> None:
        self.execute_command(message.command)

    def execute_command(self, line: str) -> None:
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
            "run": self.action_run, "step": self.action_step, "cancel": self.action_cancel,
            "help": self.action_show_help, "verify": self.action_verify_ledger, "quit": self.request_quit,
            "q": self.request_quit}
        if self.bridge.watching and cmd in CONTROL_ACTIONS | {"pause", "resume", "break", "cancel"}:
            self.notify("another console steers this run: :take takes control", severity="warning")
            return
        view_only = self.bridge.replay and not self.bridge.attached and cmd in {"run", "step", "pause", "resume"}
        if cmd == "take":
            self.take_control()
            return
        if cmd in CONTROL_ACTIONS | {"pause", "resume", "break", "bench", "cancel"} and self.readonly and not view_only:
            self.notify("read-only console: no controls", severity="warning")
            return
        if cmd in simple:
            simple[cmd]()
        elif cmd in ("pause", "resume"):
            paused = self.bridge.paused
            if (cmd == "pause") != paused:
                self.action_toggle_pause()
        elif cmd == "break":
            if self.bridge.replay and not self.bridge.attached:
                self.notify("breakpoints belong to a live run", severity="warning")
            else:
                self.action_toggle_breakpoint(args[0] if args else "HANDOFF")
        elif cmd in SCREENS_IN_ORDER:
            self.action_show_screen(cmd)
        elif cmd == "bench":
            if args:
                self.action_run_bench(args[0])
            else:
                from gputravel.console.tui.bench_args import BENCH_ARGS

                self.notify(f"bench NAME: {', '.join(BENCH_ARGS)} (tab completes)", severity="error")
        elif cmd == "screenshot":  # after the command line has closed, so it is not in the picture
            name = args[0] if args else ""
            self.set_timer(0.3, lambda: self.action_save_screenshot(name))
        elif cmd == "theme":
            try:
                self.theme = theme_name(args[0] if args else "")
            except KeyError as exc:
                self.notify(str(exc.args[0]), severity="error", markup=False)
        elif cmd == "jump":
            self._jump(args)
        else:
            self.notify(f"unknown command {line!r}: :help lists the commands", severity="error", markup=False)

    def take_control(self) -> None:
        """``:take``: steer an attached run that another console steers (that one turns read-only)."""
        if not self.bridge.attached or self.observer or self.bridge.folder is None:
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
        if not self.bridge.replay:
            self.notify("jump works in a replay (gputravel-console --replay FILE)", severity="warning")
        elif args and args[0] == "end":
            self.action_seek("end")
        elif args and args[0] == "start":
            self.action_seek("start")
        elif args and args[0].isdigit() and int(args[0]) >= 1:
            self.bridge.playing = False
            self.bridge.jump_visit(int(args[0]) - 1)
        else:
            self.notify("jump VISIT (1-based), jump start or jump end", severity="error")

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        # Textual's own "Theme" offers every theme it knows; the console's ("Theme: NAME") only those --theme
        # and :theme accept
        yield from (c for c in super().get_system_commands(screen) if c.title != "Theme")
        if not self.readonly:
            yield SystemCommand("Run", "Start the run (or resume it)", self.action_run)
            yield SystemCommand("Step one phase", "Run exactly one protocol phase, then pause", self.action_step)
            yield SystemCommand("Pause / resume", "Pause before the next phase, or resume", self.action_toggle_pause)
            if self.bridge.live:
                yield SystemCommand("Break before HANDOFF", "Toggle the breakpoint before the hand-off",
                                    self.action_toggle_break)
            yield SystemCommand("Cancel run", "Abort the visit (the buffer is scrubbed) and stop", self.action_cancel)
        for name in SCREENS_IN_ORDER:
            yield SystemCommand(f"Screen: {name}", f"Show the {name} screen",
                                lambda name=name: self.action_show_screen(name))
        yield SystemCommand("Verify ledger", "Recompute the audit ledger's hash chain", self.action_verify_ledger)
        for choice in THEMES:
            yield SystemCommand(f"Theme: {choice}", f"Switch to the {choice} theme",
                                lambda c=choice: setattr(self, "theme", theme_name(c)))
