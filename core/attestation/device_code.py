"""The device's code, named once: the source files the code measurement hashes (``evidence.code_measurement``).

Exactly the ``gputravel`` modules the device process runs: everything its two entry points import, at start
or later (function-level imports included: the trainer when a program is configured, the GPU cipher where
CUDA is, the SPDM responder's formats), and nothing the orchestrator alone runs (``core/deviceclient/``,
``core/travel/``, the ledger, the console). The device image holds both entries, so one measurement covers a
plain device and a fleet member alike.

The list is declared, not discovered at measurement time, so what is measured is reviewable in one place and
a device module that grows a new import fails ``tests/test_device_code.py`` (which walks the entries' imports
and runs them in a fresh process) until it is named here.
"""

from __future__ import annotations

from pathlib import Path

from gputravel.core.errors import ConfigError

__all__ = ["DEVICE_CODE", "DEVICE_ENTRIES", "device_code_files"]

#: ``python -m gputravel.core.device`` and a fleet member's ``python -m gputravel.core.fleet.device``
DEVICE_ENTRIES = ("gputravel.core.device.__main__", "gputravel.core.fleet.device")

#: Paths relative to the ``gputravel`` package root, grouped by what they are to the device.
DEVICE_CODE: tuple[str, ...] = (
    # the device service: sockets, operations, key windows, chunk intake and openers, checkpoints, SPDM
    "core/device/__init__.py", "core/device/__main__.py", "core/device/admission.py", "core/device/ckpt_ops.py",
    "core/device/dataplane.py", "core/device/entry.py", "core/device/intake.py", "core/device/memory.py", "core/device/model.py",
    "core/device/modelmac.py", "core/device/openers.py", "core/device/operations.py", "core/device/pending.py",
    "core/device/reply.py", "core/device/server.py", "core/device/service.py", "core/device/session_keys.py",
    "core/device/spdm.py",
    "core/device/window.py", "core/device/provision_window.py", "core/device/counters.py", "core/device/control.py", "core/device/dataconn.py",
    "core/procs.py",  # the checkpoint seal's thread runs below the training step (run_in_background)
    "core/allocator.py",  # glibc's malloc keeps freed memory (keep_freed_memory, in serve_from_args)
    # a fleet member's device: its three operations and the sealed ring of the device group
    "core/fleet/__init__.py", "core/fleet/ddp.py", "core/fleet/device.py",
    "core/collectives/__init__.py", "core/collectives/agree.py", "core/collectives/crypto.py",
    "core/collectives/direct.py",
    "core/collectives/gpu_ring.py",
    "core/collectives/hook.py", "core/collectives/keys.py", "core/collectives/parts.py", "core/collectives/ring.py",
    "core/collectives/secure_call.py", "core/collectives/streamed.py",
    # the training program it runs and the checkpoints it seals
    "core/training/__init__.py", "core/training/attention.py", "core/training/checkpoint.py",
    "core/training/checkpoint_file.py", "core/training/state_stream.py",
    "core/training/digest.py", "core/training/families.py",
    "core/training/llama.py", "core/training/lora.py", "core/training/model.py", "core/training/shapes.py",
    "core/training/store.py", "core/training/tokens.py", "core/training/train_settings.py", "core/training/trainer.py",
    # the GPU cipher (opens provisioning chunks, MACs the model)
    "core/gpucipher/__init__.py", "core/gpucipher/backend.py", "core/gpucipher/engine.py", "core/gpucipher/fused.py",
    "core/gpucipher/kernels.py", "core/gpucipher/reference.py", "core/gpucipher/torch_io.py",
    # the wire it speaks (shared with the orchestrator and, for most of it, the holders)
    "core/protocol/__init__.py", "core/protocol/admission.py", "core/protocol/cipher.py", "core/protocol/ckptring.py",
    "core/protocol/deviceanswers.py", "core/protocol/devicelink.py", "core/protocol/errors.py",
    "core/protocol/frames.py", "core/protocol/holderattest.py",
    "core/protocol/holderlink.py", "core/protocol/keys.py", "core/protocol/shmring.py",
    "core/protocol/stream.py", "core/protocol/wire.py", "core/protocol/wirejson.py",
    # its identity, evidence and signed report (the package loads whole: verify, policy and inject come along)
    "core/attestation/__init__.py", "core/attestation/device_code.py", "core/attestation/evidence.py",
    "core/attestation/hardware_evidence.py", "core/attestation/inject.py", "core/attestation/pki.py",
    "core/attestation/policy.py", "core/attestation/result.py", "core/attestation/verify.py",
    # the SPDM responder's formats (the simulated GPU's report, certificates and RIM)
    "core/evidence/__init__.py", "core/evidence/bounded.py", "core/evidence/claims.py", "core/evidence/nvidia_rim.py",
    "core/evidence/nvidia_spdm.py", "core/evidence/policy.py", "core/evidence/sim_gpu.py", "core/evidence/sim_rim.py",
    "core/evidence/sim_snp.py", "core/evidence/sim_store.py", "core/evidence/sim_tdx.py", "core/evidence/snp.py",
    "core/evidence/snp_report.py", "core/evidence/spdm_claims.py",
    # the package roots and the shared pieces: errors, the key exchange, machine probes, private files
    "__init__.py", "core/__init__.py", "core/errors.py", "core/handshake.py", "core/machine.py", "core/files.py",
)


def package_root() -> Path:
    """The installed ``gputravel`` package's folder (this file is core/attestation/device_code.py)."""
    return Path(__file__).resolve().parent.parent.parent


def device_code_files(root: Path | None = None) -> list[Path]:
    """The files of ``DEVICE_CODE`` under ``root`` (default: the installed package); a missing one is a
    ``ConfigError`` (a measurement of part of the device's code would be no measurement of it)."""
    base = package_root() if root is None else Path(root)
    files = [base / rel for rel in DEVICE_CODE]
    missing = [rel for rel, f in zip(DEVICE_CODE, files, strict=True) if not f.is_file()]
    if missing:
        raise ConfigError(f"code measurement: the device's code lacks {', '.join(missing)} under {base}")
    return files
