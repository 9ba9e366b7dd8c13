"""The console's TUI wing: the Textual app (``app``, ``app_commands``), the bridges from a run or a
recording to messages (``bridge``, ``replay_bridge``, ``fleet_view``), the view model (``view_model``,
``view_training``, ``view_fleet``), ``screens`` and ``widgets``."""
