"""``python -m gputravel.agents.holder --name X --data DIR``: the holder agent on stdin/stdout."""

from __future__ import annotations

import sys

from gputravel.agents.holder.agent import main

sys.exit(main())
