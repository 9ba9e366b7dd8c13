"""Provisioning opened by the GPU cipher (core/device/openers.py): the same bytes land in the buffer as
with the CPU engine, a tampered chunk is a counted TagError that writes nothing, and the engine that
opened the chunks is named in the device's info and the run report. On CPU the kernels run in numba's
CUDA simulator (slow), so the chunks here are small."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from gputravel.console.entries import ENTRIES
from gputravel.core import api
from gputravel.core.config import RunSettings
from gputravel.core.device.dataplane import DataPlane
from gputravel.core.device.openers import (
    CPU_LABEL,
    ChunkOpener,
    GpuOpener,
    HostOpener,
    choose_opener,
    describe_choice,
)
from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.errors import ConfigError
from gputravel.core.phases import Phase
from gputravel.core.platform.emulated import EmulatedPlatform
from gputravel.core.protocol import (
    TAG_LEN,
    Direction,
    DirectionKey,
    FrameType,
    RecvState,
    SendState,
    TagError,
    encode_frame,
    read_frame,
)
from gputravel.core.protocol.frames import frame_head
from gputravel.core.protocol.holderlink import Admission
from gputravel.core.travel.probes import EngineProbe
from tests.helpers import write_holder

SESSION = bytes(range(16))


def key(epoch: int = 1) -> DirectionKey:
    return DirectionKey(os.urandom(32), os.urandom(4), epoch, int(Direction.HOLDER_TO_DEVICE))


def seal(k: DirectionKey, plain: bytes, *, base: int, chunk: int) -> list[tuple[int, int, int, bytearray]]:
    """``(seq, offset, length, ciphertext||tag)`` for each chunk of ``plain`` written at ``base``."""
    sender = SendState(k, session_id=SESSION)
    out = []
    for seq, lo in enumerate(range(0, len(plain), chunk)):
        n = min(chunk, len(plain) - lo)
        buf = bytearray(n + TAG_LEN)
        sender.seal_into(plain[lo: lo + n], buf, frame_type=FrameType.CHUNK, offset=base + lo, length=n)
        out.append((seq, base + lo, n, buf))
    return out


def submit_all(opener: ChunkOpener, k: DirectionKey, chunks: list[tuple[int, int, int, bytearray]], *,
               chunk: int) -> list[BaseException | None]:
    """Every chunk through the one opener strategy (``submit``); each chunk's verdict once all are done."""
    recv = RecvState(k, session_id=SESSION)
    verdicts: dict[int, BaseException | None] = {}
    settled = threading.Condition()

    def done_for(seq: int) -> Any:
        def done(exc: BaseException | None) -> None:
            with settled:
                verdicts[seq] = exc
                settled.notify_all()
        return done

    for seq, off, n, payload in chunks:
        opener.submit(recv, k, payload, seq=seq, offset=off, length=n, chunk_size=chunk, done=done_for(seq))
    with settled:
        assert settled.wait_for(lambda: len(verdicts) == len(chunks), timeout=60)
    return [verdicts[seq] for seq, *_ in chunks]


@pytest.mark.parametrize("staged", [False, True], ids=["host-direct", "host-staged"])
@pytest.mark.parametrize("base", [0, 48, 5], ids=["aligned", "aligned-48", "unaligned"])
def test_the_gpu_opener_writes_what_the_host_opener_writes(base: int, staged: bool) -> None:
    k = key()
    plain = os.urandom(3 * 96 + 37)  # a short last chunk too
    chunks = seal(k, plain, base=base, chunk=96)
    bufs = {name: torch.full((base + len(plain) + 64,), 0xA5, dtype=torch.uint8) for name in ("cpu", "gpu")}
    plane = DataPlane(bufs["cpu"], staged=staged)  # staged: through host slots and the copy step, as on CUDA
    openers: dict[str, ChunkOpener] = {"cpu": HostOpener(plane), "gpu": GpuOpener(bufs["gpu"])}
    try:
        for opener in openers.values():
            assert submit_all(opener, k, chunks, chunk=96) == [None] * len(chunks)
    finally:
        plane.close()
    assert bytes(bufs["gpu"][base: base + len(plain)].numpy()) == plain
    assert torch.equal(bufs["gpu"], bufs["cpu"])
    assert openers["gpu"].label == "gpu (simulator)" and openers["cpu"].label == CPU_LABEL


