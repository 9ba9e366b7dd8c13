"""``gputravel run``: the headless batch mode."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from gputravel.console.cli.options import (
    CcMode,
    CipherEngine,
    DataPathChoice,
    ModelPreset,
    PhaseChoice,
    TransportChoice,
)
from gputravel.console.cli.run_end import RunEnding, resume_hint
from gputravel.console.cli.run_options import (
    BUFFER_MIB_DEFAULT,
    CHUNK_KIB_DEFAULT,
    CHUNK_KIB_HELP,
    DATA_HOST_DEFAULT,
    DATA_HOST_HELP,
    DATA_PATH_DEFAULT,
    DATA_PATH_HELP,
    HOLDERS_FILE_HELP,
    ROUNDS_HELP,
    STEPS_PER_VISIT_DEFAULT,
    STEPS_PER_VISIT_HELP,
    TRANSPORT_DEFAULT,
    TRANSPORT_HELP,
    RunOptions,
    resolve_out_dir,
)
from gputravel.console.cli.run_report import EXIT_PARTIAL, render_report
from gputravel.console.cli.run_view import RunView
from gputravel.console.run_telemetry import TELEMETRY_INTERVAL_S
from gputravel.core import events as ev
from gputravel.core.config import RunSettings
from gputravel.core.errors import AttestationError, CancelledRunError, ConfigError, StorageError
from gputravel.core.runfolder import RUNS_DIR, RunClaim, RunFolder, reserve_status, running_marker

#: Exit code when the run finished but some visits failed (each is in the report and the ledger).

class HolderInjection(StrEnum):
    """``run --inject``: what holders attest made wrong in one way (core/travel/holder_attest.py)."""

    CVM_DEBUG = "cvm-debug"
    CVM_REPORT_DATA = "cvm-report-data"
    GPU_MEASUREMENT = "gpu-measurement"
    GPU_NONCE = "gpu-nonce"


class CvmKind(StrEnum):
    """``run --cvm-kind``: the orchestrator CVM's kind, what holders attest (core/travel/holder_attest.py)."""

    TDX = "tdx"
    SNP = "snp"
    AZURE_SNP = "azure-snp"


GPUS_HELP = ("Travelling GPUs: N > 1 runs a fleet, N devices each a rank of one torchrun job, gradients "
             "all-reduced over the secure ring (docs/fleet.md).")
CIPHER_ENGINE_HELP = ("Who opens provisioning chunks: gpu (AES-GCM kernels open ciphertext inside device memory; "
                      "in numba's simulator on a CPU-only machine, slow), cpu (cryptography on a host core), auto "
                      "(gpu where the buffer is on CUDA and numba-cuda sees the device, else cpu).")
#: the signals a headless run continues on: resume (to the next breakpoint) and step (one phase)
RESUME_SIGNAL, STEP_SIGNAL = signal.SIGUSR1, signal.SIGUSR2


def fresh_settings(out: Path | None, **options: Any) -> tuple[RunSettings, RunClaim]:
    """The settings of a new run, validated before anything is created, and its (not yet created) folder."""
    settings = RunSettings(out_dir=out or RUNS_DIR / "pending", **options)  # validates every option
    if settings.holders_file is not None:  # the inventory too: types, ranges, keys (agents/inventory.py)
        from gputravel.agents.inventory import load_inventory

        load_inventory(settings.holders_file)
    # runs/latest: the newest run started, --out ones too (`export latest` took an older run otherwise)
    folder = RunClaim(resolve_out_dir(out, resume=False, create=False), link_latest=True)
    # absolute: the report, the recording's ledger and the agents behind SSH (in their own home) name it
    return replace(settings, out_dir=folder.out.absolute()), folder


HOLDERS_PANEL, MODEL_PANEL, DATA_PANEL, FAULTS_PANEL, OUTPUT_PANEL = ("Holders", "Model and training", "Data path",
                                                                     "Control and faults", "Run folder and output")
