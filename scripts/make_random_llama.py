"""Write a Hugging Face folder (``config.json`` + ``model.safetensors``) of a Llama-shaped model with random
weights, from this project's own model code (no ``transformers`` needed), for ``bench train --init-from DIR``.

    python scripts/make_random_llama.py --shape smollm2-135m --out /tmp/smollm2-135m-random

``smollm2-135m`` is SmolLM2-135M's ``config.json`` (hidden 576, 30 layers, 9 heads, 3 KV heads, head 64,
intermediate 1536, vocabulary 49,152, tied embeddings, rope_theta 100,000): 134,515,008 parameters, 538 MB in
fp32. ``llama-tiny`` is a small shape for a quick look. The weights are the model's own initialisation from
``--seed``: random, not SmolLM2's (a measurement of speed and sizes, never of quality).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save

from gputravel.core.training.export import atomic_write
from gputravel.core.training.hf import hf_config_json, read_hf_config
from gputravel.core.training.llama import LlamaConfig
from gputravel.core.training.model import build_model

SHAPES = {
    "smollm2-135m": LlamaConfig(arch="llama", vocab_size=49152, n_embd=576, n_layer=30, n_head=9, n_kv_head=3,
                                head_dim=64, intermediate_size=1536, block_size=8192, rope_theta=100000.0,
                                rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-tiny": LlamaConfig(arch="llama", vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_kv_head=2,
                              head_dim=16, intermediate_size=128, block_size=128),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (created)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = SHAPES[args.shape]
    model = build_model(config, generator=torch.Generator().manual_seed(args.seed))
    tensors = {n: p.detach().to(torch.float32).contiguous() for n, p in model.named_parameters()}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out / "config.json", json.dumps(hf_config_json(config), indent=2).encode() + b"\n")
    atomic_write(args.out / "model.safetensors", save(tensors, metadata={"format": "pt"}))
    if read_hf_config(args.out) != config:  # the folder reads back as the shape it was made from
        print(f"{args.out}: config.json does not read back as {args.shape}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(args.out), "shape": args.shape, "params": sum(t.numel() for t in tensors.values()),
                      "bytes": (args.out / "model.safetensors").stat().st_size}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
