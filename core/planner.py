"""The transfer planner: predict a run's transfer and training time on both data paths from measured runs.

A small regression in the spirit of CM-DARE (performance models of cloud training fitted on a handful of
measured runs). Per path, for one visit that moves ``B`` bytes and trains ``S`` steps::

    transfer_s = a + b·B        (a: the per-visit cost of opening and closing a window; b: seconds per byte)
    train_s    = c + d·S        (c: the per-visit cost (held-out evaluation, set-up); d: seconds per step)

A run is a sum of visits, so a measured run with ``V`` visits, ``ΣB`` bytes and ``ΣS`` steps gives one row
``tx_s = a·V + b·ΣB`` and ``train_s = c·V + d·ΣS``: the coefficients are fitted on whole runs by least squares
(numpy), each row weighted by 1/measured so every run counts by its relative error. The error is reported by
leave-one-run-out: fit on all runs but one, predict the one left out, compare with what was measured.

Training time does not depend on the data path (the same job, the same device), so ``c, d`` are fitted on the
runs of both paths together. Transfer is fitted per path.

A fleet of N GPUs (the all-reduce's term, lock-step steps) is ``core/fleetplan.py``, on this model.

Standard library and numpy only (a core module: no console, typer or rich).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from gputravel.core.errors import ConfigError

PATHS = ("travelling", "conventional")
#: The engine data path each study path runs on.
DATA_PATH = {"travelling": "direct", "conventional": "conventional"}
MIB = 1 << 20
#: What makes two measured runs the same training job (their training times comparable).
JOB_KEYS = ("model", "model_params", "batch_size", "seq_len", "steps_per_mib", "torch_threads")

# --- the schedule's shape ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class VisitShape:
    holder: int
    window_bytes: int  # what is provisioned: the training part plus the held-out slice
    train_bytes: int


def split_holder(size: int, *, val_fraction: float = 0.1, unit: int = 1) -> tuple[int, int]:
    """(train, held-out) bytes of a holder holding ``size`` bytes, as the agent splits them."""
    val = int(size * val_fraction) // unit * unit
    return size - val, val


def schedule(holder_bytes: Sequence[int], *, buffer_bytes: int, val_fraction: float = 0.1, val_share: float = 0.1,
             unit: int = 1) -> list[VisitShape]:
    """The visits of one round, as the engine's schedule cuts them (``core.travel.schedule.plan_visits``)."""
    if buffer_bytes < 1:
        raise ConfigError("the buffer must hold at least one byte")
    val_cap = int(buffer_bytes * val_share) // unit * unit
    train_cap = (buffer_bytes - val_cap) // unit * unit
    if train_cap < unit:
        raise ConfigError(f"a {buffer_bytes}-byte buffer leaves no room for training data")
    visits: list[VisitShape] = []
    for h, size in enumerate(holder_bytes):
        if size < 1:
            raise ConfigError(f"holder {h} holds no data")
        train, val = split_holder(int(size), val_fraction=val_fraction, unit=unit)
        val_len = min(val_cap, val) // unit * unit
        n_parts = max(1, -(-train // train_cap))
        part = -(-train // n_parts)
        part = -(-part // unit) * unit
        for p in range(n_parts):
            n = min(part, train - p * part)
            if n > 0:
                visits.append(VisitShape(h, n + val_len, n))
    return visits


def uncapped_buffer_bytes(holder_bytes: Sequence[int], *, val_fraction: float = 0.1, val_share: float = 0.1) -> int:
    """The smallest buffer (rounded up to 4 KiB) that takes each holder's whole training data in one visit."""
    train = max(split_holder(int(s), val_fraction=val_fraction)[0] for s in holder_bytes)
    need = math.ceil(train / (1.0 - val_share)) + 4096
    return -(-need // 4096) * 4096


def steps_for(train_bytes: int, steps_per_mib: float) -> int:
    """Training steps for a visit whose training part holds ``train_bytes``: proportional, at least one."""
    return max(1, round(train_bytes / MIB * steps_per_mib))


# --- measured samples ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One measured run (or one provisioning hand-off) on one path."""

    path: str
    visits: int
    bytes: int
    tx_s: float
    train_s: float | None = None
    steps: int | None = None
    label: str = ""
    job: dict[str, Any] | None = None


def samples_from_report(doc: dict[str, Any], *, source: str = "") -> list[Sample]:
    """Samples from a ``bench travel --json`` or ``bench provision --json`` document (skipped or failed rows
    and paths other than the two compared are left out)."""
    bench = doc.get("benchmark")
    out: list[Sample] = []
    if bench == "fleet":  # a fleet study: its rows feed the all-reduce term (fleet_samples_from_report)
        return out
    if bench == "calibration":  # the planner's own calibration: several travel studies
        for i, study in enumerate(doc.get("studies", [])):
            out.extend(samples_from_report(study, source=f"{source}cal{i}:"))
        return out
    if bench == "travel":
        job = doc.get("job")
        holder = job.get("holder_mib", "?") if isinstance(job, dict) else "?"
        for r in doc.get("rows", []):
            if r.get("status") != "ok" or r.get("path") not in PATHS:
                continue
            out.append(Sample(path=r["path"], visits=int(r["visits"]), bytes=int(r["bytes"]), tx_s=float(r["tx_s"]),
                              train_s=float(r["train_s"]), steps=int(r["steps"]),
                              label=f"{source}{r['path']} buffer {r['buffer_mib']} MiB, {holder} MiB/holder", job=job))
    elif bench == "provision":
        names = {"direct": "travelling", "travelling": "travelling", "conventional": "conventional"}
        for r in doc.get("rows", []):
            path = names.get(str(r.get("path")))
            if path is None or r.get("median_s") in (None, 0):
                continue
            if r.get("variant") not in (None, "all", "default", "travelling"):  # ablation rows: not the default
                continue
            if path == "travelling" and (r.get("parallel_auth") is False or r.get("overlap") is False):
                continue
            out.append(Sample(path=path, visits=1, bytes=int(float(r["size_mib"]) * MIB), tx_s=float(r["median_s"]),
                              label=f"{source}provision:{r['path']}@{r['size_mib']}MiB"))
    else:
        raise ConfigError(f"{source or 'input'}: not a 'bench travel' or 'bench provision' JSON document "
                          f"(benchmark={bench!r})")
    return out


# --- least squares -------------------------------------------------------------------------------------
def fit_linear(x: np.ndarray, y: np.ndarray, *, relative: bool = True) -> np.ndarray:
    """Least-squares coefficients of ``y ≈ x @ coef``; with ``relative`` each row is weighted by 1/|y|."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ConfigError(f"cannot fit {x.shape} against {y.shape}")
    if relative:
        w = 1.0 / np.maximum(np.abs(y), 1e-12)
        x, y = x * w[:, None], y * w
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return np.asarray(coef, dtype=float)


def fit_nonnegative(x: np.ndarray, y: np.ndarray, *, relative: bool = True) -> np.ndarray:
    """Like :func:`fit_linear`, with every coefficient >= 0 (a cost cannot be negative): the best least-squares
    fit over the subsets of features whose unconstrained fit is non-negative (the models have 2 features)."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    k = x.shape[1]
    best: tuple[float, np.ndarray] | None = None
    w = 1.0 / np.maximum(np.abs(y), 1e-12) if relative else np.ones_like(y)
    for mask in range((1 << k) - 1, 0, -1):
        cols = [j for j in range(k) if mask >> j & 1]
        sub = fit_linear(x[:, cols], y, relative=relative)
        if np.any(sub < 0):
            continue
        coef = np.zeros(k)
        coef[cols] = sub
        err = float(np.sum(((x @ coef - y) * w) ** 2))
        if best is None or err < best[0] - 1e-15 * max(1.0, abs(best[0])):
            best = (err, coef)
    return best[1] if best is not None else np.zeros(k)


@dataclass
class Term:
    """One fitted relation ``y = Σ coef_i · feature_i`` (fitted on whole runs) and its held-out error."""

    name: str
    features: tuple[str, ...]
    coef: list[float]
    n: int
    fit_error: dict[str, float | None] = field(default_factory=dict)
    loo: list[dict[str, Any]] = field(default_factory=list)
    loo_error: dict[str, float | None] = field(default_factory=dict)
    note: str = ""

    def predict(self, row: Sequence[float]) -> float:
        return float(np.dot(self.coef, np.asarray(row, dtype=float)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _errors(pred: Sequence[float], meas: Sequence[float]) -> dict[str, float | None]:
    if not len(pred):
        return {"mape": None, "max_ape": None}
    ape = [abs(p - m) / abs(m) if m else math.inf for p, m in zip(pred, meas, strict=True)]
    return {"mape": float(np.mean(ape)), "max_ape": float(max(ape))}


def fit_term(name: str, features: tuple[str, ...], x: np.ndarray, y: np.ndarray, labels: Sequence[str]) -> Term:
    """Fit ``y ≈ x @ coef`` (coefficients >= 0) and its leave-one-out error. A fold left with fewer runs than coefficients (or with
    features that do not vary) falls back to the last feature alone (a proportional model) and says so."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    n, k = x.shape
    if n == 0:
        raise ConfigError(f"no measured runs to fit {name}")
    note = ""
    if n < k or np.linalg.matrix_rank(x) < k:
        coef = np.zeros(k)
        coef[-1] = fit_nonnegative(x[:, -1:], y)[0]
        note = f"only {n} run(s) with too little variety for {k} coefficients: proportional fit"
    else:
        coef = fit_nonnegative(x, y)
    term = Term(name, features, [float(c) for c in coef], n, note=note)
    term.fit_error = _errors(list(x @ coef), list(y))
    if n < 2:
        term.loo_error = {"mape": None, "max_ape": None}
        term.note = (term.note + "; " if term.note else "") + "one run: no held-out error"
        return term
    preds: list[float] = []
    for i in range(n):
        keep = np.arange(n) != i
        xs, ys = x[keep], y[keep]
        fallback = xs.shape[0] < k or np.linalg.matrix_rank(xs) < k
        if fallback:
            c = np.zeros(k)
            c[-1] = fit_nonnegative(xs[:, -1:], ys)[0]
        else:
            c = fit_nonnegative(xs, ys)
        p = float(x[i] @ c)
        preds.append(p)
        term.loo.append({"held_out": labels[i], "predicted_s": p, "measured_s": float(y[i]),
                         "error": (p - float(y[i])) / float(y[i]) if y[i] else None, "proportional_fold": bool(fallback)})
    term.loo_error = _errors(preds, list(y))
    return term


@dataclass
class Model:
    transfer: dict[str, Term]
    train: Term | None
    steps_per_mib: float | None
    jobs: list[dict[str, Any]]
    n_samples: int

    def to_dict(self) -> dict[str, Any]:
        return {"transfer": {p: t.to_dict() for p, t in self.transfer.items()},
                "train": self.train.to_dict() if self.train else None, "steps_per_mib": self.steps_per_mib,
                "jobs": self.jobs, "samples": self.n_samples}


def fit_model(samples: Iterable[Sample]) -> Model:
    """Transfer per path (``a·visits + b·bytes``) and training for both paths together (``c·visits + d·steps``)."""
    samples = list(samples)
    if not samples:
        raise ConfigError("no measured runs to fit the model on (need 'bench travel' or 'bench provision' rows)")
    transfer: dict[str, Term] = {}
    for path in PATHS:
        rows = [s for s in samples if s.path == path and s.tx_s > 0]
        if rows:
            x = np.array([[s.visits, s.bytes] for s in rows], dtype=float)
            y = np.array([s.tx_s for s in rows])
            transfer[path] = fit_term(f"transfer[{path}]", ("visits", "bytes"), x, y, [s.label for s in rows])
    trained = [s for s in samples if s.train_s is not None and s.steps is not None and s.train_s > 0]
    train = None
    if trained:
        x = np.array([[s.visits, s.steps] for s in trained], dtype=float)
        y = np.array([float(s.train_s or 0.0) for s in trained])
        train = fit_term("train", ("visits", "steps"), x, y, [s.label for s in trained])
    jobs: list[dict[str, Any]] = []  # distinct training jobs (the dataset's size is not part of the job)
    for s in samples:
        job = {k: s.job.get(k) for k in JOB_KEYS} if s.job is not None else None
        if job is not None and job not in jobs:
            jobs.append(job)
    spm = [float(j["steps_per_mib"]) for j in jobs if j.get("steps_per_mib")]
    return Model(transfer, train, spm[0] if spm else None, jobs, len(samples))


# --- prediction ----------------------------------------------------------------------------------------
def wire_s_per_byte(gbps: float) -> float:
    if not math.isfinite(gbps) or gbps <= 0:
        raise ConfigError(f"--gbps must be a positive number, got {gbps}")
    return 8.0 / (gbps * 1e9)


def transfer_coef(model: Model, path: str, *, gbps: float | None = None) -> tuple[float, float]:
    """(per-visit seconds, seconds per byte) for ``path``; with ``gbps`` the link's rate enters: Travelling
    decrypts while the next chunk is on the wire (overlap), so its per-byte cost is the larger of the two;
    the conventional path stores and forwards through the CVM (receive, then re-encrypt and push), so the
    wire adds to it."""
    term = model.transfer.get(path)
    if term is None:
        raise ConfigError(f"no measured runs on the {path} path to predict it from")
    a, b = term.coef
    if gbps is not None:
        wire = wire_s_per_byte(gbps)
        b = max(b, wire) if path == "travelling" else b + wire
    return max(a, 0.0), max(b, 0.0)


def predict(model: Model, holder_bytes: Sequence[int], *, buffer_bytes: int, steps_per_mib: float | None = None,
            rounds: int = 1, gbps: float | None = None, val_fraction: float = 0.1,
            val_share: float = 0.1) -> dict[str, Any]:
    """Per-visit (a full buffer) and whole-run transfer and training time, and the transfer share, per path."""
    if rounds < 1:
        raise ConfigError("rounds must be >= 1")
    spm = steps_per_mib if steps_per_mib is not None else model.steps_per_mib
    if spm is None or spm <= 0:
        raise ConfigError("steps per MiB unknown: pass --steps-per-mib (the measured runs do not state it)")
    if model.train is None:
        raise ConfigError("no measured training times to predict training from (need 'bench travel' rows)")
    visits = schedule(holder_bytes, buffer_bytes=buffer_bytes, val_fraction=val_fraction, val_share=val_share)
    c, d = model.train.coef
    full = schedule([max(holder_bytes)], buffer_bytes=buffer_bytes, val_fraction=val_fraction,
                    val_share=val_share)[0]  # the biggest visit: a full buffer (or a whole holder)
    out: dict[str, Any] = {"visits": len(visits) * rounds, "rounds": rounds,
                           "bytes": sum(v.window_bytes for v in visits) * rounds,
                           "steps": sum(steps_for(v.train_bytes, spm) for v in visits) * rounds,
                           "steps_per_mib": spm, "buffer_bytes": buffer_bytes, "gbps": gbps, "paths": {}}
    for path in PATHS:
        if path not in model.transfer:
            continue
        a, b = transfer_coef(model, path, gbps=gbps)
        tx = sum(a + b * v.window_bytes for v in visits) * rounds
        tr = sum(max(0.0, c + d * steps_for(v.train_bytes, spm)) for v in visits) * rounds
        v_tx = a + b * full.window_bytes
        v_tr = max(0.0, c + d * steps_for(full.train_bytes, spm))
        out["paths"][path] = {
            "visit": {"bytes": full.window_bytes, "steps": steps_for(full.train_bytes, spm), "tx_s": v_tx,
                      "train_s": v_tr, "tx_pct": 100.0 * v_tx / (v_tx + v_tr) if v_tx + v_tr > 0 else None},
            "run": {"tx_s": tx, "train_s": tr, "total_s": tx + tr,
                    "tx_pct": 100.0 * tx / (tx + tr) if tx + tr > 0 else None},
            "mb_s": (sum(v.window_bytes for v in visits) * rounds) / tx / 1e6 if tx > 0 else None,
        }
    p = out["paths"]
    if "travelling" in p and "conventional" in p and p["travelling"]["run"]["tx_s"] > 0:
        out["conventional_over_travelling_tx"] = p["conventional"]["run"]["tx_s"] / p["travelling"]["run"]["tx_s"]
    return out
