"""The GPU screen: the emulated device's SIM card (a fleet: one per GPU), then one card per NVML device."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.css.query import NoMatches
from textual.widget import Widget
from textual.widgets import Static

from gputravel.console.tui.screens.base import ConsoleScreen
from gputravel.console.tui.widgets.device_card import DeviceCard, DeviceCounters
from gputravel.console.tui.widgets.gpu_card import GpuCard, GpuTrend
from gputravel.console.tui.widgets.text import esc
from gputravel.console.view.model import RunState
from gputravel.core.telemetry import History, TelemetryFrame


def card_id(key: str) -> str:
    """``gpu-0`` -> ``gpu-card-0``; ``sim-0`` -> ``gpu-card-sim-0``."""
    return "gpu-card-" + key.removeprefix("gpu-")


class GpuScreen(ConsoleScreen):
    """Live telemetry. N/A where the source cannot say; SIM where the device is emulated."""

    SCREEN_NAME = "gpu"
    BINDINGS = [Binding("down,j", "scroll_cards(1)", "Scroll down", show=False),
                Binding("up,k", "scroll_cards(-1)", "Scroll up", show=False),
                Binding("pagedown", "scroll_cards(2)", "Page down", show=False),
                Binding("pageup", "scroll_cards(-2)", "Page up", show=False)]
    _drawn: TelemetryFrame | None = None  # the frame on screen: a state change alone does not redraw it
    HELP = ("Cards follow nvitop: utilisation and memory bars, power, temperature, clocks, PCIe TX/RX history "
            "with its peak and the protocol phase it happened in, and the confidential-computing state. "
            "Without an NVIDIA driver the header says why; the emulated GPU's real counters show as SIM, first. "
            "Many cards scroll: arrows or j/k a line, page up / page down a page, or the mouse wheel.")
    FLEET_HELP = ("A fleet has one SIM card per GPU (its device, attestation, epoch, where it is, what it "
                  "provisioned; then its device's own counters as its rank sampled them: PCIe RX history, bytes "
                  "in, memory in use, the phase of the last sample), drawn from its rank's recording, then "
                  "NVML's cards: this machine's while the fleet runs, the ranks' own devices in a replay.")

    def compose_body(self) -> Iterable[Widget]:
        yield Static("[$text-muted]waiting for telemetry…[/]", id="nvml-status")
        yield VerticalScroll(id="gpu-cards")

    _state: RunState | None = None

    def show_state(self, state: RunState, context: dict[str, Any]) -> None:
        self._state = state
        if state.fleet:
            self._draw_fleet(state, context)
        frame = context.get("frame")
        history = context.get("history")
        if frame is not None and history is not None and frame is not self._drawn:  # a new frame only
            self._draw_telemetry(frame, history, context.get("last_devices"))
            self._drawn = frame

    def show_telemetry(self, frame: TelemetryFrame, history: History, *,
                       last_devices: TelemetryFrame | None = None) -> None:
        """Draw a telemetry frame (skipped while the screen's widgets are not there, as in ``show``)."""
        try:
            self._draw_telemetry(frame, history, last_devices)
            self._drawn = frame
        except NoMatches:
            pass

    def action_scroll_cards(self, lines: int) -> None:
        """Many cards (a fleet's GPUs, NVML's devices) scroll: arrows and j/k a line, page keys a page."""
        box = self.query_one("#gpu-cards", VerticalScroll)
        step = lines if abs(lines) == 1 else (1 if lines > 0 else -1) * max(1, box.size.height - 1)
        box.scroll_to(y=max(0, box.scroll_y + step), animate=False)

    def _draw_fleet(self, state: RunState, context: dict[str, Any]) -> None:
        """One SIM card per GPU of a fleet, first, in rank order (from the ranks' events)."""
        frame = context.get("frame")
        history = context.get("history")
        if frame is None:
            where = ("no telemetry played yet (each rank samples its device once a second)"
                     if not context.get("live_fleet") else "waiting for telemetry…")
            self.query_one("#nvml-status", Static).update(f"{_fleet_head(state)}\n[$text-muted]{esc(where)}[/]")
        box = self.query_one("#gpu-cards", VerticalScroll)
        for none in box.query("#gpu-none"):  # drawn by a telemetry tick that came before the first state
            none.remove()
        previous: DeviceCard | None = None
        for view in state.devices():
            wid = f"device-card-{view.gpu}"
            found = box.query(f"#{wid}")
            card = found.first(DeviceCard) if found else None
            if card is None:
                card = DeviceCard(id=wid)
                if previous is not None:
                    box.mount(card, after=previous)
                elif box.children:
                    box.mount(card, before=0)
                else:
                    box.mount(card)
            card.view = view
            card.counters = _counters(view.gpu, frame, history)
            previous = card

    def _draw_telemetry(self, frame: TelemetryFrame, history: History,
                        last_devices: TelemetryFrame | None = None) -> None:
        status = frame.nvml
        if status.available:
            head = (f"[b]NVML[/b] [$success]available[/] · driver {esc(status.driver_version)} · "
                    f"{status.device_count} device(s)")
        else:
            head = f"[b]NVML[/b] [$warning]not available[/]: {esc(status.reason)}"
        tag = f" · now [b]{esc(frame.phase)}[/b]" if frame.phase else ""
        state = self._state
        if state is not None and state.fleet:  # the fleet's cards first, then what NVML says of this machine
            self.query_one("#nvml-status", Static).update(f"{_fleet_head(state)}\n{head}")
        else:
            self.query_one("#nvml-status", Static).update(f"{head}\n[b]source[/b] {esc(frame.source)}{tag}")
        box = self.query_one("#gpu-cards", VerticalScroll)
        live = {card_id(d.key) for d in frame.devices}
        devices = frame.devices
        if state is not None and state.fleet:  # each GPU's SIM counters go on its own card; NVML's below
            for card in box.query(DeviceCard):
                if card.view is not None:
                    card.counters = _counters(card.view.gpu, frame, history)
            devices = tuple(d for d in devices if not d.sim)
            if not devices:
                return  # NVML found no device (the header says why)
            live = {card_id(d.key) for d in devices}
        elif not devices and last_devices is not None and state is not None and state.ended:
            devices = last_devices.devices  # the run is over: its device's last sample, marked as such
        kept = bool(devices) and devices is not frame.devices and not (state is not None and state.fleet)
        if not devices:
            text = ("[$text-muted]no devices: the emulated GPU's SIM card appears once a run has attested its "
                    "device (r or space)[/]")
            if state is not None and state.ended and state.attested:
                text = (f"[$text-muted]the run {esc(state.status)}: its device {esc(state.device_id or '')} was "
                        "shut down with it; the card keeps its last sample[/]")
            elif state is not None and state.attested:
                text = "[$text-muted]waiting for the device's counters…[/]"
            _note(box, text)
            return
        if not kept:
            for none in box.query("#gpu-none"):
                none.remove()
        for device in sorted(devices, key=lambda d: not d.sim):  # the run's own (emulated) device first
            wid = card_id(device.key)
            found = box.query(f"#{wid}")
            existing = found.first(GpuCard) if found else None
            gpu_card = existing if existing is not None else GpuCard(id=wid)
            if existing is None:
                hardware = [c for c in box.query(GpuCard) if c.snapshot is not None and not c.snapshot.sim]
                if device.sim and hardware:  # NVML's cards came first: the SIM card goes above them
                    box.mount(gpu_card, before=hardware[0])
                else:
                    box.mount(gpu_card)
            gpu_card.trend = GpuTrend(
                series={m: tuple(history.values(device.key, m)) for m in ("pcie_tx", "pcie_rx", "util")},
                peaks={m: history.peak(device.key, m) for m in ("pcie_tx", "pcie_rx")},
                measured=_measured(state) if device.sim else "")
            gpu_card.snapshot = device
            gpu_card.stale = wid not in live
        if kept and state is not None:
            text = (f"[$text-muted]the run {esc(state.status)}: its device {esc(state.device_id or '')} was shut "
                    "down with it; the card keeps its last sample[/]")
            _note(box, text)


def _fleet_head(state: RunState) -> str:
    return (f"[b]fleet[/b] {len(state.gpus)}/{state.fleet_size or len(state.gpus)} GPUs · one SIM card per device: "
            "its events and counters, from its rank's recording")


def _counters(gpu: int, frame: TelemetryFrame | None, history: History | None) -> DeviceCounters | None:
    """GPU ``gpu``'s own counters from the fleet's merged frame (its SIM sample is ``sim-<gpu>``)."""
    if frame is None or history is None:
        return None
    sample = next((d for d in frame.devices if d.sim and d.index == gpu), None)
    if sample is None:
        return None
    last = history.last(sample.key)
    return DeviceCounters(sample=sample, rx=tuple(history.values(sample.key, "pcie_rx")),
                          rx_peak=history.peak(sample.key, "pcie_rx"), phase=last[1] if last else None)


def _note(box: VerticalScroll, text: str) -> None:
    """The line above the cards that says why there is no live card."""
    found = box.query("#gpu-none")
    if found:
        found.first(Static).update(text)
    elif box.children:
        box.mount(Static(text, id="gpu-none"), before=0)
    else:
        box.mount(Static(text, id="gpu-none"))


def _measured(state: RunState | None) -> str:
    """The provisioning rate the engine measured over the last visit's transfer (the PCIe counters are averages
    over one sampling interval, so a short transfer reads far below it)."""
    if state is None:
        return ""
    for v in reversed(state.visits.values()):
        if v.mb_s:
            return f"provisioned at {v.mb_s:,.0f} MB/s (visit {v.visit + 1}, {v.holder}), as the engine timed it"
    return ""
