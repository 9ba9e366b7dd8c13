"""An llm.c-style GPT-2: learned positions, pre-LN blocks, tied lm_head, GPT-2 initialisation.

The vocabulary is padded to a multiple of 128 in the embedding (50257 -> 50304, as llm.c does); the
padded rows are never looked up and the logits are cut back to the real vocabulary, so they never
affect the loss.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from gputravel.core.errors import ConfigError
from gputravel.core.training.attention import causal_attention
from gputravel.core.training.llama import Llama, LlamaConfig

__all__ = ["GPT", "PRESETS", "GPTConfig", "ModelConfig", "build_model", "GPT2_LAYER", "model_config_from_dict", "pad_rows", "param_shapes", "param_shapes_of",
           "preset",
           "preset_for_tokens"]

_VOCAB_PAD = 128


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. ``vocab_size`` is the real vocabulary; the embedding is padded."""

    block_size: int = 128
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"GPTConfig.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary rounded up to a multiple of 128 (the embedding's row count)."""
        return -(-self.vocab_size // _VOCAB_PAD) * _VOCAB_PAD

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        """Rebuild a config; unknown keys are a ``ConfigError`` (never silently dropped)."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown GPTConfig keys: {', '.join(sorted(unknown))}")
        return cls(**data)


#: ``tiny`` and ``small`` are byte-level models for the demo; ``gpt2`` is GPT-2 124M (12 layers, 768 wide,
#: 1024 context, vocabulary 50257, lm_head tied to wte: 124,475,904 parameters with llm.c's padded embedding).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=128, vocab_size=256, n_layer=2, n_head=4, n_embd=128),
    "small": GPTConfig(block_size=256, vocab_size=256, n_layer=4, n_head=4, n_embd=256),
    "gpt2": GPTConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768),
}


def preset(name: str, *, vocab_size: int | None = None) -> GPTConfig:
    """A preset by name, optionally with another vocabulary (e.g. 50257 for ``u16`` data)."""
    try:
        config = PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}") from None
    return replace(config, vocab_size=vocab_size) if vocab_size is not None else config


def preset_for_tokens(name: str, token_vocab: int) -> GPTConfig:
    """A preset sized for a token format: the vocabulary grows to cover the tokens, never shrinks.

    So llm.c shards (GPT-2 ids, 50257) give every preset GPT-2's vocabulary, and ``gpt2`` stays GPT-2 124M
    on byte-level data (bytes are ids 0..255 of its vocabulary)."""
    base = preset(name)
    return replace(base, vocab_size=token_vocab) if token_vocab > base.vocab_size else base


#: a model's shape: GPT-2 (llm.c's layout) or a Llama-family decoder (Hugging Face's names)
ModelConfig = GPTConfig | LlamaConfig


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """A config from its dict: a Llama-family one carries ``arch``, GPT-2's has no such key."""
    if "arch" in data:
        return LlamaConfig.from_dict(dict(data))
    return GPTConfig.from_dict(dict(data))


def build_model(config: ModelConfig, *, generator: torch.Generator | None = None,
                device: torch.device | str | None = None) -> GPT | Llama:
    """The model of ``config``, initialised from ``generator``."""
    if isinstance(config, LlamaConfig):
        return Llama(config, generator=generator, device=device)
    return GPT(config, generator=generator, device=device)


#: a GPT-2 block's parameters in ``named_parameters`` order (llm.c's file order per layer)
GPT2_LAYER = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
              "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
              "mlp.c_proj.weight", "mlp.c_proj.bias")


def param_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The model's parameters (``named_parameters`` order, tied ``lm_head`` left out) and their shapes."""
    c, vp = config.n_embd, config.padded_vocab_size
    per_layer = {"ln_1.weight": (c,), "ln_1.bias": (c,), "attn.c_attn.weight": (3 * c, c),
                 "attn.c_attn.bias": (3 * c,), "attn.c_proj.weight": (c, c), "attn.c_proj.bias": (c,),
                 "ln_2.weight": (c,), "ln_2.bias": (c,), "mlp.c_fc.weight": (4 * c, c), "mlp.c_fc.bias": (4 * c,),
                 "mlp.c_proj.weight": (c, 4 * c), "mlp.c_proj.bias": (c,)}
    shapes: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (vp, c),
                                          "transformer.wpe.weight": (config.block_size, c)}
    for i in range(config.n_layer):
        for name in GPT2_LAYER:
            shapes[f"transformer.h.{i}.{name}"] = per_layer[name]
    shapes["transformer.ln_f.weight"] = (c,)
    shapes["transformer.ln_f.bias"] = (c,)
    return shapes


def pad_rows(wte: torch.Tensor, rows: int) -> torch.Tensor:
    """``wte`` with zero rows added up to ``rows`` (the padded vocabulary)."""
    if wte.shape[0] == rows:
        return wte
    out = torch.zeros((rows, wte.shape[1]), dtype=wte.dtype)
    out[: wte.shape[0]] = wte
    return out


def param_shapes_of(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The model's parameters in ``named_parameters`` order (a tied ``lm_head`` left out) and their shapes."""
    if isinstance(config, LlamaConfig):
        from gputravel.core.training.llama import llama_param_shapes

        return llama_param_shapes(config)
    return param_shapes(config)


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
