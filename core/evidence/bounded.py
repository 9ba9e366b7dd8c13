"""Bounded reading of evidence: a size cap before any decoding, hex text decoded without a regex.

Every evidence reader goes through here, so a file of any size costs at most its cap in memory: a file is read
with ``read(cap + 1)`` (a larger one is refused after one bounded read, never loaded whole), and hex text is
checked and decoded with ``bytes.translate`` and ``bytes.fromhex`` (linear, two buffers of the input's size at
most), where a backtracking ``(?:[0-9a-fA-F]{2})+`` over 100 MB took GBs.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["EVIDENCE_CAP", "EvidenceTooLarge", "read_capped", "read_hex_or_raw"]

# The largest evidence file read (bytes, as given, hex text included): an SPDM report is ~4 KiB, a TDX quote
# ~5 KiB, collateral ~16 KiB, a RIM ~100 KiB, an SNP report 1,184 bytes. 8 MiB leaves room and keeps memory
# per file far under 64 MB (at most ~2.5x the cap while decoding).
EVIDENCE_CAP = 8 * 1024 * 1024
_WHITESPACE = b" \t\r\n\v\f"
_HEX = b"0123456789abcdefABCDEF"


class EvidenceTooLarge(ValueError):
    """The input is larger than its cap; nothing of it was decoded."""


def read_capped(path: Path, *, cap: int = EVIDENCE_CAP, what: str = "evidence") -> bytes:
    """The file's bytes, refusing one larger than ``cap`` after reading at most ``cap + 1`` bytes.

    Raises:
        EvidenceTooLarge: the file is larger than ``cap``.
        OSError: it cannot be read.
    """
    with Path(path).open("rb") as fh:
        data = fh.read(cap + 1)
    if len(data) > cap:
        raise EvidenceTooLarge(f"{path}: the {what} is larger than {cap:,} bytes (refused before decoding)")
    return data


def read_hex_or_raw(data: bytes, *, cap: int = EVIDENCE_CAP) -> bytes:
    """The raw bytes of evidence given either raw or as hex text (whitespace and a ``0x`` prefix allowed).

    Raises:
        EvidenceTooLarge: ``data`` is larger than ``cap`` (checked before anything is decoded).
    """
    if len(data) > cap:
        raise EvidenceTooLarge(f"the evidence is {len(data):,} bytes, over the {cap:,}-byte cap (refused before "
                               "decoding)")
    if not data.isascii():
        return data
    text = data.strip(_WHITESPACE)
    if text[:2] in (b"0x", b"0X"):
        text = text[2:]
    text = text.translate(None, _WHITESPACE)
    if not text or len(text) % 2 or text.translate(None, _HEX):
        return data
    return bytes.fromhex(text.decode("ascii"))
