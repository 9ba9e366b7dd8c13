"""Wiring a run's holder attestation (issue 22 item 5) onto its links, before its agents start.

Apart from ``holder_attest`` (the attestor itself, which the framed link uses) so that neither that module
nor the links need to know each other or the engine: this one knows the link types and the run's parts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gputravel.core.config import RunSettings
from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.protocol.holderlink import Verdict
from gputravel.core.travel.audit import Audit
from gputravel.core.travel.framed_link import Attesting, FramedLink
from gputravel.core.travel.handoff_relay import RelayFn
from gputravel.core.travel.holder_attest import HolderAttestor, SimCvm, holder_args
from gputravel.core.travel.holders import HolderLink
from gputravel.core.travel.local_link import LocalHolderLink
from gputravel.core.travel.visits import Itinerary

__all__ = ["attach", "device_relay"]


def device_relay(client: Callable[[], DeviceClient]) -> RelayFn:
    """The framed links' ``relay``: the device session's client (``client()``, now) asks the device to write a
    HANDOFF on the holder's parked data connection (``DeviceClient.relay``)."""
    def relay(holder: str, epoch: int, handoff: dict[str, Any]) -> bool:
        return client().relay(holder=holder, epoch=epoch, handoff=handoff)
    return relay


def attach(*, out_dir: Path, run_id: str, settings: RunSettings, links: Mapping[str, HolderLink], audit: Audit,
           walk: Itinerary, client: Callable[[], DeviceClient]) -> HolderAttestor:
    """Wire a run's holder attestation (before its agents start): the SIM CVM of the run's platform folder,
    the attestor on every framed link, local agents started attesting, each verdict in the ledger and in the
    record of the visit walked (``walk.current``). ``client`` gives the device session's client now."""
    platform_dir = Path(out_dir) / "platform"
    attestor = HolderAttestor(run_id=run_id, cvm=SimCvm.load(platform_dir, settings.cvm_kind), client=client,
                              inject=settings.holder_inject)

    def on_verdict(holder: str, verdict: Verdict) -> None:
        claim = verdict.failed_claim
        report = verdict.report()
        # whose policy it was is the orchestrator's to say, not the agent's: the one it passed (managed), or the
        # holder's own (a holder-pinned link, issue 30); the digest and roots are as the agent stated them
        link = links.get(holder)
        report["policy_source"] = link.session.policy_source if isinstance(link, FramedLink) else "orchestrator"
        audit.row("holder-attestation", phase="PROVISION", holder=holder, epoch=verdict.epoch,
                  outcome="ok" if verdict.ok else "refused", duration_s=verdict.ms / 1e3,
                  detail={"claim": claim, **report})
        rec = walk.current
        if rec is not None and rec.plan.holder == holder:
            if rec.holder_attestation is not None and rec.holder_attestation.get("ms") is not None:
                report["ms"] = round(report["ms"] + rec.holder_attestation["ms"], 3)  # several keys a visit
            rec.holder_attestation = report
            if claim is not None:
                rec.holder_refusals.append(claim)

    same_host = settings.transport in ("local", "ssh")  # the embedded SSH server runs on this host
    for link in links.values():
        if isinstance(link, FramedLink):
            link.session.attestor, link.session.on_verdict = attestor, on_verdict
            # the HANDOFF off the SSH link's path (docs/performance.md)
            link.session.relays.fn = device_relay(client) if settings.handoff_relay else None
        # local agents and the embedded server's pin the SIM platform's files; an inventory host's agent pins
        # its operator's own (``SshHolderLink.attest_files``) or does not attest
        pins = isinstance(link, LocalHolderLink) or same_host
        if pins and isinstance(link, Attesting) and link.attest_files is None:
            link.attest_files = holder_args(platform_dir)
    return attestor
