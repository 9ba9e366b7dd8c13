"""``secure_gpu``: the secure ring with every hop sealed and opened by the GPU cipher (core/collectives/
gpu_ring.py). On gloo the kernels run in numba's CUDA simulator, so the tensors here are tiny; the result
must be bit-identical to the CPU secure ring's and equal to dist.all_reduce, and a tampered hop must be
rejected as on the CPU path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gputravel.core.collectives.crypto import HostCrypto, Phase
from gputravel.core.collectives.keys import emulated_identity, establish_ring_keys
from gputravel.core.collectives.launch import WorkerContext, run_workers
from gputravel.core.collectives.ring import CollectiveAbortedError, RingFault, SecureRing, Variant
from gputravel.core.protocol import TagError

SIZES = (1, 7, 300, 1001)


def _keys(ctx: WorkerContext, vendor_dir: str) -> object:
    store = dist.distributed_c10d._get_default_store()
    identity, root, crl = emulated_identity(Path(vendor_dir), rank=ctx.rank, store=store)
    return establish_ring_keys(store, rank=ctx.rank, world=ctx.world_size, identity=identity, root=root, crl=crl)


def equality_worker(ctx: WorkerContext, vendor_dir: str) -> list[str]:
    ring = SecureRing(keys=_keys(ctx, vendor_dir), crypto=HostCrypto(workers=0))  # type: ignore[arg-type]
    bad = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in SIZES:
            x = torch.randn(n, generator=torch.Generator().manual_seed(10 * ctx.rank + n)).to(dtype)
            ref = x.clone()
            dist.all_reduce(ref)
            cpu = x.clone()
            ring.all_reduce(cpu, Variant.SECURE_NAIVE)
            gpu = x.clone()
            ring.all_reduce(gpu, Variant.SECURE_GPU)
            if not torch.equal(gpu, cpu):
                bad.append(f"{dtype} n={n}: differs from the CPU secure ring")
            if not torch.allclose(gpu.float(), ref.float(), rtol=1e-2, atol=1e-2):
                bad.append(f"{dtype} n={n}: differs from dist.all_reduce")
    # the CPU variants still work on the same keys after GPU calls (the nonce counters stayed in step)
    y = torch.ones(50)
    ring.all_reduce(y, Variant.SECURE_PIPELINED)
    if not torch.all(y == ctx.world_size):
        bad.append("the CPU ring broke after secure_gpu calls")
    stats = ring.stats[Variant.SECURE_GPU]
    if stats.bytes_sealed <= 0 or stats.bytes_opened <= 0:
        bad.append("no bytes counted")
    return bad


def tamper_worker(ctx: WorkerContext, vendor_dir: str) -> list[str]:
    keys = _keys(ctx, vendor_dir)
    outcomes = []
    for fault in (RingFault("flip", rank=0, phase=Phase.REDUCE_SCATTER, step=0),
                  RingFault("flip", rank=ctx.world_size - 1, phase=Phase.ALL_GATHER, step=ctx.world_size - 2)):
        ring = SecureRing(keys=keys, fault=fault, crypto=HostCrypto(workers=0))  # type: ignore[arg-type]
        x = torch.ones(64) * (ctx.rank + 1)
        try:
            ring.all_reduce(x, Variant.SECURE_GPU)
            outcomes.append("ok")
        except (TagError, CollectiveAbortedError) as exc:
            outcomes.append(type(exc).__name__ + (" zeroed" if not x.any() else " NOT zeroed"))
    y = torch.ones(40)
    SecureRing(keys=keys, crypto=HostCrypto(workers=0)).all_reduce(y, Variant.SECURE_GPU)  # type: ignore[arg-type]
    outcomes.append("recovered" if torch.all(y == ctx.world_size) else "broken")
    return outcomes


@pytest.mark.parametrize("world", [2, 3])
def test_secure_gpu_is_bit_identical_to_the_cpu_secure_ring(world: int, tmp_path: Path) -> None:
    assert run_workers(equality_worker, world, str(tmp_path), timeout=300) == [[]] * world


def test_a_tampered_hop_is_rejected_by_the_gpu_and_every_rank_aborts(tmp_path: Path) -> None:
    world = 3
    results = run_workers(tamper_worker, world, str(tmp_path), timeout=300)
    for i, receiver in enumerate((1, 0)):  # the right neighbour of the tampering rank
        for rank in range(world):
            want = "TagError zeroed" if rank == receiver else "CollectiveAbortedError zeroed"
            assert results[rank][i] == want, (i, rank, results[rank])
    assert all(r[-1] == "recovered" for r in results)


def test_secure_gpu_is_one_of_the_variants_and_listed_only_with_a_cuda_gpu_cipher() -> None:
    from gputravel.core.collectives.gpu_ring import gpu_cipher_on_cuda
    from gputravel.core.collectives.ring import available_variants

    assert Variant("secure_gpu") is Variant.SECURE_GPU and Variant.SECURE_GPU.secure
    assert (Variant.SECURE_GPU in available_variants()) == gpu_cipher_on_cuda()
