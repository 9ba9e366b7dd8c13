"""``gputravel bench provision|allreduce|load|soak`` and ``gputravel agents deploy|status|stop`` run end
to end as real CLI processes, at their smallest settings: real emulated device services, real AES-GCM
and ECDH, real agents deployed over the loopback SSH server (``EmbeddedSshServer``).

Only outcomes and the report's own consistency are checked (fields present, numbers positive, ratios
equal to the numbers they are computed from, within the report's rounding); never a timing threshold.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import live_processes, write_holder

from gputravel.agents.holder import agent_sha256
from gputravel.agents.inventory import HolderSpec
from gputravel.agents.ssh_holder import SshHolderLink
from gputravel.agents.ssh_links import EmbeddedSshServer
from gputravel.core.errors import AgentError
from gputravel.core.protocol.shmring import ring_supported
from gputravel.core.travel import handoff as ho

MIB = 1 << 20
#: Orderings of measured intervals (a part within its whole) hold within this: the intervals are read by
#: different processes and rounded to microseconds, so a part may exceed its whole by rounding, never by more.
CLOCK_TOL_S = 1e-4
WORDS = "the quick brown fox jumps over a lazy dog while cat and bird sat on the warm mat".split()


def gputravel(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gputravel.console.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def report_of(*args: str) -> Any:
    """Run a command with ``--json``; it must exit 0 and print one JSON document on stdout."""
    res = gputravel(*args, "--json")
    assert res.returncode == 0, f"exit {res.returncode}\nstdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-3000:]}"
    return json.loads(res.stdout)


def near(value: float, expected: float, *, rel: float = 0.0, abs_: float = 0.0) -> bool:
    return math.isclose(value, expected, rel_tol=rel, abs_tol=abs_)


# --- bench provision -------------------------------------------------------------------------------
def test_bench_provision_reports_each_path_against_the_aes_core_rate_and_direct_over_ssh() -> None:
    r = report_of("bench", "provision", "--path", "direct,ssh", "--size-mib", "1", "--repeats", "1")
    assert r["benchmark"] == "provision" and r["machine"]["cores"] >= 1
    aes = r["aes_gcm_1core_mb_s"]
    assert aes > 0
    assert [row["path"] for row in r["rows"]] == ["direct", "ssh"]
    for row in r["rows"]:
        assert (row["size_mib"], row["chunk_kib"], row["repeats"]) == (1, 1024, 1)
        assert row["median_s"] > 0 and row["min_s"] == row["median_s"]  # one repeat: median is the one run
        assert row["mb_s"] > 0 and row["best_mb_s"] == row["mb_s"]
        assert near(row["mb_s"], MIB / row["median_s"] / 1e6, rel=2e-3, abs_=0.1)  # median_s has 6 decimals
        assert row["fraction_of_aes_core"] >= 0
        assert near(row["fraction_of_aes_core"], row["mb_s"] / aes, rel=1e-3, abs_=6e-4)
    direct, ssh = r["rows"]
    # per-stage seconds: the agent's (set-up, data phase; within it read/seal, wait) and the device's (open,
    # staging wait, H2D)
    for row in r["rows"]:
        st = row["stages"]
        assert set(st) == {"setup_s", "data_s", "read_seal_s", "wait_s", "open_s", "staging_wait_s", "h2d_s"}
        assert all(v >= 0 for v in st.values())
        assert st["read_seal_s"] > 0 and st["open_s"] > 0 and st["setup_s"] > 0
        # the data phase holds the sealing and the waiting, and lies inside the hand-off the orchestrator timed
        # (intervals read by two processes' clocks and rounded to microseconds: compared within CLOCK_TOL_S)
        assert st["read_seal_s"] + st["wait_s"] <= st["data_s"] + CLOCK_TOL_S
        assert st["setup_s"] + st["data_s"] <= row["median_s"] + CLOCK_TOL_S
        assert row["data_phase_s"] == st["data_s"]  # one repeat: the median is the one hand-off
        assert near(row["fixed_s"], row["median_s"] - row["data_phase_s"], abs_=2e-6)
        assert -CLOCK_TOL_S <= row["fixed_s"] < row["median_s"]
        assert near(row["data_phase_mb_s"], MIB / row["data_phase_s"] / 1e6, rel=2e-3, abs_=0.1)
    # the bare ring pipeline of this machine, measured in the same run, and each path's share of it
    ring = r["ring_pipeline_mb_s"]
    assert ring["best"] >= ring["median"] > 0
    assert near(r["ring_pipeline_of_aes_core"], ring["best"] / aes, rel=1e-3, abs_=6e-4)
    for row in r["rows"]:
        assert near(row["fraction_of_ring_pipeline"], row["mb_s"] / ring["median"], rel=1e-3, abs_=6e-4)
    assert direct["shm_ring"] is ring_supported() and ssh["shm_ring"] is False  # same host: the ring
    # the MB/s are rounded to 0.1: their ratio agrees within what that rounding allows (0.05 of each)
    ratio = direct["mb_s"] / ssh["mb_s"]
    assert near(r["direct_vs_ssh"], ratio, abs_=0.005 + ratio * (0.05 / direct["mb_s"] + 0.05 / ssh["mb_s"]) + 1e-9)
    assert near(r["direct_vs_ssh"], ssh["median_s"] / direct["median_s"], rel=0.02, abs_=0.01)
    # issue 34: every row against the machine's limit measured in this run (the lowest of one AES core, the
    # pair ceiling, memcpy), and the hand-off's fixed cost by stage, the holder's attestation included
    limits = {"aes_gcm_1core": aes, "pair_ceiling": r["pair_ceiling_mb_s"], "memcpy": r["memcpy_mb_s"]}
    for row in r["rows"]:
        assert row["bound"] == min(limits, key=lambda k: limits[k]) and row["bound_mb_s"] == limits[row["bound"]]
        assert near(row["fraction_of_bound"], row["mb_s"] / row["bound_mb_s"], rel=1e-3, abs_=6e-4)
        fixed = row["fixed_stages_ms"]
        assert set(fixed) == {"window", "attest", "verdict", "admission", "ring_bind", "first_chunk", "done",
                              "total", "data", "wall", "admission_wrap", "admission_send", "admission_agent",
                              "admission_device", "admission_transit", "done_agent", "done_transit"}
        assert all(v >= 0 for v in fixed.values())
        assert fixed["attest"] > 0 and fixed["verdict"] > 0 and fixed["window"] > 0  # the holder attests each key
        stages = sum(fixed[k] for k in ho.FIXED_STAGES)  # the parts of admission and done are not added again
        assert near(fixed["total"], stages, abs_=1e-3)  # one repeat: the medians are the one hand-off's
        # the stages inside the timed hand-off (all but the window) fit in it
        assert fixed["total"] - fixed["window"] + fixed["data"] <= 1e3 * row["median_s"] + 1e3 * CLOCK_TOL_S
    assert direct["fixed_stages_ms"]["ring_bind"] > 0 or not direct["shm_ring"]
    # the direct path's admission is split: the agent's own work and the device's check were each timed
    assert direct["fixed_stages_ms"]["admission_agent"] > 0 and direct["fixed_stages_ms"]["admission_device"] > 0
    # each end's CPU per hand-off (issue 34 item 3): its whole process, the part in its cipher calls, the rest
    for row in r["rows"]:
        cpu = row["cpu_s"]
        assert set(cpu) == {"agent", "agent_cipher", "agent_beyond_cipher", "device", "device_cipher",
                            "device_beyond_cipher"}
        assert cpu["agent_cipher"] > 0 and cpu["device_cipher"] > 0  # both ends ran AES-GCM over the window
        for end in ("agent", "device"):  # a process's CPU holds its thread's cipher calls (rounded to 1 us)
            assert cpu[end] >= cpu[f"{end}_cipher"] - 2e-6
            assert near(cpu[f"{end}_beyond_cipher"], cpu[end] - cpu[f"{end}_cipher"], abs_=2e-6)
    # the AES-GCM rate measured inside the device process, next to the standalone one
    assert r["aes_gcm_in_device_mb_s"] > 0
    assert near(r["device_aes_vs_standalone"], r["aes_gcm_in_device_mb_s"] / r["aes_gcm_1core_mb_s"],
                rel=0.01, abs_=0.002)


def test_bench_provision_measures_the_tcp_data_port_straight_and_through_the_ssh_forward_against_ssh() -> None:
    r = report_of("bench", "provision", "--path", "direct-tcp,direct-tcp-forward,ssh", "--size-mib", "1",
                  "--repeats", "1")
    tcp, forward, ssh = r["rows"]
    assert [tcp["path"], forward["path"], ssh["path"]] == ["direct-tcp", "direct-tcp-forward", "ssh"]
    assert not tcp["shm_ring"] and not forward["shm_ring"]  # frames on a TCP connection, no ring
    for key, row in (("direct_tcp_vs_ssh", tcp), ("direct_tcp_forward_vs_ssh", forward)):
        # from the medians; the rounded MB/s agree within what their rounding (0.05 of each) allows
        assert near(r[key], ssh["median_s"] / row["median_s"], abs_=0.005 + 1e-9)
        ratio = row["mb_s"] / ssh["mb_s"]
        assert near(r[key], ratio, abs_=0.005 + ratio * (0.05 / row["mb_s"] + 0.05 / ssh["mb_s"]) + 1e-9)
    assert "direct_vs_ssh" not in r  # no same-host row in this run


def test_bench_provision_refuses_zero_repeats_before_doing_any_work() -> None:
    res = gputravel("bench", "provision", "--path", "direct", "--size-mib", "1", "--repeats", "0", "--json")
    assert res.returncode == 2  # a usage error, refused before any work
    # under --json the error is the JSON envelope on stdout (and a line on stderr), never a traceback
    error = json.loads(res.stdout)["error"]
    assert error["exit_code"] == 2 and "--repeats" in error["message"]
    assert "--repeats" in res.stderr and "Traceback" not in res.stderr


def test_bench_provision_ablation_has_every_configuration_and_speedups_against_conventional() -> None:
    r = report_of("bench", "provision", "--ablate", "--size-mib", "1", "--repeats", "1")
    assert r["benchmark"] == "provision-ablation"
    assert (r["size_mib"], r["chunk_kib"], r["repeats"]) == (1, 1024, 1)
    assert r["aes_gcm_1core_gb_s"] > 0 and r["memcpy_gb_s"] > 0  # the plain memory copy floor
    assert [(row["path"], row["parallel_auth"], row["overlap"]) for row in r["rows"]] == [
        ("direct", True, True), ("direct", False, True), ("direct", False, False), ("ssh", True, True),
        ("conventional", True, True)]
    assert len({row["config"] for row in r["rows"]}) == 5 and all(row["config"] for row in r["rows"])
    conventional = r["rows"][-1]
    assert conventional["config"].startswith("conventional")
    assert conventional["speedup_vs_conventional"] == 1.0 and conventional["time_saved_vs_conventional_pct"] == 0.0
    for row in r["rows"]:
        assert row["median_s"] > 0 and row["min_s"] == row["median_s"]
        assert row["gb_s"] >= 0 and near(row["gb_s"], MIB / row["median_s"] / 1e9, rel=2e-3, abs_=6e-4)
        assert row["fraction_of_aes_core"] >= 0
        speedup = conventional["median_s"] / row["median_s"]
        assert row["speedup_vs_conventional"] > 0
        assert near(row["speedup_vs_conventional"], speedup, rel=1e-4, abs_=0.005 + 1e-9)
        assert near(row["time_saved_vs_conventional_pct"], 100 * (1 - 1 / speedup), rel=1e-4, abs_=0.05 + 1e-9)


# --- bench allreduce -------------------------------------------------------------------------------
def test_bench_allreduce_times_plain_and_both_secure_rings_at_world_size_two() -> None:
    variants = ("plain", "secure_naive", "secure_pipelined")
    r = report_of("bench", "allreduce", "--world-size", "2", "--size-mib", "0.01", "--variants", ",".join(variants),
                  "--repeats", "1", "--warmup", "0")
    assert r["benchmark"] == "allreduce" and r["machine"]["backend"] == "gloo"
    s = r["settings"]
    assert s["world_sizes"] == [2] and s["sizes_mib"] == [0.01] and tuple(s["variants"]) == variants
    assert (s["repeats"], s["warmup"]) == (1, 0)
    rows = {row["variant"]: row for row in r["rows"]}
    assert sorted(rows) == sorted(variants) and len(r["rows"]) == 3
    plain = rows["plain"]
    assert plain["ratio_vs_plain"] == 1.0 and plain["gather"] is None
    for row in r["rows"]:
        assert row["world_size"] == 2 and row["size_mib"] == 0.01 and row["repeats"] == 1
        assert row["median_s"] > 0 and row["min_s"] == row["median_s"]
        assert near(row["ratio_vs_plain"], row["median_s"] / plain["median_s"], rel=1e-6)
        nbytes = 4 * int(0.01 * MIB / 4)  # float32 elements in 0.01 MiB
        assert row["gb_per_s"] > 0 and near(row["gb_per_s"], nbytes / row["median_s"] / 1e9, rel=1e-3)
        assert set(row["breakdown_s"]) == {"crypto_s", "wire_s", "reduce_s", "wait_s"}
        assert all(v >= 0 for v in row["breakdown_s"].values())
    for name in ("secure_naive", "secure_pipelined"):
        assert rows[name]["gather"] == "sealed"
    # issue 34: each row's bound, measured in the run: plain's time plus its cipher passes at this machine's
    # cipher speed; plain's bound is plain itself
    for row in r["rows"]:
        assert row["cipher_seal_mb_s"] > 0 and row["cipher_open_mb_s"] > 0 and row["crypto_lanes"] >= 1
        assert near(row["bound_s"], plain["median_s"] + row["bound_cipher_s"], rel=1e-9)
        assert near(row["bound_ratio"], row["bound_s"] / plain["median_s"], rel=1e-9)
        assert near(row["fraction_of_bound"], row["bound_s"] / row["median_s"], rel=1e-9)
        # bound_s: the cipher over the row's own size streamed; bound_cache_s: the cache-resident chunk's (kept)
        assert row["cipher_stream_seal_mb_s"] > 0 and row["cipher_stream_open_mb_s"] > 0
        assert near(row["bound_cache_s"], plain["median_s"] + row["bound_cache_cipher_s"], rel=1e-9)
        assert near(row["bound_cache_ratio"], row["bound_cache_s"] / plain["median_s"], rel=1e-9)
        assert near(row["fraction_of_cache_bound"], row["bound_cache_s"] / row["median_s"], rel=1e-9)
    assert plain["bound_cipher_s"] == 0 and plain["bound_ratio"] == 1.0
    assert plain["bound_cache_cipher_s"] == 0 and plain["bound_cache_ratio"] == 1.0
    for name in ("secure_naive", "secure_pipelined"):
        assert rows[name]["bound_cipher_s"] > 0 and rows[name]["bound_ratio"] > 1
        assert rows[name]["bound_cache_cipher_s"] > 0 and rows[name]["bound_cache_ratio"] > 1
        assert rows[name]["breakdown_s"]["crypto_s"] > 0  # the secure rings really seal and open
    # at world 2 every schedule (the ring's two steps, or the direct hop on a machine with no free core) seals and
    # opens the same bytes, so the two secure rows have one bound
    assert near(rows["secure_naive"]["bound_cipher_s"], rows["secure_pipelined"]["bound_cipher_s"], rel=1e-9)


# --- bench load / soak -----------------------------------------------------------------------------
PHASES = ("attest", "handoff", "return", "verify", "scrub", "rotate_key_update")


def check_costs(per_visit: dict[str, Any]) -> None:
    for key in ("protocol_overhead_ms", "checkpoint_ms", "bookkeeping_ms", "provision_ms", "train_ms",
                "visit_wall_ms"):
        st = per_visit[key]
        assert st["median"] is not None and 0 <= st["median"] <= st["p95"] <= st["max"], key
        assert st["mean"] <= st["max"], key
    for key in ("protocol_overhead_ms", "checkpoint_ms", "provision_ms", "train_ms", "visit_wall_ms"):
        assert per_visit[key]["median"] > 0, key
    assert set(per_visit["overhead_by_phase_median_ms"]) == set(PHASES)
    assert all(v is not None and v >= 0 for v in per_visit["overhead_by_phase_median_ms"].values())
    # a visit's wall time holds its protocol phases, the checkpoint, provisioning and training
    assert per_visit["visit_wall_ms"]["max"] >= per_visit["protocol_overhead_ms"]["median"] - 1e3 * CLOCK_TOL_S


def test_bench_load_deploys_two_holders_over_loopback_ssh_and_runs_every_visit() -> None:
    r = report_of("bench", "load", "--holders", "2", "--rounds", "1", "--holder-kib", "1")
    assert r["benchmark"] == "load"
    s = r["settings"]
    assert (s["holders"], s["rounds"], s["visits"], s["steps_per_visit"]) == (2, 1, 2, 1)
    assert s["model"] == "tiny" and s["data_path"] == "direct" and s["buffer_kib"] > 0
    d = r["deploy"]
    assert d["wall_s"] > 0 and d["ssh_server_start_s"] > 0 and d["uploaded"] == 2  # fresh holder homes
    assert 0 < d["per_holder_s"]["median"] <= d["per_holder_s"]["max"]
    assert isinstance(d["within_target"], bool) and d["target_s"] > 0
    check_costs(r["per_visit"])
    assert isinstance(r["per_visit"]["within_target"], bool)
    peak = r["memory"]["peak_mib"]
    for role in ("orchestrator", "device", "agents", "ssh_server"):
        assert 0 < peak[role] <= peak["total"], role
    assert r["memory"]["samples"] >= 1
    assert r["outcomes"] == {"done": 2, "failed": 0}
    assert r["ledger"]["verified"] is True and r["ledger"]["rows"] > 0
    assert r["seconds"] > 0
    (row,) = r["rows"]  # issue 34 item 4: one count, one row
    assert row["holders"] == 2 and row["visits"] == 2
    assert row["orchestrator_ms_per_visit"] > 0 and row["rss_mb"] > 0 and row["open_fds"] > 0
    assert r["growth"] == {}


def test_bench_load_gives_a_row_per_holder_count_and_how_they_grow() -> None:
    r = report_of("bench", "load", "--holders", "1,2", "--rounds", "1", "--holder-kib", "1", "--transport", "local")
    assert [row["holders"] for row in r["rows"]] == [1, 2] and r["settings"]["holders"] == 2
    assert r["settings"]["transport"].startswith("local") and r["outcomes"] == {"done": 2, "failed": 0}
    for row in r["rows"]:
        assert row["orchestrator_ms_per_visit"] > 0 and row["rss_mb"] > 0 and row["open_fds"] > 0
    a, b = r["rows"]
    g = r["growth"]
    assert (g["from_holders"], g["to_holders"]) == (1, 2)
    assert near(g["orchestrator_ms_per_visit_ratio"], b["orchestrator_ms_per_visit"] / a["orchestrator_ms_per_visit"],
                rel=1e-2, abs_=1e-3)
    assert near(g["open_fds_per_added_holder"], b["open_fds"] - a["open_fds"], abs_=1e-3)


def test_bench_soak_runs_ten_visits_with_flat_memory_figures_and_a_verified_ledger() -> None:
    r = report_of("bench", "soak", "--visits", "10", "--holder-kib", "1")
    assert r["benchmark"] == "soak"
    s = r["settings"]
    assert s["visits_asked"] == 10 and s["holders"] == 4 and s["rounds"] == 3 and s["visits"] == 12
    assert r["outcomes"] == {"done": 12, "failed": 0}
    assert r["ledger"] == {"verified": True, "rows": r["ledger"]["rows"], "reason": None} and r["ledger"]["rows"] > 0
    for role in ("orchestrator", "device", "agents", "total"):
        g = r["memory"][role]
        assert 0 < g["baseline_mib"] and 0 < g["final_mib"] <= g["peak_after_warmup_mib"], role
        # growth is computed before the MiB figures are rounded to 0.1
        assert near(g["growth"], (g["final_mib"] - g["baseline_mib"]) / g["baseline_mib"],
                    abs_=0.1 / g["baseline_mib"] + 1e-4), role
        assert len(g["by_decile_mib"]) == 10 and all(x > 0 for x in g["by_decile_mib"]), role
    assert isinstance(r["memory"]["within_target"], bool)
    o = r["overhead"]
    assert o["first_10pct_median_ms"] > 0 and o["last_10pct_median_ms"] > 0
    assert near(o["ratio_last_to_first"], o["last_10pct_median_ms"] / o["first_10pct_median_ms"],
                 rel=5e-3, abs_=2e-3)
    assert len(o["by_decile_median_ms"]) == 10 and all(x > 0 for x in o["by_decile_median_ms"])
    check_costs(o)
    assert len(r["checkpoint_first_last_ms"]) == 2 and all(x > 0 for x in r["checkpoint_first_last_ms"])
    assert r["seconds"] > 0 and r["visits_per_s"] > 0


# --- agents deploy / status / stop -----------------------------------------------------------------
@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[EmbeddedSshServer, list[HolderSpec]]]:
    """Two holder accounts on the loopback SSH server; the names are unique to this test, so ``agents
    stop`` (a pkill by holder name on the holder, here this machine) can reach no one else's agents."""
    tag = secrets.token_hex(3)
    names = [f"bc{tag}a", f"bc{tag}b"]
    for i, name in enumerate(names):
        write_holder(tmp_path / "data" / name, i, WORDS, n_words=2000)
    workdir = tmp_path / "ssh"
    workdir.mkdir()
    server = EmbeddedSshServer([(n, tmp_path / "data" / n) for n in names], workdir=workdir)
    specs = server.start()
    try:
        yield server, specs
    finally:
        server.stop()


