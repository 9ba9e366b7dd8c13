"""One hand-off on the agent's side: seal the window's chunks and send them, on the direct path (the
agent's own data connection to the device, through a shared-memory ring or in socket frames) or over the
holder link itself (the channel and conventional paths), with acknowledgements, retransmission of refused
chunks and progress reports; ``Done`` at the end.

Nothing is allocated per chunk or per hand-off: the send slots, the gather buffer, the sender thread and
the data connection live as long as the agent."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gputravel.agents.holder.dataconn import DataConn, DataLinkLost, RingOffer
from gputravel.agents.holder.dataset import Dataset
from gputravel.agents.holder.link import AgentLink, Message, Sender
from gputravel.agents.holder.ring_bind import open_ring
from gputravel.core.protocol import TAG_LEN, FrameType, SendState
from gputravel.core.protocol.errors import (
    DataError,
    FrameError,
    GpuTravelError,
    HolderLinkError,
    error_from_code,
)
from gputravel.core.protocol.holderlink import (
    MAX_CHUNK,
    Admission,
    DataEndpoint,
    Done,
    Handoff,
    Progress,
    Refusal,
)
from gputravel.core.protocol.shmring import MAX_RING_BYTES, RingSpec, ShmRing

__all__ = ["MAX_CHUNK", "MAX_IN_FLIGHT", "MAX_RETRANSMITS", "REPORT_EVERY_NS", "RING_SLOTS", "ChunkOut",
           "Provisioner"]

#: chunks in flight on a socket (the TCP data port crosses machines: room for the bandwidth-delay product)
MAX_IN_FLIGHT = 32
#: slots of a shared-memory ring: few enough that the ring stays in the CPU's cache between the agent's
#: seal and the device's open (8 MiB at 1 MiB chunks); measured on the 2-core build machine, 6-8 slots with
#: acknowledgements in batches of half the ring beat 32 slots by about a fifth (docs/provisioning.md)
RING_SLOTS = 8
MAX_RETRANSMITS = 3
#: on the direct path, acknowledgements are summed up for the orchestrator at most this often (and at the end):
#: each report crosses its link (an SSH channel), which costs more CPU than sealing a chunk
REPORT_EVERY_NS = 50_000_000


@dataclass
class ChunkOut:
    """Where one hand-off's sealed chunks go: the slots they are sealed into (slot ``k`` holds a chunk
    until it is acknowledged or refused, so a refused one is resent as is) and ``send(head, ct, slot)``."""

    slots: list[memoryview]
    send: Callable[[dict[str, Any], memoryview, int], None]


class Provisioner:
    """The agent's provisioning machinery (``Agent`` adds the run loop): ``provision(handoff)`` seals and
    sends one hand-off's window. Frames from the orchestrator and the data connection arrive in ``_inbox``."""

    def __init__(self, name: str, data: Dataset, link: AgentLink) -> None:
        self.name, self.data, self.link = name, data, link
        self._inbox: queue.Queue[Any] = queue.Queue()
        # Long-lived: the send slots (allocated on the first hand-off, regrown only for a larger chunk size),
        # the gather buffer for a chunk that spans two files, the sender thread and the data connection.
        self._slots: list[bytearray] = []
        self._scratch = bytearray()
        self._sender = Sender(self._inbox)
        self._data: DataConn | None = None
        self.slot_allocations = 0  # how many times the slots were (re)allocated: once per agent, not per hand-off
        #: perf_counter_ns when the current HANDOFF was read (its set-up stage time starts there; 0: not yet), its
        #: key was taken (unwrapped by an attesting agent) and its data connection's admission was on its way
        self.handoff_read_ns = 0
        #: this process's CPU time (all its threads) when the current HANDOFF was read (``Done.stages["cpu_s"]``)
        self.handoff_cpu_ns = 0
        self.key_taken_ns = 0
        self.admit_sent_ns = 0

    def send(self, ftype: FrameType, header: dict[str, Any], payload: bytes | bytearray | memoryview = b"") -> None:
        self.link.send(ftype, header, payload)

    def send_msg(self, msg: Message) -> None:
        self.link.send_msg(msg)

    # --- the window's bytes -----------------------------------------------------------------------
    def _window_into(self, h: Handoff, start: int, out: memoryview) -> None:
        """Fill ``out`` with window bytes [start, start + len(out)): the train slice, then the val slice."""
        t0, tn = h.train
        v0, _vn = h.val
        n = len(out)
        done = 0
        if start < tn:
            take = min(n, tn - start)
            self.data.train.readinto(t0 + start, out[:take])
            start, done = start + take, take
        if done < n:
            self.data.val.readinto(v0 + start - tn, out[done:])

    def _window_view(self, h: Handoff, start: int, n: int) -> memoryview:
        """Window bytes [start, start + n) as a view of the file mapping where they lie in one file of one
        slice (no copy), else gathered into the agent's one scratch buffer."""
        t0, tn = h.train
        v0, _vn = h.val
        view = None
        if start + n <= tn:
            view = self.data.train.view(t0 + start, n)
        elif start >= tn:
            view = self.data.val.view(v0 + start - tn, n)
        if view is not None:
            return view
        if len(self._scratch) < n:
            self._scratch = bytearray(n)
        out = memoryview(self._scratch)[:n]
        self._window_into(h, start, out)
        return out

    def _slot_views(self, count: int, size: int) -> list[memoryview]:
        """``count`` send slots of ``size`` bytes from the agent's long-lived pool."""
        if self._slots and len(self._slots[0]) < size:
            self._slots = []  # a larger chunk size than any before: the only time slots are replaced
        if len(self._slots) < count:
            self.slot_allocations += 1
            self._slots += [bytearray(max(size, len(self._slots[0]) if self._slots else size))
                            for _ in range(count - len(self._slots))]
        return [memoryview(b)[:size] for b in self._slots[:count]]

    # --- the data connection ----------------------------------------------------------------------
    def _data_conn(self, endpoint: DataEndpoint, h: Handoff, ring: RingSpec | None) -> tuple[DataConn, ShmRing | None]:
        """The data connection for this hand-off's window, admitted with a MAC under its key, and its ring
        (or None: chunks go in frames). The connection is kept across hand-offs with the same device session:
        the device admits it for nothing at RETURN, so each hand-off admits it again for its own window (no
        round trip: the device reads the connection in order); a new one gets its ring with its admission."""
        session = bytes.fromhex(h.session_id)
        assert h.key is not None
        admit = Admission.make(h.key.key, session_id=session, epoch=h.epoch, holder=self.name)
        key = (endpoint, session)
        conn = self._data
        if conn is not None and (conn.key != key or conn.dead):
            self._drop_data()
            conn = None
        if conn is None:
            conn = self._data = DataConn(endpoint, session, self._inbox, key=key, admit=admit, ring=ring)
            conn.active = True
            return conn, conn.ring
        conn.active = True
        if ring is not None and conn.rings:
            return conn, open_ring(conn, ring, admit, self._inbox, name=self.name, send=self.send)
        conn.readmit(admit)
        return conn, None

    def _drop_data(self) -> None:
        if self._data is not None:
            self._data.close()
            self._data = None

    # --- one hand-off -----------------------------------------------------------------------------
    def provision(self, h: Handoff) -> None:
        """One hand-off: seal the window's chunks and send them (direct path, ring or frames, or this link).
        ``h`` was validated by ``Handoff.from_wire`` (its window, chunk size, resume point and key)."""
        if h.train[0] + h.train[1] > self.data.train.length or h.val[0] + h.val[1] > self.data.val.length:
            raise DataError("hand-off asks for bytes beyond this holder's dataset")
        self.data.train.check()
        self.data.val.check()
        # conventional path: no GPU key here. An attesting agent seals to the attested CVM (``key``: the key its
        # exchange with the CVM derived, issue 30); only a managed agent that does not attest sends plaintext on its
        # (SSH-encrypted) link, as before
        key = h.key
        if key is None and not h.conventional:
            raise FrameError("HANDOFF carries no key")
        session = bytes.fromhex(h.session_id)
        cs, total, n_chunks, start = h.chunk_size, h.window_len, h.n_chunks, h.resume_from
        sender = SendState(key, session_id=session, start=start) if key is not None else None
        endpoint = h.data_endpoint
        in_flight = min(MAX_IN_FLIGHT, n_chunks - start) or 1
        conn = ring = None
        out: ChunkOut | None = None
        try:
            if endpoint is not None:
                spec = None
                if sender is not None and endpoint.ring:
                    slots = max(1, min(in_flight, RING_SLOTS, MAX_RING_BYTES // (cs + TAG_LEN)))
                    spec = RingSpec(h.epoch, slots, cs + TAG_LEN)
                conn, ring = self._data_conn(endpoint, h, spec)
                self.admit_sent_ns = time.perf_counter_ns()
            if ring is not None and conn is not None:
                out = ChunkOut(conn.ring_slots, conn.notify)
            elif conn is not None:
                c = conn
                out = ChunkOut(self._slot_views(in_flight, cs + TAG_LEN),
                               lambda head, ct, _slot: self._sender.submit(c.send, head, ct))
            else:
                out = ChunkOut(self._slot_views(in_flight, cs + TAG_LEN),
                               lambda head, ct, _slot: self._sender.submit(self.send, FrameType.CHUNK, head, ct))
            self._provision_loop(h, sender, out, conn is not None, epoch=h.epoch, base=h.window_offset, cs=cs,
                                 total=total, n_chunks=n_chunks, start=start, skip=h.skip)
        except BaseException:
            if conn is not None:  # a failed hand-off leaves nothing behind: a fresh connection next time
                self._drop_data()
            raise
        finally:
            self._sender.drain()  # no write may still read a slot when the next hand-off reuses it
            if conn is not None:
                conn.active = False
                if conn.awaiting is not None:  # a bind never answered: its answer must not meet the next one
                    self._drop_data()

    def _provision_loop(self, h: Handoff, sender: SendState | None, out: ChunkOut, direct: bool, *,
                        epoch: int, base: int, cs: int, total: int, n_chunks: int, start: int,
                        skip: int = 0) -> None:
        # Each chunk is sealed straight from the file mapping into a free slot (encrypt_into: the one pass
        # over the bytes), then handed to the link: a sender thread writes it while the next one is sealed
        # (or, with a shared-memory ring, only the slot id crosses the socket). A chunk stays in its slot
        # until acknowledged; then the slot is reused. Nothing is allocated per chunk or per hand-off.
        free = list(range(len(out.slots)))
        sealed: dict[int, tuple[dict[str, Any], memoryview, int]] = {}
        acked: set[int] = set(range(start))
        retransmits = 0
        unreported = 0
        seq = start
        clock = time.perf_counter_ns
        cpu = time.thread_time_ns
        seal_ns = wait_ns = seal_cpu_ns = 0
        last_ack_ns = 0  # when the acknowledgement that completed the window was read
        reported_last = -1
        begun = clock()
        reported_at = begun - REPORT_EVERY_NS  # the first acknowledgement is reported at once, the last with DONE
        while len(acked) < n_chunks:
            while seq < n_chunks and free:
                t0 = clock()
                lo = seq * cs
                n = min(cs, total - lo)
                slot = free.pop()
                head: dict[str, Any] = {"e": epoch, "s": seq, "o": base + lo, "n": n}
                if direct:  # the device may acknowledge in batches, and must flush them before this agent waits
                    head["f"] = 1 if seq == n_chunks - 1 or not free else 0
                if sender is None:  # conventional path: plaintext rides the (SSH-encrypted) link, read into its slot
                    ct = out.slots[slot][:n]
                    self._window_into(h, skip + lo, ct)
                    head["plain"] = 1
                else:
                    ct = out.slots[slot][: n + TAG_LEN]
                    c0 = cpu()
                    got = sender.seal_into(self._window_view(h, skip + lo, n), ct, frame_type=FrameType.CHUNK,
                                           offset=base + lo, length=n)
                    seal_cpu_ns += cpu() - c0
                    assert got == seq
                    if h.conventional:
                        head["cv"] = 1  # sealed to the CVM, not for the GPU: the orchestrator opens and re-seals it
                sealed[seq] = (head, ct, slot)
                seal_ns += clock() - t0
                out.send(head, ct, slot)
                seq += 1
            t0 = clock()
            frame = self._inbox.get()
            wait_ns += clock() - t0
            if isinstance(frame, DataLinkLost) and frame.conn is not self._data:
                continue  # a data connection of an earlier hand-off
            if isinstance(frame, GpuTravelError):
                raise frame
            if frame is None or isinstance(frame, Exception):
                self._inbox.put(frame)  # the main loop must see the end of the link too, or it waits forever
                raise GpuTravelError("link closed during provisioning")
            if isinstance(frame, RingOffer):
                frame.conn.confirm_ring(frame)  # the answer to this hand-off's bind (or one not asked for)
                continue
            if frame.type is FrameType.ACK:
                batch = frame.header.get("batch")  # the direct path's batched acknowledgements: a list of seqs
                fresh = 0
                last = -1
                for s in batch if isinstance(batch, list) else (frame.header.get("s"),):
                    if type(s) is not int or s in acked or s >= seq:
                        continue  # a duplicate, or an acknowledgement of nothing sent: ignored
                    acked.add(s)
                    if s in sealed:
                        free.append(sealed.pop(s)[2])
                    fresh += 1
                    last = max(last, s)
                if direct and fresh:  # progress for the orchestrator, at most every REPORT_EVERY_NS (slow link)
                    unreported += fresh
                    now = clock()
                    if now - reported_at >= REPORT_EVERY_NS and len(acked) < n_chunks:
                        self.send_msg(Progress(last, unreported))
                        unreported, reported_at = 0, now
                    reported_last = last
                if len(acked) == n_chunks:
                    last_ack_ns = clock()
            elif frame.type is FrameType.ERROR:
                refusal = Refusal.from_wire(frame.header)
                if refusal.ring:  # the answer to a bind not waited for
                    text = f"the device refused this hand-off's ring: {refusal.reason}"
                    raise error_from_code(refusal.code, text) if refusal.code else HolderLinkError(text)
                s = refusal.seq
                if s is None:
                    continue
                if direct:
                    self.send_msg(refusal)
                if refusal.code == "replay":  # already in the buffer: an acknowledgement was lost
                    if s in sealed:
                        acked.add(s)
                        free.append(sealed.pop(s)[2])
                    continue
                if s not in sealed or retransmits >= MAX_RETRANSMITS * n_chunks or refusal.code in (
                        "stale-epoch", "window"):
                    raise error_from_code(refusal.code, f"chunk {s} refused: {refusal.reason}")
                retransmits += 1
                head, ct, slot = sealed[s]
                if direct:
                    head["f"] = 1  # the agent waits for this one's answer: no acknowledgement may be held back
                out.send(head, ct, slot)
            elif frame.type is FrameType.BYE:
                raise GpuTravelError("orchestrator ended the hand-off")
            elif frame.type is FrameType.PING:
                self.send(FrameType.PONG, frame.header)
        # the last progress report and DONE leave in one write. Stage times for ``bench provision``: reading
        # and sealing, waiting for slots to be acknowledged, and the data phase (first seal to last
        # acknowledgement) within the agent's whole hand-off (HANDOFF read to DONE written)
        now = clock()
        read = self.handoff_read_ns or begun
        stages = {"read_seal_s": seal_ns / 1e9, "wait_s": wait_ns / 1e9, "setup_s": (begun - read) / 1e9,
                  "data_s": (now - begun) / 1e9, "seal_cpu_s": seal_cpu_ns / 1e9}
        # CPU seconds this process (every thread) spent on the hand-off, HANDOFF read to DONE built, and the part
        # of it in the seal calls (reading the window's pages and AES-GCM): what ``bench provision`` accounts
        if self.handoff_cpu_ns:
            stages["cpu_s"] = (time.process_time_ns() - self.handoff_cpu_ns) / 1e9
        # the agent's part of the hand-off's fixed stages (``handoff.fixed_stages``): HANDOFF read to its key taken
        # and to its data connection's admission sent; the last acknowledgement read to DONE built
        if self.key_taken_ns >= read:
            stages["take_key_s"] = (self.key_taken_ns - read) / 1e9
        if direct and self.admit_sent_ns >= read:
            stages["admit_sent_s"] = (self.admit_sent_ns - read) / 1e9
        if last_ack_ns:
            stages["ack_to_done_s"] = (clock() - last_ack_ns) / 1e9
        done = Done(epoch=epoch, chunks=n_chunks - start, nbytes=total, retransmits=retransmits, stages=stages)
        msgs: list[Message] = [done]
        if direct and unreported:
            msgs.insert(0, Progress(reported_last, unreported))
        self.link.send_all(msgs)
