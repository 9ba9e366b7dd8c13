"""``gputravel run --out`` into a folder another user owns is refused before anything is written (issue 30 item 7):
that user could replace the run's ledger, keys or checkpoints whatever their modes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gputravel.core.errors import ConfigError
from gputravel.core.runfolder.claim import RunClaim, check_owner


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another uid")
def test_an_out_folder_of_another_user_is_refused_and_left_alone(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "note.txt").write_text("theirs")
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        RunClaim(theirs).claim()
    assert sorted(p.name for p in theirs.iterdir()) == ["note.txt"] and theirs.stat().st_uid == 65534


def test_an_own_or_new_out_folder_is_fine(tmp_path: Path) -> None:
    check_owner(tmp_path)  # this user's
    check_owner(tmp_path / "new")  # made by this user
