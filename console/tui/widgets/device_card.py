"""The SIM card of one fleet GPU: its device, attestation, epoch, where it is and what it moved, from its events;
then its device's own counters, from the telemetry its rank sampled.

A fleet's emulated devices live in the torchrun ranks' processes, so the console draws their cards from what
each rank recorded: its events (:class:`~gputravel.console.view.model.DeviceView`) and its device's telemetry
frames (:class:`DeviceCounters`: the last SIM sample, its PCIe-equivalent history, the phase it was taken in).
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import RenderResult
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from gputravel.console.tui.widgets.gpu_card import pcie_line
from gputravel.console.tui.widgets.phase_timeline import receipt
from gputravel.console.tui.widgets.text import bar, esc, fit, fmt_bytes, fmt_pct
from gputravel.console.view.model import DeviceView
from gputravel.core.telemetry.history import Point
from gputravel.core.telemetry.model import NA, GpuSample

STATUS_TOKENS = {"completed": "$success", "failed": "$error", "cancelled": "$warning", "running": "$accent",
                 "paused": "$warning"}


@dataclass(frozen=True, slots=True)
class DeviceCounters:
    """What a fleet GPU's rank sampled of its device: the last SIM sample, the PCIe RX (host to device)
    history oldest first with its peak, and the phase the last sample's interval ran in."""

    sample: GpuSample
    rx: tuple[float, ...] = ()
    rx_peak: Point | None = None
    phase: str | None = None


class DeviceCard(Widget):
    """One GPU of a fleet. Set ``view`` (a :class:`DeviceView`) and, once its rank has sampled its device,
    ``counters`` (a :class:`DeviceCounters`)."""

    DEFAULT_CSS = """
    DeviceCard {
        height: auto;
        width: 1fr;
        padding: 0 1;
        margin: 0 0 1 0;
        border: round $warning;
        border-title-color: $warning;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    view: reactive[DeviceView | None] = reactive(None, always_update=True, layout=True)
    counters: reactive[DeviceCounters | None] = reactive(None, layout=True)

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)

    def watch_view(self, view: DeviceView | None) -> None:
        if view is not None:
            self.border_title = esc(f"{view.label} · {view.device_id or 'device not attested yet'}"
                                    + (" · SIM" if view.sim else ""))
            self.set_class(view.status in ("completed", "failed", "cancelled"), "-ended")

    def render(self) -> RenderResult:
        d = self.view
        if d is None:
            return Content.from_markup("[$text-muted]waiting for the GPU's first event…[/]")
        badge = "[b reverse $warning] SIM [/]" if d.sim else "[b]HW[/b]"
        token = STATUS_TOKENS.get(d.status, "$foreground")
        where = "orchestrator" if d.at == "orchestrator" else f"holder {d.at}"
        phase = f" · [b]{esc(d.phase)}[/b]" if d.phase else ""
        planned = d.visits_planned or 0
        done = d.visits_done + d.visits_failed
        width = max(10, min(30, (self.content_size.width or 80) - 46))
        lines = [
            f"{badge}  [$text-muted]device {esc(d.device_id or '-')}[/]  attested {receipt(d.attested)}  "
            f"[{token}]{esc(d.status)}[/]",
            f"at      [b]◆ {esc(fit(where, 30))}[/b]{phase}   epoch [b]{d.epoch}[/b]   key "
            f"{esc((d.key_fp or '-')[:16])}",
            f"visits  {bar(done / planned if planned else None, width, token='$primary')} {d.visits_done} done"
            + (f", [$error]{d.visits_failed} failed[/]" if d.visits_failed else "") + f" of {planned or '?'}",
            f"xfer    {esc(fmt_bytes(d.provisioned_bytes))} ciphertext provisioned"
            + (f" · last {d.last_mb_s:,.1f} MB/s ({esc(d.last_transfer)}), as the engine timed it"
               if d.last_mb_s else ""),
        ]
        if d.loss_last is not None or d.tokens_per_s:
            lines.append("train   " + (f"loss {d.loss_last:.3f}" if d.loss_last is not None else "loss -")
                         + (f" · {d.tokens_per_s:,.0f} tokens/s" if d.tokens_per_s else ""))
        if d.error:
            lines.append(f"[$error]{esc(d.error)}[/]")
        lines.extend(self._counter_lines())
        return Content.from_markup("\n".join(lines))

    def _counter_lines(self) -> list[str]:
        """The device's own counters, as its rank sampled them (none before its first sample)."""
        c = self.counters
        if c is None:
            return []
        s = c.sample
        spark_w = max(8, min(40, (self.content_size.width or 80) - 60))
        # the phase the last sample's interval ran in (none: between phases, e.g. after the run ended)
        phase = f"[b]{esc(c.phase)}[/b]" if c.phase else "[$text-muted]between phases[/]"
        if s.mem_used is NA and s.rx_bytes is NA:  # not attested yet, or shut down: the sample says why
            return [f"sample  {phase} · [$text-muted]{esc(s.note or 'no counters')}[/]"]
        return [
            pcie_line("PCIe RX", c.rx, c.rx_peak, s.pcie_rx_bps, spark_w),
            f"sample  {phase} · {esc(fmt_bytes(s.rx_bytes))} in · {esc(fmt_bytes(s.mem_used))} in use · "
            f"util {fmt_pct(s.util_gpu)}",
        ]
