"""``gputravel-console``: the operator console.

The app is the composition root: it owns one bridge (live engine or recording), renders the bridge's
:class:`~gputravel.console.view.model.RunState` on the current screen, and turns keys, the ``:`` line and the
command palette into the bridge's controls. Engine work runs in workers; nothing here blocks the loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import typer
from textual import work
from textual.app import App, ScreenStackError, SystemCommand
from textual.screen import Screen
from textual.worker import Worker, WorkerState

from gputravel.console.cli.launch import Launcher
from gputravel.console.tui.app_commands import BINDINGS, CONTROL_ACTIONS, VIEW_ACTIONS, ConsoleCommands
from gputravel.console.tui.app_leave import Leaving
from gputravel.console.tui.bridge import Bridge
from gputravel.console.tui.bridges import choose_bridge
from gputravel.console.tui.fleet_view import FleetRecording, is_fleet_folder
from gputravel.console.tui.screens.base import ConsoleScreen
from gputravel.console.tui.screens.bench import BenchRunner, BenchScreen
from gputravel.console.tui.screens.confirm import ConfirmScreen, QuitScreen
from gputravel.console.tui.screens.gpu import GpuScreen
from gputravel.console.tui.screens.holders import HoldersScreen
from gputravel.console.tui.screens.ledger import LedgerScreen
from gputravel.console.tui.screens.training import TrainingScreen
from gputravel.console.tui.screens.travel import TravelScreen
from gputravel.console.tui.widgets.command_line import CommandLine
from gputravel.core.errors import ConfigError, GpuTravelError
from gputravel.core.phases import Phase
from gputravel.core.recording import Recording, load_recording
from gputravel.core.telemetry import Sampler
from gputravel.themes import CSS_PATH, THEMES, theme_name

__all__ = ["GpuTravelConsole", "main", "make_app"]

class GpuTravelConsole(App[None]):
    """Watch the GPU travel, step the protocol, read the GPU's health, run benchmarks, audit the ledger."""

    CSS_PATH = CSS_PATH
    TITLE = "gputravel"
    DEFAULT_MODE = "travel"
    #: Compact layout below 110 columns and below 32 rows (nvitop's compact mode, for 80x24 terminals).
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]
    MODES = {"travel": TravelScreen, "holders": HoldersScreen, "training": TrainingScreen, "gpu": GpuScreen,
             "bench": BenchScreen, "ledger": LedgerScreen}
    BINDINGS = BINDINGS

    def __init__(self, *, engine_factory: Callable[[], Any] | None = None,
                 replay: Recording | FleetRecording | None = None,
                 theme: str = "dark", readonly: bool = False, record: Path | bool = True,
                 telemetry_interval: float = 1.0, sampler: Sampler | None = None,
                 bench_runner: BenchRunner | None = None, follow: bool = False, replay_speed: float = 8.0,
                 breakpoints: tuple[str, ...] = (), attach: Path | None = None,
                 launcher: Launcher | None = None) -> None:
        super().__init__()
        if engine_factory is None and replay is None and launcher is None:
            raise ValueError("make_app needs a launcher, an engine_factory or a recording to replay")
        self.observer = readonly
        #: the cancel and quit questions, and how the console was left (console/tui/app_leave.py)
        self.leaving = Leaving(self, self)
        self.telemetry_interval = telemetry_interval
        self.bench_runner = bench_runner
        self.theme_choice = theme
        self.bridge: Bridge = choose_bridge(self, engine_factory=engine_factory, replay=replay, record=record,
                                            sampler=sampler, follow=follow, replay_speed=replay_speed,
                                            attach=attach, launcher=launcher)
        #: the : line, the palette and ? (console/tui/app_commands.py)
        self.commands = ConsoleCommands(self, self)
        self.run_worker_handle: Worker[Any] | None = None
        #: called once the first screen is drawn (``--gpus N`` starts its fleet then)
        self.when_ready: Callable[[], None] | None = None
        self.bridge.preset_breakpoints(Phase(phase) for phase in breakpoints)  # --break-before
        for theme_obj in THEMES.values():
            self.register_theme(theme_obj)
        self.theme = theme_name(theme)

    @property
    def left_how(self) -> str:
        """How the console was left: "detach" (the run goes on), "cancel" (asked to cancel it), or "quit"."""
        return self.leaving.how

    @property
    def readonly(self) -> bool:
        """No controls: an observer's console, or an attached one while another console steers the run."""
        return self.observer or self.bridge.watching

    def execute_command(self, line: str) -> None:
        """Run one ``:`` command (see ``widgets.command_line.COMMANDS``)."""
        self.commands.execute(line)

    def on_command_line_command_entered(self, message: CommandLine.CommandEntered) -> None:
        self.commands.execute(message.command)

    def take_control(self) -> None:
        """``:take``: steer an attached run that another console steers (that one turns read-only)."""
        self.commands.take_control()

    def action_show_help(self) -> None:
        self.commands.show_help()

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from (c for c in super().get_system_commands(screen) if c.title != "Theme")
        yield from self.commands.palette()

    # --- lifetime -------------------------------------------------------------------------------
    def on_mount(self) -> None:
        if self.observer:
            self.sub_title = "read-only"
        if self.bridge.live:
            self.set_interval(0.1, self.bridge.sync_control, name="control-sync")
        if self.bridge.replay:
            self.play_recording()
        self.bridge.begin()
        if self.bridge.polls_telemetry:
            self.poll_telemetry()
        self.render_state()
        if self.when_ready is not None:
            self.call_after_refresh(self.when_ready)

    async def on_unmount(self) -> None:
        import asyncio

        if self.bridge.live and self.bridge.running:
            self.bridge.cancel()
        await asyncio.to_thread(self.bridge.close)

    # --- workers --------------------------------------------------------------------------------
    @work(exclusive=True, group="visit", exit_on_error=False)
    async def run_visits(self, stepping: bool = False) -> dict[str, Any] | None:
        return await self.bridge.drive(stepping=stepping)

    @work(exclusive=True, group="telemetry-poll", exit_on_error=False)
    async def poll_telemetry(self) -> None:
        await self.bridge.poll_telemetry(self.telemetry_interval)

    @work(exclusive=True, group="replay", exit_on_error=False)
    async def play_recording(self) -> None:
        if self.bridge.playback is not None:
            await self.bridge.playback.play()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state is WorkerState.ERROR and event.worker.error is not None:
            self.notify(f"{event.worker.name}: {event.worker.error}", severity="error", timeout=8, markup=False)

    # --- bridge messages ----------------------------------------------------------------------
    def on_bridge_state_changed(self, message: Bridge.StateChanged) -> None:
        self.render_state()

    def on_bridge_telemetry_ticked(self, message: Bridge.TelemetryTicked) -> None:
        frame = self.bridge.take_frame()
        screen = self.current_screen()
        if isinstance(screen, GpuScreen) and frame is not None:
            screen.show_telemetry(frame, self.bridge.history, last_devices=self.bridge.last_devices)

    def on_bridge_notice(self, message: Bridge.Notice) -> None:
        self.notify(message.text, severity=message.severity, timeout=8, markup=False)

    def on_console_screen_shown(self, message: ConsoleScreen.Shown) -> None:
        self.render_state()

    def render_state(self) -> None:
        """Attributes down: hand the current screen the state (and, for the GPU screen, the latest frame)."""
        screen = self.current_screen()
        if isinstance(screen, ConsoleScreen) and screen.is_mounted:
            context = {"readonly": self.readonly, "ledger_path": self.bridge.ledger_path,
                       "frame": self.bridge.latest_frame, "history": self.bridge.history,
                       "last_devices": self.bridge.last_devices,
                       "live_fleet": self.bridge.torchrun_drives,
                       # an attached run is steered, not replayed: its panel shows the run's live state
                       "replay": self.bridge.replay and not self.bridge.attached,
                       "attached": self.bridge.attached and not self.bridge.launches,
                       "follow": self.bridge.replay and self.bridge.follow and not self.bridge.attached}
            screen.show(self.bridge.state, badges=self.badges, context=context, status=self.bridge.shown_status())

    def current_screen(self) -> Screen[Any] | None:
        """The screen on top, or None while a mode switch has not mounted one yet."""
        try:
            return self.screen
        except ScreenStackError:
            return None

    @property
    def badges(self) -> tuple[str, ...]:
        readonly: tuple[str, ...] = ()
        if self.bridge.watching:  # another console steers this run
            readonly = ("READ-ONLY · :take",)
        elif self.readonly:  # a fleet following its ranks: torchrun drives it, not these keys
            readonly = ("READ-ONLY · torchrun drives",) if self.bridge.torchrun_drives else ("READ-ONLY",)
        return (*self.bridge.badges, *readonly)

    # --- controls -------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if isinstance(self.current_screen(), (ConfirmScreen, QuitScreen)):  # a question is open: its keys only
            return False
        replay = self.bridge.replay
        view_only = replay and not self.bridge.attached and action in VIEW_ACTIONS
        if action in CONTROL_ACTIONS and self.readonly and not view_only:
            return False
        if action in ("toggle_break", "cancel") and replay and not self.bridge.attached:  # no run to steer
            return False
        if action in ("jump_visit", "seek") and not replay:
            return False
        attached_ended = self.bridge.attached and not self.bridge.launches and not self.bridge.run_live
        if action.startswith("toggle_break") and attached_ended:  # no breakpoint to set (its other keys say so)
            return False
        return True

    @property
    def run_in_flight(self) -> bool:
        w = self.run_worker_handle
        return w is not None and w.state in (WorkerState.PENDING, WorkerState.RUNNING)

    def _start_run(self, *, stepping: bool) -> None:
        self.run_worker_handle = self.run_visits(stepping)

    def action_step(self) -> None:
        """Run exactly one phase (starting the run, paused, if none is running)."""
        if self.bridge.live and not self.run_in_flight:
            self._start_run(stepping=True)
            return
        self.bridge.step()

    def action_toggle_pause(self) -> None:
        self.notify(self.bridge.toggle_pause(), timeout=2)

    def action_toggle_break(self) -> None:
        on = self.bridge.toggle_breakpoint(Phase.HANDOFF)
        self.notify(f"break before HANDOFF {'on' if on else 'off'}", timeout=2)

    def action_toggle_breakpoint(self, phase: str) -> None:
        try:
            p = Phase(phase.upper())
        except ValueError:
            self.notify(f"no phase {phase!r}: {', '.join(str(p) for p in Phase)}", severity="error")
            return
        on = self.bridge.toggle_breakpoint(p)
        self.notify(f"break before {p} {'on' if on else 'off'}", timeout=2)

    def action_run(self) -> None:
        """Start the run, or resume a paused one; in a replay, play from the start."""
        if self.bridge.attached:
            self.bridge.resume()
            return
        if self.bridge.playback is not None:
            self.bridge.playback.restart()
            return
        if self.run_in_flight:
            self.bridge.resume()
            return
        self._start_run(stepping=False)

    def action_cancel(self) -> None:
        if self.bridge.attached and self.bridge.run_live:
            self.leaving.confirm_cancel()
            return
        if self.bridge.attached:  # the console's own run, or an attached one, that has ended
            ended = self.bridge.shown_status()
            self.notify(f"no run in progress (the last one {ended})" if ended else "no run in progress", timeout=2)
            return
        if self.bridge.replay:
            self.notify("a replay has no run to cancel: p pauses, home goes back to the start", timeout=3)
            return
        if not self.run_in_flight:
            ended = self.bridge.state.status
            self.notify(f"no run in progress (the last one {ended})" if self.bridge.state.ended
                        else "no run in progress", timeout=2)
            return
        self.leaving.confirm_cancel()

    async def action_quit(self) -> None:
        """``q``: leave. A run this console steers (its own, started as a headless process, or ``--attach``) is
        asked about: detach (it goes on), cancel it, or stay; one that runs inside this process (an embedded
        engine) would die with it: that is asked first."""
        self.request_quit()

    def request_quit(self) -> None:
        self.leaving.request_quit()

    def action_jump_visit(self, delta: int) -> None:
        playback = self.bridge.playback
        if playback is not None:
            current = playback.current_visit()
            playback.playing = False
            if delta < 0 and current >= 0 and not playback.at_visit_start(current):
                delta = 0  # from inside a visit, [ goes back to its start (as "previous" does in a player)
            playback.jump_visit(max(0, current + delta))

    def action_seek(self, where: str) -> None:
        playback = self.bridge.playback
        if playback is not None:
            if where == "end":  # following: the live end, followed again
                playback.seek_end()
                return
            playback.playing = False
            playback.seek(0)

    def action_show_screen(self, name: str) -> None:
        self.switch_mode(name)

    def action_command_line(self) -> None:
        if isinstance(self.screen, ConsoleScreen):
            self.screen.open_command_line()

    def action_save_screenshot(self, name: str = "") -> None:
        """An SVG of the screen into $GPUTRAVEL_SCREENSHOT_DIR (default: the current folder)."""
        screen = self.screen
        label = name or (screen.SCREEN_NAME if isinstance(screen, ConsoleScreen) else "help")
        folder = Path(os.environ.get("GPUTRAVEL_SCREENSHOT_DIR", "."))
        folder.mkdir(parents=True, exist_ok=True)

        def save() -> None:
            saved = self.save_screenshot(filename=f"console-{label}.svg", path=str(folder))
            self.notify(f"screenshot saved to {Path(saved).resolve()}", timeout=4, markup=False)

        self.clear_notifications()  # the picture shows the screen, not the console's last notice
        self.call_after_refresh(save)

    def action_toggle_log(self) -> None:
        self.screen.toggle_class("-hide-log")

    def action_verify_ledger(self) -> None:
        self.switch_mode("ledger")
        self.call_after_refresh(self._verify_on_ledger)

    def _verify_on_ledger(self) -> None:
        if isinstance(self.screen, LedgerScreen):
            self.screen.verify()

    def action_run_bench(self, name: str) -> None:
        if self.readonly:
            self.notify("read-only console: benchmarks are not started from here", severity="warning")
            return
        self.switch_mode("bench")

        def go() -> None:
            if isinstance(self.screen, BenchScreen):
                self.screen.action_run_bench(name)

        self.call_after_refresh(go)

