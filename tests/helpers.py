"""Shared test helpers (imported by test modules; pytest puts this folder on sys.path).

One of each: holder data (``write_holder``, ``write_holders``; the ``holder_data`` and ``data_root`` fixtures in
conftest.py use them), run settings (``small_settings``), a device service (``device_process`` as its own process,
``device_in_thread`` served in the test's process) and ``wait_for``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import random
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

import pytest

from gputravel.console.entries import ENTRIES
from gputravel.core import events as ev
from gputravel.core.api import build_engine
from gputravel.core.config import RunSettings
from gputravel.core.recording import Recorder
from gputravel.core.runfolder import RunFolder
from gputravel.core.travel.engine import TravelEngine
from gputravel.core.travel.report import RunReport

#: The tests folder, the repository root, and the shared files beside the test folders.
TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` loaded as a module (the scripts are not a package), so a test calls its ``main``."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
DATA_DIR = TESTS_DIR / "data"

#: The real evidence most attestation tests verify (tests/data, from ../shared/evidence: each folder's README says
#: whose): virtee's Milan SNP report and its chip's VCEK, dcap-qvl's TDX quote and its collateral (JSON bytes).
SNP_DIR = DATA_DIR / "amd-snp"
TDX_DIR = DATA_DIR / "intel-tdx"
MILAN_REPORT = bytes.fromhex((SNP_DIR / "report_milan.hex").read_text().strip())
MILAN_VCEK = (SNP_DIR / "vcek_milan.der").read_bytes()
TDX_QUOTE = (TDX_DIR / "tdx_quote").read_bytes()
TDX_COLLATERAL = (TDX_DIR / "tdx_quote_collateral.json").read_bytes()
SNAPSHOTS_DIR = TESTS_DIR / "snapshots"


@dataclass(frozen=True)
class Proc:
    """One live (non-zombie) process, read from /proc."""

    pid: int
    ppid: int
    argv: list[bytes]
    cwd: str  # "" where it cannot be read

    @property
    def cmd(self) -> str:
        return b" ".join(self.argv).decode(errors="replace")


def live_processes() -> list[Proc]:
    """Every live, non-zombie process this user can see."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (d / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        try:
            cwd = os.readlink(d / "cwd")
        except OSError:
            cwd = ""
        if stat[0] != "Z":
            found.append(Proc(int(d.name), int(stat[1]), argv, cwd))
    return found


def descendants(root: int) -> dict[int, str]:
    """Every live descendant of ``root``: pid -> command line."""
    procs = live_processes()
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    cmd = {p.pid: p.cmd for p in procs}
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = cmd.get(pid, "?")
        todo.extend(children.get(pid, []))
    return found


def still_alive(pids: dict[int, str]) -> dict[int, str]:
    """Those of ``pids`` (pid -> command line, from ``descendants``) still alive: the same pid with the same command
    line, not a reused pid."""
    live = {p.pid: p.cmd for p in live_processes()}
    return {pid: c for pid, c in pids.items() if live.get(pid) == c}


def gputravel_children() -> list[str]:
    """Live (non-zombie) gputravel processes whose parent is this test process."""
    return [f"{p.pid}: {p.cmd}" for p in live_processes() if p.ppid == os.getpid() and "gputravel" in p.cmd]


