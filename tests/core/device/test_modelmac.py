"""The model's integrity MAC (issue 23 item 3): AES-GMAC over the model's bytes where the model lives.

The layout is recomputed here from its documented definition with ``cryptography`` alone; the GPU cipher's
GHASH path (numba's simulator on a machine without CUDA) and the staged path give the same tag as the in-place
CPU path; any changed weight, moment or key changes it; the device answers VERIFY's MAC-only measurement.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gputravel.core.device.modelmac import MAC_SLICE, model_mac
from gputravel.core.errors import DeviceError
from gputravel.core.training.model import GPTConfig
from gputravel.core.training.trainer import Trainer, TrainSettings

CONFIG = GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2, n_embd=8)


def trainer(step: bool = True) -> Trainer:
    t = Trainer(CONFIG, TrainSettings(steps_per_visit=1, batch_size=2, seq_len=8), "cpu")
    if step:  # AdamW moments and step counts exist: they are MACed too
        buf = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1)).to(torch.uint8)
        t.train_on_window(buf, train_off=0, train_len=4096, fmt="byte")
    return t


def reference_mac(t: Trainer, key: bytes) -> str:
    """modelmac's documented layout, written out with cryptography alone."""
    aes = AESGCM(key)
    head = bytearray(b"gputravel/model-mac/v1\0")
    index = 0
    params = list(t.model.named_parameters())
    items: list[tuple[str, Any]] = [(f"param:{n}", p) for n, p in params]
    for n, p in params:
        items += [(f"optim:{n}:{k}", v) for k, v in sorted(t.optimizer.state.get(p, {}).items())]
    for label, value in items:
        if not isinstance(value, torch.Tensor):
            head += f"{label}={value!r}\0".encode()
            continue
        head += f"{label}|{value.dtype}|{tuple(value.shape)}\0".encode()
        raw = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        for pos in range(0, len(raw), MAC_SLICE):
            index += 1
            head += aes.encrypt(index.to_bytes(12, "big"), b"", raw[pos: pos + MAC_SLICE])
    return aes.encrypt(bytes(12), b"", bytes(head)).hex()


def test_the_model_mac_is_the_documented_gmac_layout_computed_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    from gputravel.core.device import modelmac

    t = trainer()
    key = os.urandom(32)
    mac, engine = model_mac(t.model, t.optimizer, key)
    assert engine == "cpu" and mac == reference_mac(t, key)
    assert model_mac(t.model, t.optimizer, key)[0] == mac  # deterministic under one key
    # a large state's slices are tagged side by side (this small one made large): the same MAC
    pools: list[Any] = []
    make = modelmac._tag_pool
    monkeypatch.setattr(modelmac, "MAC_PARALLEL_BYTES", 0)
    monkeypatch.setattr(modelmac, "_tag_pool", lambda m, o: pools.append(make(m, o)) or pools[-1])
    assert model_mac(t.model, t.optimizer, key) == (mac, "cpu")
    assert pools and (pools[0] is not None or len(os.sched_getaffinity(0)) < 2)
    assert model_mac(t.model, t.optimizer, os.urandom(32))[0] != mac


def test_a_changed_weight_moment_or_step_count_changes_the_mac() -> None:
    t = trainer()
    key = os.urandom(32)
    before = model_mac(t.model, t.optimizer, key)[0]
    p = next(t.model.parameters())
    with torch.no_grad():
        p.view(-1)[-1] = p.view(-1)[-1].item() + 1e-3
    after_weight = model_mac(t.model, t.optimizer, key)[0]
    assert after_weight != before
    state = t.optimizer.state[p]
    state["exp_avg_sq"].view(-1)[0] += 1e-6
    after_moment = model_mac(t.model, t.optimizer, key)[0]
    assert after_moment not in (before, after_weight)
    state["step"] += 1
    assert model_mac(t.model, t.optimizer, key)[0] not in (before, after_weight, after_moment)


def test_the_staged_path_gives_the_in_place_tag() -> None:
    t = trainer()
    key = os.urandom(32)
    cpu, _ = model_mac(t.model, t.optimizer, key, engine="cpu")
    staged, engine = model_mac(t.model, t.optimizer, key, engine="staged")
    assert engine == "staged" and staged == cpu


def test_the_gpu_ciphers_ghash_gives_the_in_place_tag() -> None:
    """The CUDA path (the GPU cipher's seal with an empty plaintext and the tensor as AAD); without CUDA it
    runs in numba's simulator on a model small enough for it."""
    pytest.importorskip("numba")
    t = trainer(step=False)
    key = os.urandom(32)
    cpu, _ = model_mac(t.model, t.optimizer, key, engine="cpu")
    gpu, engine = model_mac(t.model, t.optimizer, key, engine="gpu")
    assert engine == "gpu" and gpu == cpu


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_gpu_cipher_macs_device_memory_to_the_cpu_tag() -> None:
    t = trainer()
    key = os.urandom(32)
    cpu, _ = model_mac(t.model, t.optimizer, key)
    t.model.to("cuda")
    for state in t.optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim():
                state[k] = v.cuda()
    gpu, engine = model_mac(t.model, t.optimizer, key)
    assert gpu == cpu and engine in ("cpu+gpu", "gpu")


def test_the_device_answers_a_mac_only_measurement_and_it_sees_a_tampered_model(tmp_path: Any) -> None:
    from gputravel.core.attestation import provision_emulated
    from gputravel.core.device.service import DeviceService

    _, identity = provision_emulated(tmp_path / "state")
    svc = DeviceService(identity=identity, buffer_bytes=4096, device="cpu", allow_fault_injection=True)
    program = {"program": "gputravel.gpt2/v1", "model": CONFIG.to_dict(),
               "train": TrainSettings(steps_per_visit=1, batch_size=2, seq_len=8).to_dict()}
    svc.model.op_configure(payload=json.dumps(program).encode())
    key = os.urandom(32)
    full = svc.model.op_measure(payload=key).header
    digests = svc.counters["model_digests"]
    quick = svc.model.op_measure(payload=key, digest=False).header
    assert quick["mac"] == full["mac"] and quick["model"] == "" and quick["mac_engine"] == "cpu"
    assert svc.counters["model_digests"] == digests  # the MAC-only check hashes nothing
    svc.model.op_tamper(region="model", payload=b"")
    assert svc.model.op_measure(payload=key, digest=False).header["mac"] != full["mac"]
    with pytest.raises(DeviceError, match="32 bytes"):
        svc.model.op_measure(payload=b"short", digest=False)
    with pytest.raises(DeviceError, match="digest or a MAC key"):
        svc.model.op_measure(payload=b"", digest=False)
