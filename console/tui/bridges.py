"""Which bridge a console gets, from what it was started with (``make_app``'s arguments)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual.app import App

from gputravel.console.cli.launch import Launcher
from gputravel.console.tui.bridge import Bridge
from gputravel.console.tui.fleet_view import FleetBridge, FleetRecording
from gputravel.console.tui.live_bridge import LiveBridge
from gputravel.console.tui.replay_bridge import ReplayBridge
from gputravel.core.recording import Recording
from gputravel.core.telemetry import Sampler

__all__ = ["choose_bridge"]


def choose_bridge(app: App[Any], *, engine_factory: Callable[[], Any] | None, replay: Recording | FleetRecording | None,
                  record: Path | bool, sampler: Sampler | None, follow: bool, replay_speed: float,
                  attach: Path | None, launcher: Launcher | None) -> Bridge:
    """A fleet's recordings (merged; NVML while it runs), a run attached (``--attach``: followed, steered through
    its channel), a recording replayed, the console's own headless runs (a launcher), else a live run in-process
    (an engine factory)."""
    if isinstance(replay, FleetRecording):
        return FleetBridge(app, replay, follow=follow, speed=replay_speed,
                           sampler=(sampler or Sampler()) if follow else None)
    if replay is not None and attach is not None:
        from gputravel.console.tui.attach_bridge import AttachedBridge

        return AttachedBridge(app, replay, attach)
    if replay is not None:
        return ReplayBridge(app, replay, follow=follow, speed=replay_speed)
    if launcher is not None:
        from gputravel.console.tui.launch_bridge import LaunchBridge

        return LaunchBridge(app, launcher)
    if engine_factory is None:
        raise ValueError("make_app needs a launcher, an engine_factory or a recording to replay")
    return LiveBridge(app, engine_factory=engine_factory, sampler=sampler, record=record)
