"""Hugging Face model folders in: ``config.json`` + ``model.safetensors`` (or a sharded index), read with bounds.

Four architectures, by the class ``config.json`` names: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``MistralForCausalLM`` (this project's :class:`~gputravel.core.training.llama.Llama`) and ``GPT2LMHeadModel``
(:class:`~gputravel.core.training.model.GPT`); any other is refused by name. The model's shape comes from
``config.json``, and with it the exact tensors (names, shapes) the folder must hold.

Every safetensors header is checked before anything is allocated: its length against the file's (and a 100 MiB
cap), each tensor's dtype (F32, F16, BF16), offsets inside the file and byte count equal to its shape's, the
tensors' names and shapes against the config's model (so a header cannot describe more than the config's model,
whatever it says). A sparse file (its allocated blocks far fewer than its length) is refused, as is a shard
index naming a file outside the folder. Each tensor is then read on its own, widened to fp32 and checked finite:
NaN or Inf is a :class:`WeightsError` naming the tensor. All of this runs in ``run`` before the run folder is
created, so before any holder is contacted.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gputravel.core.errors import ConfigError, WeightsError
from gputravel.core.training.llama import ARCHITECTURES, LlamaConfig
from gputravel.core.training.model import GPTConfig, ModelConfig, pad_rows, param_shapes_of

__all__ = ["SUPPORTED", "TensorFile", "check_safetensors", "hf_config_json", "is_hf_folder", "read_hf_config",
           "read_hf_weights"]

#: Hugging Face class -> this project's variant
SUPPORTED = {**{hf: arch for arch, hf in ARCHITECTURES.items()}, "GPT2LMHeadModel": "gpt2"}
MAX_HEADER = 100 << 20
MAX_CONFIG = 1 << 20
_DTYPES = {"F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2)}
_GPT2_IGNORED = (".attn.bias", ".attn.masked_bias")
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def is_hf_folder(path: Path) -> bool:
    return Path(path).is_dir()


def _read_json(path: Path, what: str) -> Any:
    try:
        st = os.stat(path)
        if not _regular(st.st_mode):
            raise WeightsError(f"{what} {path} is not a regular file")
        if st.st_size > MAX_CONFIG:
            raise WeightsError(f"{what} {path} is {st.st_size} bytes; at most {MAX_CONFIG} are read")
        return json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise WeightsError(f"{path} is missing: a Hugging Face model folder holds {path.name}") from None
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{what} {path} is not readable JSON: {exc}") from None


def _regular(mode: int) -> bool:
    import stat

    return stat.S_ISREG(mode)


def read_hf_config(folder: Path) -> ModelConfig:
    """The model of ``folder/config.json``; an architecture other than the four is a ``ConfigError`` by name."""
    raw = _read_json(Path(folder) / "config.json", "config")
    if not isinstance(raw, dict):
        raise WeightsError(f"{folder}/config.json is not a JSON object")
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else None
    if not archs:
        raise ConfigError(f"{folder}/config.json names no architectures (model_type {raw.get('model_type')!r}): "
                          f"add \"architectures\": [\"...\"] naming its class, one of {', '.join(SUPPORTED)}")
    if arch not in SUPPORTED:
        raise ConfigError(f"{folder}: architecture {archs!r} is not supported; this reads "
                          f"{', '.join(SUPPORTED)}")
    try:
        if arch == "GPT2LMHeadModel":
            return _gpt2_config(raw)
        return _llama_config(SUPPORTED[arch], raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise WeightsError(f"{folder}/config.json does not describe a {arch}: {exc!r}") from None


def _gpt2_config(raw: dict[str, Any]) -> GPTConfig:
    act = raw.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"GPT-2 with activation {act!r}: this GPT-2 uses tanh-approximated GELU (gelu_new)")
    return GPTConfig(block_size=int(raw["n_positions"]), vocab_size=int(raw["vocab_size"]), n_layer=int(raw["n_layer"]),
                     n_head=int(raw["n_head"]), n_embd=int(raw["n_embd"]))


def _llama_config(arch: str, raw: dict[str, Any]) -> LlamaConfig:
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{arch} with hidden_act {raw.get('hidden_act')!r}: this decoder's MLP is SwiGLU (silu)")
    rope = dict(raw.get("rope_parameters") or {})
    if not rope:  # the pre-5 form: rope_theta beside rope_scaling
        rope = {"rope_theta": raw.get("rope_theta", 10000.0), **dict(raw.get("rope_scaling") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling: dict[str, float] = {}
    if kind == "llama3":
        scaling = {k: float(rope[k]) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings")}
    elif kind != "default":
        raise ConfigError(f"{arch}: rotary scaling {kind!r} is not supported (default and llama3 are)")
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    window = raw.get("sliding_window")
    if arch == "qwen2":
        window = _qwen2_window(raw)
    tie = raw.get("tie_word_embeddings", False)
    return LlamaConfig(
        arch=arch, vocab_size=int(raw["vocab_size"]), n_embd=hidden, n_layer=int(raw["num_hidden_layers"]),
        n_head=heads, n_kv_head=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads), intermediate_size=int(raw["intermediate_size"]),
        block_size=int(raw.get("max_position_embeddings", 2048)), rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=scaling, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), tie_word_embeddings=bool(tie),
        attention_bias=bool(raw.get("attention_bias", False)), mlp_bias=bool(raw.get("mlp_bias", False)),
        sliding_window=None if window is None else int(window))


def _qwen2_window(raw: dict[str, Any]) -> int | None:
    """Qwen2's window, as transformers applies it: on the layers ``layer_types`` names ``sliding_attention``, by
    default those from ``max_window_layers`` (28) on, and only with ``use_sliding_window``. This decoder has one
    window for every layer or none, so a window on some layers only is refused by name."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    n_layer = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types") or ["sliding_attention" if window is not None and i >= int(
        raw.get("max_window_layers", 28)) else "full_attention" for i in range(n_layer)]
    sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    if not sliding or window is None:
        return None
    if len(sliding) < n_layer:
        raise ConfigError(f"qwen2: a sliding window on layers {sliding} of {n_layer} only (layer_types, "
                          "max_window_layers) is not supported: this decoder slides the window on every layer or "
                          "none (set max_window_layers to 0 or to num_hidden_layers, or use_sliding_window false, "
                          "if that is the model you mean)")
    return int(window)


