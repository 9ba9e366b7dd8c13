"""The console's view model, Textual-free: what the TUI draws and the CLI prints, folded from events only (so a
live run, a replay and ``gputravel runs`` read a run the same way). Read first:

* ``model.py``: ``RunState``, the run as the screens show it, folded from events (``RunState.apply``);
* ``training.py`` and ``fleet.py``: the folds ``RunState`` composes (training, a fleet's devices);
* ``run_info.py``: ``read_run``, a run folder's status as ``gputravel runs`` reports it;
* ``ending.py``: ``final_status`` and ``control_lands``, a run's ending and an operator's control in words.

It imports core only (events, the run folder, recordings); the CLI and the TUI import it.
"""
