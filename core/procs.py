"""Child processes of the orchestrator."""

from __future__ import annotations


def die_with_parent() -> None:
    """In the child before exec: the kernel kills it when the orchestrator dies (even by kill -9),
    so a crashed run never leaves a device service holding keys and model behind."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
