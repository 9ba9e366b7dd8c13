"""What model a run trained, as ``gputravel runs ls/show`` names it: from what the run recorded, never the
preset's default (a run started ``--init-from`` a GPT-2 124M file was listed as ``model tiny``).

In this order: the architecture and size the run recorded in its settings (``model_arch`` / ``model_params``,
or a ``model_info`` object; a Llama folder's), then, for ``--init-from`` a GPT-2 file (llm.c's model file or
safetensors), the size its header gives (``gpt2 124M from gpt2_124M.bin``: the header is read, never the
weights), else the preset (``tiny``). Cheap: no torch, no numpy."""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path
from typing import Any

__all__ = ["model_label"]

LLMC_MAGIC = 20240326
LLMC_HEADER = 256 * 4


def _size(params: float) -> str:
    if params >= 1e9:
        return f"{params / 1e9:.1f}B".replace(".0B", "B")
    return f"{params / 1e6:.0f}M" if params >= 1e6 else f"{params / 1e3:.0f}K"


def _llmc_params(head: bytes) -> int | None:
    h = struct.unpack("<8i", head[:32])
    if h[0] != LLMC_MAGIC:
        return None
    max_t, v, n_layer, _n_head, c = h[2:7]
    # GPT-2: token and position embeddings, per layer 12 C^2 + 13 C (attention, MLP, two norms), a final norm
    return int(v * c + max_t * c + n_layer * (12 * c * c + 13 * c) + 2 * c)


def _safetensors_params(path: Path, head: bytes) -> int | None:
    (n,) = struct.unpack("<Q", head[:8])
    if not 2 <= n <= 100_000_000:
        return None
    with path.open("rb") as f:
        f.seek(8)
        doc = json.loads(f.read(n))
    total = 0
    for name, tensor in doc.items():
        if name == "__metadata__" or name.endswith("lm_head.weight"):  # tied to the token embedding
            continue
        count = 1
        for dim in tensor["shape"]:
            count *= int(dim)
        total += count
    return total


def _file_params(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, struct.error):
        with path.open("rb") as f:
            head = f.read(LLMC_HEADER)
        return _llmc_params(head) if len(head) >= 32 and struct.unpack("<i", head[:4])[0] == LLMC_MAGIC \
            else _safetensors_params(path, head)
    return None


def model_label(settings: dict[str, Any]) -> str:
    """``tiny``, ``gpt2 124M from gpt2_124M.bin``, ``llama 1.2B from <folder>``: see the module's docstring."""
    preset = str(settings.get("model") or "?")
    init = settings.get("init_from")
    source = f" from {Path(str(init)).name}" if init else ""
    recorded = settings.get("model_info")
    info: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    arch = settings.get("model_arch") or info.get("arch") or info.get("architecture")
    params = settings.get("model_params") or info.get("params") or info.get("parameters")
    if arch or params:
        size = _size(float(params)) if isinstance(params, int | float) else (str(params) if params else "")
        return " ".join(str(p) for p in (arch or preset, size) if p) + source
    if init:
        counted = _file_params(Path(str(init)))
        return f"gpt2 {_size(counted)}{source}" if counted else f"pretrained{source}"
    return preset