FLEET_PANEL = "Fleet (--gpus N, torchrun)"


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run_cmd(
        holders: int | None = typer.Option(None, help="Number of holders (default: one per --data subfolder; "
                                           "without --data 3, the embedded corpus's comedies, tragedies, "
                                           "histories).", show_default=False, rich_help_panel=HOLDERS_PANEL),
        holders_file: Path | None = typer.Option(None, "--holders-file", help=HOLDERS_FILE_HELP,
                                                 rich_help_panel=HOLDERS_PANEL),
        transport: TransportChoice = typer.Option(TRANSPORT_DEFAULT, help=TRANSPORT_HELP,
                                                  rich_help_panel=HOLDERS_PANEL),
        data: Path | None = typer.Option(None, "--data", help="One subfolder per holder (.txt or llm.c .bin).",
                                         rich_help_panel=HOLDERS_PANEL),
        model: ModelPreset = typer.Option(ModelPreset.TINY, help="Model preset.", rich_help_panel=MODEL_PANEL),
        init_from: Path | None = typer.Option(None, "--init-from", rich_help_panel=MODEL_PANEL, help="Start from "
                                              "pretrained weights: llm.c's .bin, GPT-2 safetensors, or a Hugging Face "
                                              "folder (Llama, Qwen2, Mistral, GPT-2; the model's shape comes from it)."),
        lora_rank: int = typer.Option(0, "--lora-rank", min=0, rich_help_panel=MODEL_PANEL, help="Train LoRA "
                                      "adapters of this rank on the frozen base (0: the whole model)."),
        lora_alpha: float = typer.Option(0.0, "--lora-alpha", min=0.0, rich_help_panel=MODEL_PANEL,
                                         help="LoRA's alpha (scale alpha/rank; default: the rank)."),
        lora_targets: str | None = typer.Option(None, "--lora-targets", rich_help_panel=MODEL_PANEL,
                                                help="Comma-separated modules LoRA adapts (default: q_proj,k_proj,"
                                                "v_proj,o_proj; GPT-2: c_attn)."),
        rounds: int = typer.Option(2, help=ROUNDS_HELP, rich_help_panel=MODEL_PANEL),
        steps_per_visit: int = typer.Option(STEPS_PER_VISIT_DEFAULT, help=STEPS_PER_VISIT_HELP,
                                            rich_help_panel=MODEL_PANEL),
        batch_size: int = typer.Option(16, help="Sequences per training step.", rich_help_panel=MODEL_PANEL),
        seq_len: int = typer.Option(128, help="Tokens per sequence.", rich_help_panel=MODEL_PANEL),
        lr: float = typer.Option(3e-3, help="Learning rate (AdamW).", rich_help_panel=MODEL_PANEL),
        seed: int = typer.Option(1337, help="Seed of the model and the batches.", rich_help_panel=MODEL_PANEL),
        device: str | None = typer.Option(None, help="torch device for the emulated GPU (default: cuda if present).",
                                          rich_help_panel=MODEL_PANEL),
        data_path: DataPathChoice = typer.Option(DATA_PATH_DEFAULT, help=DATA_PATH_HELP, rich_help_panel=DATA_PANEL),
        data_host: str = typer.Option(DATA_HOST_DEFAULT, "--data-host", help=DATA_HOST_HELP,
                                      rich_help_panel=DATA_PANEL),
        buffer_mib: float = typer.Option(BUFFER_MIB_DEFAULT, help="GPU data buffer size (MiB); a bigger holder takes passes.",
                                         rich_help_panel=DATA_PANEL),
        chunk_kib: int = typer.Option(CHUNK_KIB_DEFAULT, help=CHUNK_KIB_HELP, rich_help_panel=DATA_PANEL),
        attest_prefetch: bool = typer.Option(True, "--attest-prefetch/--no-attest-prefetch",
                                             rich_help_panel=DATA_PANEL,
                                             help="The next holder attests while a visit trains, bound to the key "
                                                  "its window will get (default); off: each hand-off attests in "
                                                  "line (docs/performance.md)."),
        handoff_with_window: bool = typer.Option(True, "--handoff-with-window/--no-handoff-with-window",
                                                 rich_help_panel=DATA_PANEL,
                                                 help="A visit's first HANDOFF rides its window's request and the "
                                                      "device writes it on the holder's parked data connection "
                                                      "(default; needs --attest-prefetch); off: it crosses the "
                                                      "holder's SSH link after the window opens."),
        grant_at_completion: bool = typer.Option(True, "--grant-at-completion/--no-grant-at-completion",
                                                 rich_help_panel=DATA_PANEL,
                                                 help="The window's request that carries the HANDOFF is answered "
                                                      "when the window is complete and the holder's DONE is read "
                                                      "after, off the path (the default: measured faster); off: a "
                                                      "hand-off ends on DONE."),
        cipher_engine: CipherEngine = typer.Option(CipherEngine.AUTO, "--cipher-engine", help=CIPHER_ENGINE_HELP,
                                                   rich_help_panel=DATA_PANEL),
        cc_mode: CcMode = typer.Option(CcMode.ON, "--cc-mode", help="Mode the emulated GPU starts in (devtools "
                                       "fails attestation, as a real device in that mode would).",
                                       rich_help_panel=FAULTS_PANEL),
        break_before: list[PhaseChoice] = typer.Option([], "--break-before", case_sensitive=False,
                                                       help="Pause before this phase (repeatable).",
                                                       rich_help_panel=FAULTS_PANEL),
        start_paused: bool = typer.Option(False, "--start-paused", rich_help_panel=FAULTS_PANEL,
                                          help="Wait before the first phase: gputravel runs step / resume (or "
                                          "an attached console) go on. The console starts its runs so for space."),
        visit_attempts: int = typer.Option(2, help="A failed visit is redone up to this many times in all.",
                                           rich_help_panel=FAULTS_PANEL),
        checkpoint_every: int = typer.Option(1, "--checkpoint-every", min=1, rich_help_panel=OUTPUT_PANEL,
                                             help="Checkpoint every N visits (and the last), in the background; a "
                                             "visit is resumable once its checkpoint is durable."),
        keep_checkpoints: int = typer.Option(2, "--keep-checkpoints", min=1, rich_help_panel=OUTPUT_PANEL,
                                             help="Sealed checkpoints kept in the run folder."),
        fault: str | None = typer.Option(None, "--fault", hidden=True,
                                         help="Fault injection: kill-orchestrator|kill-device|kill-agent@PHASE:VISIT[+S]"),
        inject: HolderInjection | None = typer.Option(
            None, "--inject", help="Make what holders attest wrong in one way (the CVM's quote: cvm-debug, "
            "cvm-report-data; the GPU's evidence: gpu-measurement, gpu-nonce): every holder refuses, no key is "
            "released, exit 3.", rich_help_panel=FAULTS_PANEL),
        cvm_kind: CvmKind = typer.Option(
            CvmKind.TDX, "--cvm-kind", help="The orchestrator CVM holders attest (the emulated platform's SIM one): "
            "tdx (a TDX quote), snp (an SEV-SNP report) or azure-snp (Azure's HCL report + vTPM quote)."),
        out: Path | None = typer.Option(None, "--out", help="Run folder: ledger, checkpoints, keys "
                                        "(default: a new runs/run-<time>, linked as runs/latest).",
                                        rich_help_panel=OUTPUT_PANEL),
        resume: bool = typer.Option(False, "--resume", help="Continue the run in --out (default runs/latest) "
                                    "from its last checkpoint and ledger.", rich_help_panel=OUTPUT_PANEL),
        record: Path | None = typer.Option(None, "--record", help="Record events and GPU telemetry (NVML, or the "
                                           "emulated device's SIM counters) to this file for `gputravel replay` / "
                                           "`gputravel-console --replay` (default: <out>/recording.db).",
                                           rich_help_panel=OUTPUT_PANEL),
        no_record: bool = typer.Option(False, "--no-record", help="Do not record the run.",
                                       rich_help_panel=OUTPUT_PANEL),
        telemetry_interval: float = typer.Option(TELEMETRY_INTERVAL_S, "--telemetry-interval", min=0.1,
                                                 help="Seconds between the telemetry samples recorded.",
                                                 rich_help_panel=OUTPUT_PANEL),
        as_json: bool = typer.Option(False, "--json", help="Print the final report as JSON on stdout.",
                                     rich_help_panel=OUTPUT_PANEL),
        gpus: int = typer.Option(1, "--gpus", min=1, help=GPUS_HELP, rich_help_panel=FLEET_PANEL),
        fleet_variant: str = typer.Option("secure_pipelined", "--fleet-allreduce", rich_help_panel=FLEET_PANEL,
                                          help="The fleet's gradient all-reduce: secure_pipelined, secure_naive, "
                                          "ring (plaintext) or plain."),
        nnodes: int = typer.Option(1, "--nnodes", min=1, rich_help_panel=FLEET_PANEL,
                                   help="torchrun: hosts of the fleet (--gpus is the total)."),
        rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", rich_help_panel=FLEET_PANEL,
                                                 help="torchrun: HOST:PORT of the c10d rendezvous."),
        rdzv_id: str | None = typer.Option(None, "--rdzv-id", rich_help_panel=FLEET_PANEL,
                                           help="torchrun: the job's rendezvous id."),
        max_restarts: int = typer.Option(0, "--max-restarts", min=0, rich_help_panel=FLEET_PANEL,
                                         help="torchrun: elastic restarts of the fleet's ranks (they resume)."),
        join_timeout: float = typer.Option(120.0, "--join-timeout", min=0.001, rich_help_panel=FLEET_PANEL,
                                           help="Seconds every fleet worker waits for all workers' first post "
                                           "before it names the missing rank and node (exit 10)."),
        sim_pki: Path | None = typer.Option(None, "--sim-pki", rich_help_panel=FLEET_PANEL, dir_okay=False,
                                            help="SIM: the emulated vendors' PKI file every node installs "
                                            "(gputravel fleet pki export); needed with --nnodes > 1."),
    ) -> None:
        """Run collaborative training: the GPU travels holder to holder (--gpus N: a fleet, docs/fleet.md)."""
        options = RunOptions.given(
            data=data, holders=holders, holders_file=holders_file, transport=transport, data_path=data_path,
            data_host=data_host, rounds=rounds, steps_per_visit=steps_per_visit, buffer_mib=buffer_mib,
            chunk_kib=chunk_kib, break_before=break_before,
            extra=dict(model=model.value, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed, device=device,
                       cc_mode=cc_mode.value, visit_attempts=visit_attempts, fault=fault,
                       cipher_engine=cipher_engine.value, init_from=init_from,
                       attest_prefetch=attest_prefetch, handoff_with_window=handoff_with_window,
                       grant_at_completion=grant_at_completion,
                       holder_inject=inject.value if inject is not None else None,
                       cvm_kind=cvm_kind.value,
                       checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
                       lora_rank=lora_rank, lora_alpha=lora_alpha, lora_targets=lora_targets)).settings_fields()
        fleet = gpus > 1 or nnodes > 1
        if fleet and start_paused:
            raise ConfigError("--start-paused steps one GPU's run; a fleet (--gpus, --nnodes) takes --break-before")
        if fleet and init_from is not None:
            raise ConfigError("--init-from loads one device's model; a fleet (--gpus, --nnodes) does not take it yet")
        settings, folder = _settings_for(out, options, resume=resume, fleet=fleet, fault=fault, init_from=init_from)
        if fleet or (resume and RunFolder(settings.out_dir).is_fleet):
            from gputravel.console.cli.commands.run_fleet import run_fleet

            folder.claim()
            try:
                with running_marker(folder.out, owner="gputravel run --gpus"):
                    run_fleet(settings, gpus=gpus, variant=fleet_variant, nnodes=nnodes,
                              rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, max_restarts=max_restarts,
                              sim_pki=sim_pki, as_json=as_json, join_timeout=join_timeout)
            finally:
                folder.tighten()
            return
        try:
            _run_one(settings, folder, no_record=no_record, record=record, telemetry_interval=telemetry_interval,
                     as_json=as_json, start_paused=start_paused)
        except (KeyboardInterrupt, CancelledRunError, StorageError) as exc:  # the hint names this run's folder
            raise resume_hint(exc, settings.out_dir) from None


