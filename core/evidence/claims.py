"""Claims: one named check with its value, and whether it passed.

Names follow NVIDIA's local GPU verifier (claims version 3.0: a certificate chain is one claim with a nested value) for GPU evidence, so a reader who knows
NVIDIA's tools reads ours. A claim's ``ok`` is ``True`` (passed), ``False`` (failed) or ``None`` (not checked, e.g.
revocation offline, or no RIM given); whether a ``None`` is acceptable is the policy's call, never the verifier's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["REPORT_DATA_NOT_GIVEN", "Claim", "ClaimSet", "report_data_mismatch"]

NOT_CHECKED = "not-checked"
REPORT_DATA_NOT_GIVEN = ("no expected report data given (attest --report-data HEX): the report's freshness is not "
                         "checked, a replayed report passes")


def report_data_mismatch(actual: bytes, expected: bytes) -> str:
    """Why a CVM report's 64-byte report data is not ``expected`` (1 to 64 bytes, zero-padded to 64); '' when it
    is (claim ``report-data-match``)."""
    want = expected.ljust(64, b"\0")
    if actual == want:
        return ""
    return (f"the report carries report data {actual.hex()[:16]}..., not the {len(expected)} bytes expected "
            f"{expected.hex()[:16]}... (zero-padded to 64): a report made for another nonce or key (a replay), "
            "or the wrong --report-data")


@dataclass(frozen=True, slots=True)
class Claim:
    """One check: ``value`` is what NVIDIA's verifier would report under ``name``; ``detail`` says why."""

    name: str
    value: Any
    ok: bool | None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "ok": self.ok, "detail": self.detail}


@dataclass(slots=True)
class ClaimSet:
    """Claims in the order they were checked (the first failure is the one a user is told about)."""

    claims: list[Claim] = field(default_factory=list)

    def add(self, name: str, value: Any, ok: bool | None, detail: str = "") -> Claim:
        claim = Claim(name, value, ok, detail)
        self.claims = [c for c in self.claims if c.name != name] + [claim]
        return claim

    def update(self, name: str, value: Any, ok: bool | None, detail: str = "") -> Claim:
        """Replace the claim ``name`` where it stands (its place in the order is kept).

        Raises:
            KeyError: no such claim.
        """
        claim = Claim(name, value, ok, detail)
        i = next(i for i, c in enumerate(self.claims) if c.name == name) if name in self else None
        if i is None:
            raise KeyError(name)
        self.claims[i] = claim
        return claim

    def __iter__(self) -> Iterator[Claim]:
        return iter(self.claims)

    def __getitem__(self, name: str) -> Claim:
        for claim in self.claims:
            if claim.name == name:
                return claim
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return any(c.name == name for c in self.claims)

    def failed(self) -> list[Claim]:
        return [c for c in self.claims if c.ok is False]

    def unchecked(self) -> list[Claim]:
        return [c for c in self.claims if c.ok is None]

    def values(self) -> dict[str, Any]:
        """``{name: value}`` as NVIDIA's verifier lists them."""
        return {c.name: c.value for c in self.claims}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {c.name: c.to_dict() for c in self.claims}
