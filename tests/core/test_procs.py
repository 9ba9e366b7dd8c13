"""A background thread (a checkpoint's seal on the device) runs below its process's other threads: its own nice
value rises by ``BACKGROUND_NICE``, the others' stay."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from gputravel.core.procs import BACKGROUND_NICE, THREAD_NAME_BYTES, name_os_thread, run_in_background


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_a_background_thread_yields_and_the_others_keep_their_priority() -> None:
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: dict[str, object] = {}

    def body() -> None:
        seen["lowered"] = run_in_background()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == {"lowered": True, "nice": min(19, before + BACKGROUND_NICE)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # this thread's is unchanged


def _comm(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's kernel name is Linux's")
def test_a_thread_gives_the_kernel_its_name_and_the_others_keep_theirs() -> None:
    main_before = _comm(threading.get_native_id())
    seen: dict[str, object] = {}

    def body() -> None:
        tid = threading.get_native_id()
        seen["before"] = _comm(tid)
        seen["named"] = name_os_thread()
        seen["after"] = _comm(tid)
        seen["explicit"] = name_os_thread("device-control")
        seen["explicit_after"] = _comm(tid)

    t = threading.Thread(target=body, name="checkpoint-writeback")
    t.start()
    t.join()
    assert seen["before"] == main_before  # a new thread shows its process's name until it names itself
    assert seen["named"] is True and seen["after"] == "checkpoint-writeback"[:THREAD_NAME_BYTES] == "checkpoint-writ"
    assert seen["explicit"] is True and seen["explicit_after"] == "device-control"
    assert _comm(threading.get_native_id()) == main_before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's kernel name is Linux's")
def test_a_pool_named_at_its_workers_start_shows_each_worker_by_prefix_and_number() -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2, thread_name_prefix="ring-crypto", initializer=name_os_thread) as pool:
        names = set(pool.map(lambda _: _comm(threading.get_native_id()), range(8)))
    assert names and names <= {"ring-crypto_0", "ring-crypto_1"}

