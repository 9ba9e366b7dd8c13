"""Benchmarks of the ring variants: raw all-reduce and DDP training (the GPU-TEE overhead study).

Each run spawns real ranks (``launch.run_workers``), times every variant interleaved in the same
run (so ``ratio_vs_plain`` compares like with like), and returns JSON-ready rows plus the machine.
A call's time is the slowest rank's. The console renders; nothing here prints.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gputravel.core.collectives.crypto import HostCrypto, default_workers
from gputravel.core.collectives.hook import SecureRingState, default_store, secure_ring_hook
from gputravel.core.collectives.keys import emulated_identity, establish_ring_keys
from gputravel.core.collectives.launch import WorkerContext, check_backend, run_workers
from gputravel.core.collectives.models import MODELS
from gputravel.core.collectives.ring import RingStats, SecureRing, Variant, available_variants
from gputravel.core.errors import ConfigError
from gputravel.core.machine import aes_gcm_rate, aes_gcm_seal_rate, aes_gcm_stream_rates
from gputravel.core.machine import machine_info as core_machine_info

__all__ = ["MODELS", "AllReduceSpec", "DdpSpec", "machine_info", "run_allreduce_bench", "run_ddp_bench"]

BREAKDOWN = ("crypto_s", "wire_s", "reduce_s", "wait_s")


def machine_info(*, backend: str = "gloo") -> dict[str, Any]:
    """Cores, CPU, device and versions (``core.machine``) plus the collective's own facts."""
    return {**core_machine_info(), "backend": backend, "gloo_tls": Variant.GLOO_TLS in available_variants(),
            "platform": "emulated (SIM) device identities; real AES-256-GCM, ECDH and signatures"}


def parse_variants(text: str, *, hooks: bool = False) -> tuple[Variant, ...]:
    """``all`` or a comma list; ``plain`` is always measured (every ratio needs it). With ``hooks``, only
    the variants that are DDP comm hooks (``gloo_tls`` is a process-group option, not a hook)."""
    if text.strip() == "all":
        chosen = list(available_variants())
    else:
        chosen = []
        for name in (t.strip() for t in text.split(",") if t.strip()):
            try:
                v = Variant(name)
            except ValueError:
                raise ConfigError(f"unknown variant {name!r} (choose from {', '.join(x.value for x in Variant)})"
                                  ) from None
            if v not in available_variants() and v is not Variant.SECURE_GPU:  # secure_gpu: simulator if no GPU
                raise ConfigError(f"variant {v} is not available in this torch build")
            chosen.append(v)
    if Variant.PLAIN not in chosen:
        chosen.insert(0, Variant.PLAIN)
    if hooks:
        chosen = [v for v in chosen if v is not Variant.GLOO_TLS]
        from gputravel.core.collectives.gpu_ring import gpu_cipher_on_cuda

        if Variant.SECURE_GPU in chosen and not gpu_cipher_on_cuda():
            raise ConfigError("secure_gpu in bench ddp needs a CUDA device for the GPU cipher: numba's simulator "
                              "is far too slow for model gradients (bench allreduce runs it on tiny tensors)")
    return tuple(dict.fromkeys(chosen))


def _device() -> torch.device:
    """Where the job's tensors live: the rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _slowest(ctx: WorkerContext, times: list[float]) -> list[float]:
    """Per repeat, the slowest rank's time."""
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, times)
    return [max(col) for col in zip(*gathered, strict=True)]


def _mean_stats(ctx: WorkerContext, delta: dict[str, float], calls: int) -> dict[str, float]:
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, delta)
    return {k: sum(g[k] for g in gathered) / ctx.world_size / max(1, calls) for k in BREAKDOWN}


def _delta(before: dict[str, float], after: RingStats) -> dict[str, float]:
    now = after.as_dict()
    return {k: now[k] - before.get(k, 0.0) for k in BREAKDOWN}


#: the variants whose bound is host cipher passes plus plain's copies (``bound_row``); the others have none here
#: (noop moves nothing, gloo_tls's crypto is gloo's own, secure_gpu's runs at the GPU cipher's speed)
BOUNDED = (Variant.PLAIN, Variant.RING, Variant.SECURE_NAIVE, Variant.SECURE_PIPELINED)


