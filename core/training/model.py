"""An llm.c-style GPT-2: learned positions, pre-LN blocks, tied lm_head, GPT-2 initialisation.

The vocabulary is padded to a multiple of 128 in the embedding (50257 -> 50304, as llm.c does); the
padded rows are never looked up and the logits are cut back to the real vocabulary, so they never
affect the loss.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from gputravel.core.errors import ConfigError
from gputravel.core.training.attention import causal_attention
from gputravel.core.training.llama import Llama
from gputravel.core.training.shapes import (
    GPT2_LAYER,
    PRESETS,
    GPTConfig,
    LlamaConfig,
    ModelConfig,
    model_config_from_dict,
    param_shapes,
    param_shapes_of,
    preset,
    preset_for_tokens,
)

__all__ = ["GPT", "PRESETS", "GPTConfig", "ModelConfig", "build_model", "GPT2_LAYER", "model_config_from_dict", "pad_rows", "param_shapes", "param_shapes_of",
           "preset",
           "preset_for_tokens"]

def build_model(config: ModelConfig, *, generator: torch.Generator | None = None,
                device: torch.device | str | None = None) -> GPT | Llama:
    """The model of ``config``, initialised from ``generator``."""
    if isinstance(config, LlamaConfig):
        return Llama(config, generator=generator, device=device)
    return GPT(config, generator=generator, device=device)


def pad_rows(wte: torch.Tensor, rows: int) -> torch.Tensor:
    """``wte`` with zero rows added up to ``rows`` (the padded vocabulary)."""
    if wte.shape[0] == rows:
        return wte
    out = torch.zeros((rows, wte.shape[1]), dtype=wte.dtype)
    out[: wte.shape[0]] = wte
    return out


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.residual_scaled = True  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[-1]
        q, k, v = self.c_attn(x).split(c, dim=2)
        y = causal_attention(q, k, v, n_head=self.n_head, n_kv_head=self.n_head, head_dim=c // self.n_head,
                             dropout_p=self.dropout if self.training else 0.0)
        out: torch.Tensor = self.c_proj(y)
        return out


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.residual_scaled = True  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        return out


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        out: torch.Tensor = x + self.drop(self.mlp(self.ln_2(x)))
        return out


class GPT(nn.Module):
    """GPT-2. Build with ``GPT(config, generator=g)`` for an initialisation that depends only on ``g``.

    Construction touches neither the global RNG nor any device but ``device`` (default CPU): the
    parameters are allocated empty and then initialised from the generator on the CPU, so the same
    seed gives the same weights on every device.
    """

    def __init__(self, config: GPTConfig, *, generator: torch.Generator | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.transformer = nn.ModuleDict({
                "wte": nn.Embedding(config.padded_vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "drop": nn.Dropout(config.dropout),
                "h": nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                "ln_f": nn.LayerNorm(config.n_embd),
            })
            self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.to_empty(device="cpu")
        self.lm_head.weight = self.transformer["wte"].weight  # type: ignore[assignment]  # tied
        self.init_weights(generator)
        if device is not None:
            self.to(device)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 init: N(0, 0.02) everywhere, residual projections scaled by 1/sqrt(2 n_layer), zero biases."""
        if generator is None:
            generator = torch.Generator().manual_seed(0)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for module in self.modules():  # registration order: deterministic
            if isinstance(module, nn.Linear):
                if module is self.lm_head:
                    continue  # tied to wte
                std = residual_std if getattr(module, "residual_scaled", False) else 0.02
                _normal_cpu(module.weight, std, generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                _normal_cpu(module.weight, 0.02, generator)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, T, vocab_size)`` and, given targets, the mean cross-entropy loss."""
        _, t = idx.shape
        if t > self.config.block_size:
            raise ConfigError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.transformer["drop"](self.transformer["wte"](idx) + self.transformer["wpe"](pos))
        for block in cast(nn.ModuleList, self.transformer["h"]):
            x = block(x)
        x = self.transformer["ln_f"](x)
        logits = self.lm_head(x)[..., : self.config.vocab_size]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _normal_cpu(tensor: torch.Tensor, std: float, generator: torch.Generator) -> None:
    if tensor.device.type == "cpu" and generator.device.type == "cpu":
        nn.init.normal_(tensor, 0.0, std, generator=generator)
    else:  # draw on the CPU so the weights do not depend on the device
        tensor.copy_(torch.empty(tensor.shape, dtype=tensor.dtype).normal_(0.0, std, generator=generator))