def write_inventory(path: Path, specs: list[HolderSpec], *, extra: str = "") -> Path:
    entries = [{"name": s.name, "host": s.host, "port": s.port, "user": s.user, "client_key": str(s.client_key),
                "host_key": s.host_key, "data": s.data, "python": s.python} for s in specs]
    path.write_text("".join("[[holder]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in e.items()) + "\n"
                            for e in entries) + extra)
    return path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agent_pids(name: str) -> list[int]:
    """Live processes running the holder agent ``--name name``."""
    return [p.pid for p in live_processes() if b"gputravel.agents.holder" in p.argv and name.encode() in p.argv]


def agents_json(action: str, inventory: Path) -> tuple[int, list[dict[str, Any]]]:
    res = gputravel("agents", action, "--holders-file", str(inventory), "--json", timeout=90)
    assert res.stdout.strip(), f"exit {res.returncode}, no output; stderr: {res.stderr[-3000:]}"
    doc = json.loads(res.stdout)  # a failure is the one JSON error object, the holders' rows in it
    return res.returncode, doc["holders"] if isinstance(doc, dict) and doc.get("ok") is False else doc


async def test_agents_status_then_deploy_then_status_report_the_verified_bundle(
        no_leaked_processes: None, fleet: tuple[EmbeddedSshServer, list[HolderSpec]], tmp_path: Path) -> None:
    server, specs = fleet
    want = agent_sha256()
    names = [s.name for s in specs]
    inventory = write_inventory(tmp_path / "holders.toml", specs)

    # before any deploy, with a third holder nobody listens for: nothing deployed, one offline, exit != 0
    gone = (f'[[holder]]\nname = "gone"\nhost = "127.0.0.1"\nport = {closed_port()}\nuser = "gone"\n'
            f'client_key = {json.dumps(str(specs[0].client_key))}\nhost_key = {json.dumps(specs[0].host_key)}\n'
            f'data = "/nowhere"\nconnect_timeout = 5\n')
    code, rows = agents_json("status", write_inventory(tmp_path / "with-gone.toml", specs, extra=gone))
    assert code == AgentError.exit_code
    by = {r["holder"]: r for r in rows}
    assert sorted(by) == sorted([*names, "gone"])
    for name in names:
        assert by[name]["state"] == "not deployed" and by[name]["bundle_sha256"] is None
        assert by[name]["expected"] == want and by[name]["port"] == server.port
    assert by["gone"]["state"] == "offline" and "unreachable" in by["gone"]["reason"]

    # deploy uploads the bundle to each holder and verifies its hash there
    code, rows = agents_json("deploy", inventory)
    assert code == 0
    assert [r["holder"] for r in rows] == names
    for r in rows:
        assert r["state"] == "verified" and r["bundle_sha256"] == want and r["uploaded"] is True
        assert r["remote_dir"].endswith(f"agent-{want[:16]}") and r["cryptography"] and r["seconds"] > 0
        assert (server.workdir / "homes" / r["holder"] / r["remote_dir"] / "gputravel").is_dir()

    # status now finds that same hash in place
    code, rows = agents_json("status", inventory)
    assert code == 0
    for r in rows:
        assert r["state"] == "verified" and r["bundle_sha256"] == r["expected"] == want

    # and the engine's own link reuses the deployed bundle instead of uploading again
    link = SshHolderLink(specs[0])
    try:
        info = await link.start()
        assert info.agent_sha256 == want
        assert link.deploy_report is not None and link.deploy_report.uploaded is False
    finally:
        await link.close()


