"""One hand-off, the code the engine and ``bench provision`` share: open a provisioning window on the
device, let the holder provision it (resuming after a dropped link), close the window.

The device derives a key for one window and one epoch (``open_window``); the holder's link carries it to
the agent, whose sealed chunks reach the device's buffer (``provision``); closing the window kills the
key and says what arrived (``close_window``, ``require_complete``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import replace

from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.errors import DeviceError, LinkLostError, ProtocolError
from gputravel.core.platform.base import DeviceHandle
from gputravel.core.protocol.deviceanswers import WindowClosed, WindowStatus
from gputravel.core.protocol.holderlink import DataEndpoint, Handoff
from gputravel.core.travel.handoff_relay import Early
from gputravel.core.travel.holders import HolderLink, ProgressFn, ProvisionStats, RejectFn

__all__ = ["FIXED_STAGES", "STAGE_PARTS", "ResumeFn", "add_stages", "close_window", "data_endpoint", "fixed_stages",
           "open_window", "open_window_relaying", "provision", "require_complete", "resume", "sub_windows"]

#: the hand-off's fixed cost by stage (issue 34 item 2), in order: the device derives the window's key
#: (``window``), the orchestrator builds the holder's evidence (``attest``: the GPU's SPDM report over the
#: holder's nonce), the holder checks it and answers (``verdict``: ATTEST written to VERDICT read), the agent
#: takes the key and its data connection is admitted for the window (``admission``: HANDOFF written to the
#: device's admission), the shared-memory ring is bound (``ring_bind``), the first chunk is sealed, sent and
#: opened into device memory (``first_chunk``); after the data (the first chunk in device memory to the last,
#: ``data``, not a fixed cost), the last chunk's acknowledgement and the agent's DONE reach the orchestrator
#: (``done``; where the window's request was answered at completion, ``completion``, that answer)
FIXED_STAGES = ("window", "attest", "verdict", "admission", "ring_bind", "first_chunk", "done")

#: the ``admission`` and ``done`` stages split by who spends them (each a part of its stage, not added to
#: ``total``): ``admission_wrap`` the verdict to the HANDOFF's write (the key wrapped for the holder),
#: ``admission_send`` its write and flush, ``admission_agent`` the agent's HANDOFF read to its data connection's
#: admission sent (its key unwrapped, ``admission_key`` of that, the witness, the dataset's check), ``admission_device``
#: the device's DATA_OPEN read to admitted (the MAC checked), ``admission_transit`` the rest (the HANDOFF's way to
#: the agent, its wake-up, the DATA_OPEN's way to the device); ``done_agent`` the agent's last acknowledgement read
#: to its DONE built (0 where the device's answer ended the hand-off), ``done_transit`` the rest (the last
#: acknowledgement's way to the agent, DONE's to here; or the device's answer's way here).
#: The agent's parts are its own durations (its clock is never compared with this one)
STAGE_PARTS = ("admission_wrap", "admission_send", "admission_agent", "admission_device", "admission_transit",
               "done_agent", "done_transit")

#: (the error, reconnect attempt, the device's window status): a dropped link is about to be resumed
ResumeFn = Callable[[LinkLostError, int, WindowStatus], None]


def sub_windows(length: int, *, chunk_size: int, key_chunk_budget: int) -> list[tuple[int, int]]:
    """``(skip, length)`` pieces of a window so that no provisioning key seals more than
    ``key_chunk_budget`` chunks."""
    per_key = max(1, key_chunk_budget) * chunk_size
    return [(skip, min(per_key, length - skip)) for skip in range(0, length, per_key)]


def data_endpoint(handle: DeviceHandle, *, data_path: str, transport: str) -> DataEndpoint | None:
    """Where a holder sends sealed chunks on the direct path: the device's Unix socket for holders on
    this host (local agents, the embedded SSH server), its TCP data port for inventory hosts (which an
    SSH link reaches through a remote port forward unless the inventory says the network routes it).
    ``None`` on the other paths (the chunks ride the holder link)."""
    if data_path != "direct":
        return None
    if transport in ("local", "ssh"):
        return DataEndpoint(path=handle.socket_path)
    if handle.data_port is None:
        raise DeviceError("the direct data path needs the device's data port, which this device has not opened")
    return DataEndpoint(host=handle.data_host, port=handle.data_port)


async def open_window(client: DeviceClient, *, epoch: int, skip: int, length: int, chunk_size: int,
                      train: tuple[int, int], val: tuple[int, int], conventional: bool = False,
                      ledger_head: str | None = None) -> tuple[Handoff, str]:
    """A provisioning key for bytes [skip, skip+length) of the buffer in ``epoch``: the ``Handoff`` the
    holder gets, and the key's fingerprint.

    The key walks device -> orchestrator -> holder: ``BufferWindows.op_handoff`` derives it, the sealed
    control channel brings it here, asked from this loop with no worker thread (``DeviceClient.on_loop.handoff``'s
    ``HandoffGrant``, whose ``from_wire`` types it as a ``ProvisioningKey`` and checks it once), and the holder
    link forwards it inside the ``Handoff``."""
    grant = await client.on_loop.handoff(epoch=epoch, offset=skip, length=length, chunk_size=chunk_size)
    key = grant.provisioning_key
    if key.epoch != epoch or key.fingerprint != grant.key_fingerprint:
        raise DeviceError(f"the device granted a key of epoch {key.epoch} ({key.fingerprint}) for epoch {epoch} "
                          f"({grant.key_fingerprint})")
    handoff = Handoff.for_window(epoch=epoch, session_id=grant.session_id, key=key, skip=skip, length=length,
                                 chunk_size=chunk_size, train=train, val=val, conventional=conventional,
                                 ledger_head=ledger_head)
    return handoff, grant.key_fingerprint


async def open_window_relaying(client: DeviceClient, base: Handoff, early: Early, *, holder: str) -> str:
    """``open_window`` for ``base`` (a hand-off the orchestrator built with the key it derives itself, as the device
    will), its request carrying ``early.outgoing`` (that hand-off wrapped for ``holder``'s attested agent): the
    device opens the window and writes the HANDOFF on the holder's parked data connection before it answers
    (``early.delivered``). Returns the key's fingerprint; a grant of another key than ``base``'s is the device's
    error (``DeviceError``)."""
    grant = await client.on_loop.handoff(epoch=base.epoch, offset=base.skip, length=base.window_len,
                                         chunk_size=base.chunk_size, relay=(holder, early.outgoing.to_wire()))
    if base.key is None or grant.provisioning_key != base.key or grant.session_id != base.session_id:
        raise DeviceError(f"the device granted key {grant.key_fingerprint} for epoch {base.epoch}, not the one the "
                          f"session's secrets derive ({base.key.fingerprint if base.key else '-'})")
    early.delivered = grant.relayed
    return grant.key_fingerprint


async def provision(client: DeviceClient, link: HolderLink, handoff: Handoff, *, device_socket: str,
                    endpoint: DataEndpoint | None, on_progress: ProgressFn | None = None,
                    on_reject: RejectFn | None = None, on_resume: ResumeFn | None = None,
                    attempt: int = 0) -> ProvisionStats:
    """Provision; when the link to the holder drops (not the agent failing), reconnect and resume from
    the device's last contiguous acknowledged chunk: nothing is sent twice into the buffer and nothing
    is lost. ``attempt``: the drops already resumed (``completion.provision_visit`` made the first try itself)."""
    while True:
        try:
            return await link.provision(handoff, device_socket=device_socket, on_progress=on_progress,
                                        on_reject=on_reject, data_endpoint=endpoint)
        except LinkLostError as exc:
            attempt += 1
            handoff = await resume(client, link, handoff, exc, attempt, on_resume)


async def resume(client: DeviceClient, link: HolderLink, handoff: Handoff, exc: LinkLostError, attempt: int,
                 on_resume: ResumeFn | None) -> Handoff:
    """After ``link``'s ``exc`` (its ``attempt``-th drop): reconnect and return the hand-off resumed from the
    device's last contiguous acknowledged chunk, or raise ``exc`` (too many drops, or the window is not open)."""
    if attempt > link.max_reconnects:
        raise exc
    status = await asyncio.to_thread(client.window_status)
    if not status.open or status.epoch != handoff.epoch:
        raise exc
    if on_resume is not None:
        on_resume(exc, attempt, status)
    await link.reconnect()
    return replace(handoff, resume_from=status.contiguous)


async def close_window(client: DeviceClient, handoff: Handoff) -> WindowClosed:
    """The holder returned: its key dies; what the window received."""
    return await asyncio.to_thread(client.close_window, epoch=handoff.epoch)


def fixed_stages(*, window_ns: tuple[int, int], stats: ProvisionStats, closed: WindowClosed) -> dict[str, float]:
    """One hand-off's fixed cost by stage (``FIXED_STAGES``), milliseconds, and their ``total``.

    ``window_ns``: ``perf_counter_ns`` before asking for the window's key and when the grant came back;
    ``stats.marks_ns``: the link's moments (``ProvisionStats``); ``closed.marks_ns``: the device's, in ns after
    the window opened. No clock is compared across processes: the device's window opened somewhere between
    ``w0`` and ``w1``, and it is placed at the latest such moment that keeps the order both sides saw (the
    device's last chunk came before the agent's DONE).
    Placed at ``w1`` alone, a loaded machine's slow way back for the grant (milliseconds under two test workers)
    pushed the device's marks past the agent's DONE, and the clamped ``done`` stage made the stages add up to
    more than the hand-off. A stage that did not happen (no holder attestation, no ring, a device that does not
    mark) is 0.

    A window whose request was answered at completion (``answered`` among the device's marks: ``completion``) has
    ``window_ns`` end at that answer: the device's window opened at ``w0`` plus half the round trip beyond the
    device's own time (the request's way and the answer's taken as equal); its HANDOFF was relayed as it opened
    (``admission`` from there), and ``done`` ends at the answer (``stats.marks_ns["done"]``)."""
    w0, w1 = window_ns
    link = stats.marks_ns
    answered = closed.marks_ns.get("answered")
    if answered is not None:
        opened = w0 + max(0, w1 - w0 - int(answered)) // 2
        sent = key_out = opened
    else:
        sent = link.get("handoff_sent", w1)
        key_out = link.get("verdict", sent)  # from the verdict: the key wrapped for the holder, HANDOFF written
        opened = _device_window_opened(w0, w1, closed.marks_ns, done=link.get("done"))
    dev = {name: opened + int(ns) for name, ns in closed.marks_ns.items()}
    admitted = dev.get("admitted", sent)
    bound = dev.get("ring_bound", max(sent, admitted))
    ready = max(sent, admitted, bound)
    first = dev.get("first_chunk", ready)
    last = dev.get("last_chunk", first)
    ns = {"window": w1 - w0 if answered is None else opened - w0,
          "attest": link["attest_sent"] - link["attest_begun"] if "attest_sent" in link else 0,
          "verdict": link["verdict"] - link["attest_sent"] if "verdict" in link else 0,
          "admission": max(0, admitted - key_out),
          "ring_bind": max(0, bound - max(sent, admitted)),
          "first_chunk": max(0, first - ready),
          "done": max(0, link["done"] - last) if "done" in link else 0}
    out = {k: round(v / 1e6, 4) for k, v in ns.items()}
    out["total"] = round(sum(ns.values()) / 1e6, 4)
    out["data"] = round(max(0, last - first) / 1e6, 4)  # not a fixed cost: the bytes themselves
    # the hand-off on this clock, fixed cost and data together: the window's request to its end (the agent's DONE read,
    # or the device's answer at completion); no stage is placed, so both ways of ending compare on it
    out["wall"] = round(max(0, link["done"] - w0) / 1e6, 4) if "done" in link else 0.0
    out.update(_stage_parts(ns, link, dev, stats.stages, key_out=key_out, sent=sent, admitted=admitted))
    return out


def _device_window_opened(w0: int, w1: int, marks: Mapping[str, int], *, done: int | None) -> int:
    """The device's window-open moment on this process's clock: in ``[w0, w1]``, the latest that lets the device's
    ``last_chunk`` precede the agent's ``done`` (``w1`` when nothing constrains it)."""
    if done is None or "last_chunk" not in marks:
        return w1
    return max(w0, min(w1, done - int(marks["last_chunk"])))


def _stage_parts(ns: dict[str, int], link: dict[str, int], dev: dict[str, int], agent: dict[str, float], *,
                 key_out: int, sent: int, admitted: int) -> dict[str, float]:
    """``STAGE_PARTS`` of one hand-off, milliseconds (0 where a side did not say)."""
    write = min(max(key_out, link.get("handoff_write", key_out)), sent)
    wrap, send = write - key_out, sent - write
    agent_ns = int(agent.get("admit_sent_s", 0.0) * 1e9)
    device_ns = max(0, admitted - dev["admit_read"]) if "admit_read" in dev else 0
    # the device's answer ended the hand-off (``completion``): the agent's DONE is off the path
    done_agent = 0 if "done_read" in link else int(agent.get("ack_to_done_s", 0.0) * 1e9)
    parts = {"admission_wrap": wrap, "admission_send": send, "admission_agent": agent_ns,
             "admission_device": device_ns,
             "admission_transit": max(0, ns["admission"] - wrap - send - agent_ns - device_ns),
             "done_agent": min(done_agent, ns["done"]), "done_transit": max(0, ns["done"] - done_agent)}
    return {k: round(v / 1e6, 4) for k, v in parts.items()}


def add_stages(into: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """Stage times summed (a visit with several keys has several hand-offs)."""
    return {k: round(into.get(k, 0.0) + more.get(k, 0.0), 4)
            for k in (*FIXED_STAGES, "total", "data", "wall", *STAGE_PARTS)}


def require_complete(closed: WindowClosed, expected: int) -> None:
    """Every chunk of the window arrived, ``expected`` bytes in all, or ``ProtocolError``."""
    if not closed.complete or closed.bytes != expected:
        raise ProtocolError(f"holder returned with {closed.bytes} of {expected} bytes provisioned "
                            f"under epoch {closed.epoch}")
