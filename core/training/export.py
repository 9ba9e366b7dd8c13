"""A run's model out as a Hugging Face folder: ``--format hf`` (merged) and ``--format peft`` (LoRA's adapters).

* ``hf``: ``config.json`` + ``model.safetensors`` that ``from_pretrained`` loads: Llama-family names as they are,
  GPT-2's as ``GPT2LMHeadModel``'s (Conv1D transposed, the real vocabulary). A LoRA run's adapters are merged
  (``W + alpha/rank * B @ A``) into the base: the ``--init-from`` folder's weights, or, for a run that started
  from the seed, the seed's initial model (rebuilt here, exactly as the device built it).
* ``peft``: ``adapter_config.json`` + ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight``
  ...) that ``peft`` loads onto the same base (GPT-2: ``fan_in_fan_out``, its layers being Conv1D there).

Every file is written through a temporary file created with ``O_EXCL | O_NOFOLLOW`` (``mkstemp``, a random name)
in the target's own folder and renamed over the target, so a planted link is never followed nor written through.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from gputravel.core.errors import ConfigError, DataError
from gputravel.core.training.llama import LlamaConfig
from gputravel.core.training.lora import LoraSettings
from gputravel.core.training.model import (
    GPTConfig,
    ModelConfig,
    build_model,
    model_config_from_dict,
    param_shapes,
    param_shapes_of,
)
from gputravel.core.training.weights import FORMATS, gpt2_hf_tensors, read_weights, write_weights

__all__ = ["FOLDER_FORMATS", "atomic_write", "export_folder", "export_run", "merged_params", "peft_files"]

FOLDER_FORMATS = ("hf", "peft")


def atomic_write(path: Path, data: bytes | Any) -> None:
    """Write ``data`` to ``path`` through a fresh ``O_EXCL`` temporary file beside it, then rename it over
    ``path`` (a link at ``path`` is replaced, never followed). ``data``: bytes, or a callable given the file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # O_EXCL | O_NOFOLLOW
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, bytes | bytearray | memoryview):
                f.write(data)
            else:
                data(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _base_params(config: ModelConfig, settings: Mapping[str, Any], run_settings: Mapping[str, Any]
                 ) -> dict[str, torch.Tensor]:
    """The frozen base of a LoRA run: its ``--init-from`` weights, or the seed's initial model."""
    init_from = run_settings.get("init_from")
    if init_from:
        if not Path(init_from).exists():
            raise DataError(f"the run's --init-from {init_from} is not there any more: --format hf merges the LoRA "
                            "adapters into it; put it back where it was, or export the adapters alone with --format "
                            "peft")
        base_config, params = read_weights(Path(init_from))
        if base_config != config:
            raise DataError(f"the run's --init-from {init_from} no longer holds the run's model")
        return params
    model = build_model(config, generator=torch.Generator().manual_seed(int(settings["seed"])))
    return {n: p.detach() for n, p in model.named_parameters()}


def merged_params(config: ModelConfig, model: Mapping[str, torch.Tensor], lora: LoraSettings | None,
                  base: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The model's parameters (this project's names), LoRA's adapters merged into their layers."""
    shapes = param_shapes_of(config)
    if lora is None:
        return {n: model[n] for n in shapes}
    assert base is not None
    out = {n: base[n].to(torch.float32).clone() for n in shapes}
    for name in model:
        if name.endswith(".lora_A"):
            module = name.removesuffix(".lora_A")
            a, b = model[name].to(torch.float32), model[module + ".lora_B"].to(torch.float32)
            out[module + ".weight"] += lora.scale * (b @ a)
    return out


def peft_files(config: ModelConfig, model: Mapping[str, torch.Tensor], lora: LoraSettings,
               base_name: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``adapter_config.json``'s dict and ``adapter_model.safetensors``'s tensors."""
    gpt2 = not isinstance(config, LlamaConfig)
    tensors = {f"base_model.model.{name}.weight": t.detach().to("cpu", torch.float32).contiguous()
               for name, t in model.items()}
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
           "target_modules": list(lora.targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": gpt2,
           "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
           "modules_to_save": None, "base_model_name_or_path": base_name,
           "auto_mapping": None, "revision": None}
    return cfg, tensors


def _hf_tensors(config: ModelConfig, params: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                                                 dict[str, str]]:
    if isinstance(config, LlamaConfig):
        return ({n: t.detach().to("cpu", torch.float32).contiguous() for n, t in params.items()},
                {"format": "pt", "producer": "gputravel export"})

    return gpt2_hf_tensors(config, params), {"format": "pt", "producer": "gputravel export"}


def export_folder(state: Mapping[str, Any], run_settings: Mapping[str, Any], output: Path, *, fmt: str,
                  config: ModelConfig) -> dict[str, Any]:
    """Write ``state`` (an opened checkpoint's) into the folder ``output`` as ``fmt``; returns what was written."""
    from safetensors.torch import save

    from gputravel.core.training.hf import hf_config_json
    from gputravel.core.training.trainer import TrainSettings

    if fmt not in FOLDER_FORMATS:
        raise ConfigError(f"unknown folder format {fmt!r}; choose one of {', '.join(FOLDER_FORMATS)}")
    settings = TrainSettings.from_dict(dict(state["settings"]))
    lora = settings.lora(config)
    model = state["model"]
    output = Path(output)
    if output.is_symlink() or (output.exists() and not output.is_dir()):
        raise ConfigError(f"--out {output} must be a folder (it is a file or a link)")
    output.mkdir(parents=True, exist_ok=True)
    files: dict[str, int] = {}
    if fmt == "peft":
        if lora is None:
            raise ConfigError("--format peft exports LoRA adapters; this run trained the whole model (use --format hf)")
        cfg, tensors = peft_files(config, model, lora, run_settings.get("init_from"))
        writes = {"adapter_config.json": json.dumps(cfg, indent=2).encode() + b"\n",
                  "adapter_model.safetensors": save(tensors, metadata={"format": "pt"})}
        n = sum(t.numel() for t in tensors.values())
    else:
        base = _base_params(config, settings.to_dict(), run_settings) if lora is not None else None
        params = merged_params(config, model, lora, base)
        tensors, meta = _hf_tensors(config, params)
        writes = {"config.json": json.dumps(hf_config_json(config), indent=2).encode() + b"\n",
                  "model.safetensors": save(tensors, metadata=meta)}
        n = sum(t.numel() for t in tensors.values())
    for name, data in writes.items():
        atomic_write(output / name, data)
        files[name] = len(data)
    return {"files": files, "params": n, "bytes": sum(files.values()),
            "lora": None if lora is None else {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)}}


# --- export: a run's last sealed checkpoint -> a public model file -----------------------------------------
def export_run(run_dir: Path, output: Path, *, key_path: Path, checkpoints: Iterable[Path], fmt: str,
               dtype: str = "float32", settings_path: Path | None = None) -> dict[str, Any]:
    """Open ``run_dir``'s newest checkpoint (of ``checkpoints``, the folder's sealed files) with the run's key
    (``key_path``) and write its model to ``output`` as ``fmt``: ``llmc`` or ``safetensors`` (a GPT-2 file), ``hf``
    or ``peft`` (a Hugging Face folder: core/training/export.py, which reads the run's ``settings_path`` for its
    ``--init-from``). Returns what was written. The caller names the files (``RunFolder``): training knows no
    run folder.

    The checkpoint is opened through a store over an empty temporary folder: a store over the run's own folder
    would sweep the temporary file of a checkpoint the run may be writing right now."""
    import tempfile

    from gputravel.core.training.checkpoint import CheckpointStore, load_or_create_key

    if fmt not in (*FORMATS, *FOLDER_FORMATS):
        raise ConfigError(f"unknown weights format {fmt!r}; choose one of {', '.join((*FORMATS, *FOLDER_FORMATS))}")
    run_dir = Path(run_dir)
    if not key_path.is_file():
        raise ConfigError(f"{run_dir} has no checkpoint key ({key_path}): its checkpoints cannot be opened")
    found = sorted((int(p.name[5:-4]), p) for p in checkpoints if p.name[5:-4].isdigit())
    if not found:
        raise DataError(f"{run_dir} has no sealed checkpoint (checkpoints/ckpt-*.gtc) to export")
    seq, path = found[-1]
    key = load_or_create_key(key_path)  # exists: read, with its permission checks
    with tempfile.TemporaryDirectory(prefix="gputravel-export-") as empty:
        state = CheckpointStore(Path(empty), key).load(path)
    try:
        config = model_config_from_dict(dict(state["config"]))
        model = state["model"]
    except (KeyError, TypeError) as exc:
        raise DataError(f"checkpoint {path} holds no model state ({exc})") from None
    done = {"run": str(run_dir), "checkpoint": path.name, "seq": seq, "steps": int(state.get("step", 0)),
            "format": fmt, "dtype": dtype, "output": str(output), "model": config.to_dict()}
    try:
        if fmt in FOLDER_FORMATS:
            try:
                run_settings = json.loads(settings_path.read_text()) if settings_path is not None else {}
            except (OSError, ValueError):
                run_settings = {}
            return {**done, **export_folder(state, run_settings, output, fmt=fmt, config=config)}
        if not isinstance(config, GPTConfig) or state.get("lora"):
            raise ConfigError(f"--format {fmt} writes a whole GPT-2; this run's model is "
                              f"{getattr(config, 'architecture', 'GPT-2')}{' with LoRA' if state.get('lora') else ''}"
                              ": use --format hf (or peft)")
        try:
            params = {name: model[name] for name in param_shapes(config)}
        except KeyError as exc:
            raise DataError(f"checkpoint {path} holds no GPT-2 model state ({exc})") from None
        write_weights(output, config, params, fmt=fmt, dtype=dtype)
    except OSError as exc:
        raise ConfigError(f"cannot write {output}: {exc.strerror or exc}") from None
    return {**done, "bytes": Path(output).stat().st_size, "params": sum(t.numel() for t in params.values())}
