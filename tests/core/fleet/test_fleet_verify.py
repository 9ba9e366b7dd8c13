"""`gputravel ledger verify` on one node's folder of a fleet over several nodes: nothing broken, so no verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gputravel.console.cli.main import app


def _node_folder(root: Path, *ranks: int) -> Path:
    """A fleet node's folder as a run leaves it before (or without) a fleet ledger: ``fleet.json`` and its ranks."""
    root.mkdir()
    (root / "fleet.json").write_text(json.dumps({"gpus": 2}))
    for r in ranks:
        (root / f"rank-{r}").mkdir()
    return root


@pytest.mark.parametrize(("ranks", "says"), [
    ((1,), "holds rank(s) 1, and the fleet ledger is kept on rank 0's node"),
    ((0,), "the run stopped before rank 0 wrote it"),
])
def test_a_node_folder_without_the_fleet_ledger_is_exit_2_saying_where_it_is(tmp_path: Path, ranks: tuple[int, ...],
                                                                             says: str) -> None:
    node = _node_folder(tmp_path / "node-b", *ranks)

    result = CliRunner().invoke(app, ["ledger", "verify", str(node), "--json"])

    assert result.exit_code == 2, result.output  # not 8: no chain was found broken
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "config" and error["type"] == "ConfigError"
    assert says in error["message"] and f"ledger verify {node / f'rank-{ranks[0]}' / 'ledger.db'}`" in error["message"]
