"""Sealed checkpoints: round trip, tamper detection, atomic private files, key file hygiene."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import pytest
import torch

from gputravel.core.errors import ConfigError, DataError, TagError
from gputravel.core.protocol.stream import StreamSealer, rechunk
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
    header = path.read_bytes()[:80]
    assert header[:4] == b"GTCK" and b'"run_id":"r"' in header  # run id in the plaintext header


def test_flipped_ciphertext_byte_raises_tag_error(tmp_path: Path) -> None:
    store = _store(tmp_path)
    path = store.save({"w": torch.arange(10)}, run_id="r", seq=1)
    blob = bytearray(path.read_bytes())
    with store.open(path) as f:
        start = f.data_start
    blob[start + 5 + 3] ^= 0x01  # inside the first sealed chunk
    path.write_bytes(bytes(blob))
    with pytest.raises(TagError, match="authentication"):
        store.load(path)


def test_altered_header_seq_raises_tag_error(tmp_path: Path) -> None:
    store = _store(tmp_path)
    path = store.save({"w": torch.arange(10)}, run_id="r", seq=1)
    blob = bytearray(path.read_bytes())
    at = blob.index(b'"seq":1') + len(b'"seq":')
    blob[at: at + 1] = b"2"  # the plaintext header's sequence number
    renamed = store.path_for(2)
    renamed.write_bytes(bytes(blob))
    with pytest.raises(TagError, match="chunk 0 failed authentication"):
        store.load(renamed)


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


def test_a_model_state_streams_in_bounded_chunks_and_restores_in_place(tmp_path: Path) -> None:
    store = _store(tmp_path)
    trainer = _trained()
    path = store.save(trainer.state_dict(), run_id="r", seq=1, chunk_size=4096, meta={"steps": 3})
    with store.open(path) as f:
        sizes = [len(sealed) for _, sealed in f.records()]
    assert len(sizes) > 3 and max(sizes) <= 4096 + 16
    restored = Trainer(MICRO, TrainSettings(steps_per_visit=3, batch_size=2, seq_len=8, seed=9), "cpu")
    wte = restored.model.transformer["wte"].weight
    state = store.load(path, targets=restored.state_dict())
    assert state["model"]["transformer.wte.weight"] is not None
    restored.load_state_dict(state)
    assert restored.model.transformer["wte"].weight is wte  # written in place, still tied to lm_head
    assert restored.model.lm_head.weight.data_ptr() == wte.data_ptr()
    assert restored.model_digest() == trainer.model_digest()
    assert store.meta(path)["steps"] == 3


def _chunked(store: CheckpointStore) -> Path:
    return store.save({"w": torch.arange(5000, dtype=torch.float32)}, run_id="r", seq=1, chunk_size=1024)


def test_a_tampered_chunk_is_rejected_by_name(tmp_path: Path) -> None:
    store = _store(tmp_path)
    path = _chunked(store)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x40
    path.write_bytes(bytes(blob))
    with pytest.raises(TagError, match=r"checkpoint .*ckpt-000001\.gtc: chunk \d+ failed authentication"):
        store.load(path)


def test_swapped_chunks_are_rejected_by_name(tmp_path: Path) -> None:
    store = _store(tmp_path)
    path = _chunked(store)
    blob = path.read_bytes()
    rec = 5 + 1024 + 16  # a record: kind u8, length u32, a full sealed chunk
    with store.open(path) as f:
        first = f.data_start
    a, b = blob[first: first + rec], blob[first + rec: first + 2 * rec]
    path.write_bytes(blob[:first] + b + a + blob[first + 2 * rec:])
    with pytest.raises(TagError, match="chunk 0 failed authentication"):
        store.load(path)


def test_a_checkpoint_cut_at_a_chunk_boundary_is_rejected_by_name(tmp_path: Path) -> None:
    store = _store(tmp_path)
    path = _chunked(store)
    with store.open(path) as f:
        start = f.data_start
    rec = 5 + 1024 + 16
    blob = path.read_bytes()
    path.write_bytes(blob[: start + 3 * rec])  # three whole chunks, no end chunk, no meta
    with pytest.raises(DataError, match="truncated: it ends before chunk 3"):
        store.load(path)
    path.write_bytes(blob[: start + 3 * rec + 100])
    with pytest.raises(DataError, match="chunk 3 has"):
        store.load(path)


def test_a_kill_mid_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.save({"w": torch.ones(4)}, run_id="r", seq=1)
    header = store.new_header(run_id="r", seq=2, chunk_size=1024)
    writer = store.writer(header)
    writer.add(0, b"x" * 1040)  # a half-written checkpoint: the process dies here
    assert store.latest() == (1, store.path_for(1))
    reopened = _store(tmp_path)  # the next start sweeps the orphaned temporary file
    assert [p.name for p in reopened.directory.iterdir()] == ["ckpt-000001.gtc"]
    assert torch.equal(reopened.load(1, run_id="r")["w"], torch.ones(4))


def test_the_disk_writes_back_as_chunks_come_and_a_torn_file_is_still_refused_by_name(tmp_path: Path) -> None:
    """The writer starts the disk's writeback every ``writeback`` bytes (a thread of its own) without changing a
    byte: the file reads back, and cut inside a chunk it is a ``DataError`` naming that chunk; a writer given up
    mid-stream leaves no file and no thread behind."""
    store = _store(tmp_path)
    header = store.new_header(run_id="r", seq=1, chunk_size=1024)
    plain = os.urandom(20 * 1024 + 100)
    writer = store.writer(header, writeback=4096)
    wb = writer._writeback
    assert wb is not None
    with writer:
        sealer = StreamSealer(store.run_key("r"), header)
        for chunk in rechunk([plain], 1024):
            writer.add(0, sealer.seal(chunk))
        writer.add(1, sealer.end())
        deadline = time.monotonic() + 120  # the thread's first call, however loaded the machine (Linux only)
        while hasattr(os, "posix_fadvise") and wb.calls == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert wb.calls >= 1 or not hasattr(os, "posix_fadvise")  # it did start writeback
        writer.sync()
        path = writer.commit()
    assert b"".join(store.chunks(path, run_id="r")) == plain
    blob = path.read_bytes()
    with store.open(path) as f:
        start = f.data_start
    path.write_bytes(blob[: start + 7 * (5 + 1024 + 16) + 300])  # torn inside chunk 7
    with pytest.raises(DataError, match=r"ckpt-000001\.gtc is truncated: chunk 7 has"):
        list(store.chunks(path, run_id="r"))

    header2 = store.new_header(run_id="r", seq=2, chunk_size=1024)
    with pytest.raises(RuntimeError, match="given up"), store.writer(header2, writeback=1024) as w:
        s2 = StreamSealer(store.run_key("r"), header2)
        for chunk in rechunk([plain], 1024):
            w.add(0, s2.seal(chunk))
        raise RuntimeError("given up mid-stream")
    assert sorted(p.name for p in store.directory.iterdir()) == ["ckpt-000001.gtc"]
    assert not [t for t in threading.enumerate() if t.name == "checkpoint-writeback"]


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


def test_store_keeps_the_last_two_by_default_and_as_many_as_asked(tmp_path: Path) -> None:
    store = _store(tmp_path)
    for seq in range(5):
        store.save({"seq": seq}, run_id="r", seq=seq)
    assert [s for s, _ in store.checkpoints()] == [3, 4]
    assert store.load(4)["seq"] == 4
    three = _store(tmp_path / "three", keep=3)
    for seq in range(5):
        three.save({"seq": seq}, run_id="r", seq=seq)
    assert [s for s, _ in three.checkpoints()] == [2, 3, 4]


def test_prune_never_removes_the_checkpoint_the_ledger_names(tmp_path: Path) -> None:
    store = _store(tmp_path, keep=1)
    header = store.new_header(run_id="r", seq=0)
    for seq in range(3):
        header = store.new_header(run_id="r", seq=seq)
        with store.writer(header) as w:
            from gputravel.core.training.checkpoint import seal_state

            for kind, sealed in seal_state(store.run_key("r"), header, {"seq": seq}):
                w.add(kind, sealed)
            w.commit({}, prune=False)  # a run prunes only once its ledger names the new one
    assert [s for s, _ in store.checkpoints()] == [0, 1, 2]
    store.prune(protect=1)
    assert [s for s, _ in store.checkpoints()] == [1, 2]


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


def test_the_staged_paths_cuda_takes_give_the_same_bytes_and_digest() -> None:
    """On CUDA the state stream and the digest go through one bounded host stage; forced here on the CPU, they
    must give exactly what the direct paths give (the stage is smaller than most tensors)."""
    import hashlib

    from gputravel.core.training.checkpoint import state_pieces
    from gputravel.core.training.digest import hash_tensor_into

    state = _trained().state_dict()
    direct = b"".join(bytes(p) for p in state_pieces(state))
    staged = b"".join(bytes(p) for p in state_pieces(state, stage_bytes=1000, force_stage=True))
    assert staged == direct
    w = state["model"]["transformer.wte.weight"]
    a, b = hashlib.sha256(), hashlib.sha256()
    hash_tensor_into(a, "w", w)
    hash_tensor_into(b, "w", w, stage=torch.empty(777, dtype=torch.uint8))
    assert a.hexdigest() == b.hexdigest()
