"""A background thread (a checkpoint's seal on the device) runs below its process's other threads: its own nice
value rises by ``BACKGROUND_NICE``, the others' stay."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from gputravel.core.procs import BACKGROUND_NICE, run_in_background


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
