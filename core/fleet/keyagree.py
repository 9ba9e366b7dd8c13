"""The fleet key, agreed by attestation over torchrun's (untrusted) c10d store: no node reads another's files.

Every rank worker runs in a CVM. At the start of each attempt (a prefix per run id and restart):

1. each worker makes an X25519 key and asks its CVM for a quote whose report data binds it
   (``keywrap.cvm_report_data(public, context)``, as the orchestrator's CVM does for the holders), and posts
   ``hello/<rank>``: its public key, quote and collateral;
2. each worker verifies **every other** worker's hello against its own evidence policy
   (``HolderVerifier.check_cvm``, the holders' CVM check: the quote's signatures to the pinned root, the TD not
   debuggable, the TCB status and MRTD allow-lists, and the report data binding that key and this attempt), and
   posts ``verdict/<rank>`` (a platform's QE data and collateral are checked by dcap-qvl in full once per
   agreement, its other quotes for their own signature and report data: ``evidence/tdx_family.py``); a worker whose quote fails is named in every other verdict, and every worker stops with
   ``AttestationError`` (exit 3) before any key moves;
3. rank 0 makes a fresh 32-byte fleet key and posts it wrapped for each verified worker (``keywrap.wrap_key``:
   X25519 between rank 0's attested key and the worker's, HKDF-SHA256, AES-256-GCM); each worker unwraps its
   own with rank 0's attested public key.

The store can stop the fleet (withhold or garble a message), never get a key: a hello it forges has no quote
over its key, a verdict it forges makes no one accept anything, a wrap it forges does not open. The fleet key
stays in memory; the worker group seals every message under it (``core/fleet/auth.py``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from gputravel.core.errors import AttestationError, ConfigError, FleetJoinError
from gputravel.core.evidence.holder_check import HolderVerifier
from gputravel.core.evidence.policy import EvidencePolicy, load_evidence_policy
from gputravel.core.evidence.tdx_family import TdxQuoteFamilies
from gputravel.core.protocol.errors import FrameError
from gputravel.core.protocol.keywrap import LinkKey, cvm_report_data, unwrap_key, wrap_key

__all__ = ["CVM_FAULTS", "FleetCvm", "KeyAgreement", "Store", "agree_fleet_key"]

KEY_BYTES = 32
#: fault injection on this node's CVM quote (``run --inject``'s CVM values): a debuggable TD, another key bound
CVM_FAULTS = ("cvm-debug", "cvm-report-data")


class Store(Protocol):
    """What the agreement needs of torchrun's c10d store (``torch.distributed.Store``)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...

    def multi_get(self, keys: list[str]) -> list[bytes]: ...

    def check(self, keys: list[str]) -> bool: ...


@dataclass(frozen=True, slots=True)
class FleetCvm:
    """This worker's CVM (SIM: the node's SIM TDX guest, installed from ``--sim-pki``) and its evidence policy:
    the pinned root, TCB statuses and the MRTD allow-list (SIM: the one SIM TD image's measurement)."""

    quote: Callable[[bytes, bool], tuple[bytes, bytes]]  # (report data, debug) -> (quote, collateral)
    policy: EvidencePolicy

    @classmethod
    def sim(cls, cvm_dir: Path) -> FleetCvm:
        """The node's SIM CVM in ``cvm_dir`` (``RunFolder.cvm``).

        Raises:
            ConfigError: no SIM CVM there (a fleet node installs it from ``--sim-pki``).
        """
        from gputravel.core.evidence import sim_store
        from gputravel.core.evidence.policy import PolicyError
        from gputravel.core.travel.holder_attest import SimCvm

        if not (Path(cvm_dir) / "vendor-formats").is_dir():
            raise ConfigError(f"{cvm_dir}: no SIM CVM (a fleet node installs it with --sim-pki FILE)")
        cvm = SimCvm.load(cvm_dir)
        try:
            policy = load_evidence_policy(Path(cvm_dir) / "vendor-formats" / sim_store.SIM_POLICY_NAME)
        except PolicyError as exc:
            raise ConfigError(f"{cvm_dir}: the SIM evidence policy: {exc}") from None
        policy = replace(policy, tdx=replace(policy.tdx, mr_td=(cvm.tdx.mr_td.hex(),)))

        # the collateral is the platform's (Intel's PCS serves one per FMSPC; a real guest's PCCS has it cached
        # before any quote): made once when the CVM is loaded, valid 30 days, not signed in the agreement; issued
        # at the hour's start, so that the workers of one node (one platform folder) carry the same bytes
        issued = dt.datetime.now(dt.UTC).replace(minute=0, second=0, microsecond=0) - dt.timedelta(hours=1)
        collateral = cvm.tdx.collateral(issued=issued).encode()

        def quote(report_data: bytes, debug: bool) -> tuple[bytes, bytes]:
            return cvm.tdx.quote(report_data, debug=debug), collateral

        LinkKey()  # loads cryptography's OpenSSL backend here, not in the agreement's first X25519 key
        return cls(quote=quote, policy=policy)


