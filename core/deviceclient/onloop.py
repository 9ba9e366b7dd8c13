"""The device client's calls from the event loop itself, with no worker thread: the window's key, on a hand-off's
critical path (issue 34 item 2). A part of :class:`~gputravel.core.deviceclient.client.DeviceClient`
(``client.on_loop``): the client owns the link; this part borrows it for one request at a time
(``DeviceClient.claim``), or goes through a worker thread where it cannot."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from typing import Any, Protocol

from gputravel.core.errors import DeviceError, FrameError, GpuTravelError
from gputravel.core.protocol.deviceanswers import HandoffGrant, WindowClosed, WindowStatus
from gputravel.core.protocol.devicelink import Op

__all__ = ["Completion", "Link", "LoopCaller", "grant_from", "handoff_args"]

#: a relayed HANDOFF's answer held for its window's completion: the grant, and the window closed (complete) or its
#: status (not complete within the bound, or its holder's connection went), or None (the HANDOFF was not relayed)
Completion = tuple[HandoffGrant, WindowClosed | WindowStatus | None]


class Link(Protocol):
    """What the part borrows of its client: the link for one request at a time, and the blocking call."""

    timeout: float

    def claim(self) -> socket.socket | None: ...

    def release(self) -> None: ...

    def send_request(self, op: Op | str, payload: bytes | bytearray | memoryview = b"", *, attached: bool = False,
                     **args: Any) -> None: ...

    def read_answer(self) -> tuple[dict[str, Any] | GpuTravelError, bytes]: ...

    def call(self, op: Op | str, payload: bytes | bytearray | memoryview = b"", *, attached: bool = False,
             **args: Any) -> tuple[dict[str, Any], bytes]: ...


class LoopCaller:
    """``call`` and ``handoff`` over ``client``'s link, from the event loop."""

    def __init__(self, client: Link) -> None:
        self._client = client
        #: cancelled waits whose answers a worker thread read (the link stays held until it has)
        self.drained = 0

    async def call(self, op: Op | str, **args: Any) -> dict[str, Any]:
        """``client.call`` from the event loop with no worker thread, for a small request answered without a
        payload: it is sealed and written at once (a few hundred bytes on an idle socket), the loop's own poller
        wakes when the answer arrives, and it is read then; the loop is free while the device works. Two thread
        crossings fewer than ``asyncio.to_thread(call)`` (issue 34: 0.2-0.7 ms each on a loaded 2-core machine).
        Relies on the link's rule that every answer is read in full before the next request (the reader holds no
        byte now). ``call`` in a worker thread where another thread is mid-request or a rotation is due. A
        cancelled wait hands its answer to a worker thread, which reads it and only then frees the link (the
        channel stays in step; the loop never blocks on the socket); no answer in the client's ``timeout`` is
        ``DeviceError``."""
        client, loop = self._client, asyncio.get_running_loop()
        sock = client.claim()
        if sock is None:
            return (await asyncio.to_thread(client.call, op, **args))[0]
        handed = False
        try:
            client.send_request(op, **args)
            ready: asyncio.Future[None] = loop.create_future()

            def readable() -> None:
                if not ready.done():
                    ready.set_result(None)

            loop.add_reader(sock.fileno(), readable)
            try:
                async with asyncio.timeout(client.timeout):
                    await ready
            except TimeoutError:
                raise DeviceError(f"device link failed: no answer to {op} in {client.timeout:g} s") from None
            except asyncio.CancelledError:
                loop.remove_reader(sock.fileno())
                handed = True
                # a thread of its own (not the loop's executor, which may be shutting down with the loop)
                threading.Thread(target=self._drain, name="device-drain", daemon=True).start()
                raise
            finally:
                if not handed:
                    loop.remove_reader(sock.fileno())
            resp, _ = client.read_answer()
        finally:
            if not handed:
                client.release()
        if isinstance(resp, GpuTravelError):
            raise resp
        return resp

    def _drain(self) -> None:
        """A worker thread's: read the answer a cancelled wait left (a refusal or a broken link included: the link
        closed under it meanwhile is the caller's to see on its next call), then free the link."""
        try:
            with contextlib.suppress(GpuTravelError, OSError, ValueError):
                self._client.read_answer()
            self.drained += 1
        finally:
            self._client.release()

    async def handoff(self, *, epoch: int, offset: int, length: int, chunk_size: int,
                      relay: tuple[str, dict[str, Any]] | None = None) -> HandoffGrant:
        """``client.handoff`` from the event loop: the window's key on a hand-off's critical path."""
        return grant_from(await self.call(Op.HANDOFF, **handoff_args(epoch, offset, length, chunk_size, relay)))

    async def handoff_until_complete(self, *, epoch: int, offset: int, length: int, chunk_size: int,
                                     relay: tuple[str, dict[str, Any]], within: float) -> Completion:
        """``handoff`` with its relayed HANDOFF's answer held by the device until the window is complete (at most
        ``within`` seconds): the grant and the closed window in one answer (``Completion``). The link is held
        meanwhile: every other device call waits behind it, ``within`` at most."""
        head = await self.call(Op.HANDOFF, **handoff_args(epoch, offset, length, chunk_size, relay),
                               when_complete=within)
        closed, status = head.pop("closed", None), head.pop("status", None)
        try:
            end = WindowClosed.from_wire(closed) if closed is not None else \
                WindowStatus.from_wire(status) if status is not None else None
        except FrameError as exc:
            raise DeviceError(f"the device's answer at the window's completion is malformed: {exc.reason}") from None
        return grant_from(head), end


def grant_from(head: dict[str, Any]) -> HandoffGrant:
    """A HANDOFF answer, typed and checked once (a malformed grant is the device's fault: ``DeviceError``)."""
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