def _settings_for(out: Path | None, options: dict[str, Any], *, resume: bool, fleet: bool, fault: str | None,
                  init_from: Path | None) -> tuple[RunSettings, RunClaim]:
    """The run's settings and its folder: a fresh run's validated before anything is created, a resumed one's
    read back from its folder (a fleet's from the options, its folder holding ``fleet.json``)."""
    if resume:
        from gputravel.core.api import resume_settings

        out = resolve_out_dir(out, resume=True).absolute()
        if fleet or RunFolder(out).is_fleet:
            settings = RunSettings(out_dir=out, resume=True, **options)
        else:
            settings = resume_settings(out, fault=fault)
        folder = RunClaim(out)
    else:
        if init_from is not None:  # a bad weights file is refused before anything is created or contacted
            from gputravel.core.training.weights import check_weights

            check_weights(init_from)
        settings, folder = fresh_settings(out, **options)  # validated before anything is created
    return settings, folder


def _run_one(settings: RunSettings, folder: RunClaim, *, no_record: bool, record: Path | None,
             telemetry_interval: float, as_json: bool, start_paused: bool = False) -> None:
    """One GPU's run in this process: progress (rich) or JSON, the recording, status.json, the exit code."""
    console = Console(stderr=True) if as_json else Console()
    run = RunFolder(settings.out_dir)
    view = RunView(console, run_name=run.name)
    ending = RunEnding(run.path)  # writes status.json when the run pauses and ends
    sinks: list[Any] = [view, ending]
    recorder = None
    folder.claim()
    reserve_status(run)  # room for its last status.json, should a full disk stop it
    ok = False
    error: BaseException | None = None
    try:
        if not no_record:
            from gputravel.core.recording import Recorder

            recorder = Recorder(record or run.recording,
                                meta={"source": "gputravel run", "settings": settings.to_dict(),
                                      "ledger": str(run.ledger),
                                      "started_at": time.time(), "pid": os.getpid()})
            sinks.append(recorder)
        with running_marker(run, owner="gputravel run"), view.progress:
            report = asyncio.run(_run_until_stopped(settings, sinks=sinks, recorder=recorder,
                                                    telemetry_interval=telemetry_interval,
                                                    start_paused=start_paused))
        ok = True
    except BaseException as exc:
        error = exc
        raise
    finally:
        ending.finish(error, recorder=recorder)
        if recorder is not None:
            recorder.close()
        if not ok:
            folder.release_if_empty()
        folder.tighten()  # what a part wrote with its own mode (public certificates): 0600 too
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        render_report(console, report)
    refusals = report.get("holder_refusals") or []
    if report["failed_visits"] and refusals:  # a holder's own attestation refused: no key released
        first = refusals[0]  # the report (stdout with --json) is complete: the error goes to stderr, exit 3
        typer.echo(f"error: AttestationError: holder {first['holder']} refused the attestation: "
                   f"{first['claim']} ({len(refusals)} refusal(s); no key released)", err=True)
        raise typer.Exit(AttestationError.exit_code)
    if report["failed_visits"]:
        raise typer.Exit(EXIT_PARTIAL)


