"""The console's TUI wing: the Textual app (``app``, ``app_commands``), the bridges from a run or a
recording to messages (``bridge``, ``replay_bridge``, ``fleet_view``), ``screens`` and ``widgets``; the view model
they draw is ``console/view/``."""
