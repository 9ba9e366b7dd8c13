"""The state stream: model state as a stream of bytes (:func:`state_pieces`), and back (:class:`StateDecoder`).

A state dict (nested dicts, lists, tuples, scalars and tensors, as ``Trainer.state_dict()`` returns) becomes::

    b"GTST" | manifest length u32 | manifest (JSON: the tree with tensors as {"$t": i}, and per
                                     tensor its dtype, shape, byte count) | tensor 0 bytes | tensor 1 ...

The pieces are views of the tensors' own memory on the CPU (no copy) and bounded slices staged
through one pinned buffer on CUDA, so no serialised copy of the whole state ever exists. A tensor
shared by two names (GPT-2's tied ``wte``/``lm_head``) is written once. The decoder takes the
stream in any cut and writes each tensor in place: into the tensor already at that path in
``targets`` when dtype and shape match (a restore into a live model needs no second copy), else
into a new one. Sealing the stream into a checkpoint is :mod:`gputravel.core.training.checkpoint`'s.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import torch

from gputravel.core.errors import ConfigError, DataError
from gputravel.core.protocol.stream import DEFAULT_STREAM_CHUNK

__all__ = ["MAX_MANIFEST", "STAGE_BYTES", "StateDecoder", "snapshot_state", "state_pieces", "state_size"]

_STATE_MAGIC = b"GTST"
_STATE_HEAD = struct.Struct(">4sI")
MAX_MANIFEST = 16 << 20
#: bytes staged per device-to-host copy on CUDA (the only host copy of device memory at any time)
STAGE_BYTES = DEFAULT_STREAM_CHUNK


_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
              torch.int32, torch.int64, torch.bool, torch.complex64)
}


def _flatten(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """The JSON tree of ``state`` with tensors replaced by ``{"$t": index}``, and the unique tensors."""
    tensors: list[torch.Tensor] = []
    seen: dict[tuple[Any, ...], int] = {}

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            t = x.detach()
            ident: tuple[Any, ...] = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape),
                                      tuple(t.stride()), t.dtype)
            if t.numel() == 0 or ident[0] == 0:
                ident = (id(t), 0, (), (), t.dtype)
            if ident not in seen:
                if str(t.dtype).removeprefix("torch.") not in _DTYPES:
                    raise ConfigError(f"cannot stream a tensor of dtype {t.dtype}")
                seen[ident] = len(tensors)
                tensors.append(t)
            return {"$t": seen[ident]}
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in x):
                return {k: walk(v) for k, v in x.items()}
            return {"$d": [[walk(k), walk(v)] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"$tuple": [walk(v) for v in x]}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise ConfigError(f"cannot stream a value of type {type(x).__name__} in a state dict")

    return walk(state), tensors


def _manifest(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    tree, tensors = _flatten(state)
    meta = [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
             "nbytes": t.numel() * t.element_size(), "host": t.device.type == "cpu"} for t in tensors]
    raw = json.dumps({"version": 1, "tree": tree, "tensors": meta}, separators=(",", ":")).encode()
    if len(raw) > MAX_MANIFEST:
        raise ConfigError(f"state manifest of {len(raw)} bytes exceeds {MAX_MANIFEST}")
    return _STATE_HEAD.pack(_STATE_MAGIC, len(raw)) + raw, tensors


def snapshot_state(state: Any, *, reuse: list[torch.Tensor] | None = None) -> Any:
    """A copy of ``state`` whose tensors are copies in the same memory (device memory on a GPU): what a
    background checkpoint seals while training goes on with the live tensors. A tensor shared by two names
    stays shared in the copy (written once). ``reuse``: the buffers of the previous snapshot, copied into
    where shape, dtype and device match (no fresh allocation, no page faults on every checkpoint); it is
    refilled with this snapshot's buffers."""
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    old = list(reuse or [])
    made: list[torch.Tensor] = []

    def copy(t: torch.Tensor) -> torch.Tensor:
        i = len(made)
        if i < len(old) and old[i].shape == t.shape and old[i].dtype == t.dtype and old[i].device == t.device:
            out = old[i].copy_(t)
        else:
            out = t.clone(memory_format=torch.contiguous_format)
        made.append(out)
        return out

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            t = x.detach()
            ident = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), tuple(t.stride()),
                     t.dtype)
            if ident[0] == 0 or t.numel() == 0:
                return t.clone()
            if ident not in copies:
                copies[ident] = copy(t)
            return copies[ident]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    with torch.no_grad():
        snap = walk(state)
    if reuse is not None:
        reuse[:] = made
    return snap


