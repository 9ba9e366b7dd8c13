"""The operator's side, in two wings over one composition: ``tui`` (the Textual console: app, bridges, view
model, screens, widgets) and ``cli`` (the typer commands, their options and the run folder). Both compose runs
through ``gputravel.core.compose`` with what this package names: ``entries`` (the programs a run starts) and
``holders`` (a run's holders: the embedded SSH server, an inventory or local agents)."""
