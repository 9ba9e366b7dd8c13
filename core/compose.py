"""The composition root: the one place a run is built from its settings and driven to its end.

Every way a run starts comes through here: ``gputravel run`` and ``gputravel-console`` (the console's
``HolderSet`` supplies the links), each torchrun rank of a GPU fleet (``core.fleet.run.run_rank`` passes its
platform and engine), and the benches that time whole runs (``core.bench``). A run is built from:

* its settings (:class:`RunSettings`) and the run folder they name (``settings.json``, the checkpoint key);
* its holders' links: given by the caller, or local agent subprocesses started with the caller's
  ``Entries.holder_agent`` (the programs a run starts are named by the caller, the console: core never names
  a console or agents module);
* the device: the platform (emulated by default), started for the run and restarted by the engine;
* the checkpoint store (torch-free: it keeps chunks the device sealed) and the engine.

:func:`build_engine` builds (blocking); :func:`run` builds off the event loop, wires sinks, probes and
telemetry, drives the run and stops the device however it ends.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputravel.core.config import RunSettings
from gputravel.core.entries import Entries
from gputravel.core.errors import ConfigError, DataError
from gputravel.core.events import Event
from gputravel.core.platform.emulated import EmulatedPlatform
from gputravel.core.travel.engine import TravelEngine
from gputravel.core.travel.holders import HolderLink
from gputravel.core.travel.local_link import LocalHolderLink
from gputravel.core.travel.report import RunReport

if TYPE_CHECKING:
    from gputravel.core.telemetry import Sampler
    from gputravel.core.telemetry.model import TelemetryFrame
    from gputravel.core.travel.probes import EngineProbe

__all__ = ["Entries", "RunTelemetryPlan", "build_engine", "local_links", "resolve_holder_dirs", "resume_settings",
           "run", "tcp_data_host"]


@dataclass(frozen=True, kw_only=True)
class RunTelemetryPlan:
    """GPU telemetry sampled while the run goes: every ``interval`` seconds into ``record``; ``final``: one last
    frame with the final counters before the device stops (a fleet rank's recording ends with them)."""

    record: Callable[[TelemetryFrame], None]
    interval: float
    sampler: Sampler | None = None
    final: bool = False
    name: str = "run-telemetry"


def resolve_holder_dirs(settings: RunSettings) -> list[tuple[str, Path]]:
    """Holder folders: ``--data DIR`` (one subfolder per holder) or the embedded Shakespeare corpus."""
    from gputravel.core.training.corpus import fetch_corpus
    from gputravel.core.training.datacheck import validate_data_dir

    root = settings.data_dir if settings.data_dir is not None else fetch_corpus(holders=settings.holders)
    vocab, tok_hash = None, None
    if settings.init_from is not None and Path(settings.init_from).is_dir():
        from gputravel.core.training.hftokenizer import tokenizer_hash
        from gputravel.core.training.weights import read_config

        tok_hash = tokenizer_hash(Path(settings.init_from))  # the model's own tokenizer: its shards, no other's
        vocab = read_config(Path(settings.init_from)).vocab_size
    specs = validate_data_dir(Path(root), vocab=vocab, tokenizer_hash=tok_hash)
    if settings.data_dir is not None and len(specs) < settings.holders:
        raise DataError(f"{root} has {len(specs)} holder folders; --holders asks for {settings.holders}")
    return [(spec.name, spec.path) for spec in specs[: settings.holders]]


def local_links(settings: RunSettings, *, agent: Sequence[str]) -> list[HolderLink]:
    """One local agent subprocess per holder folder (``--transport local``), started as ``python *agent``."""
    return [LocalHolderLink(name, path, val_fraction=settings.val_fraction, agent=agent)
            for name, path in resolve_holder_dirs(settings)]


def _program_factory(settings: RunSettings) -> Callable[..., dict[str, Any]]:
    from gputravel.core.training.shapes import ModelConfig, preset_for_tokens
    from gputravel.core.training.tokens import vocab_size
    from gputravel.core.training.train_settings import TrainSettings

    def make(*, fmt: str, total_steps: int) -> dict[str, Any]:
        if fmt == "u32" and settings.init_from is None:
            raise ConfigError("the holders hold u32 shards (a tokenizer over 65,536 ids): train them with --init-from "
                              "the model folder whose tokenizer made them")
        model: ModelConfig = preset_for_tokens(settings.model, vocab_size(fmt if fmt != "u32" else "u16"))
        if settings.init_from is not None:  # pretrained weights: the file's shape, not the preset's
            from gputravel.core.training.weights import read_config

            model = read_config(settings.init_from)
            if fmt != "u32" and model.vocab_size < vocab_size(fmt) and not (fmt == "u16" and hasattr(model, "arch")):
                raise ConfigError(f"--init-from {settings.init_from}: its vocabulary of {model.vocab_size} does "
                                  f"not cover the holders' {fmt} tokens ({vocab_size(fmt)})")
        if settings.seq_len > model.block_size:
            raise ConfigError(f"seq-len {settings.seq_len} exceeds the model's block size {model.block_size}")
        targets = tuple(t.strip() for t in (settings.lora_targets or "").split(",") if t.strip())
        train = TrainSettings(steps_per_visit=settings.steps_per_visit, batch_size=settings.batch_size,
                              seq_len=settings.seq_len, lr=settings.lr, seed=settings.seed, total_steps=total_steps,
                              lora_rank=settings.lora_rank, lora_alpha=settings.lora_alpha, lora_targets=targets)
        lora = train.lora(model)
        if lora is not None:  # a target list that names no layer is refused before the device is configured
            from gputravel.core.training.shapes import param_shapes_of
            from gputravel.core.training.train_settings import lora_names

            lora_names(param_shapes_of(model), lora)
        source = str(settings.init_from) if settings.init_from is not None else f"preset:{settings.model}"
        return {"program": "gputravel.gpt2/v1", "model": model.to_dict(), "train": train.to_dict(), "source": source}

    return make


def resume_settings(out_dir: Path, **overrides: Any) -> RunSettings:
    """The settings a run in ``out_dir`` started with (``--resume`` continues exactly that run)."""
    from gputravel.core.runfolder import read_settings

    saved = read_settings(Path(out_dir))
    return RunSettings.from_dict(saved, out_dir=Path(out_dir), resume=True, **overrides)


def tcp_data_host(settings: RunSettings) -> str:
    """The address the device's TCP data port binds to, or ``""`` for no TCP listener at all: only holders on
    other hosts (an inventory on the direct path) need it; same-host holders reach the device's private Unix
    socket, so a same-host run offers other local users no port to reach."""
    return settings.data_host if settings.transport == "inventory" and settings.data_path == "direct" else ""


def build_engine(settings: RunSettings, *, links: Iterable[HolderLink] | None = None, entries: Entries | None = None,
                 platform_type: Callable[..., EmulatedPlatform] = EmulatedPlatform,
                 engine_type: Callable[..., TravelEngine] = TravelEngine, **engine_kw: Any) -> TravelEngine:
    """Blocking: prepare the run folder, start the device and wire the run; the caller awaits ``engine.run()``.

    ``links``: the holders (``None``: local agents, started with ``entries.holder_agent``).
    ``platform_type`` and ``engine_type`` (with its extra ``engine_kw``) are where a fleet rank plugs in its
    own device entry point and engine (``core/fleet``)."""
    from gputravel.core.runfolder import RunFolder, saved_settings, verify_run_folder
    from gputravel.core.training.store import CheckpointStore, load_or_create_key

    agent = (entries or Entries()).agent() if links is None else ()  # refused before anything is created
    folder = RunFolder(settings.out_dir)
    out = folder.path
    if folder.ledger.exists() and not settings.resume:
        raise ConfigError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    if settings.resume:
        verify_run_folder(folder)  # everything the resume builds on, before anything is started or appended
    out.mkdir(parents=True, exist_ok=True)
    if not settings.resume:
        folder.settings.write_text(json.dumps(saved_settings(settings), indent=2) + "\n")
    if links is None:
        links = local_links(settings, agent=agent)
    key = load_or_create_key(folder.checkpoint_key)
    store = CheckpointStore(folder.checkpoints, key, keep=settings.keep_checkpoints)
    platform = platform_type(folder.platform, device=settings.device, cc_mode=settings.cc_mode,
                             allow_fault_injection=settings.allow_fault_injection,
                             torch_threads=settings.torch_threads, data_host=tcp_data_host(settings),
                             cipher_engine=settings.cipher_engine, log_path=folder.device_log)
    handle = platform.start(buffer_bytes=settings.buffer_bytes)
    return engine_type(settings=settings, device=handle, links=list(links), out_dir=out, checkpoint_store=store,
                       make_program=_program_factory(settings),
                       restart_device=lambda: platform.start(buffer_bytes=settings.buffer_bytes), **engine_kw)


async def run(settings: RunSettings, *, links: Iterable[HolderLink] | None = None, entries: Entries | None = None,
              sinks: Iterable[Callable[[Event], None]] = (), probes: Iterable[EngineProbe] = (),
              on_engine: Callable[[TravelEngine], None] | None = None, telemetry: RunTelemetryPlan | None = None,
              platform_type: Callable[..., EmulatedPlatform] = EmulatedPlatform,
              engine_type: Callable[..., TravelEngine] = TravelEngine, **engine_kw: Any) -> RunReport:
    """Build one run off the event loop, drive it to its end and stop its device; returns the report
    (``RunReport``; ``to_json()`` is the JSON report).

    ``on_engine`` sees the engine once it is built, before it runs (its ``control`` for pause and step, its
    links for a recording's metadata); ``telemetry`` samples the device while the run goes."""
    from gputravel.core.session import Session

    session = Session(lambda: build_engine(settings, links=links, entries=entries, platform_type=platform_type,
                                           engine_type=engine_type, **engine_kw))
    engine = await asyncio.to_thread(session.build)
    sampling = None
    report: RunReport | None = None
    try:
        engine.bus.sinks.extend(sinks)
        engine.bus.probes.extend(probes)
        if on_engine is not None:
            on_engine(engine)
        if telemetry is not None:
            from gputravel.core.telemetry.recorded import TelemetryLoop

            sampling = TelemetryLoop(session, telemetry.record, interval=telemetry.interval,
                                     sampler=telemetry.sampler)
            engine.bus.sinks.append(sampling.tracker)
            sampling.start(name=telemetry.name)
        report = await engine.run()
        return report
    finally:
        if sampling is not None:
            assert telemetry is not None
            await sampling.stop(final=telemetry.final and report is not None)  # while the device answers
        await engine.aclose()
