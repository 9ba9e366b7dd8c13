"""``gputravel run``'s progress on the terminal: :class:`RunView`, an event sink that draws rich bars (the whole
run, the current visit's phases, the bytes or steps of the phase running) and prints the events an operator reads
(attestation, holders, losses, rejected chunks, failures, a pause with how to go on: :func:`continue_hint`)."""

from __future__ import annotations

import os

from rich.console import Console
from rich.markup import escape

from gputravel.console.cli.run_bars import Label, RunBars
from gputravel.console.view.ending import control_lands
from gputravel.core import events as ev

__all__ = ["RunView", "continue_hint"]


class RunView:
    """Rich progress: one bar for the whole run, one for the phases of the current visit,
    one for the bytes of the current provisioning."""

    PHASES = 8

    def __init__(self, console: Console, *, run_name: str | None = None) -> None:
        self.console = console
        self.run_name = run_name  # for the hint a pause prints
        # laid out for the terminal's width: at 80 columns rich's own layout cut the counts and times (session 15)
        self.progress = RunBars(console)
        # hidden until the run's first event: input refused before the run starts (a --data folder the engine
        # refuses) printed three empty bars above its error (operator walk, session 15)
        self.run_task = self.progress.add_task("visits", total=None, info="", label=Label("visits"),
                                               visible=False)
        self.phase_task = self.progress.add_task("phase", total=self.PHASES, info="", label=Label("phase"),
                                                 visible=False)
        self.bytes_task = self.progress.add_task("provisioning", total=1, info="", label=Label("provisioning"),
                                                 visible=False)
        self.shown = False
        self.provision_t0: float | None = None  # when the visit's PROVISION began: its bar's rate

    def __call__(self, event: ev.Event) -> None:
        p = self.progress
        if not self.shown:
            self.shown = True
            for task in (self.run_task, self.phase_task, self.bytes_task):
                p.update(task, visible=True)
        if isinstance(event, ev.RunStarted):
            p.update(self.run_task, total=event.visits_planned, info=f"run {event.run_id}")
        elif isinstance(event, ev.DeviceAttested):
            self.console.print(f"[bold]attested[/] {event.device_id} "
                               f"{'[green]ok[/]' if event.ok else '[red]FAILED[/]'}"
                               f"{'  [yellow]SIM[/] (emulated platform)' if event.sim else ''}")
        elif isinstance(event, ev.HolderConnected):
            self.console.print(f"holder [cyan]{event.holder}[/]: {event.train_bytes + event.val_bytes:,} bytes "
                               f"({event.fmt}), agent {event.agent_sha256[:12]}")
        elif isinstance(event, ev.PhaseStarted):
            if event.phase == "ATTEST":
                p.reset(self.phase_task, total=self.PHASES, info="", label=Label("phase"))
                p.reset(self.bytes_task, total=1, description="provisioning", info="", label=Label("provisioning"))
            if event.phase == "PROVISION":
                self.provision_t0 = event.t
            p.update(self.phase_task, description=f"visit {event.visit + 1} {event.holder} · {event.phase}",
                     label=Label(f"visit {event.visit + 1}", event.holder, f"· {event.phase}"),
                     info=f"epoch {event.epoch}")
        elif isinstance(event, ev.PhaseCompleted):
            p.advance(self.phase_task)
        elif isinstance(event, ev.ProvisionProgressed):
            took = event.t - self.provision_t0 if self.provision_t0 is not None else 0.0
            p.update(self.bytes_task, total=event.total, completed=event.nbytes,
                     count=(f"{event.nbytes / 2**20:.1f}/{event.total / 2**20:.1f} MiB",
                            f"{event.total / 2**20:.1f}/{event.total / 2**20:.1f} MiB"),
                     info=f"{event.nbytes / took / 1e6:,.1f} MB/s" if took > 0 else "")
        elif isinstance(event, ev.TrainingProgressed):  # the third bar counts the visit's steps while TRAIN runs
            p.update(self.bytes_task, description="training steps", total=event.steps, completed=event.step,
                     label=Label("training steps"), count=None,
                     info=f"loss {event.loss:.3f} · {event.tokens_per_s:,.0f} tok/s")
        elif isinstance(event, ev.LossSpiked):
            self.console.print(f"  [yellow]loss spike[/] visit {event.visit + 1} {escape(event.holder)} step "
                               f"{event.run_step}: {event.loss:.3f} > {event.factor:g} x running mean "
                               f"{event.mean:.3f}")
        elif isinstance(event, ev.ControlRequested):
            self.console.print(f"[yellow]{'CANCELLING' if event.action == 'cancel' else 'PAUSING'}...[/] "
                               f"({f'{event.phase}: ' if event.phase else ''}lands "
                               f"{control_lands(event.action, event.phase)})")
        elif isinstance(event, ev.VisitCancelled):
            self.console.print(f"  [yellow]visit {event.visit + 1} {escape(event.holder)} cancelled[/] in "
                               f"{event.phase or '-'}{f' after {event.steps} steps' if event.phase == 'TRAIN' else ''}"
                               f"; buffer scrub "
                               f"{'verified' if event.scrub_verified else '[red]NOT verified[/]'}")
        elif isinstance(event, ev.TrainingStepped):
            p.update(self.bytes_task, description="training steps", total=len(event.losses),
                     completed=len(event.losses), label=Label("training steps"), count=None,
                     info=f"{event.tokens_per_s:,.0f} tok/s")
            last = event.losses[-1]
            val = f", val {event.val_loss:.3f}" if event.val_loss is not None else ""
            self.console.print(f"  visit {event.visit + 1} [cyan]{event.holder}[/]: loss {event.losses[0]:.3f} → "
                               f"{last:.3f}{val}  ({event.tokens_per_s:,.0f} tok/s)")
        elif isinstance(event, ev.ChunkRejected):
            self.console.print(f"  [yellow]chunk rejected[/] {escape(event.holder)} seq {event.seq}: {event.code} "
                               f"({escape(event.reason)})")
        elif isinstance(event, ev.VisitCompleted):
            p.advance(self.run_task)
        elif isinstance(event, ev.VisitFailed):
            p.advance(self.run_task)
            self.console.print(f"  [red]visit {event.visit + 1} {escape(event.holder)} failed[/] in {event.phase}: "
                               f"{escape(event.error)}")
        elif isinstance(event, ev.RunPaused):
            where = f"in {event.within}" if event.within else f"before {event.next_phase}"
            self.console.print(f"[yellow]paused[/] ({event.reason}) {where}")
            if self.run_name is not None:
                self.console.print(continue_hint(self.run_name), highlight=False, soft_wrap=True)




def continue_hint(run_name: str) -> str:
    """What a headless pause says: how to go on, one whole command a line (never wrapped inside one at 80
    columns)."""
    return (f"  continue: gputravel runs resume {run_name}  (to the next breakpoint)\n"
            f"            gputravel runs step {run_name}    (one phase)\n"
            f"            kill -USR1 {os.getpid()}\n"
            f"  stop:     gputravel runs stop {run_name}")
