"""The secure ring all-reduce: equal to dist.all_reduce, tamper- and replay-evident, attested keys.

Multi-rank tests run real torch.distributed processes (gloo on 127.0.0.1); one job per world size
checks many cases, to keep the file fast on two cores.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gputravel.core.collectives.crypto import ALL_RANKS, HopAad, HopOpener, HopSealer, HostCrypto, Phase
from gputravel.core.collectives.keys import emulated_identity, establish_ring_keys
from gputravel.core.collectives.launch import WorkerContext, run_workers
from gputravel.core.collectives.parts import MAX_PIECES, WIRE_PIECE_BYTES, RingPlan, _pieces
from gputravel.core.collectives.ring import (
    DIRECT_CHUNK_BYTES,
    DIRECT_MAX_BYTES,
    CollectiveAbortedError,
    RingFault,
    SecureRing,
    Variant,
    available_variants,
    gloo_tls_available,
)
from gputravel.core.errors import AttestationError
from gputravel.core.protocol import TagError, channel_key
from gputravel.core.protocol.errors import NonceExhaustedError

SIZES = (1, 2, 7, 1000, 65_537)  # below, at and not dividing by the world size; several chunks
SMALL_CHUNK = 4096  # many chunks even for small tensors


def _ring(ctx: WorkerContext, vendor_dir: str, **kwargs: object) -> SecureRing:
    store = dist.distributed_c10d._get_default_store()
    identity, root, crl = emulated_identity(Path(vendor_dir), rank=ctx.rank, store=store)
    keys = establish_ring_keys(store, rank=ctx.rank, world=ctx.world_size, identity=identity, root=root, crl=crl)
    return SecureRing(keys=keys, chunk_bytes=SMALL_CHUNK, **kwargs)  # type: ignore[arg-type]


# --- workers (module level: spawned processes import them) -------------------------------------------
def equality_worker(ctx: WorkerContext, vendor_dir: str) -> list[str]:
    """Every variant against dist.all_reduce; returns the mismatches seen on this rank."""
    rings = {"sealed-inline": _ring(ctx, vendor_dir, sealed_gather=True, crypto=HostCrypto(workers=0))}
    keys = rings["sealed-inline"].keys
    rings["reseal-pool"] = SecureRing(keys=keys, chunk_bytes=SMALL_CHUNK, sealed_gather=False,
                                      crypto=HostCrypto(workers=2))
    rings["sealed-pool"] = SecureRing(keys=keys, chunk_bytes=SMALL_CHUNK, crypto=HostCrypto(workers=2))
    bad: list[str] = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.1)):
        for n in SIZES:
            gen = torch.Generator().manual_seed(100 * ctx.rank + n)
            x = torch.randn(n, generator=gen).to(dtype)
            ref = x.clone()
            dist.all_reduce(ref)
            for name, ring in rings.items():
                for v in available_variants():
                    y = x.clone()
                    ring.all_reduce(y, v)
                    want = x if v is Variant.NOOP else ref
                    if not torch.allclose(y.float(), want.float(), rtol=tol, atol=tol):
                        bad.append(f"{name} {v} {dtype} n={n}: max err {(y.float() - want.float()).abs().max():.3g}")
    # a non-contiguous tensor is reduced in place too
    x = torch.arange(12.0).reshape(3, 4).t() * (ctx.rank + 1)
    rings["sealed-pool"].all_reduce(x, Variant.SECURE_PIPELINED)
    want = torch.arange(12.0).reshape(3, 4).t() * sum(range(1, ctx.world_size + 1))
    if not torch.equal(x, want):
        bad.append("non-contiguous tensor")
    # world 2 with auto chunking and no free core: secure_pipelined sends a small tensor as one sealed hop each
    # way (run_direct); the sum is the same bits as dist.all_reduce's (x0 + x1 on one rank, x1 + x0 on the other)
    if ctx.world_size == 2:
        direct = SecureRing(keys=keys, chunk_bytes=None, crypto=HostCrypto(workers=0))
        for n in (1, 7, 65_537, DIRECT_MAX_BYTES // 4):
            x = torch.randn(n, generator=torch.Generator().manual_seed(ctx.rank + n))
            ref = x.clone()
            dist.all_reduce(ref)
            y = x.clone()
            direct.all_reduce(y, Variant.SECURE_PIPELINED)
            if not torch.equal(y, ref):
                bad.append(f"direct n={n}: max err {(y - ref).abs().max():.3g}")
        sealed = direct.stats[Variant.SECURE_PIPELINED].bytes_sealed
        if sealed != 4 * (1 + 7 + 65_537 + DIRECT_MAX_BYTES // 4):
            bad.append(f"direct sealed {sealed} bytes: not each tensor once")
    # a segment over the wire's piece size (16 MB: 8 MB hops at world 2, 5.3 MB at 3) goes as several pieces
    whole = SecureRing(keys=keys, chunk_bytes=None, crypto=HostCrypto(workers=0))
    x = torch.randn(4_000_003, generator=torch.Generator().manual_seed(ctx.rank))
    ref = x.clone()
    dist.all_reduce(ref)
    for v in (Variant.RING, Variant.SECURE_NAIVE, Variant.SECURE_PIPELINED):
        y = x.clone()
        whole.all_reduce(y, v)
        if not torch.allclose(y, ref, rtol=1e-5, atol=1e-5):
            bad.append(f"pieced {v}: max err {(y - ref).abs().max():.3g}")
    return bad


def tamper_worker(ctx: WorkerContext, vendor_dir: str, cases: list[tuple[str, RingFault]]) -> list[str]:
    """Run each (variant, fault) once (a replay fault twice); return what each call raised on this rank. A
    ``Phase.DIRECT`` fault runs the direct schedule (world 2, auto chunking, inline crypto)."""
    outcomes = []
    keys = _ring(ctx, vendor_dir).keys
    for variant, fault in cases:
        direct = fault.phase is Phase.DIRECT
        ring = SecureRing(keys=keys, chunk_bytes=None if direct else SMALL_CHUNK, fault=fault,
                          crypto=HostCrypto(workers=0 if direct else len(outcomes) % 2 * 2))  # inline and pool
        x = torch.ones(6000) * (ctx.rank + 1)  # two chunks per segment at world 3
        if fault.kind == "replay":
            ring.all_reduce(x.clone(), variant)  # the first call is recorded, and passes
        try:
            ring.all_reduce(x, variant)
            outcomes.append("ok")
        except (TagError, CollectiveAbortedError) as exc:
            outcomes.append(type(exc).__name__ + (" zeroed" if not x.any() else " NOT zeroed"))
    # the ring still works after an aborted call
    y = torch.ones(3000)
    SecureRing(keys=keys, chunk_bytes=SMALL_CHUNK).all_reduce(y, Variant.SECURE_PIPELINED)
    outcomes.append("recovered" if torch.all(y == ctx.world_size) else "broken")
    return outcomes


def chunked_direct_worker(ctx: WorkerContext, vendor_dir: str) -> list[str]:
    """World 2, no free core, tensors over DIRECT_MAX_BYTES: the direct schedule in DIRECT_CHUNK_BYTES hops. The
    sum must be dist.all_reduce's bits, each tensor sealed once, the link's counter advanced by the nonces the
    call reserved (never reused), and a flipped later hop rejected by its receiver with every rank zeroed. The
    chunked direct schedule is off by default (``DIRECT_CHUNKED``); this spawned rank turns it on for itself."""
    import gputravel.core.collectives.ring as ring_module

    ring_module.DIRECT_CHUNKED = True
    keys = _ring(ctx, vendor_dir).keys
    ring = SecureRing(keys=keys, chunk_bytes=None, crypto=HostCrypto(workers=0))
    bad: list[str] = []
    sizes = (DIRECT_MAX_BYTES // 4 + 1, 2 * DIRECT_CHUNK_BYTES // 4 + 3)  # 2 hops (the last one 4 bytes), 3 hops
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(ctx.rank + n))
        ref = x.clone()
        dist.all_reduce(ref)
        before = keys.send.counter
        y = x.clone()
        ring.all_reduce(y, Variant.SECURE_PIPELINED)
        if not torch.equal(y, ref):
            bad.append(f"chunked direct n={n}: max err {(y - ref).abs().max():.3g}")
        hops = -(-n * 4 // DIRECT_CHUNK_BYTES)
        if not hops <= keys.send.counter - before:
            bad.append(f"n={n}: {hops} hops but {keys.send.counter - before} nonces reserved")
    sealed = ring.stats[Variant.SECURE_PIPELINED].bytes_sealed
    if sealed != 4 * sum(sizes):
        bad.append(f"chunked direct sealed {sealed} bytes: not each tensor once")
    fault = RingFault("flip", rank=0, phase=Phase.DIRECT, chunk=1)
    tampered = SecureRing(keys=keys, chunk_bytes=None, crypto=HostCrypto(workers=0), fault=fault)
    x = torch.ones(sizes[1]) * (ctx.rank + 1)
    try:
        tampered.all_reduce(x, Variant.SECURE_PIPELINED)
        bad.append("tampered hop 1 accepted")
    except (TagError, CollectiveAbortedError) as exc:
        want = TagError if ctx.rank == 1 else CollectiveAbortedError
        if type(exc) is not want or x.any():
            bad.append(f"tampered hop 1: {type(exc).__name__}, zeroed={not x.any()}")
    return bad


def rogue_worker(ctx: WorkerContext, vendor_dir: str) -> str:
    """Rank 1 presents a device certificate from another vendor root; every rank must refuse the ring."""
    from gputravel.core.attestation import VendorCA

    store = dist.distributed_c10d._get_default_store()
    identity, root, crl = emulated_identity(Path(vendor_dir), rank=ctx.rank, store=store)
    if ctx.rank == 1:
        identity = VendorCA.generate().issue_device("rank-1")
    try:
        establish_ring_keys(store, rank=ctx.rank, world=ctx.world_size, identity=identity, root=root, crl=crl,
                            prefix="gputravel/test/rogue")
    except AttestationError as exc:
        return f"AttestationError: {exc.reason}"
    return "accepted"


# --- multi-rank tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
def test_every_variant_equals_dist_all_reduce(world: int, tmp_path: Path) -> None:
    results = run_workers(equality_worker, world, str(tmp_path), timeout=90)
    assert results == [[]] * world


@pytest.mark.parametrize("world", [2, 3])
def test_tampered_hop_raises_tag_error_on_the_receiver_and_aborts_every_rank(world: int, tmp_path: Path) -> None:
    last = world - 2  # last all-gather step
    cases = [
        (Variant.SECURE_PIPELINED, RingFault("flip", rank=0, phase=Phase.REDUCE_SCATTER, step=0, chunk=1)),
        (Variant.SECURE_NAIVE, RingFault("flip", rank=0, phase=Phase.REDUCE_SCATTER, step=0, chunk=0)),
        (Variant.SECURE_PIPELINED, RingFault("flip", rank=world - 1, phase=Phase.ALL_GATHER, step=last, chunk=0)),
    ]
    results = run_workers(tamper_worker, world, str(tmp_path), cases, timeout=90)
    receivers = [1, 1, 0]  # the right neighbour of the tampering rank
    for i, receiver in enumerate(receivers):
        for rank in range(world):
            want = "TagError zeroed" if rank == receiver else "CollectiveAbortedError zeroed"
            assert results[rank][i] == want, (i, rank, results[rank])
    assert all(r[-1] == "recovered" for r in results)


def test_replayed_hop_from_an_earlier_iteration_is_rejected(tmp_path: Path) -> None:
    cases = [(Variant.SECURE_PIPELINED, RingFault("replay", rank=1, phase=Phase.ALL_GATHER, step=0, chunk=0)),
             # the direct schedule (one hop each way): a replayed and a tampered hop, each rejected by its receiver
             (Variant.SECURE_PIPELINED, RingFault("replay", rank=0, phase=Phase.DIRECT)),
             (Variant.SECURE_PIPELINED, RingFault("flip", rank=1, phase=Phase.DIRECT)),
             # secure_naive runs the same one-hop schedule at world 2 for a small tensor: a fault only the direct
             # hop carries (Phase.DIRECT) hits it, and the agreement (one status message each way) aborts both
             (Variant.SECURE_NAIVE, RingFault("flip", rank=0, phase=Phase.DIRECT))]
    results = run_workers(tamper_worker, 2, str(tmp_path), cases, timeout=60)
    assert [r[:4] for r in results] == [["TagError zeroed", "CollectiveAbortedError zeroed", "TagError zeroed",
                                         "CollectiveAbortedError zeroed"],
                                        ["CollectiveAbortedError zeroed", "TagError zeroed",
                                         "CollectiveAbortedError zeroed", "TagError zeroed"]], results
    assert all(r[-1] == "recovered" for r in results)


def test_direct_schedule_over_its_one_hop_size_is_chunked_bit_equal_and_tamper_evident(tmp_path: Path) -> None:
    assert run_workers(chunked_direct_worker, 2, str(tmp_path), timeout=90) == [[], []]


def test_rank_with_a_certificate_from_another_vendor_is_refused_by_every_rank(tmp_path: Path) -> None:
    results = run_workers(rogue_worker, 2, str(tmp_path), timeout=60)
    assert all(r.startswith("AttestationError") for r in results), results
    assert "evidence of rank 1 does not verify" in results[0]


# --- single-process units -----------------------------------------------------------------------------
def _pair() -> tuple[HopSealer, HopOpener]:
    key = channel_key(bytes(32), bytes(16), epoch=0, direction=1)
    return HopSealer(key, session_id=bytes(16)), HopOpener(key, session_id=bytes(16))


AAD = HopAad(bytes(16), epoch=0, iteration=3, phase=Phase.REDUCE_SCATTER, step=1, chunk=2, src=0, dst=1,
             offset=4096, length=64)


@pytest.mark.parametrize("field", ["iteration", "phase", "step", "chunk", "src", "dst", "offset", "length",
                                   "epoch"])
def test_hop_with_any_other_aad_field_is_rejected(field: str) -> None:
    import dataclasses

    sealer, opener = _pair()
    seq = sealer.reserve(1)
    pt = bytes(range(64))
    ct = bytearray(80)
    sealer.seal_into(seq, pt, ct, AAD)
    out = bytearray(64)
    opener.open_into(seq, ct, out, AAD)
    assert bytes(out) == pt
    moved = dataclasses.replace(AAD, **{field: getattr(AAD, field) + 1})
    with pytest.raises(TagError, match="ring hop rejected"):
        opener.open_into(seq, ct, out, moved)
    assert bytes(out) == bytes(64)  # no unauthenticated plaintext stays behind


def test_hop_opened_with_another_sequence_number_is_rejected() -> None:
    sealer, opener = _pair()
    seq = sealer.reserve(2)
    ct = bytearray(80)
    sealer.seal_into(seq, bytes(64), ct, AAD)
    with pytest.raises(TagError):
        opener.open_into(seq + 1, ct, bytearray(64), AAD)


def test_sequence_numbers_are_reserved_once_and_never_wrap() -> None:
    sealer, _ = _pair()
    assert sealer.reserve(5) == 0 and sealer.reserve(3) == 5 and sealer.counter == 8
    sealer.counter = 2**64 - 2
    with pytest.raises(NonceExhaustedError):
        sealer.reserve(2)


def test_gathered_aad_names_every_rank() -> None:
    assert HopAad(bytes(16), 0, 0, Phase.GATHER_SEALED, 0, 0, 2, ALL_RANKS, 0, 8).pack() != AAD.pack()


@pytest.mark.parametrize(("world", "numel", "chunk"), [(2, 1, 4096), (3, 2, 4096), (3, 100_003, 4096),
                                                       (4, 10_000, 1 << 20)])
def test_plan_covers_every_element_once_and_the_ring_schedule_ends_with_every_segment(
        world: int, numel: int, chunk: int) -> None:
    plan = RingPlan.make(world=world, numel=numel, esize=4, chunk_bytes=chunk)
    covered = [e for seg in plan.chunks for a, b in seg for e in range(a, b)]
    assert covered == list(range(numel))
    for rank in range(world):
        owned = plan.seg(world - 2, rank, send=False)  # last reduce-scatter receive: fully reduced
        assert owned == (rank + 1) % world
        stored = {plan.seg(g, rank, send=False) for g in range(world - 1, 2 * world - 2)}
        assert stored | {owned} == set(range(world))


@pytest.mark.parametrize(("numel", "dtype", "want"), [(10, torch.uint8, 1), (WIRE_PIECE_BYTES, torch.uint8, 1),
                                                     (WIRE_PIECE_BYTES + 1, torch.uint8, 2),
                                                     (WIRE_PIECE_BYTES + 3, torch.float32, 5),
                                                     (100 * WIRE_PIECE_BYTES, torch.uint8, MAX_PIECES)])
def test_wire_pieces_are_views_that_cover_the_message_once(numel: int, dtype: torch.dtype, want: int) -> None:
    t = torch.zeros(numel, dtype=dtype) if numel < 2 * WIRE_PIECE_BYTES else torch.empty(numel, dtype=dtype)
    pieces = _pieces(t)
    assert len(pieces) == want
    assert sum(p.numel() for p in pieces) == numel
    esize = t.element_size()
    assert [p.data_ptr() for p in pieces] == [t.data_ptr() + sum(q.numel() for q in pieces[:i]) * esize
                                              for i in range(len(pieces))]  # views in order, no copy
    assert all(p.numel() * esize <= max(WIRE_PIECE_BYTES, -(-numel * esize // MAX_PIECES)) for p in pieces)


def test_variants_are_one_enum_and_gloo_tls_only_where_the_build_has_it() -> None:
    assert [v.value for v in Variant][:5] == ["noop", "plain", "ring", "secure_naive", "secure_pipelined"]
    assert (Variant.GLOO_TLS in available_variants()) == gloo_tls_available()


def test_emulated_identities_share_one_vendor_root() -> None:
    with tempfile.TemporaryDirectory() as d:
        a, root_a, _ = emulated_identity(Path(d), rank=0)
        b, root_b, _ = emulated_identity(Path(d), rank=1)
    assert root_a == root_b and a.chain[-1] == root_a and b.device_id == "rank-1"
    assert a.fingerprint() != b.fingerprint()


def test_nccl_with_more_ranks_than_gpus_is_a_config_error_before_any_rank_starts() -> None:
    from gputravel.core.collectives.launch import check_backend
    from gputravel.core.errors import ConfigError

    with pytest.raises(ConfigError, match="NCCL needs one GPU per rank.*gloo"):
        check_backend("nccl", 2, gpus=1)
    with pytest.raises(ConfigError, match="unknown backend"):
        check_backend("mpi-ish", 2)
    check_backend("nccl", 2, gpus=2)  # one GPU per rank: allowed
    check_backend("gloo", 8, gpus=0)


def test_bench_allreduce_nccl_on_too_few_gpus_exits_2_with_the_reason() -> None:
    import subprocess
    import sys

    world = (torch.cuda.device_count() if torch.cuda.is_available() else 0) + 1
    proc = subprocess.run([sys.executable, "-m", "gputravel.console.cli", "bench", "allreduce", "--backend", "nccl",
                           "--world-size", str(world), "--size-mib", "1", "--repeats", "1", "--warmup", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-1500:]
    assert "NCCL needs one GPU per rank" in proc.stderr and "gloo" in proc.stderr
    assert "Traceback" not in proc.stderr
