"""The error tree. Every failure crossing a boundary is one of these, with a code and a reason.

``GpuTravelError`` is the root. Protocol errors live here (the holder agent imports them);
the engine-level ones (attestation, integrity, agents, data, recordings, the visit state machine,
collectives) are defined here too so there is exactly one tree in one file, and re-exported from
``gputravel.core.errors``.

Every class has a stable ``code`` (its key in ``ERRORS_BY_CODE``, and what crosses the wire) and an
``exit_code``: the CLI exits with it, and README's exit-code table names every class under its code
(``tests/console/cli/test_cli_errors.py`` checks both).
"""

from __future__ import annotations

from typing import Any


class GpuTravelError(Exception):
    """Root of every gputravel error. ``code`` is a stable short name, ``reason`` the human text."""

    code: str = "error"
    exit_code: int = 1
    #: what a command's JSON error object carries beside the reason (``console.cli.errors``; None: nothing)
    detail: dict[str, Any] | None = None

    def __init__(self, reason: str = "", *, code: str | None = None) -> None:
        self.reason = reason or self.__class__.__name__
        if code is not None:
            self.code = code
        super().__init__(self.reason)

    def __str__(self) -> str:  # "ReplayError: sequence 3 was already accepted"
        return f"{type(self).__name__}: {self.reason}"

    @classmethod
    def from_reason(cls, reason: str) -> GpuTravelError:
        """The error rebuilt from its wire form (code, reason)."""
        return cls(reason)


# --- protocol -------------------------------------------------------------------------------
class ProtocolError(GpuTravelError):
    """A message broke the wire protocol."""

    code = "protocol"
    exit_code = 4


class FrameError(ProtocolError):
    """A frame was truncated, oversized, of unknown type or otherwise malformed."""

    code = "frame"


class WireFormatError(FrameError):
    """A message's field is missing, of the wrong type or outside its declared bounds (``core/protocol/wire.py``);
    ``field`` names it (``Message.field``)."""

    code = "wire-format"

    def __init__(self, reason: str = "", *, field: str = "", code: str | None = None) -> None:
        self.field = field
        super().__init__(reason, code=code)

    @classmethod
    def from_reason(cls, reason: str) -> GpuTravelError:
        return cls(reason, field=reason.partition(":")[0])


class TagError(ProtocolError):
    """AES-GCM authentication failed: ciphertext, tag or AAD were altered, or the key is wrong."""

    code = "tag"


class ReplayError(ProtocolError):
    """A sequence number was already accepted, or is older than the replay window allows."""

    code = "replay"


class StaleEpochError(ProtocolError):
    """A message was sealed under an epoch whose key is no longer valid."""

    code = "stale-epoch"


class WindowError(ProtocolError):
    """A write targeted bytes outside the buffer window its key is valid for."""

    code = "window"


class NonceExhaustedError(ProtocolError):
    """A cipher state reached its counter limit; the key must be rotated before use."""

    code = "nonce-exhausted"


class FleetAuthError(ProtocolError):
    """A message between a fleet's ranks (the worker group, over torchrun's unauthenticated store and gloo)
    does not authenticate under the fleet's key: injected, altered, replayed or relabelled. Refused, never used."""

    code = "fleet-auth"


# --- engine level ---------------------------------------------------------------------------
class AttestationError(GpuTravelError):
    """The device's evidence did not verify (chain, revocation, nonce, measurements or mode)."""

    code = "attestation"
    exit_code = 3


class IntegrityError(GpuTravelError):
    """The device's measurement of code or model regions differs from the expected one."""

    code = "integrity"
    exit_code = 5


class AgentError(GpuTravelError):
    """A holder agent failed, died, or could not be reached."""

    code = "agent"
    exit_code = 6

    def __init__(self, host: str, reason: str) -> None:
        self.host = host
        super().__init__(f"{host}: {reason}")

    @classmethod
    def from_reason(cls, reason: str) -> GpuTravelError:
        host, _, rest = reason.partition(": ")
        return cls(host, rest)


class HolderLinkError(GpuTravelError):
    """The holder's side of its link to the device failed (the data connection refused, the device's ring
    answer malformed or not the one asked for): raised in the agent, sent as a refusal with the code ``agent``
    (exit 6), so the orchestrator reads it as the ``AgentError`` it always was."""

    code = AgentError.code
    exit_code = AgentError.exit_code


class HolderAttestationError(AttestationError):
    """The holder refused to take a key: no attested evidence for this hand-off, another epoch, or a wrapped key
    that is not the attested one. Raised in the agent, sent with the code ``attestation`` (exit 3)."""


class LinkLostError(AgentError):
    """The connection to a holder dropped (not the agent failing): the transfer can resume."""

    code = "link-lost"


class DeviceError(GpuTravelError):
    """The device service refused a request or is unreachable."""

    code = "device"
    exit_code = 7


class GpuCipherError(DeviceError):
    """The GPU cipher could not run: toolkit missing, bad key or nonce, or a buffer it cannot use."""

    code = "gpu-cipher"


class FleetDeviceLostError(DeviceError):
    """A fleet's device died: it cannot rejoin the formed device group, so every rank stops at the step's
    agreement with its last sealed checkpoint; ``--resume`` (or torchrun's elastic restart) continues."""

    code = "fleet-device-lost"


class DataError(GpuTravelError):
    """A dataset is missing, empty or malformed."""

    code = "data"
    exit_code = 2


