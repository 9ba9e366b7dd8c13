"""Shared test helpers (imported by test modules; pytest puts this folder on sys.path)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputravel.console.entries import ENTRIES
from gputravel.core.api import build_engine
from gputravel.core.config import RunSettings
from gputravel.core.travel.engine import TravelEngine


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


def write_holder(folder: Path, seed: int, words: list[str], n_words: int = 16_000) -> None:
    """A holder folder with one ``part.txt`` of ``n_words`` words drawn (seeded) from ``words``."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    (folder / "part.txt").write_text(" ".join(rng.choice(words) for _ in range(n_words)) + "\n")
