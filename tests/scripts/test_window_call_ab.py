"""scripts/window_call_ab.py (issue 34 item 2): the window's key asked from the loop and through a worker thread, in
turn, against one real device process; every round of both is timed, and the device is left shut down."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from helpers import REPO_ROOT


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_calls_are_timed_in_turn() -> None:
    got = _script("window_call_ab").main(["--rounds", "6"])
    assert got["rounds"] == 6
    for variant in ("to_thread", "on_loop"):
        rec = got[variant]
        assert 0 < rec["p10_us"] <= rec["median_us"] <= rec["p90_us"]
    assert 0.0 <= got["on_loop_faster_share"] <= 1.0
