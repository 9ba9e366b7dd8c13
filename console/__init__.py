"""The composition root: the typer CLI (``gputravel``) and the Textual operator console (``gputravel-console``)."""
