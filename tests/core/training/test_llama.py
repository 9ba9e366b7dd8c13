"""The Llama family (issue 32): this project's decoder against ``transformers`` (a test-only reference), Hugging
Face folders in (single file, sharded, fp32/fp16/bf16), architectures refused by name, LoRA's adapters alone
training, checkpointed and resumed, and a run through the protocol from such a folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402

from gputravel.core.errors import ConfigError, WeightsError  # noqa: E402
from gputravel.core.training.hf import read_hf_config  # noqa: E402
from gputravel.core.training.llama import LlamaConfig, llama_param_shapes  # noqa: E402
from gputravel.core.training.lora import LoraSettings, lora_names  # noqa: E402
from gputravel.core.training.model import build_model  # noqa: E402
from gputravel.core.training.trainer import Trainer, TrainSettings  # noqa: E402
from gputravel.core.training.weights import read_weights  # noqa: E402
from gputravel.core.training.weights_upload import params_digest  # noqa: E402

TINY = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def hf_model(arch: str, **overrides: Any) -> Any:
    """A random tiny model of ``arch`` (weights perturbed off their init, so biases and norms are not trivial)."""
    torch.manual_seed(7)
    if arch == "gpt2":
        cfg: Any = transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64, **overrides)
        model: Any = transformers.GPT2LMHeadModel(cfg)
    else:
        kinds = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}
        config_type, model_type = kinds[arch]
        model = model_type(config_type(**{**TINY, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


CASES = {
    "llama3-untied-bias": ("llama", {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True,
                                     "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 16}}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "mistral-window": ("mistral", {"num_key_value_heads": 1, "sliding_window": 8}),
    # Qwen2's window is on the layers from max_window_layers on (default 28): none of these two, then both
    "qwen2-window-no-layer": ("qwen2", {"use_sliding_window": True, "sliding_window": 8}),
    "qwen2-window-every-layer": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    "gpt2": ("gpt2", {}),
}


def _ours(folder: Path) -> Any:
    config, params = read_weights(folder)
    model = build_model(config)
    missing, unexpected = model.load_state_dict(params, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # a tied head is the embedding itself
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers_for_each_architecture(tmp_path: Path, case: str) -> None:
    arch, overrides = CASES[case]
    ref = hf_model(arch, **overrides)
    ref.save_pretrained(tmp_path)
    ours = _ours(tmp_path)
    idx = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, (got, _) = ref(idx).logits, ours(idx)
    assert got.shape == want.shape
    assert float((got - want).abs().max()) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_sharded_half_precision_folder_loads_to_the_widened_weights(tmp_path: Path, dtype: torch.dtype) -> None:
    ref = hf_model("qwen2", tie_word_embeddings=False).to(dtype)
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    config, params = read_weights(tmp_path)
    assert isinstance(config, LlamaConfig) and config.arch == "qwen2"
    for name, t in ref.state_dict().items():
        assert torch.equal(params[name], t.to(torch.float32)), name


def test_another_architecture_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["PhiForCausalLM"], "hidden_size": 64}))
    with pytest.raises(ConfigError, match="PhiForCausalLM.*not supported"):
        read_hf_config(tmp_path)


def test_a_qwen2_window_on_some_layers_only_is_refused_by_name(tmp_path: Path) -> None:
    """transformers slides the window on layers from ``max_window_layers`` on; one window for every layer would
    silently train another model (practitioner's walk, session 15), so a mixed model is refused."""
    hf_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"qwen2: a sliding window on layers \[1\] of 2 only"):
        read_hf_config(tmp_path)


def test_a_qwen2_window_on_every_layer_exports_as_one(tmp_path: Path) -> None:
    """``export --format hf``'s config.json keeps the window transformers then slides on every layer."""
    from gputravel.core.training.hf import hf_config_json

    hf_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0).save_pretrained(tmp_path)
    config = read_hf_config(tmp_path)
    assert isinstance(config, LlamaConfig) and config.sliding_window == 8
    exported = transformers.Qwen2Config(**hf_config_json(config))
    assert exported.sliding_window == 8 and exported.layer_types == ["sliding_attention"] * 2


