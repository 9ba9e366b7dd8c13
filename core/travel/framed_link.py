"""The orchestrator's end of a holder link: the framed protocol over a pair of asyncio streams.

``FramedSession`` speaks the typed messages of ``core.protocol.holderlink`` with an agent (its HELLO,
each HANDOFF, the agent's progress, refusals and DONE, the farewell BYE). On the direct path only those
travel here (the agent sends its sealed chunks to the device itself); on the channel and conventional
paths it relays the agent's chunks to the device's data port as they are (``_BounceSealer`` seals the
conventional path's plaintext under the hand-off's ``ProvisioningKey`` first).

Every header the agent sends was decoded with ``wirejson``'s size and depth limits and is validated by
its message's ``from_wire``: a malformed or hostile frame is an ``AgentError`` naming the holder (the
visit fails and is charged to it), never an internal error of the run.

The session is a part the links hold (``LocalHolderLink`` over a subprocess's pipes, ``SshHolderLink`` over an SSH
channel), not a base they extend: a link owns its transport and its ``HolderState``; the session owns the
conversation (the agent's HELLO, its attestation nonces and key, the prefetched verdict) and is given the
transport's streams (``attach``), the link's ``kill`` (fault injection) and the errors its writes may raise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from gputravel.core.errors import AgentError, DeviceError, FrameError, GpuTravelError
from gputravel.core.protocol import TAG_LEN, Frame, FrameType, SendState, encode_frame
from gputravel.core.protocol.cipher import RecvState
from gputravel.core.protocol.frames import frame_head, read_frame_async
from gputravel.core.protocol.holderlink import (
    Admission,
    Attest,
    Bye,
    DataEndpoint,
    DataOpen,
    DataReady,
    Done,
    Handoff,
    Hello,
    Progress,
    Refusal,
    Verdict,
)
from gputravel.core.travel.handoff_relay import Early, HandoffRelay
from gputravel.core.travel.holder_attest import HolderAttestor, HolderRefusedError
from gputravel.core.travel.holders import HolderInfo, ProgressFn, ProvisionStats, RejectFn
from gputravel.core.travel.verdict_log import VerdictLog

__all__ = ["STREAM_LIMIT", "Attesting", "FramedLink", "FramedSession"]

#: the largest frame read from an agent or from the device's data port (a chunk frame and its header)
STREAM_LIMIT = 64 * 1024 * 1024

_M = TypeVar("_M", Hello, Progress, Refusal, Done, DataReady, Verdict)


@runtime_checkable
class FramedLink(Protocol):
    """A holder link that speaks to its agent through a ``FramedSession`` (the local and SSH links)."""

    session: FramedSession


@runtime_checkable
class Attesting(Protocol):
    """A link whose agent is started with the attestation files it pins (local agents, the SSH deployer's)."""

    attest_files: tuple[Path, Path] | None


class FramedSession:
    """The framed protocol with one agent over a pair of asyncio streams, with a relay to the device's data port."""

    def __init__(self, name: str, *, transport: str, kill: Callable[[], Awaitable[None]],
                 write_errors: tuple[type[BaseException], ...] = ()) -> None:
        self.name = name
        self.transport = transport  # the links' ``HolderInfo.transport``: "local", "ssh"
        #: the link's fault injection (``kill_after_chunks``), and what a write on its transport raises when the
        #: agent or its session is gone (an ``AgentError`` naming the holder then; none for a local pipe)
        self._kill = kill
        self._write_errors = write_errors
        self.reader: Any = None  # an asyncio.StreamReader, or asyncssh's reader of the agent's stdout
        self.writer: Any = None
        #: Fault injection (tests): sequence numbers whose first transmission is corrupted on the wire,
        #: standing for a malicious host between holder and device.
        self.tamper_on_wire: set[int] = set()
        #: Fault injection (tests): kill the agent once this many chunks were acknowledged.
        self.kill_after_chunks: int | None = None
        self.agent_pid: int | None = None
        #: holders' own attestation (issue 22 item 5): the run's attestor, set by the engine; the agent's nonce
        #: for its next hand-off and its key-exchange key (from HELLO, then each VERDICT; None: it does not
        #: attest); ``on_verdict(holder, verdict)``: the engine's ledger row and report field
        self.attestor: HolderAttestor | None = None
        self.holder_nonce: bytes | None = None
        self.holder_pub: bytes | None = None
        self.on_verdict: Callable[[str, Verdict], None] | None = None
        #: whose evidence policy this link's agent checks against (issue 30): "orchestrator" (it passed the policy:
        #: local agents, the embedded SSH server, managed inventory holders) or "holder" (``managed = false``)
        self.policy_source = "orchestrator"
        self.hello: Hello | None = None  # the agent's last HELLO
        #: the attestation fetched ahead (``prefetch_attestation``): its task while it runs, then (epoch, key
        #: fingerprint, verdict) until the hand-off it was for takes it (or another hand-off discards it)
        self._prefetch: asyncio.Task[None] | None = None
        self._prefetched: tuple[int, str, Verdict] | None = None
        #: the ok verdict of the HANDOFF being sent, logged once it is on its way, and its row being written meanwhile
        self._verdicts = VerdictLog()
        #: the HANDOFF's ways to the agent over its parked data connection (``relays.fn`` set by the engine)
        self.relays = HandoffRelay()

    def attach(self, reader: Any, writer: Any) -> None:
        """The agent's stdout and stdin (a new agent: its HELLO comes next, ``greet``)."""
        self.reader, self.writer = reader, writer
        self.relays.reset()

    async def _read(self) -> Frame:
        assert self.reader is not None
        try:
            frame = await read_frame_async(self.reader, max_payload=STREAM_LIMIT)
        except FrameError as exc:  # oversized, nested too deep, not JSON...: the agent's doing
            raise AgentError(self.name, f"sent a malformed frame: {exc}") from None
        except (ConnectionError, OSError) as exc:
            raise AgentError(self.name, f"link failed: {exc}") from None
        if frame is None:
            raise AgentError(self.name, "the agent closed the link (died or was stopped)")
        return frame

    def _parse(self, cls: type[_M], frame: Frame) -> _M:
        """The agent's message, validated; a malformed one is charged to this holder."""
        try:
            return cls.from_wire(frame.header)
        except FrameError as exc:
            raise AgentError(self.name, f"sent a malformed {frame.type.name}: {exc}") from None

    def _failed(self, frame: Frame) -> AgentError:
        """The agent's ERROR (the hand-off failed on its side) as the error to raise."""
        refusal = self._parse(Refusal, frame)
        return AgentError(self.name, f"{refusal.code}: {refusal.reason}")

    def _send(self, ftype: FrameType, header: dict[str, Any], payload: bytes = b"") -> None:
        """A write on a channel that closed under us is the agent or its session gone: a named error."""
        try:
            self.writer.write(encode_frame(ftype, header, payload))
        except self._write_errors as exc:
            raise AgentError(self.name, f"link failed: {exc or type(exc).__name__}") from None

    async def _drain(self) -> None:
        """Flush to the agent; an agent that died under us is an ``AgentError`` (the visit is redone)."""
        try:
            await self.writer.drain()
        except (OSError, RuntimeError, ConnectionError) as exc:
            raise AgentError(self.name, f"link failed: {exc}") from None

    async def greet(self) -> HolderInfo:
        """The agent's HELLO (its nonce and key kept for attesting), as the link's ``HolderInfo``."""
        frame = await self._read()
        if frame.type is FrameType.ERROR:
            raise self._failed(frame)
        if frame.type is not FrameType.HELLO:
            raise AgentError(self.name, f"expected HELLO, got {frame.type.name}")
        hello = self._parse(Hello, frame)
        self.hello = hello
        self.agent_pid = hello.pid
        self.holder_nonce = bytes.fromhex(hello.nonce) if hello.nonce else None
        self.holder_pub = bytes.fromhex(hello.link_pub) if hello.link_pub else None
        if self.attestor is not None and self.holder_pub is not None:  # the key's wrap, off the hand-off's path
            self.attestor.link_key.prepare(self.holder_pub, self.attestor.run_id.encode())
        self._prefetched = None  # a verdict of an earlier agent counts for nothing
        return HolderInfo.from_hello(self.name, hello, transport=self.transport)

    def prefetch_attestation(self, *, epoch: int, key_fp: str) -> None:
        """ATTEST -> VERDICT for the hand-off of key ``key_fp`` in ``epoch``, now, in the background (the engine
        calls it for the next holder while a visit trains). Nothing of the key goes with it; the hand-off takes
        the verdict only for that very key and epoch (``_attested``), else attests afresh."""
        if self._prefetch is not None and self._prefetch.done() and self._prefetched is not None \
                and self._prefetched[:2] == (epoch, key_fp):
            return  # fetched already (as the visit before trained): its hand-off takes it
        if self._prefetch is not None and self._prefetch.done():
            # an earlier prefetch no hand-off took (its visit failed first, e.g. the device died as the window
            # opened): its verdict is for a key that will never be granted; it must not block this one
            self._prefetch, self._prefetched = None, None
        if self.attestor is None or self.holder_nonce is None or self.holder_pub is None or self._prefetch:
            return
        self._prefetched = None
        task = asyncio.get_running_loop().create_task(self._fetch_verdict(epoch, key_fp))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure is seen by _settle
        self._prefetch = task

    async def _fetch_verdict(self, epoch: int, key_fp: str) -> None:
        assert self.attestor is not None and self.holder_nonce is not None
        msg = await self.attestor.attest_key(epoch=epoch, key_fp=key_fp, holder_nonce=self.holder_nonce)
        self._prefetched = (epoch, key_fp, await self._exchange(msg, epoch))

    async def settle_attestation(self) -> None:
        """Wait for an attestation fetched ahead (the link reads nothing else meanwhile); one that failed
        leaves nothing behind (its hand-off attests afresh, or finds the link broken)."""
        task, self._prefetch = self._prefetch, None
        if task is None:
            return
        await asyncio.wait({task})
        if task.cancelled() or task.exception() is not None:
            self._prefetched = None

    async def _exchange(self, msg: Attest, epoch: int) -> Verdict:
        """Send ATTEST and read the agent's VERDICT for ``epoch`` (its next nonce kept)."""
        self.holder_nonce = None  # spent, whatever happens next
        self._send(FrameType.ATTEST, msg.to_wire(), msg.payload())
        await self._drain()
        while True:
            frame = await self._read()
            if frame.type is FrameType.VERDICT:
                break
            if frame.type is FrameType.ERROR:
                raise self._failed(frame)
            if frame.type is not FrameType.PONG:
                raise AgentError(self.name, f"expected VERDICT, got {frame.type.name}")
        verdict = self._parse(Verdict, frame)
        self.holder_nonce = bytes.fromhex(verdict.next_nonce)
        if verdict.epoch != epoch:
            raise AgentError(self.name, f"VERDICT for epoch {verdict.epoch}, not {epoch}")
        return verdict

    async def _attested(self, handoff: Handoff, stats: ProvisionStats | None = None) -> Handoff:
        """The hand-off as it may go to this agent. An attesting agent first gets ATTEST (the CVM's quote, the
        GPU's evidence under its nonce) and answers VERDICT; only an ok verdict lets the key go, wrapped for it.
        A refusal raises ``HolderRefusedError``: nothing of the key was sent. A verdict fetched ahead for this
        very key and epoch (``prefetch_attestation``) is that exchange, done earlier."""
        pending = self._prefetch is not None and not self._prefetch.done()
        waited_from = time.perf_counter_ns()
        await self.settle_attestation()
        ahead, self._prefetched = self._prefetched, None
        early = self.relays.take(handoff)
        if self.attestor is None or self.holder_pub is None or (self.holder_nonce is None and ahead is None):
            return handoff
        marks = stats.marks_ns if stats is not None else {}
        fp = handoff.key.fingerprint if handoff.key is not None else ""
        if ahead is not None and ahead[:2] == (handoff.epoch, fp):
            verdict = ahead[2]
            # a prefetch still under way when the hand-off came: its rest is waited for, and counted as ``verdict``
            now = time.perf_counter_ns()
            marks["attest_begun"] = marks["attest_sent"] = waited_from if pending else now
            marks["verdict"] = now
            if stats is not None:
                stats.attest_prefetched = True
            if early is not None and verdict.ok:  # wrapped before the window opened, which carried it to the agent
                self._verdicts.pending = verdict
                if stats is not None and early.delivered:
                    stats.relayed, marks["handoff_sent"] = True, now
                return early.outgoing
        else:
            assert self.holder_nonce is not None
            marks["attest_begun"] = time.perf_counter_ns()
            msg: Attest = await self.attestor.attest(handoff, self.holder_nonce)
            marks["attest_sent"] = time.perf_counter_ns()
            verdict = await self._exchange(msg, handoff.epoch)
            marks["verdict"] = time.perf_counter_ns()
        if not verdict.ok:
            if self.on_verdict is not None:
                self.on_verdict(self.name, verdict)
            raise HolderRefusedError(self.name, verdict)
        self._verdicts.pending = verdict  # its ledger row is written once the HANDOFF is on its way
        return self.attestor.seal_key(handoff, self.holder_pub)

    def prepare_handoff(self, handoff: Handoff, *, data_endpoint: DataEndpoint | None) -> Early | None:
        """``handoff`` as it will go to this agent, wrapped before its window opens, for the window's request to
        carry (``HandoffRelay.prepare``): only on an ok verdict fetched ahead for this very epoch and key, which is
        left for the hand-off to take (``_attested``); None otherwise (the hand-off then goes as before)."""
        task, ahead, key = self._prefetch, self._prefetched, handoff.key
        if self.attestor is None or self.holder_pub is None or key is None or task is None or not task.done() \
                or ahead is None or ahead[:2] != (handoff.epoch, key.fingerprint) or not ahead[2].ok:
            return None
        base = self._outgoing(handoff, data_endpoint)
        return self.relays.prepare(base, self.attestor.seal_key(base, self.holder_pub))

    async def _send_handoff(self, outgoing: Handoff, stats: ProvisionStats) -> None:
        """HANDOFF (its key sealed for the attested agent) on its way, relayed by the device too where it may be
        (``HandoffRelay.send``; not again where the window's request carried it); the verdict it was given on is
        logged then, whether sending it worked or not."""
        stats.marks_ns["handoff_write"] = time.perf_counter_ns()
        try:
            if not stats.relayed:
                outgoing, stats.relayed = await self.relays.send(self.name, outgoing)
                if stats.relayed:  # on its way to the agent: the copy below is the record and the fallback
                    stats.marks_ns["handoff_sent"] = time.perf_counter_ns()
            self._send(FrameType.HANDOFF, outgoing.to_wire())
            await self._drain()
            stats.marks_ns.setdefault("handoff_sent", time.perf_counter_ns())
        finally:
            self._verdicts.log(self.name, self.on_verdict)

    def _conventional_opener(self, handoff: Handoff) -> RecvState | None:
        """For an attesting agent, what opens its conventional chunks: they are sealed to this run's CVM under the
        key exchange it attested (issue 30), never plaintext; None for an agent that does not attest."""
        if self.attestor is None or self.holder_pub is None:
            return None
        key = self.attestor.conventional_key(self.holder_pub, handoff.epoch)
        return RecvState(key, session_id=bytes.fromhex(handoff.session_id))

    async def provision(self, handoff: Handoff, *, device_socket: str, on_progress: ProgressFn | None = None,
                        on_reject: RejectFn | None = None,
                        data_endpoint: DataEndpoint | None = None) -> ProvisionStats:
        try:
            stats = await self._provision(handoff, device_socket=device_socket, on_progress=on_progress,
                                          on_reject=on_reject, data_endpoint=data_endpoint)
        except BaseException:
            self.relays.reset()  # a failed hand-off: the agent drops its data connection
            await self._verdicts.logged(failing=True)
            raise
        await self._verdicts.logged()
        return stats

    def _outgoing(self, handoff: Handoff, data_endpoint: DataEndpoint | None) -> Handoff:
        """The hand-off as this link sends it: the run's id with it (the holder's witness is per run), and the
        direct path's data endpoint."""
        if self.attestor is not None:
            handoff = replace(handoff, run_id=self.attestor.run_id)
        return handoff if data_endpoint is None else replace(handoff, data_endpoint=data_endpoint)

    async def _provision(self, handoff: Handoff, *, device_socket: str, on_progress: ProgressFn | None,
                         on_reject: RejectFn | None, data_endpoint: DataEndpoint | None) -> ProvisionStats:
        if data_endpoint is not None:
            return await self._provision_direct(self._outgoing(handoff, data_endpoint), on_progress, on_reject)
        handoff = self._outgoing(handoff, None)
        stats = ProvisionStats()
        try:
            dev_r, dev_w = await asyncio.open_unix_connection(device_socket, limit=STREAM_LIMIT)
        except OSError as exc:
            raise DeviceError(f"cannot open the device data port: {exc}") from None
        try:
            # the relay speaks for this holder's window: admitted with a MAC under the window's key
            admit = None if handoff.key is None else Admission.make(
                handoff.key.key, session_id=bytes.fromhex(handoff.session_id), epoch=handoff.epoch, holder=self.name)
            dev_w.write(encode_frame(FrameType.DATA_OPEN, DataOpen(handoff.session_id, admit=admit).to_wire()))
            ready = await read_frame_async(dev_r, max_payload=STREAM_LIMIT)
            if ready is None or ready.type is not FrameType.DATA_READY:
                raise DeviceError(f"device refused the data connection: {ready.header if ready else 'closed'}")
            try:
                DataReady.from_wire(ready.header)
            except FrameError as exc:
                raise DeviceError(f"the device's DATA_READY is malformed: {exc}") from None
            await self._send_handoff(await self._attested(replace(handoff, data_endpoint=None), stats), stats)
            down = asyncio.create_task(self._device_to_agent(dev_r, stats, on_progress, on_reject))
            # its failure surfaces through _agent_to_device; when the agent side fails first, mark it seen
            down.add_done_callback(lambda t: t.cancelled() or t.exception())
            bounce = _BounceSealer(handoff, self._conventional_opener(handoff)) if handoff.conventional else None
            try:
                done = await self._agent_to_device(dev_w, down, bounce)
            finally:
                down.cancel()
            stats.marks_ns["done"] = time.perf_counter_ns()
            stats.retransmits = done.retransmits
            stats.stages = dict(done.stages)
        finally:
            try:
                dev_w.write(encode_frame(FrameType.BYE, {}))
                dev_w.close()
            except (OSError, RuntimeError):
                pass
        return stats

    async def _provision_direct(self, handoff: Handoff, on_progress: ProgressFn | None,
                                on_reject: RejectFn | None) -> ProvisionStats:
        """The direct path: the agent sends its sealed chunks straight to the device's data port;
        only the hand-off, progress, rejections and DONE travel on this link."""
        stats = ProvisionStats()
        await self._send_handoff(await self._attested(handoff, stats), stats)
        while True:
            frame = await self._read()
            if frame.type is FrameType.ACK:
                progress = self._parse(Progress, frame)
                stats.chunks += progress.chunks
                if on_progress:
                    for _ in range(progress.chunks):
                        on_progress(progress.seq)
            elif frame.type is FrameType.ERROR:
                refusal = self._parse(Refusal, frame)
                if refusal.seq is None:
                    raise AgentError(self.name, f"{refusal.code}: {refusal.reason}")
                stats.rejected[refusal.code] += 1
                if on_reject:
                    on_reject(refusal.seq, refusal.code, refusal.reason)
            elif frame.type is FrameType.DONE:
                done = self._parse(Done, frame)
                stats.marks_ns["done"] = time.perf_counter_ns()
                stats.retransmits = done.retransmits
                stats.stages = dict(done.stages)
                self.relays.parked = handoff.data_endpoint is not None and handoff.data_endpoint.path is not None
                return stats
            elif frame.type is not FrameType.PONG:
                raise AgentError(self.name, f"unexpected {frame.type.name} during provisioning")

    async def _agent_to_device(self, dev_w: Any, down: asyncio.Task[None], bounce: _BounceSealer | None = None
                               ) -> Done:
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
                    frame.header, payload = bounce.seal(self.name, frame.header, payload)
                if seq in self.tamper_on_wire:
                    self.tamper_on_wire.discard(seq)
                    payload = bytearray(payload)
                    payload[len(payload) // 2] ^= 0x01
                dev_w.write(frame_head(FrameType.CHUNK, frame.header, len(payload), max_payload=STREAM_LIMIT))
                dev_w.write(payload)
                await dev_w.drain()
            elif frame.type is FrameType.DONE:
                return self._parse(Done, frame)
            elif frame.type is FrameType.ERROR:
                raise self._failed(frame)
            elif frame.type is FrameType.PONG:
                continue
            else:
                raise AgentError(self.name, f"unexpected {frame.type.name} during provisioning")

    async def _device_to_agent(self, dev_r: asyncio.StreamReader, stats: ProvisionStats,
                               on_progress: ProgressFn | None, on_reject: RejectFn | None) -> None:
        while True:
            try:
                frame = await read_frame_async(dev_r, max_payload=STREAM_LIMIT)
            except FrameError as exc:
                raise DeviceError(f"the device's data connection sent a malformed frame: {exc}") from None
            if frame is None:
                return
            if frame.type is FrameType.ACK:
                stats.chunks += 1
                seq = frame.header.get("s")
                if on_progress and type(seq) is int:
                    on_progress(seq)
            elif frame.type is FrameType.ERROR:
                refusal = _device_refusal(frame.header)
                stats.rejected[refusal.code] += 1
                if on_reject:
                    on_reject(refusal.seq, refusal.code, refusal.reason)
            try:
                self._send(frame.type, frame.header)
                await self.writer.drain()
            except (OSError, RuntimeError, ConnectionError) as exc:  # the agent died under us
                raise AgentError(self.name, f"link failed: {exc}") from None
            if self.kill_after_chunks is not None and stats.chunks >= self.kill_after_chunks:
                self.kill_after_chunks = None
                await self._kill()

    async def stop(self, farewell_head: str | None, farewell_rows: Mapping[int, tuple[tuple[int, str], ...]]) -> None:
        """BYE to the agent (the ledger's head and its visits' rows, for its witness and receipts)."""
        if self._prefetch is not None:  # the agent may be checking evidence: its VERDICT is not waited for
            self._prefetch.cancel()
            self._prefetch = None
        if self.writer is not None:
            try:
                run_id = self.attestor.run_id if self.attestor is not None else None
                self._send(FrameType.BYE, Bye(farewell_head, run_id=run_id, rows=farewell_rows).to_wire())
                await self.writer.drain()
            except (OSError, RuntimeError, ConnectionError):
                pass


def _device_refusal(header: dict[str, Any]) -> Refusal:
    """The device's refusal of a relayed chunk. Its ``s`` echoes the agent's chunk header, which a hostile
    agent chose: a malformed one is the agent's (the refusal still counts, under no sequence number), never
    an error of the device."""
    try:
        return Refusal.from_wire(header)
    except FrameError:
        return Refusal.from_wire({k: header.get(k) for k in ("code", "reason") if isinstance(header.get(k), str)})


class _BounceSealer:
    """The conventional path's CPU re-encryption: plaintext that arrived over the holder's secure link
    is sealed again for the GPU (standing for the CC bounce buffer), in the orchestrator's CVM, under the
    hand-off's ``ProvisioningKey`` (which on this path never leaves the orchestrator)."""

    def __init__(self, handoff: Handoff, opener: RecvState | None = None) -> None:
        if handoff.key is None:
            raise AgentError("conventional", "a conventional hand-off needs its provisioning key here")
        self.state = SendState(handoff.key, session_id=bytes.fromhex(handoff.session_id), start=handoff.resume_from)
        #: an attesting agent's chunks arrive sealed to the CVM (header ``cv``): opened here, then sealed for the GPU
        self.opener = opener
        #: recent ciphertexts by sequence: a retransmitted chunk is resent as sealed, never re-sealed
        #: under a used nonce (bounded like the agent's in-flight window)
        self.recent: dict[int, tuple[dict[str, Any], bytearray]] = {}

    def seal(self, holder: str, header: dict[str, Any], plain: Any) -> tuple[dict[str, Any], bytearray]:
        if self.opener is not None and not header.get("cv"):
            raise AgentError(holder, "an attesting agent sent a conventional chunk not sealed to the CVM")
        if self.opener is None and not header.get("plain"):
            raise AgentError(holder, "expected a plaintext chunk on the conventional path")
        epoch, seq, offset, n = (header.get(k) for k in ("e", "s", "o", "n"))
        if not all(type(v) is int and v >= 0 for v in (epoch, seq, offset, n)):
            raise AgentError(holder, "sent a malformed CHUNK: e, s, o and n must be non-negative integers")
        assert isinstance(seq, int) and isinstance(offset, int) and isinstance(n, int) and isinstance(epoch, int)
        if seq in self.recent:
            return self.recent[seq]
        if self.opener is not None:
            try:
                plain = self.opener.open(plain, seq=seq, epoch=epoch, frame_type=FrameType.CHUNK, offset=offset,
                                         length=n)
            except GpuTravelError as exc:
                raise AgentError(holder, f"a conventional chunk does not open under the CVM's exchange: "
                                         f"{exc.reason}") from None
        if seq != self.state.counter or len(plain) != n:
            raise AgentError(holder, f"plaintext chunk {seq} out of order or of the wrong size")
        out = bytearray(n + TAG_LEN)
        self.state.seal_into(plain, out, frame_type=FrameType.CHUNK, offset=offset, length=n)
        self.recent[seq] = ({"e": epoch, "s": seq, "o": offset, "n": n}, out)
        if len(self.recent) > 256:
            del self.recent[min(self.recent)]
        return self.recent[seq]
