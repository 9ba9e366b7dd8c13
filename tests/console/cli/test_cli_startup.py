"""Commands that need no model start without torch (issue 25.10): the root command loads only the module of
the command that runs, and those modules import the engine lazily. Checked on ``sys.modules`` in a fresh
process, never by timing (``gputravel --version`` measured 0.1 s of CPU here against 1.4 s before)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gputravel.core import events as ev
from gputravel.core.ledger import Ledger
from gputravel.core.recording import Recorder

PROBE = """
import json, sys
sys.argv = ["gputravel", *json.loads(sys.argv[1])]
from gputravel.console.cli import main as cli
try:
    cli.main()
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "textual": "textual" in sys.modules}),
      file=sys.stderr)
"""


def probe(args: list[str], cwd: Path) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True,
                          timeout=120, cwd=cwd)
    return dict(json.loads(proc.stderr.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("startup")
    run = root / "runs" / "run-1"
    run.mkdir(parents=True)
    rec = Recorder(run / "recording.db", meta={})
    rec(ev.RunStarted(1.0, "r1", {"kind": "emulated", "sim": True}, ("alice",), 1))
    rec(ev.RunCompleted(2.0, "r1", 1, 0, 1.0))
    rec.close()
    with Ledger.open(run / "ledger.db", run_id="r1") as ledger:
        ledger.append(kind="phase", phase="train", holder="alice", epoch=1, key_fp=None, nbytes=1, duration_s=0.1,
                      detail={}, state={})
    (root / "runs" / "latest").symlink_to("run-1")
    fleet = root / "runs" / "fleet-1"  # a fleet folder: its ledger and a rank's
    (fleet / "rank-0").mkdir(parents=True)
    (fleet / "fleet.json").write_text(json.dumps({"settings": {}, "fleet": {}}))
    for path in (fleet / "ledger.db", fleet / "rank-0" / "ledger.db"):
        with Ledger.open(path, run_id="f1") as ledger:
            ledger.append(kind="phase", phase="train", holder="alice", epoch=1, key_fp=None, nbytes=1,
                          duration_s=0.1, detail={}, state={})
    (root / "data" / "alice").mkdir(parents=True)
    (root / "data" / "alice" / "a.txt").write_text("to be or not to be " * 100)
    return root


@pytest.mark.parametrize("args", [
    ["--version"], ["runs", "ls"], ["runs", "show", "latest"], ["runs", "show", "run-1", "--json"],
    ["runs", "log", "run-1"], ["ledger", "verify", "run-1"], ["ledger", "verify", "fleet-1", "--json"], ["ledger", "show", "run-1"], ["replay", "run-1"],
    ["data", "check", "data"], ["attest", "--help"], ["runs", "show", "nope", "--json"],
], ids=lambda a: " ".join(a))
def test_a_command_that_needs_no_model_imports_no_torch(args: list[str], run_dir: Path) -> None:
    seen = probe(args, run_dir)
    assert seen["code"] in (0, None) or args[-2:] in (["nope", "--json"], ["fleet-1", "--json"]), seen
    assert seen["torch"] is False, f"gputravel {' '.join(args)} imported torch"
    assert seen["textual"] is False



ORCHESTRATOR_PATH = ["gputravel.core.travel.engine", "gputravel.core.api", "gputravel.core.deviceclient.client",
                     "gputravel.core.runfolder", "gputravel.core.ledger", "gputravel.core.attestation",
                     "gputravel.core.session", "gputravel.core.platform.emulated", "gputravel.core.travel.handoff"]
MODULES_PROBE = """
import json, sys
for name in json.loads(sys.argv[1]):
    __import__(name)
