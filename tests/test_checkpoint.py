"""Sealed checkpoints: round trip, tamper detection, atomic private files, key file hygiene."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from gputravel.core.errors import ConfigError, DataError, TagError
from gputravel.core.training.checkpoint import CheckpointStore, load_or_create_key
from gputravel.core.training.model import GPTConfig
from gputravel.core.training.trainer import Trainer, TrainSettings

MICRO = GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2, n_embd=16)
FAST = TrainSettings(steps_per_visit=3, batch_size=2, seq_len=8, warmup_steps=1)
TEXT = b"all the world's a stage, and all the men and women merely players. " * 4


def _store(tmp_path: Path, **kw: int) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ckpt", load_or_create_key(tmp_path / "keys" / "ckpt.key"), **kw)


def _trained() -> Trainer:
    trainer = Trainer(MICRO, FAST, "cpu")
    trainer.train_on_window(torch.frombuffer(bytearray(TEXT), dtype=torch.uint8), train_off=0,
                            train_len=len(TEXT), fmt="byte")
    return trainer


def test_trainer_state_round_trips_through_a_sealed_checkpoint(tmp_path: Path) -> None:
    store = _store(tmp_path)
    trainer = _trained()
    path = store.save(trainer.state_dict(), run_id="run-a", seq=7)
    assert path.name == "ckpt-000007.gtc"
    assert store.latest() == (7, path)
    restored = Trainer(MICRO, FAST, "cpu")
    restored.load_state_dict(store.load(7, run_id="run-a"))
    assert restored.step == trainer.step == 3
    assert restored.model_digest() == trainer.model_digest()
    assert torch.equal(restored.generator.get_state(), trainer.generator.get_state())


def test_checkpoint_file_is_private_and_leaves_no_temp_files(tmp_path: Path) -> None:
    store = _store(tmp_path)
    path = store.save({"w": torch.ones(3)}, run_id="r", seq=1)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in store.directory.iterdir()] == ["ckpt-000001.gtc"]
    header = path.read_bytes()[:16]
    assert header[:4] == b"GTCK" and header[13:16] == b"\x00\x01r"  # run id in the plaintext header


def test_flipped_ciphertext_byte_raises_tag_error(tmp_path: Path) -> None:
    store = _store(tmp_path)
    path = store.save({"w": torch.arange(10)}, run_id="r", seq=1)
    blob = bytearray(path.read_bytes())
    blob[-20] ^= 0x01
    path.write_bytes(bytes(blob))
    with pytest.raises(TagError, match="authentication"):
        store.load(path)


def test_altered_header_seq_raises_tag_error(tmp_path: Path) -> None:
    store = _store(tmp_path)
    path = store.save({"w": torch.arange(10)}, run_id="r", seq=1)
    blob = bytearray(path.read_bytes())
    blob[12] ^= 0x01  # low byte of the big-endian seq
    path.write_bytes(bytes(blob))
    with pytest.raises(TagError):
        store.load(path)


def test_renamed_checkpoint_is_detected(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.save({"w": torch.zeros(1)}, run_id="r", seq=1)
    os.replace(store.path_for(1), store.path_for(5))
    with pytest.raises(TagError, match="renamed"):
        store.load(5)


def test_checkpoint_of_another_run_or_key_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    path = store.save({"w": torch.zeros(1)}, run_id="run-a", seq=1)
    with pytest.raises(TagError, match="run-a"):
        store.load(path, run_id="run-b")
    other = CheckpointStore(tmp_path / "ckpt", os.urandom(32))
    with pytest.raises(TagError, match="another key"):
        other.load(path)


def test_truncated_checkpoint_is_a_clear_data_error(tmp_path: Path) -> None:
    store = _store(tmp_path)
    path = store.save({"w": torch.ones(100)}, run_id="r", seq=1)
    blob = path.read_bytes()
    path.write_bytes(blob[:-50])
    with pytest.raises(DataError, match="truncated"):
        store.load(path)
    path.write_bytes(blob[:6])
    with pytest.raises(DataError, match="truncated"):
        store.load(path)


def test_store_keeps_the_last_three(tmp_path: Path) -> None:
    store = _store(tmp_path)
    for seq in range(5):
        store.save({"seq": seq}, run_id="r", seq=seq)
    assert [s for s, _ in store.checkpoints()] == [2, 3, 4]
    assert store.load(4)["seq"] == 4


def test_key_is_created_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "k" / "ckpt.key"
    key = load_or_create_key(path)
    assert len(key) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_key(path) == key


@pytest.mark.parametrize(("mode", "word"), [(0o604, "world-readable"), (0o640, "group-readable")])
def test_key_file_readable_by_others_is_refused(tmp_path: Path, mode: int, word: str) -> None:
    path = tmp_path / "ckpt.key"
    load_or_create_key(path)
    path.chmod(mode)
    with pytest.raises(ConfigError, match=word) as info:
        load_or_create_key(path)
    assert str(path) in str(info.value)


def test_key_file_of_wrong_length_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.key"
    path.write_bytes(b"short")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="5 bytes"):
        load_or_create_key(path)


def test_device_state_is_sealed_as_the_device_serialised_it_and_reads_back_byte_for_byte(tmp_path: Path) -> None:
    import io

    store = _store(tmp_path)
    trainer = _trained()
    buf = io.BytesIO()
    torch.save(trainer.state_dict(), buf)
    blob = buf.getvalue()
    record = {"model_digest": trainer.model_digest(), "seq": 4, "epoch": 9, "note": "", "steps": 3}
    path = store.save_device_state(memoryview(blob), record, run_id="run-a", seq=4)
    assert path.read_bytes()[4] == 2  # format version 2: the blob is not serialised a second time
    got_record, got_blob = store.load_device_state(4, run_id="run-a")
    assert got_record == record and bytes(got_blob) == blob
    assert store.load(4)["model_digest"] == record["model_digest"]
    restored = Trainer(MICRO, FAST, "cpu")
    restored.load_state_dict(torch.load(io.BytesIO(bytes(got_blob)), weights_only=False))
    assert restored.model_digest() == trainer.model_digest()
    with pytest.raises(TagError, match="belongs to run"):
        store.load_device_state(4, run_id="run-b")
    sealed = bytearray(path.read_bytes())
    sealed[-5] ^= 0x01  # inside the sealed device state
    path.write_bytes(bytes(sealed))
    with pytest.raises(TagError, match="authentication"):
        store.load_device_state(4)


def test_a_version_1_checkpoint_holding_a_device_state_tensor_still_reads(tmp_path: Path) -> None:
    store = _store(tmp_path)
    blob = os.urandom(1000)
    store.save({"device_state": torch.frombuffer(bytearray(blob), dtype=torch.uint8), "model_digest": "ab",
                "seq": 1}, run_id="r", seq=1)
    record, got = store.load_device_state(1, run_id="r")
    assert bytes(got) == blob and record["model_digest"] == "ab"