@dataclass(frozen=True, slots=True)
class _Entry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file


@dataclass(frozen=True, slots=True)
class TensorFile:
    """A safetensors file's checked header: its tensors (name -> entry) and metadata."""

    path: Path
    tensors: dict[str, _Entry]
    metadata: dict[str, str]


def check_safetensors(path: Path) -> TensorFile:
    """Parse and bound ``path``'s header (see the module's docstring); nothing of its data is read."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise WeightsError(f"cannot open safetensors file {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not _regular(st.st_mode):
            raise WeightsError(f"safetensors file {path} is not a regular file")
        size = st.st_size
        if size > (1 << 20) and st.st_blocks * 512 < size // 2:
            raise WeightsError(f"safetensors file {path} is sparse: {st.st_blocks * 512} bytes allocated of the "
                               f"{size} it claims")
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise WeightsError(f"safetensors file {path} is truncated: {size} bytes, no header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise WeightsError(f"safetensors file {path}: header length {n} exceeds the file ({size} bytes) or "
                               f"the {MAX_HEADER}-byte cap")
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise WeightsError(f"safetensors file {path}: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"safetensors file {path}: its header is not a JSON object")
    data_len = size - 8 - n
    meta = header.pop("__metadata__", None) or {}
    tensors: dict[str, _Entry] = {}
    for name, desc in header.items():
        try:
            dtype, shape, (begin, end) = desc["dtype"], tuple(int(d) for d in desc["shape"]), desc["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise WeightsError(f"safetensors file {path}: tensor {name!r} has no dtype/shape/data_offsets") from None
        if dtype not in _DTYPES:
            raise WeightsError(f"safetensors file {path}: tensor {name} has dtype {dtype}; this reads "
                               f"{', '.join(_DTYPES)}")
        if any(d < 0 for d in shape) or not (type(begin) is int and type(end) is int and 0 <= begin <= end <= data_len):
            raise WeightsError(f"safetensors file {path}: tensor {name} lies outside the file "
                               f"(offsets {begin}..{end} of {data_len} data bytes)")
        if end - begin != math.prod(shape) * _DTYPES[dtype][1]:
            raise WeightsError(f"safetensors file {path}: tensor {name} of shape {list(shape)} {dtype} takes "
                               f"{end - begin} bytes, not {math.prod(shape) * _DTYPES[dtype][1]}")
        tensors[name] = _Entry(path, dtype, shape, 8 + n + begin)
    return TensorFile(path, tensors, {str(k): str(v) for k, v in dict(meta).items()})


def _folder_tensors(folder: Path) -> dict[str, _Entry]:
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.exists():
        return check_safetensors(single).tensors
    if not index.exists():
        pickled = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
        hint = (f" ({pickled[0]} is PyTorch's pickle, never read here: it can run code; save the model as "
                "safetensors, e.g. transformers' save_pretrained(DIR), which writes model.safetensors)") if pickled else ""
        raise WeightsError(f"{folder} holds neither model.safetensors nor model.safetensors.index.json{hint}")
    weight_map = _read_json(index, "shard index").get("weight_map")
    if not isinstance(weight_map, dict):
        raise WeightsError(f"{index} has no weight_map")
    out: dict[str, _Entry] = {}
    for shard in sorted(set(weight_map.values())):
        if not isinstance(shard, str) or Path(shard).name != shard or shard.startswith("."):
            raise WeightsError(f"{index} names shard {shard!r}: shards are files of the folder itself")
        for name, entry in check_safetensors(folder / shard).tensors.items():
            if weight_map.get(name) != shard or name in out:
                raise WeightsError(f"{folder}: tensor {name} in {shard} is not where the index puts it")
            out[name] = entry
    missing = sorted(set(weight_map) - set(out))
    if missing:
        raise WeightsError(f"{folder}: the index names tensors no shard holds: {missing[:3]}")
    return out


def _expected(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The folder's tensor names -> shapes that this config's model takes (GPT-2: HF's layout)."""
    shapes = param_shapes_of(config)
    if isinstance(config, LlamaConfig):
        return dict(shapes)
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        short = name.removeprefix("transformer.")
        if short == "wte.weight":
            shape = (config.vocab_size, config.n_embd)
        elif short.endswith(_CONV1D):
            shape = shape[::-1]
        out[short] = shape
    return out


