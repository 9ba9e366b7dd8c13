"""``gputravel plan``: predict a run's transfer and training time on both data paths (the model is ``core.planner``).

The model is fitted on measured runs: files (outputs of ``bench travel --json`` and/or ``bench provision
--json``), or without them the calibration cached under the user cache dir
(``<cache>/gputravel/plan-calibration.json``) when it was measured on this machine, else a short calibration
(two small travel studies, about a minute) that is then cached; ``recalibrate`` forces one.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gputravel.core import fleetplan, planner
from gputravel.core.bench.travel import ProgressFn, RunFn, machine_info, study
from gputravel.core.errors import ConfigError

__all__ = ["CALIBRATION", "CALIBRATION_VERSION", "cache_path", "calibrate", "load_calibration", "load_samples",
           "plan"]

CALIBRATION_VERSION = 1
#: The calibration: two datasets (2 and 8 MiB per holder), each with a small buffer and an uncapped one,
#: so both the number of visits and the bytes moved vary between runs.
CALIBRATION: tuple[tuple[float, list[float | None]], ...] = ((2.0, [0.5, None]), (8.0, [2.0, None]))


def _quiet(text: str) -> None:
    return None


def cache_path() -> Path:
    """Where the calibration is cached (the user cache dir)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("gputravel")) / "plan-calibration.json"


def _machine_key(info: dict[str, Any]) -> dict[str, Any]:
    return {k: info.get(k) for k in ("cores", "platform", "torch", "cuda")}


def calibrate(*, run: RunFn, say: Callable[[str], None] = _quiet,
              on_progress: ProgressFn | None = None) -> dict[str, Any]:
    """Measure the calibration: the travel studies of ``CALIBRATION`` on this machine."""
    studies = []
    with tempfile.TemporaryDirectory(prefix="gputravel-plan-") as tmp:
        for i, (holder_mib, buffers) in enumerate(CALIBRATION):
            say(f"calibrating {i + 1}/{len(CALIBRATION)}: {holder_mib:g} MiB per holder, buffers "
                f"{', '.join('uncapped' if b is None else f'{b:g} MiB' for b in buffers)}")
            studies.append(study(buffers, workdir=Path(tmp) / f"s{i}", dataset_mib=holder_mib, run=run,
                                 on_progress=on_progress))
    return {"benchmark": "calibration", "version": CALIBRATION_VERSION, "created": time.time(),
            "machine": machine_info(), "studies": studies}


def load_calibration(*, recalibrate: bool, run: RunFn, say: Callable[[str], None] = _quiet,
                     on_progress: ProgressFn | None = None) -> tuple[dict[str, Any], str]:
    """The cached calibration if it fits this machine, else a fresh one (cached); and where it came from."""
    path = cache_path()
    here = _machine_key(machine_info())
    if not recalibrate and path.exists():
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            doc = {}
        if doc.get("version") == CALIBRATION_VERSION and _machine_key(doc.get("machine", {})) == here:
            age_h = (time.time() - float(doc.get("created", 0))) / 3600
            return doc, f"cached calibration {path} ({age_h:,.1f} h old; --recalibrate to measure again)"
    doc = calibrate(run=run, say=say, on_progress=on_progress)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc) + "\n")
        where = f"calibration measured now, cached in {path}"
    except OSError as exc:
        where = f"calibration measured now (not cached: {exc})"
    return doc, where


def load_samples(files: Sequence[Path]) -> list[planner.Sample]:
    """The measured runs in benchmark JSON files; a file that is not one is a ``ConfigError`` naming it."""
    samples: list[planner.Sample] = []
    for f in files:
        try:
            doc = json.loads(Path(f).read_text())
        except OSError as exc:
            raise ConfigError(f"--from {f}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ConfigError(f"--from {f}: not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"--from {f}: not a benchmark JSON document")
        samples.extend(planner.samples_from_report(doc, source=f"{Path(f).name}:"))
    return samples


def _load_fleet_samples(files: Sequence[Path]) -> list[fleetplan.FleetSample]:
    out: list[fleetplan.FleetSample] = []
    for f in files:
        out.extend(fleetplan.fleet_samples_from_report(json.loads(Path(f).read_text()), source=f"{Path(f).name}:"))
    return out


def plan(holder_bytes: list[int], *, buffer_mib: float, from_files: Sequence[Path] = (), gbps: float | None = None,
         steps_per_mib: float | None = None, rounds: int = 1, recalibrate: bool = False, run: RunFn,
         say: Callable[[str], None] = _quiet, on_progress: ProgressFn | None = None, gpus: int = 1,
         fleet_variant: str = "secure_pipelined", steps_per_visit: int = 20) -> dict[str, Any]:
    """Fit the model on ``from_files`` (or the calibration) and predict a run over ``holder_bytes``;
    returns the JSON-able result (``command: plan``). ``run`` is only used to measure a calibration.
    With ``gpus > 1`` it also predicts the fleet's wall time; the all-reduce term is fitted on the
    ``bench fleet --json`` documents among ``from_files`` (the other terms come from the travel runs)."""
    samples = load_samples(from_files) if from_files else []
    if samples:
        source = ", ".join(str(f) for f in from_files)
    else:
        doc, source = load_calibration(recalibrate=recalibrate, run=run, say=say, on_progress=on_progress)
        samples = planner.samples_from_report(doc)
    model = planner.fit_model(samples)
    prediction = planner.predict(model, holder_bytes, buffer_bytes=int(buffer_mib * planner.MIB),
                                 steps_per_mib=steps_per_mib, rounds=rounds, gbps=gbps)
    result = {"command": "plan", "holder_bytes": holder_bytes, "buffer_mib": buffer_mib, "source": source,
              "prediction": prediction, "model": model.to_dict()}
    if gpus > 1:
        allreduce = fleetplan.fit_allreduce(_load_fleet_samples(from_files), variant=fleet_variant)
        result["fleet"] = {
            "prediction": fleetplan.predict_fleet(model, allreduce, holder_bytes, gpus=gpus,
                                                buffer_bytes=int(buffer_mib * planner.MIB),
                                                steps_per_visit=steps_per_visit, rounds=rounds),
            "one_gpu": fleetplan.predict_fleet(model, allreduce, holder_bytes, gpus=1,
                                             buffer_bytes=int(buffer_mib * planner.MIB),
                                             steps_per_visit=steps_per_visit, rounds=rounds),
            "allreduce": allreduce.to_dict(), "variant": fleet_variant}
    return result
