"""``gputravel telemetry``: what the GPU says right now, like ``nvitop --once``.

Without a driver it prints why (``nvml.available`` false and a ``reason``) and exits 0: a machine
without a GPU is a state, not an error.

It reads NVML only. The emulated GPU's counters (labelled SIM) exist only while a run's device service is
alive, and only that run's orchestrator reads them: ``gputravel-console`` shows them live on its GPU screen,
and ``gputravel run`` records them into the run's recording (``gputravel-console --replay`` shows them).
"""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gputravel.core.telemetry import NA, NAType, Sampler, TelemetryFrame
from gputravel.core.telemetry.model import Num

#: Said when there is nothing to show: where the emulated GPU's counters are to be found instead.
NO_DEVICES = ("no devices to show. The emulated GPU's SIM counters exist only while a run's device service is "
              "alive and are not read here: gputravel-console shows them live (GPU screen), and gputravel run "
              "records them for gputravel-console --replay.")


def _mib(value: Num) -> str:
    return "N/A" if isinstance(value, NAType) else f"{float(value) / 2**20:,.0f} MiB"


def _rate(value: Num) -> str:
    return "N/A" if isinstance(value, NAType) else f"{float(value) / 1e6:,.1f} MB/s"


def render_frame(console: Console, frame: TelemetryFrame) -> None:
    status = frame.nvml
    if status.available:
        console.print(f"[bold]NVML[/] driver {status.driver_version} · NVML {status.nvml_version} · "
                      f"{status.device_count} device(s)")
    else:
        console.print(f"[bold]NVML[/] [yellow]not available[/]: {escape(str(status.reason))}")
    if not frame.devices:
        console.print(f"[dim]{NO_DEVICES}[/]")
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("#", "name", "util", "memory", "power", "temp", "sm/mem MHz", "PCIe TX", "PCIe RX", "CC"):
        table.add_column(col, no_wrap=True)
    for d in frame.devices:
        table.add_row(
            f"{d.index}{' SIM' if d.sim else ''}", d.name, f"{d.util_gpu:.0f}%" if d.util_gpu is not NA else "N/A",
            f"{_mib(d.mem_used)} / {_mib(d.mem_total)}", f"{d.power_w:.0f} / {d.power_limit_w:.0f} W",
            f"{d.temp_c}°C" if d.temp_c is not NA else "N/A", f"{d.sm_clock_mhz} / {d.mem_clock_mhz}",
            _rate(d.pcie_tx_bps), _rate(d.pcie_rx_bps),
            f"{d.cc.feature} (devtools {d.cc.devtools}, {d.cc.environment})")
    console.print(table)


def register(app: typer.Typer) -> None:
    @app.command("telemetry")
    def telemetry_cmd(
        once: Annotated[bool, typer.Option("--once", help="Print one sample and exit.")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="JSON (one object per line when repeating).")] = False,
        interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between samples.")] = 1.0,
        count: Annotated[int, typer.Option("--count", min=0, help="Stop after N samples (0: until Ctrl-C).")] = 0,
    ) -> None:
        """GPU telemetry through NVML: utilisation, memory, power, clocks, PCIe, confidential-computing state.

        NVML only. The emulated GPU's SIM counters exist only while a run's device is alive: see them in
        gputravel-console, or in the recording gputravel run writes.
        """
        sampler = Sampler()
        console = Console()
        n = 0
        said: tuple[object, ...] | None = None  # what was said of a frame with no devices: said once, not each time
        try:
            while True:
                frame = sampler.collect()
                if as_json:
                    typer.echo(json.dumps(frame.to_dict(), indent=None if not once else 2))
                elif frame.devices:
                    render_frame(console, frame)
                    said = None
                elif said != (nothing := (frame.nvml.available, frame.nvml.reason, frame.nvml.device_count)):
                    render_frame(console, frame)
                    if not once and count != 1:
                        console.print(f"[dim]waiting: a sample every {interval:g} s, printed when a device "
                                      f"appears or NVML's answer changes (Ctrl-C stops)[/]")
                    said = nothing
                n += 1
                if once or (count and n >= count):
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
        finally:
            sampler.close()