async def _run_until_stopped(settings: RunSettings, *, start_paused: bool = False, **kw: Any) -> dict[str, Any]:
    """The run, ended by SIGTERM (``gputravel runs stop``) as by the operator: the run's task is cancelled, the
    device service and the agents are stopped, and the run's final event says ``cancelled``."""
    from gputravel.console.cli.run_control import ControlChannel
    from gputravel.console.holders import run as holders_run

    controls: list[Any] = []  # the engine's Control, once built
    # an attached console's keys (control.jsonl); a fresh run reads its channel from the start (the console that
    # started it may ask before the engine exists), a resumed one from its end
    channel = ControlChannel(settings.out_dir, from_start=not settings.resume, start_paused=start_paused)

    def built(control: Any) -> None:
        controls.append(control)
        channel.attach(control)

    task = asyncio.ensure_future(holders_run(settings, on_control=built, **kw))
    loop = asyncio.get_running_loop()
    stopped = False

    def stop() -> None:
        nonlocal stopped
        if not stopped:  # the pending state, in the output and the recording: CANCELLING... until it lands
            for sink in kw.get("sinks", ()):
                sink(ev.ControlRequested(time.time(), "cancel", None))
        stopped = True
        task.cancel()

    def resume() -> None:  # `gputravel runs resume RUN`: on to the next breakpoint
        for control in controls:
            control.resume()

    def step() -> None:  # `gputravel runs step RUN`: one phase, then paused again
        for control in controls:
            control.step()

    handlers = ((signal.SIGTERM, stop), (RESUME_SIGNAL, resume), (STEP_SIGNAL, step))
    for signum, handler in handlers:
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread, or no signals here
            loop.add_signal_handler(signum, handler)
    serving = asyncio.ensure_future(_serve_control(channel))
    try:
        return (await task).to_json()
    except asyncio.CancelledError:
        if stopped:
            raise CancelledRunError("stopped by SIGTERM (gputravel runs stop)") from None
        raise
    finally:
        serving.cancel()
        for signum, _ in handlers:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signum)


async def _serve_control(channel: Any) -> None:
    """The run's control channel (``console/cli/run_control.py``): requests appended to ``control.jsonl`` reach
    the engine's Control within ``POLL_S``, and land as the console's keys do."""
    from gputravel.console.cli.run_control import POLL_S

    while True:
        await asyncio.sleep(POLL_S)
        channel.poll()
