"""What a benchmark prints with every figure: the machine it ran on."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """Cores this process may use, CPU model, accelerator, versions."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cuda = torch.cuda.is_available()
    return {"cores": cores, "cpu": cpu_model(), "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "cuda": cuda, "python": sys.version.split()[0], "torch": torch.__version__,
            "platform": platform.platform()}