@pytest.mark.parametrize("engine", ["cpu", "gpu"])
def test_either_opener_fails_a_tampered_chunk_through_done_with_a_tag_error(engine: str) -> None:
    k = key()
    plain = os.urandom(2 * 64)
    chunks = seal(k, plain, base=0, chunk=64)
    chunks[1][3][5] ^= 0x01  # one ciphertext bit of the second chunk
    buf = torch.full((len(plain),), 0x5A, dtype=torch.uint8)
    plane = DataPlane(buf)
    try:
        verdicts = submit_all(choose_opener(engine, plane), k, chunks, chunk=64)
    finally:
        plane.close()
    assert verdicts[0] is None and isinstance(verdicts[1], TagError)
    assert bytes(buf[:64].numpy()) == plain[:64]
    # nothing of the forged chunk landed: the GPU opener left the bytes, the host opener zeroed them
    assert bytes(buf[64:].numpy()) == bytes([0x5A if engine == "gpu" else 0]) * 64


def test_a_tampered_chunk_is_a_tag_error_and_writes_nothing() -> None:
    k = key()
    plain = os.urandom(4 * 64)
    chunks = seal(k, plain, base=0, chunk=64)
    buf = torch.full((len(plain),), 0x5A, dtype=torch.uint8)
    opener = GpuOpener(buf)
    recv = RecvState(k, session_id=SESSION)
    seq, off, n, payload = chunks[2]
    for flip in (0, n - 1, n + 3):  # ciphertext first and last byte, and the tag
        bad = bytearray(payload)
        bad[flip] ^= 0x01
        with pytest.raises(TagError):
            opener.open(recv, k, bad, seq=seq, offset=off, length=n)
        assert bool((buf == 0x5A).all())  # nothing written
    with pytest.raises(TagError):  # the right bytes under another key
        opener.open(recv, key(), payload, seq=seq, offset=off, length=n)
    opener.open(recv, k, payload, seq=seq, offset=off, length=n)
    assert bytes(buf[off: off + n].numpy()) == plain[off: off + n]


