"""Holder-pinned holders on real accounts behind Debian's OpenSSH ``sshd`` (issue 30 item 6).

Two system users, each with its own gputravel installation (a world-readable venv of ``/usr/bin/python3``
carrying a copy of gputravel and what its ``holder`` commands import), its data in a home only it can read, and
its own configuration: ``gputravel holder init`` (trusting the SIM platform of the run, as a holder who chose to
does: the SIM policy, its root certificates and ``gpu.json``, never the keys) and ``gputravel holder authorize``
of the orchestrator's key. The orchestrator's inventory says ``managed = false``. Proven here: a run completes
every visit; the orchestrator's key gets no shell, no SFTP, no forwarding and no byte of data; an inventory that
names another ``attest_policy`` for a holder changes nothing; a holder whose policy pins another MRTD refuses and
its data never leaves; each holder verifies its receipts against the run's ledger, as itself, offline.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncssh
import pytest
from helpers import write_holder
from test_openssh import _free_port, _pids_of, _remove_user, _skip_reason

from gputravel.agents.deploy import connect
from gputravel.agents.holder import package_root
from gputravel.agents.inventory import load_inventory
from gputravel.console import holders
from gputravel.core.config import RunSettings
from gputravel.core.evidence import sim_store
from gputravel.core.ledger import read_rows

pytestmark = pytest.mark.process

SSHD = Path("/usr/sbin/sshd")
SYSTEM_PYTHON = Path("/usr/bin/python3")
USERS = {"holder-a": "gt-pinned-a", "holder-b": "gt-pinned-b"}
#: what `gputravel holder ...` imports besides gputravel and the standard library, as top-level names
_PROBE = ("import sys, gputravel.console.cli.main, gputravel.console.cli.commands.holder, "
          "gputravel.agents.holder.serve, gputravel.agents.holder.attest, gputravel.agents.receipts_check, "
          "gputravel.core.evidence.tdx, dcap_qvl\n"
          "from typer.testing import CliRunner\n"  # parsing options imports more (typer's coercion)
          "for args in (['holder', 'show', '--config', '/nonexistent'], ['holder', 'verify', '--ledger', '/x', 'r']):\n"
          "    CliRunner().invoke(gputravel.console.cli.main.app, args)\n"
          "std = set(sys.stdlib_module_names)\n"
          "print('\\n'.join(sorted({n.split('.')[0] for n, m in list(sys.modules.items()) if getattr(m, '__file__', None)"
          " and 'site-packages' in m.__file__ and n.split('.')[0] not in std | {'gputravel'}})))")


def _holder_install(root: Path) -> Path:
    """The holders' own gputravel: a venv of the system python with copies of gputravel's sources and of the
    packages its holder commands import; returns its ``gputravel`` launcher."""
    venv = root / "venv"
    subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    names = subprocess.run([sys.executable, "-c", _PROBE], check=True, capture_output=True, text=True).stdout.split()
    here = [p for p in map(Path, sys.path) if p.name == "site-packages" and p.is_dir()]
    for name in names:
        for base in here:
            pkg, mod = base / name, [*base.glob(f"{name}.*.so"), *base.glob(f"{name}.py"), *base.glob(f"{name}.abi3.so")]
            for info in base.glob(f"{name}-*.dist-info"):  # importlib.metadata's view (dcap_qvl reads its version)
                shutil.copytree(info, site / info.name, dirs_exist_ok=True)
            if pkg.is_dir():
                shutil.copytree(pkg, site / name, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
                break
            if mod:
                for m in mod:
                    shutil.copy2(m, site / m.name)
                break
    src = package_root()
    (site / "gputravel").mkdir()
    for part in ("__init__.py", "py.typed"):
        shutil.copy2(src / part, site / "gputravel" / part)
    for part in ("core", "agents", "console"):
        shutil.copytree(src / part, site / "gputravel" / part, ignore=shutil.ignore_patterns("__pycache__"))
    exe = venv / "bin" / "gputravel"
    exe.write_text(f"#!{venv / 'bin' / 'python'}\nfrom gputravel.console.cli.main import main\nmain()\n")
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) or path == exe else 0o644)
    return exe


def _as(user: str, home: Path, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as ``user`` with its own home (and nothing of root's environment)."""
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "COLUMNS": "200"}
    res = subprocess.run([shutil.which("runuser") or "/usr/sbin/runuser", "-u", user, "--", *argv], capture_output=True, text=True, env=env, cwd="/")
    if check and res.returncode != 0:
        raise AssertionError(f"{argv} as {user}: exit {res.returncode}\n{res.stdout}\n{res.stderr}")
    return res


