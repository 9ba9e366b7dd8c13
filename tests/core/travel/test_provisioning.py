"""Every data path delivers the holder's bytes into the buffer exactly, with each provisioning
optimisation on and off, and tampering is caught on every path."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers import device_process

from gputravel.agents.holder import open_dataset
from gputravel.console.entries import ENTRIES
from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.protocol import TAG_LEN, FrameType, SendState, encode_frame, read_frame
from gputravel.core.protocol.frames import frame_head
from gputravel.core.protocol.holderlink import Admission, DataEndpoint
from gputravel.core.travel.holders import Handoff
from gputravel.core.travel.local_link import LocalHolderLink

CHUNK = 8 * 1024
WINDOW = 40 * CHUNK + 123  # a short last chunk too


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("prov") / "holder"
    folder.mkdir()
    (folder / "data.txt").write_bytes(os.urandom(WINDOW).hex().encode()[: int(WINDOW / 0.9) + 100])
    return folder


def expected_digest(holder: Path) -> str:
    data = open_dataset(holder, val_fraction=0.1)
    return hashlib.sha256(data.train.read(0, WINDOW)).hexdigest()


@asynccontextmanager
async def device(tmp_path: Path, *, parallel_auth: bool, overlap: bool) -> AsyncIterator[tuple[Any, DeviceClient]]:
    with device_process(tmp_path / "platform", buffer_bytes=WINDOW + 4096, connect=False, timeout=600.0,
                        allow_fault_injection=True) as dev:
        client = dev.client
        await asyncio.to_thread(client.connect)
        config = await asyncio.to_thread(client.set_data_path, parallel_auth=parallel_auth, overlap=overlap)
        assert config.parallel_auth == parallel_auth
        yield dev.handle, client


def open_window(client: DeviceClient, epoch: int) -> Handoff:
    grant = client.handoff(epoch=epoch, offset=0, length=WINDOW, chunk_size=CHUNK)
    return Handoff(epoch=epoch, session_id=grant.session_id, key=grant.provisioning_key,
                   window_offset=0, chunk_size=CHUNK, train=(0, WINDOW), val=(0, 0))


OPTIMISATIONS = [(True, True), (False, True), (False, False)]


@pytest.mark.parametrize(("parallel_auth", "overlap"), OPTIMISATIONS)
@pytest.mark.parametrize("path", ["direct", "channel", "conventional"])
async def test_each_path_delivers_the_holders_bytes_exactly(holder: Path, tmp_path: Path, path: str,
                                                            parallel_auth: bool, overlap: bool) -> None:
    async with device(tmp_path, parallel_auth=parallel_auth, overlap=overlap) as (handle, client):
        link = LocalHolderLink("h", holder, agent=ENTRIES.holder_agent)
        await link.start()
        try:
            handoff = open_window(client, 1)
            if path == "conventional":
                handoff = replace(handoff, conventional=True)
            endpoint = DataEndpoint(path=handle.socket_path) if path == "direct" else None
            await link.provision(handoff, device_socket=handle.socket_path, data_endpoint=endpoint)
            closed = client.close_window(epoch=1)
            assert closed.complete and closed.bytes == WINDOW and closed.chunks == 41
            assert client.digest(offset=0, length=WINDOW).sha256 == expected_digest(holder)
        finally:
            await link.close()


@pytest.mark.parametrize(("parallel_auth", "overlap"), OPTIMISATIONS)
@pytest.mark.parametrize("path", ["channel", "conventional"])
async def test_a_chunk_tampered_on_the_wire_is_caught_and_retransmitted(holder: Path, tmp_path: Path, path: str,
                                                                        parallel_auth: bool, overlap: bool) -> None:
    async with device(tmp_path, parallel_auth=parallel_auth, overlap=overlap) as (handle, client):
        link = LocalHolderLink("h", holder, agent=ENTRIES.holder_agent)
        await link.start()
        link.session.tamper_on_wire = {3, 17}
        try:
            handoff = open_window(client, 1)
            if path == "conventional":
                handoff = replace(handoff, conventional=True)
            stats = await link.provision(handoff, device_socket=handle.socket_path)
            assert stats.rejected["tag"] == 2 and stats.retransmits == 2
            closed = client.close_window(epoch=1)
            assert closed.complete and closed.rejected_in_window.get("tag") == 2
            assert client.digest(offset=0, length=WINDOW).sha256 == expected_digest(holder)
        finally:
            await link.close()


@pytest.mark.parametrize(("parallel_auth", "overlap"), OPTIMISATIONS)
async def test_tampering_on_the_direct_path_is_caught_by_the_pipelined_device(tmp_path: Path, parallel_auth: bool,
                                                                              overlap: bool) -> None:
    async with device(tmp_path, parallel_auth=parallel_auth, overlap=overlap) as (handle, client):
        handoff = open_window(client, 1)
        assert handoff.key is not None
        sender = SendState(handoff.key, session_id=bytes.fromhex(handoff.session_id))
        plain = os.urandom(WINDOW)
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(handle.socket_path)
        stream = sock.makefile("rb")
        admit = Admission.make(handoff.key.key, session_id=bytes.fromhex(handoff.session_id), epoch=handoff.epoch,
                               holder="h").to_wire()
        sock.sendall(encode_frame(FrameType.DATA_OPEN, {"session": handoff.session_id, "admit": admit}))
        assert read_frame(stream).type is FrameType.DATA_READY  # type: ignore[union-attr]
        sealed = []
        for seq in range(41):
            lo = seq * CHUNK
            n = min(CHUNK, WINDOW - lo)
            out = bytearray(n + TAG_LEN)
            sender.seal_into(plain[lo: lo + n], out, frame_type=FrameType.CHUNK, offset=lo, length=n)
            sealed.append(({"e": 1, "s": seq, "o": lo, "n": n}, out))
        bad = bytearray(sealed[5][1])
        bad[7] ^= 0x80
        frames = [sealed[5][0], *[h for h, _ in sealed]]
        payloads = [bad, *[p for _, p in sealed]]
        for head, payload in zip(frames, payloads, strict=True):
            sock.sendall(frame_head(FrameType.CHUNK, head, len(payload)) + bytes(payload))
        replies = [read_frame(stream) for _ in range(42)]
        errors = [r for r in replies if r is not None and r.type is FrameType.ERROR]
        acks = {r.header["s"] for r in replies if r is not None and r.type is FrameType.ACK}
        assert [e.header["code"] for e in errors] == ["tag"] and acks == set(range(41))
        sock.close()
        assert client.close_window(epoch=1).complete
        assert client.digest(offset=0, length=WINDOW).sha256 == hashlib.sha256(plain).hexdigest()
