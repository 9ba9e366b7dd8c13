"""The model families a run can train, torch-free (the orchestrator names them without loading torch)."""

from __future__ import annotations

__all__ = ["ARCHITECTURES", "DEFAULT_LORA_TARGETS", "architecture_of"]

#: this project's name of each Llama-family variant -> the Hugging Face class its config.json names
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
#: LoRA's targets when ``--lora-targets`` is not given: the attention projections
DEFAULT_LORA_TARGETS = {"gpt2": ("c_attn",), "llama": ("q_proj", "k_proj", "v_proj", "o_proj")}


def architecture_of(model: dict[str, object]) -> str:
    """The Hugging Face class of a model config's dict (GPT-2's has no ``arch``)."""
    return ARCHITECTURES.get(str(model.get("arch")), "GPT2LMHeadModel")
