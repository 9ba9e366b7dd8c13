"""Holder links: how the engine reaches a holder's agent.

One interface (``HolderLink``: every member the engine uses) and one set of per-host states
(``HolderState``). ``FramedHolderLink`` speaks the framed protocol over any pair of asyncio streams
and relays ciphertext chunks to the device's data port as they are, without opening them.

The orchestrator is trusted with the holders' keys (holders trust it; see the design's actors): it
holds the session's master secret, from which the device derives every provisioning key, and for each
hand-off it receives that hand-off's provisioning key from the device and forwards it to the holder
inside the encrypted holder link (``Handoff``); on the conventional path it seals the holder's
plaintext under that key itself. What it does not do is open the sealed chunks on the direct and
channel paths, and a key is useless after its holder returns (the device closes the window and
refuses its epoch). ``LocalHolderLink`` runs the agent as a local subprocess over stdin/stdout; the
SSH deployer provides another link over the same interface.
"""

from __future__ import annotations

import asyncio
import sys
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from gputravel.core.errors import AgentError, DeviceError, GpuTravelError, LinkLostError
from gputravel.core.procs import die_with_parent
from gputravel.core.protocol import TAG_LEN, DirectionKey, FrameError, FrameType, SendState, encode_frame
from gputravel.core.protocol.frames import frame_head, read_frame_async

STREAM_LIMIT = 64 * 1024 * 1024


class HolderState(StrEnum):
    """Per-host states of a holder link: connecting -> deploying -> verified -> ready -> provisioning ->
    returned, or failed / offline; stopped when the run lets it go."""

    CONNECTING = "connecting"
    DEPLOYING = "deploying"
    VERIFIED = "verified"
    READY = "ready"
    PROVISIONING = "provisioning"
    RETURNED = "returned"
    FAILED = "failed"
    OFFLINE = "offline"
    STOPPED = "stopped"


#: (holder, state, detail): how a link reports its per-host state to the engine
StateFn = Callable[[str, str, str], None]


@dataclass(frozen=True, slots=True)
class HolderInfo:
    name: str
    fmt: str
    train_bytes: int
    val_bytes: int
    files: int
    agent_sha256: str
    transport: str
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "format": self.fmt, "train_bytes": self.train_bytes, "val_bytes": self.val_bytes,
                "files": self.files, "agent_sha256": self.agent_sha256, "transport": self.transport, **self.detail}


@dataclass(frozen=True, slots=True)
class Handoff:
    """What one holder gets for one visit. ``key`` travels only inside the holder link."""

    epoch: int
    session_id: str
    key: dict[str, Any]
    window_offset: int
    chunk_size: int
    train: tuple[int, int]
    val: tuple[int, int]
    resume_from: int = 0
    skip: int = 0  # this key's window starts at this byte of the visit's window (train slice, then val slice)
    length: int | None = None  # bytes under this key (default: the whole train + val window)
    conventional: bool = False  # the holder sends plaintext over its link; the orchestrator re-encrypts
    ledger_head: str | None = None  # "SEQ:HASH" of the audit ledger at this hand-off, for the holder's witness

    def header(self, data_endpoint: dict[str, Any] | None = None) -> dict[str, Any]:
        h = {"epoch": self.epoch, "session": self.session_id, "window_offset": self.window_offset,
             "chunk_size": self.chunk_size, "train": list(self.train), "val": list(self.val),
             "resume_from": self.resume_from, "skip": self.skip,
             "length": self.length if self.length is not None else self.train[1] + self.val[1]}
        if self.conventional:
            h["plain"] = True  # no GPU key leaves the orchestrator on the conventional path
        else:
            h["key"] = self.key
        if data_endpoint is not None:
            h["data_endpoint"] = data_endpoint
        if self.ledger_head is not None:
            h["ledger_head"] = self.ledger_head
        return h

    def __repr__(self) -> str:  # never the key
        return f"Handoff(epoch={self.epoch}, window={self.window_offset}+{self.train[1] + self.val[1]})"


