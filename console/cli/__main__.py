"""``python -m gputravel.console.cli``: the ``gputravel`` command."""

from gputravel.console.cli.main import main

main()
