"""A fleet in the console: the N ranks' recordings of one ``gputravel run --gpus N`` merged into one view.

Every rank of a fleet records its own events to ``<out>/rank-R/recording.db`` (``console/cli/fleet_rank.py``).
:class:`FleetRecording` reads them all and merges their items by time, each tagged with its GPU (the rank);
:meth:`FleetRecording.more` reads what the ranks appended since (following a fleet that is still running).
:class:`FleetBridge` plays the merge like a recording (step, play, jump), folding each event into the
:class:`~gputravel.console.view.model.RunState` with its GPU, so the state keeps one run per GPU and their
merge. A fleet is driven by torchrun, never by the console's keys: following one, the console is read-only.

Each rank also records its own device's telemetry (``core/fleet/run.py``): the bridge keeps every GPU's
newest frame, numbers its SIM sample by its GPU (``sim-R``), pushes it into the history with the phase its
rank was in, and offers one merged frame (every GPU's SIM sample, then NVML's devices) to the GPU screen.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputravel.console.tui.bridge import Bridge
from gputravel.console.tui.playback import Playback
from gputravel.console.view.model import RunState
from gputravel.console.view.recorded_run import RecordedRun
from gputravel.core import events as ev
from gputravel.core.errors import GpuTravelError, RecordingError
from gputravel.core.phases import Phase
from gputravel.core.recording import RECORDING_VERSION, Player, RecordedItem, Recording, load_recording
from gputravel.core.runfolder import RunFolder
from gputravel.core.runfolder.nodes import fleet_nodes
from gputravel.core.telemetry import Sampler, TelemetryFrame

if TYPE_CHECKING:
    from textual.app import App

__all__ = ["FleetBridge", "FleetItem", "FleetRecording", "is_fleet_folder"]

def gpu_of(item: RecordedItem) -> int:
    """The GPU (torchrun rank) a merged item is of (0: an item of a plain recording)."""
    return item.gpu if isinstance(item, FleetItem) else 0


def is_fleet_folder(path: Path) -> bool:
    """A fleet run folder: ``rank-R/recording.db`` in it, or the ``fleet.json`` its ranks are about to read."""
    return RunFolder(path).looks_like_fleet()


@dataclass(frozen=True, slots=True)
class FleetItem(RecordedItem):
    """A recorded item of one rank, tagged with its GPU (the torchrun rank)."""

    gpu: int = 0


class FleetRecording:
    """The recordings of one fleet run folder, merged by time.

    ``follow``: the fleet is still running; a rank whose file is not there yet, or is being created, is read
    when it is (else such a folder is refused with :class:`RecordingError`). ``nodes``: a fleet over several
    nodes, the other nodes' folders (or copies) whose ranks merge with this node's (``--node-folder``).
    """

    def __init__(self, out: Path, *, follow: bool = False, gpus: int = 0, nodes: tuple[Path, ...] = ()) -> None:
        self.path = Path(out)
        if not self.path.is_dir():
            raise RecordingError(f"{self.path}: no such fleet run folder")
        self.nodes = fleet_nodes(self.path, nodes)  # a node folder given that does not fit: ConfigError, named
        self.follow = follow
        self.expected_gpus = gpus  # a fleet being started: its size before any rank has written
        self.last_seq: dict[int, int] = {}
        self.last_t: dict[int, float] = {}  # per rank, the time of its last item merged
        self.metas: dict[int, dict[str, Any]] = {}
        self.items: tuple[FleetItem, ...] = self.more()
        if not self.metas and not follow:
            raise RecordingError(f"{self.path}: no rank-R/recording.db in it (not a `gputravel run --gpus N` "
                                 "folder)")

    @property
    def gpus(self) -> int:
        """The fleet's size: as its ranks recorded it, else as its fleet.json says, else the ranks seen."""
        sizes = [int(m["gpus"]) for m in self.metas.values() if isinstance(m.get("gpus"), int)]
        if sizes:
            return max(sizes)
        try:
            return int(json.loads(RunFolder(self.path).fleet_config.read_text())["fleet"]["gpus"])
        except (OSError, ValueError, KeyError, TypeError):
            return max(self.expected_gpus, len(self.rank_files()))

    def rank_files(self) -> dict[int, Path]:
        """``rank -> <out>/rank-R/recording.db`` for the ranks that have one, in rank order."""
        return dict(fleet_nodes(self.path, self.nodes.given).recordings())

    @property
    def elsewhere(self) -> tuple[int, ...]:
        """The fleet's ranks that ran on other nodes whose folders were not given."""
        return self.nodes.elsewhere

    def more(self) -> tuple[FleetItem, ...]:
        """The items every rank appended since the last call, merged by time."""
        new: list[FleetItem] = []
        for rank, path in self.rank_files().items():
            try:
                rec = load_recording(path, since_seq=self.last_seq.get(rank, 0))
            except RecordingError:
                if self.follow:  # created but its meta not written yet: read it on the next call
                    continue
                raise
            self.metas[rank] = rec.meta
            if rec.items:
                self.last_seq[rank] = rec.items[-1].seq
            # a rank's items stay in the order it recorded them: a telemetry sample stamped a little before an
            # event recorded ahead of it is placed at that event's time (its own time never goes back)
            t = self.last_t.get(rank, float("-inf"))
            for i in rec.items:
                t = max(t, i.t)
                new.append(FleetItem(i.seq, t, i.kind, i.name, i.body, gpu=rank))
            self.last_t[rank] = t
        new.sort(key=lambda i: (i.t, i.gpu, i.seq))
        return tuple(new)

    @property
    def ledger(self) -> Path:
        """The fleet ledger rank 0 keeps (joins, per-step weights and digests, every rank ledger's head)."""
        return RunFolder(self.path).ledger

    def recording(self) -> Recording:
        """The merge as one recording (what the console's player walks)."""
        meta = {"version": RECORDING_VERSION, "source": "gputravel run --gpus", "gpus": self.gpus,
                "ledger": str(self.ledger), "ranks": {str(r): str(p) for r, p in self.rank_files().items()}}
        return Recording(self.path, meta, self.items)


