"""The model digest ``gputravel/model-digest/v3``: one BLAKE3 per tensor (``v2``: SHA-256, still checked), a
frozen tensor's kept between digests while torch counts no write to it; any change, in place too, to a base weight,
an adapter or an optimizer moment changes the digest, which always equals a recomputation from scratch. A stream
sealed in ``v2`` still restores and is checked in ``v2``; one whose digest differs is refused by name."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

from gputravel.core.device.modelmac import state_tensors
from gputravel.core.errors import DataError, IntegrityError
from gputravel.core.protocol.deviceanswers import DeviceState
from gputravel.core.training.digest import (
    DIGEST_FORMAT,
    DIGEST_FORMATS,
    check_digest_format,
    combine,
    digest_trailer,
    tensor_entry,
    value_entry,
)
from gputravel.core.training.llama import LlamaConfig
from gputravel.core.training.trainer import Trainer, TrainSettings
from gputravel.core.travel.device_session import restored_model


def _trainer(**lora: object) -> Trainer:
    return Trainer(LlamaConfig(), TrainSettings(steps_per_visit=2, batch_size=2, seq_len=16, seed=5, **lora), "cpu")


_HASHES: dict[str, Any] = {"v3": blake3.blake3, "v2": hashlib.sha256}


def _from_scratch(t: Trainer, fmt: str = "v3") -> str:
    """The digest recomputed with no memo, straight from the format's definition (v3: BLAKE3, v2: SHA-256)."""
    hash_ = _HASHES[fmt]
    entries = []
    for label, value in state_tensors(t.model, t.optimizer):
        if isinstance(value, torch.Tensor):
            h = hash_(f"{label}|{value.dtype}|{tuple(value.shape)}\0".encode())
            h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            entries.append(h.digest())
        else:
            entries.append(hash_(f"{label}={value!r}\0".encode()).digest())
    return str(hash_(f"gputravel/model-digest/{fmt}\0".encode() + b"".join(entries)).hexdigest())