@dataclass
class Pinned:
    port: int
    exe: Path
    homes: dict[str, Path]
    uids: dict[str, int]
    data_files: dict[str, Path]
    orch_key: Path
    orch_pub: Path
    shared: Path
    host_public: str
    work: Path


@pytest.fixture(scope="module")
def pinned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pinned]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    if shutil.which("runuser") is None:
        pytest.skip("needs runuser (util-linux)")
    work = tmp_path_factory.mktemp("openssh-pinned")  # root only: keys, config, logs, runs
    shared = Path(tempfile.mkdtemp(prefix="gputravel-holder-install-"))  # readable by the holder users
    shared.chmod(0o755)
    sshd: subprocess.Popen[bytes] | None = None
    try:
        for user in USERS.values():
            _remove_user(user)
        exe = _holder_install(shared / "install")
        host_key = asyncssh.generate_private_key("ssh-ed25519")
        host_path = work / "ssh_host_ed25519_key"
        host_path.write_bytes(host_key.export_private_key())
        host_path.chmod(0o600)
        orch = asyncssh.generate_private_key("ssh-ed25519")
        orch_key, orch_pub = work / "orchestrator_key", shared / "orchestrator.pub"
        orch_key.write_bytes(orch.export_private_key())
        orch_key.chmod(0o600)
        orch_pub.write_bytes(orch.export_public_key())
        orch_pub.chmod(0o644)
        homes, uids, files = {}, {}, {}
        for i, (name, user) in enumerate(USERS.items()):
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", user], check=True, capture_output=True)
            subprocess.run(["usermod", "-p", "*", user], check=True)
            pw = pwd.getpwnam(user)
            homes[name], uids[name] = Path(pw.pw_dir), pw.pw_uid
            files[name] = write_holder(homes[name] / "data", seed=30 + i)
            for path in [homes[name], *homes[name].rglob("*")]:
                os.chown(path, pw.pw_uid, pw.pw_gid, follow_symlinks=False)
                path.chmod(0o700 if path.is_dir() else 0o600)
        port = _free_port()
        config = work / "sshd_config"
        config.write_text("\n".join([
            "ListenAddress 127.0.0.1", f"PidFile {work / 'sshd.pid'}", "UsePAM no", "StrictModes yes",
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PermitRootLogin no", f"AllowUsers {' '.join(USERS.values())}",
            "AuthorizedKeysFile .ssh/authorized_keys", "Subsystem sftp internal-sftp", "X11Forwarding no",
            "PrintMotd no", "MaxStartups 50", "LogLevel VERBOSE"]) + "\n")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
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
                    raise RuntimeError("sshd did not listen") from None
                time.sleep(0.05)
        yield Pinned(port, exe, homes, uids, files, orch_key, orch_pub, shared,
                     host_key.export_public_key().decode().strip(), work)
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


