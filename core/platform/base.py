"""What every platform gives the engine: a running device service and the anchors to trust it."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputravel.core.deviceclient.anchors import TrustAnchors


@dataclass(frozen=True, slots=True)
class PlatformInfo:
    kind: str  # "emulated" | "hardware"
    sim: bool
    device: str
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "sim": self.sim, "device": self.device, "notes": list(self.notes)}


def last_log_line(path: Path | None, *, tail: int = 8192) -> str | None:
    """The last non-blank line of a log file (read from its last ``tail`` bytes), or None."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - tail))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return None
    lines = [ln for ln in lines if ln]
    return lines[-1][:500] if lines else None


@dataclass(slots=True)
class DeviceHandle:
    """A started device service."""

    socket_path: str
    anchors: TrustAnchors
    info: PlatformInfo
    process: subprocess.Popen[bytes] | None = None
    log: list[str] = field(default_factory=list)
    data_host: str = "127.0.0.1"
    data_port: int | None = None
    #: where the device service's stderr goes (``<run>/device.log``, 0600), or None
    log_path: Path | None = None

    def last_error(self) -> str | None:
        """The last line the device service wrote to its log (its dying words: an exception's last line), or
        None when there is no log or it is empty."""
        return last_log_line(self.log_path)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._remove_socket_dir()

    def _remove_socket_dir(self) -> None:
        import os
        import shutil

        folder = os.path.dirname(self.socket_path)
        if os.path.basename(folder).startswith("gputravel-dev-"):
            shutil.rmtree(folder, ignore_errors=True)

    def kill(self) -> None:
        """Hard kill (fault injection: the device service dies)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
