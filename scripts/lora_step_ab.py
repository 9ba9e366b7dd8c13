"""Issue 32: what one training step costs in the device's ``Trainer`` against ``bench train``'s plain loop, the two
loops in one process, their steps taken in turn (so both meet the same load), each step's CPU time on the thread
(``time.thread_time``) and its minor page faults (``getrusage(RUSAGE_THREAD).ru_minflt``).

    .venv/bin/python scripts/lora_step_ab.py DIR --rank 8 --steps 6 --variants plain,trainer

Variants (each its own model, optimizer and seed-0 generator, the base weights of DIR loaded):

* ``plain``: ``core/bench/train.py: plain_loop``'s step (model built on the CPU, weights loaded, LoRA applied,
  batches cut from an ``int64`` tensor of the holder's bytes).
* ``trainer``: the device's ``Trainer`` (built, LoRA applied, ``load_base``), ``train_on_window(steps=1)`` on a
  ``uint8`` data buffer in the ``byte`` format: one one-step TRAIN slice, as the device runs a visit.
* ``trainer_step``: the same ``Trainer``, its ``step_batch`` on the plain loop's ``int64`` batches (no window, no
  gather): splits the slice's and the gather's cost from the step's. It is fed the very batches ``plain`` is
  (each from its own generator of the same seed), so the two give the same losses bit for bit when the two
  loops do the same arithmetic (``same_losses``).

Prints JSON: per variant the steps' CPU seconds, minor page faults, voluntary and involuntary context switches
(``csw``: a thread that waits for the GIL switches voluntarily) and losses, and the median CPU of all but the first
step.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gputravel.core.bench.train import PlainStep
from gputravel.core.training.trainer import Trainer, TrainSettings
from gputravel.core.training.weights import read_weights


def _plain(config: Any, base: dict[str, torch.Tensor], settings: TrainSettings, data: torch.Tensor) -> Callable[[], float]:
    plain = PlainStep(config, settings, torch.device("cpu"), torch.Generator().manual_seed(settings.seed), base=base)
    plain.model.train()
    span = torch.arange(settings.seq_len + 1)
    state = {"step": 0}
    gen = torch.Generator().manual_seed(settings.seed)  # the batches' own stream (trainer_step's too)

    def step() -> float:
        starts = torch.randint(0, data.numel() - settings.seq_len - 1, (settings.batch_size, 1), generator=gen)
        loss = plain.step(data[starts + span], state["step"])
        state["step"] += 1
        return loss
    return step


def _trainer(config: Any, base: dict[str, torch.Tensor], settings: TrainSettings, buf: torch.Tensor,
             data: torch.Tensor, *, window: bool) -> Callable[[], float]:
    trainer = Trainer(config, settings, "cpu")
    trainer.load_base(base)
    gen = torch.Generator().manual_seed(settings.seed)
    span = torch.arange(settings.seq_len + 1)

    def slice_step() -> float:
        return trainer.train_on_window(buf, train_off=0, train_len=buf.numel(), fmt="byte", steps=1).losses[0]

    def bare_step() -> float:
        starts = torch.randint(0, data.numel() - settings.seq_len - 1, (settings.batch_size, 1), generator=gen)
        chunk = data[starts + span]
        return float(trainer.step_batch(chunk[:, :-1], chunk[:, 1:]).item())
    return slice_step if window else bare_step


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--variants", default="plain,trainer")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    config, base = read_weights(args.dir)
    settings = TrainSettings(steps_per_visit=8, batch_size=args.batch_size, seq_len=args.seq_len, total_steps=48,
                             lora_rank=args.rank)
    raw = bytes((i * 7 + (i >> 5)) % 251 for i in range(1 << 20))  # 1 MiB of varied bytes (ids < 256)
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    data = buf.to(torch.int64)
    makers = {"plain": lambda: _plain(config, base, settings, data),
              "trainer": lambda: _trainer(config, base, settings, buf, data, window=True),
              "trainer_step": lambda: _trainer(config, base, settings, buf, data, window=False)}
    names = args.variants.split(",")
    steps = {name: makers[name]() for name in names}
    out: dict[str, dict[str, Any]] = {name: {"cpu_s": [], "minflt": [], "csw": [], "losses": []} for name in names}
    for _ in range(args.steps):
        for name in names:
            u0, c0 = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time()
            out[name]["losses"].append(steps[name]())
            out[name]["cpu_s"].append(round(time.thread_time() - c0, 3))
            u1 = resource.getrusage(resource.RUSAGE_THREAD)
            out[name]["minflt"].append(u1.ru_minflt - u0.ru_minflt)
            out[name]["csw"].append([u1.ru_nvcsw - u0.ru_nvcsw, u1.ru_nivcsw - u0.ru_nivcsw])
    for rec in out.values():
        rec["median_cpu_s"] = statistics.median(rec["cpu_s"][1:] or rec["cpu_s"])
    result: dict[str, Any] = {"variants": out}
    if "plain" in out and "trainer_step" in out:
        result["same_losses"] = out["plain"]["losses"] == out["trainer_step"]["losses"]
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