def state_size(state: Any) -> int:
    """Bytes of the state stream of ``state`` (manifest and tensor bytes)."""
    head, tensors = _manifest(state)
    return len(head) + sum(t.numel() * t.element_size() for t in tensors)


def _tensor_bytes(t: torch.Tensor, stage: torch.Tensor | None, *, force_stage: bool = False) -> Iterator[memoryview]:
    if t.numel() == 0:
        return
    if t.device.type == "cpu" and not force_stage:
        flat = t.contiguous().reshape(-1).view(torch.uint8)  # a view when already contiguous (the usual case)
        yield _host_view(flat)
        return
    assert stage is not None
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    host = _host_view(stage)
    for pos in range(0, n, stage.numel()):
        k = min(stage.numel(), n - pos)
        stage[:k].copy_(flat[pos: pos + k])  # synchronous: the staged bytes are complete when yielded
        yield host[:k]


def _host_view(t: torch.Tensor) -> memoryview:
    """A byte view of a CPU ``uint8`` tensor's own memory (no copy)."""
    arr: Any = t.numpy()
    return memoryview(arr).cast("B")


def state_pieces(state: Any, *, stage_bytes: int = STAGE_BYTES, force_stage: bool = False) -> Iterator[memoryview]:
    """The state stream of ``state`` as pieces; each piece is valid until the next is asked for.

    Tensors off the CPU (and all of them with ``force_stage``, for tests of that path on a CPU-only machine)
    go through one staging buffer of ``stage_bytes``."""
    head, tensors = _manifest(state)
    yield memoryview(head)
    stage: torch.Tensor | None = None
    if force_stage or any(t.device.type != "cpu" for t in tensors):
        stage = torch.empty(stage_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    for t in tensors:
        yield from _tensor_bytes(t, stage, force_stage=force_stage)


class StateDecoder:
    """Rebuilds a state dict from its stream, fed in chunks of any size (a push parser)."""

    def __init__(self, *, targets: Any = None, device: torch.device | str = "cpu",
                 stage_bytes: int = STAGE_BYTES) -> None:
        self.device = torch.device(device)
        self._targets = targets
        self._head = bytearray()
        self._need = _STATE_HEAD.size
        self._tree: Any = None
        self._meta: list[dict[str, Any]] = []
        self._tensors: list[torch.Tensor] = []
        self._index = 0
        self._pos = 0
        self._cur: memoryview | None = None  # host bytes of the current tensor (CPU) or None (staged)
        self._stage: torch.Tensor | None = None
        self._stage_bytes = stage_bytes
        self.bytes = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.bytes += len(view)
        pos = 0
        while pos < len(view):
            if self._tree is None:
                take = min(self._need - len(self._head), len(view) - pos)
                self._head += view[pos: pos + take]
                pos += take
                if len(self._head) == self._need:
                    self._parse_head()
                continue
            if self._index >= len(self._meta):
                raise DataError(f"state stream has {len(view) - pos} bytes after its last tensor")
            pos += self._fill(view[pos:])

    def _parse_head(self) -> None:
        if self._need == _STATE_HEAD.size:
            magic, n = _STATE_HEAD.unpack(bytes(self._head))
            if magic != _STATE_MAGIC:
                raise DataError("not a model state stream (bad magic)")
            if n > MAX_MANIFEST:
                raise DataError(f"state manifest of {n} bytes exceeds {MAX_MANIFEST}")
            self._need += n
            if n:
                return
        try:
            manifest = json.loads(bytes(self._head[_STATE_HEAD.size:]).decode())
            self._meta = list(manifest["tensors"])
            tree = manifest["tree"]
            if manifest.get("version") != 1:
                raise DataError(f"state stream version {manifest.get('version')!r} is not 1")
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"state manifest is malformed: {exc}") from None
        targets = _target_tensors(tree, self._targets)
        for i, m in enumerate(self._meta):
            try:
                dtype = _DTYPES[str(m["dtype"])]
                shape = tuple(int(s) for s in m["shape"])
            except (KeyError, TypeError, ValueError):
                raise DataError(f"state manifest: tensor {i} has a bad dtype or shape: {m!r}") from None
            t = targets.get(i)
            if t is None or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
                # host-side tensors (optimizer step counts, the sampler's state) stay on the host
                t = torch.empty(shape, dtype=dtype, device="cpu" if m.get("host") else self.device)
            if t.numel() * t.element_size() != int(m.get("nbytes", -1)):
                raise DataError(f"state manifest: tensor {i} declares {m.get('nbytes')} bytes for shape {shape}")
            self._tensors.append(t)
        self._tree = tree
        self._start_tensor()

    def _start_tensor(self) -> None:
        while self._index < len(self._tensors) and self._tensors[self._index].numel() == 0:
            self._index += 1
        self._pos = 0
        self._cur = None
        if self._index < len(self._tensors):
            t = self._tensors[self._index]
            if t.device.type == "cpu":
                self._cur = _host_view(t.detach().reshape(-1).view(torch.uint8))

    def _fill(self, view: memoryview) -> int:
        t = self._tensors[self._index]
        total = t.numel() * t.element_size()
        k = min(total - self._pos, len(view))
        if self._cur is not None:
            self._cur[self._pos: self._pos + k] = view[:k]
        else:
            if self._stage is None:
                self._stage = torch.empty(self._stage_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            flat = t.detach().reshape(-1).view(torch.uint8)
            done = 0
            while done < k:
                m = min(self._stage.numel(), k - done)
                self._stage.numpy()[:m] = view[done: done + m]
                flat[self._pos + done: self._pos + done + m].copy_(self._stage[:m])
                done += m
        self._pos += k
        if self._pos == total:
            self._index += 1
            self._start_tensor()
        return k

    def result(self) -> Any:
        """The state dict; a stream that stopped early is a ``DataError``."""
        if self._tree is None or self._index < len(self._tensors):
            raise DataError(f"state stream is truncated: {self._index} of {len(self._tensors) or '?'} tensors "
                            f"complete after {self.bytes} bytes")
        return _unflatten(self._tree, self._tensors)


def _target_tensors(tree: Any, targets: Any) -> dict[int, torch.Tensor]:
    """Tensors already present in ``targets`` at the paths where ``tree`` has tensor ``i``."""
    found: dict[int, torch.Tensor] = {}
    if targets is None:
        return found

    def walk(node: Any, target: Any) -> None:
        if isinstance(node, dict) and set(node) == {"$t"}:
            if isinstance(target, torch.Tensor):
                found.setdefault(int(node["$t"]), target.detach())
            return
        if isinstance(node, dict) and set(node) == {"$d"}:
            if isinstance(target, dict):
                for k, v in node["$d"]:
                    key = _unflatten(k, [])
                    if key in target:
                        walk(v, target[key])
            return
        if isinstance(node, dict) and set(node) == {"$tuple"}:
            node = node["$tuple"]
        if isinstance(node, dict) and isinstance(target, dict):
            for k, v in node.items():
                if k in target:
                    walk(v, target[k])
        elif isinstance(node, list) and isinstance(target, (list, tuple)):
            for v, tv in zip(node, target, strict=False):
                walk(v, tv)

    walk(tree, targets)
    return found


def _unflatten(node: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(node, dict):
        if set(node) == {"$t"}:
            return tensors[int(node["$t"])]
        if set(node) == {"$d"}:
            return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in node["$d"]}
        if set(node) == {"$tuple"}:
            return tuple(_unflatten(v, tensors) for v in node["$tuple"])
        return {k: _unflatten(v, tensors) for k, v in node.items()}
    if isinstance(node, list):
        return [_unflatten(v, tensors) for v in node]
    return node
