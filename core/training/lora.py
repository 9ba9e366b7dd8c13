"""LoRA: low-rank adapters on a frozen base, as ``peft`` defines them.

A targeted ``nn.Linear`` (``q_proj`` ... or GPT-2's ``c_attn`` ...) becomes a :class:`LoraLinear`: its own
``weight``/``bias`` (frozen, the base), plus ``lora_A`` ``(rank, in)`` and ``lora_B`` ``(out, rank)``, and
``y = x W^T + b + (x A^T B^T) * alpha / rank``. ``A`` starts as ``peft`` starts it (Kaiming-uniform, bound
``1/sqrt(in)``), ``B`` at zero, so the adapted model starts equal to the base. A target matches a module whose
last name component is the target (``peft``'s rule for a list of names).

The adapters' initial values come from a generator of their own (``seed + 1``) in the model's parameter order,
so the orchestrator computes the digest a freshly built adapted model must have (:func:`lora_init`) without
building the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from gputravel.core.errors import ConfigError
from gputravel.core.training.train_settings import DEFAULT_TARGETS, LoraSettings, lora_names, with_adapters

__all__ = ["DEFAULT_TARGETS", "LoraLinear", "LoraSettings", "apply_lora", "lora_init", "lora_names", "with_adapters"]

class LoraLinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank update; ``weight`` and ``bias`` are the (frozen) base's."""

    def __init__(self, base: nn.Linear, rank: int, scale: float) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        dev = base.weight.device
        self.lora_A = nn.Parameter(torch.zeros(rank, base.in_features, device=dev))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=dev))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_A),
                                                                           self.lora_B) * self.scale
        return out


def lora_init(shapes: Mapping[str, tuple[int, ...]], lora: LoraSettings, seed: int) -> dict[str, torch.Tensor]:
    """The adapters' initial values (CPU, fp32): ``A`` Kaiming-uniform from ``Generator(seed + 1)``, ``B`` zero."""
    gen = torch.Generator().manual_seed(seed + 1)
    out: dict[str, torch.Tensor] = {}
    for name, shape in lora_names(shapes, lora).items():
        if name.endswith(".lora_A"):
            bound = 1.0 / math.sqrt(shape[1])
            out[name] = torch.empty(shape).uniform_(-bound, bound, generator=gen)
        else:
            out[name] = torch.zeros(shape)
    return out


def apply_lora(model: nn.Module, lora: LoraSettings, shapes: Mapping[str, tuple[int, ...]], seed: int) -> list[str]:
    """Replace each targeted linear layer of ``model`` by a :class:`LoraLinear`, freeze everything else, set the
    adapters to :func:`lora_init`'s values. Returns the names of the trainable parameters."""
    init = lora_init(shapes, lora, seed)
    modules = dict(model.named_modules())
    for name in {n.rsplit(".", 1)[0] for n in init}:
        base = modules.get(name)
        if not isinstance(base, nn.Linear):
            raise ConfigError(f"LoRA target {name} is not a linear layer of this model")
        parent_name, _, leaf = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, leaf, LoraLinear(base, lora.rank, lora.scale))
    for p in model.parameters():
        p.requires_grad_(False)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in init.items():
            params[name].copy_(value)
            params[name].requires_grad_(True)
    return list(init)