def cipher_speed(ctx: WorkerContext, chunk: int) -> dict[str, float]:
    """One core's AES-256-GCM seal and open rates (bytes/s) on ``chunk``-byte messages, measured on every rank
    at once (as the ring's passes run), the slowest rank's: the cipher speed a row's bound is made of (each the
    best of short windows: a bound is a ceiling, and a busy machine only ever lowers a window)."""
    dist.barrier()
    mine = {"seal": aes_gcm_seal_rate(chunk, seconds=0.3), "open": aes_gcm_rate(chunk, seconds=0.3)}
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    return {k: min(g[k] for g in gathered) for k in mine}


def cipher_stream_speed(ctx: WorkerContext, size: int, chunk: int) -> dict[str, float]:
    """One core's AES-256-GCM seal and open rates over a ``size``-byte buffer streamed in ``chunk``-byte messages
    (``aes_gcm_stream_rates``: the least memory traffic a ring pays for ``size`` bytes), on every rank at once,
    the slowest rank's: the cipher speed of a row's own access pattern, which ``bound_s`` is made of."""
    dist.barrier()
    mine = aes_gcm_stream_rates(size, chunk)
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    return {k: min(g[k] for g in gathered) for k in mine}


def bound_row(ctx: WorkerContext, variant: Variant, delta: dict[str, float], calls: int, *, plain_s: float,
              median_s: float, speed: dict[str, float], stream: dict[str, float], lanes: int) -> dict[str, Any]:
    """A row's bound (issue 34 item 3): plain's time (its copies and wire) plus the bytes the busiest rank sealed
    and opened per call at this machine's cipher speed on ``lanes`` crypto threads. ``bound_s`` takes the cipher
    over the row's own access pattern (``stream``: the row's size streamed, every rank at once); ``bound_cache_s``
    the cache-resident chunk's (``speed``, the bound before session 10, kept readable). ``bound_ratio`` = bound /
    plain, ``fraction_of_bound`` = bound / measured (1: at the bound); the same with ``cache`` for the other."""
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, (delta.get("bytes_sealed", 0.0), delta.get("bytes_opened", 0.0)))
    if variant not in BOUNDED or plain_s <= 0 or median_s <= 0:
        return {"bound_s": None, "bound_ratio": None, "fraction_of_bound": None}

    def cipher_s(rates: dict[str, float]) -> float:
        worst = max(float(s) / rates["seal"] + float(o) / rates["open"] for s, o in gathered)
        return worst / max(1, calls) / max(1, lanes)

    bound, cache = plain_s + cipher_s(stream), plain_s + cipher_s(speed)
    return {"bound_s": bound, "bound_cipher_s": bound - plain_s, "bound_ratio": bound / plain_s,
            "fraction_of_bound": bound / median_s, "bound_cache_s": cache, "bound_cache_cipher_s": cache - plain_s,
            "bound_cache_ratio": cache / plain_s, "fraction_of_cache_bound": cache / median_s}


# --- all-reduce ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AllReduceSpec:
    """What ``bench allreduce`` measures."""

    sizes_mib: tuple[float, ...]
    variants: tuple[Variant, ...]
    repeats: int = 10
    warmup: int = 2
    chunk_bytes: int | None = None  # None: auto (SecureRing.pipeline_chunk)
    workers: int | None = None  # crypto threads per rank; None: free cores
    gathers: tuple[str, ...] = ("sealed",)  # all-gather modes of secure variants: "sealed", "reseal"
    dtype: str = "float32"


