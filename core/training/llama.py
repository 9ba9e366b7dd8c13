"""The Llama family in this project's own code: Llama 2/3, Qwen2, Mistral, SmolLM2.

One decoder, the variants are configuration: RMSNorm, rotary position embeddings (``rope_theta``, and Llama 3's
frequency scaling), grouped-query attention (``n_kv_head`` key/value heads shared by ``n_head // n_kv_head``
query heads each), a SwiGLU MLP, tied or untied embeddings, attention biases where the config says (Qwen2 has
them on q/k/v). The parameter names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight`` ...), so a
Hugging Face folder loads by name and a merged export is written by name; ``nn.Linear`` weights are ``(out, in)``
as in ``transformers``. ``transformers`` itself is a test-only reference: the device runs this code.

The interface is :class:`~gputravel.core.training.model.GPT`'s: ``model(idx, targets) -> (logits, loss)``,
``init_weights(generator)`` (N(0, 0.02) from the generator on the CPU, norms 1, biases 0), ``num_parameters()``.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from gputravel.core.errors import ConfigError
from gputravel.core.training.attention import causal_attention
from gputravel.core.training.families import ARCHITECTURES
from gputravel.core.training.shapes import LlamaConfig, llama_param_shapes

__all__ = ["ARCHITECTURES", "Llama", "LlamaConfig", "llama_param_shapes", "rope_frequencies"]



def rope_frequencies(config: LlamaConfig) -> torch.Tensor:
    """The rotary inverse frequencies (``head_dim / 2`` of them), with Llama 3's scaling when configured."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    rs = config.rope_scaling
    if not rs:
        return inv
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = self.weight * h.to(x.dtype)
        return out


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        hd, c = config.head_dim, config.n_embd
        qk_bias = config.attention_bias or config.arch == "qwen2"
        self.q_proj = nn.Linear(c, config.n_head * hd, bias=qk_bias)
        self.k_proj = nn.Linear(c, config.n_kv_head * hd, bias=qk_bias)
        self.v_proj = nn.Linear(c, config.n_kv_head * hd, bias=qk_bias)
        self.o_proj = nn.Linear(config.n_head * hd, c, bias=config.attention_bias and config.arch != "qwen2")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
                ) -> torch.Tensor:
        cfg = self.config
        y = causal_attention(self.q_proj(x), self.k_proj(x), self.v_proj(x), n_head=cfg.n_head,
                             n_kv_head=cfg.n_kv_head, head_dim=cfg.head_dim, rotary=(cos, sin), mask=mask)
        out: torch.Tensor = self.o_proj(y)
        return out


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c, m, bias = config.n_embd, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(c, m, bias=bias)
        self.up_proj = nn.Linear(c, m, bias=bias)
        self.down_proj = nn.Linear(m, c, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = SwiGLU(config)
        self.input_layernorm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
                ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Llama(nn.Module):
    """A Llama-family decoder. Built like :class:`~gputravel.core.training.model.GPT`: allocated empty, then
    initialised from ``generator`` on the CPU (the same seed, the same weights on every device)."""

    def __init__(self, config: LlamaConfig, *, generator: torch.Generator | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.model = nn.ModuleDict({
                "embed_tokens": nn.Embedding(config.vocab_size, config.n_embd),
                "layers": nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layer)),
                "norm": RMSNorm(config.n_embd, config.rms_norm_eps),
            })
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.to_empty(device="cpu")
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model["embed_tokens"].weight  # type: ignore[assignment]  # tied
        self.register_buffer("inv_freq", rope_frequencies(config), persistent=False)
        self.init_weights(generator)
        if device is not None:
            self.to(device)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        if generator is None:
            generator = torch.Generator().manual_seed(0)
        for module in self.modules():  # registration order: deterministic
            if isinstance(module, nn.Linear):
                if module is self.lm_head and self.config.tie_word_embeddings:
                    continue
                _normal_cpu(module.weight, 0.02, generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                _normal_cpu(module.weight, 0.02, generator)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, T, vocab_size)`` and, given targets, the mean cross-entropy loss."""
        _, t = idx.shape
        cfg = self.config
        if t > cfg.block_size:
            raise ConfigError(f"sequence length {t} exceeds block_size {cfg.block_size}")
        inv_freq = cast(torch.Tensor, self.inv_freq)
        freqs = torch.arange(t, device=idx.device, dtype=torch.float32)[:, None] * inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.model["embed_tokens"](idx)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        mask = None
        if cfg.sliding_window is not None and t > cfg.sliding_window:
            pos = torch.arange(t, device=idx.device)
            diff = pos[:, None] - pos[None, :]
            mask = (diff >= 0) & (diff < cfg.sliding_window)
        for layer in cast(nn.ModuleList, self.model["layers"]):
            x = layer(x, cos, sin, mask)
        logits = self.lm_head(self.model["norm"](x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _normal_cpu(tensor: torch.Tensor, std: float, generator: torch.Generator) -> None:
    if tensor.device.type == "cpu" and generator.device.type == "cpu":
        nn.init.normal_(tensor, 0.0, std, generator=generator)
    else:
        tensor.copy_(torch.empty(tensor.shape, dtype=tensor.dtype).normal_(0.0, std, generator=generator))
