"""``gputravel bench train``: tokens/s of ``gputravel run``'s training next to a plain torch loop of the same
model and batch (``core.bench.train``), wired: options, the fleet, a progress bar, the table or ``--json``."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from gputravel.console.cli.commands.bench import StudyProgress
from gputravel.core.allocator import keep_freed_memory
from gputravel.core.errors import ConfigError


def render(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    if result.get("part") in ("plain", "protocol"):  # one pass alone: its figure, for --combine
        figures = result[result["part"]]
        console.print(f"bench train, {result['part']} pass alone: {figures['steps']} steps, {figures['tokens_per_s']} "
                      f"tokens/s (join the passes' --json results with --combine)")
        return
    job, proto, plain = result["job"], result["protocol"], result["plain"]
    table = Table(title=f"bench train: {job['model']} ({job['model_params'] or '?'} parameters), batch "
                        f"{job['batch_size']}×{job['seq_len']}, {proto['steps']} steps on {job['device']}")
    for col in ("loop", "steps", "seconds", "tokens/s", "vs plain"):
        table.add_column(col, justify="left" if col == "loop" else "right")
    table.add_row("gputravel run (all visit phases)", str(proto["steps"]), f"{proto['visits_s']:.2f}",
                  f"{proto['tokens_per_s']:,.0f}", f"{result['ratio']:.3f}")
    table.add_row("gputravel run (TRAIN phases)", str(proto["steps"]), f"{proto['train_s']:.2f}",
                  f"{proto['train_phase_tokens_per_s']:,.0f}", f"{result['train_phase_ratio']:.3f}")
    table.add_row("plain torch loop", str(plain["steps"]), f"{plain['seconds']:.2f}", f"{plain['tokens_per_s']:,.0f}",
                  "1.000")
    console.print(table)
    console.print(f"protocol cost: {result['protocol_cost_pct']:.1f} % of plain throughput ({result['target']}).")
    ckpt = result.get("checkpoint") or {}
    if ckpt.get("bytes"):
        console.print(f"last checkpoint: {ckpt['bytes']:,} bytes ({ckpt['pct_of_full_state']} % of the whole state's "
                      f"{ckpt['full_state_bytes']:,}), sealed in {ckpt['seal_s']} s on the device")


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("train")
    def train_cmd(
        model: str = typer.Option("tiny", "--model", help="tiny, small or gpt2."),
        holders: int = typer.Option(2, "--holders"),
        rounds: int = typer.Option(1, "--rounds", help="Rounds: each holder is visited this many times."),
        steps: int = typer.Option(10, "--steps", help="Training steps per visit (one round)."),
        batch_size: int = typer.Option(4, "--batch-size"),
        seq_len: int = typer.Option(64, "--seq-len"),
        dataset_mib: float = typer.Option(1.0, "--dataset-mib", help="MiB of data per holder."),
        device: str | None = typer.Option(None, "--device", help="torch device (default: cuda if present)."),
        torch_threads: int = typer.Option(0, "--torch-threads", help="Training threads (0: torch's default)."),
        transport: str = typer.Option("local", "--transport", help="local (agent subprocesses) or ssh."),
        init_from: Path | None = typer.Option(None, "--init-from", help="A weights file or Hugging Face folder "
                                              "(Llama, Qwen2, Mistral, GPT-2) instead of the preset."),
        lora_rank: int = typer.Option(0, "--lora-rank", min=0, help="Train LoRA adapters of this rank alone."),
        part: str = typer.Option("all", "--part", help="all (plain loop, run, plain loop), or one pass alone: "
                                 "plain or protocol (join their --json results with --combine)."),
        combine: list[Path] | None = typer.Option(None, "--combine", help="A --part result (JSON) to join into one "
                                                  "study; repeat it: one protocol part, one or more plain parts."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    ) -> None:
        """The protocol's cost in training throughput: gputravel run vs a plain torch loop, same job."""
        if transport not in ("ssh", "local"):
            raise typer.BadParameter("transport is ssh or local", param_hint="--transport")
        from gputravel.console import holders as holder_set
        from gputravel.core.bench import train  # torch: only when the study runs, not for --help

        if part not in train.PARTS:
            raise typer.BadParameter(f"part is one of {', '.join(train.PARTS)}", param_hint="--part")
        if combine:
            try:
                result = train.combine([_read_part(path) for path in combine])
            except ConfigError as exc:
                raise typer.BadParameter(exc.reason, param_hint="--combine") from None
            _emit(result, as_json)
            return
        try:  # before the progress bar's thread: the plain loop's allocator, as the device sets its own
            keep_freed_memory()
        except ConfigError as exc:
            raise typer.BadParameter(exc.reason) from None
        with tempfile.TemporaryDirectory(prefix="gputravel-bench-train-") as tmp, \
                StudyProgress(TextColumn("{task.description:<24}"), BarColumn(), TimeElapsedColumn(),
                              console=Console(stderr=True)) as progress:
            try:
                result = train.study(workdir=Path(tmp), run=holder_set.run, model=model, holders=holders, rounds=rounds,
                                     steps=steps,
                                     batch_size=batch_size, seq_len=seq_len, dataset_mib=dataset_mib,
                                     device=device, torch_threads=torch_threads, transport=transport,
                                     on_progress=progress, init_from=init_from, lora_rank=lora_rank, part=part)
            except ConfigError as exc:
                raise typer.BadParameter(exc.reason) from None
        _emit(result, as_json)


def _read_part(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise typer.BadParameter(f"{path}: not a readable JSON result ({exc})", param_hint="--combine") from None
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{path}: not a bench train result", param_hint="--combine")
    return data


def _emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return
    render(result)
