"""What a fleet adds to a run's settings (``FleetOptions``), and the all-reduce variants a fleet may run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from gputravel.core.collectives.ring import Variant
from gputravel.core.errors import ConfigError

__all__ = ["FLEET_VARIANTS", "FleetOptions"]

#: the all-reduce variants a fleet may run (the DDP hook's)
FLEET_VARIANTS = (Variant.SECURE_PIPELINED, Variant.SECURE_NAIVE, Variant.RING, Variant.PLAIN)


@dataclass(frozen=True, kw_only=True)
class FleetOptions:
    """What a fleet adds to a run's settings."""

    gpus: int = 1
    #: the gradient all-reduce: secure_pipelined (default), secure_naive, ring (plaintext) or plain
    variant: str = Variant.SECURE_PIPELINED.value
    #: the device group's backend; None: nccl where the devices are CUDA, else gloo
    backend: str | None = None
    #: seconds a rank waits for the others (agreements, the ring) before the job fails
    timeout_s: float = 900.0
    #: seconds a worker waits for every worker's first post (its hello in the fleet key agreement) before it names
    #: the missing ranks and their nodes (``FleetJoinError``); at most ``timeout_s``
    join_timeout_s: float = 120.0
    #: fault injection (tests, demos; needs allow_fault_injection): ``flip@R``/``replay@R`` on the ring's hops
    ring_fault: str | None = None

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ConfigError("--gpus must be >= 1")
        if self.variant not in {v.value for v in FLEET_VARIANTS}:
            raise ConfigError(f"fleet all-reduce variant {self.variant!r} is not one of "
                              f"{', '.join(v.value for v in FLEET_VARIANTS)}")
        if self.backend not in (None, "gloo", "nccl"):
            raise ConfigError("the device group's backend is gloo or nccl")
        if self.timeout_s <= 0 or self.join_timeout_s <= 0:
            raise ConfigError("the fleet's timeouts (--join-timeout included) must be positive")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FleetOptions:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown fleet options: {', '.join(sorted(unknown))}")
        return cls(**data)

