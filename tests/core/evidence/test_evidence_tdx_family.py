"""A platform's TDX quotes checked in full once per agreement (``core/evidence/tdx_family.py``, issue 36): every
reuse gives the verdict dcap-qvl gives the same quote, and a tampered or debuggable quote is still refused by name."""

from __future__ import annotations

import datetime as dt
import os

import pytest

from gputravel.core.evidence.sim_tdx import SimTdx
from gputravel.core.evidence.tdx import TdxVerdict, verify_tdx_quote
from gputravel.core.evidence.tdx_family import (
    REPORT_DATA_AT,
    SIGNATURE_AT,
    TdxQuoteFamilies,
    collateral_expiry,
)

ISSUED = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
NOW = int((ISSUED + dt.timedelta(days=1)).timestamp())


@pytest.fixture(scope="module")
def sim_tdx() -> SimTdx:
    return SimTdx.generate()


def _full(sim_tdx: SimTdx, quote: bytes, collateral: bytes, now: int = NOW) -> TdxVerdict:
    return verify_tdx_quote(quote, collateral, now=now, root_ca_der=sim_tdx.pki.root_der)


def _check(families: TdxQuoteFamilies, sim_tdx: SimTdx, quote: bytes, collateral: bytes,
           now: int = NOW) -> TdxVerdict:
    return families.verify(quote, collateral, now, lambda: _full(sim_tdx, quote, collateral, now))


def test_a_platforms_quotes_share_one_full_check_and_get_dcap_qvls_verdict(sim_tdx: SimTdx) -> None:
    collateral = sim_tdx.collateral(issued=ISSUED).encode()
    assert collateral == sim_tdx.collateral(issued=ISSUED).encode()  # deterministic, as one platform's PCS answer
    families = TdxQuoteFamilies()
    quotes = [sim_tdx.quote(os.urandom(64)) for _ in range(4)]
    verdicts = [_check(families, sim_tdx, q, collateral) for q in quotes]
    assert (families.full, families.reused) == (1, 3)
    baseline = TdxQuoteFamilies(reuse=False)  # `bench fleet-key --every-quote-in-full`: dcap-qvl for each
    assert [_check(baseline, sim_tdx, q, collateral) for q in quotes] == verdicts
    assert (baseline.full, baseline.reused) == (4, 0)
    for quote, verdict in zip(quotes, verdicts, strict=True):
        assert verdict == _full(sim_tdx, quote, collateral)  # what dcap-qvl says of this very quote
        assert verdict.ok and verdict.report_data == quote[REPORT_DATA_AT:REPORT_DATA_AT + 64].hex()
    # the QE's certification data is the platform's: another process loading the same keys makes the same bytes
    twin = SimTdx(pki=sim_tdx.pki, template_quote=sim_tdx.template_quote,
                  template_collateral=sim_tdx.template_collateral, attestation_key=sim_tdx.attestation_key)
    assert _check(families, sim_tdx, twin.quote(os.urandom(64)), collateral).ok and families.full == 1


@pytest.mark.parametrize("at, why", [(REPORT_DATA_AT, "report data"), (SIGNATURE_AT + 7, "signature")])
def test_a_tampered_quote_of_a_known_family_is_refused_by_name(sim_tdx: SimTdx, at: int, why: str) -> None:
    collateral = sim_tdx.collateral(issued=ISSUED).encode()
    families = TdxQuoteFamilies()
    assert _check(families, sim_tdx, sim_tdx.quote(bytes(64)), collateral).ok
    quote = bytearray(sim_tdx.quote(os.urandom(64)))
    quote[at] ^= 0x01  # its REPORTDATA or its signature: still of the family, so the reuse path judges it
    verdict = _check(families, sim_tdx, bytes(quote), collateral)
    assert families.reused == 1, why
    assert not verdict.ok and verdict.failed == "quote-verified" == _full(sim_tdx, bytes(quote), collateral).failed
    assert "signature" in verdict.reason


def test_a_debuggable_or_expired_quote_is_not_of_the_family_and_dcap_qvl_names_it(sim_tdx: SimTdx) -> None:
    collateral = sim_tdx.collateral(issued=ISSUED, valid_days=2).encode()
    families = TdxQuoteFamilies()
    assert _check(families, sim_tdx, sim_tdx.quote(bytes(64)), collateral).ok
    debug = _check(families, sim_tdx, sim_tdx.quote(os.urandom(64), debug=True), collateral)
    assert not debug.ok and debug.failed == "td-not-debug" and families.full == 2
    late = NOW + 3 * 86400  # past the collateral's nextUpdate: the family is dropped and the quote checked in full
    assert late >= collateral_expiry(collateral)
    expired = _check(families, sim_tdx, sim_tdx.quote(os.urandom(64)), collateral, now=late)
    assert not expired.ok and expired.failed == "quote-verified" and "expired" in expired.reason.lower()
    assert (families.full, families.reused) == (3, 0)
