"""Reading a run folder only where it can be trusted.

``gputravel run --resume`` builds on what a run folder holds: its settings, its audit ledger (the hash chain
and the progress state next to it), its last sealed checkpoint and the checkpoint key. Each is checked here
*before* anything is started or appended, and the first that fails refuses the resume with a named error:

=====================================================  ==================  =====
what                                                   error               exit
=====================================================  ==================  =====
settings.json unreadable or invalid                    ``ConfigError``     2
ledger chain broken, or shorter / other than the head  ``LedgerError``     8
sealed in the last checkpoint; state not what the
chain says
checkpoints without a ledger                           ``LedgerError``     8
checkpoint missing, altered, of another run; key       ``IntegrityError``  5
missing or of another run; settings.json changed
since the run started
checkpoint key readable by others                      ``InsecureKeyError``2
=====================================================  ==================  =====

A folder where nothing was committed yet (a run killed in its first seconds: settings written, no ledger
and no checkpoint) is ``fresh``: resuming it starts the run with its saved settings.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputravel.core.config import RunSettings
from gputravel.core.errors import ConfigError, GpuTravelError, IntegrityError, LedgerError
from gputravel.core.ledger import canonical_json, read_rows, read_state, verify_ledger
from gputravel.core.runfolder.folder import RunFolder

__all__ = ["RunFolderCheck", "read_settings", "saved_settings", "sealed_settings_digest", "settings_digest",
           "verify_run_folder"]

#: settings.json fields that are not part of what a run is (a resume may change them)
UNSEALED_SETTINGS = frozenset({"resume", "fault", "out_dir"})


def settings_digest(saved: dict[str, Any]) -> str:
    """SHA-256 of the settings a run started with (``settings.json`` less the fields a resume may change)."""
    return hashlib.sha256(canonical_json({k: v for k, v in saved.items()
                                          if k not in UNSEALED_SETTINGS}).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class RunFolderCheck:
    """What a trusted run folder holds."""

    out: Path
    fresh: bool  # nothing committed: a resume starts the run
    rows: int = 0
    head_hash: str | None = None
    checkpoint_seq: int | None = None


def verify_run_folder(out: RunFolder | Path) -> RunFolderCheck:
    """Check everything a resume of ``out`` builds on; raise the first failure (nothing is written)."""
    folder = RunFolder.of(out)
    out = folder.path
    saved = read_settings(folder)
    ledger = folder.ledger
    checkpoints = folder.checkpoint_files()
    has_ckpts = bool(checkpoints)
    if not ledger.exists():
        if has_ckpts:
            raise LedgerError(f"--resume refused: {out} holds checkpoints but no {ledger.name} (removed?); "
                              f"nothing there can be proven")
        return RunFolderCheck(out, fresh=True)
    result = verify_ledger(ledger)
    if not result.ok:
        raise LedgerError(f"--resume refused: the ledger {ledger} is broken: {result.reason}")
    rows = read_rows(ledger)
    state = read_state(ledger)
    if "plan_digest" not in state:
        if has_ckpts:
            raise LedgerError(f"--resume refused: {ledger} records no plan but checkpoints exist")
        return RunFolderCheck(out, fresh=False, rows=result.rows, head_hash=result.head_hash)
    _check_state_against_chain(ledger, rows, state)
    seq = state.get("checkpoint_seq")
    if seq is not None:
        run_id = str(state.get("run_id", ""))
        sealed = _open_checkpoint(folder, int(seq), run_id)
        _check_sealed_head(ledger, int(seq), sealed)
        newest = max((int(p.name[5:-4]) for p in checkpoints if p.name[5:-4].isdigit()), default=int(seq))
        if newest > int(seq):  # written before a kill cut its visit short, or rows were cut off the ledger
            _check_sealed_head(ledger, newest, _open_checkpoint(folder, newest, run_id))
        want = sealed.get("settings_sha256")
        if want is not None and want != settings_digest(saved):
            raise IntegrityError(f"--resume refused: {folder.settings} changed since the run started "
                                 f"(its digest differs from the one sealed in checkpoint {seq})")
    return RunFolderCheck(out, fresh=False, rows=result.rows, head_hash=result.head_hash,
                          checkpoint_seq=None if seq is None else int(seq))


def _check_sealed_head(ledger: Path, seq: int, sealed: dict[str, Any]) -> None:
    """The ledger head sealed into checkpoint ``seq`` is still in the chain: no rows cut off, none rewritten."""
    head = sealed.get("ledger_head")
    if head is None:
        return  # a checkpoint written before heads were sealed
    again = verify_ledger(ledger, expect_head=(int(head[0]), str(head[1])))
    if not again.ok:
        raise LedgerError(f"--resume refused: the ledger is not the one checkpoint {seq} was sealed with: "
                          f"{again.reason}")


def read_settings(out: RunFolder | Path) -> dict[str, Any]:
    """The run folder's settings (``settings.json``) as a dict, or ``ConfigError`` saying what to do instead."""
    folder = RunFolder.of(out)
    out, path = folder.path, folder.settings
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--resume: {out} holds no run to continue (no {path.name}): the run never "
                          f"started; start it again with a plain `gputravel run` (and --out {out} if you "
                          f"want this folder)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--resume refused: {path} is unreadable or not JSON: {exc}") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"--resume refused: {path} is not a settings object")
    return saved


