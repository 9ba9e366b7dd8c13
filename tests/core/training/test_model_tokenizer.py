"""The model's own tokenizer for holders' data (issue 32, item 3 of "What to build"): ``data fetch|check
--tokenizer DIR`` tokenizes text with the folder's tokenizer.json, ids below its vocabulary, its hash recorded
beside the shards; a run from that folder takes those shards and refuses another tokenizer's, and text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

from gputravel.core.training.corpus import read_llmc_shard  # noqa: E402
from tests.core.training.test_llama import RUN, gputravel, hf_model  # noqa: E402
from tests.helpers import write_holders  # noqa: E402


def _tokenizer(folder: Path, words: list[str], vocab: int) -> None:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([" ".join(words)] * 50, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))


@pytest.mark.process
def test_text_tokenized_with_the_models_tokenizer_trains_and_another_tokenizers_shards_are_refused(
        tmp_path: Path) -> None:
    from tests.helpers import WORDS

    model = tmp_path / "model"
    hf_model("llama", tie_word_embeddings=True).save_pretrained(model)  # vocabulary 300
    _tokenizer(model, WORDS, 300)
    text = write_holders(tmp_path / "text", {"alice": 1, "bob": 2}, n_words=3000)
    shards = tmp_path / "shards"
    proc = gputravel("data", "fetch", "--tokenizer", str(model), "--text", str(text), "--dest", str(shards), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    holders = json.loads(proc.stdout)["holders"]
    assert [h["format"] for h in holders] == ["u16", "u16"] and all(h["tokens"] > 500 for h in holders)
    ids = read_llmc_shard(shards / "alice" / "train_000.bin")
    assert int(ids.max()) < 300 and int(ids.max()) > 255  # the model's own merges, not bytes
    record = json.loads((shards / "alice" / ".tokenizer").read_text())
    import hashlib

    assert record["sha256"] == hashlib.sha256((model / "tokenizer.json").read_bytes()).hexdigest()
    assert gputravel("data", "check", str(shards), "--tokenizer", str(model)).returncode == 0

    proc = gputravel("run", "--data", str(shards), *RUN, "--init-from", str(model), "--lora-rank", "2",
                     "--out", str(tmp_path / "run"), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [v["outcome"] for v in json.loads(proc.stdout)["visits"]] == ["done", "done"]

    other = tmp_path / "other"
    _tokenizer(other, WORDS[::-1] + ["zzz"], 290)
    foreign = tmp_path / "foreign"
    proc = gputravel("data", "fetch", "--tokenizer", str(other), "--text", str(text), "--dest", str(foreign))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = gputravel("data", "check", str(foreign), "--tokenizer", str(model))
    assert proc.returncode == 2 and "tokenized by tokenizer" in proc.stderr
    for data, message in ((foreign, "tokenized by tokenizer"), (text, "holds text, but the model has its own")):
        out = tmp_path / f"refused-{data.name}"
        proc = gputravel("run", "--data", str(data), *RUN, "--init-from", str(model), "--out", str(out))
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
