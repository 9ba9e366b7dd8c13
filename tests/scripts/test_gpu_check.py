"""``make gpu-check`` (issue 23 item 7): on a machine without CUDA it writes ``{"cuda": false, ...}`` with the
reason and exits 0; its plan holds every GPU check the issue lists, the NCCL ones only where 2 GPUs exist."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT

ROOT = REPO_ROOT
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def test_without_cuda_the_report_says_so_with_the_reason_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "gpu-report.json"
    proc = run("--output", str(out), env={"CUDA_VISIBLE_DEVICES": ""})  # hides any GPU of this machine
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["cuda"] is False and report["ok"] is True and report["checks"] == {}
    assert "CUDA" in report["reason"] and report["torch"] == torch.__version__
    assert {"tests", "gpu_aes", "train_gpt2", "allreduce_secure_gpu", "nccl_fleet"} <= set(report["skipped"])
    assert set(report["goals"]) == set(report["skipped"]) and all(report["goals"].values())
    assert "no CUDA" in proc.stdout


def test_the_plan_runs_every_gpu_check_and_nccl_only_on_two_gpus() -> None:
    one = json.loads(run("--plan", "--assume-gpus", "1").stdout)
    two = json.loads(run("--plan", "--assume-gpus", "2").stdout)
    names_one = [c["name"] for c in one["checks"]]
    names_two = [c["name"] for c in two["checks"]]
    assert names_one == ["tests", "provision_gpu", "provision_cpu", "gpu_aes", "train_gpt2", "allreduce_secure_gpu"]
    assert names_two == [*names_one, "nccl_allreduce", "nccl_fleet"]
    commands = {c["name"]: c["argv"] for c in two["checks"]}
    assert commands["tests"][-3:] == ["-m", "gpu", "tests"]
    assert "secure_gpu" in ",".join(commands["allreduce_secure_gpu"])
    assert commands["nccl_allreduce"][commands["nccl_allreduce"].index("--backend") + 1] == "nccl"
    assert commands["train_gpt2"][commands["train_gpt2"].index("--model") + 1] == "gpt2"


def test_an_unknown_check_name_is_a_usage_error() -> None:
    proc = run("--plan", "--only", "tests,warp-drive")
    assert proc.returncode == 2 and "warp-drive" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_with_cuda_the_report_names_the_device_and_keeps_each_checks_result(tmp_path: Path) -> None:
    out = tmp_path / "gpu-report.json"
    proc = run("--output", str(out), "--only", "gpu_aes")
    report = json.loads(out.read_text())
    assert report["cuda"] is True and report["devices"]
    assert report["checks"]["gpu_aes"]["rc"] == proc.returncode == 0 and "report" in report["checks"]["gpu_aes"]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_runs_the_script_into_gpu_report_json_with_its_args() -> None:
    """Issue 34 item 1: the target had gone (``Nothing to be done for 'gpu-check'``); ``make -n`` shows the recipe
    without running it, with GPU_CHECK_ARGS passed through."""
    proc = subprocess.run(["make", "-n", "gpu-check", "GPU_CHECK_ARGS=--quick --only gpu_aes"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Nothing to be done" not in proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "scripts/gpu_check.py" in x)
    assert "--output gpu-report.json" in line and line.rstrip().endswith("--quick --only gpu_aes")


def test_the_plan_names_what_each_row_measures_and_its_goal() -> None:
    """Issue 34 item 5: one GPU sitting fills the table, so every planned row says what it measures and the goal
    it is read against; the four rows the issue names are there."""
    checks = {c["name"]: c for c in json.loads(run("--plan", "--assume-gpus", "2").stdout)["checks"]}
    assert all(c["measures"] and c["goal"] for c in checks.values())
    assert "one AES-GCM core" in checks["provision_gpu"]["goal"] and "2 ms" in checks["provision_gpu"]["goal"]
    assert "GB/s" in checks["gpu_aes"]["goal"]
    assert "%" in checks["train_gpt2"]["goal"]
    assert "bound" in checks["nccl_allreduce"]["goal"]
