"""A torchrun worker for tests/core/fleet/test_fleet_ddp.py: each rank is a device's replica in a FleetRing.

Usage: python -m torch.distributed.run ... tests/core/fleet/fleet_ddp_worker.py OUT_DIR VARIANT
Each rank trains 3 lock-step steps (rank 1 idle in step 1) and writes OUT_DIR/rank-R.json with the model
digest after every step, and OUT_DIR/rank-R.pt with its final parameters.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from gputravel.core.attestation import DeviceIdentity, VendorCA
from gputravel.core.fleet.ddp import FleetRing, sample_seed
from gputravel.core.training.model import GPTConfig
from gputravel.core.training.trainer import Trainer, TrainSettings


def main() -> None:
    out, variant = Path(sys.argv[1]), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    ca = VendorCA.load(out / "vendor")
    identity = DeviceIdentity.load(out / f"device-{rank}")
    trainer = Trainer(GPTConfig(block_size=32, vocab_size=256, n_layer=1, n_head=2, n_embd=32),
                      TrainSettings(steps_per_visit=2, batch_size=4, seq_len=16, warmup_steps=1, seed=5),
                      "cpu")
    ring = FleetRing(trainer=trainer, host=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]),
                     prefix=f"test/devices/{variant}", rank=rank, world=world, identity=identity, root=ca.root,
                     crl=ca.crl(), variant=variant, timeout_s=60)
    buf = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(100 + rank))
    digests, weights = [], [(1, 1), (1, 0), (1, 1)]  # rank 1 idle (weight 0) in step 1
    results = []
    for step, w in enumerate(weights):
        weight = w[rank]
        res = ring.train_step(buf, train_off=0, train_len=3584, val_off=3584, val_len=512, fmt="byte",
                              weight=weight, total_weight=sum(w), steps=2, seed=sample_seed(5, rank, step))
        digests.append(trainer.model_digest())
        results.append(res.to_wire())
    (out / f"rank-{rank}.json").write_text(json.dumps({"digests": digests, "results": results,
                                                       "peers": ring.peers()}))
    torch.save({k: v.clone() for k, v in trainer.model.state_dict().items()}, out / f"rank-{rank}.pt")
    ring.close()


if __name__ == "__main__":
    main()
