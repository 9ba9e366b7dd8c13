"""``gputravel holder serve``: the agent a holder runs under its restricted key's forced command (issue 30).

It reads the holder's own configuration (``agents.holder.config``) and nothing else decides what it trusts: no
option, environment variable or file of the orchestrator's reaches it (the forced command ignores the command the
orchestrator asks for, and SSH passes no environment the holder did not allow). Attestation is not optional: every
hand-off needs the holder's own ok verdict on the CVM and the GPU (no verdict, no data), a key in the clear is
refused, a conventional hand-off is refused unless the holder allowed it and is then sealed to the attested CVM.
Run parameters (the run id, epochs, windows) arrive in the protocol and are checked there; the run id names the
folder of that run's receipts only after it is checked as a name.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import BinaryIO

from gputravel.agents.holder.agent import Agent
from gputravel.agents.holder.config import HolderConfig
from gputravel.agents.holder.dataset import open_dataset
from gputravel.agents.holder.receipts import ReceiptBook
from gputravel.core.protocol import FrameType, write_frame
from gputravel.core.protocol.errors import DataError, GpuTravelError
from gputravel.core.protocol.holderlink import Refusal

__all__ = ["build_agent", "serve"]


def build_agent(config: HolderConfig, out: BinaryIO, inp: BinaryIO) -> Agent:
    """The holder-pinned agent of ``config`` on this pair of streams (``GpuTravelError`` if it cannot start)."""
    try:
        from gputravel.agents.holder.attest import HolderAttestation
        from gputravel.core.evidence.holder_check import HolderVerifier
    except ImportError as exc:
        raise DataError(f"this holder cannot attest: {exc} (install dcap-qvl and cryptography in "
                        f"{sys.executable})") from None
    try:
        data = open_dataset(config.data, val_fraction=config.val_fraction)
    except OSError as exc:
        raise DataError(f"{exc.filename or config.data}: cannot read the dataset: {exc.strerror or exc}") from None
    attestation = HolderAttestation(
        HolderVerifier(config.policy, config.golden),
        policy={"source": "holder", "sha256": config.policy_sha256, "roots": dict(config.roots),
                "mr_td_policy": config.mr_td_policy},
        allow_conventional=config.allow_conventional)
    return Agent(config.name, data, out, inp, attestation=attestation,
                 receipts=ReceiptBook(config.receipts, config.name))


def serve(folder: Path | None = None) -> int:
    """Serve one orchestrator connection on stdin/stdout; 2 when the configuration refuses (said in an ERROR frame
    the orchestrator reads, and on stderr)."""
    out, inp = sys.stdout.buffer, sys.stdin.buffer
    sys.stdout = sys.stderr  # nothing but frames may reach the real stdout
    try:
        agent = build_agent(HolderConfig.load(folder), out, inp)
    except GpuTravelError as exc:
        print(f"gputravel holder serve: {exc.reason}", file=sys.stderr)
        write_frame(out, FrameType.ERROR, Refusal(exc.code, exc.reason).to_wire())
        out.flush()
        return 2
    return agent.run()
