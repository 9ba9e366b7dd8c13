"""``python -m gputravel.agents.holder --name X --data DIR``: the holder agent on stdin/stdout."""

from __future__ import annotations

from gputravel.agents.holder.agent import exit_now, main

exit_now(main())
