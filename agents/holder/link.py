"""The holder link as the agent sees it: length-prefixed frames on stdout (written under one lock, so the
sender thread and the main loop never interleave) and stdin (read by one thread into the agent's inbox),
and the long-lived sender thread that writes sealed chunks while the next ones are sealed."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, BinaryIO, ClassVar, Protocol

from gputravel.core.protocol import FrameType, read_frame, write_frame
from gputravel.core.protocol.errors import AgentError, GpuTravelError

__all__ = ["AgentLink", "Message", "SendFailed", "Sender"]


class Message(Protocol):
    """A typed holder-link message (``core.protocol.holderlink``)."""

    FRAME: ClassVar[FrameType]

    def to_wire(self) -> dict[str, Any]: ...


class SendFailed(AgentError):
    """Writing a sealed chunk to its link failed (posted by the sender thread)."""

    def __init__(self, reason: str) -> None:
        super().__init__("agent", reason)


class AgentLink:
    """The agent's end of the holder link (stdin/stdout, locally or through an SSH channel)."""

    def __init__(self, out: BinaryIO, inp: BinaryIO) -> None:
        self.out, self.inp = out, inp
        self._write_lock = threading.Lock()

    def send(self, ftype: FrameType, header: dict[str, Any], payload: bytes | bytearray | memoryview = b"") -> None:
        with self._write_lock:
            write_frame(self.out, ftype, header, payload)
            self.out.flush()

    def send_msg(self, msg: Message) -> None:
        self.send(msg.FRAME, msg.to_wire())

    def send_all(self, msgs: list[Message]) -> None:
        """Several header-only messages in one write to the link (one SSH packet where they fit)."""
        with self._write_lock:
            for msg in msgs:
                write_frame(self.out, msg.FRAME, msg.to_wire())
            self.out.flush()

    def start_reader(self, inbox: queue.Queue[Any]) -> None:
        """Post every frame the orchestrator sends to ``inbox``; then None (end of stream) or the error."""

        def read() -> None:
            try:
                while True:
                    frame = read_frame(self.inp)
                    inbox.put(frame)
                    if frame is None:
                        return
            except GpuTravelError as exc:  # a malformed frame (wirejson's bounds included): the link is done
                inbox.put(exc)

        threading.Thread(target=read, name="agent-link-reader", daemon=True).start()


class Sender:
    """One long-lived thread per agent that writes sealed chunks to their link while the agent seals the
    next ones (sealing and sending overlap). A failed write is posted to the agent's inbox."""

    def __init__(self, inbox: queue.Queue[Any]) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._inbox = inbox
        self._pending = 0
        self._idle = threading.Condition()
        threading.Thread(target=self._run, name="agent-sender", daemon=True).start()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        with self._idle:
            self._pending += 1
        self._q.put((fn, args))

    def drain(self) -> None:
        """Wait until every submitted write finished (before the slots are reused)."""
        with self._idle:
            while self._pending:
                self._idle.wait()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except (OSError, GpuTravelError, ValueError) as exc:
                self._inbox.put(SendFailed(f"sending a chunk failed: {exc}"))
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
