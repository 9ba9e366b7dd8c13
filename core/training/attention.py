"""The attention core GPT-2 and the Llama family share: heads, rotary positions (Llama), grouped-query
attention (Llama), causal or windowed masking, and the merge of the heads back.

Each model keeps its own projections (GPT-2's fused ``c_attn``, Llama's ``q/k/v_proj``, so parameter names and
LoRA targets stay Hugging Face's and llm.c's) and hands the projected queries, keys and values here. GPT-2 passes
no rotary table, no mask and equal head counts: the very calls it made before (llm.c and ``transformers``
reference tests unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_attention", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The second half of the last dimension, negated, before the first (rotary embeddings' pair swap)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, n_head: int, n_kv_head: int,
                     head_dim: int, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                     mask: torch.Tensor | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention over projected ``q`` ``(b, t, n_head * head_dim)`` and ``k``, ``v``
    ``(b, t, n_kv_head * head_dim)``; returns ``(b, t, n_head * head_dim)``, heads merged.

    ``rotary``: ``(cos, sin)`` applied to queries and keys; ``mask``: a boolean mask instead of the plain causal
    one (Mistral's sliding window); ``n_kv_head < n_head``: grouped-query attention.
    """
    b, t, _ = q.shape
    qh = q.view(b, t, n_head, head_dim).transpose(1, 2)
    kh = k.view(b, t, n_kv_head, head_dim).transpose(1, 2)
    vh = v.view(b, t, n_kv_head, head_dim).transpose(1, 2)
    if rotary is not None:
        cos, sin = rotary
        qh = qh * cos + rotate_half(qh) * sin
        kh = kh * cos + rotate_half(kh) * sin
    gqa = n_kv_head != n_head
    if mask is None:
        y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa)
    else:
        y = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)
    return y.transpose(1, 2).reshape(b, t, n_head * head_dim)
