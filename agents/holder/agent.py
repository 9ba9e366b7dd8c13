"""The holder agent: runs in a data holder's confidential VM, next to its private dataset.

Small and deployable: standard library, ``cryptography`` and ``gputravel.core.protocol`` only; an attesting
agent (``--attest-policy``, ``--golden``: ``attest``) adds ``dcap_qvl`` and the SPDM/TDX part of
``core.evidence`` (``python -m gputravel.agents.holder`` runs ``main``).
It speaks length-prefixed frames on stdin/stdout (locally, or through an SSH channel), in the typed
vocabulary of ``core.protocol.holderlink``:

    agent -> HELLO (Hello; an attesting agent adds its nonce and key-exchange key)
    orch  -> ATTEST (Attest: the CVM's TDX quote, the GPU's SPDM report)   agent -> VERDICT (Verdict)
    orch  -> HANDOFF (Handoff, with its ProvisioningKey, wrapped for an attesting agent after an ok VERDICT)
    agent -> CHUNK {e, s, o, n} + AES-GCM(ciphertext||tag)   ... device -> ACK {s} / ERROR (Refusal)
             (direct path: the chunks go to the device on the agent's DataOpen connection; the agent
             reports Progress and forwards Refusals on this link)
    agent -> DONE (Done)
    orch  -> BYE (Bye)

The agent never sees any key but the one of the hand-off it is given, and that key only opens a
write window in the GPU's buffer for one epoch. Plaintext never leaves this process.

The modules: ``dataset`` (the holder's files, read by range), ``link`` (this end of the holder link),
``dataconn`` (the direct path's connection to the device and its shared-memory ring), ``provision`` (one
hand-off: seal, send, acknowledgements, retransmission), ``receipts`` (the holder's records: its witness of the
ledger heads, a holder-pinned agent's receipts) and this run loop.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, NoReturn

from gputravel.agents.holder.bundle import agent_sha256
from gputravel.agents.holder.dataconn import DataLinkLost, RelayedFrame
from gputravel.agents.holder.dataset import Dataset, open_dataset
from gputravel.agents.holder.link import AgentLink, SendFailed
from gputravel.agents.holder.provision import Provisioner
from gputravel.agents.holder.receipts import HolderRecords, ReceiptBook
from gputravel.agents.holder.relayed import RelayedCopies
from gputravel.core.protocol import FrameType, write_frame
from gputravel.core.protocol.errors import DataError, FrameError, GpuTravelError
from gputravel.core.protocol.holderlink import Attest, Bye, Handoff, Hello, Refusal

if TYPE_CHECKING:  # imported when the agent attests: a holder that does not needs no dcap_qvl
    from gputravel.agents.holder.attest import HolderAttestation

__all__ = ["AGENT_VERSION", "Agent", "exit_now", "main"]

AGENT_VERSION = "1"


class Agent(Provisioner):
    """Says HELLO, then provisions each HANDOFF until BYE or the end of the link."""

    def __init__(self, name: str, data: Dataset, out: BinaryIO, inp: BinaryIO, *,
                 witness: Path | None = None, attestation: HolderAttestation | None = None,
                 receipts: ReceiptBook | None = None) -> None:
        super().__init__(name, data, AgentLink(out, inp))
        #: an attesting agent (``--attest-policy``) takes a key only after its own ok verdict on ATTEST
        self.attestation = attestation
        #: the holder's own records: the ledger heads it was shown (``witness``) and, for a holder-pinned agent
        #: (``holder serve``), its receipts and per-run witness in the holder's folder
        self.records = HolderRecords(name, witness=witness, receipts=receipts)
        #: which copy of a HANDOFF (the holder link's, or relayed by the device) is taken
        self.relays = RelayedCopies(name)

    def hello(self) -> Hello:
        att = self.attestation
        policy = att.policy if att else {}
        return Hello(name=self.name, version=AGENT_VERSION, fmt=self.data.fmt, train_bytes=self.data.train.length,
                     val_bytes=self.data.val.length, files=self.data.files, agent_sha256=agent_sha256(),
                     pid=os.getpid(), nonce=att.nonce.hex() if att else None,
                     link_pub=att.link_key.public.hex() if att else None,
                     policy_sha256=policy.get("sha256"), policy_source=policy.get("source"))

    def run(self) -> int:
        self.send_msg(self.hello())
        self.link.start_reader(self._inbox)
        try:
            while True:
                frame = self._inbox.get()
                if isinstance(frame, (DataLinkLost, SendFailed)):  # between hand-offs: the next one reconnects
                    continue
                if frame is None or isinstance(frame, Exception):
                    return 0 if frame is None else 4
                if frame.type is FrameType.HANDOFF:
                    self.handoff(frame.header, relayed=isinstance(frame, RelayedFrame))
                elif frame.type is FrameType.ATTEST:
                    self.attest(frame.header, frame.payload)
                elif frame.type is FrameType.PING:
                    self.send(FrameType.PONG, frame.header)
                elif frame.type is FrameType.BYE:
                    try:
                        bye = Bye.from_wire(frame.header)
                    except GpuTravelError:
                        return 0
                    self.records.keep_witness(bye, at="end")  # the head after every visit of the run
                    self.records.keep_rows(bye)
                    return 0
        finally:
            self._drop_data()

    def handoff(self, header: dict[str, object], *, relayed: bool) -> None:
        """One HANDOFF, from the holder link or relayed by the device on the parked data connection (``relayed``):
        which copy is taken, ``RelayedCopies``."""
        read_ns = time.perf_counter_ns()  # the set-up stage starts here
        cpu_ns = time.process_time_ns()  # and the hand-off's CPU account (``cpu_s``)
        try:
            handoff = Handoff.from_wire(header)  # validated once; the key is typed from here
        except GpuTravelError as exc:
            if relayed:
                self.relays.ignore(f"malformed ({exc.reason})")
            else:
                self.send_msg(Refusal(exc.code, exc.reason))
            return
        if not self.relays.take(handoff, relayed=relayed, attestation=self.attestation):
            return
        self.handoff_read_ns, self.handoff_cpu_ns = read_ns, cpu_ns
        try:
            if self.attestation is not None:  # refused unless attested: the key is never used
                handoff = self.attestation.accept(handoff)
            self.key_taken_ns = time.perf_counter_ns()
            self.records.keep_witness(handoff)
            self.provision(handoff)
            self.records.keep_receipt(handoff, self.attestation.last if self.attestation else None)
        except GpuTravelError as exc:
            self.send_msg(Refusal(exc.code, exc.reason))

    def attest(self, header: dict[str, object], payload: bytes | bytearray | memoryview) -> None:
        """Verify the CVM and the GPU for the next hand-off and send the verdict (a refusal names the claim)."""
        if self.attestation is None:
            self.send_msg(Refusal("attestation", "this agent does not attest (no --attest-policy)"))
            return
        try:
            verdict = self.attestation.verify(Attest.from_frame(header, payload))
        except FrameError as exc:
            self.send_msg(Refusal(exc.code, exc.reason))
            return
        if not verdict.ok:
            print(f"gputravel agent {self.name}: attestation refused ({verdict.failed_claim}); no key taken",
                  file=sys.stderr)
        self.send_msg(verdict)


def exit_now(code: int) -> NoReturn:
    """End the agent's process once its run loop returned (issue 30 item 7). Its reader thread may still be blocked
    reading stdin (an orchestrator that keeps the link open after BYE): the interpreter's shutdown would then abort
    on that stream's lock (SIGABRT, "could not acquire lock for <stdin>"). Everything the agent wrote is flushed
    first; nothing else is left to clean up (its files are written whole as it goes)."""
    for stream in (sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gputravel-agent", description="gputravel holder agent (stdio framing)")
    parser.add_argument("--name", required=True)
    parser.add_argument("--data", required=True, type=Path)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--witness", type=Path, default=None,
                        help="append the ledger head stated at each hand-off to this file (~ expands)")
    parser.add_argument("--attest-policy", type=Path, default=None,
                        help="attest the CVM and the GPU before each key: evidence policy pinning the roots")
    parser.add_argument("--golden", type=Path, default=None,
                        help="the GPU's golden measurements this holder approved (JSON; with --attest-policy)")
    ns = parser.parse_args(argv)
    out, inp = sys.stdout.buffer, sys.stdin.buffer
    sys.stdout = sys.stderr  # nothing but frames may reach the real stdout
    try:
        try:
            data = open_dataset(ns.data, val_fraction=ns.val_fraction)
        except OSError as exc:  # e.g. another holder's folder: permission denied, named rather than a traceback
            raise DataError(f"{exc.filename or ns.data}: cannot read the dataset: {exc.strerror or exc}") from None
        attestation = None
        if ns.attest_policy is not None:
            if ns.golden is None:
                raise DataError("--attest-policy needs --golden (the GPU measurements this holder approved)")
            try:
                from gputravel.agents.holder.attest import HolderAttestation
            except ImportError as exc:  # named, rather than a traceback the orchestrator never sees
                raise DataError(f"this holder cannot attest: {exc} (install dcap-qvl and cryptography in "
                                f"{sys.executable})") from None
            attestation = HolderAttestation.load(ns.attest_policy.expanduser(), ns.golden.expanduser())
    except GpuTravelError as exc:
        write_frame(out, FrameType.ERROR, Refusal(exc.code, exc.reason).to_wire())
        out.flush()
        return 2
    return Agent(ns.name, data, out, inp, witness=ns.witness.expanduser() if ns.witness else None,
                 attestation=attestation).run()