def _sim_for_holders(p: Pinned, run: Path) -> Path:
    """`gputravel attest --sim-formats --state-dir RUN/platform`, then what a holder copies: the SIM policy, its
    root certificates and gpu.json (never the keys), where the holders can read them."""
    res = subprocess.run([sys.executable, "-m", "gputravel.console.cli", "attest", "--sim-formats", "--state-dir",
                          str(run / "platform"), "--out", str(p.work / "sim-evidence"), "--json"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    sim = run / "platform" / "vendor-formats"
    copy = p.shared / f"sim-{run.name}"
    copy.mkdir(mode=0o755)
    for f in ("sim-evidence.toml", "gpu-root.crt", "rim-root.crt", "tdx-root.crt", "gpu.json"):
        shutil.copy2(sim / f, copy / f)
        (copy / f).chmod(0o644)
    assert not list(copy.glob("*.key"))
    return copy


def _init(p: Pinned, name: str, sim: Path, *extra: str) -> dict[str, object]:
    user, home = USERS[name], p.homes[name]
    res = _as(user, home, str(p.exe), "holder", "init", "--data", str(home / "data"), "--name", name, "--policy",
              str(sim / "sim-evidence.toml"), "--golden", str(sim / "gpu.json"), *extra, "--json")
    _as(user, home, str(p.exe), "holder", "authorize", "--key", str(p.orch_pub))
    doc: dict[str, object] = json.loads(res.stdout)
    return doc


def _inventory(p: Pinned, *, evil: Path | None = None) -> Path:
    inv = p.work / "holders.toml"
    entries = []
    for name, user in USERS.items():
        entry = (f'[[holder]]\nname = "{name}"\nhost = "127.0.0.1"\nuser = "{user}"\nmanaged = false\n'
                 f'client_key = "{p.orch_key.name}"\n')
        if evil is not None and name == "holder-b":  # the orchestrator's say on what holder-b checks: ignored
            entry += f'attest_policy = "{evil}"\ngolden = "{evil}"\ndata = "/etc"\npython = "/bin/sh"\n'
        entries.append(entry)
    inv.write_text(f'[defaults]\nport = {p.port}\nhost_key = "{p.host_public}"\nconnect_timeout = 5\n\n'
                   + "\n".join(entries))
    return inv


def _settings(out: Path, inventory: Path, **kw: object) -> RunSettings:
    base: dict[str, object] = dict(rounds=1, steps_per_visit=2, batch_size=4, seq_len=32, chunk_kib=16,
                                   buffer_mib=0.25, out_dir=out, transport="inventory", holders_file=inventory,
                                   data_path="channel")
    base.update(kw)
    return RunSettings(**base)  # type: ignore[arg-type]


async def test_a_holder_pinned_run_over_openssh_completes_and_its_receipts_verify(pinned: Pinned,
                                                                                   capsys: pytest.CaptureFixture[str]
                                                                                   ) -> None:
    run = pinned.work / "run-1"
    sim = _sim_for_holders(pinned, run)
    configs = {name: _init(pinned, name, sim, "--accept-any-td") for name in USERS}
    # the orchestrator names its own SIM policy for holder-b: ignored (with a warning), nothing changes
    evil = pinned.work / "evil.toml"
    evil.write_text('[intel-tdx]\ntcb_status = ["OutOfDate"]\n')
    inventory = _inventory(pinned, evil=evil)
    specs = {s.name: s for s in load_inventory(inventory)}
    assert "is holder-pinned" in capsys.readouterr().err
    assert specs["holder-b"].attest_policy is None and set(specs["holder-b"].ignored) >= {"attest_policy", "golden",
                                                                                          "data", "python"}
    report = (await holders.run(_settings(run, inventory))).to_json()
    assert [(v["holder"], v["outcome"]) for v in report["visits"]] == [("holder-a", "done"), ("holder-b", "done")]
    assert report["failed_visits"] == 0 and report["ledger"]["verified"]
    for v in report["visits"]:
        att = v["holder_attestation"]
        assert att["policy_source"] == "holder" and att["policy_sha256"] == configs[v["holder"]]["policy_sha256"]
        assert att["roots"] == configs[v["holder"]]["roots"] and v["bytes"] > 0
    for h in report["holders"]:
        assert h["managed"] is False and h["policy_sha256"] == configs[h["name"]]["policy_sha256"]
        assert "remote_dir" not in h  # nothing was uploaded
    # `agents deploy` uploads nothing and reports what each holder's agent states
    from gputravel.console.cli.commands.agents import _for_each

    rows = {r["holder"]: r for r in await _for_each(inventory, "deploy")}
    for name in USERS:
        assert rows[name]["state"] == "holder-pinned" and rows[name]["uploaded"] is False
        assert rows[name]["policy_sha256"] == configs[name]["policy_sha256"] and rows[name]["agent_version"]
    for home in pinned.homes.values():
        assert not (home / ".gputravel").exists()  # no bundle, no witness of the orchestrator's choosing
    # each holder verifies its receipts, as itself, against the ledger the orchestrator hands it (a copy it keeps
    # in its own home: SQLite's WAL mode needs a folder the reader may write its shared-memory file in)
    for name, user in USERS.items():
        ledger = pinned.homes[name] / "ledger-1.db"
        shutil.copy2(run / "ledger.db", ledger)
        pw = pwd.getpwnam(user)
        os.chown(ledger, pw.pw_uid, pw.pw_gid)
        res = _as(user, pinned.homes[name], str(pinned.exe), "holder", "verify", "--ledger", str(ledger),
                  "--json")
        assert json.loads(res.stdout)["ok"] is True and json.loads(res.stdout)["holder"] == name
        # the run's farewell reached the agent before sshd let the connection go (session 15: lost in 3 of 4
        # runs): every receipt names its visit's rows, and the witness holds the run's end head
        receipts = pinned.homes[name] / ".config" / "gputravel" / "holder" / "receipts" / str(report["run_id"])
        assert all(json.loads(p.read_text()).get("ledger_rows") for p in receipts.glob("epoch-*.json"))
        witness = [json.loads(line) for line in (receipts / "witness.jsonl").read_text().splitlines()]
        assert [w["at"] for w in witness][-1] == "end"


async def test_the_orchestrator_key_gets_no_shell_no_sftp_no_forward_and_no_data(pinned: Pinned) -> None:
    run = pinned.work / "run-2"
    sim = _sim_for_holders(pinned, run)
    _init(pinned, "holder-a", sim, "--accept-any-td")
    spec = {s.name: s for s in load_inventory(_inventory(pinned))}["holder-a"]
    secret = pinned.data_files["holder-a"].read_bytes()[:64]
    conn = await connect(spec)
    try:
        for command in (f"cat {pinned.data_files['holder-a']}", "cat data/part.txt", "id -un; sh -i"):
            res = await asyncio.wait_for(conn.run(command, check=False, encoding=None, stdin=asyncssh.DEVNULL), 60)
            out = bytes(res.stdout or b"")
            assert secret not in out and b"gt-pinned" not in out  # holder serve ran, not the command
            assert b'"name":"holder-a"' in out.replace(b" ", b"")  # its HELLO (sizes only), then nothing

        async def sftp() -> list[str]:
            async with conn.start_sftp_client() as client:
                return list(await client.listdir("."))

        # the SFTP subsystem is the forced command too: no SFTP server answers (an error, or no answer at all)
        with pytest.raises((asyncssh.Error, OSError, TimeoutError)):
            await asyncio.wait_for(sftp(), 20)
        with pytest.raises((asyncssh.Error, OSError, TimeoutError)):  # restrict: no forwarding
            _reader, writer = await asyncio.wait_for(conn.open_connection("127.0.0.1", pinned.port), 20)
            writer.close()
        with pytest.raises(asyncssh.ChannelListenError):  # nor the direct path's forward, unless the holder says
            await asyncio.wait_for(conn.forward_remote_port("127.0.0.1", 0, "127.0.0.1", pinned.port), 20)
    finally:
        conn.close()
        await conn.wait_closed()
    # --permit-open: OpenSSH takes the line, and the key may forward to that one address only; it may listen on
    # the holder's loopback, nowhere else (session 15: any address sshd's GatewayPorts allowed)
    _as(USERS["holder-a"], pinned.homes["holder-a"], str(pinned.exe), "holder", "authorize", "--key",
        str(pinned.orch_pub), "--permit-open", f"127.0.0.1:{pinned.port}")
    conn = await connect(spec)
    try:
        _reader, writer = await asyncio.wait_for(conn.open_connection("127.0.0.1", pinned.port), 20)
        writer.close()
        with pytest.raises((asyncssh.Error, OSError, TimeoutError)):
            _reader, writer = await asyncio.wait_for(conn.open_connection("127.0.0.1", pinned.port + 1), 20)
            writer.close()
        with pytest.raises(asyncssh.ChannelListenError):
            await asyncio.wait_for(conn.forward_remote_port("0.0.0.0", 0, "127.0.0.1", pinned.port), 20)
    finally:
        conn.close()
        await conn.wait_closed()
    # --data-forward: the direct path's forward (a listener on the holder's loopback), and no local forward
    _as(USERS["holder-a"], pinned.homes["holder-a"], str(pinned.exe), "holder", "authorize", "--key",
        str(pinned.orch_pub), "--data-forward")
    conn = await connect(spec)
    try:
        listener = await asyncio.wait_for(conn.forward_remote_port("127.0.0.1", 0, "127.0.0.1", pinned.port), 20)
        assert listener.get_port() > 0
        listener.close()
        with pytest.raises((asyncssh.Error, OSError, TimeoutError)):
            _reader, writer = await asyncio.wait_for(conn.open_connection("127.0.0.1", pinned.port), 20)
            writer.close()
    finally:
        conn.close()
        await conn.wait_closed()


async def test_the_direct_path_needs_the_holders_data_forward_and_says_so_without_it(pinned: Pinned) -> None:
    """Session 15: the README's run (the direct path, data_route "forward") against a key authorized as the
    holder guide says ended in asyncssh's ChannelListenError, a traceback (exit 1). Now the visit fails by name
    with what to do; with ``holder authorize --data-forward`` it is done."""
    run = pinned.work / "run-4"
    sim = _sim_for_holders(pinned, run)
    _init(pinned, "holder-a", sim, "--accept-any-td")  # restricted: no forwarding
    _init(pinned, "holder-b", sim, "--accept-any-td")
    _as(USERS["holder-b"], pinned.homes["holder-b"], str(pinned.exe), "holder", "authorize", "--key",
        str(pinned.orch_pub), "--data-forward")
    report = (await holders.run(_settings(run, _inventory(pinned), data_path="direct", visit_attempts=1))).to_json()
    by = {v["holder"]: v for v in report["visits"]}
    assert by["holder-b"]["outcome"] == "done" and by["holder-b"]["bytes"] > 0
    assert by["holder-a"]["outcome"] == "failed" and by["holder-a"]["bytes"] == 0
    assert "--data-forward" in by["holder-a"]["error"] and 'data_route = "network"' in by["holder-a"]["error"]


async def test_a_holder_that_pins_another_mrtd_refuses_and_its_data_never_leaves(pinned: Pinned) -> None:
    run = pinned.work / "run-3"
    sim = _sim_for_holders(pinned, run)
    _init(pinned, "holder-a", sim, "--accept-any-td")
    other = pinned.shared / "sim-run-3-pinned"
    shutil.copytree(sim, other)
    (other / "sim-evidence.toml").write_text((sim / "sim-evidence.toml").read_text() + f'mr_td = ["{"cd" * 48}"]\n')
    for f in [other, *other.iterdir()]:
        f.chmod(0o755 if f.is_dir() else 0o644)
    config_b = _init(pinned, "holder-b", other)  # pinned: no --accept-any-td needed
    assert config_b["mr_td_policy"] == "pinned"
    report = (await holders.run(_settings(run, _inventory(pinned), visit_attempts=1))).to_json()
    by = {v["holder"]: v for v in report["visits"]}
    assert by["holder-a"]["outcome"] == "done"
    assert by["holder-b"]["outcome"] == "failed" and by["holder-b"]["bytes"] == 0
    assert by["holder-b"]["holder_attestation"]["failed_claim"] == "mr-td"
    rows = read_rows(run / "ledger.db")
    assert not [r for r in rows if r.holder == "holder-b" and r.kind == "phase" and r.phase == "PROVISION"
                and (r.nbytes or 0) > 0]
    run_id = rows[0].run_id
    assert run_id is not None
    receipts_b = _as(USERS["holder-b"], pinned.homes["holder-b"], str(pinned.exe), "holder", "receipts", "--json")
    assert [r for r in json.loads(receipts_b.stdout) if r["run"] == run_id] == []
    assert sim_store  # the SIM identities stayed in the orchestrator's run folder


def test_init_names_a_data_folder_the_holder_cannot_read(pinned: Pinned) -> None:
    """Session 15: `holder init --data` on a folder the holder's user cannot reach (here under root's home; one it
    can see but not read is refused by the option's parser) was a PermissionError traceback (exit 1); it is a
    ConfigError naming the folder and what to do (exit 2), and nothing is written."""
    user, home = USERS["holder-b"], pinned.homes["holder-b"]
    config = home / "unreadable-config"
    res = _as(user, home, str(pinned.exe), "holder", "init", "--data", "/root/data", "--config", str(config),
              "--accept-any-td", check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "--data /root/data" in res.stderr and "cannot read it" in res.stderr
    assert not config.exists()
