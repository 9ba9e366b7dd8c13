"""A DDP communication hook that all-reduces every gradient bucket over the (secure) ring.

Shaped like torch's own hooks (``torch.distributed.algorithms.ddp_comm_hooks``)::

    state = SecureRingState(variant="secure_pipelined", vendor_dir=shared_dir)   # SIM identities
    ddp_model.register_comm_hook(state, secure_ring_hook)

The hook averages (divides by the world size, like ``allreduce_hook``) and returns a future that a
single communication thread completes, so buckets are reduced in DDP's order while backward runs on.
A rejected hop makes the future fail: ``loss.backward()`` raises on every rank.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cryptography import x509

from gputravel.core.attestation import DeviceIdentity, Policy
from gputravel.core.collectives.crypto import HostCrypto, default_workers
from gputravel.core.collectives.keys import RingKeys, emulated_identity, establish_ring_keys
from gputravel.core.collectives.ring import (
    RingFault,
    SecureRing,
    Variant,
    available_variants,
)
from gputravel.core.errors import CollectiveError, ConfigError
from gputravel.core.procs import name_os_thread

#: ``torch.distributed.Store`` (the c10d key-value store); not exported to type checkers
Store = Any

__all__ = ["SecureRingState", "default_store", "secure_ring_hook"]

_SETUPS = itertools.count()  # ring set-ups in this process: the same sequence on every rank


def default_store() -> Store:
    """The default process group's store (where ``init_process_group`` rendezvoused)."""
    return dist.distributed_c10d._get_default_store()


class SecureRingState:
    """Keys, counters, the crypto pool and the stats of ``secure_ring_hook`` on one rank."""

    __slots__ = (
        "variant",  # Variant this hook runs
        "process_group",  # None: the default group
        "world_size",  # ranks in the group (gradients are divided by it)
        "ring",  # SecureRing: keys, nonce counters, buffers, stats
        "async_comm",  # reduce on a communication thread (True) or inside the hook (False)
        "_comm",  # the single communication thread (keeps DDP's bucket order)
        "error",  # the last exception a reduce raised (DDP hands backward only its text; ``backward`` re-raises it)
    )

    def __init__(
        self,
        *,
        variant: Variant | str = Variant.SECURE_PIPELINED,
        process_group: dist.ProcessGroup | None = None,
        identity: DeviceIdentity | None = None,
        root: x509.Certificate | None = None,
        crl: x509.CertificateRevocationList | None = None,
        vendor_dir: Path | str | None = None,
        policy: Policy | None = None,
        keys: RingKeys | None = None,
        store: Store | None = None,
        chunk_bytes: int | None = None,
        workers: int | None = None,
        sealed_gather: bool = True,
        async_comm: bool = True,
        fault: RingFault | None = None,
        timeout: timedelta = timedelta(seconds=120),
        expected_peers: list[str] | None = None,
    ) -> None:
        """Secure variants need keys: pass ``keys``, or ``identity`` + ``root`` (+ ``crl``) of this rank's
        device, or (SIM) ``vendor_dir``, a folder all ranks share, for emulated identities."""
        try:
            self.variant = Variant(variant)
        except ValueError:
            raise ConfigError(f"unknown variant {variant!r} (choose from {', '.join(v.value for v in Variant)})") from None
        if self.variant not in available_variants():
            raise ConfigError(f"variant {self.variant} is not available in this torch build")
        if not dist.is_initialized():
            raise CollectiveError("call torch.distributed.init_process_group before creating the hook state")
        if chunk_bytes is not None and chunk_bytes < 4096:
            raise ConfigError("chunk_bytes must be at least 4096")
        if workers is not None and workers < 0:
            raise ConfigError("workers must be >= 0 (0: crypto inline)")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
        if self.variant.secure and keys is None and self.world_size > 1:
            store = default_store() if store is None else store
            if identity is None or root is None:
                if vendor_dir is None:
                    raise ConfigError("secure variants need keys, identity and root, or (SIM) vendor_dir")
                identity, root, crl = emulated_identity(Path(vendor_dir), rank=rank, store=store, timeout=timeout)
            ranks = "-".join(str(r) for r in dist.get_process_group_ranks(process_group or dist.group.WORLD))
            keys = establish_ring_keys(store, rank=rank, world=self.world_size, identity=identity, root=root,
                                       crl=crl, policy=policy, prefix=f"gputravel/ring/{ranks}/{next(_SETUPS)}",
                                       timeout=timeout, expected=expected_peers)
        self.ring = SecureRing(group=process_group, keys=keys, chunk_bytes=chunk_bytes, sealed_gather=sealed_gather,
                               crypto=HostCrypto(workers=default_workers(_local_world(self.world_size))
                                                 if workers is None else workers),
                               fault=fault)
        self.async_comm = async_comm
        self._comm: ThreadPoolExecutor | None = None
        self.error: BaseException | None = None

    @property
    def stats(self) -> dict[str, dict[str, float]]:
        """Seconds by where they went, per variant (see ``RingStats``)."""
        return {v.value: s.as_dict() for v, s in self.ring.stats.items()}

    def close(self) -> None:
        if self._comm is not None:
            self._comm.shutdown(wait=True)
            self._comm = None
        self.ring.close()

    def __repr__(self) -> str:
        return f"SecureRingState(variant={self.variant.value}, world={self.world_size}, keys={self.ring.keys!r})"

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average ``tensor`` over the group in place with this state's variant (a failure is kept in ``error``)."""
        tensor.div_(self.world_size)
        try:
            result: torch.Tensor = self.ring.all_reduce(tensor, self.variant)
        except BaseException as exc:
            self.error = exc
            raise
        return result

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, raising the ring's own error where the hook failed.

        DDP turns a hook's exception into a ``RuntimeError`` that only quotes it ("Unable to cast TagError: ...
        to Tensor"), so ``except TagError`` would never match; this raises the ``TagError``,
        ``CollectiveAbortedError`` or ``CollectiveError`` itself (DDP's error as its cause)."""
        self.error = None
        try:
            torch.autograd.backward(loss)
        except RuntimeError as exc:
            failure, self.error = self.error, None
            if failure is None:
                raise
            raise failure from exc

    def comm_thread(self) -> ThreadPoolExecutor:
        if self._comm is None:
            self._comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ring-comm", initializer=name_os_thread)
        return self._comm


def _local_world(world: int) -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, else all of them (one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def secure_ring_hook(state: SecureRingState,
                     bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
    """DDP comm hook: average the bucket over the ring of ``state.variant``."""
    buffer = bucket.buffer()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    if state.variant is Variant.NOOP:
        fut.set_result(buffer)
        return fut
    if not state.async_comm:
        fut.set_result(state.reduce(buffer))
        return fut

    def run() -> None:
        try:
            fut.set_result(state.reduce(buffer))
        except BaseException as exc:  # handed to DDP, which raises it in backward
            fut.set_exception(exc)  # type: ignore[arg-type]  # torch's stub says Tensor

    state.comm_thread().submit(run)
    return fut


# DDP checks the hook's annotations by identity (inspect.signature); with postponed annotations they
# would be strings, so they are set as objects here.
secure_ring_hook.__annotations__.update(
    state=SecureRingState, bucket=dist.GradBucket,  # type: ignore[attr-defined]  # exported at run time
    **{"return": torch.futures.Future[torch.Tensor]})
