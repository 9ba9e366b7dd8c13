"""Two fleet nodes as two system users (issue 36 item 5): neither can read the other's folder, the OS says so.

Each node is ``gputravel run --gpus 2 --nnodes 2 --sim-pki FILE --out ~/node`` run by its own user (``runuser``),
rendezvous on 127.0.0.1, with a python both users can run: a venv of ``/usr/bin/python3`` whose one ``.pth`` adds
this environment's site-packages (as tests/agents/test_openssh.py lends the holders cryptography). Each home is
0700; the holders' data is world-readable (each node reaches its holders itself).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from helpers import WORDS, write_holders

from gputravel.core.fleet.pki import export_sim_pki

pytestmark = [pytest.mark.process, pytest.mark.slow]

SYSTEM_PYTHON = Path("/usr/bin/python3")


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the test creates two system users"
    for tool in ("useradd", "userdel", "runuser"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if not SYSTEM_PYTHON.exists():
        return f"needs {SYSTEM_PYTHON}"
    probe = subprocess.run([str(SYSTEM_PYTHON), "-c", "import sys; print(sys.version_info[:2])"],
                           capture_output=True, text=True)
    if probe.stdout.strip() != str(tuple(sys.version_info[:2])):
        return f"{SYSTEM_PYTHON} is not Python {sys.version_info[0]}.{sys.version_info[1]} (cannot lend it torch)"
    return None


def _shared_python(root: Path) -> Path:
    """A venv of the system python every user can run, with this environment's packages (and gputravel)."""
    import site

    venv = root / "venv"
    subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", "--without-pip", str(venv)], check=True)
    ours = next(p for p in site.getsitepackages() if p.endswith("site-packages"))
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (venv / "lib" / version / "site-packages" / "gputravel-env.pth").write_text(
        f"import site; site.addsitedir({ours!r})\n")
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
    return venv / "bin" / "python"


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_two_nodes_as_two_users_train_one_model_and_cannot_read_each_other(tmp_path: Path) -> None:
    root = Path(f"/tmp/gputravel-users-{uuid.uuid4().hex[:8]}")  # pytest's tmp is root's own (0700)
    root.mkdir(mode=0o755)
    users = [f"gtnode{uuid.uuid4().hex[:6]}" for _ in range(2)]
    try:
        python = _shared_python(root)
        data = root / "data"
        write_holders(data, {"north": 1, "south": 2}, WORDS, 12_000, file="text.txt", newline=False)
        for path in [data, *data.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        pki = tmp_path / "sim-pki.json"
        export_sim_pki(pki)
        homes = []
        for user in users:
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", user], check=True, capture_output=True)
            home = Path(f"/home/{user}")
            home.chmod(0o700)
            shutil.copy(pki, home / "sim-pki.json")
            shutil.chown(home / "sim-pki.json", user, user)
            homes.append(home)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        rdzv_id = f"users-{uuid.uuid4().hex[:8]}"
        procs: list[subprocess.CompletedProcess[str] | None] = [None, None]

        def node(i: int) -> None:
            cmd = ["runuser", "-u", users[i], "--", "env", f"HOME={homes[i]}", "OMP_NUM_THREADS=1", str(python),
                   "-m", "gputravel.console.cli", "run", "--gpus", "2", "--nnodes", "2",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
                   "--sim-pki", str(homes[i] / "sim-pki.json"), "--data", str(data), "--rounds", "1",
                   "--steps-per-visit", "2", "--batch-size", "4", "--seq-len", "32", "--chunk-kib", "16",
                   "--buffer-mib", "0.25", "--transport", "local", "--out", str(homes[i] / "node"), "--json"]
            procs[i] = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=homes[i])

        threads = [threading.Thread(target=node, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=660)
        reports = []
        for p in procs:
            assert p is not None and p.returncode == 0, (p.stderr[-3000:] if p else "never ran")
            reports.append(json.loads(p.stdout))
        assert all(r["fleet"]["replica_digests_equal"] is True for r in reports)
        assert reports[0]["fleet"]["final_model_digest"] == reports[1]["fleet"]["final_model_digest"]
        assert sorted(r["node"]["ranks"][0] for r in reports) == [0, 1]
        # the OS keeps each node out of the other's folder
        peek = subprocess.run(["runuser", "-u", users[0], "--", "ls", str(homes[1] / "node")], capture_output=True,
                              text=True)
        assert peek.returncode != 0 and "Permission denied" in peek.stderr
        for i in (0, 1):
            assert (homes[i] / "node").stat().st_uid == (homes[i]).stat().st_uid  # made by its own user
    finally:
        for user in users:
            subprocess.run(["userdel", "--remove", user], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
