"""What one visit of ``bench train --init-from DIR`` costs, part by part, in CPU time (``time.process_time``: every thread of the
process, the digest's and the MAC's side-by-side threads included) and wall time: a training step, the held-out
evaluation (``val_batches`` forward batches), the model digest (``gputravel/model-digest/v3``: once when the weights are loaded, every tensor;
then a visit's, after the steps, where a frozen tensor's entry is reused), VERIFY's model MAC (AES-GMAC of the
whole state),
with and without LoRA, and the machine's single-core AES-256-GCM rate. ``--tail-formats v2,v3`` also times TRAIN's
tail as the device runs it (``ModelSlot.op_train``: the whole state's digest in that format on a thread beside the
evaluation; wall time, ``--tail-reps`` rounds, the formats alternating, the evaluation alone first in each round):
the digest format's before/after in one sitting. CPU time does not move with the wait for a
core, so on a loaded shared machine these figures stand where a whole ``bench train`` study cannot be run.

    .venv/bin/python scripts/train_visit_costs.py DIR --ranks 8,0 --steps 4

DIR: a Hugging Face folder (``scripts/make_random_llama.py``); batch 2 × 128 and one torch thread, the issue's
setting. Prints JSON (a line after each rank, the last one complete).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from gputravel.core.device.modelmac import model_mac
from gputravel.core.machine import aes_gcm_rate
from gputravel.core.training.trainer import Trainer, TrainSettings
from gputravel.core.training.weights import read_weights


def _timed(fn: Any) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return round(time.process_time() - c0, 3), round(time.perf_counter() - w0, 3)


def _one_rank(config: Any, base: dict[str, torch.Tensor], rank: int, args: argparse.Namespace) -> dict[str, Any]:
    settings = TrainSettings(steps_per_visit=8, batch_size=args.batch_size, seq_len=args.seq_len, total_steps=48,
                             lora_rank=rank)
    trainer = Trainer(config, settings, "cpu")
    trainer.load_base(base)
    model, opt = trainer.model, trainer.optimizer
    trainable = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        x = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x[:, :-1], x[:, 1:])
        assert loss is not None
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()

    first = _timed(trainer.model_digest)  # the device's digest after the weights' restore: every tensor
    steps = [_timed(step) for _ in range(args.steps)]
    digest = _timed(trainer.model_digest)  # a visit's: the trained tensors and their moments

    @torch.no_grad()
    def evaluate() -> None:  # the visit's held-out evaluation: val_batches forward batches, eval mode
        model.eval()
        for _ in range(settings.val_batches):
            x = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
            model(x[:, :-1], x[:, 1:])
        model.train()

    evaluation = _timed(evaluate)
    mac = _timed(lambda: model_mac(model, opt, os.urandom(32)))
    tails: dict[str, list[float]] = {}
    for _ in range(args.tail_reps if args.tail_formats else 0):
        tails.setdefault("eval_alone", []).append(_timed(evaluate)[1])
        for fmt in args.tail_formats.split(","):
            def beside(fmt: str = fmt) -> None:  # the device's TRAIN tail: the digest on a thread beside the evaluation
                hashing = threading.Thread(target=trainer.model_digest, args=(fmt,))
                hashing.start()
                evaluate()
                hashing.join()
            tails.setdefault(f"digest_{fmt}_alone_cpu", []).append(_timed(lambda fmt=fmt: trainer.model_digest(fmt))[0])
            tails.setdefault(f"eval_beside_digest_{fmt}", []).append(_timed(beside)[1])
    tensors = list(model.parameters()) + [v for st in opt.state.values() for v in st.values()
                                          if isinstance(v, torch.Tensor)]
    return {"state_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "step_cpu_s": [c for c, _ in steps], "step_wall_s": [w for _, w in steps],
            "step_cpu_median_later_s": round(statistics.median(c for c, _ in steps[1:] or steps), 3),
            "digest_first_cpu_wall_s": list(first),
            "digest_cpu_wall_s": list(digest), "eval_cpu_wall_s": list(evaluation), "mac_cpu_wall_s": list(mac),
            "tail_wall_s": tails}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--ranks", default="8,0", help="LoRA ranks, comma-separated (0: the whole model trains)")
    parser.add_argument("--steps", type=int, default=4, help="training steps a rank (the first is a warm-up)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--tail-formats", default="", help="digest formats whose TRAIN tail to time, e.g. v2,v3")
    parser.add_argument("--tail-reps", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config, base = read_weights(args.folder)
    out: dict[str, Any] = {"load": os.getloadavg(), "aes_gcm_1core_mb_s": round(aes_gcm_rate(4 << 20) / 1e6, 1)}
    for rank in (int(r) for r in args.ranks.split(",")):
        out[f"rank{rank}"] = _one_rank(config, base, rank, args)
        print(json.dumps(out), flush=True)
    out["load_end"] = os.getloadavg()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