def test_nan_weights_are_a_named_weights_error(tmp_path: Path) -> None:
    ref = hf_model("llama")
    with torch.no_grad():
        ref.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    ref.save_pretrained(tmp_path)
    with pytest.raises(WeightsError, match=r"model.layers.1.mlp.up_proj.weight holds NaN"):
        read_weights(tmp_path)


def _trainer(config: Any, **lora: Any) -> Trainer:
    return Trainer(config, TrainSettings(steps_per_visit=2, batch_size=2, seq_len=16, seed=3, **lora), "cpu")


def test_lora_trains_only_the_adapters_and_checkpoints_them_alone(tmp_path: Path) -> None:
    ref = hf_model("llama", tie_word_embeddings=True)
    ref.save_pretrained(tmp_path)
    config, params = read_weights(tmp_path)
    trainer = _trainer(config, lora_rank=4, lora_alpha=8.0)
    trainer.load_base(params)
    assert trainer.model_digest() == params_digest(params, config, lora=trainer.lora, seed=3)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    buf = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    trainer.train_on_window(buf, train_off=0, train_len=4096, fmt="byte")
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in base.items())  # the base is frozen
    assert any(not torch.equal(after[n], torch.zeros_like(after[n])) for n in after if n.endswith("lora_B"))
    state = trainer.state_dict()
    assert sorted(state["model"]) == sorted(n for n in after if ".lora_" in n) and len(state["model"]) == 2 * 4 * 2
    # a fresh trainer with the same base restores the adapters and optimizer to the same digest
    again = _trainer(config, lora_rank=4, lora_alpha=8.0)
    again.load_base(params)
    again.load_state_dict(state)
    assert again.model_digest() == trainer.model_digest()
    other = _trainer(config, lora_rank=2)
    with pytest.raises(ConfigError, match="LoRA"):
        other.load_state_dict(state)


def test_a_lora_checkpoint_of_a_135m_llama_is_under_2_percent_of_the_full_state() -> None:
    smollm2 = LlamaConfig(arch="llama", vocab_size=49152, n_embd=576, n_layer=30, n_head=9, n_kv_head=3, head_dim=64,
                          intermediate_size=1536, block_size=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                          tie_word_embeddings=True)
    shapes = llama_param_shapes(smollm2)
    full = sum(torch.Size(s).numel() for s in shapes.values())
    assert 134_000_000 < full < 135_000_000  # SmolLM2-135M: 134,515,008 parameters
    adapters = sum(torch.Size(s).numel() for s in lora_names(shapes, LoraSettings(8, 16.0, ("q_proj", "k_proj",
                                                                                          "v_proj", "o_proj"))).values())
    # a checkpoint holds the trainable tensors and AdamW's two moments of each, fp32
    assert 3 * adapters / (3 * full) <= 0.02
    assert adapters == 30 * (8 * 576 + 576 * 8 + 2 * (8 * 576 + 192 * 8) + 8 * 576 + 576 * 8)


def test_unknown_lora_targets_are_refused_by_name() -> None:
    config = LlamaConfig()
    with pytest.raises(ConfigError, match="names no linear layer"):
        _trainer(config, lora_rank=2, lora_targets=("qkv",))


