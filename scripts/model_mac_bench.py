"""GPT-2 124M after one AdamW step: the model digest (``v3``, BLAKE3) against the model MAC (AES-GMAC), best of 3.

Prints one JSON object: state_bytes, digest_s, gmac_s and their MB/s (``--threads`` torch threads)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from gputravel.core.device.modelmac import model_mac
from gputravel.core.training.model import preset
from gputravel.core.training.trainer import Trainer, TrainSettings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t = Trainer(preset(args.model), TrainSettings(steps_per_visit=1, batch_size=1, seq_len=32), args.device)
    buf = torch.randint(0, 256, (8192,), dtype=torch.uint8, device=args.device)
    t.train_on_window(buf, train_off=0, train_len=8192, fmt="byte")
    nbytes = sum(p.numel() * p.element_size() for p in t.model.parameters()) * 3  # weights and two moments
    out: dict[str, Any] = {"model": args.model, "device": args.device, "state_bytes": nbytes}
    engines: list[str] = []

    def mac() -> None:
        engines.append(model_mac(t.model, t.optimizer, os.urandom(32))[1])

    runs: tuple[tuple[str, Callable[[], Any]], ...] = (("digest_s", t.model_digest), ("gmac_s", mac))
    for name, fn in runs:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        out[name] = round(best, 4)
    out["digest_mb_s"] = round(nbytes / out["digest_s"] / 1e6)
    out["gmac_mb_s"] = round(nbytes / out["gmac_s"] / 1e6)
    out["mac_engine"] = engines[-1]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
