"""Training on the device: the GPT-2 model, the trainer, token formats, the demo corpus, sealed checkpoints.

Names are re-exported lazily, so ``import gputravel.core.training.corpus`` does not build the model
module and the CLI stays quick to start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from gputravel.core.training.checkpoint import CheckpointStore, load_or_create_key
    from gputravel.core.training.corpus import HolderDataSpec, fetch_corpus
    from gputravel.core.training.datacheck import validate_data_dir
    from gputravel.core.training.llmc import read_llmc_shard, write_llmc_shard
    from gputravel.core.training.model import GPT, PRESETS, GPTConfig, preset
    from gputravel.core.training.tokens import (
        TokenFormat,
        bytes_per_token,
        gpt2_encoding,
        tokens_from_buffer,
        vocab_size,
    )
    from gputravel.core.training.trainer import Trainer, TrainSettings, VisitTrainResult

_EXPORTS = {
    "GPT": "model", "GPTConfig": "model", "PRESETS": "model", "preset": "model",
    "Trainer": "trainer", "TrainSettings": "trainer", "VisitTrainResult": "trainer",
    "TokenFormat": "tokens", "bytes_per_token": "tokens", "vocab_size": "tokens",
    "tokens_from_buffer": "tokens", "gpt2_encoding": "tokens",
    "CheckpointStore": "checkpoint", "load_or_create_key": "checkpoint",
    "HolderDataSpec": "corpus", "fetch_corpus": "corpus", "validate_data_dir": "datacheck",
    "write_llmc_shard": "llmc", "read_llmc_shard": "llmc",
}

__all__ = [
    "GPT", "PRESETS", "CheckpointStore", "GPTConfig", "HolderDataSpec", "TokenFormat", "TrainSettings", "Trainer",
    "VisitTrainResult", "bytes_per_token", "fetch_corpus", "gpt2_encoding", "load_or_create_key", "preset",
    "read_llmc_shard", "tokens_from_buffer", "validate_data_dir", "vocab_size", "write_llmc_shard",
]
assert set(__all__) == set(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