def gputravel(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "gputravel.console.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


RUN = ["--holders", "2", "--rounds", "1", "--steps-per-visit", "2", "--batch-size", "2", "--seq-len", "16",
       "--chunk-kib", "16", "--buffer-mib", "0.25", "--transport", "local", "--no-record"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Llama folder fine-tuned with LoRA through the protocol, uninterrupted: its args and report."""
    from tests.helpers import write_holders

    tmp_path = tmp_path_factory.mktemp("lora")
    folder = tmp_path / "llama"
    hf_model("llama", tie_word_embeddings=True).save_pretrained(folder)
    data = write_holders(tmp_path / "data", {"alice": 1, "bob": 2}, n_words=3000)
    args = ["--data", str(data), *RUN, "--init-from", str(folder), "--lora-rank", "4"]
    proc = gputravel("run", *args, "--out", str(tmp_path / "whole"), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"args": args, "folder": folder, "report": json.loads(proc.stdout)}


@pytest.mark.process
def test_a_llama_folder_fine_tunes_with_lora_through_the_protocol(lora_run: dict[str, Any]) -> None:
    report = lora_run["report"]
    assert [v["outcome"] for v in report["visits"]] == ["done", "done"]
    assert report["training"]["model"]["architecture"] == "LlamaForCausalLM"
    assert report["training"]["model"]["lora"]["rank"] == 4
    assert report["training"]["model"]["source"] == str(lora_run["folder"])


@pytest.mark.process
def test_a_lora_run_killed_mid_checkpoint_resumes_to_the_same_digest(lora_run: dict[str, Any], tmp_path: Path) -> None:
    cut = tmp_path / "cut"
    proc = gputravel("run", *lora_run["args"], "--out", str(cut), "--fault", "kill-orchestrator@CHECKPOINT:1")
    assert proc.returncode == -9, proc.stderr[-3000:]
    proc = gputravel("run", "--resume", "--out", str(cut), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["training"]["model_digest"] == lora_run["report"]["training"]["model_digest"]


@pytest.mark.process
def test_a_restarted_device_gets_the_lora_base_again(lora_run: dict[str, Any], tmp_path: Path) -> None:
    # a device that dies mid-TRAIN: the restarted one gets the base again, then the adapters' checkpoint
    proc = gputravel("run", *lora_run["args"], "--out", str(tmp_path / "restarted"), "--fault",
                     "kill-device@TRAIN:1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    restarted = json.loads(proc.stdout)
    assert any("device died" in f for f in restarted["visits"][1]["earlier_failures"])
    assert restarted["training"]["model_digest"] == lora_run["report"]["training"]["model_digest"]


@pytest.mark.process
def test_run_refuses_nan_weights_with_exit_2_before_the_run_exists(tmp_path: Path) -> None:
    ref = hf_model("mistral")
    with torch.no_grad():
        ref.model.norm.weight[0] = float("inf")
    ref.save_pretrained(tmp_path / "bad")
    out = tmp_path / "run"
    proc = gputravel("run", *RUN, "--out", str(out), "--init-from", str(tmp_path / "bad"), "--json")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1])["error"]["type"] == "WeightsError"
    assert "model.norm.weight holds NaN or Inf" in proc.stderr and not out.exists()


@pytest.mark.process
def test_bench_train_from_a_folder_with_lora_reports_checkpoint_bytes_and_seal_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # in-process bench train: this pytest worker's malloc stays at glibc's defaults (see test_models' bench test)
    monkeypatch.setenv("GPUTRAVEL_KEEP_FREED_MEMORY", "0")
    from typer.testing import CliRunner

    from gputravel.console.cli import main as cli

    hf_model("llama", tie_word_embeddings=True).save_pretrained(tmp_path / "llama")
    runs = {}
    for rank in ("0", "4"):
        result = CliRunner().invoke(cli.app, [
            "bench", "train", "--init-from", str(tmp_path / "llama"), "--lora-rank", rank, "--holders", "1",
            "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--dataset-mib", "0.05", "--torch-threads", "1",
            "--json"])
        assert result.exit_code == 0, result.output
        runs[rank] = json.loads(result.stdout)
    for rank, res in runs.items():
        assert res["job"]["architecture"] == "LlamaForCausalLM" and res["job"]["lora_rank"] == int(rank)
        assert res["protocol"]["steps"] == res["plain"]["steps"] == 2 and res["protocol_cost_pct"] is not None
        assert res["checkpoint"]["bytes"] > 0 and res["checkpoint"]["seal_s"] >= 0
        # held to issue 32's goal for its kind of job, and told whether it met it
        assert res["target_pct"] == (5.0 if rank == "4" else 10.0) and "issue 32" in res["target"]
        assert res["target_met"] == (res["protocol_cost_pct"] <= res["target_pct"])
    # the adapters and their moments against the whole model and its moments
    assert runs["4"]["checkpoint"]["bytes"] < runs["0"]["checkpoint"]["bytes"] / 4
    assert runs["0"]["checkpoint"]["pct_of_full_state"] > 90
