"""The device service's command line: ``python -m gputravel.core.device`` (the fleet's device adds its
identity to the same options, core/fleet/device.py), built, then served by :class:`DeviceServer`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from gputravel.core.allocator import keep_freed_memory
from gputravel.core.device.server import DeviceServer
from gputravel.core.device.service import DeviceService
from gputravel.core.errors import GpuTravelError

__all__ = ["device_arg_parser", "main", "pin_threads", "serve_from_args"]


def device_arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The device service's command line (the fleet's device adds its identity to it)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--buffer-bytes", type=int, required=True)
    parser.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    parser.add_argument("--cc-mode", default="on", choices=["on", "off", "devtools"])
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default count), fixed for the process (pin_threads)")
    parser.add_argument("--allow-fault-injection", action="store_true")
    parser.add_argument("--data-host", default="127.0.0.1", help="address of the TCP data port ('' for none)")
    parser.add_argument("--data-port", type=int, default=0)
    parser.add_argument("--cipher-engine", default="auto", choices=["auto", "cpu", "gpu"],
                        help="who opens provisioning chunks: cryptography on the CPU, or the GPU cipher")
    return parser


def pin_threads(requested: int) -> int:
    """Fix this process's torch intra-op thread count: ``requested``, or (0) torch's default count; returns it.

    Setting the count (``torch.set_num_threads``) also turns MKL's dynamic thread choice off
    (``mkl_set_dynamic(0)``). Left on (MKL's default while torch's count is never set), MKL may run a GEMM on fewer
    threads than it was given, and a GEMM's float sums then come out in another order: the same model, optimizer
    and batches give other last bits. That is how a resumed run once ended 1 ulp away from the uninterrupted one
    (the crash sweep's ``kill-orchestrator@ROTATE:0+0.196`` under CI's load: its retrained visit's last loss was
    bit for bit the one MKL on one thread gives). Pinned, every GEMM uses the same threads on every run, resumed
    or not."""
    import torch

    count = requested or torch.get_num_threads()
    torch.set_num_threads(count)
    return count


def serve_from_args(ns: argparse.Namespace, build: Callable[[argparse.Namespace], DeviceService]) -> None:
    """Keep freed memory (``core/allocator.py``: glibc's malloc set before the service's threads start, unless
    ``GPUTRAVEL_KEEP_FREED_MEMORY=0``), pin the torch threads (``pin_threads``), build the service from parsed
    options (a refused build or setting prints ``ERROR`` and exits with its code), say which device it holds
    (``DEVICE cpu``, ``DEVICE cuda:0 (name)``), then serve until shut down."""
    try:
        keep_freed_memory()
        pin_threads(ns.threads)
        service = build(ns)
    except GpuTravelError as exc:
        print(f"ERROR {exc}", flush=True)
        sys.exit(exc.exit_code)
    from gputravel.core.device.memory import device_label

    # The orchestrator names the device from this line (it never imports torch for it): before READY.
    print(f"DEVICE {device_label(service.device)}", flush=True)
    DeviceServer(service, ns.socket, data_host=ns.data_host or None, data_port=ns.data_port).serve_forever()


def main(argv: list[str] | None = None) -> None:
    from gputravel.core.device.service import load_service

    parser = device_arg_parser("python -m gputravel.core.device",
                               "Run the emulated confidential GPU's device service.")
    serve_from_args(parser.parse_args(argv), lambda ns: load_service(
        ns.state_dir, buffer_bytes=ns.buffer_bytes, device=ns.device, cc_mode=ns.cc_mode,
        allow_fault_injection=ns.allow_fault_injection, cipher_engine=ns.cipher_engine))
