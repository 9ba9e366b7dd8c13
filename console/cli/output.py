"""Where the CLI's human output goes: a terminal gets rich's layout at its width; a pipe or a file gets lines
that are never wrapped (one event, one line, so ``gputravel runs log | grep provisioned`` returns whole lines)
and tables at ``PIPE_WIDTH`` columns (rich would lay them out at 80), unless ``COLUMNS`` says otherwise."""

from __future__ import annotations

import os
import sys
from typing import Any

from rich.console import Console

PIPE_WIDTH = 200


def out_console(**kwargs: Any) -> Console:
    """A rich console on stdout: ``soft_wrap`` (rich never breaks a printed line) and, off a terminal, a
    table width of ``PIPE_WIDTH``."""
    if not sys.stdout.isatty() and "COLUMNS" not in os.environ and "width" not in kwargs:
        kwargs["width"] = PIPE_WIDTH
    return Console(soft_wrap=True, **kwargs)
