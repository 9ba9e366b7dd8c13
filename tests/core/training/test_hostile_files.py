"""Weights and data files that cannot hurt the run (issue 32, item 4): headers bounded before any allocation,
lying, sparse or mistyped files refused by name, data files that are not regular files refused, shards checked in
bounded memory."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from gputravel.core.errors import DataError, WeightsError
from gputravel.core.training.corpus import write_llmc_shard
from gputravel.core.training.datacheck import validate_data_dir
from gputravel.core.training.hf import check_safetensors
from gputravel.core.training.weights import LLMC_MAGIC, read_config, read_weights

GIB = 1 << 30


def test_an_llmc_header_claiming_2_31_layers_is_refused_before_any_allocation(tmp_path: Path) -> None:
    header = [0] * 256
    header[:8] = [LLMC_MAGIC, 3, 1024, 50257, 2**31 - 1, 12, 768, 50304]
    path = tmp_path / "huge.bin"
    path.write_bytes(struct.pack("<256i", *header))
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="truncated"):
            read_config(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # the size is arithmetic on the header, no per-layer table is built


def _safetensors(path: Path, header: dict[str, object], data_len: int, *, sparse: bool = False) -> None:
    raw = json.dumps(header).encode()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        if sparse:
            f.truncate(8 + len(raw) + data_len)
        else:
            f.write(b"\0" * data_len)


def test_a_sparse_safetensors_file_describing_15_gib_is_refused_by_name(tmp_path: Path) -> None:
    n = 15 * GIB // 4
    path = tmp_path / "model.safetensors"
    _safetensors(path, {"wte.weight": {"dtype": "F32", "shape": [n // 768, 768], "data_offsets": [0, n // 768 * 768 * 4]}},
                 n // 768 * 768 * 4, sparse=True)
    assert path.stat().st_size > 15 * GIB - (1 << 20) and path.stat().st_blocks * 512 < 1 << 20
    with pytest.raises(WeightsError, match="sparse"):
        check_safetensors(path)
    with pytest.raises(WeightsError, match="sparse"):
        read_config(path)


def test_a_header_lying_about_its_sizes_or_dtype_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "lying.safetensors"
    _safetensors(path, {"w": {"dtype": "F32", "shape": [1 << 20, 1 << 10], "data_offsets": [0, 1 << 32]}}, 64)
    with pytest.raises(WeightsError, match="lies outside the file"):
        check_safetensors(path)
    _safetensors(path, {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}}, 64)
    with pytest.raises(WeightsError, match="takes 32 bytes, not 64"):
        check_safetensors(path)
    _safetensors(path, {"w": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}, 16)
    with pytest.raises(WeightsError, match="dtype I64"):
        check_safetensors(path)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(WeightsError, match="header length"):
        check_safetensors(path)


def test_a_folder_whose_tensors_exceed_its_config_is_refused_before_reading_them(tmp_path: Path) -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "intermediate_size": 16, "max_position_embeddings": 16, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    big = 1 << 28  # a 1 GiB embedding the config's 32 x 8 model does not have
    _safetensors(tmp_path / "model.safetensors", {"model.embed_tokens.weight": {
        "dtype": "F32", "shape": [big // 8, 8], "data_offsets": [0, big * 4]}}, big * 4, sparse=True)
    os.truncate(tmp_path / "model.safetensors", 8)  # also a lie about the file's length
    with pytest.raises(WeightsError):
        read_weights(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../outside.safetensors"}}))
    with pytest.raises(WeightsError, match="files of the folder itself"):
        read_weights(tmp_path)


@pytest.mark.process
def test_data_check_refuses_a_fifo_without_waiting_on_it(tmp_path: Path) -> None:
    (tmp_path / "alice").mkdir()
    os.mkfifo(tmp_path / "alice" / "part.txt")
    with pytest.raises(DataError, match="not a regular file \\(a FIFO\\)"):
        validate_data_dir(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "gputravel.console.cli", "data", "check", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not a regular file" in proc.stderr


@pytest.mark.process
def test_data_check_reads_a_1_gib_shard_in_bounded_memory(tmp_path: Path) -> None:
    (tmp_path / "alice").mkdir()
    shard = tmp_path / "alice" / "train_000.bin"
    write_llmc_shard(shard, np.zeros(4, dtype=np.uint16))
    count = GIB // 2
    with shard.open("r+b") as f:  # a 1 GiB shard of token 0, sparse on disk
        f.write(struct.pack("<3i", 20240520, 1, count))
        f.truncate(1024 + 2 * count)
    code = ("import resource, sys; from pathlib import Path; from gputravel.core.training.datacheck import "
            "validate_data_dir; base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
            "specs = validate_data_dir(Path(sys.argv[1])); "
            "print(specs[0].tokens, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tokens, grown_kib = (int(v) for v in proc.stdout.split())
    assert tokens == count
    assert grown_kib * 1024 <= 64 << 20  # the bound: 64 MB whatever the shard's size
