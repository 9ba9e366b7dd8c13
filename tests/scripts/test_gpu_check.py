"""``make gpu-check`` (issue 23 item 7): on a machine without CUDA it writes ``{"cuda": false, ...}`` with the
reason and exits 0; its plan holds every GPU check the issue lists, the NCCL ones only where 2 GPUs exist."""

from __future__ import annotations

import json
import os
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