def allreduce_worker(ctx: WorkerContext, spec: AllReduceSpec, vendor_dir: str) -> list[dict[str, Any]]:
    store = default_store()
    identity, root, crl = emulated_identity(Path(vendor_dir), rank=ctx.rank, store=store)
    keys = establish_ring_keys(store, rank=ctx.rank, world=ctx.world_size, identity=identity, root=root, crl=crl)
    crypto = HostCrypto(workers=default_workers(ctx.world_size) if spec.workers is None else spec.workers)
    rings = {g: SecureRing(keys=keys, crypto=crypto, chunk_bytes=spec.chunk_bytes, sealed_gather=g == "sealed")
             for g in spec.gathers}
    gathered = [v for v in spec.variants if v.secure and v is not Variant.SECURE_GPU]  # secure_gpu: one mode
    runs = [(v, g if v in gathered else None) for v in spec.variants for g in (spec.gathers if v in gathered else ("-",))]
    dtype = getattr(torch, spec.dtype)
    speed = cipher_speed(ctx, spec.chunk_bytes or (1 << 20))
    lanes = max(1, crypto.workers)
    total, done = len(spec.sizes_mib) * (spec.warmup + spec.repeats), 0
    rows: list[dict[str, Any]] = []
    for mib in spec.sizes_mib:
        numel = max(1, int(mib * 2**20) // torch.empty(0, dtype=dtype).element_size())
        x = torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank)).to(_device(), dtype)
        y = torch.empty_like(x)
        skipped = _gpu_skips(runs, numel * x.element_size())
        stream = cipher_stream_speed(ctx, numel * x.element_size(), spec.chunk_bytes or (1 << 20))
        size_runs = [r for r in runs if r not in skipped]
        times: dict[tuple[Variant, str | None], list[float]] = {r: [] for r in runs}
        before: dict[tuple[Variant, str | None], dict[str, float]] = {}
        for rep in range(spec.warmup + spec.repeats):
            if rep == spec.warmup:
                before = {(v, g): rings[g or spec.gathers[0]].stats.get(v, RingStats()).as_dict() for v, g in runs}
            for v, g in size_runs:
                y.copy_(x)
                dist.barrier()
                t0 = time.perf_counter()
                rings[g or spec.gathers[0]].all_reduce(y, v)
                if rep >= spec.warmup:
                    times[(v, g)].append(time.perf_counter() - t0)
            done += 1
            if ctx.rank == 0:
                ctx.report({"done": done, "total": total, "size_mib": mib})
        # the cipher again after this size's runs: the bound takes the best seen so far (a ceiling; a run that
        # started in a starved moment otherwise keeps a bound slower than the ring it bounds)
        later = cipher_speed(ctx, spec.chunk_bytes or (1 << 20))
        speed = {k: max(speed[k], later[k]) for k in speed}
        later = cipher_stream_speed(ctx, numel * x.element_size(), spec.chunk_bytes or (1 << 20))
        stream = {k: max(stream[k], later[k]) for k in stream}
        plain = statistics.median(_slowest(ctx, times[(Variant.PLAIN, None)]))
        for v, g in runs:
            if (v, g) in skipped:
                rows.append({"world_size": ctx.world_size, "size_mib": mib, "variant": v.value, "gather": g,
                             "repeats": 0, "median_s": None, "min_s": None, "ratio_vs_plain": None,
                             "gb_per_s": None, "breakdown_s": None, "cipher_engine": "gpu (simulator)",
                             "bound_s": None, "bound_ratio": None, "fraction_of_bound": None,
                             "note": skipped[(v, g)]})
                continue
            slow = _slowest(ctx, times[(v, g)])
            ring = rings[g or spec.gathers[0]]
            after = ring.stats.get(v, RingStats())
            breakdown = _mean_stats(ctx, _delta(before[(v, g)], after), spec.repeats)
            med = statistics.median(slow)
            moved = {k: after.as_dict()[k] - before[(v, g)].get(k, 0.0) for k in ("bytes_sealed", "bytes_opened")}
            bound = bound_row(ctx, v, moved, spec.repeats, plain_s=plain, median_s=med, speed=speed,
                               stream=stream, lanes=lanes)
            rows.append({
                "world_size": ctx.world_size, "size_mib": mib, "variant": v.value, "gather": g,
                "repeats": spec.repeats, "median_s": med, "min_s": min(slow),
                "ratio_vs_plain": med / plain if plain > 0 else None,
                "gb_per_s": (numel * x.element_size() / med / 1e9) if med > 0 else None,
                "breakdown_s": breakdown, **bound,
                "cipher_seal_mb_s": speed["seal"] / 1e6, "cipher_open_mb_s": speed["open"] / 1e6,
                "cipher_stream_seal_mb_s": stream["seal"] / 1e6, "cipher_stream_open_mb_s": stream["open"] / 1e6,
                "crypto_lanes": lanes,
                **({"cipher_engine": _gpu_label()} if v is Variant.SECURE_GPU else {}),
            })
    for ring in rings.values():
        ring.close()
    return rows