def assert_no_leaked_processes(timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while gputravel_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gputravel_children() == [], "device service or agent processes outlived the run"


@contextlib.asynccontextmanager
async def started(settings: RunSettings, links: list[Any] | None = None) -> AsyncIterator[TravelEngine]:
    """``build_engine`` plus the clean-up ``api.run`` does, so a test can reach the engine itself."""
    engine = await asyncio.to_thread(build_engine, settings, links=links, entries=ENTRIES)
    try:
        yield engine
    finally:
        await engine.aclose()


@contextlib.asynccontextmanager
async def running(engine: TravelEngine) -> AsyncIterator[asyncio.Task[RunReport]]:
    """``engine.run()`` as a task the test steers (pause, step, resume) and awaits; on the way out a run still
    going (a failed assertion, a timeout) is cancelled and awaited, so no test leaves it running."""
    task = asyncio.create_task(engine.run())
    try:
        yield task
    finally:
        if not task.done():
            engine.control.cancel()
            with contextlib.suppress(Exception):
                await task


def recorded_run(folder: Path, *final: ev.Event, run_id: str = "rec00001") -> Path:
    """A run folder with no process behind it, for what a console attached to it writes and shows: its recording
    has the device attested, a run for alice started and her first visit's TRAIN begun, then ``final`` (nothing: a
    run still in TRAIN; a ``RunCompleted`` / ``RunFailed`` of ``run_id``: a run that has ended)."""
    folder.mkdir(mode=0o700)
    rec = Recorder(RunFolder(folder).recording, meta={"settings": {"holders": 1}})
    rec(ev.DeviceAttested(1000.0, "emu-gpu-0", True, {"nonce": True}, True))
    rec(ev.RunStarted(1000.1, run_id, {"kind": "emulated", "sim": True, "device": "cpu", "notes": []},
                      ("alice",), 1))
    rec(ev.PhaseStarted(1000.2, 0, "alice", "TRAIN", 1))
    for event in final:
        rec(event)
    rec.close()
    return folder


def control_lines(folder: Path) -> list[dict[str, Any]]:
    """The requests written to a run folder's control channel (``control.jsonl``), oldest first."""
    path = RunFolder(folder).control
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


#: The ``holder_data`` fixture's type (conftest.py): ``holder_data(seeds, words, n_words, name=..., ...) -> Path``.
HolderData = Callable[..., Path]

#: The words most holder folders are drawn from.
WORDS = "the quick brown fox jumps over a lazy dog while cat and bird sat on the warm mat".split()

#: The small run most tests make: two holders, one round of two steps on 4 x 32 tokens, 16 KiB chunks, a
#: 0.25 MiB buffer (one pass for the default holder data).
SMALL_RUN: dict[str, Any] = dict(holders=2, rounds=1, steps_per_visit=2, batch_size=4, seq_len=32, chunk_kib=16,
                                 buffer_mib=0.25)


def write_holder(folder: Path, seed: int, words: list[str] = WORDS, n_words: int = 16_000, *,
                 file: str = "part.txt", newline: bool = True) -> Path:
    """A holder folder with one text file of ``n_words`` words drawn (seeded) from ``words``; returns the file."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    path = folder / file
    path.write_text(" ".join(rng.choice(words) for _ in range(n_words)) + ("\n" if newline else ""))
    return path


def write_holders(root: Path, seeds: Mapping[str, int], words: list[str] = WORDS, n_words: int = 16_000, *,
                  file: str = "part.txt", newline: bool = True) -> Path:
    """A data folder: one ``write_holder`` folder per name, seeded as ``seeds`` says; returns ``root``."""
    for name, seed in seeds.items():
        write_holder(root / name, seed, words, n_words, file=file, newline=newline)
    return root


def small_settings(data: Path | None, out: Path, **overrides: Any) -> RunSettings:
    """``RunSettings`` for ``SMALL_RUN`` on ``data`` into ``out``; ``overrides`` win."""
    base: dict[str, Any] = {**SMALL_RUN, "out_dir": out}
    if data is not None:
        base["data_dir"] = data
    return RunSettings(**{**base, **overrides})


#: the fleet tests' run: 3 holders, 1 round, 2 steps a visit, one torch thread per rank, faults allowed
FLEET_RUN: dict[str, Any] = dict(holders=3, rounds=1, steps_per_visit=2, buffer_mib=0.125, batch_size=4, seq_len=32,
                                 chunk_kib=32, torch_threads=1, transport="local", visit_attempts=1,
                                 allow_fault_injection=True)


def fleet_settings(data: Path, out: Path, **overrides: Any) -> RunSettings:
    """``RunSettings`` for ``FLEET_RUN`` on ``data`` into ``out``; ``overrides`` win."""
    return small_settings(data, out, **{**FLEET_RUN, **overrides})


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.02) -> bool:
    """Polls ``predicate`` until it is true or ``timeout`` passes; returns its last answer (as a bool)."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(interval)
    return bool(predicate())


async def until(pilot: Any, cond: Callable[[], Any], *, timeout: float = 60.0, what: str = "") -> None:
    """``wait_for`` in a Textual Pilot: pauses the app until ``cond()`` holds; fails naming ``what`` after
    ``timeout`` seconds."""
    for _ in range(int(timeout / 0.05)):
        if cond():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"timed out waiting for {what or cond}")


# --- a device service ----------------------------------------------------------------------------------
@dataclass
class DeviceProcess:
    """A device service running as its own process, and the client of its control session (a test that opens
    a new session sets ``client``: that one shuts the service down)."""

    handle: Any
    client: Any


