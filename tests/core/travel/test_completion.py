"""core/travel/completion.py against a real device service and server in this process: the window's request that
carries the HANDOFF, answered at the window's completion, and what follows on the holder link. The holder link is
``ScriptedLink``, a fake that isolates this unit: its agent's side is real (the parked data connection, the relayed
HANDOFF read on it, the re-admission, sealed chunks into the device), its holder link only a script (DONE late, or
the link lost after the last chunk, or mid-window)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from dataclasses import replace
from typing import Any

from helpers import ConnectedDevice

from gputravel.core.errors import LinkLostError
from gputravel.core.protocol import TAG_LEN, Direction, FrameType, SendState, encode_frame, provisioning_key
from gputravel.core.protocol.deviceanswers import WindowStatus
from gputravel.core.protocol.holderlink import Admission, DataEndpoint, Handoff, ProvisioningKey
from gputravel.core.protocol.keys import DirectionKey
from gputravel.core.protocol.shmring import recv_frame_with_fds
from gputravel.core.travel import completion
from gputravel.core.travel.handoff_relay import Early
from gputravel.core.travel.holders import ProvisionStats

CHUNK = 256
N = 4


class ScriptedLink:
    """A fake holder link (isolates completion.py), its agent's data connection real. ``script``: ``"late-done"``
    (every chunk, then DONE 0.3 s later), ``"lost-after"`` (every chunk, then the link drops), ``"lost-mid"`` (one
    chunk, the data connection and the link drop; the resumed hand-off sends the rest and DONE)."""

    max_reconnects = 1

    def __init__(self, dev: ConnectedDevice, script: str) -> None:
        self.dev, self.script = dev, script
        self.reconnects = 0
        self.provisions: list[int] = []  # each provision's resume_from
        self.sock: socket.socket | None = None
        self.session = b""
        grant = dev.client.handoff(epoch=1, offset=0, length=N * CHUNK, chunk_size=CHUNK)  # a first window: parks
        self.session = bytes.fromhex(grant.session_id)
        self._connect(grant.provisioning_key, 1)
        dev.client.close_window(epoch=1)

    def _send(self, ftype: FrameType, header: dict[str, Any], payload: bytes = b"") -> Any:
        assert self.sock is not None
        self.sock.sendall(encode_frame(ftype, header, payload))
        got = recv_frame_with_fds(self.sock)
        return None if got is None else got[0]

    def _admit(self, key: DirectionKey, epoch: int) -> None:
        admit = Admission.make(key.key, session_id=self.session, epoch=epoch, holder="alice")
        assert self._send(FrameType.DATA_OPEN, {"session": self.session.hex(), "admit": admit.to_wire()}).type \
            is FrameType.DATA_READY

    def _connect(self, key: DirectionKey, epoch: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.dev.sock)
        self._admit(key, epoch)

    def _chunk(self, key: DirectionKey, seq: int) -> None:
        out = bytearray(CHUNK + TAG_LEN)
        SendState(key, session_id=self.session, start=seq).seal_into(os.urandom(CHUNK), out,
                                                                      frame_type=FrameType.CHUNK, offset=seq * CHUNK,
                                                                      length=CHUNK)
        ack = self._send(FrameType.CHUNK, {"e": key.epoch, "s": seq, "o": seq * CHUNK, "n": CHUNK}, bytes(out))
        assert ack.type is FrameType.ACK

    def agent(self, key: DirectionKey, epoch: int) -> None:
        """The agent's side of the window, as it runs beside the held request: the relayed HANDOFF read on the parked
        connection, re-admitted, its chunks (all, or one for ``lost-mid``, then the connection gone)."""
        assert self.sock is not None
        got = recv_frame_with_fds(self.sock)
        assert got is not None and got[0].type is FrameType.HANDOFF and got[0].header["epoch"] == epoch
        self._admit(key, epoch)
        for seq in range(1 if self.script == "lost-mid" else N):
            self._chunk(key, seq)
        if self.script == "lost-mid":
            self.sock.close()

    async def provision(self, handoff: Handoff, *, device_socket: str, on_progress: Any = None,
                        on_reject: Any = None, data_endpoint: DataEndpoint | None = None) -> ProvisionStats:
        self.provisions.append(handoff.resume_from)
        if handoff.resume_from:  # the resumed hand-off: a fresh connection, the rest of the chunks
            assert handoff.key is not None
            key: DirectionKey = handoff.key

            def rest() -> None:
                self._connect(key, handoff.epoch)
                for seq in range(handoff.resume_from, N):
                    self._chunk(key, seq)

            await asyncio.to_thread(rest)
            return ProvisionStats(marks_ns={"done": time.perf_counter_ns()}, stages={"admit_sent_s": 0.001})
        if self.script in ("lost-after", "lost-mid"):
            raise LinkLostError("alice", "connection lost: the SSH session dropped")
        await asyncio.sleep(0.3)  # the holder's DONE comes late
        return ProvisionStats(marks_ns={"done": time.perf_counter_ns()}, stages={"admit_sent_s": 0.001})

    async def reconnect(self) -> None:
        self.reconnects += 1


def window(dev: ConnectedDevice) -> tuple[Handoff, Early, DirectionKey]:
    """Epoch 2's hand-off as the orchestrator builds it before the window opens, and its HANDOFF wrapped for alice."""
    secrets = dev.client.secrets
    assert secrets is not None
    key = provisioning_key(secrets.master, secrets.session_id, epoch=2, offset=0, length=N * CHUNK,
                           direction=Direction.HOLDER_TO_DEVICE)
    base = Handoff.for_window(epoch=2, session_id=secrets.session_id.hex(), key=ProvisioningKey.of(key), skip=0,
                              length=N * CHUNK, chunk_size=CHUNK, train=(0, N * CHUNK), val=(0, 0))
    outgoing = replace(base, key=None, wrapped_key="ab" * 40, key_fp=key.fingerprint, relay_id=os.urandom(8).hex(),
                       data_endpoint=DataEndpoint(path=dev.sock))
    return base, Early(base, outgoing), key