print(json.dumps(sorted(sys.modules)))
"""


def test_the_orchestrator_path_loads_no_torch_and_nothing_of_the_device() -> None:
    """Issue 26 item 3, at run time (the import contracts say it of the source): the travel engine, the api,
    the device client, runs, the ledger and attestation import without torch, numpy or any ``core.device``
    module (the orchestrator speaks to the device only over the wire in ``core.protocol``)."""
    out = subprocess.run([sys.executable, "-c", MODULES_PROBE, json.dumps(ORCHESTRATOR_PATH)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    loaded = set(json.loads(out.strip().splitlines()[-1]))
    assert set(ORCHESTRATOR_PATH) <= loaded
    assert "torch" not in loaded and "numpy" not in loaded
    assert sorted(m for m in loaded if m.startswith("gputravel.core.device.") or m == "gputravel.core.device") == []


def test_a_whole_run_and_its_resume_never_import_torch_in_the_orchestrator(data_root: Path, tmp_path: Path) -> None:
    """The orchestrator plans the model from ``core/training/shapes.py`` and ``train_settings.py`` (no torch)
    and names the device from the device service's ``DEVICE`` line: only the device process imports torch.
    Every test and user that starts ``gputravel run`` saves torch's import (about 3 s of CPU here) once."""
    out = tmp_path / "run"
    seen = probe(["run", "--data", str(data_root), "--holders", "2", "--rounds", "1", "--steps-per-visit", "2",
                  "--batch-size", "4", "--seq-len", "32", "--buffer-mib", "0.25", "--transport", "local",
                  "--out", str(out), "--json"], tmp_path)
    assert seen["code"] in (0, None), seen
    assert (out / "ledger.db").is_file()
    assert seen["torch"] is False, "gputravel run imported torch in the orchestrator"
    resumed = probe(["run", "--resume", "--out", str(out), "--json"], tmp_path)
    assert resumed["code"] in (0, None) and resumed["torch"] is False, resumed


FIRST_FRAME = """
import json, sys, types
sys.argv = ["gputravel-console", *json.loads(sys.argv[1])]
from gputravel.console.tui import app as console_app

seen = {}
run = console_app.GpuTravelConsole.run


def first_frame_then_quit(self, *args, **kwargs):
    start_fleet = self.when_ready  # what the fleet console starts once its first screen is drawn

    def drawn():
        seen["torch"] = "torch" in sys.modules
        seen["content"] = bool(self.screen.query("*"))
        seen["starts_fleet_after"] = start_fleet is not None
        self.exit()

    self.when_ready = drawn
    return run(self, headless=True, size=(80, 24))


# the fleet itself (torchrun, torch) is not this test's business: its two modules stand in, empty
fake_rank, fake_run = types.ModuleType("gputravel.core.fleet.rank"), types.ModuleType("gputravel.core.fleet.run")
fake_rank.FleetOptions = lambda **kw: kw
fake_run.launch_fleet = lambda settings, options, quiet: {"stand-in": True}
sys.modules.update({fake_rank.__name__: fake_rank, fake_run.__name__: fake_run})
console_app.GpuTravelConsole.run = first_frame_then_quit
try:
    console_app.main()
except (SystemExit, Exception) as exc:
    seen["ended"] = type(exc).__name__
print(json.dumps(seen), file=sys.stderr)
"""


