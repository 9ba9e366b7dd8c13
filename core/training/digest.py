"""The model digest's formats (``gputravel/model-digest/v3``, and ``v2`` still read) and the memo that keeps a
frozen tensor's hash.

The digest is a hash ``H`` over the domain ``gputravel/model-digest/<format>\\0`` followed by one 32-byte entry per
item of the state, in :meth:`Trainer.model_digest`'s order (parameters, then each parameter's optimizer state):

* a tensor's entry is ``H(label|dtype|shape\\0 || its raw bytes)``;
* a plain value's entry (an optimizer's step count kept as a number) is ``H(label=repr(value)\\0)``.

``H`` is BLAKE3 (32-byte output) in ``v3``, the format every digest is taken in now, and SHA-256 in ``v2``: the same
layout, another hash. BLAKE3 hashes about 4 GB/s of a core on the build machines' Xeon (no SHA extensions), SHA-256
about 0.2-0.35 GB/s (``scripts/hash_speeds.py``), so a whole 135M model's state (1.6 GB with AdamW's moments) is
hashed in about 0.4 s of CPU instead of 7.6 s. A ``v2`` digest (a checkpoint or weights stream sealed before
``v3``) is still checked: the device recomputes the restored state's digest in the format the stream's trailer
names (:func:`check_digest_format`) and compares it with the sealed one. ``v1`` (one SHA-256 over every tensor's
label and bytes in a row) and unknown formats are refused by name, never read as another.

A tensor's entry depends on that tensor alone: a tensor that cannot have changed (a frozen base weight under LoRA)
is hashed once and its entry reused (:class:`FrozenHashes`), and a visit hashes only what trains.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import blake3
import torch

from gputravel.core.errors import DataError
from gputravel.core.procs import name_os_thread

__all__ = ["DIGEST_DOMAIN", "DIGEST_FORMAT", "DIGEST_FORMATS", "DIGEST_PARALLEL_BYTES", "DIGEST_STAGE_BYTES",
           "FrozenHashes", "check_digest_format", "combine", "digest_domain", "digest_trailer", "digest_workers",
           "hash_tensor_into", "new_hash", "tensor_entries", "tensor_entry", "value_entry"]

#: the format every digest is taken in
DIGEST_FORMAT = "v3"
#: the formats a restored stream's digest may be in (and is checked in): the current one and the one before
DIGEST_FORMATS = ("v2", "v3")


def digest_domain(fmt: str = DIGEST_FORMAT) -> bytes:
    """The bytes a digest of format ``fmt`` starts with."""
    return f"gputravel/model-digest/{fmt}\0".encode()


DIGEST_DOMAIN = digest_domain()


def new_hash(fmt: str = DIGEST_FORMAT, data: bytes = b"") -> Any:
    """A fresh hash of format ``fmt`` (``v3``: BLAKE3, 32 bytes; ``v2``: SHA-256), fed ``data``. Both release the
    GIL on large buffers."""
    if fmt == "v3":
        return blake3.blake3(data)
    if fmt == "v2":
        return hashlib.sha256(data)
    raise ValueError(f"model digest format is one of {', '.join(DIGEST_FORMATS)}, not {fmt!r}")

#: bytes of device memory staged per host copy while hashing on CUDA: the digest never copies a whole tensor
#: (GPT-2's embedding is 154 MB), let alone the model, to the host
DIGEST_STAGE_BYTES = 4 << 20

#: below this many bytes to hash, a digest's tensors are hashed on the calling thread alone (a LoRA visit's
#: adapters: a pool would cost more than it saves)
DIGEST_PARALLEL_BYTES = 32 << 20


def hash_tensor_into(h: Any, label: str, tensor: torch.Tensor, *, stage: torch.Tensor | None = None) -> None:
    """Feed ``h`` a tensor's label, dtype, shape and bytes: straight from its memory on the CPU; through
    ``stage`` (default: one pinned buffer) in bounded slices elsewhere, or wherever ``stage`` is given."""
    t = tensor.detach().contiguous().reshape(-1)
    h.update(f"{label}|{t.dtype}|{tuple(tensor.shape)}\0".encode())
    raw = t.view(torch.uint8)
    if raw.device.type == "cpu" and stage is None:
        h.update(raw.numpy())  # the tensor's own memory, no copy
        return
    stage = stage if stage is not None else _digest_stage()
    host = stage.numpy()
    for pos in range(0, raw.numel(), stage.numel()):
        k = min(stage.numel(), raw.numel() - pos)
        stage[:k].copy_(raw[pos: pos + k])  # synchronous: complete before it is hashed
        h.update(host[:k])


def tensor_entry(label: str, tensor: torch.Tensor, *, stage: torch.Tensor | None = None,
                 fmt: str = DIGEST_FORMAT) -> bytes:
    """A tensor's 32-byte entry in a digest of format ``fmt``."""
    h = new_hash(fmt)
    hash_tensor_into(h, label, tensor, stage=stage)
    return bytes(h.digest())


