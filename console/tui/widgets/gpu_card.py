"""An nvitop-grade card for one GPU: bars, power, temperature, clocks, PCIe history with peaks, CC state."""

from __future__ import annotations

from dataclasses import dataclass, field

from textual.app import RenderResult
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from gputravel.console.tui.widgets.text import bar, esc, fmt_bytes, fmt_num, fmt_pct, fmt_rate, spark
from gputravel.core.telemetry.history import Point
from gputravel.core.telemetry.model import NA, GpuSample, NAType, Num


@dataclass(frozen=True, slots=True)
class GpuTrend:
    """History for the card: values oldest first, and each metric's peak with the phase it ran in."""

    series: dict[str, tuple[float, ...]] = field(default_factory=dict)
    peaks: dict[str, Point | None] = field(default_factory=dict)
    measured: str = ""  # the engine's own timing of the last transfer, shown under the sampled PCIe lines


def _fraction(used: Num, total: Num) -> float | None:
    if isinstance(used, NAType) or isinstance(total, NAType) or not total:
        return None
    return float(used) / float(total)


def pcie_line(label: str, values: tuple[float, ...], peak: Point | None, current: object, width: int) -> str:
    """One PCIe direction: its history as a sparkline, the current rate, the peak and the phase it ran in."""
    peak_text = ""
    if peak is not None and peak.value > 0:
        # a rate averaged over one sampling interval, tagged with the phase that moved the bytes
        peak_text = f"  peak {fmt_rate(peak.value)} [$text-muted]avg[/]" + (
            f" [$accent]({esc(peak.phase)})[/]" if peak.phase else "")
    line = spark(values, width) if values else "[$text-disabled]no history[/]"
    return f"{label:<8}[$primary]{line}[/] {fmt_rate(current):>10}{peak_text}"


class GpuCard(Widget):
    """One device. Set ``snapshot`` (a :class:`GpuSample`) and ``trend``; fields the source lacks read N/A."""

    DEFAULT_CSS = """
    GpuCard {
        height: auto;
        width: 1fr;
        padding: 0 1;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    snapshot: reactive[GpuSample | None] = reactive(None)
    trend: reactive[GpuTrend] = reactive(GpuTrend, always_update=True)
    stale: reactive[bool] = reactive(False)  # the device is gone (shut down with its run): the last sample

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)

    def watch_snapshot(self, snapshot: GpuSample | None) -> None:
        self.set_class(snapshot is not None and snapshot.sim, "-sim")
        if snapshot is not None:
            self.border_title = esc(f"GPU {snapshot.index} · {snapshot.name}" + (" · SIM" if snapshot.sim else ""))

    def watch_stale(self, stale: bool) -> None:
        self.set_class(stale, "-stale")
        self.border_subtitle = "last sample · device shut down" if stale else ""

    def _pcie(self, label: str, metric: str, current: object, width: int) -> str:
        return pcie_line(label, self.trend.series.get(metric, ()), self.trend.peaks.get(metric), current, width)

    def render(self) -> RenderResult:
        s = self.snapshot
        if s is None:
            return Content.from_markup("[$text-muted]waiting for the first sample…[/]")
        width = max(10, min(40, (self.content_size.width or 80) - 40))
        spark_w = max(8, min(40, (self.content_size.width or 80) - 60))  # room for the peak and its phase
        util = None if isinstance(s.util_gpu, NAType) else float(s.util_gpu) / 100.0
        mem_frac = _fraction(s.mem_used, s.mem_total)
        badge = " [b reverse $warning] SIM [/]" if s.sim else ""
        lines = [
            f"{badge.strip() or '[b]NVML[/b]'}  [$text-muted]uuid {esc(s.uuid)}[/]",
            f"util    {bar(util, width)} {fmt_pct(s.util_gpu):>5}",
            f"memory  {bar(mem_frac, width)} {esc(fmt_bytes(s.mem_used))} / {esc(fmt_bytes(s.mem_total))}",
            f"power   {fmt_num(s.power_w, '.0f', ' W')} / {fmt_num(s.power_limit_w, '.0f', ' W')}   "
            f"temp {fmt_num(s.temp_c, '.0f', '°C')}   clocks SM {fmt_num(s.sm_clock_mhz)} / mem {fmt_num(s.mem_clock_mhz)} MHz",
            self._pcie("PCIe TX", "pcie_tx", s.pcie_tx_bps, spark_w),
            self._pcie("PCIe RX", "pcie_rx", s.pcie_rx_bps, spark_w),
        ]
        if self.trend.measured:
            lines.append(f"[$text-muted]        {esc(self.trend.measured)}[/]")
        cc = s.cc
        ready = "N/A" if cc.gpus_ready is NA else ("yes" if cc.gpus_ready else "no")
        cc_token = "$success" if cc.feature == "on" else "$warning" if cc.feature is not NA else "$text-muted"
        lines.append(f"CC      [{cc_token}]{esc(cc.feature)}[/] · devtools {esc(cc.devtools)} · env "
                     f"{esc(cc.environment)} · GPUs ready {ready} · protected "
                     f"{esc(fmt_bytes(NA if isinstance(cc.protected_mem_kib, NAType) else cc.protected_mem_kib * 1024))}")
        if s.processes:
            procs = ", ".join(f"{p.pid} {esc(p.name)} {esc(fmt_bytes(p.used_bytes))}" for p in s.processes[:4])
            lines.append(f"procs   {procs}")
        if s.note:
            lines.append(f"[$text-muted]{esc(s.note)}[/]")
        return Content.from_markup("\n".join(lines))