@dataclass(slots=True)
class ProvisionStats:
    nbytes: int = 0
    chunks: int = 0
    retransmits: int = 0
    seconds: float = 0.0
    rejected: Counter[str] = field(default_factory=Counter)
    #: the agent's own seconds per stage of this hand-off (``read_seal_s``, ``wait_s``), from its DONE
    stages: dict[str, float] = field(default_factory=dict)


def _stages(done: dict[str, Any]) -> dict[str, float]:
    """The agent's stage times from its DONE header (numbers only; anything else is dropped)."""
    raw = done.get("stages")
    if not isinstance(raw, dict):
        return {}
    return {str(k): float(v) for k, v in raw.items() if type(v) in (int, float)}


ProgressFn = Callable[[int], None]
RejectFn = Callable[[int | None, str, str], None]


class HolderLink(ABC):
    """How the engine reaches one holder: start its agent, provision a hand-off, resume after a dropped
    link, close; ``on_state`` reports its ``HolderState`` changes."""

    name: str
    #: "SEQ:HASH" of the ledger when the run lets the holder go: sent with the farewell, for its witness
    farewell_head: str | None = None
    #: the engine's callback for per-host state changes (set by the engine when the link has none)
    on_state: StateFn | None = None
    #: how often a dropped link may be re-established within one hand-off (0: it cannot reconnect)
    max_reconnects: int = 0

    @abstractmethod
    async def start(self) -> HolderInfo: ...

    @abstractmethod
    async def provision(self, handoff: Handoff, *, device_socket: str, on_progress: ProgressFn | None = None,
                        on_reject: RejectFn | None = None,
                        data_endpoint: dict[str, Any] | None = None) -> ProvisionStats: ...

    @abstractmethod
    async def close(self) -> None: ...

    async def reconnect(self) -> HolderInfo:
        """Re-establish a dropped link and restart the agent (links with ``max_reconnects > 0``)."""
        raise LinkLostError(self.name, "this link cannot reconnect")

    @property
    def ready(self) -> bool:
        """Verified-ready: the agent this link verified is still there and waiting. The engine hands a key
        (opens a provisioning window) only to a holder that is ready."""
        return True

    async def ensure_ready(self) -> HolderInfo | None:
        """Bring a holder that is not :attr:`ready` back (restart, or reconnect with backoff and verify the
        agent again), or raise ``AgentError``; the new agent's ``HolderInfo`` (None: nothing changed)."""
        return None

    async def kill(self) -> None:
        """Fault injection: the agent dies."""
        raise NotImplementedError


