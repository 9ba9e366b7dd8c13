"""The console's CLI wing: the typer app (``main``; ``python -m gputravel.console.cli``), one module per command
under ``commands``, shared ``options``, how a run ends (``run_end``, ``run_report``), the error mapping (``errors``) and the torchrun rank program (``fleet_rank``)."""
