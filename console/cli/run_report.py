"""The end of a run as the CLI prints it: the visits table, the training and provisioning lines, a loss
sparkline and the ledger head (shared by ``gputravel run`` and a fleet's ``run --gpus N``)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["EXIT_PARTIAL", "render_report", "sparkline"]

#: the run finished but some visits failed
EXIT_PARTIAL = 9


def sparkline(values: list[float], *, width: int = 60) -> str:
    """A one-line plot: ``values`` averaged into ``width`` buckets, drawn with block characters."""
    if not values:
        return ""
    blocks = "▁▂▃▄▅▆▇█"
    n = min(width, len(values))
    buckets = [values[i * len(values) // n: (i + 1) * len(values) // n] for i in range(n)]
    means = [sum(b) / len(b) for b in buckets if b]
    lo, hi = min(means), max(means)
    span = (hi - lo) or 1.0
    return "".join(blocks[min(7, int((m - lo) / span * 7.999))] for m in means)


def render_report(console: Console, report: dict[str, Any]) -> None:
    plat = report["platform"]
    console.print(f"\n[bold]platform[/]: {plat['kind']}{' [yellow](SIM)[/]' if plat.get('sim') else ''} · "
                  f"{plat['device']}")
    table = Table(title="visits", show_lines=False, pad_edge=False, box=None, header_style="bold",
                  collapse_padding=True)
    multi_part = any(v["part"] != "1/1" for v in report["visits"])
    fleet = "device" in (report["visits"] or [{}])[0]  # a fleet's visits name their GPU
    cols = ["#"] + (["gpu", "step"] if fleet else []) + ["holder"] + (["part"] if multi_part else []) + ["ep", "key fp", "MiB", "MB/s", "train s",
                                                                 "loss", "val", "i s", "outcome"]
    for col in cols:
        table.add_column(col, no_wrap=True,
                         justify="right" if col in ("#", "ep", "MiB", "MB/s", "train s", "val") else "left")
    for v in report["visits"]:
        loss = f"{v['loss_first']:.2f}→{v['loss_last']:.2f}" if v["loss_first"] is not None else "-"
        outcome = v["outcome"] if v["outcome"] != "failed" else f"[red]failed[/] ({v['failed_phase']})"
        row = [str(v["visit"] + 1)] + ([str(v["gpu"]), str(v["step"])] if fleet else []) + [v["holder"]] + (
            [v["part"]] if multi_part else []) + [
            str(v["epoch"]), (v["key_fingerprint"] or "-")[:8], f"{v['bytes'] / 2**20:.2f}",
            f"{v['provision_mb_s']:.0f}", f"{v['train_s']:.2f}", loss,
            f"{v['val_loss']:.3f}" if v["val_loss"] is not None else "-",
            ("✓" if v["integrity_ok"] else "✗") + ("✓" if v["scrub_verified"] else "✗"), outcome]
        table.add_row(*row)
    console.print(table)
    console.print("[dim]i s: integrity verified after return, buffer scrub verified[/]")
    tr, pv, lg = report["training"], report["provisioning"], report["ledger"]
    if tr["loss_first"] is not None:
        console.print(f"[bold]training[/]: {tr['steps']} steps, loss {tr['loss_first']:.3f} → {tr['loss_last']:.3f}, "
                      f"val {tr['val_loss'] if tr['val_loss'] is None else round(tr['val_loss'], 3)}")
    if tr.get("loss_curve"):
        console.print(f"[bold]loss[/]     {sparkline(tr['loss_curve'], width=60)}  "
                      f"({min(tr['loss_curve']):.2f}..{max(tr['loss_curve']):.2f} over {len(tr['loss_curve'])} steps)")
    if pv["mb_s"]:
        console.print(f"[bold]provisioning[/]: {pv['bytes'] / 2**20:.1f} MiB at {pv['mb_s']:.0f} MB/s "
                      f"(chunks {pv['chunk_kib']} KiB), rejected {pv['rejected'] or 'none'}")
    if pv.get("cipher_engine"):
        console.print(f"[bold]chunks opened by[/]: {pv['cipher_engine']} ({pv.get('cipher_engine_reason') or '?'})")
    console.print(f"[bold]ledger[/]: {escape(str(lg['path']))} · "
                  f"{'[green]verified[/]' if lg['verified'] else '[red]BROKEN[/]'} ({lg['rows']} rows); head "
                  f"(`gputravel ledger verify RUN --head ...` checks it later):", soft_wrap=True)
    # the head alone on its line (73 columns for a 64-digit hash), never wrapped or styled: a terminal copies it
    console.print(f"{lg['rows']}:{lg['head']}", soft_wrap=True, highlight=False, markup=False)