def run(dev: ConnectedDevice, link: ScriptedLink) -> tuple[completion.Closing, ProvisionStats, list[Any]]:
    """One hand-off through ``completion``: asked, the agent's side run beside it, provisioned (resumed where the link
    drops), its DONE read; the Closing, its stats and the resumptions seen."""
    base, early, key = window(dev)
    resumed: list[Any] = []

    async def go() -> tuple[completion.Closing, ProvisionStats]:
        p = await completion.ask(dev.client, base, early, holder="alice", asked_ns=time.perf_counter_ns())
        agent = threading.Thread(target=link.agent, args=(key, 2))
        agent.start()
        closing = await completion.provision_visit(dev.client, p, link, device_socket=dev.sock,
                                                   endpoint=DataEndpoint(path=dev.sock),
                                                   on_resume=lambda exc, n, st: resumed.append((n, st)))
        stats = await closing.finish()
        await asyncio.to_thread(agent.join, 20)
        return closing, stats

    closing, stats = asyncio.run(go())
    return closing, stats, resumed


def test_the_hand_off_ends_at_the_devices_answer_and_the_done_is_read_after(connected_device: ConnectedDevice) -> None:
    link = ScriptedLink(connected_device, "late-done")
    closing, stats, resumed = run(connected_device, link)
    assert closing.closed is not None and closing.closed.complete and closing.closed.bytes == N * CHUNK
    assert closing.relayed and stats.relayed and resumed == [] and link.provisions == [0]
    assert "answered" in closing.closed.marks_ns and connected_device.service.windows.window is None
    # the DONE came 0.3 s after the answer: read after, its stats kept; the hand-off's Tx ends at the answer
    assert stats.marks_ns["done"] == closing.answered_ns < stats.marks_ns["done_read"]
    assert stats.marks_ns["done_read"] - closing.answered_ns >= 0.25e9
    assert stats.stages == {"admit_sent_s": 0.001}


def test_a_link_lost_after_the_last_chunk_resumes_nothing(connected_device: ConnectedDevice) -> None:
    link = ScriptedLink(connected_device, "lost-after")
    closing, stats, resumed = run(connected_device, link)
    assert closing.closed is not None and closing.closed.complete  # every chunk arrived before the link went
    assert resumed == [] and link.provisions == [0] and link.reconnects == 1  # brought back, nothing resumed
    assert connected_device.service.windows.window is None and stats.marks_ns["done"] == closing.answered_ns


def test_a_link_lost_mid_window_resumes_from_the_last_acknowledged_chunk(connected_device: ConnectedDevice) -> None:
    link = ScriptedLink(connected_device, "lost-mid")
    closing, stats, resumed = run(connected_device, link)
    assert closing.closed is None and closing.stats is stats  # the answer was the open window's status
    assert [n for n, _ in resumed] == [1] and isinstance(resumed[0][1], WindowStatus)
    assert resumed[0][1].contiguous == 1 and link.provisions == [0, 1] and link.reconnects == 1
    closed = connected_device.client.close_window(epoch=2)  # RETURN closes it, as without the option
    assert closed.complete and closed.chunks == N and "answered" not in closed.marks_ns
