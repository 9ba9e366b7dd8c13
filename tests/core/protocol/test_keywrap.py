"""The holder key exchange kept per peer (issue 34): a wrap key derived once (or ahead, ``prepare``) is the very key a
fresh derivation gives, bound to its peer and context; the kept exchanges are bounded. Real X25519 and AES-GCM."""

from __future__ import annotations

import os

import pytest

from gputravel.core.protocol import keywrap
from gputravel.core.protocol.errors import FrameError
from gputravel.core.protocol.keywrap import LinkKey, conventional_secret, unwrap_key, wrap_key


def test_a_kept_wrap_key_opens_what_a_fresh_one_sealed_and_only_for_its_context() -> None:
    cvm, agent = LinkKey(), LinkKey()
    agent.prepare(cvm.public, b"run-1")  # ahead, as the agent does when it verifies an ATTEST
    secret = os.urandom(36)
    for epoch in (1, 2, 3):  # the orchestrator derives once, then keeps; the agent had it prepared
        wrapped = wrap_key(cvm, agent.public, b"run-1", secret, epoch=epoch, fingerprint="f" * 16)
        assert unwrap_key(agent, cvm.public, b"run-1", wrapped, epoch=epoch, fingerprint="f" * 16) == secret
    with pytest.raises(FrameError, match="does not open"):  # another run's context: another key
        unwrap_key(agent, cvm.public, b"run-2", wrapped, epoch=3, fingerprint="f" * 16)
    with pytest.raises(FrameError, match="does not open"):  # a third party's exchange with the CVM
        unwrap_key(LinkKey(), cvm.public, b"run-1", wrapped, epoch=3, fingerprint="f" * 16)
    # the conventional secret uses the same kept exchange: both sides agree
    assert conventional_secret(cvm, agent.public, "run-1", 4) == conventional_secret(agent, cvm.public, "run-1", 4)


def test_a_malformed_peer_key_is_named_at_use_and_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    own = LinkKey()
    own.prepare(b"\x01" * 5, b"ctx")  # left for the use to name
    with pytest.raises(FrameError, match="not an X25519 public key"):
        wrap_key(own, b"\x01" * 5, b"ctx", b"s" * 36, epoch=1, fingerprint="f")
    monkeypatch.setattr(keywrap, "MAX_PEERS", 3)
    peers = [LinkKey() for _ in range(5)]
    for p in peers:
        own.prepare(p.public, b"ctx")
    assert len(own._shared) == len(own._wraps) == 3  # bounded: the oldest are forgotten
    wrapped = wrap_key(own, peers[0].public, b"ctx", b"s" * 36, epoch=1, fingerprint="f")  # derived again
    assert unwrap_key(peers[0], own.public, b"ctx", wrapped, epoch=1, fingerprint="f") == b"s" * 36