def _gpu_label() -> str:
    from gputravel.core.gpucipher import backend

    return f"gpu ({backend()})"


def _gpu_skips(runs: Sequence[tuple[Variant, str | None]], nbytes: int) -> dict[tuple[Variant, str | None], str]:
    """The ``secure_gpu`` runs left out at this size: where the GPU cipher is numba's simulator (no CUDA
    device), only tensors up to ``SIM_MAX_BYTES`` run (about 3 s per 64 KiB sealed there)."""
    from gputravel.core.collectives.gpu_ring import SIM_MAX_BYTES, gpu_cipher_on_cuda

    if gpu_cipher_on_cuda() or nbytes <= SIM_MAX_BYTES:
        return {}
    note = (f"skipped: no CUDA device, the GPU cipher would run in numba's simulator (tensors up to "
            f"{SIM_MAX_BYTES // 1024} KiB only)")
    return {r: note for r in runs if r[0] is Variant.SECURE_GPU}


def run_allreduce_bench(spec: AllReduceSpec, *, world_sizes: Sequence[int], backend: str = "gloo",
                        on_progress: Callable[[int, dict[str, Any]], None] | None = None,
                        timeout: float = 1800.0) -> dict[str, Any]:
    """Run ``spec`` at each world size; returns ``{"machine", "settings", "rows"}``."""
    rows = _each_world(allreduce_worker, spec, world_sizes, prefix="gputravel-ring-", backend=backend,
                       timeout=timeout, on_progress=on_progress)
    return {"benchmark": "allreduce", "machine": machine_info(backend=backend),
            "settings": _settings(spec, world_sizes), "rows": rows}


def _each_world(worker: Callable[..., list[dict[str, Any]]], spec: Any, world_sizes: Sequence[int], *, prefix: str,
                backend: str, timeout: float,
                on_progress: Callable[[int, dict[str, Any]], None] | None) -> list[dict[str, Any]]:
    """``worker(ctx, spec, vendor_dir)`` on ``world`` ranks for each world size (a fresh emulated vendor
    folder each); rank 0's rows, in order. Progress is reported per world size."""
    for world in world_sizes:  # every world size checked before the first job starts
        check_backend(backend, world)
    rows: list[dict[str, Any]] = []
    for i, world in enumerate(world_sizes):
        def progress(_rank: int, payload: dict[str, Any], i: int = i, world: int = world) -> None:
            if on_progress is not None:
                on_progress(i, {**payload, "world_size": world})

        with tempfile.TemporaryDirectory(prefix=prefix) as vendor_dir:
            result = run_workers(worker, world, spec, vendor_dir, backend=backend, timeout=timeout,
                                 pg_timeout=120, on_progress=progress)
        rows.extend(result[0])
    return rows


def _settings(spec: Any, world_sizes: Sequence[int]) -> dict[str, Any]:
    return {**asdict(spec), "variants": [v.value for v in spec.variants], "world_sizes": list(world_sizes),
            "workers": "free cores" if spec.workers is None else spec.workers}


# --- DDP training --------------------------------------------------------------------------------------


def _mlp(name: str) -> torch.nn.Module:
    width_in, hidden, layers = MODELS[name]
    mods: list[torch.nn.Module] = [torch.nn.Linear(width_in, hidden), torch.nn.ReLU()]
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(hidden, 16))
    return torch.nn.Sequential(*mods)