@dataclass(frozen=True, slots=True)
class KeyAgreement:
    """The agreed fleet key and what the agreement saw (no key bytes in ``info``)."""

    key: bytes
    info: dict[str, Any]


def _report_data(public: bytes, context: str, rank: int) -> bytes:
    return cvm_report_data(public, f"gputravel-fleet-key {context} rank={rank}")


def _unreached(what: str, timeout_s: float, exc: RuntimeError) -> AttestationError:
    return AttestationError(f"fleet key agreement: no {what} on the store within {timeout_s:.0f} s "
                            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})")


def _get(store: Store, key: str, timeout_s: float) -> bytes:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return bytes(store.get(key))
    except RuntimeError as exc:  # torch's store timeout / connection loss
        raise _unreached(repr(key), timeout_s, exc) from None


class _Missing(Exception):
    """``_read_all`` timed out: the ranks whose key never came, and the store's own error."""

    def __init__(self, ranks: list[int], cause: RuntimeError) -> None:
        super().__init__(ranks)
        self.ranks, self.cause = ranks, cause


def _read_all(store: Store, kind: str, world: int, timeout_s: float) -> list[bytes]:
    """Every rank's ``kind/<r>``: one wait for all of them, then one round trip (``multi_get``), not 2W; a
    timeout is ``_Missing`` naming the ranks whose key never came."""
    keys = [f"{kind}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
        return [bytes(v) for v in store.multi_get(keys)]
    except RuntimeError as exc:
        raise _Missing([r for r, k in enumerate(keys) if not _has(store, k)], exc) from None


def _get_all(store: Store, kind: str, world: int, timeout_s: float) -> list[bytes]:
    """Every rank's ``kind/<r>``, or the ranks that never posted named (``_unreached``)."""
    try:
        return _read_all(store, kind, world, timeout_s)
    except _Missing as gone:
        raise _unreached(", ".join(repr(f"{kind}/{r}") for r in gone.ranks) or f"{kind!r} of every rank",
                         timeout_s, gone.cause) from None


def _hellos(store: Store, world: int, join_timeout_s: float, ranks_per_node: int) -> list[bytes]:
    """Every worker's hello, within the join deadline: a worker with none by then is named (its rank and node)."""
    try:
        return _read_all(store, "hello", world, join_timeout_s)
    except _Missing as gone:
        missing, exc = gone.ranks or list(range(world)), gone.cause
        where = ", ".join(f"rank {r}" + (f" (node {r // ranks_per_node})" if ranks_per_node > 0 else "")
                          for r in missing)
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FleetJoinError(f"fleet join: no word from {where} within {join_timeout_s:g} s of this worker's "
                             f"hello (--join-timeout): its node died after torchrun's rendezvous or never started "
                             f"its workers; no fleet key was sent ({why})") from None


def _has(store: Store, key: str) -> bool:
    """Whether ``key`` is in the store now (``check``: no wait; a 1 ms wait timed out on a loaded machine before
    the store's answer came, and named a rank that had posted as missing)."""
    try:
        return bool(store.check([key]))
    except RuntimeError:
        return False


def _check(verifier: HolderVerifier, families: TdxQuoteFamilies, hello: bytes, rank: int,
           context: str) -> tuple[bytes | None, str | None]:
    """(its public key, None) when rank ``rank``'s hello verifies, else (None, why)."""
    try:
        doc = json.loads(hello)
        public = bytes.fromhex(doc["public"])
        quote, collateral = bytes.fromhex(doc["quote"]), doc["collateral"].encode()
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, "not a hello (garbled on the store)"
    if int(doc.get("rank", -1)) != rank or len(public) != 32:
        return None, "not its hello (another rank's or no X25519 key)"
    verdict = verifier.check_cvm(quote, collateral, _report_data(public, context, rank), remember=False,
                                 families=families)
    if not verdict["ok"]:
        tcb = f" (TCB {verdict['tcb_status']})" if verdict["tcb_status"] else ""
        return None, f"{verdict['failed']}{tcb}"
    return public, None


def agree_fleet_key(store: Store, *, rank: int, world: int, context: str, cvm: FleetCvm, timeout_s: float,
                    fault: str | None = None, join_timeout_s: float | None = None,
                    ranks_per_node: int = 0, by_family: bool = True) -> KeyAgreement:
    """Agree the fleet key with the other ``world - 1`` workers over ``store`` (a prefix of this attempt's own).

    ``join_timeout_s`` (default ``timeout_s``): how long this worker waits for every worker's hello, its first
    post; ``ranks_per_node`` (torchrun's ``LOCAL_WORLD_SIZE``; 0: unknown) names the node of a rank missing.

    Raises:
        FleetJoinError: a worker's hello did not come within ``join_timeout_s`` (its rank and node named).
        AttestationError: a worker's CVM quote failed (named), or the store did not deliver in ``timeout_s``.
    """
    if fault is not None and fault not in CVM_FAULTS:
        raise ConfigError(f"unknown CVM fault {fault!r} (one of {', '.join(CVM_FAULTS)})")
    started, cpu_started = time.perf_counter(), time.process_time()
    own = LinkKey()
    bound = os.urandom(32) if fault == "cvm-report-data" else own.public
    quote, collateral = cvm.quote(_report_data(bound, context, rank), fault == "cvm-debug")
    store.set(f"hello/{rank}", json.dumps({"rank": rank, "public": own.public.hex(), "quote": quote.hex(),
                                           "collateral": collateral.decode()}))
    hello_at = time.monotonic()
    verifier = HolderVerifier(cvm.policy, {})
    families = TdxQuoteFamilies(reuse=by_family)  # this agreement's: a platform's QE data and collateral checked once
    publics: dict[int, bytes] = {}
    refused: dict[int, str] = {}
    hellos = _hellos(store, world, timeout_s if join_timeout_s is None else join_timeout_s, ranks_per_node)
    for r, hello in enumerate(hellos):
        if r == rank:  # its own quote is the others' to check (each names it if it fails): W - 1 verifications
            publics[r] = own.public
            continue
        public, why = _check(verifier, families, hello, r, context)
        if public is None:
            refused[r] = why or "?"
        else:
            publics[r] = public
    verified_s = time.perf_counter() - started
    store.set(f"verdict/{rank}", json.dumps({r: why for r, why in refused.items()}))
    verdicts = _get_all(store, "verdict", world, timeout_s)
    for r, verdict in enumerate(verdicts):  # every worker's word: the fleet stops together, naming whom it refused
        try:
            theirs = {int(k): str(v) for k, v in json.loads(verdict).items()}
        except (ValueError, TypeError, AttributeError):
            theirs = {r: "its verdict was garbled on the store"}
        for bad, why in theirs.items():
            refused.setdefault(bad, f"{why} (refused by rank {r})")
    if refused:
        names = "; ".join(f"rank {r}: {why}" for r, why in sorted(refused.items()))
        raise AttestationError(f"fleet key agreement refused the CVM quote of {names}: no fleet key was sent")
    fingerprint = "fleet-key"
    if rank == 0:
        key = os.urandom(KEY_BYTES)
        for r in range(1, world):
            store.set(f"key/{r}", wrap_key(own, publics[r], f"{context} to={r}".encode(), key, epoch=0,
                                           fingerprint=fingerprint))
    else:
        wrapped = _get(store, f"key/{rank}", timeout_s).decode(errors="replace")
        try:
            key = unwrap_key(own, publics[0], f"{context} to={rank}".encode(), wrapped, epoch=0,
                             fingerprint=fingerprint)
        except FrameError:
            raise AttestationError("fleet key agreement: the fleet key sent to this rank does not open under "
                                   "rank 0's attested key (forged on the store); refused") from None
        if len(key) != KEY_BYTES:
            raise AttestationError("fleet key agreement: the unwrapped fleet key has the wrong length")
    return KeyAgreement(key=key, info={
        "workers": world, "verified": sorted(publics), "verifications": world - 1, "context": context,
        "key_fingerprint": hashlib.sha256(b"gputravel-fleet-key-fp\0" + key).hexdigest()[:16],
        "verify_s": round(verified_s, 6), "seconds": round(time.perf_counter() - started, 6),
        # quotes dcap-qvl checked in full, and quotes of a family already checked (their own signature checked)
        "verify_full": families.full, "verify_reused": families.reused,
        # CLOCK_MONOTONIC, one clock for every process of a host: the bench times the fleet from the first hello
        "hello_at": hello_at, "key_at": time.monotonic(),
        "cpu_s": round(time.process_time() - cpu_started, 6),
        "mr_td": list(cvm.policy.tdx.mr_td)})
