"""Bounded input (issue 31 item 5): a size cap before any decoding, hex text decoded without a backtracking regex,
trailing bytes after a quote or report refused, and memory per evidence file at most 4x its size and never more
than 64 MB (measured with tracemalloc: every bytes object the reader makes is counted)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import TDX_COLLATERAL as COLLATERAL
from helpers import TDX_QUOTE as QUOTE
from typer.testing import CliRunner

from gputravel.core.evidence.bounded import EVIDENCE_CAP, EvidenceTooLarge, read_capped, read_hex_or_raw
from gputravel.core.evidence.nvidia_gpu import verify_gpu
from gputravel.core.evidence.policy import GpuPolicy
from gputravel.core.evidence.tdx import verify_tdx_quote

MB = 1024 * 1024
AT = 1750331763


def _peak(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            fn()
        except (EvidenceTooLarge, ValueError):
            pass
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def hundred_mb_hex(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("big") / "report.hex"
    with path.open("wb") as fh:
        for _ in range(100):
            fh.write(b"ab" * (MB // 2))
    return path


def test_a_100_mb_hex_file_is_refused_after_one_bounded_read(hundred_mb_hex: Path) -> None:
    size = hundred_mb_hex.stat().st_size
    assert size == 100 * MB
    peak = _peak(lambda: read_capped(hundred_mb_hex))
    assert peak <= min(4 * EVIDENCE_CAP, 64 * MB), peak  # never the whole 100 MB
    with pytest.raises(EvidenceTooLarge, match="before decoding"):
        read_capped(hundred_mb_hex)


def test_the_cli_refuses_100_mb_of_hex_evidence_with_exit_2(hundred_mb_hex: Path) -> None:
    from gputravel.console.cli.main import app

    out = CliRunner().invoke(app, ["attest", "--evidence", str(hundred_mb_hex), "--cert-chain", str(hundred_mb_hex),
                                   "--nonce", "00" * 32])
    assert out.exit_code == 2 and "larger than" in out.output


def test_decoding_hex_at_the_cap_costs_at_most_4x_its_size() -> None:
    text = b"0x" + b"0a" * (EVIDENCE_CAP // 2 - 1)
    assert len(text) <= EVIDENCE_CAP
    peak = _peak(lambda: read_hex_or_raw(text))
    assert peak <= 4 * len(text) and peak <= 64 * MB, peak
    assert read_hex_or_raw(text)[:2] == b"\x0a\x0a"


def test_bytes_over_the_cap_are_refused_before_decoding() -> None:
    with pytest.raises(EvidenceTooLarge):
        read_hex_or_raw(b"00" * (EVIDENCE_CAP // 2 + 1))
    verdict = verify_gpu(b"00" * (EVIDENCE_CAP // 2 + 1), b"", bytes(32), policy=GpuPolicy(require_rims=False))
    assert verdict.failed is not None and verdict.failed.name == "x-nvidia-gpu-attestation-report-parsed"


@pytest.mark.parametrize("text,raw", [(b"0a0B\n0c", b"\x0a\x0b\x0c"), (b" 0xff ", b"\xff"), (b"abc", b"abc"),
                                      (b"zz", b"zz"), (b"\xff\x00", b"\xff\x00")])
def test_hex_or_raw_reads_what_the_old_reader_read(text: bytes, raw: bytes) -> None:
    assert read_hex_or_raw(text) == raw


def test_a_tdx_quote_with_1_mib_of_trailing_bytes_is_refused() -> None:
    assert verify_tdx_quote(QUOTE, COLLATERAL, now=AT).ok  # the real quote carries 70 zero bytes of padding
    for tail in (bytes(MB), b"\x01", bytes(4096 - 70 + 1)):
        verdict = verify_tdx_quote(QUOTE + tail, COLLATERAL, now=AT)
        assert not verdict.ok and verdict.failed == "quote-parsed" and "follow the quote" in verdict.reason


def test_a_truncated_tdx_quote_is_refused_at_parse() -> None:
    verdict = verify_tdx_quote(QUOTE[:4000], COLLATERAL, now=AT)
    assert not verdict.ok and verdict.failed == "quote-parsed"