def digest_workers() -> int:
    """Threads that hash a large digest's tensors: the process's cores (its CPU affinity), at most 4. A tensor's
    entry depends on that tensor alone, so entries are hashed side by side and joined in order; both hashes
    release the GIL on large buffers."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on this platform
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def tensor_entries(items: Sequence[tuple[str, torch.Tensor]], *, workers: int | None = None,
                   fmt: str = DIGEST_FORMAT) -> list[bytes]:
    """``[tensor_entry(label, t, fmt=fmt) for label, t in items]``, in that order, the CPU tensors' hashed by up to
    ``workers`` threads (default :func:`digest_workers`) where they hold ``DIGEST_PARALLEL_BYTES`` or more, the
    largest first. Tensors elsewhere (CUDA) go through the one staging buffer, on the calling thread."""
    sizes = [t.numel() * t.element_size() for _, t in items]
    n = digest_workers() if workers is None else workers
    on_cpu = all(t.device.type == "cpu" for _, t in items)
    if n < 2 or len(items) < 2 or not on_cpu or sum(sizes) < DIGEST_PARALLEL_BYTES:
        return [tensor_entry(label, t, fmt=fmt) for label, t in items]
    order = sorted(range(len(items)), key=lambda i: -sizes[i])  # largest first: the threads end together
    out: list[bytes] = [b""] * len(items)
    with ThreadPoolExecutor(max_workers=min(n, len(items)), thread_name_prefix="model-digest",
                            initializer=name_os_thread) as pool:
        for i, entry in zip(order, pool.map(lambda i: tensor_entry(*items[i], fmt=fmt), order), strict=True):
            out[i] = entry
    return out


def value_entry(label: str, value: object, fmt: str = DIGEST_FORMAT) -> bytes:
    """A plain value's 32-byte entry in a digest of format ``fmt``."""
    return bytes(new_hash(fmt, f"{label}={value!r}\0".encode()).digest())


def combine(entries: Iterable[bytes], fmt: str = DIGEST_FORMAT) -> str:
    """The digest (hex) of format ``fmt`` of the state whose entries are ``entries``, in order."""
    h = new_hash(fmt, digest_domain(fmt))
    for entry in entries:
        h.update(entry)
    return str(h.hexdigest())


def digest_trailer(digest: str, fmt: str = DIGEST_FORMAT) -> dict[str, str]:
    """A sealed stream's trailer: the model's digest and its format."""
    return {"model_digest": digest, "digest_format": fmt}


def check_digest_format(trailer: Any, what: str) -> str:
    """The format of the digest in ``trailer`` (a restored stream's), one this version computes and so checks
    (``DIGEST_FORMATS``); else a ``DataError`` naming it (none named: ``v1``, sealed before the format was
    named)."""
    got = trailer.get("digest_format", "v1") if isinstance(trailer, dict) else "v1"
    if got not in DIGEST_FORMATS:
        raise DataError(f"{what} was sealed with model digest {str(got)[:16]!r}; this version computes "
                        f"{' and '.join(repr(f) for f in DIGEST_FORMATS)} (gputravel/model-digest/...) and cannot "
                        "check it: re-run from the weights, or restore it with the version that wrote it")
    return str(got)


class FrozenHashes:
    """Entries of frozen tensors (``requires_grad`` off), each kept while the same tensor object, at the same
    address, has the same ``_version`` (torch bumps it at every in-place write through the tensor or a view of
    it: ``copy_``, ``load_state_dict``, an optimizer's update).

    A write that torch does not count (through ``.data``, a NumPy view of the memory, another process) is not
    seen here: whoever writes a model that way calls :meth:`forget` (the device's restore does), and VERIFY's
    model MAC, which reads every byte each time, is what finds a write behind torch's back."""

    def __init__(self) -> None:
        #: (format, label) -> (the tensor itself, held so that its id cannot be reused; its address; its version;
        #: entry)
        self._memo: dict[tuple[str, str], tuple[torch.Tensor, int, int, bytes]] = {}
        self.hashed = 0  # tensors hashed (not reused) since the memo was made: the tests read it

    def entry(self, label: str, tensor: torch.Tensor, fmt: str = DIGEST_FORMAT) -> bytes:
        """``tensor_entry(label, tensor, fmt=fmt)``, from the memo where the tensor is frozen and unchanged."""
        return self.entries([(label, tensor)], fmt=fmt)[0][0]

    def entries(self, items: Sequence[tuple[str, torch.Tensor]], *, also: Sequence[tuple[str, torch.Tensor]] = (),
                workers: int | None = None, fmt: str = DIGEST_FORMAT) -> tuple[list[bytes], list[bytes]]:
        """:meth:`entry` of each of ``items``, and ``tensor_entry`` of each of ``also`` (never kept: an optimizer's
        moments), in their orders: the kept ones from the memo, the rest hashed side by side in one pool
        (:func:`tensor_entries`) and the frozen ones among them kept."""
        out: list[bytes | None] = [self._kept(fmt, label, t) for label, t in items]
        todo = [i for i, e in enumerate(out) if e is None]
        fresh = tensor_entries([items[i] for i in todo] + list(also), workers=workers, fmt=fmt)
        for i, entry in zip(todo, fresh, strict=False):
            label, tensor = items[i]
            out[i] = entry
            if not tensor.requires_grad:  # the address and version it was hashed at (nothing writes it meanwhile)
                self._memo[(fmt, label)] = (tensor, tensor.data_ptr(), tensor._version, entry)
        self.hashed += len(todo)
        return [e for e in out if e is not None], fresh[len(todo):]

    def _kept(self, fmt: str, label: str, tensor: torch.Tensor) -> bytes | None:
        if tensor.requires_grad:
            return None
        kept = self._memo.get((fmt, label))
        if kept is not None and kept[0] is tensor and kept[1] == tensor.data_ptr() and kept[2] == tensor._version:
            return kept[3]
        return None

    def forget(self) -> None:
        """Drop every kept entry: the next digest hashes every tensor."""
        self._memo.clear()


_STAGE: list[torch.Tensor] = []


def _digest_stage() -> torch.Tensor:
    """One pinned host buffer of ``DIGEST_STAGE_BYTES``, allocated on first use."""
    if not _STAGE:
        _STAGE.append(torch.empty(DIGEST_STAGE_BYTES, dtype=torch.uint8, pin_memory=torch.cuda.is_available()))
    return _STAGE[0]
