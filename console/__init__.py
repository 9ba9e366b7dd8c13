"""The composition root: the typer CLI (and, later, the Textual console)."""