@contextlib.contextmanager
def device_process(state: Path, *, buffer_bytes: int, connect: bool = True, timeout: float = 30.0,
                   **platform: Any) -> Iterator[DeviceProcess]:
    """The emulated platform's device service as its own process (``platform``: ``allow_fault_injection``,
    ``cipher_engine``, ...) and a ``DeviceClient`` (connected unless ``connect`` is false). Afterwards the
    service is asked to shut down (whatever the test left it in), then stopped, and must be gone."""
    from gputravel.core.deviceclient.client import DeviceClient
    from gputravel.core.platform.emulated import EmulatedPlatform

    handle = EmulatedPlatform(state, **platform).start(buffer_bytes=buffer_bytes)
    dev = DeviceProcess(handle, DeviceClient(handle.socket_path, anchors=handle.anchors, timeout=timeout))
    try:
        if connect:
            dev.client.connect()
        yield dev
    finally:
        try:
            if dev.client.secrets is not None and handle.alive():
                dev.client.shutdown()
        except Exception:  # noqa: BLE001 - teardown goes on whatever the service says
            pass
        finally:
            dev.client.close()
            handle.stop()
    assert not handle.alive()


@dataclass
class ServedDevice:
    """A device service served on threads of this process, its counters and server open to the test."""

    service: Any
    server: Any
    sock: str
    state: Path

    def new_client(self) -> Any:
        """A fresh ``DeviceClient`` for this device (not connected)."""
        from gputravel.core.deviceclient.client import DeviceClient
        from gputravel.core.platform.emulated import EmulatedPlatform

        return DeviceClient(self.sock, anchors=EmulatedPlatform(self.state).anchors())


#: The ``serve_device`` fixture's type (conftest.py): ``serve_device(**bounds) -> ServedDevice``.
ServeDevice = Callable[..., ServedDevice]


class ConnectedDevice:
    """A device served in this process and the orchestrator's control client, connected (the ``connected_device``
    fixture, conftest.py): tests that speak the device's protocol themselves start from it."""

    def __init__(self, service: Any, server: Any, sock: str, client: Any) -> None:
        self.service, self.server, self.sock, self.client = service, server, sock, client


@contextlib.contextmanager
def device_in_thread(folder: Path, *, data_host: str | None = None, max_pending: int = 4,
                     handshake_timeout: float = 0.5, evict_after: float | None = None,
                     buffer_bytes: int = 1 << 16) -> Iterator[ServedDevice]:
    """A real device service (real sockets, real keys) served in this process under ``folder``, with the
    bounds given: ``max_pending`` connections may wait to authenticate per listener, for ``handshake_timeout``
    seconds (a newcomer over that budget takes the place of one that has waited ``evict_after``, half of it by
    default); a TCP data port too where ``data_host`` is set."""
    from gputravel.core.device.server import DeviceServer
    from gputravel.core.device.service import load_service

    state = folder / "state"
    service = load_service(state, buffer_bytes=buffer_bytes)
    sock = str(folder / "d.sock")
    server = DeviceServer(service, sock, data_host=data_host, max_pending=max_pending,
                          handshake_timeout=handshake_timeout, evict_after=evict_after)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: os.path.exists(sock) and (data_host is None or server.tcp is not None), 30)
        yield ServedDevice(service, server, sock, state)
    finally:
        for listener in (server.sock, server.tcp):  # closing alone does not wake a thread blocked in accept()
            if listener is not None:
                with contextlib.suppress(OSError):
                    listener.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(5)
        assert not thread.is_alive(), "the device server's thread outlived its close"


@contextlib.contextmanager
def user_terminal(columns: int | None = None) -> Iterator[tuple[TextIO, bytearray]]:
    """A pseudo-terminal standing for the user's (``columns`` wide where given): yields its terminal side, open for
    writing as a program's stderr would be, and the bytes a terminal emulator read from the other side, all of
    them once the block has ended."""
    import fcntl
    import pty
    import struct
    import termios

    user, user_tty = pty.openpty()
    if columns is not None:
        fcntl.ioctl(user_tty, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    seen = bytearray()

    def read_user() -> None:
        while True:
            try:
                chunk = os.read(user, 65536)
            except OSError:
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=read_user, daemon=True)
    reader.start()
    try:
        with os.fdopen(user_tty, "w", closefd=True) as terminal:
            yield terminal, seen
    finally:
        reader.join(10)
        os.close(user)


@contextlib.contextmanager
def small_disk(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted at ``path`` (skips when this process may not mount)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path, nbytes: int | None = None) -> Path:
    """A filler file of ``nbytes`` (None: until the disk refuses) under ``path``."""
    filler = path / ".filler"
    block = b"\xa5" * (64 * 1024)
    with open(filler, "wb", buffering=0) as f:
        written = 0
        while nbytes is None or written < nbytes:
            try:
                written += f.write(block if nbytes is None else block[: min(len(block), nbytes - written)])
            except OSError:
                break
        with contextlib.suppress(OSError):
            os.fsync(f.fileno())
    return filler
