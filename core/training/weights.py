"""Pretrained GPT-2 weights in and out: llm.c's model file and Hugging Face safetensors.

The project's GPT-2 (:mod:`core.training.model`) is llm.c's, so its parameter names are those of llm.c's
``train_gpt2.py`` (``transformer.h.0.attn.c_attn.weight`` ...) and its ``nn.Linear`` weights are
``(out, in)``. The two public formats:

* **llm.c** (``gpt2_124M.bin``): a header of 256 little-endian int32 (magic 20240326, version 3 = fp32 or
  5 = bf16, then maxT, V, L, NH, C, padded V), then every parameter in llm.c's order (``wte`` padded to
  ``Vp`` rows, ``wpe``, then each per-layer tensor for all layers at once, ``ln_f``). The model's shape
  comes from the header.
* **safetensors** with the names of Hugging Face's ``GPT2LMHeadModel`` (``transformer.`` prefix optional,
  as in the published ``gpt2`` checkpoint; ``lm_head.weight`` absent or equal to ``wte``, the causal-mask
  buffers ``attn.bias``/``attn.masked_bias`` ignored). HF's ``Conv1D`` stores ``(in, out)``: every
  ``c_attn``/``c_proj``/``c_fc`` weight is transposed on the way in and out. The vocabulary is unpadded
  (50257 rows); the head count comes from the file's metadata (``n_head``, written by ``export``), a
  ``config.json`` beside it, or ``n_embd // 64`` (every GPT-2 size has 64-wide heads).

:func:`read_weights` gives the parameters under this project's names, fp32 and padded to the model's
vocabulary (padded rows are never looked up; from HF they are zeros). ``core/training/weights_upload.py``
turns them into a sealed state stream of kind ``weights`` that the device opens straight into its model (the
restore path): the weights are never trained, nor kept, in the orchestrator.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gputravel.core.errors import ConfigError, DataError, WeightsError
from gputravel.core.training.model import (
    GPT2_LAYER as _LAYER,
)
from gputravel.core.training.model import (
    GPTConfig,
    ModelConfig,
    pad_rows,
    param_shapes,
    param_shapes_of,
)

__all__ = ["LLMC_MAGIC", "WEIGHTS_KIND", "check_params", "check_weights", "detect_format", "gpt2_hf_tensors", "param_shapes",
           "read_config", "read_weights", "write_llmc", "write_safetensors", "write_weights"]

LLMC_MAGIC = 20240326
LLMC_VERSIONS = {3: torch.float32, 5: torch.bfloat16}
_LLMC_HEADER = 256 * 4
#: the stream kind of a weights upload (a restore of the model alone; a checkpoint's kind is "checkpoint")
WEIGHTS_KIND = "weights"
FORMATS = ("llmc", "safetensors")
#: the per-layer tensors in llm.c's order (llm.c writes each one for all layers before the next), which is
#: also the model's own registration order (so ``named_parameters`` and the digest)
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_HF_IGNORED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")
_HF_LAYER = re.compile(r"^h\.(\d+)\.(.+)$")


def _llmc_order(config: GPTConfig) -> list[str]:
    names = ["transformer.wte.weight", "transformer.wpe.weight"]
    names += [f"transformer.h.{i}.{name}" for name in _LAYER for i in range(config.n_layer)]
    return names + ["transformer.ln_f.weight", "transformer.ln_f.bias"]


def detect_format(path: Path) -> str:
    """``llmc`` or ``safetensors``, from the file's first bytes; anything else is a ``DataError``."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            head = f.read(9)
    except OSError as exc:
        raise DataError(f"cannot read weights file {path}: {exc.strerror or exc}") from None
    if len(head) >= 4 and struct.unpack("<i", head[:4])[0] == LLMC_MAGIC:
        return "llmc"
    if len(head) == 9 and head[8:9] == b"{" and 2 <= struct.unpack("<Q", head[:8])[0] < 100 << 20:
        return "safetensors"
    raise DataError(f"{path} is neither an llm.c model file (magic {LLMC_MAGIC}) nor safetensors "
                    f"(first bytes {head[:8].hex() or 'none: empty file'})")


