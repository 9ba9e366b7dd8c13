"""The composition root: the Textual operator console (``app``, ``screens``, ``widgets``) and the typer CLI
(``cli``, one command module per file under ``commands``)."""