def test_chunks_delivered_together_are_opened_in_shared_launches() -> None:
    k = key()
    plain = os.urandom(12 * 32)
    chunks = seal(k, plain, base=0, chunk=32)
    buf = torch.zeros(len(plain), dtype=torch.uint8)
    opener = GpuOpener(buf)
    recv = RecvState(k, session_id=SESSION)
    gate = threading.Barrier(len(chunks))
    errors: list[BaseException] = []

    def one(seq: int, off: int, n: int, payload: bytearray) -> None:
        gate.wait()
        try:
            opener.open(recv, k, payload, seq=seq, offset=off, length=n)
        except BaseException as exc:  # noqa: BLE001 (collected and asserted below)
            errors.append(exc)

    threads = [threading.Thread(target=one, args=c) for c in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert bytes(buf.numpy()) == plain
    assert opener.chunks == len(chunks) and opener.launches <= len(chunks)


def test_engine_choice_is_automatic_named_and_validated() -> None:
    cpu_buf = torch.zeros(64, dtype=torch.uint8)
    plane = DataPlane(cpu_buf)
    auto = choose_opener("auto", plane)
    assert isinstance(auto, HostOpener) and auto.label == CPU_LABEL and auto.reason.startswith("auto:")
    assert choose_opener("gpu", plane).label == "gpu (simulator)"
    assert describe_choice("auto", device="cpu")[0] == CPU_LABEL
    assert describe_choice("gpu", device="cpu")[0] == "gpu (simulator)"
    with pytest.raises(ConfigError, match="cipher engine"):
        choose_opener("fpga", plane)
    with pytest.raises(ConfigError, match="cipher-engine"):
        RunSettings(cipher_engine="fpga")


# --- through the device service process -----------------------------------------------------------

CHUNK = 1024
WINDOW = 6 * CHUNK + 100


def test_the_device_opens_on_the_gpu_and_counts_a_forged_chunk(tmp_path: Path) -> None:
    handle = EmulatedPlatform(tmp_path / "platform", allow_fault_injection=True, cipher_engine="gpu").start(
        buffer_bytes=WINDOW + 4096)
    client = DeviceClient(handle.socket_path, anchors=handle.anchors)
    try:
        client.connect()
        info = client.info()
        assert info.cipher_engine == "gpu (simulator)" and info.cipher_reason == "set explicitly"
        client.set_data_path(parallel_auth=True, overlap=True, workers=3)  # several chunks in flight
        before = client.digest(offset=0, length=WINDOW).sha256
        grant = client.handoff(epoch=1, offset=0, length=WINDOW, chunk_size=CHUNK)
        k = grant.provisioning_key
        plain = os.urandom(WINDOW)
        sender = SendState(k, session_id=bytes.fromhex(grant.session_id))
        sealed = []
        for seq, lo in enumerate(range(0, WINDOW, CHUNK)):
            n = min(CHUNK, WINDOW - lo)
            out = bytearray(n + TAG_LEN)
            sender.seal_into(plain[lo: lo + n], out, frame_type=FrameType.CHUNK, offset=lo, length=n)
            sealed.append(({"e": 1, "s": seq, "o": lo, "n": n}, out))
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(handle.socket_path)
        stream = sock.makefile("rb")
        admit = Admission.make(k.key, session_id=bytes.fromhex(grant.session_id), epoch=1, holder="h").to_wire()
        sock.sendall(encode_frame(FrameType.DATA_OPEN, {"session": grant.session_id, "admit": admit}))
        assert read_frame(stream).type is FrameType.DATA_READY  # type: ignore[union-attr]
        bad = bytearray(sealed[2][1])
        bad[-1] ^= 0x80  # the tag
        # first the forgery alone: it must leave the buffer as it was
        sock.sendall(frame_head(FrameType.CHUNK, sealed[2][0], len(bad)) + bytes(bad))
        first = read_frame(stream)
        assert first is not None and first.type is FrameType.ERROR and first.header["code"] == "tag"
        assert client.digest(offset=0, length=WINDOW).sha256 == before
        replayed = [*sealed, sealed[4]]  # then every chunk, and one of them again: a replay
        for head, payload in replayed:
            sock.sendall(frame_head(FrameType.CHUNK, head, len(payload)) + bytes(payload))
        replies = [read_frame(stream) for _ in replayed]
        sock.close()
        codes = sorted(r.header["code"] for r in replies if r is not None and r.type is FrameType.ERROR)
        acks = {r.header["s"] for r in replies if r is not None and r.type is FrameType.ACK}
        assert codes == ["replay"] and acks == set(range(len(sealed)))
        closed = client.close_window(epoch=1)
        assert closed.complete and closed.rejected_in_window == {"tag": 1, "replay": 1}
        assert client.digest(offset=0, length=WINDOW).sha256 == hashlib.sha256(plain).hexdigest()
    finally:
        client.close()
        handle.stop()


class BufferDigests(EngineProbe):
    """The whole buffer's SHA-256 right after each provisioning (the digest op needs fault injection on)."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.digests: list[str] = []

    def on_phase(self, visit: int, phase: Phase, seconds: float) -> None:
        if phase == Phase.PROVISION:
            size = self.engine.settings.buffer_bytes
            self.digests.append(self.engine.device.client.digest(offset=0, length=size).sha256)


async def _run(tmp_path: Path, engine_name: str, data: Path) -> tuple[dict[str, Any], list[str]]:
    settings = RunSettings(holders=2, rounds=1, steps_per_visit=2, batch_size=2, seq_len=16, chunk_kib=4,
                           buffer_mib=12 / 1024, data_dir=data, out_dir=tmp_path / engine_name, transport="local",
                           allow_fault_injection=True, cipher_engine=engine_name, torch_threads=1)
    engine = await asyncio.to_thread(api.build_engine, settings, entries=ENTRIES)
    probe = BufferDigests()
    probe.engine = engine
    engine.bus.probes.append(probe)
    try:
        report: dict[str, Any] = (await engine.run()).to_json()
    finally:
        await engine.aclose()
    return report, probe.digests


async def test_a_run_with_the_gpu_engine_provisions_the_same_bytes_and_trains_the_same(tmp_path: Path) -> None:
    data = tmp_path / "data"
    words = "the travelling gpu opens each chunk inside its own memory".split()
    write_holder(data / "alice", 1, words, n_words=1500)
    write_holder(data / "bob", 2, words, n_words=1500)
    cpu, cpu_digests = await _run(tmp_path, "cpu", data)
    gpu, gpu_digests = await _run(tmp_path, "gpu", data)
    assert cpu["failed_visits"] == 0 and gpu["failed_visits"] == 0
    assert gpu["provisioning"]["cipher_engine"] == "gpu (simulator)"
    assert cpu["provisioning"]["cipher_engine"] == CPU_LABEL
    assert gpu["provisioning"]["bytes"] == cpu["provisioning"]["bytes"] > 0
    assert len(gpu_digests) == len(cpu_digests) >= 2 and gpu_digests == cpu_digests
    assert gpu["training"]["model_digest"] == cpu["training"]["model_digest"]
    assert gpu["training"]["loss_curve"] == cpu["training"]["loss_curve"]


def test_attest_names_the_engine_that_opens_the_data_path(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from gputravel.console.cli.main import app

    res = CliRunner().invoke(app, ["attest", "--json", "--state-dir", str(tmp_path / "state")])
    assert res.exit_code == 0, res.output
    engine = json.loads(res.stdout)["cipher_engine"]
    assert engine["label"] == describe_choice("auto")[0] and engine["reason"].startswith("auto:")


async def test_bench_provision_names_the_engine_that_opened_its_chunks(tmp_path: Path) -> None:
    from gputravel.core.bench.provision import measure_path

    probe: dict[str, Any] = {}
    times = await measure_path("local", size=8192, chunk=4096, repeats=1, workdir=tmp_path, server=None, entries=ENTRIES,  # type: ignore[arg-type]
                               probe=probe, cipher_engine="gpu")
    assert len(times) == 1 and probe["cipher_engine"] == "gpu (simulator)"


async def test_a_chunk_tampered_on_the_holder_link_is_caught_by_the_gpu_and_retransmitted(tmp_path: Path) -> None:
    from gputravel.agents.holder import open_dataset
    from gputravel.core.travel.holders import Handoff
    from gputravel.core.travel.local_link import LocalHolderLink

    folder = tmp_path / "holder"
    folder.mkdir()
    (folder / "data.txt").write_bytes(os.urandom(WINDOW).hex().encode()[: int(WINDOW / 0.9) + 100])
    handle = EmulatedPlatform(tmp_path / "platform", allow_fault_injection=True, cipher_engine="gpu").start(
        buffer_bytes=WINDOW + 4096)
    client = DeviceClient(handle.socket_path, anchors=handle.anchors)
    link = LocalHolderLink("h", folder, agent=ENTRIES.holder_agent)
    try:
        await asyncio.to_thread(client.connect)
        await link.start()
        link.session.tamper_on_wire = {1, 4}
        grant = client.handoff(epoch=1, offset=0, length=WINDOW, chunk_size=CHUNK)
        handoff = Handoff(epoch=1, session_id=grant.session_id, key=grant.provisioning_key,
                          window_offset=0, chunk_size=CHUNK, train=(0, WINDOW), val=(0, 0))
        stats = await link.provision(handoff, device_socket=handle.socket_path)  # the channel path
        assert stats.rejected["tag"] == 2 and stats.retransmits == 2
        closed = client.close_window(epoch=1)
        assert closed.complete and closed.rejected_in_window.get("tag") == 2
        want = hashlib.sha256(open_dataset(folder, val_fraction=0.1).train.read(0, WINDOW)).hexdigest()
        assert client.digest(offset=0, length=WINDOW).sha256 == want
    finally:
        await link.close()
        client.close()
        handle.stop()