@dataclass(frozen=True, slots=True)
class DdpSpec:
    """What ``bench ddp`` measures."""

    models: tuple[str, ...]
    variants: tuple[Variant, ...]
    iters: int = 5
    warmup: int = 2
    batch: int = 32
    chunk_bytes: int | None = None  # None: auto (SecureRing.pipeline_chunk)
    workers: int | None = None


def ddp_worker(ctx: WorkerContext, spec: DdpSpec, vendor_dir: str) -> list[dict[str, Any]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    workers = default_workers(ctx.world_size) if spec.workers is None else spec.workers
    total, done, rows = len(spec.models) * (spec.warmup + spec.iters), 0, []
    for name in spec.models:
        runs: dict[Variant, tuple[Any, Any, SecureRingState | None]] = {}
        for v in spec.variants:
            torch.manual_seed(0)
            model = DDP(_mlp(name).to(_device()))
            state = None
            if v is not Variant.PLAIN:  # plain: DDP's own all-reduce, no hook
                state = SecureRingState(variant=v, vendor_dir=Path(vendor_dir), chunk_bytes=spec.chunk_bytes,
                                        workers=workers)
                model.register_comm_hook(state, secure_ring_hook)
            runs[v] = (model, torch.optim.SGD(model.parameters(), lr=1e-3), state)
        params = sum(p.numel() for p in runs[spec.variants[0]][0].parameters())
        gen = torch.Generator().manual_seed(ctx.rank)
        x = torch.randn(spec.batch, MODELS[name][0], generator=gen).to(_device())
        y = torch.randint(0, 16, (spec.batch,), generator=gen).to(_device())
        times: dict[Variant, list[float]] = {v: [] for v in spec.variants}
        before: dict[Variant, dict[str, float]] = {}
        for it in range(spec.warmup + spec.iters):
            for v, (model, opt, state) in runs.items():
                if it == spec.warmup and state is not None:
                    before[v] = state.ring.stats.get(v, RingStats()).as_dict()
                dist.barrier()
                t0 = time.perf_counter()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
                if it >= spec.warmup:
                    times[v].append(time.perf_counter() - t0)
            done += 1
            if ctx.rank == 0:
                ctx.report({"done": done, "total": total, "model": name})
        slow = {v: _slowest(ctx, t) for v, t in times.items()}
        plain = statistics.median(slow[Variant.PLAIN])
        noop = statistics.median(slow[Variant.NOOP]) if Variant.NOOP in slow else None
        for v, (_model, _opt, state) in runs.items():
            med = statistics.median(slow[v])
            stats = state.ring.stats.get(v, RingStats()) if state is not None else None
            breakdown = (_mean_stats(ctx, _delta(before.get(v, {}), stats), spec.iters) if stats is not None
                         else _mean_stats(ctx, dict.fromkeys(BREAKDOWN, 0.0), spec.iters))
            rows.append({
                "world_size": ctx.world_size, "model": name, "params": params, "variant": v.value,
                "iters": spec.iters, "median_s": med, "min_s": min(slow[v]), "ratio_vs_plain": med / plain,
                "ratio_vs_noop": med / noop if noop else None, "comm_breakdown_s": breakdown,
            })
            if state is not None:
                state.close()
    return rows


def run_ddp_bench(spec: DdpSpec, *, world_sizes: Sequence[int], backend: str = "gloo",
                  on_progress: Callable[[int, dict[str, Any]], None] | None = None,
                  timeout: float = 1800.0) -> dict[str, Any]:
    """Per-iteration DDP time with each hook, by world size and model size (the study's table)."""
    if Variant.PLAIN not in spec.variants:
        raise ConfigError("the DDP benchmark needs the plain variant (every ratio is against it)")
    rows = _each_world(ddp_worker, spec, world_sizes, prefix="gputravel-ddp-", backend=backend, timeout=timeout,
                       on_progress=on_progress)
    settings = {**_settings(spec, world_sizes), "models": {m: {"mlp": MODELS[m]} for m in spec.models}}
    return {"benchmark": "ddp", "machine": machine_info(backend=backend), "settings": settings, "rows": rows}
