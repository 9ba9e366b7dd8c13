"""``gputravel-console``: the ``console`` command, its options and how it builds each run.

The TUI's entry point (``console/tui/app.py``: ``main``) registers this command with its own app factory, so
this module imports no Textual: the options are :class:`RunOptions`, as ``gputravel run``'s are.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from gputravel.console.cli.launch import next_out_dir
from gputravel.console.cli.options import (
    DataPathChoice,
    PhaseChoice,
    ThemeChoice,
    TransportChoice,
    quiet_flag_types,
    version_callback,
)
from gputravel.console.cli.run_options import (
    BUFFER_MIB_DEFAULT,
    CHUNK_KIB_DEFAULT,
    CHUNK_KIB_HELP,
    DATA_HOST_DEFAULT,
    DATA_HOST_HELP,
    DATA_PATH_DEFAULT,
    DATA_PATH_HELP,
    HOLDERS_FILE_HELP,
    ROUNDS_HELP,
    STEPS_PER_VISIT_DEFAULT,
    STEPS_PER_VISIT_HELP,
    TRANSPORT_DEFAULT,
    TRANSPORT_HELP,
    RunOptions,
    resolve_out_dir,
)
from gputravel.core.runfolder import RUNS_DIR, clear_running, mark_running

__all__ = ["register"]

HOLDERS_PANEL, RUN_PANEL, VIEW_PANEL = "Holders and data path", "The run", "Screen, replay and recording"


def come_back(folder: Path) -> str:
    """What a detached console prints: how to come back to the run, one whole command a line (at 80 columns the
    terminal broke them mid-word, ``--a`` / ``ttach``: walk 16)."""
    return (f"detached from {folder}: the run goes on. Come back with\n"
            f"  gputravel-console --attach {folder}    (full control)\n"
            f"  gputravel-console --replay {folder} --follow    (read-only)")


def left_message(how: str, folder: Path, *, proc: Any = None) -> str | None:
    """What the console prints as it leaves a run it steered: how to come back, or how the cancel ended."""
    if how == "detach":
        return come_back(folder)
    if how != "cancel":
        return None
    if proc is not None:  # its own run: wait for the cancel to land (after the current step or chunk)
        import subprocess

        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            return f"cancel asked of {folder}: the run has not ended yet (gputravel runs show {folder})"
    from gputravel.console.view.run_info import read_run

    return f"cancel asked of {folder}: the run is {read_run(folder).status} (gputravel runs show {folder})"


def attach_run(address: str, *, make_app: Callable[..., Any], theme: str, readonly: bool) -> None:
    """``--attach RUN``: the run's follow view with its controls (read-only with ``--readonly``, or while another
    console steers it, until ``:take``); leaving it leaves the run going, and says how to come back."""
    from gputravel.core.runfolder import replay_target, resolve_run

    folder = resolve_run(address).folder
    if folder is None:
        raise typer.BadParameter(f"{address}: a recording outside any run folder has no run to attach to",
                                 param_hint="--attach")
    app = make_app(replay=replay_target(address), theme=theme, readonly=readonly, follow=True,
                   attach=None if readonly else folder)
    app.run()
    how = app.left_how
    if how == "quit":  # left without the question: a run that has ended, or one another console steers
        from gputravel.console.view.run_info import read_run

        how = "detach" if read_run(folder).status in ("running", "paused") else how
    said = left_message(how, folder.absolute())
    if said is not None:
        typer.echo(said)


def launch_args(options: RunOptions, *, interval: float) -> tuple[str, ...]:
    """``gputravel run``'s options for the console's options (its own runs: headless processes)."""
    args = ["--rounds", str(options.rounds), "--steps-per-visit", str(options.steps_per_visit),
            "--buffer-mib", repr(options.buffer_mib), "--chunk-kib", str(options.chunk_kib),
            "--transport", options.transport, "--data-path", options.data_path, "--data-host", options.data_host,
            "--telemetry-interval", repr(interval)]
    if options.data is not None:
        args += ["--data", str(Path(options.data).absolute())]
    if options.holders is not None:
        args += ["--holders", str(options.holders)]
    if options.holders_file is not None:
        args += ["--holders-file", str(Path(options.holders_file).absolute())]
    return tuple(args)


def register(app: typer.Typer, *, make_app: Callable[..., Any], watch_fleet: Callable[..., None]) -> None:
    """Add the ``console`` command to ``app``; ``make_app`` is the TUI's app factory (``make_app(...)``) and
    ``watch_fleet(settings, gpus=, theme=)`` its fleet view, given by the TUI."""
    quiet_flag_types()

    @app.command()
    def console(
        data: Annotated[Path | None, typer.Option("--data", help="One subfolder per holder (default: the embedded "
                                                                "Shakespeare corpus).", rich_help_panel=HOLDERS_PANEL)] = None,
        holders: Annotated[int | None, typer.Option(help="Number of holders (default: one per --data subfolder; "
                                                         "3 without --data, as gputravel run).",
                                                    rich_help_panel=HOLDERS_PANEL)] = None,
        holders_file: Annotated[Path | None, typer.Option("--holders-file", help=HOLDERS_FILE_HELP,
                                                          rich_help_panel=HOLDERS_PANEL)] = None,
        transport: Annotated[TransportChoice, typer.Option(help=TRANSPORT_HELP,
                                                           rich_help_panel=HOLDERS_PANEL)] = TRANSPORT_DEFAULT,
        data_path: Annotated[DataPathChoice, typer.Option(help=DATA_PATH_HELP,
                                                          rich_help_panel=HOLDERS_PANEL)] = DATA_PATH_DEFAULT,
        data_host: Annotated[str, typer.Option("--data-host", help=DATA_HOST_HELP,
                                               rich_help_panel=HOLDERS_PANEL)] = DATA_HOST_DEFAULT,
        out: Annotated[Path | None, typer.Option("--out", help="Run folder (default: a new runs/run-<time>); a "
                                                               "second run in the same console goes to OUT-2, then "
                                                               "OUT-3.", rich_help_panel=RUN_PANEL)] = None,
        rounds: Annotated[int, typer.Option(help=ROUNDS_HELP, rich_help_panel=RUN_PANEL)] = 1,
        steps_per_visit: Annotated[int, typer.Option(help=STEPS_PER_VISIT_HELP,
                                                     rich_help_panel=RUN_PANEL)] = STEPS_PER_VISIT_DEFAULT,
        buffer_mib: Annotated[float, typer.Option(help="GPU data buffer (MiB).", rich_help_panel=RUN_PANEL)] = BUFFER_MIB_DEFAULT,
        chunk_kib: Annotated[int, typer.Option(help=CHUNK_KIB_HELP, rich_help_panel=RUN_PANEL)] = CHUNK_KIB_DEFAULT,
        break_before: Annotated[list[PhaseChoice], typer.Option("--break-before", case_sensitive=False,
                                                                metavar="<phase>", rich_help_panel=RUN_PANEL,
                                                                help="Pause before this phase (repeatable): "
                                                                "attest, handoff, provision, return, verify, train, "
                                                                "scrub or rotate.")] = [],  # noqa: B006
        theme: Annotated[ThemeChoice, typer.Option("--theme", help="Colour theme (ctrl+p offers the same).",
                                                   rich_help_panel=VIEW_PANEL)] = ThemeChoice.DARK,
        readonly: Annotated[bool, typer.Option("--readonly", help="Observer mode: no controls, no benchmarks.",
                                               rich_help_panel=VIEW_PANEL)] = False,
        replay: Annotated[Path | None, typer.Option("--replay", help="Play a recording instead of a live run: a "
                                                                     "recording file, a run or fleet folder (all its "
                                                                     "GPUs), a run name or latest.",
                                                    rich_help_panel=VIEW_PANEL)] = None,
        attach: Annotated[str | None, typer.Option("--attach", metavar="RUN", help="Attach to a run another "
                                                   "process drives (gputravel run): follow it and steer it through "
                                                   "its control channel; q leaves it going.",
                                                   rich_help_panel=VIEW_PANEL)] = None,
        node_folders: Annotated[list[Path] | None, typer.Option(
            "--node-folder", metavar="DIR", help="With --replay of a fleet over several nodes: another node's fleet "
            "folder (or a copy), whose GPUs merge with this node's (repeatable).", rich_help_panel=VIEW_PANEL)] = None,
        follow: Annotated[bool, typer.Option("--follow", help="With --replay: follow a recording still being "
                                                              "written (watch a run live).",
                                             rich_help_panel=VIEW_PANEL)] = False,
        record: Annotated[Path | None, typer.Option("--record", help="Record to this file (default: "
                                                                     "<out>/recording.db).",
                                                    rich_help_panel=VIEW_PANEL)] = None,
        no_record: Annotated[bool, typer.Option("--no-record", help="Do not record the run.",
                                                rich_help_panel=VIEW_PANEL)] = False,
        interval: Annotated[float, typer.Option("--interval", min=0.1, help="Telemetry interval (s).",
                                                rich_help_panel=VIEW_PANEL)] = 1.0,
        version: Annotated[bool, typer.Option("--version", callback=version_callback, is_eager=True,
                                              help="Print the version and exit.")] = False,
        gpus: Annotated[int, typer.Option("--gpus", min=1, rich_help_panel=RUN_PANEL,
                                          help="A fleet of N GPUs runs under torchrun; the console follows all "
                                               "N, read-only (docs/fleet.md).")] = 1,
        in_process: Annotated[bool, typer.Option("--in-process", rich_help_panel=RUN_PANEL,
                                                 help="Run inside the console's own process (the run ends with "
                                                 "the console; q asks first). Default: each run is its own "
                                                 "headless gputravel run process, which outlives the console.")
                              ] = False,
    ) -> None:
        """The operator console: watch the GPU travel, step the protocol, audit the ledger."""
        if attach is not None:
            attach_run(attach, make_app=make_app, theme=theme.value, readonly=readonly)
            return
        if readonly and replay is None and gpus == 1:
            raise typer.BadParameter("--readonly watches a run that something else drives; give it the run: "
                                     "--replay RUN --follow (RUN: latest, a run name or folder, or a recording; "
                                     "gputravel runs ls lists them)", param_hint="--readonly")
        options = RunOptions.given(data=data, holders=holders, holders_file=holders_file, transport=transport,
                                   data_path=data_path, data_host=data_host, rounds=rounds,
                                   steps_per_visit=steps_per_visit, buffer_mib=buffer_mib, chunk_kib=chunk_kib,
                                   break_before=break_before)
        breakpoints = options.break_before
        if gpus > 1 and replay is None:
            watch_fleet(options.settings(resolve_out_dir(out, resume=False).absolute(), breakpoints=()), gpus=gpus,
                        theme=theme.value)
            return
        holder_sets: list[Any] = []  # the holders (e.g. the embedded SSH server) of the run built last

        def close_holders() -> None:
            while holder_sets:
                holder_sets.pop().close()

        launcher = None
        if replay is not None:  # any run address: a recording, a run or fleet folder, a name, latest
            from gputravel.core.runfolder import replay_target

            more = {"nodes": tuple(node_folders)} if node_folders else {}  # a fleet's other nodes' folders
            app = make_app(replay=replay_target(replay), theme=theme.value, readonly=readonly, follow=follow, **more)
        elif not in_process:  # each run its own headless `gputravel run`, attached: it outlives the console
            from gputravel.console.cli.launch import Launcher

            options.settings(RUNS_DIR / "pending")  # bad options fail here, before the screen opens
            if data is not None and holders_file is None:  # and the data, as `run` reads it
                from gputravel.core.compose import resolve_holder_dirs

                resolve_holder_dirs(options.settings(RUNS_DIR / "pending"))
            if no_record:
                raise typer.BadParameter("the console follows its runs through their recording: drop --no-record, "
                                         "or run inside the console with --in-process", param_hint="--no-record")
            launcher = Launcher(launch_args(options, interval=interval), out=out, record=record)
            app = make_app(launcher=launcher, theme=theme.value, readonly=readonly, breakpoints=breakpoints)
        else:
            checked = options.settings(RUNS_DIR / "pending")  # bad options fail here, before the screen opens
            if data is not None and holders_file is None:  # and the data, as `run` reads it: no folder made
                from gputravel.core.compose import resolve_holder_dirs  # for a run whose input is refused

                resolve_holder_dirs(checked)
            runs_built = 0
            markers: list[Path] = []  # the pid file of the run built last

            def factory() -> Any:
                """Blocking (the bridge calls it off the loop): the holders, as `gputravel run` composes them,
                then the engine (``core.compose`` through ``core.api``)."""
                from gputravel.console import holders as holder_module
                from gputravel.console.entries import ENTRIES
                from gputravel.core import api

                nonlocal runs_built
                close_holders()  # a new run is built only once the previous one is over
                while markers:
                    clear_running(markers.pop())
                runs_built += 1
                target = (next_out_dir(out, runs_built) if out is not None
                          else resolve_out_dir(None, resume=False)).absolute()
                run_settings = options.settings(target, breakpoints=())
                holder_set = holder_module.HolderSet(run_settings)
                holder_sets.append(holder_set)
                try:
                    engine = api.build_engine(run_settings, links=holder_set.links(), entries=ENTRIES)
                except BaseException:
                    close_holders()
                    raise
                markers.append(mark_running(target, owner="gputravel-console"))
                return engine

            rec: Path | bool = False if no_record else (record if record is not None else True)
            app = make_app(engine_factory=factory, theme=theme.value, readonly=readonly, record=rec,
                           telemetry_interval=interval, breakpoints=breakpoints)
        try:
            app.run()
        finally:
            close_holders()
            if replay is None and launcher is None:
                while markers:
                    clear_running(markers.pop())
        last = launcher.last if launcher is not None else None
        if last is not None and (last.exit_code() is None or app.left_how == "cancel"):
            said = left_message(app.left_how, last.folder, proc=last.proc)
            typer.echo(said or come_back(last.folder))
