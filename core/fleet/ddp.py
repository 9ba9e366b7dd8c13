"""The device side of the fleet: a device joins the fleet's gradient ring and trains its replica with it.

Each device is a rank of the *device group*, a ``torch.distributed`` process group of the fleet's
device services rendezvoused on the torchrun job's c10d store (under a prefix of its own). Its model
is wrapped in ``DistributedDataParallel`` with :func:`~gputravel.core.collectives.hook.secure_ring_hook`:
every gradient bucket is averaged over the ring, every hop sealed with AES-256-GCM under link keys the
neighbouring devices agreed by attested ECDH with their own identity keys
(:func:`~gputravel.core.collectives.keys.establish_ring_keys`). No plaintext parameter or gradient
leaves a device: DDP's initial broadcast is off (``init_sync=False``; every replica is built from the
same seed, and a replica restored from a checkpoint is checked by digest).

A lock-step step is weighted: each device trains on its own holder's buffer with weight 1, an idle
device (or one whose visit failed) with weight 0 on a zero batch, so the ring stays whole. The loss is
scaled by ``weight * world / total_weight`` and the hook divides by ``world``: the update is the mean
gradient over the devices that trained, identical on every replica.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from cryptography import x509
from torch.nn.parallel import DistributedDataParallel

from gputravel.core.attestation import DeviceIdentity, Policy
from gputravel.core.collectives.hook import SecureRingState, secure_ring_hook
from gputravel.core.collectives.ring import RingFault, RingStats, Variant
from gputravel.core.errors import CollectiveError, ConfigError, DataError
from gputravel.core.training.tokens import TokenFormat, bytes_per_token, gather_tokens

__all__ = ["FleetRing", "FleetStepResult", "sample_seed"]


def sample_seed(seed: int, rank: int, step: int) -> int:
    """The batch-sampling seed of device ``rank`` in fleet step ``step`` (distinct per device and step)."""
    return (seed * 1_000_003 + rank * 7_919 + step) % (2**63)


@dataclass(slots=True)
class FleetStepResult:
    """What one lock-step step did on one device."""

    losses: list[float]
    tokens: int
    seconds: float
    allreduce_calls: int
    allreduce_s: float
    val_loss: float | None = None
    stats: dict[str, float] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"losses": self.losses, "tokens": self.tokens, "seconds": self.seconds,
                "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 and self.tokens else 0.0,
                "allreduce_calls": self.allreduce_calls, "allreduce_s": self.allreduce_s,
                "val_loss": self.val_loss, "stats": self.stats}


class FleetRing:
    """One device's membership of the device group: the process group, the ring keys, the DDP replica."""

    def __init__(self, *, trainer: Any, host: str, port: int, prefix: str, rank: int, world: int,
                 identity: DeviceIdentity, root: x509.Certificate,
                 crl: x509.CertificateRevocationList | None = None, policy: Policy | None = None,
                 variant: Variant | str = Variant.SECURE_PIPELINED, backend: str = "gloo",
                 timeout_s: float = 300.0, fault: RingFault | None = None,
                 expected_peers: list[str] | None = None) -> None:
        if dist.is_initialized():
            raise CollectiveError("this device is already in a device group")
        if not 0 <= rank < world:
            raise ConfigError(f"device rank {rank} outside world {world}")
        try:
            self.variant = Variant(variant)
        except ValueError:
            raise ConfigError(f"unknown all-reduce variant {variant!r}") from None
        timeout = timedelta(seconds=timeout_s)
        base = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)  # type: ignore[attr-defined]
        self.store = dist.PrefixStore(prefix, base)  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=self.store, rank=rank, world_size=world, timeout=timeout)
        self.rank, self.world = rank, world
        self.trainer = trainer
        try:
            self.state = SecureRingState(variant=self.variant, identity=identity, root=root, crl=crl, policy=policy,
                                         store=self.store, timeout=timeout, fault=fault,
                                         expected_peers=expected_peers)
            # no initial broadcast (it would carry parameters in plaintext): replicas start equal by seed
            self.ddp = DistributedDataParallel(trainer.model, init_sync=False, broadcast_buffers=False)
            self.ddp.register_comm_hook(self.state, secure_ring_hook)
        except BaseException:
            dist.destroy_process_group()
            raise

    def peers(self) -> dict[str, Any]:
        """The verified neighbours (device id and key fingerprint) and this rank's link-key fingerprints."""
        keys = self.state.ring.keys
        if keys is None:  # a plaintext variant, or a world of one
            return {"variant": self.variant.value, "sealed": False}
        return {"variant": self.variant.value, "sealed": True, "peers": dict(keys.peers),
                "send_fp": keys.send.fingerprint, "recv_fp": keys.recv.fingerprint}

    def close(self) -> None:
        self.state.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def train_step(self, buf: torch.Tensor, *, train_off: int, train_len: int, val_off: int, val_len: int,
                   fmt: str, weight: float, total_weight: float, steps: int, seed: int) -> FleetStepResult:
        """``steps`` optimizer steps of one lock-step step; every device calls it with the same
        ``total_weight`` and ``steps``. On any failure the replica is put back as it was before the call
        (every device fails together: the ring aborts on all ranks)."""
        if total_weight <= 0 or weight < 0 or steps < 1:
            raise ConfigError("a fleet step needs total_weight > 0, weight >= 0 and steps >= 1")
        trainer = self.trainer
        s = trainer.settings
        tfmt = TokenFormat(fmt)
        device = buf.device
        window = n_tokens = None
        if weight > 0:
            window = trainer._window(buf, train_off, train_len, tfmt, "training")
            n_tokens = train_len // bytes_per_token(tfmt)
            if n_tokens < s.seq_len + 1:
                raise DataError(f"the training part holds {n_tokens} tokens; at least {s.seq_len + 1} are needed")
        snapshot = {"model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                    "optimizer": _clone(trainer.optimizer.state_dict()), "step": trainer.step}
        gen = torch.Generator().manual_seed(seed)
        span = torch.arange(s.seq_len + 1, device=device)
        zeros = torch.zeros((s.batch_size, s.seq_len), dtype=torch.long, device=device)
        scale = weight * self.world / total_weight
        stats = self.state.ring.stats.setdefault(self.variant, RingStats())
        calls0, wall0 = stats.calls, stats.wall_s
        losses: list[float] = []
        trainer.model.train()
        t0 = time.perf_counter()
        try:
            for _ in range(steps):
                if window is not None and n_tokens is not None:
                    starts = torch.randint(0, n_tokens - s.seq_len, (s.batch_size, 1), generator=gen)
                    chunk = gather_tokens(window, tfmt, starts.to(device) + span)
                    x, y = chunk[:, :-1], chunk[:, 1:]
                else:
                    x = y = zeros
                # the trainer's own step, through DDP: its hook averages every bucket over the sealed ring
                loss = trainer.step_batch(x, y, forward=self.ddp, scale=scale)
                if weight > 0:
                    losses.append(float(loss.item()))
        except BaseException:
            trainer.model.load_state_dict(snapshot["model"])
            trainer.optimizer.load_state_dict(snapshot["optimizer"])
            trainer.step = snapshot["step"]
            raise
        seconds = time.perf_counter() - t0
        val = None
        if weight > 0 and val_len:
            val = trainer.eval_on_window(buf, val_off=val_off, val_len=val_len, fmt=tfmt)
        tokens = steps * s.batch_size * s.seq_len if weight > 0 else 0
        return FleetStepResult(losses=losses, tokens=tokens, seconds=seconds, allreduce_calls=stats.calls - calls0,
                               allreduce_s=stats.wall_s - wall0, val_loss=val, stats=stats.as_dict())


def _clone(obj: Any) -> Any:
    """A deep copy of an optimizer state dict (tensors cloned)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj
