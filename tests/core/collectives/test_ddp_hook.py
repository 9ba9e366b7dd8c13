"""The DDP comm hook: same training as plain DDP, loud on tampering, strict about its arguments."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gputravel.core.collectives.crypto import Phase
from gputravel.core.collectives.hook import SecureRingState, secure_ring_hook
from gputravel.core.collectives.launch import WorkerContext, run_workers
from gputravel.core.collectives.ring import RingFault, Variant, gloo_tls_available
from gputravel.core.errors import CollectiveAbortedError, CollectiveError, ConfigError, TagError, WorkerError

STEPS = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _train(ctx: WorkerContext, state: SecureRingState | None) -> list[float]:
    """A few SGD steps on this rank's shard; returns the global mean loss per step."""
    model = DDP(_model(), bucket_cap_mb=0.01)  # several buckets, so bucket order matters
    if state is not None:
        model.register_comm_hook(state, secure_ring_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    gen = torch.Generator().manual_seed(1234 + ctx.rank)
    teacher = torch.randn(32, 4, generator=torch.Generator().manual_seed(7))  # a learnable labelling
    x = torch.randn(64, 32, generator=gen)  # this rank's shard
    y = (x @ teacher).argmax(dim=1)
    losses = []
    for _ in range(STEPS):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / ctx.world_size)
    return losses


def training_worker(ctx: WorkerContext, vendor_dir: str) -> dict[str, list[float]]:
    curves = {"ddp": _train(ctx, None)}
    for variant in (Variant.RING, Variant.SECURE_NAIVE, Variant.SECURE_PIPELINED):
        state = SecureRingState(variant=variant, vendor_dir=Path(vendor_dir), chunk_bytes=4096)
        curves[variant.value] = _train(ctx, state)
        state.close()
    return curves


def tamper_worker(ctx: WorkerContext, vendor_dir: str) -> str:
    fault = RingFault("flip", rank=0, phase=Phase.REDUCE_SCATTER, step=0, chunk=0)
    state = SecureRingState(variant=Variant.SECURE_PIPELINED, vendor_dir=Path(vendor_dir), fault=fault)
    try:
        _train(ctx, state)
    except Exception as exc:  # DDP re-raises the hook's error from backward
        return f"{type(exc).__name__}: {exc}"
    return "trained"


def _named(exc: BaseException) -> str:
    """The ring's error class this is an instance of (not a name found in its text)."""
    for cls in (TagError, CollectiveAbortedError, CollectiveError):
        if isinstance(exc, cls):
            return cls.__name__
    return f"other {type(exc).__name__}"


def typed_tamper_worker(ctx: WorkerContext, vendor_dir: str) -> list[str]:
    """The docs' loop with ``state.backward(loss)``: the ring's own error class, on every rank."""
    fault = RingFault("flip", rank=0, phase=Phase.REDUCE_SCATTER, step=0, chunk=0)
    state = SecureRingState(variant="secure_pipelined", vendor_dir=vendor_dir, fault=fault)  # a str, as the docs
    model = DDP(_model(), init_sync=False, forward_sync_buffers=False)
    model.register_comm_hook(state, secure_ring_hook)
    loss = model(torch.randn(8, 32)).square().mean()
    try:
        state.backward(loss)
    except Exception as exc:
        return [_named(exc), type(exc.__cause__).__name__, str(state.error)]
    finally:
        state.close()
    return ["trained"]


def killed_peer_worker(ctx: WorkerContext, vendor_dir: str) -> None:
    """Rank 1 is killed before its third step; rank 0 reports what its backward raised, then stops. (Not the
    second: DDP's own first-iteration bucket rebuild, in forward, is DDP's plain gloo call, not the ring.)"""
    state = SecureRingState(variant="secure_pipelined", vendor_dir=vendor_dir)
    model = DDP(_model(), init_sync=False, forward_sync_buffers=False)
    model.register_comm_hook(state, secure_ring_hook)
    for step in range(3):
        if step == 2 and ctx.rank == 1:
            os._exit(9)  # a rank killed mid-training (SIGKILL, the OOM killer): no exception, its sockets close
        loss = model(torch.randn(8, 32)).square().mean()
        try:
            state.backward(loss)
        except Exception as exc:
            ctx.report([_named(exc), str(exc)])
            return
        finally:
            if step == 2:
                state.close()
    ctx.report(["trained"])


def validation_worker(ctx: WorkerContext) -> list[str]:
    seen = []
    for kwargs in ({"variant": "secure_pipelined"}, {"variant": "ring", "chunk_bytes": 16},
                   {"variant": "ring", "workers": -1}):
        try:
            SecureRingState(**kwargs)  # type: ignore[arg-type]
            seen.append("accepted")
        except ConfigError as exc:
            seen.append(exc.reason)
    return seen


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_with_secure_ring_hook_reaches_the_same_loss_as_plain_ddp(world: int, tmp_path: Path) -> None:
    curves = run_workers(training_worker, world, str(tmp_path), timeout=120)
    assert len(curves) == world
    for rank_curves in curves:
        ddp = rank_curves["ddp"]
        assert ddp[-1] < ddp[0]  # it trains
        for variant in ("ring", "secure_naive", "secure_pipelined"):
            assert rank_curves[variant] == pytest.approx(ddp, rel=1e-4, abs=1e-5), variant


@pytest.mark.parametrize("world", [2, 3])
def test_tampered_gradient_hop_fails_backward_on_every_rank(world: int, tmp_path: Path) -> None:
    results = run_workers(tamper_worker, world, str(tmp_path), timeout=120)
    assert "TagError" in results[1]  # rank 0 seals to rank 1
    assert all("CollectiveAbortedError" in r for i, r in enumerate(results) if i != 1)


def test_state_rejects_unknown_unavailable_and_invalid_settings() -> None:
    with pytest.raises(ConfigError, match="unknown variant"):
        SecureRingState(variant="bogus")
    if not gloo_tls_available():
        with pytest.raises(ConfigError, match="not available"):
            SecureRingState(variant="gloo_tls")
    results = run_workers(validation_worker, 2, timeout=60)
    assert results[0][0].startswith("secure variants need keys")
    assert "chunk_bytes" in results[0][1] and "workers" in results[0][2]


def test_tampered_hop_raises_the_rings_own_error_class_from_state_backward(tmp_path: Path) -> None:
    """DDP reports a hook's failure as a RuntimeError quoting it; ``state.backward`` raises the ring's class."""
    results = run_workers(typed_tamper_worker, 2, str(tmp_path), timeout=120)
    assert results[1][:2] == ["TagError", "RuntimeError"]  # rank 0 seals to rank 1; DDP's error is the cause
    assert results[0][:2] == ["CollectiveAbortedError", "RuntimeError"]
    assert all(r[2] == "None" for r in results)  # taken: a later backward starts clean


def test_a_rank_killed_mid_training_stops_the_other_with_a_named_collective_error(tmp_path: Path) -> None:
    seen: dict[int, Any] = {}
    with pytest.raises(WorkerError) as info:  # rank 1 died; rank 0 reported what it saw
        run_workers(killed_peer_worker, 2, str(tmp_path), timeout=120,
                    on_progress=lambda rank, payload: seen.setdefault(rank, payload))
    assert info.value.errors[1] == ("ProcessDied", "exit code 9"), info.value
    assert 0 in seen, str(info.value)
    kind, text = seen[0]
    assert kind == "CollectiveError", text
    assert "rank 0: the secure_pipelined all-reduce lost its link" in text and "a peer rank died" in text
