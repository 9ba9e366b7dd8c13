"""``gputravel-console``'s command line: the options it shares with ``gputravel run`` reach the run's settings,
and the bench screen launches small configurations. No engine runs here: the app, the holder set and the
engine builder are fakes that record what they were given."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import click
import pytest
import typer
from typer.testing import CliRunner

from gputravel.console import holders as holders_module
from gputravel.console.tui import app as console_app
from gputravel.console.tui.screens import bench as bench_screen
from gputravel.core import api
from gputravel.core.config import RunSettings

SHARED_OPTIONS = ("holders_file", "transport", "data_path", "data_host", "steps_per_visit", "chunk_kib")


class FakeApp:
    """Stands in for the Textual app: ``run`` builds one engine through the factory it was given."""

    def __init__(self, engine_factory: Any) -> None:
        self.engine_factory = engine_factory
        self.engine: Any = None

    def run(self) -> None:
        self.engine = self.engine_factory()


class FakeHolders:
    """Stands in for ``console.holders.HolderSet``: no SSH server, a marker for links."""

    built: list[FakeHolders] = []

    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        self.closed = False
        FakeHolders.built.append(self)

    def links(self) -> list[str]:
        return [f"link-from-{self.settings.transport}"]

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {"apps": []}

    def fake_make_app(**kw: Any) -> FakeApp:
        if kw.get("launcher") is not None:  # the console's own runs: headless `gputravel run` processes
            seen["launcher"] = kw["launcher"]
            app = FakeApp(lambda: None)
            seen["apps"].append(app)
            return app
        assert kw.get("engine_factory") is not None, "a live console needs an engine factory"
        app = FakeApp(kw["engine_factory"])
        seen["apps"].append(app)
        return app

    def fake_build_engine(settings: RunSettings, *, links: Any = None, **_: Any) -> dict[str, Any]:
        seen["settings"], seen["links"] = settings, links
        return {"fake engine for": settings.transport}

    FakeHolders.built = []
    monkeypatch.setattr(console_app, "make_app", fake_make_app)
    monkeypatch.setattr(holders_module, "HolderSet", FakeHolders)
    monkeypatch.setattr(api, "build_engine", fake_build_engine)
    return seen


def invoke(*args: str) -> Any:
    return CliRunner().invoke(console_app.cli, list(args))


def test_console_defaults_to_the_same_transport_and_data_path_as_run(captured: dict[str, Any],
                                                                     tmp_path: Path) -> None:
    result = invoke("--out", str(tmp_path / "out"), "--no-record", "--in-process")
    assert result.exit_code == 0, result.output + repr(result.exception)
    s = captured["settings"]
    assert (s.transport, s.data_path, s.data_host, s.holders_file) == ("ssh", "direct", "127.0.0.1", None)
    assert s.out_dir == tmp_path / "out"
    # the links come from the holder set built with the same settings, closed when the app ends
    (holder_set,) = FakeHolders.built
    assert holder_set.settings is s and captured["links"] == ["link-from-ssh"]
    assert holder_set.closed


def test_console_holders_file_means_inventory_and_data_options_pass_through(captured: dict[str, Any],
                                                                            tmp_path: Path) -> None:
    inventory = tmp_path / "holders.toml"
    result = invoke("--out", str(tmp_path / "out"), "--no-record", "--in-process", "--holders-file", str(inventory),
                    "--data-path", "channel", "--data-host", "10.0.0.5")
    assert result.exit_code == 0, result.output + repr(result.exception)
    s = captured["settings"]
    assert (s.transport, s.holders_file, s.data_path, s.data_host) == ("inventory", inventory, "channel",
                                                                       "10.0.0.5")


def test_console_transport_local(captured: dict[str, Any], tmp_path: Path) -> None:
    result = invoke("--out", str(tmp_path / "out"), "--no-record", "--in-process", "--transport", "local")
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert captured["settings"].transport == "local"
    assert captured["links"] == ["link-from-local"]


def test_console_refuses_a_bad_transport_before_opening(captured: dict[str, Any], tmp_path: Path) -> None:
    result = invoke("--out", str(tmp_path / "out"), "--transport", "carrier-pigeon")
    assert result.exit_code == 2  # a usage error: the choices are typed
    assert "transport" in result.output and "carrier-pigeon" in result.output
    assert captured["apps"] == []


def _params(command: click.Command) -> dict[str, click.Parameter]:
    return {p.name: p for p in command.params if p.name in SHARED_OPTIONS}


def test_console_and_run_share_option_names_defaults_and_help() -> None:
    from gputravel.console.cli import main as cli

    run_cmd = typer.main.get_command(cli.app).get_command(None, "run")  # type: ignore[attr-defined]
    console_cmd = typer.main.get_command(console_app.cli)
    ours, theirs = _params(console_cmd), _params(run_cmd)
    assert set(ours) == set(theirs) == set(SHARED_OPTIONS)
    for name in SHARED_OPTIONS:
        assert ours[name].opts == theirs[name].opts, name
        assert ours[name].default == theirs[name].default, name
        assert ours[name].help == theirs[name].help, name  # type: ignore[attr-defined]


def test_bench_screen_launches_the_small_travel_study(monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[tuple[str, ...]] = []

    class FakeProcess:
        """Stands in for the ``gputravel bench`` child: prints ``[]`` and exits 0."""

        def __init__(self) -> None:
            self.stdout = asyncio.StreamReader()
            self.stderr = asyncio.StreamReader()
            self.stdout.feed_data(b"[]")
            self.stdout.feed_eof()
            self.stderr.feed_eof()

        async def wait(self) -> int:
            return 0

    async def fake_exec(*args: str, **kw: Any) -> FakeProcess:
        launched.append(args)
        return FakeProcess()

    monkeypatch.setattr(asyncio, "create_subprocess_exec", fake_exec)
    assert asyncio.run(bench_screen.run_bench_subprocess("travel", lambda line: None)) == []
    asyncio.run(bench_screen.run_bench_subprocess("provision", lambda line: None))
    travel, provision = launched
    assert travel[-4:] == ("travel", "--buffer-mib", "4,20", "--json")
    assert provision[-6:] == ("provision", "--size-mib", "16", "--repeats", "2", "--json")  # small, to watch


# --- conventions an operator expects --------------------------------------------------------------------------
def test_version_and_completion_are_offered() -> None:
    from gputravel.console.cli import main as cli

    version = CliRunner().invoke(cli.app, ["--version"])
    assert version.exit_code == 0 and version.output.startswith("gputravel ")
    helped = CliRunner().invoke(cli.app, ["--help"], env={"COLUMNS": "120"})
    assert "--install-completion" in helped.output and "runs" in helped.output
    assert invoke("--version").output.startswith("gputravel ")


def test_run_help_is_grouped_in_panels_with_choices_and_no_bool_on_flags() -> None:
    from gputravel.console.cli import main as cli

    text = CliRunner().invoke(cli.app, ["run", "--help"], env={"COLUMNS": "160"}).output
    for panel in ("Holders", "Model and training", "Data path", "Control and faults", "Run folder and output"):
        assert panel in text, panel
    assert "<bool>" not in text
    for choices in ("ssh|local", "direct|channel|ssh|conventional", "tiny|small|gpt2", "on|off|devtools"):
        assert choices in text, choices


def test_model_choice_names_the_engine_presets() -> None:
    from gputravel.console.cli.options import ModelPreset
    from gputravel.core.training.model import PRESETS

    assert [m.value for m in ModelPreset] == list(PRESETS)


@pytest.mark.parametrize("command", [["run"], []])
def test_a_typo_in_break_before_is_refused_by_run_and_console(command: list[str], captured: dict[str, Any],
                                                               tmp_path: Path) -> None:
    from gputravel.console.cli import main as cli

    args = [*command, "--break-before", "handof", "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(cli.app if command else console_app.cli, args)
    assert result.exit_code == 2
    assert "handof" in result.output and "handoff" in result.output  # names the phases it takes
    assert captured["apps"] == [] and "settings" not in captured


def test_console_takes_the_palette_themes_and_break_before_in_any_case(captured: dict[str, Any],
                                                                     tmp_path: Path) -> None:
    result = invoke("--out", str(tmp_path / "out"), "--no-record", "--in-process", "--theme", "high-contrast",
                    "--break-before", "provision")
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert invoke("--theme", "plaid").exit_code == 2


def test_runs_errors_are_json_with_the_errors_exit_code(tmp_path: Path) -> None:
    from gputravel.console.cli import main as cli

    for args in (["runs", "show", "nope"], ["runs", "log", "nope"], ["runs", "stop", "nope"]):
        result = CliRunner().invoke(cli.app, [*args, "--runs-dir", str(tmp_path), "--json"])
        assert result.exit_code == 2, result.output
        error = __import__("json").loads(result.stdout)["error"]
        assert error == {"code": "config", "exit_code": 2, "type": "ConfigError",
                         "message": f"no run 'nope' under {tmp_path}/ (gputravel runs ls lists them)"}
    empty = CliRunner().invoke(cli.app, ["runs", "ls", "--runs-dir", str(tmp_path), "--json"])
    assert empty.exit_code == 0 and __import__("json").loads(empty.output)["runs"] == []


def test_a_run_folder_without_process_or_final_event_reads_died(tmp_path: Path) -> None:
    from gputravel.console.cli import main as cli
    from gputravel.core import events as ev
    from gputravel.core.recording import Recorder

    run = tmp_path / "run-1"
    rec = Recorder(run / "recording.db", meta={})
    rec(ev.RunStarted(1.0, "r1", {"kind": "emulated", "sim": True}, ("alice",), 1))
    rec(ev.PhaseStarted(2.0, 0, "alice", "PROVISION", 1))
    rec.close()
    (run / "orchestrator.pid").write_text('{"pid": 999999999, "owner": "gputravel run"}')  # a process long gone
    result = CliRunner().invoke(cli.app, ["runs", "ls", "--runs-dir", str(tmp_path), "--json"])
    (info,) = __import__("json").loads(result.output)["runs"]
    assert info["status"] == "died" and "no final event" in info["error"]


def test_printed_errors_keep_their_brackets(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                            ) -> None:
    import sys

    from gputravel.console.cli import main as cli
    from gputravel.core.errors import DataError
    from gputravel.core.training import corpus

    def no_bpe(*a: Any, **kw: Any) -> Any:
        raise DataError("the gpt2 tokenizer needs tiktoken: pip install 'gputravel[bpe]'")

    monkeypatch.setattr(corpus, "fetch_corpus", no_bpe)
    monkeypatch.setattr(sys, "argv", ["gputravel", "data", "fetch", "--tokenizer", "gpt2", "--json"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 2
    assert "pip install 'gputravel[bpe]'" in capsys.readouterr().err  # rich did not eat "[bpe]"


# --- issue 35: the folder's holder count, no folder for refused input, --readonly needs a run -----------------
def _two_holders(root: Path) -> Path:
    for name in ("north", "south"):
        (root / "data" / name).mkdir(parents=True)
        (root / "data" / name / "a.txt").write_text("to be or not to be " * 200)
    return root / "data"


def test_console_data_follows_the_folders_holder_count_as_run_does(captured: dict[str, Any], tmp_path: Path) -> None:
    data = _two_holders(tmp_path)
    result = invoke("--data", str(data), "--out", str(tmp_path / "out"), "--no-record", "--in-process")
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert captured["settings"].holders == 2  # `--holders` defaulted to 3 here and refused a 2-holder folder


def test_console_refuses_input_before_making_a_run_folder(captured: dict[str, Any], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    data = _two_holders(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = invoke("--data", str(data), "--holders", "3")
    assert result.exit_code != 0 and "has 2 holder folders; --holders asks for 3" in str(result.exception)
    assert captured["apps"] == [] and not (tmp_path / "runs").exists()  # no empty `not started` folder left


def test_readonly_without_a_run_says_what_to_give(captured: dict[str, Any]) -> None:
    result = invoke("--readonly")
    assert result.exit_code == 2 and "--replay RUN --follow" in " ".join(result.output.split())
    assert captured["apps"] == []


def test_console_starts_its_runs_as_headless_gputravel_run_processes(captured: dict[str, Any], tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the console composes no run itself: each is ``gputravel run`` with the console's options in
    a folder of its own (issue 35.1); the console's ``--out`` names the first, OUT-2 the second."""
    data = _two_holders(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = invoke("--data", "data", "--out", "out", "--transport", "local", "--break-before", "train",
                    "--steps-per-visit", "7")
    assert result.exit_code == 0, result.output + repr(result.exception)
    launcher = captured["launcher"]
    assert "settings" not in captured  # no engine built in the console's process
    argv = launcher.argv(launcher.target(), breakpoints=["TRAIN"], start_paused=True)
    assert argv[1:4] == ["-m", "gputravel.console.cli", "run"]
    pairs = dict(zip(argv[4::1], argv[5::1], strict=False))
    assert pairs["--data"] == str(data.absolute()) and pairs["--transport"] == "local"
    assert pairs["--rounds"] == "1" and pairs["--steps-per-visit"] == "7" and "--holders" not in argv
    assert pairs["--out"] == str(tmp_path / "out") and pairs["--break-before"] == "TRAIN"
    assert argv[-1] == "--start-paused"
    refused = invoke("--no-record")  # the console follows its runs through their recording
    assert refused.exit_code == 2 and "--in-process" in refused.output


def test_leaving_an_attached_run_says_how_to_come_back_only_while_it_goes_on(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``--attach RUN``: ``d`` prints how to come back (``--attach``, ``--replay --follow``); ``q`` on a run that
    has ended prints nothing (it does not go on)."""
    from gputravel.core import events as ev
    from gputravel.core.recording import Recorder

    run = tmp_path / "run-1"
    rec = Recorder(run / "recording.db", meta={})
    rec(ev.RunStarted(1.0, "r1", {"kind": "emulated", "sim": True}, ("alice",), 1))
    rec(ev.RunCompleted(2.0, "r1", 1, 0, 4.2))
    rec.close()
    left: list[str] = []

    class LeavingApp:
        def __init__(self) -> None:
            self.left_how = left[0]

        def run(self) -> None:
            pass

    monkeypatch.setattr(console_app, "make_app", lambda **kw: LeavingApp())
    left.append("detach")
    said = invoke("--attach", str(run)).output
    assert f"Come back with gputravel-console --attach {run}" in " ".join(said.split())
    assert f"gputravel-console --replay {run} --follow" in " ".join(said.split())
    # one whole command a line: at 80 columns the terminal broke the one long line mid-word (walk 16)
    assert f"  gputravel-console --attach {run}    (full control)" in said.splitlines(), said
    assert f"  gputravel-console --replay {run} --follow    (read-only)" in said.splitlines(), said
    left[0] = "quit"
    assert invoke("--attach", str(run)).output == ""
