"""Pretrained weights in and out (issue 23 item 5): llm.c's model file and GPT2LMHeadModel safetensors.

The llm.c file is written here the way llm.c's ``train_gpt2.py`` writes it (``write_model``: a 256-int32 header,
the padded ``wte``, then each per-layer tensor for all layers), and the safetensors file with Hugging Face's
names and Conv1D ``(in, out)`` layout, independently of the code under test. The end-to-end test runs the
real CLI: a run, ``export``, then ``run --init-from`` whose model at start is exactly the exported one.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from gputravel.core.errors import ConfigError, DataError, DeviceError
from gputravel.core.training.checkpoint import CheckpointStore, load_or_create_key, seal_state
from gputravel.core.training.model import GPT, GPTConfig
from gputravel.core.training.weights import (
    detect_format,
    read_config,
    read_weights,
    write_llmc,
    write_safetensors,
)
from gputravel.core.training.weights_upload import params_digest, sealed_weights

#: a tiny GPT-2 whose vocabulary needs padding (300 -> 384), as GPT-2's does (50257 -> 50304)
CONFIG = GPTConfig(block_size=32, vocab_size=300, n_layer=2, n_head=2, n_embd=32)
LAYER = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
         "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
         "mlp.c_proj.bias")


def model(seed: int = 3, config: GPTConfig = CONFIG) -> GPT:
    m = GPT(config, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # biases and norms away from their 0/1 init, so a swapped tensor shows
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    return m


def logits(m_or_params: Any, config: GPTConfig = CONFIG) -> torch.Tensor:
    if isinstance(m_or_params, GPT):
        m = m_or_params
    else:
        m = GPT(config)
        sd = dict(m_or_params)
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
        m.load_state_dict(sd)
    idx = torch.arange(24).remainder(config.vocab_size).view(2, 12)
    with torch.no_grad():
        return m.eval()(idx)[0]


def llmc_write_model(m: GPT, path: Path, dtype: str) -> None:
    """llm.c's train_gpt2.py ``write_model`` (header, pad_vocab with zeros, write_tensors in its order)."""
    config = m.config
    header = torch.zeros(256, dtype=torch.int32)
    header[0], header[1] = 20240326, {"float32": 3, "bfloat16": 5}[dtype]
    header[2:7] = torch.tensor([config.block_size, config.vocab_size, config.n_layer, config.n_head, config.n_embd])
    params = {name: p.detach().cpu() for name, p in m.named_parameters()}
    wte = params["transformer.wte.weight"][: config.vocab_size]  # llm.c's model has the real vocabulary
    vp = (config.vocab_size + 127) // 128 * 128
    params["transformer.wte.weight"] = torch.nn.functional.pad(wte, (0, 0, 0, vp - config.vocab_size))
    header[7] = vp

    def write(t: torch.Tensor, f: Any) -> None:
        t = t.detach().cpu().to(torch.float32 if dtype == "float32" else torch.bfloat16)
        f.write((t if dtype == "float32" else t.view(torch.int16)).numpy().tobytes())

    with path.open("wb") as f:
        f.write(header.numpy().tobytes())
        write(params["transformer.wte.weight"], f)
        write(params["transformer.wpe.weight"], f)
        for name in LAYER:
            for i in range(config.n_layer):
                write(params[f"transformer.h.{i}.{name}"], f)
        write(params["transformer.ln_f.weight"], f)
        write(params["transformer.ln_f.bias"], f)


def hf_write(m: GPT, path: Path, *, prefix: str = "", with_buffers: bool = True) -> None:
    """What ``GPT2LMHeadModel`` holds: Conv1D weights (in, out), the real vocabulary, causal-mask buffers."""
    out: dict[str, torch.Tensor] = {}
    for name, p in m.named_parameters():
        t = p.detach().clone()
        short = name.removeprefix("transformer.")
        if short.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            t = t.t().contiguous()
        if short == "wte.weight":
            t = t[: m.config.vocab_size].clone()
        out[prefix + short] = t
    if with_buffers:
        for i in range(m.config.n_layer):
            out[f"{prefix}h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    out["lm_head.weight"] = out[prefix + "wte.weight"].clone()
    save_file(out, str(path), metadata={"format": "pt"})


def real_rows_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], vocab: int) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if name == "transformer.wte.weight":
            x, y = x[:vocab], y[:vocab]
        assert torch.equal(x, y), name


def test_a_file_in_llmcs_published_layout_loads_with_its_shape_and_logits(tmp_path: Path) -> None:
    m = model()
    path = tmp_path / "gpt2_tiny.bin"
    llmc_write_model(m, path, "float32")
    assert detect_format(path) == "llmc" and read_config(path) == CONFIG
    config, params = read_weights(path)
    assert config == CONFIG
    real_rows_equal(params, {n: p.detach() for n, p in m.named_parameters()}, CONFIG.vocab_size)
    assert torch.equal(params["transformer.wte.weight"][CONFIG.vocab_size:], torch.zeros(84, 32))  # llm.c's pad
    assert torch.equal(logits(params), logits(m))