def _check_state_against_chain(ledger: Path, rows: list[Any], state: dict[str, Any]) -> None:
    """The progress state sits next to the chain, not in it: it must say what the chained rows say."""
    planned = [r for r in rows if r.kind == "planned"]
    if not planned or planned[-1].detail.get("plan_digest") != state.get("plan_digest"):
        raise LedgerError(f"--resume refused: {ledger}: the recorded plan is not the one its rows name")
    done = sorted({int(r.detail["visit"]) for r in rows if r.kind == "visit-completed" and "visit" in r.detail})
    if sorted(int(v) for v in state.get("visits_done", [])) != done:
        raise LedgerError(f"--resume refused: {ledger}: the progress state lists visits "
                          f"{sorted(state.get('visits_done', []))} done, the chained rows {done}")
    want_seq = max((v + 1 for v in done), default=0)
    if "fleet_digest" in state:  # a fleet rank counts checkpoints in lock-step steps: its last step agreed "ok"
        agreed = [int(r.detail["step"]) for r in rows if r.kind == "fleet-step" and r.outcome == "ok"]
        want_seq = agreed[-1] + 1 if agreed else 0
        if int(state.get("fleet_steps_done", 0)) != want_seq:
            raise LedgerError(f"--resume refused: {ledger}: the progress state says {state.get('fleet_steps_done')} "
                              f"fleet steps done, the chained rows {want_seq}")
    if state.get("checkpoint_seq") not in (None, want_seq):
        raise LedgerError(f"--resume refused: {ledger}: the progress state names checkpoint "
                          f"{state.get('checkpoint_seq')}, the chained rows {want_seq}")
    max_epoch = max((r.epoch for r in rows if r.epoch is not None), default=0)
    if int(state.get("epoch", 0)) > max_epoch:
        raise LedgerError(f"--resume refused: {ledger}: the progress state's epoch {state.get('epoch')} is beyond "
                          f"any epoch the chained rows used ({max_epoch})")


def _open_checkpoint(folder: RunFolder, seq: int, run_id: str) -> dict[str, Any]:
    """The sealed record of checkpoint ``seq`` (model digest, epoch, the ledger head and settings digest it
    was sealed with), after its key and seal were checked."""
    from gputravel.core.training.store import CheckpointStore, _read_key

    key_path = folder.checkpoint_key
    if not key_path.exists():
        raise IntegrityError(f"--resume refused: {key_path} is missing, so checkpoint {seq} cannot be opened "
                             f"(a new key would not open it)")
    key = _read_key(key_path)  # InsecureKeyError (exit 2) for a key others can read
    try:
        record = CheckpointStore(folder.checkpoints, key).verified_meta(seq, run_id=run_id)
    except GpuTravelError as exc:
        raise IntegrityError(f"--resume refused: checkpoint {seq} does not verify: {exc.reason}") from None
    except OSError as exc:
        raise IntegrityError(f"--resume refused: checkpoint {seq} cannot be read: {exc}") from None
    return dict(record)


def saved_settings(settings: RunSettings) -> dict[str, Any]:
    """What ``settings.json`` holds: the run's settings with absolute paths (a resume may start anywhere)."""
    saved = {k: v for k, v in settings.to_dict().items() if k not in ("resume", "fault")}
    for key in ("data_dir", "holders_file", "out_dir", "init_from"):
        if saved.get(key) is not None:
            saved[key] = str(Path(saved[key]).expanduser().resolve())
    return saved


def sealed_settings_digest(out: RunFolder | Path) -> str | None:
    """The digest of the run folder's settings as the engine seals it into each checkpoint (None: no file)."""
    try:
        saved = json.loads(RunFolder.of(out).settings.read_text())
    except (OSError, ValueError):
        return None
    return settings_digest(saved) if isinstance(saved, dict) else None
