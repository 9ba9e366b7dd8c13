"""The model, the token formats and the trainer: shapes, learning, determinism, data errors."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gputravel.core.errors import ConfigError, DataError
from gputravel.core.training.model import GPT, PRESETS, GPTConfig, preset
from gputravel.core.training.shapes import LlamaConfig
from gputravel.core.training.tokens import (
    TokenFormat,
    bytes_per_token,
    check_token_range,
    gather_tokens,
    gpt2_encoding,
    tokens_from_buffer,
    vocab_size,
)
from gputravel.core.training.trainer import Trainer, TrainSettings

MICRO = GPTConfig(block_size=32, vocab_size=256, n_layer=1, n_head=2, n_embd=32)
FAST = TrainSettings(steps_per_visit=5, batch_size=4, seq_len=16, warmup_steps=2, val_batches=2)
TEXT = b"to be or not to be, that is the question. " * 40


def _buf(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# --- model ----------------------------------------------------------------------------------------
def test_model_shapes_and_tied_weights() -> None:
    model = GPT(MICRO, generator=torch.Generator().manual_seed(0))
    idx = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    logits, loss = model(idx)
    assert logits.shape == (3, 20, 256)
    assert loss is None
    _, loss = model(idx, idx)
    assert loss is not None and loss.ndim == 0
    assert model.lm_head.weight is model.transformer["wte"].weight
    assert model.lm_head.weight.data_ptr() == model.transformer["wte"].weight.data_ptr()


def test_gpt2_preset_pads_vocab_like_llmc_and_cuts_logits() -> None:
    cfg = PRESETS["gpt2"]
    assert (cfg.block_size, cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd) == (1024, 50257, 12, 12, 768)
    assert cfg.padded_vocab_size == 50304
    small_u16 = replace(MICRO, vocab_size=50257)
    model = GPT(small_u16)
    assert model.transformer["wte"].weight.shape == (50304, 32)
    logits, _ = model(torch.tensor([[50256, 3]]))
    assert logits.shape[-1] == 50257


def test_gpt2_preset_is_gpt2_124m_on_any_token_format() -> None:
    from gputravel.core.training.model import preset_for_tokens

    for token_vocab in (256, 50257):  # byte data and llm.c shards
        cfg = preset_for_tokens("gpt2", token_vocab)
        assert cfg == PRESETS["gpt2"]
    model = GPT(cfg)
    assert model.num_parameters() == 124_475_904  # GPT-2 124M with llm.c's padded (50304-row) tied embedding
    assert model.lm_head.weight is model.transformer["wte"].weight
    assert preset_for_tokens("tiny", 50257).vocab_size == 50257  # llm.c shards widen a byte-level preset
    assert preset_for_tokens("small", 256) == PRESETS["small"]


def test_initialisation_follows_gpt2_and_leaves_global_rng_alone() -> None:
    cfg = GPTConfig(block_size=16, vocab_size=256, n_layer=8, n_head=2, n_embd=64)
    before = torch.random.get_rng_state()
    model = GPT(cfg, generator=torch.Generator().manual_seed(3))
    assert torch.equal(before, torch.random.get_rng_state())
    proj = model.transformer["h"][0].mlp.c_proj.weight
    fc = model.transformer["h"][0].mlp.c_fc.weight
    assert abs(fc.std().item() - 0.02) < 0.002
    assert abs(proj.std().item() - 0.02 / 4.0) < 0.001  # 1/sqrt(2 * 8 layers)
    assert torch.all(model.transformer["h"][0].ln_1.weight == 1)


def test_config_round_trips_and_rejects_unknown_keys() -> None:
    cfg = preset("tiny", vocab_size=50257)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="bogus"):
        GPTConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    llama = LlamaConfig(rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64})
    assert LlamaConfig.from_dict(llama.to_dict()) == llama
    with pytest.raises(ConfigError, match="unknown LlamaConfig keys: bogus"):
        LlamaConfig.from_dict({**llama.to_dict(), "bogus": 1})
    with pytest.raises(ConfigError, match="n_head"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ConfigError, match="unknown model preset"):
        preset("huge")


# --- tokens ---------------------------------------------------------------------------------------
def test_token_format_sizes() -> None:
    assert (bytes_per_token("byte"), vocab_size(TokenFormat.BYTE)) == (1, 256)
    assert (bytes_per_token("u16"), vocab_size(TokenFormat.U16)) == (2, 50257)


def test_u16_tokens_decode_unsigned_little_endian_at_any_offset() -> None:
    values = [0, 1, 255, 256, 32767, 32768, 50256, 65535]
    raw = b"".join(v.to_bytes(2, "little") for v in values)
    buf = _buf(b"\x00" + raw)
    for window in (buf[1:], _buf(raw)):  # odd offset (copy path) and aligned (view path)
        out = tokens_from_buffer(window, "u16")
        assert out.dtype == torch.int64
        assert out.tolist() == values
        assert gather_tokens(window, "u16", torch.tensor([[5, 6]])).tolist() == [[32768, 50256]]


def test_byte_tokens_are_the_bytes() -> None:
    assert tokens_from_buffer(_buf(b"\x00\xffA"), "byte").tolist() == [0, 255, 65]


def test_partial_token_or_wrong_dtype_is_a_data_error() -> None:
    with pytest.raises(DataError, match="whole number"):
        tokens_from_buffer(_buf(b"abc"), "u16")
    with pytest.raises(DataError, match="uint8"):
        tokens_from_buffer(torch.zeros(4, dtype=torch.int32), "byte")


def test_out_of_vocabulary_u16_token_is_refused() -> None:
    check_token_range(_buf((50256).to_bytes(2, "little")), "u16", 50257)
    with pytest.raises(DataError, match="50257"):
        check_token_range(_buf((7).to_bytes(2, "little") + (50257).to_bytes(2, "little")), "u16", 50257)


def test_gpt2_encoding_matches_gpt2(tmp_path: Path, bpe_wheel: Path) -> None:
    enc = gpt2_encoding(cache=tmp_path, wheel=bpe_wheel)
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert enc.n_vocab == 50257


# --- trainer --------------------------------------------------------------------------------------
def test_loss_decreases_on_repetitive_text() -> None:
    trainer = Trainer(MICRO, replace(FAST, steps_per_visit=30, lr=1e-2), "cpu")
    buf = _buf(TEXT)
    before = trainer.eval_on_window(buf, val_off=0, val_len=len(TEXT), fmt="byte")
    result = trainer.train_on_window(buf, train_off=0, train_len=len(TEXT), fmt="byte")
    after = trainer.eval_on_window(buf, val_off=0, val_len=len(TEXT), fmt="byte")
    assert len(result.losses) == 30 and trainer.step == 30
    assert result.tokens == 30 * 4 * 16 and result.tokens_per_s > 0
    assert before is not None and after is not None
    assert after < 0.6 * before
    assert sum(result.losses[-5:]) < sum(result.losses[:5])


def test_same_seed_same_digest_different_seed_different_digest() -> None:
    buf = _buf(TEXT)
    digests = []
    for seed in (1, 1, 2):
        trainer = Trainer(MICRO, replace(FAST, seed=seed), "cpu")
        trainer.train_on_window(buf, train_off=0, train_len=len(TEXT), fmt="byte")
        digests.append(trainer.model_digest())
    assert digests[0] == digests[1]
    assert digests[0] != digests[2]


def test_digest_covers_optimizer_state() -> None:
    trainer = Trainer(MICRO, FAST, "cpu")
    trainer.train_on_window(_buf(TEXT), train_off=0, train_len=len(TEXT), fmt="byte")
    before = trainer.model_digest()
    p = next(iter(trainer.model.parameters()))
    trainer.optimizer.state[p]["exp_avg"].add_(1e-3)
    assert trainer.model_digest() != before


def test_resume_from_state_continues_bit_for_bit() -> None:
    buf = _buf(TEXT)
    straight = Trainer(MICRO, FAST, "cpu")
    straight.train_on_window(buf, train_off=0, train_len=len(TEXT), fmt="byte")
    straight.train_on_window(buf, train_off=0, train_len=len(TEXT), fmt="byte")

    first = Trainer(MICRO, FAST, "cpu")
    first.train_on_window(buf, train_off=0, train_len=len(TEXT), fmt="byte")
    resumed = Trainer(MICRO, replace(FAST, seed=99), "cpu")
    resumed.load_state_dict(first.state_dict())
    resumed.train_on_window(buf, train_off=0, train_len=len(TEXT), fmt="byte")
    assert resumed.step == straight.step == 10
    assert resumed.model_digest() == straight.model_digest()


def test_state_of_another_model_shape_is_refused() -> None:
    state = Trainer(MICRO, FAST, "cpu").state_dict()
    other = Trainer(replace(MICRO, n_embd=64), FAST, "cpu")
    with pytest.raises(ConfigError, match="differs"):
        other.load_state_dict(state)


def test_u16_window_trains_on_a_bpe_sized_model() -> None:
    cfg = replace(MICRO, vocab_size=50257)
    ids = [(i * 7919) % 50257 for i in range(200)] + [50256, 40000]
    raw = b"".join(v.to_bytes(2, "little") for v in ids)
    trainer = Trainer(cfg, replace(FAST, steps_per_visit=2), "cpu")
    result = trainer.train_on_window(_buf(b"\x00" + raw), train_off=1, train_len=len(raw), fmt="u16")
    assert len(result.losses) == 2 and all(loss > 0 for loss in result.losses)


def test_short_training_window_is_a_data_error_naming_the_need() -> None:
    trainer = Trainer(MICRO, FAST, "cpu")
    with pytest.raises(DataError, match=r"seq_len \+ 1 = 17"):
        trainer.train_on_window(_buf(b"x" * 16), train_off=0, train_len=16, fmt="byte")


def test_window_outside_buffer_is_a_data_error() -> None:
    trainer = Trainer(MICRO, FAST, "cpu")
    with pytest.raises(DataError, match="outside"):
        trainer.train_on_window(_buf(TEXT), train_off=10, train_len=len(TEXT), fmt="byte")


def test_short_held_out_part_gives_none_and_eval_is_deterministic() -> None:
    trainer = Trainer(MICRO, FAST, "cpu")
    buf = _buf(TEXT)
    assert trainer.eval_on_window(buf, val_off=0, val_len=16, fmt="byte") is None
    a = trainer.eval_on_window(buf, val_off=100, val_len=1000, fmt="byte")
    b = trainer.eval_on_window(buf, val_off=100, val_len=1000, fmt="byte")
    assert a is not None and a == b
    assert trainer.model.training


def test_u16_data_on_a_byte_model_is_a_config_error() -> None:
    trainer = Trainer(MICRO, FAST, "cpu")
    with pytest.raises(ConfigError, match="vocabulary"):
        trainer.train_on_window(_buf(TEXT), train_off=0, train_len=len(TEXT), fmt="u16")


def test_seq_len_beyond_block_size_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        Trainer(MICRO, replace(FAST, seq_len=64), "cpu")


def test_learning_rate_schedule_warms_up_then_decays_to_ten_percent() -> None:
    s = TrainSettings(lr=1.0, warmup_steps=4, total_steps=20)
    assert s.lr_at(0) == pytest.approx(0.25)
    assert s.lr_at(3) == pytest.approx(1.0)
    assert s.lr_at(19) == pytest.approx(0.1, abs=0.02)
    assert s.lr_at(100) == pytest.approx(0.1)
    assert TrainSettings(lr=1.0, warmup_steps=0).lr_at(1000) == 1.0


# --- TRAIN in slices ------------------------------------------------------------------------------
def test_training_in_slices_ends_bit_identical_to_one_piece() -> None:
    settings = replace(FAST, steps_per_visit=6)
    whole, sliced = Trainer(MICRO, settings, "cpu"), Trainer(MICRO, settings, "cpu")
    one = whole.train_on_window(_buf(TEXT), train_off=0, train_len=len(TEXT), fmt="byte")
    parts = [sliced.train_on_window(_buf(TEXT), train_off=0, train_len=len(TEXT), fmt="byte", steps=n)
             for n in (1, 2, 3)]
    assert [x for p in parts for x in p.losses] == one.losses
    assert [len(p.losses) for p in parts] == [1, 2, 3] and [p.tokens for p in parts] == [64, 128, 192]
    assert sliced.step == whole.step == 6
    assert sliced.model_digest() == whole.model_digest()


def test_time_budget_cuts_a_slice_after_its_first_step() -> None:
    trainer = Trainer(MICRO, replace(FAST, steps_per_visit=50), "cpu")
    res = trainer.train_on_window(_buf(TEXT), train_off=0, train_len=len(TEXT), fmt="byte", budget_s=1e-9)
    assert len(res.losses) == 1 and trainer.step == 1  # at least one step, never more once the budget is spent
    res = trainer.train_on_window(_buf(TEXT), train_off=0, train_len=len(TEXT), fmt="byte", steps=4, budget_s=60)
    assert len(res.losses) == 4 and trainer.step == 5


@pytest.mark.parametrize("kw", [{"steps": 0}, {"steps": -1}, {"budget_s": 0.0}, {"budget_s": -1.0}])
def test_empty_training_slice_is_a_config_error(kw: dict[str, float]) -> None:
    trainer = Trainer(MICRO, FAST, "cpu")
    with pytest.raises(ConfigError, match="training slice"):
        trainer.train_on_window(_buf(TEXT), train_off=0, train_len=len(TEXT), fmt="byte", **kw)  # type: ignore[arg-type]
    assert trainer.step == 0