def test_an_llmc_bf16_file_version_5_loads_as_the_bf16_rounded_weights(tmp_path: Path) -> None:
    m = model()
    path = tmp_path / "gpt2_tiny_bf16.bin"
    llmc_write_model(m, path, "bfloat16")
    _, params = read_weights(path)
    for name, p in m.named_parameters():
        want = p.detach().to(torch.bfloat16).to(torch.float32)
        got = params[name]
        if name == "transformer.wte.weight":
            want, got = want[:300], got[:300]
        assert torch.equal(got, want), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llmc_export_then_read_gives_identical_tensors_and_logits(tmp_path: Path, dtype: str) -> None:
    m = model()
    params = {n: p.detach() for n, p in m.named_parameters()}
    path = tmp_path / "out.bin"
    write_llmc(path, CONFIG, params, dtype=dtype)
    head = struct.unpack("<8i", path.read_bytes()[:32])
    assert head == (20240326, 3 if dtype == "float32" else 5, 32, 300, 2, 2, 32, 384)
    config, back = read_weights(path)
    assert config == CONFIG
    if dtype == "float32":  # every tensor, padded rows included, bit for bit
        assert all(torch.equal(back[n], params[n]) for n in params)
        assert torch.equal(logits(back), logits(m))
    else:
        assert all(torch.equal(back[n], params[n].to(torch.bfloat16).float()) for n in params)


def test_safetensors_export_then_read_gives_identical_tensors_and_logits(tmp_path: Path) -> None:
    m = model()
    params = {n: p.detach() for n, p in m.named_parameters()}
    path = tmp_path / "model.safetensors"
    write_safetensors(path, CONFIG, params)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # GPT2LMHeadModel's names and Conv1D layout
        assert f.get_slice("transformer.h.0.attn.c_attn.weight").get_shape() == [32, 96]
        assert f.get_slice("transformer.h.1.mlp.c_proj.weight").get_shape() == [128, 32]
        assert f.get_slice("transformer.wte.weight").get_shape() == [300, 32]
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118
    config, back = read_weights(path)
    assert config == CONFIG
    real_rows_equal(back, params, CONFIG.vocab_size)
    assert torch.equal(logits(back), logits(m))  # the padded rows never reach the logits


@pytest.mark.parametrize("prefix", ["", "transformer."])
def test_safetensors_with_hugging_face_names_loads(tmp_path: Path, prefix: str) -> None:
    """The published gpt2 checkpoint's names (no prefix, mask buffers, lm_head), with config.json beside it
    giving the head count; a model saved from GPT2LMHeadModel has the ``transformer.`` prefix."""
    config = GPTConfig(block_size=32, vocab_size=300, n_layer=2, n_head=4, n_embd=32)  # not n_embd // 64
    m = model(config=config)
    hf_write(m, tmp_path / "model.safetensors", prefix=prefix)
    (tmp_path / "config.json").write_text(json.dumps({"n_head": 4, "n_layer": 2, "n_embd": 32}))
    got, params = read_weights(tmp_path / "model.safetensors")
    assert got == config
    assert torch.equal(logits(params, config), logits(m))


def test_an_untied_lm_head_in_safetensors_is_refused_by_name(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    m = model()
    path = tmp_path / "model.safetensors"
    hf_write(m, path)
    tensors = load_file(str(path))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(DataError, match="not tied"):
        read_weights(path)


def test_truncated_bad_magic_and_foreign_files_are_named_data_errors(tmp_path: Path) -> None:
    m = model()
    good = tmp_path / "good.bin"
    llmc_write_model(m, good, "float32")
    raw = good.read_bytes()
    cases = {
        "cut.bin": (raw[:-10], "truncated"),
        "header.bin": (raw[:100], "truncated"),
        "long.bin": (raw + b"\0" * 4, "longer than its header"),
        "magic.bin": (struct.pack("<i", 20240325) + raw[4:], "neither an llm.c model file"),
        "version.bin": (raw[:4] + struct.pack("<i", 4) + raw[8:], "version 4"),
        "empty.bin": (b"", "empty file"),
    }
    st = tmp_path / "model.safetensors"
    hf_write(m, st)
    cases["cut.safetensors"] = (st.read_bytes()[:-100], "wte.weight lies outside the file")
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match=message):
            read_weights(tmp_path / name)


