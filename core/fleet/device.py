"""A fleet member's device service: the emulated confidential GPU, plus the fleet's three operations.

``fleet_join`` makes the device a rank of the device group (see :mod:`gputravel.core.fleet.ddp`),
``fleet_train`` runs one lock-step step on its buffer with the gradient all-reduced over the sealed ring,
``fleet_leave`` leaves the group: :class:`FleetPart`, added to a plain :class:`DeviceService` (no subclass). Run it with
``python -m gputravel.core.fleet.device`` (the same options as ``python -m gputravel.core.device``, plus
``--device-id``: every device of a fleet has its own identity under the fleet's vendor root).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from cryptography import x509

from gputravel.core.attestation import CCMode, DeviceIdentity, provision_emulated
from gputravel.core.collectives.ring import RingFault
from gputravel.core.device.entry import device_arg_parser, serve_from_args
from gputravel.core.device.service import DeviceService, Handler, Reply
from gputravel.core.errors import (
    CollectiveAbortedError,
    ConfigError,
    DeviceError,
    GpuTravelError,
    TagError,
)
from gputravel.core.fleet.ddp import FleetRing

__all__ = ["FLEET_OPS", "FleetPart", "fleet_device_service", "main"]

#: the fleet's operations, by their wire names
FLEET_OPS = ("fleet_join", "fleet_train", "fleet_leave")


class FleetPart:
    """The fleet's part of a device service: it owns the device group's ring and the drift fault, and adds its
    three entries (``FLEET_OPS``) to the service's one operation table. ``fleet_train`` shares ``train``'s
    guards (:meth:`~gputravel.core.device.model.ModelSlot.check_train_ranges`); everything else it reads from
    the service it was added to (identity, buffer, trainer, counters)."""

    def __init__(self, service: DeviceService) -> None:
        self.service = service
        self.ring: FleetRing | None = None
        self.drift = False  # fault injection: this replica drifts after every step (a diverging replica)

    def operations(self) -> dict[str, Handler]:
        """The fleet's entries of the operation table, by their wire names (``FLEET_OPS``)."""
        return {"fleet_join": self.op_fleet_join, "fleet_train": self.op_fleet_train,
                "fleet_leave": self.op_fleet_leave}

    def op_fleet_join(self, *, host: str, port: int, prefix: str, rank: int, world: int, variant: str,
                      backend: str | None = None, timeout_s: float = 300.0, fault: str | None = None,
                      expected: list[str] | None = None, payload: bytes) -> Reply:
        """Join the device group on the job's c10d store; ``payload``: the vendor's CRL (PEM) or empty.
        The ring's neighbours are verified against the vendor root this device was provisioned with.
        ``fault`` (fault injection, only where enabled): ``flip@R`` / ``replay@R``, device R tampers with
        the first hop it sends in every all-reduce (``replay``: from the second on); ``drift@R``, device R's
        replica drifts from the others' after every step (a diverging replica). ``expected``: every rank's
        device (``"device_id:key fingerprint"``) as the workers attested them; a ring neighbour must be it."""
        svc = self.service
        if self.ring is not None:
            raise DeviceError("this device is already in a fleet")
        ring_fault = None
        if fault:
            if not svc.allow_fault_injection:
                raise DeviceError("fault injection is disabled on this device")
            kind, _, who = fault.partition("@")
            if not who.isdigit():
                raise ConfigError(f"ring fault {fault!r} is flip@RANK, replay@RANK or drift@RANK")
            if kind == "drift":
                self.drift = int(who) == int(rank)
            else:
                ring_fault = RingFault(kind, rank=int(who))
        if expected is not None and (not isinstance(expected, list) or len(expected) != int(world)
                                     or not all(isinstance(e, str) for e in expected)):
            raise ConfigError("fleet_join: expected names one device per rank")
        crl = None
        if payload:
            try:
                crl = x509.load_pem_x509_crl(bytes(payload))
            except ValueError as exc:
                raise ConfigError(f"fleet_join: the revocation list does not parse: {exc}") from None
        backend = backend or ("nccl" if svc.device.type == "cuda" else "gloo")
        try:
            self.ring = FleetRing(trainer=svc.need_trainer(), host=host, port=int(port), prefix=prefix,
                                  rank=int(rank), world=int(world), identity=svc.identity,
                                  root=svc.identity.chain[-1], crl=crl, variant=variant, backend=backend,
                                  timeout_s=float(timeout_s), fault=ring_fault, expected_peers=expected)
        except GpuTravelError:
            raise
        except (RuntimeError, ValueError, OSError) as exc:
            raise DeviceError(f"fleet_join: {type(exc).__name__}: {exc}") from None
        svc.counters["fleet_joins"] += 1
        return Reply({"rank": int(rank), "world": int(world), "backend": backend,
                      "device_id": svc.identity.device_id, **self.ring.peers()})

    def op_fleet_train(self, *, train_off: int, train_len: int, val_off: int, val_len: int, fmt: str,
                       weight: float, total_weight: float, steps: int, seed: int,
                       payload: bytes) -> Reply:
        """One lock-step step (see :meth:`FleetRing.train_step`); with weight 0 the buffer is not read."""
        if self.ring is None:
            raise DeviceError("fleet_train: this device is in no fleet (fleet_join first)")
        svc = self.service
        svc.check_train_ranges(train_off=train_off, train_len=train_len, val_off=val_off, val_len=val_len)
        svc.model_changed()
        try:
            res = self.ring.train_step(svc.buffer.tensor, train_off=train_off, train_len=train_len,
                                       val_off=val_off, val_len=val_len, fmt=fmt, weight=float(weight),
                                       total_weight=float(total_weight), steps=int(steps), seed=int(seed))
            if self.drift:  # fault injection: one parameter moves on this device alone
                import torch

                with torch.no_grad():
                    next(svc.need_trainer().model.parameters()).view(-1)[0] += 1e-3
        except GpuTravelError:
            raise
        except RuntimeError as exc:  # the hook's error, raised by DDP in backward (the replica is put back)
            raise _ring_error(str(exc)) from None
        finally:
            svc.model_changed()
        svc.counters["train_steps"] += len(res.losses)
        return Reply({**res.to_wire(), "model_digest": svc.model_digest()})

    def op_fleet_leave(self, *, payload: bytes) -> Reply:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        return Reply({"left": True})