class FramedHolderLink(HolderLink):
    """The framed protocol over asyncio streams, with a relay to the device's data port."""

    transport = "stream"

    def __init__(self, name: str) -> None:
        self.name = name
        self.reader: asyncio.StreamReader | None = None
        self.writer: Any = None
        self.info: HolderInfo | None = None
        #: Fault injection (tests): sequence numbers whose first transmission is corrupted on the wire,
        #: standing for a malicious host between holder and device.
        self.tamper_on_wire: set[int] = set()
        #: Fault injection (tests): kill the agent once this many chunks were acknowledged.
        self.kill_after_chunks: int | None = None
        self.agent_pid: int | None = None
        #: per-host state (connecting -> ... -> ready -> provisioning -> returned / failed / offline) and the
        #: engine's callback for it: (holder, state, detail)
        self.state: str = HolderState.OFFLINE
        self.state_detail = ""
        self.on_state = None

    def set_state(self, state: str, detail: str = "") -> None:
        self.state, self.state_detail = state, detail
        if self.on_state is not None:
            self.on_state(self.name, state, detail)

    async def _read(self) -> Any:
        assert self.reader is not None
        try:
            frame = await read_frame_async(self.reader, max_payload=STREAM_LIMIT)
        except (FrameError, ConnectionError, OSError) as exc:
            raise AgentError(self.name, f"link failed: {exc}") from None
        if frame is None:
            raise AgentError(self.name, "the agent closed the link (died or was stopped)")
        return frame

    def _send(self, ftype: FrameType, header: dict[str, Any], payload: bytes = b"") -> None:
        self.writer.write(encode_frame(ftype, header, payload))

    async def _drain(self) -> None:
        """Flush to the agent; an agent that died under us is an ``AgentError`` (the visit is redone)."""
        try:
            await self.writer.drain()
        except (OSError, RuntimeError, ConnectionError) as exc:
            raise AgentError(self.name, f"link failed: {exc}") from None

    async def _hello(self) -> HolderInfo:
        frame = await self._read()
        if frame.type is FrameType.ERROR:
            raise AgentError(self.name, f"{frame.header.get('code')}: {frame.header.get('reason')}")
        if frame.type is not FrameType.HELLO:
            raise AgentError(self.name, f"expected HELLO, got {frame.type.name}")
        h = frame.header
        try:
            info = HolderInfo(name=self.name, fmt=str(h["format"]), train_bytes=int(h["train_bytes"]),
                              val_bytes=int(h["val_bytes"]), files=int(h["files"]),
                              agent_sha256=str(h["agent_sha256"]), transport=self.transport)
        except (KeyError, TypeError, ValueError) as exc:
            raise AgentError(self.name, f"malformed HELLO: {exc}") from None
        if info.fmt not in ("byte", "u16"):
            raise AgentError(self.name, f"unknown token format {info.fmt!r}")
        self.info = info
        self.agent_pid = h.get("pid")
        return info

    async def provision(self, handoff: Handoff, *, device_socket: str, on_progress: ProgressFn | None = None,
                        on_reject: RejectFn | None = None,
                        data_endpoint: dict[str, Any] | None = None) -> ProvisionStats:
        if data_endpoint is not None:
            return await self._provision_direct(handoff, data_endpoint, on_progress, on_reject)
        stats = ProvisionStats()
        t0 = time.perf_counter()
        try:
            dev_r, dev_w = await asyncio.open_unix_connection(device_socket, limit=STREAM_LIMIT)
        except OSError as exc:
            raise DeviceError(f"cannot open the device data port: {exc}") from None
        try:
            dev_w.write(encode_frame(FrameType.DATA_OPEN, {"session": handoff.session_id}))
            ready = await read_frame_async(dev_r, max_payload=STREAM_LIMIT)
            if ready is None or ready.type is not FrameType.DATA_READY:
                raise DeviceError(f"device refused the data connection: {ready.header if ready else 'closed'}")
            self._send(FrameType.HANDOFF, handoff.header(None))
            await self._drain()
            down = asyncio.create_task(self._device_to_agent(dev_r, stats, on_progress, on_reject))
            # its failure surfaces through _agent_to_device; when the agent side fails first, mark it seen
            down.add_done_callback(lambda t: t.cancelled() or t.exception())
            bounce = _BounceSealer(handoff) if handoff.conventional else None
            try:
                done = await self._agent_to_device(dev_w, down, bounce)
            finally:
                down.cancel()
            stats.retransmits = int(done.get("retransmits", 0))
            stats.stages = _stages(done)
        finally:
            try:
                dev_w.write(encode_frame(FrameType.BYE, {}))
                dev_w.close()
            except (OSError, RuntimeError):
                pass
        stats.seconds = time.perf_counter() - t0
        return stats

    async def _provision_direct(self, handoff: Handoff, endpoint: dict[str, Any], on_progress: ProgressFn | None,
                                on_reject: RejectFn | None) -> ProvisionStats:
        """The direct path: the agent sends its sealed chunks straight to the device's data port;
        only the hand-off, progress, rejections and DONE travel on this link."""
        stats = ProvisionStats()
        t0 = time.perf_counter()
        self._send(FrameType.HANDOFF, handoff.header(endpoint))
        await self._drain()
        while True:
            frame = await self._read()
            if frame.type is FrameType.ACK:
                n = int(frame.header.get("n", 1))
                stats.chunks += n
                if on_progress:
                    for _ in range(n):
                        on_progress(int(frame.header.get("s", 0)))
            elif frame.type is FrameType.ERROR and frame.header.get("s") is not None:
                code = str(frame.header.get("code"))
                stats.rejected[code] += 1
                if on_reject:
                    on_reject(frame.header.get("s"), code, str(frame.header.get("reason")))
            elif frame.type is FrameType.DONE:
                stats.retransmits = int(frame.header.get("retransmits", 0))
                stats.stages = _stages(frame.header)
                stats.seconds = time.perf_counter() - t0
                return stats
            elif frame.type is FrameType.ERROR:
                raise AgentError(self.name, f"{frame.header.get('code')}: {frame.header.get('reason')}")
            elif frame.type is not FrameType.PONG:
                raise AgentError(self.name, f"unexpected {frame.type.name} during provisioning")

    async def _agent_to_device(self, dev_w: Any, down: asyncio.Task[None], bounce: _BounceSealer | None = None
                               ) -> dict[str, Any]:
        while True:
            read = asyncio.ensure_future(self._read())
            await asyncio.wait({read, down}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                read.cancel()
                down.result()  # raises the device side's error
                raise DeviceError("the device closed the data connection during provisioning")
            frame = read.result()
            if frame.type is FrameType.CHUNK:
                payload = frame.payload
                seq = frame.header.get("s")
                if bounce is not None:  # conventional path: re-encrypt on the orchestrator's CPU
                    frame.header, payload = bounce.seal(frame.header, payload)
                if seq in self.tamper_on_wire:
                    self.tamper_on_wire.discard(seq)
                    payload = bytearray(payload)
                    payload[len(payload) // 2] ^= 0x01
                dev_w.write(frame_head(FrameType.CHUNK, frame.header, len(payload), max_payload=STREAM_LIMIT))
                dev_w.write(payload)
                await dev_w.drain()
            elif frame.type is FrameType.DONE:
                return dict(frame.header)
            elif frame.type is FrameType.ERROR:
                raise AgentError(self.name, f"{frame.header.get('code')}: {frame.header.get('reason')}")
            elif frame.type is FrameType.PONG:
                continue
            else:
                raise AgentError(self.name, f"unexpected {frame.type.name} during provisioning")

    async def _device_to_agent(self, dev_r: asyncio.StreamReader, stats: ProvisionStats,
                               on_progress: ProgressFn | None, on_reject: RejectFn | None) -> None:
        while True:
            frame = await read_frame_async(dev_r, max_payload=STREAM_LIMIT)
            if frame is None:
                return
            if frame.type is FrameType.ACK:
                stats.chunks += 1
                if on_progress:
                    on_progress(int(frame.header["s"]))
            elif frame.type is FrameType.ERROR:
                code = str(frame.header.get("code"))
                stats.rejected[code] += 1
                if on_reject:
                    on_reject(frame.header.get("s"), code, str(frame.header.get("reason")))
            try:
                self._send(frame.type, frame.header)
                await self.writer.drain()
            except (OSError, RuntimeError, ConnectionError) as exc:  # the agent died under us
                raise AgentError(self.name, f"link failed: {exc}") from None
            if self.kill_after_chunks is not None and stats.chunks >= self.kill_after_chunks:
                self.kill_after_chunks = None
                await self.kill()

    async def stop(self) -> None:
        if self.writer is not None:
            try:
                self._send(FrameType.BYE, {"ledger_head": self.farewell_head} if self.farewell_head else {})
                await self.writer.drain()
            except (OSError, RuntimeError, ConnectionError):
                pass


class _BounceSealer:
    """The conventional path's CPU re-encryption: plaintext that arrived over the holder's secure link
    is sealed again for the GPU (standing for the CC bounce buffer), in the orchestrator's CVM."""

    def __init__(self, handoff: Handoff) -> None:
        self.state = SendState(DirectionKey.from_wire(handoff.key), session_id=bytes.fromhex(handoff.session_id),
                               start=handoff.resume_from)
        #: recent ciphertexts by sequence: a retransmitted chunk is resent as sealed, never re-sealed
        #: under a used nonce (bounded like the agent's in-flight window)
        self.recent: dict[int, tuple[dict[str, Any], bytearray]] = {}

    def seal(self, header: dict[str, Any], plain: Any) -> tuple[dict[str, Any], bytearray]:
        if not header.get("plain"):
            raise AgentError("conventional", "expected a plaintext chunk on the conventional path")
        seq, offset, n = int(header["s"]), int(header["o"]), int(header["n"])
        if seq in self.recent:
            return self.recent[seq]
        if seq != self.state.counter or len(plain) != n:
            raise AgentError("conventional", f"plaintext chunk {seq} out of order or of the wrong size")
        out = bytearray(n + TAG_LEN)
        self.state.seal_into(plain, out, frame_type=FrameType.CHUNK, offset=offset, length=n)
        self.recent[seq] = ({"e": header["e"], "s": seq, "o": offset, "n": n}, out)
        if len(self.recent) > 256:
            del self.recent[min(self.recent)]
        return self.recent[seq]


class LocalHolderLink(FramedHolderLink):
    """The agent as a local subprocess on stdin/stdout (``python -m gputravel.agents.holder``)."""

    transport = "local"

    def __init__(self, name: str, data_dir: Path, *, val_fraction: float = 0.1, python: str | None = None,
                 witness: Path | None = None) -> None:
        super().__init__(name)
        self.data_dir = Path(data_dir)
        self.val_fraction = val_fraction
        self.python = python or sys.executable
        self.witness = witness  # the agent appends the ledger head of each hand-off here
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> HolderInfo:
        self.set_state(HolderState.CONNECTING, "local subprocess")
        try:
            self.proc = await asyncio.create_subprocess_exec(
                self.python, "-m", "gputravel.agents.holder", "--name", self.name, "--data", str(self.data_dir),
                "--val-fraction", str(self.val_fraction),
                *(("--witness", str(self.witness)) if self.witness is not None else ()), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, limit=STREAM_LIMIT,
                preexec_fn=die_with_parent)
        except OSError as exc:
            raise AgentError(self.name, f"cannot start the agent: {exc}") from None
        self.reader, self.writer = self.proc.stdout, self.proc.stdin
        try:
            info = await self._hello()
        except GpuTravelError as exc:
            self.set_state(HolderState.FAILED, exc.reason)
            await self.close()
            raise
        self.set_state(HolderState.READY, info.agent_sha256[:16])
        return info

    async def provision(self, handoff: Handoff, *, device_socket: str, on_progress: ProgressFn | None = None,
                        on_reject: RejectFn | None = None,
                        data_endpoint: dict[str, Any] | None = None) -> ProvisionStats:
        self.set_state(HolderState.PROVISIONING, f"epoch {handoff.epoch}")
        try:
            stats = await super().provision(handoff, device_socket=device_socket, on_progress=on_progress,
                                            on_reject=on_reject, data_endpoint=data_endpoint)
        except GpuTravelError as exc:
            self.set_state(HolderState.FAILED, exc.reason)
            raise
        self.set_state(HolderState.RETURNED, f"epoch {handoff.epoch}")
        return stats

    @property
    def ready(self) -> bool:
        """The agent answered HELLO, is still running and did not fail a transfer."""
        return (self.proc is not None and self.proc.returncode is None and self.info is not None
                and self.state not in (HolderState.FAILED, HolderState.STOPPED, HolderState.PROVISIONING))

    async def ensure_ready(self) -> HolderInfo | None:
        """A local agent that died while waiting is marked offline and started again."""
        if self.ready:
            return None
        if self.state not in (HolderState.OFFLINE, HolderState.FAILED):
            rc = self.proc.returncode if self.proc is not None else None
            self.set_state(HolderState.OFFLINE, f"agent exited while waiting (status {rc})")
        await self.close()
        return await self.start()

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    async def close(self) -> None:
        if self.proc is None:
            return
        if self.state not in (HolderState.FAILED, HolderState.OFFLINE):
            self.set_state(HolderState.STOPPED)
        if self.proc.returncode is None:
            await self.stop()
            try:
                if self.writer is not None:
                    self.writer.close()
                await asyncio.wait_for(self.proc.wait(), 5)
            except (TimeoutError, OSError, RuntimeError, ConnectionError):
                self.proc.kill()
                await self.proc.wait()
