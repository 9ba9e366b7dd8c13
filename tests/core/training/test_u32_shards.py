"""32-bit token shards for vocabularies over 65,536 (issue 32, what is left, item 1): llm.c's Llama 3 shard
header (magic 20240801, version 7) says the width; the writer picks it from the tokenizer's vocabulary, every
reader (the agent, ``data check``, the trainer) checks it against the file's real length and the model's
vocabulary. The model here is tiny in width (hidden 16) so a 70,000-id vocabulary stays quick."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from gputravel.agents.holder import open_dataset
from gputravel.core.errors import DataError
from gputravel.core.protocol.shards import parse_shard_header
from gputravel.core.training.corpus import read_llmc_shard, shard_format_for, write_llmc_shard
from gputravel.core.training.datacheck import validate_data_dir
from gputravel.core.training.llama import LlamaConfig
from gputravel.core.training.tokens import TokenFormat, check_token_range, gather_tokens
from gputravel.core.training.trainer import Trainer, TrainSettings

VOCAB = 70_000
IDS = [0, 1, 65_535, 65_536, 69_999, 4_000_000_000 % VOCAB]


def test_a_u32_shard_carries_llmc_llama3_header_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "s.bin"
    write_llmc_shard(path, IDS, fmt="u32")
    assert np.fromfile(path, dtype="<i4", count=3).tolist() == [20240801, 7, len(IDS)]
    assert path.stat().st_size == 1024 + 4 * len(IDS)
    out = read_llmc_shard(path, vocab=VOCAB)
    assert out.dtype == np.uint32 and out.tolist() == IDS
    with pytest.raises(DataError, match="69999 is beyond the vocabulary"):
        read_llmc_shard(path)  # GPT-2's vocabulary by default
    with pytest.raises(DataError, match="must fit in uint16"):
        write_llmc_shard(path, IDS)  # u16 stays the default and refuses ids over 65,535
    assert shard_format_for(65_536) is TokenFormat.U16 and shard_format_for(65_537) is TokenFormat.U32


def test_the_header_width_is_checked_against_the_files_real_length(tmp_path: Path) -> None:
    path = tmp_path / "s.bin"
    write_llmc_shard(path, IDS, fmt="u32")
    blob = path.read_bytes()
    relabelled = struct.pack("<2i", 20240520, 1) + blob[8:]  # a u32 payload under the u16 header
    for broken, message in ((blob[:-2], "header says 6 tokens \\(u32\\)"), (relabelled, "header says 6 tokens \\(u16\\)"),
                            (struct.pack("<2i", 20240801, 1) + blob[8:], "not a known llm.c shard")):
        path.write_bytes(broken)
        with pytest.raises(DataError, match=message):
            parse_shard_header(broken[:1024], len(broken), path)
        with pytest.raises(DataError, match=message):
            read_llmc_shard(path, vocab=VOCAB)
        with pytest.raises(DataError, match=message):
            open_dataset(tmp_path)


def test_data_check_and_the_agent_take_u32_folders_and_refuse_mixed_widths_or_ids_past_the_vocabulary(
        tmp_path: Path) -> None:
    for holder, ids in (("alice", IDS * 50), ("bob", list(range(66_000, 66_400)))):
        (tmp_path / holder).mkdir()
        write_llmc_shard(tmp_path / holder / "train_000.bin", ids, fmt="u32")
    specs = validate_data_dir(tmp_path, vocab=VOCAB)
    assert [(s.fmt, s.tokens, s.nbytes) for s in specs] == [(TokenFormat.U32, 300, 1200), (TokenFormat.U32, 400, 1600)]
    ds = open_dataset(tmp_path / "bob", val_fraction=0.1)
    assert ds.fmt == "u32" and ds.train.length + ds.val.length == 1600 and ds.val.length % 4 == 0
    assert np.frombuffer(ds.train.read(0, 8), dtype="<u4").tolist() == [66_000, 66_001]

    with pytest.raises(DataError, match="69999 is beyond the vocabulary \\(66400\\)"):
        validate_data_dir(tmp_path, vocab=66_400)
    write_llmc_shard(tmp_path / "bob" / "train_001.bin", [1, 2, 3])  # a u16 shard beside a u32 one
    with pytest.raises(DataError, match="bob: mixes u16 and u32 shards"):
        validate_data_dir(tmp_path, vocab=VOCAB)
    with pytest.raises(DataError, match="mixes u16 and u32 shards"):
        open_dataset(tmp_path / "bob")
    (tmp_path / "bob" / "train_000.bin").unlink()
    with pytest.raises(DataError, match="different widths \\(u16, u32\\)"):
        validate_data_dir(tmp_path, vocab=VOCAB)


def test_a_tiny_llama_with_70000_ids_trains_on_a_u32_window_at_any_offset() -> None:
    ids = np.arange(65_000, 65_000 + 4096, dtype="<u4") % VOCAB
    raw = bytearray(b"\x07" + ids.tobytes())  # one stray byte first: the window starts at an odd offset
    buf = torch.frombuffer(raw, dtype=torch.uint8)
    window = buf[1:]
    index = torch.tensor([[0, 1], [1000, 4095]])
    assert gather_tokens(window, "u32", index).tolist() == [[65_000, 65_001], [66_000, 69_095]]
    check_token_range(window, "u32", VOCAB)
    with pytest.raises(DataError, match="u32 token 69000 at token 4000 is outside the model's vocabulary of 69000"):
        check_token_range(window, "u32", 69_000)

    config = LlamaConfig(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_kv_head=1, head_dim=8,
                         intermediate_size=32, block_size=32)
    trainer = Trainer(config, TrainSettings(steps_per_visit=2, batch_size=2, seq_len=16, seed=3), "cpu")
    result = trainer.train_on_window(buf, train_off=1, train_len=len(raw) - 1, fmt="u32")
    assert trainer.step == 2 and len(result.losses) == 2 and all(np.isfinite(result.losses))
    val = trainer.eval_on_window(buf, val_off=1, val_len=len(raw) - 1, fmt="u32")
    assert val is not None and np.isfinite(val)


def test_data_fetch_with_a_tokenizer_over_65536_ids_writes_u32_shards_and_records_the_width(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from gputravel.core.training.hftokenizer import ModelTokenizer, tokenize_holders
    from tests.helpers import WORDS, write_holders

    words = sorted(set(WORDS))
    # a word-level tokenizer whose words sit above 65,535: only u32 shards can carry them
    vocab = {"[UNK]": 0, **{f"pad{i}": i for i in range(1, VOCAB - len(words))},
             **{w: VOCAB - len(words) + k for k, w in enumerate(words)}}
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}))
    tok = ModelTokenizer.load(model)
    assert tok.vocab == VOCAB and tok.shard_format == "u32"
    text = write_holders(tmp_path / "text", {"alice": 1, "bob": 2}, n_words=400)
    shards = tokenize_holders(text, tmp_path / "shards", tok)
    specs = validate_data_dir(shards, vocab=VOCAB, tokenizer_hash=tok.sha256)
    assert [s.fmt for s in specs] == [TokenFormat.U32, TokenFormat.U32]
    ids = read_llmc_shard(shards / "alice" / "train_000.bin", vocab=VOCAB)
    assert int(ids.min()) >= VOCAB - len(words) > 65_535 and ids.size >= 400
    record = json.loads((shards / "alice" / ".tokenizer").read_text())
    assert record["format"] == "u32" and record["vocab"] == VOCAB

    record["format"] = "u16"  # the record and the shards disagree on the width: refused by name
    (shards / "alice" / ".tokenizer").write_text(json.dumps(record))
    with pytest.raises(DataError, match="u32 shards, but its tokenizer record says data fetch --tokenizer wrote u16"):
        validate_data_dir(shards, vocab=VOCAB, tokenizer_hash=tok.sha256)
