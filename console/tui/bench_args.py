"""The benches the console runs, and the small configuration of each (a module of its own: the screens' base
imports it for Tab completion, the bench screen to run them)."""

from __future__ import annotations

__all__ = ["BENCH_ARGS"]

#: Options the console passes to ``gputravel bench NAME``: a configuration small enough to watch (the CLI's
#: defaults are studies that run far longer than a console session; ``gputravel bench NAME`` runs those).
BENCH_ARGS: dict[str, tuple[str, ...]] = {
    "provision": ("--size-mib", "16", "--repeats", "2"),
    "allreduce": ("--size-mib", "1,4", "--repeats", "5"),
    "travel": ("--buffer-mib", "4,20"),
    "ddp": ("--iters", "5"),
    "load": ("--holders", "4", "--rounds", "1"),
    "soak": ("--visits", "20"),
    "gpu_aes": ("--repeats", "3"),
    "fleet": ("--gpus", "2"),
    "fleet_key": ("--workers", "2", "--repeats", "1"),
    "evidence": ("--rounds", "10"),
    "hostile": ("--size-mib", "16", "--visits", "3"),
}
