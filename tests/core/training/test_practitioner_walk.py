"""A practitioner's walk through fine-tuning a Hugging Face folder (session 15): what a careful user tripped
on, each fix's check. The Qwen2 window's tests are with the other architectures (test_llama.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gputravel.core.compose import resolve_holder_dirs
from gputravel.core.errors import ConfigError
from gputravel.core.training.hftokenizer import ModelTokenizer, tokenizer_hash
from tests.helpers import small_settings, write_holders

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 64}


def _folder(path: Path, config: dict[str, object], *files: str) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    for name in files:
        (path / name).write_bytes(b"\x0a\x03not")
    return path


@pytest.mark.parametrize("files", [("tokenizer.model",), ("tokenizer.model", "tokenizer_config.json")])
def test_a_sentencepiece_tokenizer_is_refused_not_ignored(tmp_path: Path, files: tuple[str, ...]) -> None:
    """A Llama 2 or Mistral folder with only sentencepiece's tokenizer.model took byte-level text as its ids:
    the model trained on ids its tokenizer never made."""
    model = _folder(tmp_path / "model", LLAMA, *files)
    with pytest.raises(ConfigError, match=rf"{files[0]} but no tokenizer.json.*save_pretrained.*data fetch --tokenizer"):
        tokenizer_hash(model)
    with pytest.raises(ConfigError, match=rf"{files[0]} but no tokenizer.json"):
        ModelTokenizer.load(model)
    data = write_holders(tmp_path / "data", {"alice": 1, "bob": 2}, n_words=200)
    with pytest.raises(ConfigError, match=rf"{files[0]} but no tokenizer.json"):
        resolve_holder_dirs(small_settings(data, tmp_path / "out", init_from=model))


def test_a_folder_with_no_tokenizer_at_all_still_takes_the_data_as_it_is(tmp_path: Path) -> None:
    model = _folder(tmp_path / "model", LLAMA, "generation_config.json")
    assert tokenizer_hash(model) is None
    data = write_holders(tmp_path / "data", {"alice": 1, "bob": 2}, n_words=200)
    assert [name for name, _ in resolve_holder_dirs(small_settings(data, tmp_path / "out", init_from=model))] == [
        "alice", "bob"]


def test_a_slow_bpe_is_refused_unless_the_folder_is_gpt2s(tmp_path: Path) -> None:
    """A Llama (or Qwen2) folder with its tokenizer as vocab.json + merges.txt and no tokenizer.json took
    byte-level text as its ids (left alone in session 15, refused since): a GPT-2 folder of that form still takes
    llm.c's GPT-2 shards, which that tokenizer made."""
    llama = _folder(tmp_path / "llama", LLAMA, "vocab.json", "merges.txt")
    with pytest.raises(ConfigError, match=r"as vocab.json \+ merges.txt but no tokenizer.json.*save_pretrained"):
        tokenizer_hash(llama)
    data = write_holders(tmp_path / "data", {"alice": 1, "bob": 2}, n_words=200)
    with pytest.raises(ConfigError, match=r"vocab.json \+ merges.txt but no tokenizer.json"):
        resolve_holder_dirs(small_settings(data, tmp_path / "out", init_from=llama))
    gpt2 = _folder(tmp_path / "gpt2", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
                   "vocab.json", "merges.txt")
    assert tokenizer_hash(gpt2) is None
    half = _folder(tmp_path / "half", LLAMA, "vocab.json")  # vocab.json alone is no tokenizer
    assert tokenizer_hash(half) is None


def test_a_folder_of_pytorch_model_bin_says_to_save_it_as_safetensors(tmp_path: Path) -> None:
    from gputravel.core.errors import WeightsError
    from gputravel.core.training.weights import read_weights

    model = _folder(tmp_path / "model", LLAMA, "pytorch_model.bin")
    with pytest.raises(WeightsError, match=r"neither model.safetensors.*pytorch_model.bin is PyTorch's pickle.*"
                                           r"save_pretrained"):
        read_weights(model)


def test_a_config_without_architectures_says_what_to_add(tmp_path: Path) -> None:
    from gputravel.core.training.hf import read_hf_config

    model = _folder(tmp_path / "model", {k: v for k, v in LLAMA.items() if k != "architectures"})
    with pytest.raises(ConfigError, match=r"names no architectures \(model_type 'llama'\): add \"architectures\""):
        read_hf_config(model)


def test_export_help_names_the_hugging_face_formats() -> None:
    """``gputravel --help`` and ``export --help`` said 'as llm.c's model file or GPT-2 safetensors' only, while
    docs/models.md sends a Llama or LoRA run to ``export --format hf|peft``."""
    from typer.testing import CliRunner

    from gputravel.console.cli.main import app

    for args in (["--help"], ["export", "--help"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0
        text = " ".join(result.output.replace("│", " ").split())  # the help's box and wrapping undone
        said = text[text.index("Write a run's model"):][:200]
        assert "Hugging Face folder (hf, LoRA merged)" in said and "peft" in said, said


def test_a_lora_hf_export_whose_base_moved_says_what_to_do(tmp_path: Path) -> None:
    """It said 'cannot read weights file DIR: No such file or directory', not that the merge needs the run's
    --init-from folder, nor that --format peft does not."""
    from gputravel.core.errors import DataError
    from gputravel.core.training.export import export_folder
    from gputravel.core.training.llama import LlamaConfig

    config = LlamaConfig(arch="llama", vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_kv_head=2, head_dim=8,
                         intermediate_size=32, block_size=32)
    state = {"settings": {"steps_per_visit": 1, "batch_size": 1, "seq_len": 8, "lora_rank": 2}, "model": {}}
    moved = tmp_path / "base"
    with pytest.raises(DataError, match=rf"--init-from {moved} is not there any more.*--format peft"):
        export_folder(state, {"init_from": str(moved)}, tmp_path / "out", fmt="hf", config=config)
