"""The emulated platform: a device-service process standing for a CC-mode GPU, real cryptography.

The emulated vendor PKI and the device identity are generated under the state folder (never in the
repository). The orchestrator pins that vendor root as it would pin NVIDIA's. Everything the real
hardware would do in silicon (terminating the channel, enforcing key windows, measuring regions)
the service does in software; nothing here claims hardware isolation.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gputravel.core import allocator
from gputravel.core.attestation import Policy, load_policy, provision_emulated
from gputravel.core.deviceclient.anchors import TrustAnchors
from gputravel.core.errors import ConfigError, DeviceError
from gputravel.core.platform.base import DeviceHandle, PlatformInfo, last_log_line
from gputravel.core.procs import die_with_parent, name_os_thread


class EmulatedPlatform:
    kind = "emulated"

    def __init__(self, state_dir: Path, *, device: str | None = None, cc_mode: str = "on",
                 policy: Policy | None = None, allow_fault_injection: bool = False, torch_threads: int = 0,
                 data_host: str = "127.0.0.1", cipher_engine: str = "auto", module: str = "gputravel.core.device",
                 extra_args: tuple[str, ...] = (), log_path: Path | None = None) -> None:
        self.state_dir = Path(state_dir)
        self.device = device
        self.cc_mode = cc_mode
        self.policy = policy
        self.allow_fault_injection = allow_fault_injection
        self.torch_threads = torch_threads
        self.data_host = data_host
        self.cipher_engine = cipher_engine
        self.module = module  # the device service's entry point (a fleet member's adds its operations)
        self.extra_args = extra_args  # and its own options (the fleet's device id)
        #: the device service's stderr goes here (created 0600, appended to across restarts); None: discarded
        self.log_path = Path(log_path) if log_path is not None else None

    def anchors(self) -> TrustAnchors:
        ca, _ = provision_emulated(self.state_dir)
        return TrustAnchors(root=ca.root_cert, crl=ca.crl(), policy=self.policy or load_policy())

    def start(self, *, buffer_bytes: int, ready_timeout: float = 120.0) -> DeviceHandle:
        check_torch_device(self.device)
        allocator.wanted()  # the device inherits GPUTRAVEL_KEEP_FREED_MEMORY: a bad value is refused here, by name
        anchors = self.anchors()
        sock_dir = tempfile.mkdtemp(prefix="gputravel-dev-")  # short path: AF_UNIX limits it to 108 bytes
        os.chmod(sock_dir, 0o700)
        sock = os.path.join(sock_dir, "device.sock")
        cmd = [sys.executable, "-m", self.module, *self.extra_args, "--socket", sock, "--state-dir", str(self.state_dir),
               "--buffer-bytes", str(buffer_bytes), "--cc-mode", self.cc_mode, "--data-host", self.data_host]
        if self.device:
            cmd += ["--device", self.device]
        if self.torch_threads:
            cmd += ["--threads", str(self.torch_threads)]
        if self.allow_fault_injection:
            cmd.append("--allow-fault-injection")
        if self.cipher_engine != "auto":
            cmd += ["--cipher-engine", self.cipher_engine]
        log_fd = self._open_log()
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_fd, stdin=subprocess.DEVNULL,
                                    preexec_fn=die_with_parent)
        finally:
            if log_fd != subprocess.DEVNULL:
                os.close(log_fd)
        assert proc.stdout is not None
        lines: list[str] = []
        ready = threading.Event()

        def pump() -> None:
            name_os_thread()
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                lines.append(line)
                if line.startswith(("READY", "ERROR")):
                    ready.set()
            ready.set()

        threading.Thread(target=pump, name="device-stdout", daemon=True).start()
        deadline = time.monotonic() + ready_timeout
        while not ready.wait(0.05):
            if time.monotonic() > deadline:
                proc.kill()
                raise DeviceError(f"the device service did not start within {ready_timeout:.0f} s")
        if not any(line.startswith("READY") for line in lines):
            proc.kill()
            proc.wait()
            err = last_log_line(self.log_path) or ""
            raise DeviceError(f"the device service failed to start: {' '.join(lines)} {err}".strip())
        # the device service names its own device (its DEVICE line): this process needs no torch for it
        name = next((line.split(" ", 1)[1] for line in lines if line.startswith("DEVICE ")),
                    self.device or "unknown")
        info = PlatformInfo(kind="emulated", sim=True, device=name,
                            notes=("SIM: the confidential GPU is emulated in software; no TDX or CC-mode H100 "
                                   "isolation is claimed. Attestation, channel and key windows use real "
                                   "ECDSA P-384 / ECDH / AES-256-GCM.",))
        ready_line = next(line for line in lines if line.startswith("READY"))
        parts = ready_line.split()
        data_port = int(parts[2]) if len(parts) > 2 else None
        return DeviceHandle(socket_path=sock, anchors=anchors, info=info, process=proc, log=lines,
                            data_host=self.data_host, data_port=data_port, log_path=self.log_path)

    def _open_log(self) -> int:
        """A write descriptor on the device log (0600, appended), or DEVNULL when there is none."""
        if self.log_path is None:
            return subprocess.DEVNULL
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)
        return fd


def check_torch_device(device: str | None) -> None:
    """``--device`` names a torch device this machine has, or ``ConfigError`` in one line (checked before the
    device service starts, so its traceback never becomes the message)."""
    if not device:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"--device {device!r} is not a torch device: {str(exc).splitlines()[0]}") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = dev.index or 0
        if index >= count:
            raise ConfigError(f"--device {device}: this machine has {count} CUDA device(s)"
                              + (f" (cuda:0 to cuda:{count - 1})" if count else ""))
    elif dev.type not in ("cpu", "meta"):
        raise ConfigError(f"--device {device}: the emulated GPU runs on cpu or cuda, not {dev.type}")



def describe_cipher_engine(setting: str = "auto", *, device: str | None = None) -> tuple[str, str]:
    """``(label, reason)`` of the engine a device service started here would open provisioning chunks with
    (``core.device.openers.describe_choice``): the platform is the orchestrator's one door to the device's code."""
    from gputravel.core.device.openers import describe_choice

    return describe_choice(setting, device=device)