def _plan(folder: Path) -> tuple[ModelConfig, dict[str, _Entry], dict[str, str]]:
    """The config, and for each expected tensor (folder name) its entry; checks names and shapes first."""
    config = read_hf_config(folder)
    found = _folder_tensors(Path(folder))
    gpt2 = not isinstance(config, LlamaConfig)
    names: dict[str, str] = {}  # expected name -> the folder's name
    extra = []
    for name in found:
        short = name.removeprefix("transformer.") if gpt2 else name
        if gpt2 and short.endswith(_GPT2_IGNORED) or name.endswith("rotary_emb.inv_freq"):
            continue
        if short in names:
            raise WeightsError(f"{folder} holds {short} twice (with and without 'transformer.')")
        names[short] = name
    want = _expected(config)
    tied_head = "lm_head.weight" in names and "lm_head.weight" not in want
    extra = sorted(set(names) - set(want) - ({"lm_head.weight"} if tied_head else set()))
    missing = sorted(set(want) - set(names))
    if missing or extra:
        raise WeightsError(f"{folder} is not {getattr(config, 'architecture', 'GPT2LMHeadModel')}'s model of its "
                           f"config.json: missing {missing[:4]}, unexpected {extra[:4]}")
    bad = [f"{n} {list(found[names[n]].shape)} (want {list(s)})" for n, s in want.items()
           if found[names[n]].shape != s]
    if tied_head and found[names["lm_head.weight"]].shape != want[_embed(config)]:
        bad.append("lm_head.weight (tied: want the embedding's shape)")
    if bad:
        raise WeightsError(f"{folder}: tensor shapes differ from config.json's model: {', '.join(bad[:3])}")
    entries = {n: found[names[n]] for n in want}
    if tied_head:
        entries["lm_head.weight"] = found[names["lm_head.weight"]]
    return config, entries, names


