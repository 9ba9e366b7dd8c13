"""A model folder's own tokenizer (``tokenizer.json``, through the ``tokenizers`` library) for holders' text.

``data fetch|check --tokenizer DIR`` tokenizes a holder's text locally into llm.c shards (``u16`` ids for a
vocabulary of at most 65,536: SmolLM2, Llama 2, Mistral; ``u32`` ids beyond it: Llama 3's 128,256, Qwen2.5's
151,936) and leaves a ``.tokenizer`` record beside them: the tokenizer.json's SHA-256, vocabulary and shard
format. A run
from a folder that has a ``tokenizer.json`` refuses shards without that record or with another hash, and text.

``tokenizers`` is the optional extra ``gputravel[tokenizer]``: only ``--tokenizer`` needs it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputravel.core.errors import ConfigError, DataError

__all__ = ["ModelTokenizer", "tokenizer_hash", "tokenize_holders"]

_MAX_TOKENIZER_JSON = 64 << 20


# a model's tokenizer in a form this project does not read: sentencepiece's (Llama 2, Mistral), and a slow BPE's
# vocab.json + merges.txt in a folder that is not GPT-2's (a GPT-2 folder with them takes llm.c's GPT-2 shards,
# which that tokenizer made; any other model's would train on byte-level text as its ids)
_OTHER_TOKENIZERS = ("tokenizer.model",)
_SLOW_BPE = ("vocab.json", "merges.txt")
_MAX_CONFIG_JSON = 1 << 20


def _other_tokenizer(folder: Path) -> str | None:
    """The form of ``folder``'s tokenizer when it is one this project does not read, else ``None``."""
    for other in _OTHER_TOKENIZERS:
        if (folder / other).exists():
            return other
    if all((folder / name).exists() for name in _SLOW_BPE) and _model_type(folder) not in (None, "gpt2"):
        return " + ".join(_SLOW_BPE)
    return None


def _model_type(folder: Path) -> str | None:
    """``config.json``'s ``model_type``; ``None`` when the folder has no readable config to tell."""
    path = folder / "config.json"
    try:
        if path.stat().st_size > _MAX_CONFIG_JSON:
            return None
        config = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    kind = config.get("model_type") if isinstance(config, dict) else None
    return kind if isinstance(kind, str) else None


def tokenizer_hash(folder: Path) -> str | None:
    """SHA-256 of ``folder/tokenizer.json``, or ``None`` when the folder has no tokenizer at all (or is a file).

    Raises:
        ConfigError: the folder has a tokenizer only as sentencepiece's ``tokenizer.model``, or as a slow BPE's
            ``vocab.json`` + ``merges.txt`` in a folder whose config is not GPT-2's: ignoring it would train the
            model on ids its own tokenizer never made."""
    path = Path(folder) / "tokenizer.json"
    if not Path(folder).is_dir():
        return None
    if not path.is_file():
        other = _other_tokenizer(Path(folder))
        if other is not None:
            raise ConfigError(
                f"{folder} has its tokenizer as {other} but no tokenizer.json, the only form this project reads "
                "(the holders' data must be that tokenizer's ids): write one, e.g. with transformers "
                "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR), then tokenize the holders' text "
                "with data fetch --tokenizer DIR")
        return None
    if path.stat().st_size > _MAX_TOKENIZER_JSON:
        raise DataError(f"{path} is over {_MAX_TOKENIZER_JSON} bytes")
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class ModelTokenizer:
    """A loaded ``tokenizer.json``: its hash, its vocabulary, the library's tokenizer."""

    folder: Path
    sha256: str
    vocab: int
    impl: Any

    @classmethod
    def load(cls, folder: Path) -> ModelTokenizer:
        digest = tokenizer_hash(folder)
        if digest is None:
            raise ConfigError(f"--tokenizer {folder}: no tokenizer.json there")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("--tokenizer needs the tokenizers library: pip install 'gputravel[tokenizer]'") from None
        try:
            impl = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        except Exception as exc:  # the library's own error types
            raise DataError(f"{folder}/tokenizer.json does not load: {exc}") from None
        vocab = int(impl.get_vocab_size(with_added_tokens=True))
        if not 0 < vocab < 1 << 31:
            raise DataError(f"{folder}/tokenizer.json: a vocabulary of {vocab} ids")
        return cls(Path(folder), digest, vocab, impl)

    @property
    def shard_format(self) -> str:
        """``u16`` while every id fits 16 bits (the default), ``u32`` for a larger vocabulary."""
        from gputravel.core.training.llmc import shard_format_for

        return shard_format_for(self.vocab).value

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.impl.encode(text, add_special_tokens=False).ids
        return ids

    def record(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "vocab": self.vocab, "format": self.shard_format,
                "tokenizer": str(self.folder / "tokenizer.json")}


def tokenize_holders(src: Path, dest: Path, tok: ModelTokenizer) -> Path:
    """Each holder folder of text in ``src`` -> the same holder in ``dest`` as one llm.c shard of ``tok``'s ids
    (``u16`` or ``u32``: :attr:`ModelTokenizer.shard_format`), with the ``.tokenizer`` record. Text is read in bounded pieces (lines, up to 1 MiB at a time)."""
    from gputravel.core.training.datacheck import TOKENIZER_RECORD, read_regular, validate_data_dir
    from gputravel.core.training.llmc import write_llmc_shard

    specs = validate_data_dir(src)
    for spec in specs:
        if spec.fmt.value != "byte":
            raise DataError(f"{spec.path}: --tokenizer tokenizes text (.txt) holders, this one holds shards")
        out = Path(dest) / spec.name
        out.mkdir(parents=True, exist_ok=True)
        ids: list[int] = []
        for f in spec.files:
            pending = b""
            for block in read_regular(f, chunk=1 << 20):
                pending += block
                cut = pending.rfind(b"\n") + 1
                if cut:
                    ids += tok.encode(pending[:cut].decode())
                    pending = pending[cut:]
            if pending:
                ids += tok.encode(pending.decode())
        write_llmc_shard(out / "train_000.bin", ids, fmt=tok.shard_format)
        (out / TOKENIZER_RECORD).write_text(json.dumps(tok.record(), indent=2) + "\n")
    return Path(dest)