def _service(tmp_path: Path) -> Any:
    from gputravel.core.attestation import provision_emulated
    from gputravel.core.device.service import DeviceService
    from gputravel.core.training.trainer import TrainSettings

    _, identity = provision_emulated(tmp_path / "state")
    svc = DeviceService(identity=identity, buffer_bytes=64 * 1024, device="cpu")
    program = {"program": "gputravel.gpt2/v1", "model": CONFIG.to_dict(),
               "train": TrainSettings(steps_per_visit=1, batch_size=2, seq_len=16).to_dict()}
    svc.model.op_configure(payload=json.dumps(program).encode())
    return svc


def _upload(svc: Any, header: Any, records: Any, key: bytes) -> dict[str, Any]:
    svc.streams.op_restore(header=header.to_dict(), payload=key)
    for kind, sealed in records:
        svc.streams.op_restore_chunk(kind=kind, payload=bytes(sealed))
    return dict(svc.streams.op_restore_end(payload=b"").header)


def test_weights_reach_the_device_model_through_a_sealed_stream_with_their_digest(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    m = model()
    params = {n: p.detach() for n, p in m.named_parameters()}
    key = os.urandom(32)
    header, records, digest = sealed_weights(params, CONFIG, key=key, run_id="run-w")
    state = _upload(svc, header, records, key)
    assert state["model_digest"] == digest == params_digest(params, CONFIG)
    device_model = svc.model.trainer.model
    assert all(torch.equal(p, params[n]) for n, p in device_model.named_parameters())
    assert device_model.lm_head.weight is device_model.transformer["wte"].weight  # still tied
    assert svc.model.trainer.step == 0 and not svc.model.trainer.optimizer.state


def test_a_weights_stream_with_a_flipped_byte_or_another_shape_is_refused(tmp_path: Path) -> None:
    from gputravel.core.protocol.stream import StreamHeader

    svc = _service(tmp_path)
    params = {n: p.detach() for n, p in model().named_parameters()}
    key = os.urandom(32)
    header, records, _ = sealed_weights(params, CONFIG, key=key, run_id="run-w")
    chunks = [(k, bytearray(s)) for k, s in records]
    chunks[0][1][100] ^= 1
    with pytest.raises(Exception, match="failed authentication"):
        _upload(svc, header, chunks, key)
    with pytest.raises(DeviceError, match="incomplete"):  # a failed upload leaves no half-loaded model to train
        svc.model.need_whole_model()
    other = GPTConfig(block_size=32, vocab_size=300, n_layer=1, n_head=2, n_embd=32)
    small = {n: p.detach() for n, p in model(config=other).named_parameters()}
    header, records, _ = sealed_weights(small, other, key=key, run_id="run-w")
    with pytest.raises((DeviceError, ConfigError, DataError, RuntimeError)):
        _upload(svc, header, records, key)
    # a checkpoint-kind stream cannot pose as weights, nor weights as anything else
    bogus = StreamHeader.new(kind="bogus", run_id="run-w", seq=0)
    with pytest.raises(Exception, match="kind"):
        _upload(svc, bogus, seal_state(key, bogus, {}), key)


def test_upload_weights_streams_the_file_into_the_device_and_refuses_another_programs_model(tmp_path: Path) -> None:
    from gputravel.core.training.weights_upload import upload_weights

    m = model()
    path = tmp_path / "w.bin"
    llmc_write_model(m, path, "float32")
    svc = _service(tmp_path)
    key = os.urandom(32)
    state, want, config = upload_weights(path, program_model=CONFIG.to_dict(), key=key, run_id="run-u",
                                         restore=lambda k, h, r: _upload(svc, h, r, k))
    assert state["model_digest"] == want and config == CONFIG.to_dict()
    assert torch.equal(logits(svc.model.trainer.model), logits(m))
    other = GPTConfig(block_size=32, vocab_size=300, n_layer=3, n_head=2, n_embd=32).to_dict()
    with pytest.raises(ConfigError, match="differs from the program"):
        upload_weights(path, program_model=other, key=key, run_id="run-u", restore=lambda k, h, r: None)


def test_a_trained_model_refuses_pretrained_weights(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    svc.model.trainer.step = 1
    params = {n: p.detach() for n, p in model().named_parameters()}
    key = os.urandom(32)
    header, records, _ = sealed_weights(params, CONFIG, key=key, run_id="run-w")
    with pytest.raises(DeviceError, match="not trained"):
        _upload(svc, header, records, key)


# --- the CLI, end to end ------------------------------------------------------------------------------
def gputravel(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "gputravel.console.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


RUN_ARGS = ["--holders", "1", "--rounds", "1", "--steps-per-visit", "2", "--batch-size", "2", "--seq-len", "16",
            "--chunk-kib", "16", "--buffer-mib", "0.25", "--transport", "local", "--no-record", "--json"]


def _checkpoint_model(out: Path, seq: int | None = None) -> dict[str, torch.Tensor]:
    store = CheckpointStore(out / "checkpoints", load_or_create_key(out / "keys" / "checkpoint.key"))
    latest = store.latest()
    assert latest is not None
    state = store.load(latest[1] if seq is None else seq)
    return {k: v for k, v in state["model"].items() if k != "lm_head.weight"}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """One short run (its data folder, its run folder, its last model): the two export formats' tests start from
    it, so the module pays for it once."""
    from tests.helpers import write_holder

    root = tmp_path_factory.mktemp("export")
    data = root / "data"
    write_holder(data / "alice", 1, "to be or not to be that is the question".split(), n_words=3000)
    first = root / "first"
    proc = gputravel("run", "--data", str(data), *RUN_ARGS, "--out", str(first))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return data, first, _checkpoint_model(first)


def _export(first: Path, fmt: str, output: Path, *run: str) -> None:
    proc = gputravel("export", *(run or (str(first),)), "--format", fmt, "--output", str(output), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads(proc.stdout)
    assert done["format"] == fmt and done["steps"] == 2 and done["bytes"] == output.stat().st_size


@pytest.mark.process
def test_export_llmc_then_init_from_continues_from_the_exported_model(
        first_run: tuple[Path, Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    data, first, trained = first_run
    exported_file = tmp_path / "exported.llmc"
    _export(first, "llmc", exported_file)  # the run named by its folder
    proc = gputravel("export", str(first), "--output", str(tmp_path / "no-such-dir" / "x.bin"))
    assert proc.returncode == 2 and "cannot write" in proc.stderr
    _, exported = read_weights(exported_file)
    assert all(torch.equal(exported[n], trained[n]) for n in exported)  # the run's last model, bit for bit

    second = tmp_path / "second"
    proc = gputravel("run", "--data", str(data), *RUN_ARGS, "--out", str(second), "--init-from", str(exported_file))
    assert proc.returncode == 0, proc.stderr[-3000:]
    at_start = _checkpoint_model(second, 0)  # the new run's initial checkpoint: the model before its first step
    assert all(torch.equal(at_start[n], trained[n]) for n in trained)
    from gputravel.core.ledger import read_rows

    loaded = [r for r in read_rows(second / "ledger.db") if r.kind == "weights-loaded"]
    assert len(loaded) == 1 and loaded[0].detail["model_digest"] == params_digest(exported, read_config(exported_file))


@pytest.mark.process
def test_export_safetensors_then_init_from_starts_from_the_same_model(
        first_run: tuple[Path, Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    data, first, trained = first_run
    exported_file = tmp_path / "exported.safetensors"
    _export(first, "safetensors", exported_file, "first", "--runs-dir", str(first.parent))  # the run named by its name
    third = tmp_path / "third"  # safetensors: the same model (its padded rows are zeros; they are never used)
    proc = gputravel("run", "--data", str(data), *RUN_ARGS, "--out", str(third), "--init-from", str(exported_file))
    assert proc.returncode == 0, proc.stderr[-3000:]
    real_rows_equal(_checkpoint_model(third, 0), trained, 256)


@pytest.mark.process
def test_run_init_from_a_bad_file_exits_2_before_creating_the_run(tmp_path: Path) -> None:
    bad = tmp_path / "bad.bin"
    bad.write_bytes(struct.pack("<i", 20240326) + b"\0" * 50)
    out = tmp_path / "run"
    proc = gputravel("run", *RUN_ARGS, "--out", str(out), "--init-from", str(bad))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1])["error"]["type"] == "DataError"
    assert "truncated" in proc.stderr and not out.exists()
    proc = gputravel("export", str(tmp_path), "--format", "llmc", "--out", str(tmp_path / "x.bin"))  # --out as run spells it
    assert proc.returncode == 2 and "not a run folder" in proc.stderr, proc.stderr  # a folder that holds no run



@pytest.mark.slow
def test_gpt2_124m_exports_as_llmcs_gpt2_124m_bin_and_reads_back(tmp_path: Path) -> None:
    """GPT-2 124M in llm.c's layout: header (1024, 50257, 12, 12, 768, 50304) and llm.c's 124,475,904
    parameters, so the file has gpt2_124M.bin's size; reading it back gives the same tensors."""
    from gputravel.core.training.model import preset

    config = preset("gpt2")
    params = {n: p.detach() for n, p in GPT(config).named_parameters()}
    path = tmp_path / "gpt2_124M.bin"
    write_llmc(path, config, params)
    assert struct.unpack("<8i", path.read_bytes()[:32]) == (20240326, 3, 1024, 50257, 12, 12, 768, 50304)
    assert path.stat().st_size == 1024 + 4 * 124_475_904
    got, back = read_weights(path)
    assert got == config and all(torch.equal(back[n], params[n]) for n in params)
