"""``gputravel export RUN --format llmc|safetensors|hf|peft --output PATH``: a run's trained model as a public file
or a Hugging Face folder (``hf``: merged; ``peft``: LoRA's adapters; core/training/export.py).

RUN is a run folder, a name as ``gputravel runs ls`` shows it (a unique prefix or suffix will do) or
``latest``. The run's newest sealed checkpoint is opened with its key (``keys/checkpoint.key``) and its model
written as llm.c's model file (fp32 version 3, or bf16 version 5 with ``--dtype bfloat16``) or as Hugging
Face ``GPT2LMHeadModel`` safetensors (docs/checkpoints.md, "Pretrained weights in and out").
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from gputravel.core.runfolder import RUNS_DIR, RunFolder, find_run


def _when(t: float | None) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "?"


class WeightsFormat(StrEnum):
    LLMC = "llmc"
    SAFETENSORS = "safetensors"
    HF = "hf"
    PEFT = "peft"


class WeightsDtype(StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


def register(app: typer.Typer) -> None:
    @app.command("export")
    def export_cmd(
        run: Annotated[str, typer.Argument(help="A run: a folder, its name under runs/ (a unique prefix or suffix "
                                                "will do), or latest.", show_default=False)],
        fmt: Annotated[WeightsFormat, typer.Option("--format", help="llmc (llm.c's .bin), safetensors "
                                                   "(Hugging Face GPT2LMHeadModel names), hf (a Hugging Face folder, "
                                                   "LoRA merged) or peft (a LoRA run's adapters, a folder).")] = WeightsFormat.LLMC,
        output: Annotated[Path | None, typer.Option("--output", "-o", "--out", help="File (or, for hf and peft, folder) to write.",
                                                    show_default=False)] = None,
        dtype: Annotated[WeightsDtype, typer.Option("--dtype", help="llmc: float32 (version 3) or bfloat16 "
                                                    "(version 5).")] = WeightsDtype.FLOAT32,
        runs_dir: Annotated[Path, typer.Option("--runs-dir", help="Folder that holds the run folders.")] = RUNS_DIR,
        as_json: Annotated[bool, typer.Option("--json", help="Print what was written as JSON.")] = False,
    ) -> None:
        """Write a run's model: llm.c, GPT-2 safetensors, a Hugging Face folder (hf, LoRA merged) or peft.

        The run's last sealed checkpoint: llm.c's model file, GPT-2's safetensors names, a Hugging Face folder with
        LoRA merged, or a LoRA run's adapters as a folder for peft."""
        from gputravel.core.errors import ConfigError
        from gputravel.core.training.export import export_run

        if output is None:
            raise ConfigError("export needs --output FILE")
        folder = find_run(run, runs_dir)
        if not as_json:  # which run an address such as `latest` took, before anything is written
            from gputravel.console.view.run_info import read_run

            info = read_run(folder)
            Console(stderr=True).print(f"run {escape(str(folder))}: {escape(info.status)}, started "
                                       f"{_when(info.started_at)}, {escape(info.model)}", highlight=False,
                                       soft_wrap=True)
        here = RunFolder(folder)
        done = export_run(folder, output, key_path=here.checkpoint_key, checkpoints=here.checkpoint_files(),
                          fmt=fmt.value, dtype=dtype.value, settings_path=here.settings)
        if as_json:
            typer.echo(json.dumps({"run": str(folder), **done}, indent=2))
            return
        Console().print(f"wrote {escape(str(output))} ({done['format']}, {done.get('bytes', 0):,} bytes, "
                        f"{done['params']:,} parameters) from {escape(done['checkpoint'])} of "
                        f"{escape(str(folder))} ({done['steps']} steps)", highlight=False)