def _step(t: Trainer) -> None:
    buf = torch.randint(0, 256, (2048,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    t.train_on_window(buf, train_off=0, train_len=2048, fmt="byte")


def test_a_lora_digest_hashes_the_frozen_base_once_and_sees_every_change() -> None:
    t = _trainer(lora_rank=2)
    params = dict(t.model.named_parameters())
    frozen = [n for n, p in params.items() if not p.requires_grad]
    adapters = [n for n, p in params.items() if p.requires_grad]
    assert frozen and adapters
    first = t.model_digest()
    assert first == _from_scratch(t) and t.frozen_hashes.hashed == len(params)
    assert t.model_digest() == first and t.frozen_hashes.hashed == len(params) + len(adapters)  # base reused
    _step(t)
    trained = t.model_digest()
    assert trained != first and trained == _from_scratch(t)
    assert t.frozen_hashes.hashed == len(params) + 2 * len(adapters)  # the base still not rehashed
    seen = {trained}
    for name in (frozen[0], frozen[-1], adapters[0]):  # a base weight, the last one, an adapter: in place
        with torch.no_grad():
            params[name].view(-1)[0] += 1.0
        now = t.model_digest()
        assert now not in seen and now == _from_scratch(t), name
        seen.add(now)
    moment = next(v for s in t.optimizer.state.values() for k, v in s.items() if k == "exp_avg")
    moment.view(-1)[-1] += 1.0  # an optimizer moment, in place
    assert t.model_digest() not in seen and t.model_digest() == _from_scratch(t)


def test_a_write_torch_does_not_count_is_seen_after_forget_and_a_full_model_keeps_nothing() -> None:
    t = _trainer(lora_rank=2)
    before = t.model_digest()
    base = next(p for p in t.model.parameters() if not p.requires_grad)
    base.data.view(-1)[0] += 1.0  # through .data: torch's version counter does not move
    t.frozen_hashes.forget()  # what the device's restore does before it writes the tensors' memory
    assert t.model_digest() != before and t.model_digest() == _from_scratch(t)
    full = _trainer()
    n = len(list(full.model.parameters()))
    _step(full)
    assert full.model_digest() == _from_scratch(full) and full.model_digest() == _from_scratch(full)
    assert full.frozen_hashes.hashed == 2 * n  # nothing is frozen: every digest hashes every parameter


def test_entries_and_the_trailer_name_the_format() -> None:
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    for fmt, hash_ in _HASHES.items():  # the documented layout, in each format (v3 by default)
        want = hash_(f"gputravel/model-digest/{fmt}\0".encode()
                     + hash_(b"param:w|torch.float32|(2, 3)\0" + w.numpy().tobytes()).digest()
                     + hash_(b"optim:w:step=3\0").digest()).hexdigest()
        assert combine([tensor_entry("param:w", w, fmt=fmt), value_entry("optim:w:step", 3, fmt)], fmt) == want
        assert check_digest_format(digest_trailer("ab" * 32, fmt), "checkpoint 1") == fmt
    assert combine([tensor_entry("param:w", w)]) == combine([tensor_entry("param:w", w, fmt="v3")], "v3")
    assert digest_trailer("ab")["digest_format"] == DIGEST_FORMAT == "v3" and DIGEST_FORMATS == ("v2", "v3")
    with pytest.raises(DataError, match=r"checkpoint 3 of r was sealed with model digest 'v1'"):
        check_digest_format({"model_digest": "ab" * 32}, "checkpoint 3 of r")
    with pytest.raises(DataError, match=r"sealed with model digest 'v9'"):
        check_digest_format(digest_trailer("ab" * 32, "v9"), "checkpoint 4 of r")


def test_a_large_digest_is_hashed_side_by_side_and_equals_the_format(monkeypatch: pytest.MonkeyPatch) -> None:
    from gputravel.core.training import digest

    threads: list[str] = []
    one = digest.tensor_entry

    def counted(label: str, tensor: torch.Tensor, *, fmt: str = DIGEST_FORMAT) -> bytes:
        threads.append(threading.current_thread().name)
        return one(label, tensor, fmt=fmt)

    monkeypatch.setattr(digest, "tensor_entry", counted)
    monkeypatch.setattr(digest, "DIGEST_PARALLEL_BYTES", 0)  # the tiny model counts as large
    monkeypatch.setattr(digest, "digest_workers", lambda: 3)
    t = _trainer(lora_rank=2)
    _step(t)
    n_params = len(list(t.model.parameters()))
    assert t.model_digest() == _from_scratch(t) and t.frozen_hashes.hashed == n_params  # every parameter once
    assert threads and all(name.startswith("model-digest") for name in threads)  # every entry on the pool
    _step(t)
    assert t.model_digest() == _from_scratch(t)  # the frozen base kept across the pool's hashes
    assert t.frozen_hashes.hashed == n_params + sum(p.requires_grad for p in t.model.parameters())
    items = [(f"w{i}", torch.full((1000 + i,), float(i))) for i in range(7)]
    assert digest.tensor_entries(items, workers=2) == digest.tensor_entries(items, workers=1) == [
        one(label, w) for label, w in items]  # in the items' order, whatever thread hashed each


def _device(tmp_path: Path) -> Any:
    from gputravel.core.attestation import provision_emulated
    from gputravel.core.device.service import DeviceService

    _, identity = provision_emulated(tmp_path / "state")
    svc = DeviceService(identity=identity, buffer_bytes=64 * 1024, device="cpu")
    program = {"program": "gputravel.gpt2/v1", "model": LlamaConfig().to_dict(),
               "train": TrainSettings(steps_per_visit=2, batch_size=2, seq_len=16, seed=5).to_dict()}
    svc.model.op_configure(payload=json.dumps(program).encode())
    return svc


def _restore(svc: Any, key: bytes, trailer: dict[str, str], state: Any) -> dict[str, Any]:
    from gputravel.core.protocol.stream import StreamHeader
    from gputravel.core.training.checkpoint import seal_state

    header = StreamHeader.new(kind="checkpoint", run_id="run-d", seq=1)
    svc.streams.op_restore(header=header.to_dict(), payload=key)
    for kind, sealed in seal_state(key, header, state, trailer=trailer):
        svc.streams.op_restore_chunk(kind=kind, payload=bytes(sealed))
    return dict(svc.streams.op_restore_end(payload=b"").header)


def test_a_v2_checkpoint_still_restores_checked_in_v2_and_a_differing_digest_is_refused_by_name(
        tmp_path: Path) -> None:
    trained = _trainer()
    _step(trained)
    state, key = trained.state_dict(), os.urandom(32)
    v2, v3 = _from_scratch(trained, "v2"), _from_scratch(trained, "v3")
    assert v2 != v3 and trained.model_digest("v2") == v2 and trained.model_digest() == v3
    svc = _device(tmp_path)
    answer = _restore(svc, key, digest_trailer(v2, "v2"), state)  # sealed before v3: checked in v2
    assert (answer["sealed_digest"], answer["sealed_format"], answer["model_digest"]) == (v2, "v2", v3)
    assert svc.model.model_digest() == v3 and svc.model.trainer.step == trained.step
    assert _restore(svc, key, digest_trailer(v3), state)["sealed_digest"] == v3  # and the current format
    for trailer in (digest_trailer(v3, "v2"), digest_trailer(v2, "v3")):  # a digest that differs, either format
        with pytest.raises(IntegrityError, match=rf"checkpoint 1 of run-d restored to a model whose digest "
                                                 rf"\({trailer['digest_format']}\) .* differs from the sealed"):
            _restore(svc, key, trailer, state)
        assert svc.model.incomplete  # refused: no training on it until a restore succeeds
    with pytest.raises(DataError, match="sealed with model digest 'v1'"):
        _restore(svc, key, {"model_digest": v2}, state)
    # the orchestrator's side: the run's record of that checkpoint (the ledger's, written in v2) against the
    # device's digest in v2; the model expected from then on is the v3 one
    restored = DeviceState.from_wire(answer)
    assert restored_model(restored, 1, v2) == v3
    for recorded in (v3, "00" * 32, None):
        with pytest.raises(IntegrityError, match=r"checkpoint 1 restored to a model whose digest \(v2\) differs"):
            restored_model(restored, 1, recorded)
