"""Ring key set-up: each pair of neighbours runs the core's attested ECDH handshake over a ``dist.Store``.

For the link ``r -> right`` (rank r seals, its right neighbour opens) rank r is the initiator and the
right neighbour the responder. Both authenticate with their device identity: each sends attestation
evidence (``make_evidence``) over the peer's fresh nonce hashed with its own ephemeral key, and each
verifies the other's with ``verify_evidence`` against the pinned vendor root (chain, CRL, signature,
nonce, measurements, CC mode). The responder also signs the handshake transcript (``respond``).

Store rounds (every message is public; the store is the untrusted host's):

1. ``nonce/r``: 32 fresh bytes.
2. ``init/r``: initiator ephemeral key for ``r -> right`` and r's evidence over
   ``H("init" | nonce_right | ephemeral)``.
3. ``resp/r``: responder ephemeral key, transcript signature and r's evidence over
   ``H("resp" | nonce_left | ephemeral)`` for the link ``left -> r``.
4. ``group/r``: the ring-wide gather master, created by rank 0 and passed around the ring sealed
   under each link's key-wrap key.

What is emulated (SIM): the device identities come from an emulated vendor PKI
(``emulated_identity``) and the CC mode in the evidence is asserted by software. The handshake, the
signatures, the HKDF schedule and AES-256-GCM are real.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gputravel.core.attestation import (
    CCMode,
    DeviceIdentity,
    Evidence,
    Measurements,
    Policy,
    VendorCA,
    emulated_measurements,
    load_policy,
    make_evidence,
    verify_evidence,
)
from gputravel.core.collectives.crypto import HopOpener, HopSealer
from gputravel.core.errors import AttestationError, ConfigError
from gputravel.core.handshake import Initiator, SessionSecrets, respond
from gputravel.core.protocol import DirectionKey, channel_key, fingerprint

#: ``torch.distributed.Store`` (the c10d key-value store); not exported to type checkers
Store = Any

__all__ = ["RingKeys", "emulated_identity", "establish_ring_keys"]

LINK_DIRECTION = 0x52494E47  # "RING": HKDF field of a link's hop key
WRAP_DIRECTION = 0x57524150  # "WRAP": HKDF field of the key that carries the group master
GATHER_DIRECTION = 0x47410000  # + owner rank: HKDF field of an owner's ring-wide gather key
_ERR = b"ERR:"


class RingKeys:
    """The keys of one rank in one ring: its outgoing link, its incoming link, the ring-wide gather keys."""

    __slots__ = ("rank", "world", "epoch", "send", "recv", "gather_seal", "gather_open", "peers")

    def __init__(self, *, rank: int, world: int, epoch: int, send: HopSealer, recv: HopOpener,
                 gather_seal: HopSealer, gather_open: tuple[HopOpener, ...], peers: dict[str, str]) -> None:
        if not 0 <= rank < world or len(gather_open) != world:
            raise ConfigError("rank/world do not match the gather keys")
        self.rank = rank
        self.world = world
        self.epoch = epoch
        self.send = send  # seals hops to the right neighbour
        self.recv = recv  # opens hops from the left neighbour
        self.gather_seal = gather_seal  # this rank's ring-wide key (sealed all-gather)
        self.gather_open = gather_open  # every owner's ring-wide key, by rank
        self.peers = peers  # "left"/"right" -> verified device id and key fingerprint (for logs)

    def __repr__(self) -> str:
        return (f"RingKeys(rank={self.rank}/{self.world}, send={self.send.fingerprint}, "
                f"recv={self.recv.fingerprint}, peers={self.peers})")


def emulated_identity(vendor_dir: Path, *, rank: int, store: Store | None = None,
                      timeout: timedelta = timedelta(seconds=60),
                      ) -> tuple[DeviceIdentity, x509.Certificate, x509.CertificateRevocationList]:
    """SIM: this rank's emulated device identity under a vendor PKI shared by the job (a folder).

    Rank 0 creates the vendor PKI in ``vendor_dir`` if absent; the others wait for it (through ``store``
    when given). Returns the identity, the root to pin and the vendor's revocation list.
    """
    vendor_dir = Path(vendor_dir)
    if rank == 0 and not (vendor_dir / "root.pem").exists():
        VendorCA.generate().save(vendor_dir)
    if store is not None:
        if rank == 0:
            store.set("gputravel/vendor-ready", "1")
        else:
            store.wait(["gputravel/vendor-ready"], timeout)
    ca = VendorCA.load(vendor_dir)
    return ca.issue_device(f"rank-{rank}"), ca.root, ca.crl()


def _lp(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def _unlp(data: bytes, n: int) -> list[bytes]:
    out, i = [], 0
    for _ in range(n):
        size = int.from_bytes(data[i:i + 4], "big")
        out.append(data[i + 4:i + 4 + size])
        i += 4 + size
    if i != len(data) or any(len(p) == 0 for p in out):
        raise AttestationError("ring handshake: malformed message")
    return out


def _evidence_bytes(ev: Evidence) -> bytes:
    return _lp(ev.report, ev.signature, *ev.chain_pem)


def _evidence_from(data: bytes) -> Evidence:
    parts = _unlp(data, 5)
    return Evidence(report=parts[0], signature=parts[1], chain_pem=tuple(parts[2:]))


def _bind(label: bytes, peer_nonce: bytes, ephemeral: bytes) -> bytes:
    return hashlib.sha256(b"gputravel ring " + label + peer_nonce + ephemeral).digest()


def _link_context(prefix: str, src: int, dst: int, world: int, nonce_src: bytes, nonce_dst: bytes) -> bytes:
    return _lp(b"gputravel ring link v1", prefix.encode(), src.to_bytes(4, "big"), dst.to_bytes(4, "big"),
               world.to_bytes(4, "big"), nonce_src, nonce_dst)


def _linger_until_all_aborted(store: Store, key: str, *, world: int, seconds: float = 10.0) -> None:
    """Every rank that gives up on the handshake counts itself out, then waits (bounded) for the others:
    rank 0 hosts the store, and leaving first would cut a neighbour off before it read who failed (it
    would then see a broken pipe instead of the named ``AttestationError``)."""
    import time

    deadline = time.monotonic() + seconds
    try:
        count = int(store.add(key, 1))
        while count < world and time.monotonic() < deadline:
            time.sleep(0.02)
            count = int(store.add(key, 0))
    except Exception:  # the store itself may be gone; the named error is raised either way
        return


def establish_ring_keys(
    store: Store,
    *,
    rank: int,
    world: int,
    identity: DeviceIdentity,
    root: x509.Certificate,
    crl: x509.CertificateRevocationList | None = None,
    policy: Policy | None = None,
    prefix: str = "gputravel/ring/0",
    epoch: int = 0,
    timeout: timedelta = timedelta(seconds=60),
    expected: Sequence[str] | None = None,
) -> RingKeys:
    """Run the neighbour handshakes of one ring and derive this rank's keys.

    ``prefix`` must be unique per ring set-up within ``store``. Raises ``AttestationError`` when a
    neighbour's evidence or signature does not verify (the neighbour is told, and raises too).
    ``expected`` (a fleet: every rank's ``"device_id:key fingerprint"``, as its own orchestrator attested
    it and told the others over an authenticated channel, never the store) pins each rank to its device:
    evidence that verifies but comes from another device (another genuine GPU on the store) is refused too.
    """
    if expected is not None and len(expected) != world:
        raise ConfigError(f"expected names {len(expected)} devices for a ring of {world}")
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} outside world {world}")
    policy = load_policy() if policy is None else policy
    measurements = emulated_measurements()
    code = measurements.code

    def get(kind: str, who: int) -> bytes:
        key = f"{prefix}/{kind}/{who}"
        store.wait([key], timeout)
        value = bytes(store.get(key))
        if value.startswith(_ERR):
            raise AttestationError(f"ring handshake: rank {who} failed: {value[len(_ERR):].decode(errors='replace')}")
        return value

    def verify(ev_bytes: bytes, *, fresh: bytes, who: int) -> tuple[ec.EllipticCurvePublicKey, str]:
        result = verify_evidence(_evidence_from(ev_bytes), nonce=fresh, root=root, crl=crl, policy=policy,
                                 expected_code=code)
        if not result.ok or result.device_public_key is None:
            reasons = "; ".join(f"{c.name}: {c.detail}" for c in result.failed)
            raise AttestationError(f"ring handshake: evidence of rank {who} does not verify: {reasons}")
        name = f"{result.device_id}:{result.device_key_fingerprint}"
        if expected is not None and name != expected[who]:
            raise AttestationError(f"ring handshake: rank {who} answered as device {name}, not as the device its "
                                   f"orchestrator attested ({expected[who]}): refused")
        return result.device_public_key, name

    posted: set[str] = set()

    def put(kind: str, value: bytes) -> None:
        store.set(f"{prefix}/{kind}/{rank}", value)  # the store takes bytes
        posted.add(kind)

    try:
        send_secrets, recv_secrets, names, group = _handshake(
            put, get, verify, rank=rank, world=world, identity=identity, measurements=measurements,
            prefix=prefix, epoch=epoch)
    except AttestationError as exc:
        # Unblock every neighbour waiting on this rank, then let every rank learn who failed.
        for kind in ("nonce", "init", "resp", "group"):
            if kind not in posted:
                put(kind, _ERR + exc.reason.encode())
        put("done", _ERR + exc.reason.encode())
        _linger_until_all_aborted(store, f"{prefix}/aborted", world=world)
        raise
    put("done", b"OK")
    try:
        for who in range(world):
            get("done", who)
    except AttestationError:  # another rank failed its handshake: leave together
        _linger_until_all_aborted(store, f"{prefix}/aborted", world=world)
        raise

    group_master, group_sid = group[:32], group[32:]

    def gather_key(owner: int) -> DirectionKey:
        return channel_key(group_master, group_sid, epoch=epoch, direction=GATHER_DIRECTION + owner)

    send_key = channel_key(send_secrets.master, send_secrets.session_id, epoch=epoch, direction=LINK_DIRECTION)
    recv_key = channel_key(recv_secrets.master, recv_secrets.session_id, epoch=epoch, direction=LINK_DIRECTION)
    return RingKeys(
        rank=rank, world=world, epoch=epoch,
        send=HopSealer(send_key, session_id=send_secrets.session_id),
        recv=HopOpener(recv_key, session_id=recv_secrets.session_id),
        gather_seal=HopSealer(gather_key(rank), session_id=group_sid),
        gather_open=tuple(HopOpener(gather_key(o), session_id=group_sid) for o in range(world)),
        peers={**names, "group": fingerprint(group_master)},
    )


def _handshake(
    put: Callable[[str, bytes], None],
    get: Callable[[str, int], bytes],
    verify: Callable[..., tuple[ec.EllipticCurvePublicKey, str]],
    *, rank: int, world: int, identity: DeviceIdentity, measurements: Measurements, prefix: str, epoch: int,
) -> tuple[SessionSecrets, SessionSecrets, dict[str, str], bytes]:
    """Rounds 1-4 of the module docstring; returns (send secrets, recv secrets, peer names, group master)."""
    left, right = (rank - 1) % world, (rank + 1) % world
    my_nonce = os.urandom(32)
    put("nonce", my_nonce)
    nonce_right, nonce_left = get("nonce", right), get("nonce", left)

    # 2. initiator of rank -> right
    initiator = Initiator(context=_link_context(prefix, rank, right, world, my_nonce, nonce_right))
    init_pub = initiator.public_bytes()
    my_ev = make_evidence(identity, nonce=_bind(b"init", nonce_right, init_pub), measurements=measurements,
                          cc_mode=CCMode.ON)
    put("init", _lp(init_pub, _evidence_bytes(my_ev)))

    # 3. responder of left -> rank
    left_pub, left_ev = _unlp(get("init", left), 2)
    _left_key, left_name = verify(left_ev, fresh=_bind(b"init", my_nonce, left_pub), who=left)
    dev_pub, sig, recv_secrets = respond(
        identity.key, initiator_public=left_pub,
        context=_link_context(prefix, left, rank, world, nonce_left, my_nonce))
    resp_ev = make_evidence(identity, nonce=_bind(b"resp", nonce_left, dev_pub), measurements=measurements,
                            cc_mode=CCMode.ON)
    put("resp", _lp(dev_pub, sig, _evidence_bytes(resp_ev)))

    # 4. finish rank -> right
    right_pub, right_sig, right_ev = _unlp(get("resp", right), 3)
    right_key, right_name = verify(right_ev, fresh=_bind(b"resp", my_nonce, right_pub), who=right)
    send_secrets = initiator.finish(device_public=right_pub, signature=right_sig, device_key=right_key)

    # 5. the ring-wide gather master: rank 0 makes it, each rank unwraps it and re-wraps it for the right
    send_wrap = channel_key(send_secrets.master, send_secrets.session_id, epoch=epoch, direction=WRAP_DIRECTION)
    recv_wrap = channel_key(recv_secrets.master, recv_secrets.session_id, epoch=epoch, direction=WRAP_DIRECTION)
    aad = f"{prefix}/group".encode()
    if rank == 0:
        group = os.urandom(48)
    else:
        try:
            group = AESGCM(recv_wrap.key).decrypt(recv_wrap.prefix + bytes(8), get("group", left), aad)
        except InvalidTag:
            raise AttestationError(f"ring handshake: the group key from rank {left} does not authenticate") from None
    if right != 0:
        put("group", AESGCM(send_wrap.key).encrypt(send_wrap.prefix + bytes(8), group, aad))
    return send_secrets, recv_secrets, {"left": left_name, "right": right_name}, group
