"""``make gpu-check``: every check that needs a GPU, in one command, into one report (issue 23 item 7).

Runs, each as its own process with a time limit, and keeps every result (exit code, wall time, the
command's JSON report or its output's tail):

* ``tests``: the ``gpu``-marked tests (``pytest -m gpu``);
* ``provision_gpu`` / ``provision_cpu``: ``bench provision`` into CUDA, chunks opened by the GPU cipher and
  by host cores;
* ``gpu_aes``: ``bench gpu-aes`` (the GPU cipher against cryptography, every size);
* ``train_gpt2``: ``bench train --model gpt2``, the protocol against a plain loop on the GPU's batch;
* ``allreduce_secure_gpu``: ``bench allreduce`` with ``secure_gpu`` (hops sealed and opened on the GPU);
* ``nccl_allreduce`` and ``nccl_fleet``: a 2-rank NCCL all-reduce and fleet, where 2 GPUs exist.

Without CUDA it writes ``{"cuda": false, "reason": ..., ...}`` and exits 0: the machine has nothing to check.
With CUDA it exits 1 when a check failed. ``--plan`` prints the checks it would run and runs nothing: each
with what it measures and its goal (issue 34 item 5), so one GPU sitting fills docs/performance.md's table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TAIL = 4000


@dataclass(frozen=True)
class Check:
    name: str
    argv: list[str]
    timeout_s: int
    json_out: bool = True
    min_gpus: int = 1
    #: what the row measures and the goal it is read against (the issues' targets; docs/performance.md)
    measures: str = ""
    goal: str = ""


def gputravel(*args: str) -> list[str]:
    return [sys.executable, "-m", "gputravel.console.cli", *args]


def plan(gpus: int, *, quick: bool = False) -> list[Check]:
    """The checks for a machine with ``gpus`` CUDA devices (``quick``: smaller sizes, for a short lease)."""
    steps = "4" if quick else "8"
    batch = "8" if quick else "16"
    checks = [
        Check("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests"],
              900, json_out=False, measures="the gpu-marked tests (GPU cipher against cryptography, CUDA buffers)",
              goal="all pass"),
        Check("provision_gpu", gputravel("bench", "provision", "--path", "direct", "--cipher-engine", "gpu",
                                         "--size-mib", "64" if quick else "256", "--repeats", "2", "--json"), 600,
              measures="provisioning into CUDA, chunks opened by the GPU cipher: rows[].mb_s against the same "
                       "run's one-core AES-GCM (rows[].fraction_of_aes_core) and its bound (fraction_of_bound); "
                       "rows[].fixed_stages_s, the hand-off's fixed cost by stage",
              goal=">= 0.8 of one AES-GCM core; fixed cost <= 2 ms a hand-off"),
        Check("provision_cpu", gputravel("bench", "provision", "--path", "direct", "--cipher-engine", "cpu",
                                         "--size-mib", "64" if quick else "256", "--repeats", "2", "--json"), 600,
              measures="provisioning into CUDA, chunks opened by host cores (the one-core yardstick beside "
                       "provision_gpu)",
              goal=">= 0.8 of one AES-GCM core; provision_gpu >= 2.5x this row"),
        Check("gpu_aes", gputravel("bench", "gpu-aes", "--json"), 600,
              measures="GPU AES-256-GCM open+verify GB/s per batch size, byte-compatible with cryptography",
              goal=">= 50 GB/s at >= 64 MiB batches on an H100, >= 6x one CPU core"),
        Check("train_gpt2", gputravel("bench", "train", "--model", "gpt2", "--holders", "2", "--steps", steps,
                                      "--batch-size", batch, "--seq-len", "1024", "--dataset-mib", "8",
                                      "--device", "cuda", "--json"), 900,
              measures="GPT-2 124M: the protocol's cost over a plain loop at the GPU's batch (protocol_cost_pct)",
              goal="protocol cost <= 5%"),
        Check("allreduce_secure_gpu", gputravel("bench", "allreduce", "--world-size", "2", "--size-mib", "64",
                                                "--variants", "plain,secure_pipelined,secure_gpu", "--repeats", "5",
                                                "--json"), 600,
              measures="secure all-reduce with hops sealed and opened on the GPU against plain; rows[].bound_ratio "
                       "(the ring's cipher passes at the measured cipher speed plus plain's copies, over plain)",
              goal="secure <= 1.1x its bound (rows[].fraction_of_bound >= 0.91)"),
        Check("nccl_allreduce", gputravel("bench", "allreduce", "--backend", "nccl", "--world-size", "2",
                                          "--size-mib", "64", "--variants", "plain,secure_gpu", "--repeats", "5",
                                          "--json"), 600, min_gpus=2,
              measures="secure all-reduce on NCCL, 2 GPUs: secure_gpu against NCCL's plain all-reduce",
              goal="secure <= 1.1x its bound"),
        Check("nccl_fleet", gputravel("bench", "fleet", "--gpus", "1,2", "--model", "tiny", "--repeats", "1",
                                      "--json"), 900, min_gpus=2,
              measures="a 2-rank fleet on NCCL: steps/s with the secure ring against one GPU",
              goal="runs; 2 GPUs faster than 1"),
    ]
    return [c for c in checks if c.min_gpus <= max(gpus, 1)]


def cuda_status() -> dict[str, Any]:
    """``cuda`` true/false and, without it, the reason; the device and versions with it."""
    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch
    except ImportError as exc:
        return {**info, "cuda": False, "reason": f"torch is not importable: {exc}"}
    info["torch"] = torch.__version__
    if torch.version.cuda is None:
        return {**info, "cuda": False, "reason": f"this torch ({torch.__version__}) is built without CUDA"}
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return {**info, "cuda": False, "reason": "no CUDA device is visible (torch built for CUDA "
                f"{torch.version.cuda}; CUDA_VISIBLE_DEVICES={visible!r})"}
    n = torch.cuda.device_count()
    return {**info, "cuda": True, "cuda_version": torch.version.cuda, "gpus": n,
            "devices": [torch.cuda.get_device_name(i) for i in range(n)]}


def last_json(text: str) -> Any:
    """The JSON document a command printed (the whole output, else its last line that parses)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def run_check(check: Check) -> dict[str, Any]:
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(check.argv, cwd=ROOT, capture_output=True, text=True, timeout=check.timeout_s, env=env)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = (exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")) + \
            f"\ntimed out after {check.timeout_s} s"
    result: dict[str, Any] = {"command": " ".join(check.argv[2:] if check.argv[1:3] == ["-m", "gputravel.console.cli"]
                                                  else check.argv[1:]),
                              "rc": rc, "ok": rc == 0, "wall_s": round(time.perf_counter() - t0, 3),
                              "goal": check.goal}
    parsed = last_json(out) if check.json_out else None
    if parsed is not None:
        result["report"] = parsed
    else:
        result["stdout_tail"] = out[-TAIL:]
    if rc != 0 or parsed is None:
        result["stderr_tail"] = err[-TAIL:]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", type=Path, default=ROOT / "gpu-report.json")
    ap.add_argument("--only", default="", help="Comma list of check names (default: all).")
    ap.add_argument("--quick", action="store_true", help="Smaller sizes (a short GPU lease).")
    ap.add_argument("--plan", action="store_true", help="Print the checks for this machine and run nothing.")
    ap.add_argument("--assume-gpus", type=int, default=None, help="With --plan: plan for this many GPUs.")
    args = ap.parse_args(argv)

    status = cuda_status() if args.assume_gpus is None else {"cuda": args.assume_gpus > 0, "gpus": args.assume_gpus}
    checks = plan(int(status.get("gpus", 0)), quick=args.quick)
    if args.only:
        wanted = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = wanted - {c.name for c in plan(2)}
        if unknown:
            ap.error(f"unknown checks: {', '.join(sorted(unknown))}")
        checks = [c for c in checks if c.name in wanted]
    if args.plan:
        print(json.dumps({**status, "checks": [asdict(c) for c in checks]}, indent=2))
        return 0
    if args.output.parent != Path() and not args.output.parent.is_dir():
        ap.error(f"--output: no folder {args.output.parent}")
    started = time.time()
    report: dict[str, Any] = {**status, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}
    if not status["cuda"]:
        report.update(ok=True, checks={}, skipped=[c.name for c in plan(2)],
                      goals={c.name: c.goal for c in plan(2)})
        write(args.output, report)
        print(f"gpu-check: no CUDA ({status['reason']}); wrote {args.output}")
        return 0
    report["checks"] = {}
    report["skipped"] = {c.name: f"needs {c.min_gpus} GPUs" for c in plan(2) if c.min_gpus > status["gpus"]}
    for check in checks:
        print(f"gpu-check: {check.name} ...", flush=True)
        report["checks"][check.name] = result = run_check(check)
        print(f"gpu-check: {check.name} rc={result['rc']} ({result['wall_s']} s)", flush=True)
        write(args.output, report)  # every finished check is on disk, even if a later one hangs the machine
    report["ok"] = all(r["ok"] for r in report["checks"].values())
    report["seconds"] = round(time.time() - started, 1)
    write(args.output, report)
    print(f"gpu-check: {'all passed' if report['ok'] else 'FAILED'}; wrote {args.output}")
    return 0 if report["ok"] else 1


def write(path: Path, report: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