# --- llm.c ---------------------------------------------------------------------------------------------
def _llmc_header(path: Path) -> tuple[GPTConfig, int, torch.dtype]:
    with Path(path).open("rb") as f:
        raw = f.read(_LLMC_HEADER)
    if len(raw) < _LLMC_HEADER:
        raise DataError(f"llm.c model file {path} is truncated: {len(raw)} bytes, shorter than its "
                        f"{_LLMC_HEADER}-byte header")
    h = struct.unpack("<256i", raw)
    if h[0] != LLMC_MAGIC:
        raise DataError(f"{path} has magic {h[0]}, not llm.c's {LLMC_MAGIC}")
    if h[1] not in LLMC_VERSIONS:
        raise DataError(f"llm.c model file {path} has version {h[1]}; this reads 3 (fp32) and 5 (bf16)")
    max_t, v, n_layer, n_head, c, vp = h[2:8]
    itemsize = 4 if h[1] == 3 else 2
    size = Path(path).stat().st_size
    if min(max_t, v, n_layer, n_head, c, vp) >= 1:  # the model's size by arithmetic, before any shape is listed
        per_layer = 12 * c * c + 13 * c
        claimed = _LLMC_HEADER + (vp * c + max_t * c + n_layer * per_layer + 2 * c) * itemsize
        if claimed != size:
            what = "truncated" if size < claimed else "longer than its header says"
            raise DataError(f"llm.c model file {path} is {what}: {size} bytes, the header's model takes {claimed}")
    try:
        config = GPTConfig(block_size=max_t, vocab_size=v, n_layer=n_layer, n_head=n_head, n_embd=c)
    except ConfigError as exc:
        raise DataError(f"llm.c model file {path}: its header describes no valid model ({exc.reason})") from None
    if vp < v:
        raise DataError(f"llm.c model file {path}: padded vocabulary {vp} is smaller than the vocabulary {v}")
    dtype = LLMC_VERSIONS[h[1]]
    shapes = _llmc_shapes(config, vp)
    want = _LLMC_HEADER + sum(int(np.prod(s)) for s in shapes.values()) * (4 if dtype == torch.float32 else 2)
    size = Path(path).stat().st_size
    if size != want:
        what = "truncated" if size < want else "longer than its header says"
        raise DataError(f"llm.c model file {path} is {what}: {size} bytes, the header's model takes {want}")
    return config, vp, dtype


def _llmc_shapes(config: GPTConfig, vp: int) -> dict[str, tuple[int, ...]]:
    shapes = param_shapes(config)
    shapes["transformer.wte.weight"] = (vp, config.n_embd)
    return shapes


def _read_llmc(path: Path) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    config, vp, dtype = _llmc_header(path)
    shapes = _llmc_shapes(config, vp)
    order = _llmc_order(config)
    itemsize = 4 if dtype == torch.float32 else 2
    counts = [int(np.prod(shapes[n])) for n in order]
    raw = np.fromfile(path, dtype=np.float32 if itemsize == 4 else np.int16, offset=_LLMC_HEADER)
    flat = torch.from_numpy(raw)
    if dtype == torch.bfloat16:
        flat = flat.view(torch.bfloat16)
    params: dict[str, torch.Tensor] = {}
    pos = 0
    for name, n in zip(order, counts, strict=True):  # views of the one read: no copy before the fp32 cast
        params[name] = flat[pos: pos + n].view(shapes[name])
        pos += n
    if vp != config.padded_vocab_size:  # another padding than the model's: the real rows, then zeros
        wte = params["transformer.wte.weight"][: config.vocab_size]
        params["transformer.wte.weight"] = pad_rows(wte, config.padded_vocab_size)
    return config, {name: params[name].to(torch.float32).contiguous() for name in param_shapes(config)}


def write_llmc(path: Path, config: GPTConfig, params: Mapping[str, torch.Tensor], *, dtype: str = "float32") -> None:
    """Write llm.c's model file (version 3 for ``float32``, 5 for ``bfloat16``), as ``train_gpt2.py``'s
    ``write_model`` does, with the model's padded vocabulary."""
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"llm.c files are float32 or bfloat16, not {dtype!r}")
    check_params(config, params)
    header = [0] * 256
    header[:8] = [LLMC_MAGIC, 3 if dtype == "float32" else 5, config.block_size, config.vocab_size,
                  config.n_layer, config.n_head, config.n_embd, config.padded_vocab_size]
    with _AtomicFile(path) as f:
        f.write(struct.pack("<256i", *header))
        for name in _llmc_order(config):
            t = params[name].detach().to("cpu", torch.float32 if dtype == "float32" else torch.bfloat16)
            if dtype == "bfloat16":
                t = t.view(torch.int16)
            f.write(t.contiguous().numpy().tobytes())


