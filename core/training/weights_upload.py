"""``--init-from``'s upload: pretrained weights (read by ``core/training/weights.py``) as a sealed state stream of
kind ``weights`` that the device opens straight into its model (the restore path), and the digest the loaded
model must then report (:func:`params_digest`, the device's ``Trainer.model_digest`` of an untrained model).
The weights are never trained, nor kept, in the orchestrator."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from gputravel.core.errors import ConfigError
from gputravel.core.protocol.stream import StreamHeader
from gputravel.core.training.checkpoint import seal_state
from gputravel.core.training.digest import combine, digest_trailer, tensor_entry
from gputravel.core.training.llama import LlamaConfig
from gputravel.core.training.lora import LoraSettings, lora_init, with_adapters
from gputravel.core.training.model import ModelConfig, model_config_from_dict, param_shapes_of
from gputravel.core.training.weights import WEIGHTS_KIND, check_params, read_weights

__all__ = ["params_digest", "sealed_weights", "upload_weights"]


def params_digest(params: Mapping[str, torch.Tensor], config: ModelConfig, *, lora: LoraSettings | None = None,
                  seed: int = 0) -> str:
    """The digest the device reports (``Trainer.model_digest``) for a model holding ``params`` that has not
    trained yet (no optimizer state): ``gputravel/model-digest/v3`` over each parameter's entry (its label, dtype,
    shape and bytes), in the model's order; with ``lora``, the adapters' initial values (``lora_init``, from
    ``seed``) where the model holds them."""
    shapes = param_shapes_of(config)
    adapters = lora_init(shapes, lora, seed) if lora is not None else {}
    return combine(tensor_entry(f"param:{name}", adapters[name] if name in adapters else params[name])
                   for name in (with_adapters(shapes, lora) if lora is not None else shapes))


def sealed_weights(params: Mapping[str, torch.Tensor], config: ModelConfig, *, key: bytes, run_id: str,
                   lora: LoraSettings | None = None, seed: int = 0
                   ) -> tuple[StreamHeader, Iterator[tuple[int, memoryview]], str]:
    """A ``weights`` stream of ``params`` for the device's restore path: its header, its sealed records (data
    chunks, then the end chunk, whose sealed trailer carries the digest the loaded model must have) and that
    digest."""
    check_params(config, params)
    model = {name: params[name] for name in param_shapes_of(config)}
    if "lm_head.weight" not in model:  # tied: one tensor, streamed once
        model["lm_head.weight"] = model[_embedding(config)]
    digest = params_digest(params, config, lora=lora, seed=seed)
    header = StreamHeader.new(kind=WEIGHTS_KIND, run_id=run_id, seq=0)
    state = {"format": WEIGHTS_KIND, "config": config.to_dict(), "model": model}
    return header, seal_state(key, header, state, trailer=digest_trailer(digest)), digest


def _embedding(config: ModelConfig) -> str:
    return "model.embed_tokens.weight" if isinstance(config, LlamaConfig) else "transformer.wte.weight"


def upload_weights(path: Path, *, program_model: Mapping[str, Any], key: bytes, run_id: str,
                   restore: Callable[[bytes, StreamHeader, Iterator[tuple[int, memoryview]]], Any],
                   program_train: Mapping[str, Any] | None = None) -> tuple[Any, str, dict[str, Any]]:
    """``--init-from``: read ``path``, check it is the program's model, and stream it sealed through ``restore``
    (the device client's). Returns the device's answer, the digest its model must have, and the model."""
    from gputravel.core.training.trainer import TrainSettings

    config, params = read_weights(path)
    if config != model_config_from_dict(dict(program_model)):
        raise ConfigError(f"--init-from {path}: model {config.to_dict()} differs from the program's")
    train = TrainSettings.from_dict(dict(program_train)) if program_train is not None else None
    lora = train.lora(config) if train is not None else None
    header, records, want = sealed_weights(params, config, key=key, run_id=run_id, lora=lora,
                                           seed=train.seed if train is not None else 0)
    return restore(key, header, records), want, config.to_dict()
