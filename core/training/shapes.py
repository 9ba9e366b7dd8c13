"""Model shapes without torch: GPT-2's and the Llama family's configurations, the presets, every parameter's name
and shape. The orchestrator plans a run from these (``core/compose.py``) and never imports torch for it; the
model code (``model.py``, ``llama.py``) builds the modules from the same classes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from gputravel.core.errors import ConfigError
from gputravel.core.training.families import ARCHITECTURES

__all__ = ["GPT2_LAYER", "PRESETS", "GPTConfig", "LlamaConfig", "ModelConfig", "llama_param_shapes",
           "model_config_from_dict", "param_shapes", "param_shapes_of", "preset", "preset_for_tokens"]

_VOCAB_PAD = 128


def _known_keys(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``data`` whose keys are all fields of the dataclass ``cls``; any other key is a ``ConfigError``
    naming it (a config from a file or the wire is never silently trimmed)."""
    unknown = set(data) - {f.name for f in fields(cls)}
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} keys: {', '.join(sorted(unknown))}")
    return dict(data)


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
        return cls(**_known_keys(cls, data))


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


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """A config from its dict: a Llama-family one carries ``arch``, GPT-2's has no such key."""
    if "arch" in data:
        return LlamaConfig.from_dict(dict(data))
    return GPTConfig.from_dict(dict(data))


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-family model. ``rope_scaling`` is Llama 3's (``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``) or empty."""

    arch: str = "llama"
    vocab_size: int = 256
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    block_size: int = 128
    rope_theta: float = 10000.0
    rope_scaling: dict[str, float] = field(default_factory=dict)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # q/k/v/o (Llama's flag); Qwen2: q/k/v always, o never
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral: each position attends to at most this many

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"unknown Llama-family variant {self.arch!r}; choose one of {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "n_embd", "n_layer", "n_head", "n_kv_head", "head_dim", "intermediate_size",
                     "block_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.n_head % self.n_kv_head:
            raise ConfigError(f"LlamaConfig: n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.head_dim % 2:
            raise ConfigError(f"LlamaConfig.head_dim ({self.head_dim}) must be even (rotary pairs)")
        if not (self.rope_theta > 0 and self.rms_norm_eps > 0):
            raise ConfigError("LlamaConfig: rope_theta and rms_norm_eps must be positive")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"LlamaConfig.sliding_window must be positive, got {self.sliding_window}")
        if self.rope_scaling:
            want = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
            if set(self.rope_scaling) != want:
                raise ConfigError(f"LlamaConfig.rope_scaling is Llama 3's ({', '.join(sorted(want))}), "
                                  f"got {sorted(self.rope_scaling)}")
            if not self.rope_scaling["high_freq_factor"] > self.rope_scaling["low_freq_factor"]:
                raise ConfigError("LlamaConfig.rope_scaling: high_freq_factor must exceed low_freq_factor")

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, str(v)) for k, v in self.to_dict().items())))

    @property
    def architecture(self) -> str:
        """The Hugging Face class name (``LlamaForCausalLM`` ...)."""
        return ARCHITECTURES[self.arch]

    @property
    def padded_vocab_size(self) -> int:  # no padding: the shapes are the folder's
        return self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlamaConfig:
        """Rebuild a config; unknown keys are a ``ConfigError``."""
        d = _known_keys(cls, data)
        d["rope_scaling"] = {str(k): float(v) for k, v in dict(d.get("rope_scaling") or {}).items()}
        return cls(**d)


def llama_param_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter in ``named_parameters`` order and its shape (a tied ``lm_head`` left out)."""
    c, hd, qk_bias = config.n_embd, config.head_dim, config.attention_bias or config.arch == "qwen2"
    o_bias = config.attention_bias and config.arch != "qwen2"
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, c)}
    for i in range(config.n_layer):
        p = f"model.layers.{i}."
        for name, out, inp, bias in (("q_proj", config.n_head * hd, c, qk_bias), ("k_proj", config.n_kv_head * hd,
                                     c, qk_bias), ("v_proj", config.n_kv_head * hd, c, qk_bias),
                                     ("o_proj", c, config.n_head * hd, o_bias)):
            shapes[f"{p}self_attn.{name}.weight"] = (out, inp)
            if bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out,)
        for name, out, inp in (("gate_proj", config.intermediate_size, c), ("up_proj", config.intermediate_size, c),
                               ("down_proj", c, config.intermediate_size)):
            shapes[f"{p}mlp.{name}.weight"] = (out, inp)
            if config.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = (out,)
        shapes[f"{p}input_layernorm.weight"] = (c,)
        shapes[f"{p}post_attention_layernorm.weight"] = (c,)
    shapes["model.norm.weight"] = (c,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, c)
    return shapes


#: a model's shape: GPT-2 (llm.c's layout) or a Llama-family decoder (Hugging Face's names)
ModelConfig = GPTConfig | LlamaConfig


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


def param_shapes_of(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The model's parameters in ``named_parameters`` order (a tied ``lm_head`` left out) and their shapes."""
    if isinstance(config, LlamaConfig):
        return llama_param_shapes(config)
    return param_shapes(config)