async def test_agents_stop_ends_the_running_agent_of_each_holder(
        no_leaked_processes: None, fleet: tuple[EmbeddedSshServer, list[HolderSpec]], tmp_path: Path) -> None:
    """An agent started by the engine's link is ended by ``agents stop``; the other holder has none running
    and says so. The remote shell that runs pkill is not killed by its own pattern (exit 0 or 1, not 143)."""
    _server, specs = fleet
    names = [s.name for s in specs]
    inventory = write_inventory(tmp_path / "holders.toml", specs)
    link = SshHolderLink(specs[0])
    try:
        await link.start()
        assert agent_pids(names[0]), "the agent is not running"
        assert agent_pids(names[1]) == []
        code, rows = await asyncio.to_thread(agents_json, "stop", inventory)
        assert code == 0
        by = {r["holder"]: r for r in rows}
        assert sorted(by) == sorted(names)
        assert by[names[0]]["state"] == "stopped" and by[names[0]]["was_running"] is True
        assert by[names[0]]["exit_status"] == 0
        assert by[names[1]]["state"] == "stopped" and by[names[1]]["was_running"] is False
        assert by[names[1]]["exit_status"] == 1
        deadline = time.monotonic() + 10
        while agent_pids(names[0]) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert agent_pids(names[0]) == [], "stop left the agent running"
    finally:
        await link.close()


def test_allreduce_table_keeps_variant_names_and_figures_whole_at_100_columns() -> None:
    from rich.console import Console

    from gputravel.console.cli.commands.bench_allreduce import render

    breakdown = {"crypto_s": 0.001, "wire_s": 0.002, "reduce_s": 0.003, "wait_s": 0.004}
    rows = [{"world_size": 2, "size_mib": 4, "variant": v, "gather": g, "median_s": 0.01234, "min_s": 0.00987,
             "ratio_vs_plain": 1.5, "gb_per_s": 1.25, "breakdown_s": breakdown}
            for v, g in (("plain", None), ("secure_naive", "sealed"), ("secure_pipelined", "reseal"))]
    console = Console(width=100, record=True, color_system=None)
    render(console, {"rows": rows, "machine": {"cores": 2, "cpu": "test", "device": "cpu", "backend": "gloo",
                                          "torch": "2", "gloo_tls": False}})
    text = console.export_text()
    assert "secure_pipelined" in text and "secure_naive" in text and "…" not in text
    assert "12.34" in text and "9.87" in text