# --- safetensors ---------------------------------------------------------------------------------------
def _st_config(path: Path, tensors: Mapping[str, tuple[int, ...]], metadata: Mapping[str, str]) -> GPTConfig:
    try:
        vocab, c = tensors["wte.weight"]
        block = tensors["wpe.weight"][0]
    except (KeyError, ValueError):
        raise DataError(f"safetensors file {path} has no GPT-2 wte.weight/wpe.weight of two dimensions") from None
    layers = sorted({int(m.group(1)) for name in tensors if (m := _HF_LAYER.match(name))})
    if layers != list(range(len(layers))):
        raise DataError(f"safetensors file {path}: layers {layers} are not numbered 0..L-1")
    n_head: Any = metadata.get("n_head")
    beside = Path(path).parent / "config.json"
    if n_head is None and beside.is_file():
        try:
            n_head = json.loads(beside.read_text()).get("n_head")
        except (OSError, ValueError):
            raise DataError(f"{beside} (beside {path}) is not readable JSON") from None
    try:
        n_head = int(n_head) if n_head is not None else max(1, c // 64)
        return GPTConfig(block_size=block, vocab_size=vocab, n_layer=len(layers), n_head=n_head, n_embd=c)
    except (ConfigError, ValueError) as exc:
        raise DataError(f"safetensors file {path} describes no valid GPT-2: {exc}") from None


def _read_safetensors(path: Path, *, shape_only: bool = False) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    from gputravel.core.training.hf import check_safetensors

    check_safetensors(path)  # bounded: the header's sizes against the file's before anything is allocated
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            keys = [k for k in f.keys() if not _HF_IGNORED.match(k)]  # noqa: SIM118 (safe_open has no __iter__)
            names = {k.removeprefix("transformer."): k for k in keys}
            if len(names) != len(keys):
                raise DataError(f"safetensors file {path} holds names both with and without 'transformer.'")
            shapes = {n: tuple(f.get_slice(k).get_shape()) for n, k in names.items()}
            config = _st_config(path, shapes, metadata)
            want = {k.removeprefix("transformer."): s for k, s in param_shapes(config).items()}
            want["wte.weight"] = (config.vocab_size, config.n_embd)
            for name in _conv1d_hf(config):
                want[name] = want[name][::-1]
            missing = sorted(set(want) - set(shapes))
            extra = sorted(set(shapes) - set(want) - {"lm_head.weight"})
            if missing or extra:
                raise DataError(f"safetensors file {path} is not GPT2LMHeadModel's: missing {missing[:4]}, "
                                f"unexpected {extra[:4]}")
            bad = [f"{n} {shapes[n]} (want {s})" for n, s in want.items() if shapes[n] != s]
            if bad:
                raise DataError(f"safetensors file {path}: shapes differ from the model's: {', '.join(bad[:3])}")
            params: dict[str, torch.Tensor] = {}
            if shape_only:
                return config, params
            conv = set(_conv1d_hf(config))
            for name in want:
                t = f.get_tensor(names[name]).to(torch.float32)
                params["transformer." + name] = (t.t() if name in conv else t).contiguous()
            if "lm_head.weight" in names:
                head = f.get_tensor(names["lm_head.weight"]).to(torch.float32)
                if head.shape != params["transformer.wte.weight"].shape or not torch.equal(
                        head, params["transformer.wte.weight"]):
                    raise DataError(f"safetensors file {path}: lm_head.weight is not tied to wte.weight "
                                    "(this GPT-2 ties them)")
    except SafetensorError as exc:
        raise DataError(f"safetensors file {path} is unreadable: {exc}") from None
    params["transformer.wte.weight"] = pad_rows(params["transformer.wte.weight"], config.padded_vocab_size)
    return config, params


def _conv1d_hf(config: GPTConfig) -> list[str]:
    """The HF names of every ``Conv1D`` weight of the model (transposed on the way in and out)."""
    return [f"h.{i}.{name}" for i in range(config.n_layer) for name in _CONV1D]


def gpt2_hf_tensors(config: GPTConfig, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``GPT2LMHeadModel``'s tensors (``transformer.`` names, Conv1D weights ``(in, out)``, the real vocabulary;
    ``lm_head.weight`` left out as ``save_pretrained`` leaves out a tied tensor)."""
    check_params(config, params)
    conv = {"transformer." + n for n in _conv1d_hf(config)}
    out: dict[str, torch.Tensor] = {}
    for name in param_shapes(config):
        t = params[name].detach().to("cpu", torch.float32)
        if name == "transformer.wte.weight":
            t = t[: config.vocab_size]
        out[name] = (t.t() if name in conv else t).contiguous()
    return out


def write_safetensors(path: Path, config: GPTConfig, params: Mapping[str, torch.Tensor]) -> None:
    """Write ``GPT2LMHeadModel``'s tensors (:func:`gpt2_hf_tensors`) with the shape in the metadata."""
    from safetensors.torch import save

    out = gpt2_hf_tensors(config, params)
    meta = {"format": "pt", "n_head": str(config.n_head), "n_layer": str(config.n_layer),
            "n_embd": str(config.n_embd), "n_positions": str(config.block_size), "vocab_size": str(config.vocab_size),
            "producer": "gputravel export"}
    with _AtomicFile(path) as f:
        f.write(save(out, metadata=meta))


# --- both ----------------------------------------------------------------------------------------------
def read_config(path: Path) -> ModelConfig:
    """The model shape a weights file or Hugging Face folder holds (llm.c: from the header alone; a folder: from
    its config.json)."""
    path = Path(path)
    if path.is_dir():
        from gputravel.core.training.hf import read_hf_config

        return read_hf_config(path)
    if detect_format(path) == "llmc":
        return _llmc_header(path)[0]
    return _read_safetensors(path, shape_only=True)[0]


def read_weights(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model shape and its parameters (this project's names, fp32, padded vocabulary, CPU)."""
    path = Path(path)
    if path.is_dir():
        from gputravel.core.training.hf import read_hf_weights

        return read_hf_weights(path)
    fmt = detect_format(path)
    config, params = _read_llmc(path) if fmt == "llmc" else _read_safetensors(path)
    for name, t in params.items():
        if not bool(torch.isfinite(t).all()):
            raise WeightsError(f"weights file {path}: tensor {name} holds NaN or Inf values")
    return config, params


def write_weights(path: Path, config: GPTConfig, params: Mapping[str, torch.Tensor], *, fmt: str,
                  dtype: str = "float32") -> None:
    if fmt == "llmc":
        write_llmc(path, config, params, dtype=dtype)
    elif fmt == "safetensors":
        if dtype != "float32":
            raise ConfigError("safetensors export writes float32")
        write_safetensors(path, config, params)
    else:
        raise ConfigError(f"unknown weights format {fmt!r}; choose one of {', '.join(FORMATS)}")


def check_params(config: ModelConfig, params: Mapping[str, torch.Tensor]) -> None:
    """Every parameter of ``config``'s model present in ``params`` with its shape, or ``ConfigError``."""
    for name, shape in param_shapes_of(config).items():
        t = params.get(name)
        if t is None or tuple(t.shape) != shape:
            raise ConfigError(f"parameter {name} is {None if t is None else tuple(t.shape)}, the model's is {shape}")


class _AtomicFile:
    """Write ``path`` through a fresh temporary file in its folder (``mkstemp``: ``O_EXCL | O_NOFOLLOW``, a random
    name, so a planted link is never followed), renamed over it only when complete (a link at ``path`` itself is
    replaced, not written through)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def __enter__(self) -> Any:
        import os
        import tempfile

        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        self.tmp = Path(tmp)
        self.f = os.fdopen(fd, "wb")
        return self.f

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.f.close()
        if exc_type is None:
            self.tmp.replace(self.path)
        else:
            self.tmp.unlink(missing_ok=True)


def check_weights(path: Path) -> ModelConfig:
    """Everything ``--init-from`` will load, checked now (bounded headers, names, shapes, dtypes, finite values),
    one tensor at a time: ``run`` calls it before the run folder exists and any holder is contacted."""
    config, params = read_weights(path)
    del params
    return config