def fleet_device_service(*, identity: DeviceIdentity, buffer_bytes: int, **kw: Any) -> DeviceService:
    """A device service with the fleet's part added (a plain :class:`DeviceService`, not a subclass): the
    fleet's three operations join its one table."""
    service = DeviceService(identity=identity, buffer_bytes=buffer_bytes, **kw)
    service.add_part(FleetPart(service).operations())
    return service


def _ring_error(text: str) -> GpuTravelError:
    """The ring's typed error back from DDP's RuntimeError (a rejected hop, or the abort it caused elsewhere)."""
    for cls in (TagError, CollectiveAbortedError):
        found = re.search(rf"{cls.__name__}: (.*?)(?: to Tensor)?$", text.splitlines()[0] if text else "")
        if found:
            return cls(f"{found.group(1)} (replica restored)")
    return DeviceError(f"fleet all-reduce failed, replica restored: {text}".splitlines()[0][:500])


def main(argv: list[str] | None = None) -> None:
    parser = device_arg_parser("python -m gputravel.core.fleet.device",
                               "Run one fleet member's emulated confidential GPU.")
    parser.add_argument("--device-id", required=True, help="this device's identity (emu-gpu-R)")

    def build(ns: argparse.Namespace) -> DeviceService:
        _, identity = provision_emulated(ns.state_dir, device_id=ns.device_id)
        service = fleet_device_service(identity=identity, buffer_bytes=ns.buffer_bytes, device=ns.device,
                                       cc_mode=CCMode(ns.cc_mode),
                                       allow_fault_injection=ns.allow_fault_injection,
                                       cipher_engine=ns.cipher_engine)
        service.spdm.state_dir = Path(ns.state_dir)  # the SIM GPU's identity the holders pin lives with the platform's
        return service

    serve_from_args(parser.parse_args(argv), build)


if __name__ == "__main__":
    main()