def test_the_fleet_console_draws_its_first_frame_before_torch_is_imported(tmp_path: Path) -> None:
    """``gputravel-console --gpus 2``: the screen comes first; torchrun's start (and torch's import in this
    process) only once it is drawn (issue 25.10: the fleet console stayed blank for seconds)."""
    proc = subprocess.run([sys.executable, "-c", FIRST_FRAME, json.dumps(["--gpus", "2", "--out", "run"])],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    seen = json.loads(proc.stderr.strip().splitlines()[-1])
    assert seen.get("content") is True, proc.stderr[-2000:]
    assert seen["torch"] is False
    assert seen["starts_fleet_after"] is True


HELP_PROBE = """
import json, sys
import typer.main
from typer._click.core import Context
from typer.testing import CliRunner
from gputravel.console.cli.main import app

root = typer.main.get_command(app)
runner = CliRunner()
shown, failed = [], []


def walk(command, path):
    result = runner.invoke(app, [*path, "--help"])
    (shown if result.exit_code == 0 and "Usage" in result.output else failed).append(" ".join(path) or "(root)")
    if hasattr(command, "list_commands"):  # a group (typer's vendored click has no Group class to test)
        ctx = Context(command)
        for name in command.list_commands(ctx):
            walk(command.get_command(ctx, name), [*path, name])


walk(root, [])
print(json.dumps({"shown": shown, "failed": failed, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def test_help_at_every_level_imports_no_torch() -> None:
    """Issue 35 item 3: ``gputravel --help``, ``bench --help`` and every command's and group's help render
    without importing torch (it was imported through ``core.bench.fleet``: 8 s for ``--help``)."""
    proc = subprocess.run([sys.executable, "-c", HELP_PROBE], capture_output=True, text=True, timeout=300)
    seen = json.loads(proc.stderr.strip().splitlines()[-1])
    assert seen["failed"] == [], seen
    assert {"(root)", "bench", "bench fleet", "bench train", "bench checkpoint", "runs", "ledger show"} \
        <= set(seen["shown"]), seen["shown"]
    assert seen["torch"] is False, "rendering help imported torch"


def test_bench_fleets_default_variants_are_the_studys() -> None:
    """``bench fleet`` repeats the study's default variants so that its help need not import torch."""
    from gputravel.console.cli.commands.bench_fleet import DEFAULT_VARIANTS
    from gputravel.core.bench import fleet

    assert DEFAULT_VARIANTS == fleet.DEFAULT_VARIANTS


def test_bench_gpu_aes_default_sizes_are_the_studys() -> None:
    """``bench gpu-aes`` spells the study's default sizes so that its help need not import numpy."""
    from gputravel.console.cli.commands.bench_gpu_aes import DEFAULT_SIZES, parse_sizes
    from gputravel.core.bench import gpu_aes

    assert tuple(parse_sizes(DEFAULT_SIZES)) == gpu_aes.DEFAULT_SIZES


def test_the_roots_help_lists_each_command_as_its_own_help_says() -> None:
    """``gputravel --help`` lists the commands from ``COMMAND_SUMMARIES`` (it imports no command module); each
    line is the first paragraph of that command's own help."""
    import typer.main
    from typer._click.core import Context

    from gputravel.console.cli.main import COMMAND_MODULES, COMMAND_SUMMARIES, app

    root = typer.main.get_command(app)
    ctx = Context(root)
    for name, summary in COMMAND_SUMMARIES.items():
        assert name in COMMAND_MODULES
        command = root.get_command(ctx, name)
        own = command.short_help or command.help or ""
        assert " ".join(own.split("\n\n")[0].split()) == summary, name


def test_the_roots_help_loads_no_command_module(tmp_path: Path) -> None:
    seen = probe(["--help"], tmp_path)
    assert seen["code"] in (0, None) and seen["torch"] is False
    out = subprocess.run([sys.executable, "-c", "import sys; sys.argv = ['gputravel', '--help']\n"
                          "from gputravel.console.cli import main\ntry:\n    main.main()\nexcept SystemExit:\n    pass\n"
                          "print(sorted(m for m in sys.modules if m.startswith('gputravel.console.cli.commands')),"
                          " file=sys.stderr)"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "run" in out.stdout and "runs" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "[]"


BENCH_HELP_PROBE = """
import json, sys
sys.argv = ["gputravel", "bench", "--help"]
from gputravel.console.cli import main
try:
    main.main()
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "loaded": [m for m in ("pydantic", "asyncio", "torch") if m in sys.modules]}),
      file=sys.stderr)
"""


def test_bench_help_imports_neither_pydantic_nor_asyncio() -> None:
    """Issue 35 item 4: ``gputravel bench --help`` took 0.6 s: typer built a pydantic adapter for ``--help``'s
    and the completion flags' None (pydantic's import: about 0.2 s), and ``bench load``/``soak`` imported asyncio
    at the top. Flags pass through (``options.fast_bool_flags``), asyncio is imported where a study runs."""
    proc = subprocess.run([sys.executable, "-c", BENCH_HELP_PROBE], capture_output=True, text=True, timeout=120)
    seen = json.loads(proc.stderr.strip().splitlines()[-1])
    assert seen == {"code": 0, "loaded": []}, seen