def make_app(*, engine_factory: Callable[[], Any] | None = None,
             replay: Recording | FleetRecording | Path | None = None,
             theme: str = "dark", readonly: bool = False, record: Path | bool = True, telemetry_interval: float = 1.0,
             sampler: Sampler | None = None, bench_runner: BenchRunner | None = None,
             follow: bool = False, breakpoints: tuple[str, ...] = (), gpus: int = 0,
             attach: Path | None = None, launcher: Launcher | None = None,
             nodes: tuple[Path, ...] = ()) -> GpuTravelConsole:
    """The app factory (tests pass a small engine factory or a recording). ``replay``: a recording, or a fleet
    run folder (``gputravel run --gpus N --out DIR``: its ranks' recordings, merged); ``gpus``: the fleet being
    started there (followed before its ranks have written anything); ``nodes``: a fleet node's folder, the other
    nodes' folders whose ranks merge with its own (``--node-folder``)."""
    if isinstance(replay, Path):
        fleet = is_fleet_folder(replay) or (gpus > 1 and follow and replay.is_dir())
        if nodes and not fleet:
            raise ConfigError(f"--node-folder: {replay} is not a fleet's folder")
        replay = (FleetRecording(replay, follow=follow, gpus=gpus, nodes=nodes) if fleet
                  else load_recording(replay))
    return GpuTravelConsole(engine_factory=engine_factory, replay=replay, theme=theme, readonly=readonly,
                            record=record, telemetry_interval=telemetry_interval, sampler=sampler,
                            bench_runner=bench_runner, follow=follow, breakpoints=breakpoints, attach=attach,
                            launcher=launcher)


def _watch_fleet(settings: Any, *, gpus: int, theme: str) -> None:
    from gputravel.console.tui.fleet_console import watch_fleet

    watch_fleet(settings, gpus=gpus, make_app=make_app, theme=theme)


def _console_cli() -> typer.Typer:
    """``gputravel-console``'s typer app: the ``console`` command (``console/cli/commands/console.py``) given this
    module's app factory (looked up when a run starts, so a test may stand in for it)."""
    from gputravel.console.cli.commands import console as console_command

    app = typer.Typer(add_completion=True, pretty_exceptions_enable=False)
    console_command.register(app, make_app=lambda **kw: make_app(**kw), watch_fleet=_watch_fleet)
    return app


cli = _console_cli()


def main() -> None:
    """Entry point of ``gputravel-console``."""
    try:
        cli(standalone_mode=True)
    except GpuTravelError as exc:
        typer.echo(f"error: {exc}", err=True)  # plain text: no markup to eat "[bpe]"
        raise SystemExit(exc.exit_code) from None


if __name__ == "__main__":
    main()
