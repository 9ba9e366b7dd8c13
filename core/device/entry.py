"""The device service's command line: ``python -m gputravel.core.device`` (the fleet's device adds its
identity to the same options, core/fleet/device.py), built, then served by :class:`DeviceServer`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from gputravel.core.device.server import DeviceServer
from gputravel.core.device.service import DeviceService
from gputravel.core.errors import GpuTravelError

__all__ = ["device_arg_parser", "main", "serve_from_args"]


def device_arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The device service's command line (the fleet's device adds its identity to it)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--buffer-bytes", type=int, required=True)
    parser.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    parser.add_argument("--cc-mode", default="on", choices=["on", "off", "devtools"])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    parser.add_argument("--allow-fault-injection", action="store_true")
    parser.add_argument("--data-host", default="127.0.0.1", help="address of the TCP data port ('' for none)")
    parser.add_argument("--data-port", type=int, default=0)
    parser.add_argument("--cipher-engine", default="auto", choices=["auto", "cpu", "gpu"],
                        help="who opens provisioning chunks: cryptography on the CPU, or the GPU cipher")
    return parser


def serve_from_args(ns: argparse.Namespace, build: Callable[[argparse.Namespace], DeviceService]) -> None:
    """Build the service from parsed options (a refused build prints ``ERROR`` and exits with its code),
    then serve until shut down."""
    if ns.threads:
        import torch

        torch.set_num_threads(ns.threads)
    try:
        service = build(ns)
    except GpuTravelError as exc:
        print(f"ERROR {exc}", flush=True)
        sys.exit(exc.exit_code)
    DeviceServer(service, ns.socket, data_host=ns.data_host or None, data_port=ns.data_port).serve_forever()


def main(argv: list[str] | None = None) -> None:
    from gputravel.core.device.service import load_service

    parser = device_arg_parser("python -m gputravel.core.device",
                               "Run the emulated confidential GPU's device service.")
    serve_from_args(parser.parse_args(argv), lambda ns: load_service(
        ns.state_dir, buffer_bytes=ns.buffer_bytes, device=ns.device, cc_mode=ns.cc_mode,
        allow_fault_injection=ns.allow_fault_injection, cipher_engine=ns.cipher_engine))
