"""Holders behind Debian's OpenSSH ``sshd``, as separate system users.

The fixture (root only) creates two users, each with an authorized key and a dataset in a home only
it can read, and starts ``/usr/sbin/sshd`` on a loopback port with its own config file and host key.
The holders' remote python is a world-readable venv of ``/usr/bin/python3`` carrying a copy of this
environment's ``cryptography`` (the project's own interpreter may live where other users cannot
reach). Everything is removed at teardown: sshd, the users and their homes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import asyncssh
import pytest
from helpers import wait_for, write_holder

from gputravel.agents.deploy import connect
from gputravel.agents.holder import agent_sha256
from gputravel.agents.inventory import HolderSpec, load_inventory
from gputravel.agents.ssh_holder import SshHolderLink
from gputravel.console import holders
from gputravel.core.config import RunSettings
from gputravel.core.errors import AgentError, GpuTravelError
from gputravel.core.ledger import read_rows

SSHD = Path("/usr/sbin/sshd")
SYSTEM_PYTHON = Path("/usr/bin/python3")
USERS = {"holder-a": "gt-holder-a", "holder-b": "gt-holder-b"}


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the fixture creates system users and runs sshd"
    if not SSHD.exists():
        return f"needs {SSHD} (apt-get install openssh-server)"
    for tool in ("useradd", "usermod", "userdel"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if not SYSTEM_PYTHON.exists():
        return f"needs {SYSTEM_PYTHON} for the holders' python"
    probe = subprocess.run([str(SYSTEM_PYTHON), "-c", "import sys; print(sys.version_info[:2])"],
                           capture_output=True, text=True)
    if probe.stdout.strip() != str(tuple(sys.version_info[:2])):
        return f"{SYSTEM_PYTHON} is not Python {sys.version_info[0]}.{sys.version_info[1]} (cannot lend it cryptography)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pids_of(uid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if d.stat().st_uid == uid and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(d.name))
            except (OSError, IndexError):
                continue
    return pids


def _remove_user(user: str) -> None:
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        return
    for pid in _pids_of(uid):  # only processes of our own test users
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while _pids_of(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    subprocess.run(["userdel", "-r", user], capture_output=True)


def _holder_python(root: Path) -> Path:
    """A venv of the system python that every user can run, with this environment's cryptography."""
    venv = root / "venv"
    subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    for name in ("cryptography", "cffi", "pycparser", "_cffi_backend"):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        if origin.name == "__init__.py":
            shutil.copytree(origin.parent, site / origin.parent.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(origin, site / origin.name)
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():  # bin/python links to the system python: leave that alone
            path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
    return venv / "bin" / "python"


@dataclass
class OpenSsh:
    port: int
    host_public: str
    inventory: Path
    specs: dict[str, HolderSpec]
    homes: dict[str, Path]
    data_files: dict[str, Path]
    uids: dict[str, int]


@pytest.fixture(scope="module")
def openssh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenSsh]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("openssh")  # root only: keys, config, logs
    shared = Path(tempfile.mkdtemp(prefix="gputravel-holder-python-"))  # readable by the holder users
    sshd: subprocess.Popen[bytes] | None = None
    try:
        for user in USERS.values():
            _remove_user(user)  # leftovers of an interrupted earlier run
        python = _holder_python(shared)
        host_key = asyncssh.generate_private_key("ssh-ed25519")
        host_path = work / "ssh_host_ed25519_key"
        host_path.write_bytes(host_key.export_private_key())
        host_path.chmod(0o600)
        homes, files, uids, keys = {}, {}, {}, {}
        for i, (name, user) in enumerate(USERS.items()):
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", user], check=True, capture_output=True)
            subprocess.run(["usermod", "-p", "*", user], check=True)  # no password, yet not a locked account
            pw = pwd.getpwnam(user)
            home, uids[name] = Path(pw.pw_dir), pw.pw_uid
            client = asyncssh.generate_private_key("ssh-ed25519")
            keys[name] = work / f"{name}_key"
            keys[name].write_bytes(client.export_private_key())
            keys[name].chmod(0o600)
            (home / ".ssh").mkdir(mode=0o700)
            (home / ".ssh" / "authorized_keys").write_bytes(client.export_public_key())
            files[name] = write_holder(home / "data", seed=10 + i)
            for path in [home, *home.rglob("*")]:
                os.chown(path, pw.pw_uid, pw.pw_gid, follow_symlinks=False)
                if not path.is_symlink():
                    path.chmod(0o700 if path.is_dir() else 0o600)  # only the holder itself can read its data
            homes[name] = home
        port = _free_port()
        config = work / "sshd_config"
        config.write_text("\n".join([
            "ListenAddress 127.0.0.1", f"PidFile {work / 'sshd.pid'}", "UsePAM no", "StrictModes yes",
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PermitRootLogin no", f"AllowUsers {' '.join(USERS.values())}",
            "AuthorizedKeysFile .ssh/authorized_keys", "Subsystem sftp internal-sftp", "X11Forwarding no",
            "PrintMotd no", "MaxStartups 50", "LogLevel VERBOSE"]) + "\n")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation folder
        log = (work / "sshd.log").open("wb")
        sshd = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config), "-p", str(port), "-h", str(host_path)],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            if sshd.poll() is not None:
                raise RuntimeError(f"sshd exited: {(work / 'sshd.log').read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd did not listen: {(work / 'sshd.log').read_text()[-2000:]}") from None
                time.sleep(0.05)
        host_public = host_key.export_public_key().decode().strip()
        inventory = work / "holders.toml"
        inventory.write_text(f'[defaults]\npython = "{python}"\nport = {port}\nhost_key = "{host_public}"\n'
                             f'connect_timeout = 5\n\n' + "\n".join(
                                 f'[[holder]]\nname = "{name}"\nhost = "127.0.0.1"\nuser = "{user}"\n'
                                 f'client_key = "{keys[name].name}"\ndata = "{files[name].parent}"\n'
                                 for name, user in USERS.items()))
        specs = {s.name: s for s in load_inventory(inventory)}
        yield OpenSsh(port, host_public, inventory, specs, homes, files, uids)
        # no agent outlives the runs
        deadline = time.monotonic() + 5
        while any(_pids_of(uid) for uid in uids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {name: _pids_of(uid) for name, uid in uids.items() if _pids_of(uid)}
        assert not left, f"processes of the holder users outlived the tests: {left}"
    finally:
        if sshd is not None and sshd.poll() is None:
            sshd.terminate()
            try:
                sshd.wait(5)
            except subprocess.TimeoutExpired:
                sshd.kill()
                sshd.wait()
        for user in USERS.values():
            _remove_user(user)
        shutil.rmtree(shared, ignore_errors=True)


def small(out: Path, inventory: Path, **kw: Any) -> RunSettings:
    base: dict[str, Any] = dict(rounds=1, steps_per_visit=2, batch_size=4, seq_len=32, chunk_kib=16,
                                buffer_mib=0.25, out_dir=out, transport="inventory", holders_file=inventory)
    base.update(kw)
    return RunSettings(**base)


@pytest.mark.parametrize("data_path", ["channel", "direct"])
async def test_full_run_over_openssh_with_two_system_users(data_path: str, openssh: OpenSsh, tmp_path: Path) -> None:
    out = tmp_path / "run"
    report = (await holders.run(small(out, openssh.inventory, data_path=data_path))).to_json()

    assert [(v["holder"], v["outcome"]) for v in report["visits"]] == [("holder-a", "done"), ("holder-b", "done")]
    assert all(v["integrity_ok"] and v["scrub_verified"] and v["bytes"] > 0 for v in report["visits"])
    assert report["failed_visits"] == 0 and report["ledger"]["verified"]
    for h in report["holders"]:
        name = h["name"]
        assert (h["transport"], h["host"], h["port"], h["user"]) == ("ssh", "127.0.0.1", openssh.port, USERS[name])
        assert h["bundle_sha256"] == h["agent_sha256"] == agent_sha256()
        folder = openssh.homes[name] / h["remote_dir"]
        assert folder.stat().st_uid == openssh.uids[name]  # deployed as, and run by, the holder's own user
        assert (folder / "gputravel/agents/holder/agent.py").stat().st_mode & 0o077 == 0
        states = [r.outcome for r in read_rows(out / "ledger.db") if r.kind == "holder-state" and r.holder == name]
        assert states[-3:] == ["provisioning", "returned", "stopped"] and "verified" in states


async def test_holder_a_cannot_read_holder_b_files(openssh: OpenSsh) -> None:
    a = openssh.specs["holder-a"]
    b_file, b_data = openssh.data_files["holder-b"], openssh.data_files["holder-b"].parent
    conn = await connect(a)
    try:
        whoami = await conn.run("id -un", check=False)
        assert str(whoami.stdout).strip() == USERS["holder-a"]
        for command in (f"cat {b_file}", f"ls {b_data}", f"head -c 1 {b_file}"):
            res = await conn.run(command, check=False)
            assert res.exit_status != 0, command
            assert "Permission denied" in str(res.stderr), (command, res.stderr)
        own = await conn.run(f"head -c 9 {openssh.data_files['holder-a']}", check=False)
        assert own.exit_status == 0 and len(str(own.stdout)) == 9  # A reads its own data
    finally:
        conn.close()
        await conn.wait_closed()

    # A's agent pointed at B's folder cannot open it, and says which path
    link = SshHolderLink(replace(a, data=str(b_data)))
    with pytest.raises(AgentError) as info:
        await link.start()
    assert str(b_data) in str(info.value) and "Permission denied" in str(info.value)
    assert info.value.host == "holder-a"
    assert link.state == "failed"
    await link.close()


async def test_openssh_refuses_a_pin_of_another_host_key(openssh: OpenSsh) -> None:
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    with pytest.raises(AgentError, match="host key not verified"):
        await connect(replace(openssh.specs["holder-a"], host_key=other))
    stranger = openssh.specs["holder-b"].client_key  # B's key does not open A's account
    with pytest.raises(AgentError, match="authentication failed"):
        await asyncio.wait_for(connect(replace(openssh.specs["holder-a"], client_key=stranger)), 20)


async def test_an_agent_killed_while_its_holder_waits_goes_offline_and_the_run_ends_0(openssh: OpenSsh,
                                                                                       tmp_path: Path) -> None:
    """Issue 15 on real OpenSSH: ``kill-agent@ATTEST:1`` kills holder-b's agent (its own user's process) before
    its visit; the holder goes offline, is reconnected and re-verified before any key, and its visit is done."""
    out = tmp_path / "run"
    report = (await holders.run(small(out, openssh.inventory, fault="kill-agent@ATTEST:1",
                                         allow_fault_injection=True))).to_json()

    assert [(v["holder"], v["outcome"]) for v in report["visits"]] == [("holder-a", "done"), ("holder-b", "done")]
    rows = read_rows(out / "ledger.db")
    states = [r.outcome for r in rows if r.kind == "holder-state" and r.holder == "holder-b"]
    off = states.index("offline")
    assert states[off:off + 4] == ["offline", "connecting", "verified", "ready"]
    handoffs = [i for i, r in enumerate(rows) if r.kind == "phase" and r.phase == "HANDOFF" and r.holder == "holder-b"]
    offline_at = next(i for i, r in enumerate(rows) if r.kind == "holder-state" and r.holder == "holder-b"
                      and r.outcome == "offline")
    assert len(handoffs) == 1 and handoffs[0] > offline_at  # the key only went to the re-verified agent
    assert rows[-1].kind == "run-completed" and rows[-1].outcome == "ok" and report["ledger"]["verified"]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _handed_off(ledger: Path) -> bool:
    try:
        return any(r.kind == "phase" and r.phase == "HANDOFF" for r in read_rows(ledger))
    except (GpuTravelError, sqlite3.Error):  # no ledger yet, or one being created
        return False


@pytest.mark.process
def test_an_orchestrator_killed_outright_leaves_no_process_on_the_holders(openssh: OpenSsh, tmp_path: Path) -> None:
    """The holders' side gets no signal of ours: their agents run under sshd as the holders' own users. ``kill -9``
    of a real ``gputravel run`` paused before PROVISION (both agents attested, holder-a's holding its provisioning
    key): its sockets close with it, sshd ends each session, the agent reads the end of its stdin and ends, and
    no process of either holder user is left (a fleet's worker holds its holders' sessions the same way)."""
    out = tmp_path / "run"
    log_path = tmp_path / "run.log"
    with log_path.open("wb") as log:
        orch = subprocess.Popen([sys.executable, "-m", "gputravel.console.cli", "run", "--holders-file",
                                 str(openssh.inventory), "--rounds", "1", "--steps-per-visit", "2", "--batch-size", "4",
                                 "--seq-len", "32", "--chunk-kib", "16", "--buffer-mib", "0.25", "--out", str(out),
                                 "--break-before", "PROVISION"],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert wait_for(lambda: _handed_off(out / "ledger.db") or orch.poll() is not None, 240, 0.2), "never handed off"
        assert orch.poll() is None, log_path.read_text()[-2000:]
        for name, uid in openssh.uids.items():
            assert any(b"gputravel.agents.holder" in _cmdline(pid) for pid in _pids_of(uid)), f"no agent of {name}"
        os.kill(orch.pid, signal.SIGKILL)
        assert orch.wait(timeout=10) == -signal.SIGKILL
        assert wait_for(lambda: not any(_pids_of(uid) for uid in openssh.uids.values()), 20, 0.2), \
            {name: [_cmdline(pid) for pid in _pids_of(uid)] for name, uid in openssh.uids.items()}
    finally:
        if orch.poll() is None:
            orch.kill()
            orch.wait()