class FleetBridge(Bridge):
    """Plays (or follows) a fleet's merged recordings: one run per GPU, and their merge. Its parts: the
    :class:`FleetRecording` (the ranks' files) and the :class:`~gputravel.console.tui.playback.Playback` of their
    merge (each run event folded into the run's state with its GPU; following reads what every rank appended)."""

    replay = True
    merges_gpus = True
    playback: Playback

    def __init__(self, app: App[Any], fleet: FleetRecording, *, speed: float = 8.0, follow: bool = False,
                 sampler: Sampler | None = None) -> None:
        super().__init__(app)
        self.fleet = fleet
        self.state = self.new_state()
        recorded = RecordedRun(fleet.recording(), new_state=self.new_state, gpu_of=gpu_of, more=self.more)
        self.playback = Playback(self, recorded, speed=speed, follow=follow, apply=self.apply_items)
        #: NVML while following a running fleet (its devices' own counters come from the ranks' recordings)
        self.sampler = sampler
        self.rank_frames: dict[int, TelemetryFrame] = {}  # each GPU's newest recorded frame, its SIM as sim-R
        self.local_frame: TelemetryFrame | None = None  # this machine's NVML, sampled while following

    def new_state(self) -> RunState:
        return RunState(fleet_size=self.fleet.gpus, breakpoints=set())

    @property
    def ledger_path(self) -> Path | None:
        return self.fleet.ledger

    @property
    def polls_telemetry(self) -> bool:
        """NVML on this machine while following a running fleet."""
        return self.follow

    @property
    def badges(self) -> tuple[str, ...]:
        fleet = f"FLEET ×{self.fleet.gpus}" + (" SIM" if self.state.sim else "")
        away = self.fleet.elsewhere
        if away:  # a node's folder: the other nodes' ranks are theirs (--node-folder merges them)
            return fleet, f"GPU {','.join(map(str, away))} ON OTHER NODES", self.playback.badge()
        return fleet, self.playback.badge()

    def more(self, player: Player) -> tuple[tuple[RecordedItem, ...], str | None]:
        """What the ranks appended since (a fleet's merge has no meta status)."""
        return self.fleet.more(), None  # a RecordingError: nothing read this time

    @property
    def running(self) -> bool:
        return self.playback.playing

    @property
    def paused(self) -> bool:
        return self.state.status == "paused" or not self.playback.playing

    def shown_status(self) -> str | None:
        return self.playback.recorded.status(follow=self.playback.follow)

    def step(self) -> bool:
        self.playback.step()
        return True

    def toggle_pause(self) -> str:
        return self.playback.toggle()

    def toggle_breakpoint(self, phase: Phase) -> bool:
        raise GpuTravelError("breakpoints belong to a live run")

    def cancel(self) -> None:
        self.playback.stop()

    def apply_items(self, items: Iterable[RecordedItem]) -> tuple[ev.Event, ...]:
        """Each played item with its GPU: events into the fleet's state (one run per GPU), frames merged."""
        events: list[ev.Event] = []
        for item in items:
            if item.kind == "telemetry":
                self.offer_rank_frame(gpu_of(item), item.frame())
                continue
            if item.kind != "event":
                continue
            event = item.event()
            self.state.apply(event, gpu=gpu_of(item))
            self.tracker(event)
            events.append(event)
        return tuple(events)

    def follow_more(self) -> bool:
        more = self.playback.recorded.read_more()
        for state in (self.state, self.playback.end_state):
            if state.fleet_size < self.fleet.gpus:
                state.fleet_size = self.fleet.gpus
        return more

    # --- telemetry: the ranks' recorded frames, merged --------------------------------------------
    def offer_rank_frame(self, gpu: int, frame: TelemetryFrame) -> None:
        """A frame GPU ``gpu``'s rank recorded: its SIM sample becomes ``sim-<gpu>`` (every rank's own device
        is index 0 where it runs). Its NVML sample (the rank's own CUDA device) counts only in a replay:
        following, this machine's NVML says the same of every device."""
        devices = tuple(replace(d, index=gpu) if d.sim else d for d in frame.devices)
        frame = frame.replace(devices=devices)
        self.rank_frames[gpu] = frame
        for device in devices:
            if device.sim or self.sampler is None:
                self.history.push_sample(device, t=frame.t, phase=frame.phase)
        self._offer_merged()

    def offer_frame(self, frame: TelemetryFrame) -> None:
        """This machine's NVML (following a fleet), drawn after the GPUs' own SIM samples."""
        self.local_frame = frame
        self.history.push(frame)
        self._offer_merged()

    def merged_frame(self) -> TelemetryFrame | None:
        """Every GPU's newest SIM sample in rank order, then NVML's devices: this machine's while following,
        else those the ranks recorded (each rank only its own device). NVML's status likewise."""
        ranks = [self.rank_frames[g] for g in sorted(self.rank_frames)]
        if not ranks and self.local_frame is None:
            return None
        sims = tuple(d for f in ranks for d in f.devices if d.sim)
        local = self.local_frame
        if self.sampler is not None:  # following: this machine's NVML (its first tick may not be in yet)
            nvml = tuple(d for d in local.devices if not d.sim) if local is not None else ()
            status = local.nvml if local is not None else ranks[0].nvml
        else:
            seen = {d.key: d for f in ranks for d in f.devices if not d.sim}
            nvml = tuple(seen[k] for k in sorted(seen))
            status = next((f.nvml for f in ranks if f.nvml.available), ranks[0].nvml)
        newest = max([f for f in (*ranks, local) if f is not None], key=lambda f: f.t)
        return TelemetryFrame(t=newest.t, source="fleet" if self.follow else "replay", nvml=status,
                              devices=sims + nvml, phase=newest.phase)

    def _offer_merged(self) -> None:
        merged = self.merged_frame()
        if merged is None:
            return
        self.latest_frame = merged
        if merged.devices:
            self.last_devices = merged
        if not self._frame_pending:  # coalesced, as Bridge.offer_frame does
            self._frame_pending = True
            self.app.post_message(self.TelemetryTicked())

    def reset_view(self, state: RunState) -> None:
        self.rank_frames = {}
        super().reset_view(state)

    async def poll_telemetry(self, interval: float) -> None:
        """This machine's NVML while following (each GPU's emulated device is sampled by its rank)."""
        if self.sampler is None:
            return
        while True:
            frame = await asyncio.to_thread(self.sampler.collect, phase=self.tracker.tag)
            self.offer_frame(frame)
            await asyncio.sleep(interval)

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
