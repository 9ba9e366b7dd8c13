"""Checkpoints through the shared-memory ring: the device seals on a thread of its own, into the orchestrator's
ring; with a snapshot, training goes on while the checkpoint of the model before it is written."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import device_process

from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.errors import DataError, DeviceError, FrameError
from gputravel.core.protocol.ckptring import CheckpointRing, ring_supported
from gputravel.core.training.model import preset
from gputravel.core.training.store import CheckpointStore
from gputravel.core.training.trainer import TrainSettings

pytestmark = pytest.mark.skipif(not ring_supported(), reason="needs memfd and /proc (Linux)")


def _program() -> bytes:
    model = replace(preset("tiny"), block_size=16, n_layer=1, n_head=2, n_embd=32)
    train = TrainSettings(steps_per_visit=2, batch_size=2, seq_len=16)
    return json.dumps({"program": "gputravel.gpt2/v1", "model": model.to_dict(), "train": train.to_dict()}).encode()


@pytest.fixture(scope="module")
def device(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeviceClient]:
    with device_process(tmp_path_factory.mktemp("ring-device"), buffer_bytes=64 * 1024, timeout=60.0) as dev:
        dev.client.configure(_program())
        dev.client.train(train_off=0, train_len=4096, val_off=0, val_len=0, fmt="byte")
        yield dev.client


def _write(store: CheckpointStore, client: DeviceClient, seq: int, *, ring: bool) -> tuple[Path, str]:
    header = store.new_header(run_id="r", seq=seq, chunk_size=4096)  # many chunks: the ring wraps around
    with store.writer(header) as w:
        done = client.checkpoint(store.run_key("r"), header, w.add, ring=ring)
        assert done.tag_digest == w.tag_digest
        return w.commit({"model_digest": done.model_digest}), done.model_digest


def _restore(store: CheckpointStore, client: DeviceClient, path: Path) -> str:
    with store.open(path, run_id="r") as f:
        return client.restore(store.run_key("r"), f.header, f.records()).model_digest


def test_the_ring_and_the_attached_path_store_the_same_model(device: DeviceClient, tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "c", os.urandom(32), keep=5)
    ring_path, digest = _write(store, device, 1, ring=True)
    plain_path, digest2 = _write(store, device, 2, ring=False)
    assert digest == digest2 == device.measure().model
    assert _restore(store, device, ring_path) == digest
    assert _restore(store, device, plain_path) == digest


def test_a_snapshot_checkpoint_keeps_the_model_of_its_moment_while_training_goes_on(
        device: DeviceClient, tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "c", os.urandom(32))
    before = device.measure().model
    header = store.new_header(run_id="r", seq=1, chunk_size=4096)
    with store.writer(header) as w:
        pending = device.checkpoint_begin(store.run_key("r"), header, snapshot=True)
        after = device.train(train_off=0, train_len=4096, val_off=0, val_len=0, fmt="byte").model_digest
        pending.drain(w.add)  # drained only after the model changed: the snapshot is what was sealed
        done = device.checkpoint_end(pending)
        assert done.tag_digest == w.tag_digest and done.model_digest == before
        path = w.commit({})
    assert after != before
    assert _restore(store, device, path) == before


def test_an_orchestrator_that_gives_up_leaves_the_device_ready_for_the_next(device: DeviceClient,
                                                                              tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "c", os.urandom(32))
    header = store.new_header(run_id="r", seq=1, chunk_size=4096)
    pending = device.checkpoint_begin(store.run_key("r"), header)

    def broken_disk(kind: int, sealed: memoryview) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        pending.drain(broken_disk)
    with pytest.raises(DataError, match="gave up"):
        device.checkpoint_end(pending)
    path, digest = _write(store, device, 2, ring=True)
    assert _restore(store, device, path) == digest


def test_the_device_refuses_a_ring_that_is_not_a_sealed_private_memfd(device: DeviceClient, tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "c", os.urandom(32))
    header = store.new_header(run_id="r", seq=1, chunk_size=4096)
    plain = tmp_path / "not-a-ring"
    plain.write_bytes(bytes(1 << 20))
    fd = os.open(plain, os.O_RDWR)
    try:
        spec = {"path": f"/proc/{os.getpid()}/fd/{fd}", "slots": 2, "slot_bytes": (1 << 20) // 2 - 128}
        with pytest.raises(FrameError, match="not a|not sealed"):
            device.call("checkpoint", store.run_key("r"), header=header.to_dict(), ring=spec)
        with pytest.raises(FrameError, match="not a /proc"):
            device.call("checkpoint", store.run_key("r"), header=header.to_dict(), ring={**spec, "path": str(plain)})
    finally:
        os.close(fd)
    with pytest.raises(DeviceError, match="no checkpoint stream"):
        device.call("checkpoint_end")  # nothing was opened


def test_a_ring_slot_claiming_more_than_it_holds_is_refused() -> None:
    ring = CheckpointRing.create(slots=2, slot_bytes=4096)
    try:
        ring.put(0, 0, lambda slot: 100)
        import struct

        struct.pack_into("<II", ring._map, 64, 0, 10**6)  # type: ignore[arg-type]  # a lying slot head
        with pytest.raises(FrameError, match="bad slot"):
            ring.get(0)
    finally:
        ring.close()


def test_consecutive_snapshots_reuse_their_buffers_and_each_keeps_its_own_model(device: DeviceClient,
                                                                                 tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "c", os.urandom(32), keep=5)
    paths, digests = [], []
    for seq in (1, 2):
        digests.append(device.measure().model)
        header = store.new_header(run_id="r", seq=seq, chunk_size=4096)
        with store.writer(header) as w:
            pending = device.checkpoint_begin(store.run_key("r"), header, snapshot=True)
            device.train(train_off=0, train_len=4096, val_off=0, val_len=0, fmt="byte")  # changes the live model
            pending.drain(w.add)
            assert device.checkpoint_end(pending).model_digest == digests[-1]
            paths.append(w.commit({}))
    assert digests[0] != digests[1]
    assert [_restore(store, device, p) for p in paths] == digests


def test_a_visit_s_digest_taken_beside_its_evaluation_is_the_trained_model_s_hashed_once(
        device: DeviceClient, tmp_path: Path) -> None:
    before = device.stats().counters.get("model_digests", 0)
    res = device.train(train_off=0, train_len=4096, val_off=4096, val_len=4096, fmt="byte")
    assert res.val_loss is not None and res.model_digest
    assert device.stats().counters.get("model_digests", 0) == before + 1  # once, on its own thread
    m = device.measure()
    assert m.model == res.model_digest and m.digest_s == 0.0  # the memo of this model generation
    store = CheckpointStore(tmp_path / "c", os.urandom(32))
    path, digest = _write(store, device, 1, ring=True)
    assert digest == res.model_digest
    assert _restore(store, device, path) == res.model_digest  # restored and hashed afresh: the same bytes
