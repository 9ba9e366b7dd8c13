"""The device's side of checkpoints: a model state sealed as a checkpoint's stream, and opened back.

The state becomes bytes and back through :mod:`gputravel.core.training.state_stream` (:func:`state_pieces`,
:class:`StateDecoder`; re-exported here); :func:`seal_state` seals those bytes chunk by chunk under the run key.
The files those streams are stored in, and everything else the orchestrator does with checkpoints,
are :mod:`gputravel.core.training.store` (torch-free); its names are re-exported here.
:class:`CheckpointStore` here adds in-process sealing and opening of a state (tests and tools).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from gputravel.core.protocol.stream import DEFAULT_STREAM_CHUNK, StreamHeader, StreamSealer, rechunk
from gputravel.core.training import store as _store
from gputravel.core.training.state_stream import StateDecoder, snapshot_state, state_pieces, state_size
from gputravel.core.training.store import (
    CHECKPOINT_VERSION,
    DEFAULT_KEEP,
    REC_DATA,
    REC_END,
    CheckpointFile,
    CheckpointWriter,
    load_or_create_key,
    meta_mac,
)

__all__ = [
    "CHECKPOINT_VERSION",
    "DEFAULT_KEEP",
    "CheckpointFile",
    "CheckpointStore",
    "CheckpointWriter",
    "StateDecoder",
    "load_or_create_key",
    "meta_mac",
    "seal_state",
    "snapshot_state",
    "state_pieces",
    "state_size",
]


def seal_state(key: bytes, header: StreamHeader, state: Any, *,
               trailer: Mapping[str, Any] | None = None) -> Iterator[tuple[int, memoryview]]:
    """The sealed chunks of ``state``'s stream as ``(record kind, sealed bytes)``: data chunks, then the end
    chunk. The sealed bytes are a view of one reused buffer, valid until the next chunk is asked for."""
    sealer = StreamSealer(key, header)
    out = bytearray(header.sealed_size(header.chunk_size))
    for chunk in rechunk(state_pieces(state), header.chunk_size):
        n = sealer.seal_into(chunk, out)
        yield REC_DATA, memoryview(out)[:n]
    yield REC_END, memoryview(sealer.end(trailer))


class CheckpointStore(_store.CheckpointStore):
    """The torch-free store, plus sealing and opening a state in this process (tests, tools; a run's
    device seals its own)."""

    @classmethod
    def over(cls, store: _store.CheckpointStore) -> CheckpointStore:
        """The same folder and key as ``store`` (a run's torch-free store), able to open states here."""
        return cls(store.directory, store._key, keep=store.keep)

    def save(self, state: Any, *, run_id: str, seq: int, meta: Mapping[str, Any] | None = None,
             chunk_size: int = DEFAULT_STREAM_CHUNK) -> Path:
        """Seal ``state`` as checkpoint ``seq`` of ``run_id``, chunk by chunk; keeps the newest ``keep`` files."""
        header = self.new_header(run_id=run_id, seq=seq, chunk_size=chunk_size)
        with self.writer(header) as w:
            for kind, sealed in seal_state(self.run_key(run_id), header, state):
                w.add(kind, sealed)
            return w.commit(meta)

    def load(self, path_or_seq: Path | int, *, run_id: str | None = None, targets: Any = None) -> Any:
        """Verify, open and decode a checkpoint.

        Raises:
            DataError: missing or truncated file (the message names the chunk).
            TagError: the file was altered, sealed under another key, renamed, or belongs to another run.
        """
        decoder = StateDecoder(targets=targets)
        for plain in self.chunks(path_or_seq, run_id=run_id):
            decoder.feed(plain)
        return decoder.result()