def _embed(config: ModelConfig) -> str:
    return "model.embed_tokens.weight" if isinstance(config, LlamaConfig) else "wte.weight"


def _read_entry(name: str, e: _Entry) -> torch.Tensor:
    dtype, size = _DTYPES[e.dtype]
    n = math.prod(e.shape) * size
    out = torch.empty(n, dtype=torch.uint8)
    with open(e.file, "rb", buffering=0) as f:  # noqa: PTH123 (readinto a tensor's memory)
        f.seek(e.start)
        arr: Any = out.numpy()
        view = memoryview(arr)
        got = 0
        while got < n:
            k = f.readinto(view[got:])
            if not k:
                raise WeightsError(f"{e.file}: tensor {name} is cut short ({got} of {n} bytes)")
            got += k
    t = out.view(dtype).view(e.shape).to(torch.float32)
    if not bool(torch.isfinite(t).all()):
        raise WeightsError(f"{e.file}: tensor {name} holds NaN or Inf values")
    return t


def _iter_weights(folder: Path) -> Iterator[tuple[ModelConfig, str, torch.Tensor]]:
    config, entries, _ = _plan(folder)
    for name, entry in entries.items():
        yield config, name, _read_entry(name, entry)


def read_hf_weights(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model of ``folder`` and its parameters under this project's names (fp32, CPU; GPT-2's vocabulary padded,
    its Conv1D weights transposed)."""

    folder = Path(folder)
    config, entries, _ = _plan(folder)
    params: dict[str, torch.Tensor] = {}
    for name, entry in entries.items():
        params[name] = _read_entry(name, entry)
    if isinstance(config, LlamaConfig):
        head = params.pop("lm_head.weight", None)
        if config.tie_word_embeddings and head is not None and not torch.equal(head, params["model.embed_tokens.weight"]):
            raise WeightsError(f"{folder}: lm_head.weight differs from the embedding, but config.json ties them")
        if not config.tie_word_embeddings:
            assert head is not None  # an untied head is among the expected tensors: _plan checked it is there
            params["lm_head.weight"] = head
        return config, params
    head = params.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, params["wte.weight"]):
        raise WeightsError(f"{folder}: lm_head.weight is not tied to wte.weight (this GPT-2 ties them)")
    out: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        if name.endswith(_CONV1D):
            t = t.t().contiguous()
        out["transformer." + name] = t
    out["transformer.wte.weight"] = pad_rows(out["transformer.wte.weight"], config.padded_vocab_size)
    return config, out


def hf_config_json(config: ModelConfig) -> dict[str, Any]:
    """``config.json`` for a Hugging Face folder of this model (``export --format hf``)."""
    if isinstance(config, LlamaConfig):
        d: dict[str, Any] = {
            "architectures": [config.architecture], "model_type": config.arch, "vocab_size": config.vocab_size,
            "hidden_size": config.n_embd, "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
            "num_key_value_heads": config.n_kv_head, "head_dim": config.head_dim,
            "intermediate_size": config.intermediate_size, "max_position_embeddings": config.block_size,
            "rms_norm_eps": config.rms_norm_eps, "tie_word_embeddings": config.tie_word_embeddings,
            "hidden_act": "silu", "torch_dtype": "float32", "dtype": "float32",
            "rope_theta": config.rope_theta,
            "rope_parameters": {"rope_type": "llama3" if config.rope_scaling else "default",
                                "rope_theta": config.rope_theta, **config.rope_scaling},
        }
        if config.arch == "llama":
            d.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)
        if config.arch == "mistral":
            d["sliding_window"] = config.sliding_window
        if config.arch == "qwen2":
            window = config.sliding_window  # on every layer (the only Qwen2 window read: _qwen2_window)
            d.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=0)
        return d
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_positions": config.block_size, "n_embd": config.n_embd, "n_layer": config.n_layer,
            "n_head": config.n_head, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "tie_word_embeddings": True, "torch_dtype": "float32", "dtype": "float32"}
