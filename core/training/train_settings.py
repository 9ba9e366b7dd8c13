"""Training settings without torch: the optimiser's (``TrainSettings``) and LoRA's (``LoraSettings``, which
layers a target list adapts and the adapters' shapes). The orchestrator checks a run's settings with these before
any device is configured; the trainer (``trainer.py``) and the adapters (``lora.py``) use the same classes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from gputravel.core.errors import ConfigError
from gputravel.core.training.families import DEFAULT_LORA_TARGETS
from gputravel.core.training.shapes import ModelConfig

__all__ = ["DEFAULT_TARGETS", "LoraSettings", "TrainSettings", "lora_names", "with_adapters"]

#: targets when ``--lora-targets`` is not given: the attention projections
DEFAULT_TARGETS = DEFAULT_LORA_TARGETS


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    targets: tuple[str, ...]

    def __post_init__(self) -> None:
        if type(self.rank) is not int or self.rank < 1:
            raise ConfigError(f"--lora-rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ConfigError(f"--lora-alpha must be positive, got {self.alpha!r}")
        if not self.targets or not all(isinstance(t, str) and t.isidentifier() for t in self.targets):
            raise ConfigError(f"--lora-targets names modules (q_proj,v_proj,...), got {list(self.targets)!r}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _targeted(weight_names: list[str], targets: tuple[str, ...]) -> list[str]:
    """The module paths (``model.layers.0.self_attn.q_proj``) of 2-D weights whose module a target names."""
    out = []
    for name in weight_names:
        if not name.endswith(".weight"):
            continue
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in targets:
            out.append(module)
    return out


def lora_names(shapes: Mapping[str, tuple[int, ...]], lora: LoraSettings) -> dict[str, tuple[int, ...]]:
    """The adapters' parameters (``<module>.lora_A``/``lora_B``) and shapes, in the adapted model's order."""
    modules = _targeted([n for n, s in shapes.items() if len(s) == 2], lora.targets)
    if not modules:
        raise ConfigError(f"--lora-targets {','.join(lora.targets)} names no linear layer of this model")
    out: dict[str, tuple[int, ...]] = {}
    for m in modules:
        rows, cols = shapes[m + ".weight"]
        out[m + ".lora_A"] = (lora.rank, cols)
        out[m + ".lora_B"] = (rows, lora.rank)
    return out


def with_adapters(shapes: Mapping[str, tuple[int, ...]], lora: LoraSettings) -> dict[str, tuple[int, ...]]:
    """``shapes`` (a model's parameters in order) with the adapters where the adapted model registers them: each
    targeted module's ``lora_A``, ``lora_B`` right after its own ``weight`` (and ``bias``)."""
    adapters = lora_names(shapes, lora)
    out: dict[str, tuple[int, ...]] = {}
    names = list(shapes)
    for i, name in enumerate(names):
        out[name] = shapes[name]
        module = name.rsplit(".", 1)[0]
        following = names[i + 1].rsplit(".", 1)[0] if i + 1 < len(names) else None
        if following != module and module + ".lora_A" in adapters:
            out[module + ".lora_A"] = adapters[module + ".lora_A"]
            out[module + ".lora_B"] = adapters[module + ".lora_B"]
    return out


@dataclass(frozen=True)
class TrainSettings:
    """Optimisation settings. ``total_steps`` known -> cosine decay to 10% of ``lr`` after warmup."""

    steps_per_visit: int = 20
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 10
    total_steps: int | None = None
    val_batches: int = 4
    seed: int = 1337
    lora_rank: int = 0  # 0: the whole model trains; R: LoRA adapters of rank R on a frozen base
    lora_alpha: float = 0.0  # 0: the rank (scale 1)
    lora_targets: tuple[str, ...] = ()  # (): the attention projections (lora.DEFAULT_TARGETS)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if type(self.lora_rank) is not int or self.lora_rank < 0 or self.lora_alpha < 0:
            raise ConfigError("TrainSettings: lora_rank must be an integer >= 0 and lora_alpha >= 0")
        for name in ("steps_per_visit", "batch_size", "seq_len", "val_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"TrainSettings.{name} must be positive, got {getattr(self, name)}")
        if self.lr <= 0 or self.weight_decay < 0 or self.grad_clip < 0 or self.warmup_steps < 0:
            raise ConfigError("TrainSettings: lr must be positive; weight_decay, grad_clip, warmup_steps non-negative")
        if self.total_steps is not None and self.total_steps < 1:
            raise ConfigError(f"TrainSettings.total_steps must be positive, got {self.total_steps}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainSettings:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown TrainSettings keys: {', '.join(sorted(unknown))}")
        return cls(**data)

    def lora(self, config: ModelConfig) -> LoraSettings | None:
        """The LoRA settings for ``config``'s model, or ``None`` when the whole model trains."""
        if not self.lora_rank:
            return None
        targets = self.lora_targets or DEFAULT_TARGETS["gpt2" if not hasattr(config, "arch") else "llama"]
        return LoraSettings(rank=self.lora_rank, alpha=self.lora_alpha or float(self.lora_rank), targets=targets)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based): linear warmup, then constant or cosine."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return self.lr
        min_lr = 0.1 * self.lr
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - min_lr)
