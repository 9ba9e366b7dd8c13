"""``export --format peft|hf`` (issue 32): a run's LoRA adapters load in ``peft`` onto the same base with the
run's own logits; a merged Hugging Face folder loads with ``from_pretrained``, for Llama, Qwen2 and GPT-2; the
export's temporary file never follows a planted link."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("peft")
from peft import PeftModel  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from gputravel.core.training.checkpoint import CheckpointStore, load_or_create_key  # noqa: E402
from gputravel.core.training.model import model_config_from_dict  # noqa: E402
from gputravel.core.training.trainer import Trainer, TrainSettings  # noqa: E402
from gputravel.core.training.weights import read_weights  # noqa: E402
from tests.core.training.test_llama import RUN, gputravel, hf_model  # noqa: E402

pytestmark = pytest.mark.process


def _run_model(out: Path, base: Path | None) -> Any:
    """The run's last model as the device held it: the base, its checkpoint's adapters (or whole model)."""
    store = CheckpointStore(out / "checkpoints", load_or_create_key(out / "keys" / "checkpoint.key"))
    latest = store.latest()
    assert latest is not None
    state = store.load(latest[1])
    config = model_config_from_dict(dict(state["config"]))
    trainer = Trainer(config, TrainSettings.from_dict(dict(state["settings"])), "cpu")
    if base is not None:
        trainer.load_base(read_weights(base)[1])
    trainer.load_state_dict(state)
    return trainer.model.eval()


def _fine_tune(tmp_path: Path, arch: str, *extra: str, **overrides: Any) -> tuple[Path, Path]:
    from tests.helpers import write_holders

    base = tmp_path / "base"
    hf_model(arch, **overrides).save_pretrained(base)
    data = write_holders(tmp_path / "data", {"alice": 1, "bob": 2}, n_words=3000)
    out = tmp_path / "run"
    proc = gputravel("run", "--data", str(data), *RUN, "--lr", "0.05", "--init-from", str(base), "--out", str(out),
                     *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base, out


def _export(out: Path, fmt: str, dest: Path) -> dict[str, Any]:
    proc = gputravel("export", str(out), "--format", fmt, "--out", str(dest), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    done: dict[str, Any] = json.loads(proc.stdout)
    return done


IDX = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_lora_adapters_load_in_peft_and_merged_in_transformers_with_the_runs_logits(tmp_path: Path,
                                                                                    arch: str) -> None:
    base, out = _fine_tune(tmp_path, arch, "--lora-rank", "4", "--lora-alpha", "8",
                           **({"tie_word_embeddings": True} if arch == "llama" else {}))
    peft_dir, hf_dir = tmp_path / "adapters", tmp_path / "merged"
    done = _export(out, "peft", peft_dir)
    assert set(done["files"]) == {"adapter_config.json", "adapter_model.safetensors"} and done["lora"]["rank"] == 4
    _export(out, "hf", hf_dir)
    with torch.no_grad():
        ours, _ = _run_model(out, base)(IDX)
        plain = AutoModelForCausalLM.from_pretrained(base).eval()(IDX).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base).eval(), peft_dir).eval()(IDX).logits
        merged = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(IDX).logits
    assert float((ours - plain).abs().max()) > 1e-4  # the adapters changed the model
    assert float((adapted - ours).abs().max()) < 1e-4
    assert float((merged - ours).abs().max()) < 1e-4


def test_a_whole_qwen2_fine_tune_exports_as_a_folder_from_pretrained_loads(tmp_path: Path) -> None:
    _, out = _fine_tune(tmp_path, "qwen2", tie_word_embeddings=False)
    _export(out, "hf", tmp_path / "merged")
    with torch.no_grad():
        ours, _ = _run_model(out, None)(IDX)
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(IDX).logits
    assert float((theirs - ours).abs().max()) < 1e-4
    proc = gputravel("export", str(out), "--format", "peft", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "exports LoRA adapters" in proc.stderr
    proc = gputravel("export", str(out), "--format", "llmc", "--out", str(tmp_path / "x.bin"))
    assert proc.returncode == 2 and "use --format hf" in proc.stderr


def test_export_never_follows_a_planted_temporary_link(tmp_path: Path) -> None:
    from tests.helpers import write_holder

    data = tmp_path / "data"
    write_holder(data / "alice", 1, n_words=3000)
    out = tmp_path / "run"
    proc = gputravel("run", "--data", str(data), *RUN[2:], "--holders", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "model.bin"
    os.symlink(victim, tmp_path / ".model.bin.tmp")  # the old fixed temporary name
    linked = tmp_path / "linked.bin"
    os.symlink(victim, linked)
    for dest in (target, linked):
        proc = gputravel("export", str(out), "--format", "llmc", "--out", str(dest))
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert victim.read_bytes() == b"precious"  # neither the planted link nor a link at the target is written through
    assert target.stat().st_size > 1000 and not linked.is_symlink() and linked.stat().st_size == target.stat().st_size