class WeightsError(DataError):
    """A pretrained weights file or model folder is malformed, lying about its sizes, sparse, of an unsupported
    dtype or holds NaN/Inf: refused before the run starts."""

    code = "weights"


class ConfigError(GpuTravelError):
    """A setting, policy or file given by the operator is invalid."""

    code = "config"
    exit_code = 2


class InsecureKeyError(ConfigError):
    """A private key file is group- or world-accessible, or belongs to another user: it is refused, not used."""

    code = "insecure-key"


class RecordingError(GpuTravelError):
    """A recording cannot be written, opened or read (missing, not a recording, another version)."""

    code = "recording"
    exit_code = 2


class LedgerError(GpuTravelError):
    """The audit ledger is unreadable or its hash chain is broken."""

    code = "ledger"
    exit_code = 8


class StorageError(GpuTravelError):
    """The run folder refused a write of the run's durable state (its ledger, recording or a checkpoint):
    the run stops; what was committed before stays, and ``--resume`` continues once the cause is gone."""

    code = "storage"
    exit_code = 12


class DiskFullError(StorageError):
    """The disk (or quota) holding the run folder is full: no space for the ledger, recording or a checkpoint.
    What was committed stays; free space and ``gputravel run --resume`` continues."""

    code = "disk-full"


class ReplicaDivergedError(IntegrityError):
    """A fleet's replicas differ after a step (a device's model is not the fleet's): every rank stops; the
    step is not committed, so ``--resume`` continues from the last step whose replicas were equal."""

    code = "replica-diverged"


class TransitionError(GpuTravelError):
    """The engine asked its visit state machine for an illegal phase transition: a bug in gputravel, not bad input."""

    code = "transition"
    exit_code = 11


class CancelledRunError(GpuTravelError):
    """The operator cancelled the run."""

    code = "cancelled"
    exit_code = 130


# --- secure collectives ----------------------------------------------------------------------
class CollectiveAbortedError(ProtocolError):
    """Another rank of the ring rejected a hop; this rank's result is discarded (zeroed)."""

    code = "collective-aborted"


class CollectiveError(GpuTravelError):
    """A secure collective (the ring, its DDP hook, their ranks) cannot run as asked or failed at run time."""

    code = "collective"
    exit_code = 10


class FleetJoinError(CollectiveError):
    """A fleet's worker (named by rank and node) never made its first post within the join deadline: its node died
    after torchrun's rendezvous, or never started its workers."""

    code = "fleet-join"


class WorkerError(CollectiveError):
    """One or more ranks of a collective job failed; ``errors`` maps rank -> (exception type name, message)."""

    code = "worker"

    def __init__(self, errors: dict[int, tuple[str, str]] | None = None, detail: str = "", *,
                 reason: str = "") -> None:
        self.errors = dict(errors or {})
        text = reason or "; ".join(f"rank {r}: {t}: {m}" for r, (t, m) in sorted(self.errors.items()))
        super().__init__(text + (f"\n{detail}" if detail else ""))

    @classmethod
    def from_reason(cls, reason: str) -> GpuTravelError:
        return cls(reason=reason)


class RankReportError(CollectiveError):
    """A fleet rank's report file (``rank-R/report.json``, the merged ``report.json``) is not what a rank writes:
    not JSON, not an object, or an error without a string code and reason. Named with the file."""

    code = "rank-report"


#: classes that travel under their parent's code (raised on a holder, read by the orchestrator as the parent)
WIRE_ALIASES: dict[type[GpuTravelError], type[GpuTravelError]] = {
    HolderLinkError: AgentError, HolderAttestationError: AttestationError,
}

ERRORS_BY_CODE: dict[str, type[GpuTravelError]] = {
    cls.code: cls
    for cls in (
        GpuTravelError, ProtocolError, FrameError, WireFormatError, TagError, ReplayError, StaleEpochError,
        WindowError, NonceExhaustedError, FleetAuthError, AttestationError, IntegrityError, AgentError, LinkLostError,
        DeviceError, FleetDeviceLostError, GpuCipherError, DataError, WeightsError, ConfigError, InsecureKeyError, RecordingError, LedgerError,
        StorageError, DiskFullError, ReplicaDivergedError, TransitionError, CancelledRunError, CollectiveAbortedError, CollectiveError, FleetJoinError, WorkerError,
        RankReportError,
    )
}


def error_from_code(code: str, reason: str) -> GpuTravelError:
    """Rebuild a typed error sent over the wire as (code, reason)."""
    cls = ERRORS_BY_CODE.get(code)
    if cls is None:  # a code this side does not know: the root class, the code kept
        return GpuTravelError(reason, code=code)
    return cls.from_reason(reason)


__all__ = [
    "ERRORS_BY_CODE", "WIRE_ALIASES", "AgentError", "AttestationError", "CancelledRunError", "CollectiveAbortedError",
    "CollectiveError", "ConfigError", "DataError", "DeviceError", "DiskFullError", "FleetAuthError", "FleetDeviceLostError", "FleetJoinError", "FrameError", "GpuCipherError", "GpuTravelError",
    "HolderAttestationError", "HolderLinkError", "InsecureKeyError", "IntegrityError", "LedgerError", "LinkLostError", "NonceExhaustedError", "ProtocolError",
    "RankReportError", "RecordingError", "ReplayError", "ReplicaDivergedError", "StaleEpochError", "StorageError", "TagError", "TransitionError", "WeightsError", "WindowError", "WireFormatError", "WorkerError",
    "error_from_code",
]
