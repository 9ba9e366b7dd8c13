"""Telemetry: NVML field mapping (through a fake NVML module, for this unit only), N/A handling, the
no-driver path of this machine, the emulated source's rates, phase-tagged history, the CLI."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from typer.testing import CliRunner

from gputravel.console.cli import main as cli
from gputravel.core import events as ev
from gputravel.core.telemetry import (
    NA,
    EmulatedSource,
    GpuSample,
    History,
    IntervalPhaseTracker,
    NvmlSource,
    PhaseTracker,
    Sampler,
    TelemetryFrame,
    TelemetryLoop,
    explain_init_error,
    nvml_query,
    rank_sampler,
)
from gputravel.core.telemetry.recorded import nvml_index_of


class FakeNvml:
    """A stand-in for the pynvml module: two devices; device 1 supports little (NotSupported everywhere)."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1

    def __init__(self, *, init_error: Exception | None = None, with_cc: bool = True) -> None:
        self.init_error = init_error
        self.inits = 0
        if not with_cc:  # older drivers: the confidential-compute functions do not exist
            self.nvmlSystemGetConfComputeState = None  # type: ignore[assignment]

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"550.54.15"

    def nvmlSystemGetNVMLVersion(self) -> str:
        return "12.550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    @staticmethod
    def _only0(h: int) -> None:
        if h != 0:
            raise pynvml.NVMLError_NotSupported()

    def nvmlDeviceGetName(self, h: int) -> str:
        return "NVIDIA H100 80GB HBM3" if h == 0 else "NVIDIA A10"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h:08d}"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        self._only0(h)
        return SimpleNamespace(gpu=87, memory=41)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(used=12 * 2**30, total=80 * 2**30, free=68 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        self._only0(h)
        return 312_500  # mW

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        self._only0(h)
        return 700_000

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == 0
        self._only0(h)
        return 47

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        self._only0(h)
        return {1: 1980, 2: 2619}[clock]

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:
        self._only0(h)
        return {0: 1000, 1: 250_000}[counter]  # KB/s

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        self._only0(h)
        return [SimpleNamespace(pid=4242, usedGpuMemory=3 * 2**30), SimpleNamespace(pid=4343, usedGpuMemory=None)]

    def nvmlSystemGetConfComputeState(self) -> Any:
        return SimpleNamespace(environment=2, ccFeature=1, devToolsMode=0)

    def nvmlSystemGetConfComputeGpusReadyState(self) -> int:
        return 1

    def nvmlDeviceGetConfComputeMemSizeInfo(self, h: int) -> Any:
        self._only0(h)
        return SimpleNamespace(protectedMemSizeKib=79 * 2**20, unprotectedMemSizeKib=2**20)


def test_nvml_fields_map_to_units_and_cc_state() -> None:
    source = NvmlSource(nvml=FakeNvml())
    status = source.open()
    assert status.available and status.device_count == 2
    assert status.driver_version == "550.54.15"  # C strings decoded
    h100, _ = source.sample()
    assert (h100.name, h100.uuid, h100.sim) == ("NVIDIA H100 80GB HBM3", "GPU-00000000", False)
    assert (h100.util_gpu, h100.util_mem) == (87, 41)
    assert (h100.mem_used, h100.mem_total) == (12 * 2**30, 80 * 2**30)
    assert h100.power_w == pytest.approx(312.5) and h100.power_limit_w == pytest.approx(700.0)
    assert (h100.temp_c, h100.sm_clock_mhz, h100.mem_clock_mhz) == (47, 1980, 2619)
    assert h100.pcie_tx_bps == 1000 * 1024 and h100.pcie_rx_bps == 250_000 * 1024  # KB/s -> bytes/s
    assert [p.pid for p in h100.processes] == [4242, 4343]
    assert h100.processes[0].used_bytes == 3 * 2**30 and h100.processes[1].used_bytes is NA
    cc = h100.cc
    assert (cc.feature, cc.devtools, cc.environment, cc.gpus_ready) == ("on", "off", "prod", True)
    assert cc.protected_mem_kib == 79 * 2**20


def test_unsupported_fields_read_na_and_print_na() -> None:
    _, a10 = NvmlSource(nvml=FakeNvml()).sample()
    assert a10.name == "NVIDIA A10" and a10.mem_total == 80 * 2**30
    for field in ("util_gpu", "power_w", "temp_c", "sm_clock_mhz", "pcie_tx_bps", "pcie_rx_bps"):
        assert getattr(a10, field) is NA, field
    assert a10.cc.protected_mem_kib is NA and a10.processes == ()
    assert f"{a10.power_w:.0f} W" == "N/A W" and str(a10.temp_c) == "N/A" and not a10.util_gpu
    assert a10.to_dict()["power_w"] is None  # JSON null


def test_missing_confidential_compute_functions_read_na() -> None:
    h100, _ = NvmlSource(nvml=FakeNvml(with_cc=False)).sample()
    assert h100.cc.feature is NA and h100.cc.devtools is NA
    assert h100.cc.gpus_ready is True  # the functions that exist still answer


def test_nvml_query_turns_nvml_errors_and_missing_functions_into_the_default() -> None:
    def boom() -> None:
        raise pynvml.NVMLError_GpuIsLost()

    assert nvml_query(boom) is NA
    assert nvml_query(None) is NA
    assert nvml_query(boom, default=0) == 0
    assert nvml_query(lambda x: x + 1, 1) == 2
    with pytest.raises(ZeroDivisionError):  # only NVML's own errors are "not available"
        nvml_query(lambda: 1 / 0)


def test_init_failure_is_a_status_with_a_reason_and_is_not_retried_every_tick() -> None:
    fake = FakeNvml(init_error=pynvml.NVMLError_DriverNotLoaded())
    source = NvmlSource(nvml=fake)
    assert source.sample() == ()
    assert source.open().reason == "NVIDIA driver not loaded" and not source.status.available
    source.sample()
    assert fake.inits == 1


def test_this_machine_without_a_driver_says_why() -> None:
    frame = Sampler().collect()
    if frame.nvml.available:
        pytest.skip("this machine has an NVIDIA driver")
    assert frame.source == "none" and frame.devices == ()
    assert frame.nvml.reason and "NVML" in frame.nvml.reason
    assert explain_init_error(pynvml.NVMLError_LibraryNotFound()).startswith("NVML library not found")


def test_telemetry_once_json_prints_source_and_nvml_state() -> None:
    result = CliRunner().invoke(cli.app, ["telemetry", "--once", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert set(out) >= {"source", "nvml", "devices", "t"}
    assert out["nvml"]["available"] is False or out["source"] == "nvml"
    if not out["nvml"]["available"]:
        assert out["nvml"]["reason"]


def test_telemetry_table_says_nvml_is_missing() -> None:
    result = CliRunner().invoke(cli.app, ["telemetry", "--count", "1", "--interval", "0.1"])
    assert result.exit_code == 0 and "NVML" in result.output


def test_emulated_source_turns_device_counters_into_rates_labelled_sim() -> None:
    clock = iter([10.0, 12.0])
    counters = iter([{"busy_s": 1.0, "counters": {"bytes_in": 0}, "memory_bytes": 5_000, "epoch": 1},
                     {"busy_s": 2.0, "counters": {"bytes_in": 4_000_000}, "memory_bytes": 6_000, "epoch": 2}])
    source = EmulatedSource(lambda: next(counters), info={"device_name": "CPU (emulated GPU memory)",
                                                          "cc_mode": "on", "buffer_bytes": 2**20},
                            clock=lambda: next(clock))
    first = source.sample()
    assert first.sim and first.util_gpu is NA and first.pcie_rx_bps is NA and first.mem_used == 5_000
    second = source.sample()
    assert second.util_gpu == 50.0  # 1 s busy in 2 s
    assert second.pcie_rx_bps == 2_000_000.0
    assert second.power_w is NA and second.temp_c is NA
    assert second.cc.feature == "on" and second.cc.environment == "sim" and second.cc.protected_mem_kib == 1024


def test_emulated_source_names_no_device_before_it_is_attested_then_its_id() -> None:
    stats = {"busy_s": 0.0, "counters": {"bytes_in": 0}, "memory_bytes": 1, "epoch": 1}
    source = EmulatedSource(lambda: stats)
    assert source.sample().uuid is NA  # NA itself, not the text "N/A" a device could be named
    source.info = {"device_id": "emu-gpu-0"}
    assert source.sample().uuid == "emu-gpu-0"


def test_emulated_source_degrades_when_the_device_is_gone() -> None:
    def gone() -> dict[str, Any]:
        raise RuntimeError("not connected")

    sample = EmulatedSource(gone).sample()
    assert sample.sim and sample.util_gpu is NA and "not answering" in (sample.note or "")
    assert EmulatedSource(None).sample().note == "no device service running"


def test_history_tags_each_sample_with_the_phase_so_a_spike_names_its_holder() -> None:
    tracker = PhaseTracker()
    history = History(capacity=3)
    rates = {"ATTEST": 0.0, "PROVISION": 9e8, "TRAIN": 1e3}
    for t, phase in enumerate(("ATTEST", "PROVISION", "TRAIN", "SCRUB")):
        tracker(ev.PhaseStarted(float(t), 0, "bob", phase, 1))
        sample = GpuSample(index=0, name="x", pcie_rx_bps=rates.get(phase, 5.0), util_gpu=NA)
        history.push(TelemetryFrame(t=float(t), source="nvml", nvml=None, devices=(sample,),  # type: ignore[arg-type]
                                    phase=tracker.tag))
        tracker(ev.PhaseCompleted(float(t), 0, "bob", phase, 1, 0.1))
    assert tracker.tag is None
    assert history.values("gpu-0", "pcie_rx") == [9e8, 1e3, 5.0]  # ring buffer of 3
    peak = history.peak("gpu-0", "pcie_rx")
    assert peak is not None and peak.phase == "bob · PROVISION"
    assert history.values("gpu-0", "util") == []  # NA is not history


def test_frames_round_trip_through_dicts() -> None:
    h100, a10 = NvmlSource(nvml=FakeNvml()).sample()
    status = NvmlSource(nvml=FakeNvml()).open()
    frame = TelemetryFrame(t=1.0, source="nvml", nvml=status, devices=(h100, a10), phase="alice · TRAIN")
    again = TelemetryFrame.from_dict(json.loads(json.dumps(frame.to_dict())))
    assert again == frame


def test_a_fleet_rank_samples_only_its_own_nvml_device() -> None:
    assert [d.index for d in NvmlSource(nvml=FakeNvml(), indices=(1,)).sample()] == [1]
    none = NvmlSource(nvml=FakeNvml(), indices=())
    assert none.sample() == () and none.status.available and none.status.device_count == 2
    assert nvml_index_of(1, visible="3,5") == 5 and nvml_index_of(1, visible="") == 1
    assert nvml_index_of(0, visible="GPU-8f3c") == 0  # UUIDs cannot be mapped without NVML: taken as is


def test_a_cpu_rank_samples_no_nvml_device_and_says_why_without_a_driver() -> None:
    sampler = rank_sampler("cpu")
    frame = sampler.collect()
    sampler.close()
    assert not [d for d in frame.devices if not d.sim]
    if not frame.nvml.available:
        assert frame.nvml.reason and "NVML" in frame.nvml.reason


def test_history_remembers_the_phase_of_each_devices_last_sample_even_without_values() -> None:
    history = History()
    history.push_sample(GpuSample(index=0, name="x", sim=True, mem_used=5), t=1.0, phase="bob · PROVISION")
    history.push_sample(GpuSample(index=0, name="x", sim=True, note="not answering"), t=2.0, phase="bob · TRAIN")
    assert history.last("sim-0") == (2.0, "bob · TRAIN") and history.last("sim-1") is None
    assert history.values("sim-0", "mem") == [5.0]
    history.clear()
    assert history.last("sim-0") is None


class Feed:
    """A device as the loop follows it: real counters in a dict the test moves on."""

    built = True
    finished = False

    def __init__(self) -> None:
        self.counters = {"busy_s": 0.0, "counters": {"bytes_in": 0}, "memory_bytes": 1_000, "epoch": 1}

    def device_stats(self) -> dict[str, Any]:
        return dict(self.counters)

    def device_info(self) -> dict[str, Any]:
        return {"device_id": "emu-gpu-7"}


async def test_telemetry_loop_records_a_frame_per_tick_and_a_final_one_on_request() -> None:
    feed, frames = Feed(), []
    loop = TelemetryLoop(feed, frames.append, interval=3600.0, sampler=rank_sampler("cpu"))
    loop.tracker(ev.PhaseStarted(1.0, 0, "bob", "PROVISION", 1))
    loop.start()
    for _ in range(200):
        if frames:
            break
        await asyncio.sleep(0.01)
    feed.counters = {**feed.counters, "counters": {"bytes_in": 4096}}
    await loop.stop(final=True)
    assert loop.frames == len(frames) == 2
    assert [f.phase for f in frames] == ["bob · PROVISION", "bob · PROVISION"]
    assert [d.rx_bytes for f in frames for d in f.devices if d.sim] == [0, 4096]
    assert all(d.uuid == "emu-gpu-7" for f in frames for d in f.devices if d.sim)


def test_interval_tracker_tags_a_sample_with_the_data_phase_its_interval_saw() -> None:
    tracker = IntervalPhaseTracker()
    tracker(ev.PhaseStarted(1.0, 0, "bob", "PROVISION", 1))
    tracker(ev.PhaseCompleted(1.5, 0, "bob", "PROVISION", 1, 0.5))
    tracker(ev.PhaseStarted(1.6, 0, "bob", "TRAIN", 1))
    assert tracker.tag == "bob · PROVISION"  # the transfer that ended inside the interval, not the TRAIN now
    assert tracker.tag == "bob · TRAIN"
