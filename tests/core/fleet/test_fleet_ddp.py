"""The device side of the fleet under torchrun (gloo, two real processes): replicas stay identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from gputravel.core.attestation import VendorCA
from gputravel.core.collectives.launch import free_port

WORKER = Path(__file__).with_name("fleet_ddp_worker.py")


def _torchrun(out: Path, variant: str) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "vendor").exists():
        ca = VendorCA.generate()
        ca.save(out / "vendor")
        for r in range(2):
            ca.issue_device(f"emu-gpu-{r}").save(out / f"device-{r}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"fleet-ddp-{uuid.uuid4().hex[:8]}",
           "--max-restarts", "0", str(WORKER), str(out), variant]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("fleet-ddp")
    secure, plain = base / "secure", base / "plain"
    (secure / "vendor").parent.mkdir(parents=True, exist_ok=True)
    _torchrun(secure, "secure_pipelined")
    # the same devices (same vendor, same identities) with the plain all-reduce
    plain.mkdir()
    for name in ("vendor", "device-0", "device-1"):
        os.symlink(secure / name, plain / name)
    _torchrun(plain, "plain")
    return {"secure": secure, "plain": plain}


def _ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


def test_replicas_digests_match_after_every_step(runs: dict[str, Path]) -> None:
    r0, r1 = _ranks(runs["secure"])
    assert len(r0["digests"]) == 3
    assert r0["digests"] == r1["digests"]
    assert len(set(r0["digests"])) == 3  # the model moved every step


def test_every_hop_was_sealed_under_keys_from_the_devices_identities(runs: dict[str, Path]) -> None:
    r0, r1 = _ranks(runs["secure"])
    assert r0["peers"]["sealed"] and r1["peers"]["sealed"]
    assert r0["peers"]["peers"]["right"].startswith("emu-gpu-1:")
    assert r1["peers"]["peers"]["left"].startswith("emu-gpu-0:")
    assert r0["peers"]["send_fp"] == r1["peers"]["recv_fp"]  # one link key, each end derived it
    assert all(res["allreduce_calls"] >= 2 for res in r0["results"])  # every optimizer step reduced


def test_idle_device_trains_nothing_but_keeps_its_replica_equal(runs: dict[str, Path]) -> None:
    r0, r1 = _ranks(runs["secure"])
    assert r1["results"][1]["losses"] == [] and r1["results"][1]["tokens"] == 0
    assert len(r0["results"][1]["losses"]) == 2
    assert r0["digests"][1] == r1["digests"][1]


def test_plain_all_reduce_with_the_same_seed_gives_the_same_model(runs: dict[str, Path]) -> None:
    secure = torch.load(runs["secure"] / "rank-0.pt")
    plain = torch.load(runs["plain"] / "rank-0.pt")
    assert _ranks(runs["plain"])[0]["peers"]["sealed"] is False
    for name, tensor in secure.items():
        torch.testing.assert_close(tensor, plain[name], rtol=1e-4, atol=1e-5)
