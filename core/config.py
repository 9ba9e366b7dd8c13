"""Run settings: keyword-only, validated, with the defaults the README documents."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gputravel.core.errors import ConfigError
from gputravel.core.phases import VISIT_PHASES

#: The stated limits of a run's numbers: beyond them a value is a typo or an attack on the orchestrator's
#: memory (a plan of 10**20 rounds), refused with ``ConfigError`` before anything is created.
LIMITS: dict[str, tuple[float, float]] = {
    "holders": (1, 10_000),
    "rounds": (1, 1_000_000),
    "steps_per_visit": (1, 1_000_000),
    "batch_size": (1, 65_536),
    "seq_len": (8, 1_048_576),
    "lr": (1e-12, 10.0),
    "seed": (0, 2**63 - 1),
    "torch_threads": (0, 4096),
    "auth_workers": (0, 4096),
    "visit_attempts": (1, 100),
    "key_chunk_budget": (1, 2**32),
    "epoch_limit": (1, 2**62),
    "checkpoint_every": (1, 1_000_000),
    "keep_checkpoints": (1, 1_000_000),
    "lora_rank": (0, 65_536),
    "lora_alpha": (0.0, 1e6),
}
_INT_FIELDS = ("holders", "rounds", "steps_per_visit", "chunk_kib", "batch_size", "seq_len", "seed",
               "torch_threads", "auth_workers", "visit_attempts", "key_chunk_budget", "epoch_limit",
               "checkpoint_every", "keep_checkpoints", "lora_rank")
_FLOAT_FIELDS = ("buffer_mib", "val_fraction", "val_share", "lr", "lora_alpha")
_STR_FIELDS = ("model", "cc_mode", "transport", "data_path", "cipher_engine", "data_host")
_OPTIONAL_STR_FIELDS = ("device", "fault", "lora_targets")
_BOOL_FIELDS = ("resume", "allow_fault_injection", "attest_prefetch", "handoff_relay", "handoff_with_window",
                "grant_at_completion")
_OPTIONAL_BOOL_FIELDS = ("parallel_auth", "overlap")


def _num(x: float) -> str:
    return f"{x:,}" if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    holders: int = 3
    rounds: int = 2
    steps_per_visit: int = 20
    buffer_mib: float = 4.0
    data_dir: Path | None = None
    out_dir: Path = Path("runs/default")
    resume: bool = False
    chunk_kib: int = 1024
    val_fraction: float = 0.1  # of each holder's data held out for validation
    val_share: float = 0.1  # of the buffer reserved for the held-out slice of a visit
    model: str = "tiny"
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    seed: int = 1337
    device: str | None = None
    cc_mode: str = "on"
    torch_threads: int = 0
    allow_fault_injection: bool = False
    breakpoints: tuple[str, ...] = field(default_factory=tuple)
    transport: str = "local"  # "local" (agent subprocess), "ssh" (embedded loopback server), "inventory"
    holders_file: Path | None = None
    #: "direct": the agent seals once under the GPU key and sends straight to the device's data port;
    #: "channel" (alias "ssh"): the same sealed chunks ride the holder link (SSH channel), relayed unopened;
    #: "conventional": what collaborative training does without Travelling: the holder sends plaintext over
    #: its secure link (SSH), the orchestrator's CVM receives it, re-encrypts it for the GPU's bounce buffer
    #: and the device decrypts it (the redundant re-encryption Fastrack removes).
    data_path: str = "direct"
    #: device: chunk authentication/decryption over a worker pool sized to the free cores; None = auto
    #: (on where the device has cores to spare, off on 2 cores, where it was measured to slow provisioning)
    parallel_auth: bool | None = None
    #: device: decrypt chunk k while chunk k+1 is on the wire; None = auto (as above)
    overlap: bool | None = None
    auth_workers: int = 0  # 0: sized to the free cores
    #: device: who opens provisioning chunks: "cpu" (cryptography), "gpu" (core.gpucipher kernels, opened in
    #: device memory; in numba's simulator on a CPU-only machine), "auto" (gpu where the buffer is on CUDA and
    #: numba-cuda sees the device)
    cipher_engine: str = "auto"
    data_host: str = "127.0.0.1"  # address the device's TCP data port binds to (inventory holders, route "network")
    visit_attempts: int = 2  # a failed visit is redone (agent restarted, device recovered) up to this many times
    key_chunk_budget: int = 2**32  # chunks one provisioning key may seal; beyond it the window is split
    epoch_limit: int | None = None  # epochs per session before a fresh attested session (re-key)
    #: pretrained weights the model starts from (llm.c .bin or GPT-2 safetensors; docs/checkpoints.md): the
    #: model's shape comes from the file, the weights reach the device as a sealed stream (core/training/weights.py)
    init_from: Path | None = None
    #: LoRA (core/training/lora.py): adapters of this rank on the frozen base train, alone; 0: the whole model
    lora_rank: int = 0
    lora_alpha: float = 0.0  # 0: the rank (scale alpha / rank = 1)
    lora_targets: str | None = None  # comma-separated module names; None: the attention projections
    #: a visit's checkpoint is written in the background; every N-th visit (and the last) checkpoints, and a
    #: visit is committed (resumable) once the checkpoint holding it is durable
    checkpoint_every: int = 1
    keep_checkpoints: int = 2  # sealed checkpoints kept in the run folder (never the one the ledger names)
    fault: str | None = None  # fault injection: "kill-orchestrator|kill-device|kill-agent@PHASE:VISIT[+SECONDS]"
    #: fault injection into what holders attest (``run --inject``): cvm-debug, cvm-report-data, gpu-measurement,
    #: gpu-nonce; every holder must refuse (core/travel/holder_attest.py)
    holder_inject: str | None = None
    #: the orchestrator CVM's kind, what holders attest (issue 31): tdx, snp (SEV-SNP) or azure-snp (Azure's HCL
    #: report + vTPM quote); on the emulated platform a SIM CVM of that kind
    cvm_kind: str = "tdx"
    #: the next holder's attestation (ATTEST -> VERDICT, over the key its window will have) runs while the
    #: current visit trains; its hand-off then only checks that the prediction held (core/travel/windows.py)
    attest_prefetch: bool = True  # the next holder's attestation while the current visit trains (issue 34 item 2)
    #: an attesting holder's HANDOFF is also relayed by the device on the agent's parked data connection (its key
    #: wrapped for the agent; the agent takes the first copy): the SSH link's crossing leaves the hand-off's path. Off:
    #: measured no faster (the orchestrator's round trip to the device cost more than the crossing it saves,
    #: docs/performance.md); ``bench travel --handoff-relay`` turns it on
    handoff_relay: bool = False
    #: a visit's first HANDOFF goes with its window's request (its key wrapped before the window opens, on the
    #: holder's ok verdict fetched ahead, ``attest_prefetch``): the device opens the window and writes it on the
    #: agent's parked data connection at once, one orchestrator -> device message for window and relay
    #: (core/travel/handoff_relay.py). On: measured faster (docs/performance.md, session 11's A/B); it acts only where
    #: the attestation is prefetched; ``bench travel --no-handoff-with-window`` turns it off
    handoff_with_window: bool = True
    #: a window's request that carries its HANDOFF is answered when the window is complete, grant and
    #: ``WindowClosed`` in one answer, and the holder's DONE is read after, off the hand-off's path
    #: (core/travel/completion.py, task complete14). On by default since session 14: with Tx counted from the
    #: window's request to its end on both paths, four ABBA pairs of ``bench travel`` found Tx per visit lower in
    #: every pair at 4 and 20 MiB (docs/performance.md, "Session 14"); ``--no-grant-at-completion`` turns it off
    grant_at_completion: bool = True

    def __post_init__(self) -> None:
        if self.data_path == "ssh":  # the name `bench provision` and the docs use for the channel path
            object.__setattr__(self, "data_path", "channel")
        self._check_types()
        checks = [
            (self.holders >= 1, "holders must be >= 1"),
            (self.rounds >= 1, "rounds must be >= 1"),
            (self.steps_per_visit >= 1, "steps-per-visit must be >= 1"),
            (0 < self.buffer_mib <= 64 * 1024, "buffer-mib must be in (0, 65536]"),
            (4 <= self.chunk_kib <= 16 * 1024, "chunk-kib must be in [4, 16384]"),
            (0 < self.val_fraction < 0.5, "val-fraction must be in (0, 0.5)"),
            (0 < self.val_share < 0.5, "val-share must be in (0, 0.5)"),
            (self.batch_size >= 1 and self.seq_len >= 8, "batch-size >= 1 and seq-len >= 8"),
            (self.cc_mode in ("on", "off", "devtools"), "cc-mode is on, off or devtools"),
            (self.transport in ("local", "ssh", "inventory"), "transport is local, ssh or inventory"),
            (self.data_path in ("channel", "direct", "conventional"), "data path is direct, channel (ssh) or conventional"),
            (self.visit_attempts >= 1, "visit-attempts must be >= 1"),
            (self.cipher_engine in ("auto", "cpu", "gpu"), "cipher-engine is auto, cpu or gpu"),
            (self.holder_inject in (None, "cvm-debug", "cvm-report-data", "gpu-measurement", "gpu-nonce"),
             "inject is cvm-debug, cvm-report-data, gpu-measurement or gpu-nonce"),
            (self.cvm_kind in ("tdx", "snp", "azure-snp"), "cvm-kind is tdx, snp or azure-snp"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        self._check_limits()

    def _check_types(self) -> None:
        """Every number is of its type and finite."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if name == "epoch_limit" and value is None:
                continue
            if type(value) is not int:
                raise ConfigError(f"{name.replace('_', '-')} must be an integer, not {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(f"{name.replace('_', '-')} must be a finite number, not {value!r}")
        for name in (*_STR_FIELDS, *_OPTIONAL_STR_FIELDS):
            value = getattr(self, name)
            if not (isinstance(value, str) or (value is None and name in _OPTIONAL_STR_FIELDS)):
                raise ConfigError(f"{name.replace('_', '-')} must be a string, not {value!r}")
            if isinstance(value, str) and (not value or any(ord(c) < 32 for c in value)):
                raise ConfigError(f"{name.replace('_', '-')} must be a non-empty line, not {value!r}")
        for name in (*_BOOL_FIELDS, *_OPTIONAL_BOOL_FIELDS):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (value is None and name in _OPTIONAL_BOOL_FIELDS)):
                raise ConfigError(f"{name.replace('_', '-')} must be true or false, not {value!r}")
        for name in ("data_dir", "holders_file", "out_dir"):
            value = getattr(self, name)
            if isinstance(value, str | os.PathLike) and not isinstance(value, Path):
                object.__setattr__(self, name, value := Path(value))
            if not (isinstance(value, Path) or (value is None and name != "out_dir")):
                raise ConfigError(f"{name.replace('_', '-')} must be a path, not {value!r}")
        if isinstance(self.breakpoints, list):
            object.__setattr__(self, "breakpoints", tuple(self.breakpoints))
        if not isinstance(self.breakpoints, tuple) or not all(isinstance(b, str) for b in self.breakpoints):
            raise ConfigError(f"break-before must be phase names, not {self.breakpoints!r}")

    def _check_limits(self) -> None:
        """Every number inside its stated limit (``LIMITS``), every breakpoint a phase: checked before
        anything is created, so a typo never starts a run."""
        for name, (lo, hi) in LIMITS.items():
            value = getattr(self, name)
            if value is not None and not lo <= value <= hi:
                raise ConfigError(f"{name.replace('_', '-')} must be in [{_num(lo)}, {_num(hi)}], not {value!r}")
        names = [str(p) for p in VISIT_PHASES]
        for b in self.breakpoints:
            if b not in names:
                raise ConfigError(f"break-before {b!r} is not a phase (one of {', '.join(names)})")

    @property
    def buffer_bytes(self) -> int:
        return int(self.buffer_mib * 1024 * 1024)

    @property
    def chunk_size(self) -> int:
        return self.chunk_kib * 1024

    @classmethod
    def from_dict(cls, data: dict[str, Any], **overrides: Any) -> RunSettings:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown settings: {', '.join(sorted(unknown))}")
        d = {**data, **overrides}
        for key in ("data_dir", "holders_file", "init_from"):
            if d.get(key) is not None:
                d[key] = Path(d[key])
        d["out_dir"] = Path(d["out_dir"])
        d["breakpoints"] = tuple(d.get("breakpoints", ()))
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["data_dir"] = str(self.data_dir) if self.data_dir else None
        d["holders_file"] = str(self.holders_file) if self.holders_file else None
        d["init_from"] = str(self.init_from) if self.init_from else None
        d["out_dir"] = str(self.out_dir)
        d["breakpoints"] = list(self.breakpoints)
        return d
