"""The device client's calls from the event loop itself, with no worker thread: the window's key, on a hand-off's
critical path (issue 34 item 2). A base of :class:`~gputravel.core.deviceclient.client.DeviceClient`, which owns the
link; this part only reads it."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

from gputravel.core.errors import DeviceError, FrameError, GpuTravelError
from gputravel.core.protocol.deviceanswers import HandoffGrant
from gputravel.core.protocol.devicelink import ControlChannel, Op

__all__ = ["LoopCalls", "handoff_args"]


class LoopCalls:
    """``call_on_loop`` and ``handoff_on_loop`` over the client's link (its socket, channel and lock)."""

    _sock: socket.socket | None
    _chan: ControlChannel | None
    _lock: threading.Lock
    nonce_budget: int
    timeout: float

    def call(self, op: Op | str, payload: bytes | bytearray | memoryview = b"", *, attached: bool = False,
             **args: Any) -> tuple[dict[str, Any], bytes]:
        raise NotImplementedError

    def _send(self, op: Op | str, payload: bytes | bytearray | memoryview = b"", *, attached: bool = False,
              **args: Any) -> None:
        raise NotImplementedError

    def _receive(self) -> tuple[dict[str, Any] | GpuTravelError, bytes]:
        raise NotImplementedError

    async def call_on_loop(self, op: Op | str, **args: Any) -> dict[str, Any]:
        """``call`` from the event loop with no worker thread, for a small request answered without a payload:
        it is sealed and written at once (a few hundred bytes on an idle socket), the loop's own poller wakes when
        the answer arrives, and it is read then; the loop is free while the device works. Two thread crossings
        fewer than ``asyncio.to_thread(call)`` (issue 34: 0.2-0.7 ms each on a loaded 2-core machine). Relies on
        this link's rule that every answer is read in full before the next request (the reader holds no byte
        now). ``call`` in a worker thread where another thread is mid-request or a rotation is due; a cancelled
        wait still reads its answer (the channel stays in step); no answer in ``timeout`` is ``DeviceError``."""
        sock, loop = self._sock, asyncio.get_running_loop()
        if sock is None or self._chan is None or self._chan.send.counter >= self.nonce_budget - 1 \
                or not self._lock.acquire(blocking=False):
            return (await asyncio.to_thread(self.call, op, **args))[0]
        try:
            self._send(op, **args)
            ready: asyncio.Future[None] = loop.create_future()

            def readable() -> None:
                if not ready.done():
                    ready.set_result(None)

            loop.add_reader(sock.fileno(), readable)
            try:
                async with asyncio.timeout(self.timeout):
                    await ready
            except TimeoutError:
                raise DeviceError(f"device link failed: no answer to {op} in {self.timeout:g} s") from None
            except asyncio.CancelledError:
                self._receive()
                raise
            finally:
                loop.remove_reader(sock.fileno())
            resp, _ = self._receive()
        finally:
            self._lock.release()
        if isinstance(resp, GpuTravelError):
            raise resp
        return resp

    async def handoff_on_loop(self, *, epoch: int, offset: int, length: int, chunk_size: int,
                              relay: tuple[str, dict[str, Any]] | None = None) -> HandoffGrant:
        """``handoff`` from the event loop (``call_on_loop``): the window's key on a hand-off's critical path."""
        return self._grant(await self.call_on_loop(Op.HANDOFF,
                                                   **handoff_args(epoch, offset, length, chunk_size, relay)))

    @staticmethod
    def _grant(head: dict[str, Any]) -> HandoffGrant:
        try:
            return HandoffGrant.from_wire(head)
        except FrameError as exc:
            raise DeviceError(f"the device's handoff grant is malformed: {exc.reason}") from None


def handoff_args(epoch: int, offset: int, length: int, chunk_size: int,
                 relay: tuple[str, dict[str, Any]] | None) -> dict[str, Any]:
    """``Op.HANDOFF``'s arguments."""
    args: dict[str, Any] = {"epoch": epoch, "offset": offset, "length": length, "chunk_size": chunk_size}
    if relay is not None:
        args["relay"] = {"holder": relay[0], "handoff": relay[1]}
    return args
