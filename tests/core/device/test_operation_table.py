"""The device's one operation table: every wire operation has one handler, assembled from the service's
concerns, and a fleet member's service extends the same table (no second dispatch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gputravel.core.attestation import DeviceIdentity, provision_emulated
from gputravel.core.device.service import DeviceService
from gputravel.core.errors import DeviceError, WindowError
from gputravel.core.fleet.device import FLEET_OPS, FleetPart, fleet_device_service
from gputravel.core.protocol.devicelink import Op


class FakeRing:
    """Stands in for the device group's ring, to isolate fleet_train's guards: any step on it fails the test."""

    def train_step(self, *args: object, **kwargs: object) -> object:
        raise AssertionError("the range guard should have refused before the ring was reached")


def _identity(tmp_path: Path, device_id: str = "emu-gpu-0") -> DeviceIdentity:
    _, identity = provision_emulated(tmp_path / "state", device_id=device_id)
    return identity


def test_the_table_holds_every_wire_operation_once(tmp_path: Path) -> None:
    svc = DeviceService(identity=_identity(tmp_path), buffer_bytes=4096, device="cpu")
    assert set(svc.operations) == {op.value for op in Op}
    # the service is composed of parts, no mixin: it and every part derive from nothing of the project's, and
    # the table's entries split between the parts with none left over
    parts = {"ops": svc.ops, "windows": svc.windows, "model": svc.model, "streams": svc.streams}
    assert DeviceService.__bases__ == (object,)
    assert all(type(part).__bases__ == (object,) for part in (*parts.values(), svc.intake, svc.counts, svc.keys))
    owners = {op: next(name for name, part in parts.items() if getattr(fn, "__self__", None) is part)
              for op, fn in svc.operations.items()}
    assert owners[Op.HANDOFF] == owners[Op.SCRUB] == "windows" and owners[Op.TRAIN] == "model"
    assert owners[Op.RESTORE] == "streams" and owners[Op.STATS] == "ops"


def test_the_fleet_service_extends_the_same_table(tmp_path: Path) -> None:
    svc = fleet_device_service(identity=_identity(tmp_path), buffer_bytes=4096, device="cpu")
    assert set(svc.operations) == {op.value for op in Op} | set(FLEET_OPS)
    assert type(svc) is DeviceService  # the fleet adds a part, it does not subclass
    assert svc.handle("fleet_leave", {}, b"").header == {"left": True}
    with pytest.raises(DeviceError, match="in no fleet"):
        svc.handle("fleet_train", {"train_off": 0, "train_len": 0, "val_off": 0, "val_len": 0, "fmt": "u16",
                                   "weight": 1.0, "total_weight": 1.0, "steps": 1, "seed": 0}, b"")


@pytest.mark.parametrize("op", ["fleet_nope", "op_info", "", 7])
def test_an_unknown_operation_is_a_named_device_error(tmp_path: Path, op: object) -> None:
    for cls in (DeviceService, fleet_device_service):
        svc = cls(identity=_identity(tmp_path), buffer_bytes=4096, device="cpu")
        with pytest.raises(DeviceError, match="unknown operation"):
            svc.handle(op, {}, b"")  # type: ignore[arg-type]


def test_bad_arguments_to_a_fleet_operation_are_a_named_device_error(tmp_path: Path) -> None:
    svc = fleet_device_service(identity=_identity(tmp_path), buffer_bytes=4096, device="cpu")
    with pytest.raises(DeviceError, match="bad arguments for fleet_leave"):
        svc.handle("fleet_leave", {"nonsense": 1}, b"")


def test_fleet_train_shares_the_range_checks_of_train(tmp_path: Path) -> None:
    """``fleet_train`` refuses a range outside the buffer with ``train``'s own guard (one check, two ops)."""
    svc = DeviceService(identity=_identity(tmp_path), buffer_bytes=4096, device="cpu")
    part = FleetPart(svc)
    svc.add_part(part.operations())
    args = {"train_off": 4000, "train_len": 200, "val_off": 0, "val_len": 0, "fmt": "u16"}
    with pytest.raises(WindowError, match=r"range \[4000, 4200\) is outside the buffer"):
        svc.check_train_ranges(**{k: v for k, v in args.items() if k != "fmt"})
    part.ring = FakeRing()  # a ring that must never be reached: the guard refuses first
    with pytest.raises(WindowError, match=r"range \[4000, 4200\) is outside the buffer"):
        svc.handle("fleet_train", {**args, "weight": 1.0, "total_weight": 1.0, "steps": 1, "seed": 0}, b"")
    with pytest.raises(DeviceError, match="already in the table: fleet_join"):
        svc.add_part(part.operations())  # a part cannot shadow an entry of the table


def test_the_parts_share_state_not_self_a_changed_model_ends_its_stream_and_an_open_restore_bars_training(
        tmp_path: Path) -> None:
    """The seams between the model part and the streams part: an attached checkpoint stream of an older model
    generation is refused (the model changed under it), and while a restore is open the model is incomplete."""
    import json
    import os

    from gputravel.core.protocol.stream import StreamHeader
    from gputravel.core.training.model import GPTConfig
    from gputravel.core.training.trainer import TrainSettings

    svc = DeviceService(identity=_identity(tmp_path), buffer_bytes=4096, device="cpu", allow_fault_injection=True)
    config = GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2, n_embd=8)
    program = {"program": "gputravel.gpt2/v1", "model": config.to_dict(),
               "train": TrainSettings(steps_per_visit=1, batch_size=2, seq_len=8).to_dict()}
    svc.model.op_configure(payload=json.dumps(program).encode())
    key, header = os.urandom(32), StreamHeader("checkpoint", "run-1", 0, os.urandom(16), 4096).to_dict()
    first = svc.handle("checkpoint", {"header": header}, key).header
    assert first["chunks"] >= 2 and svc.handle("checkpoint_next", {}, b"").header["kind"] == 0
    before = svc.model.generation
    svc.handle("tamper", {"region": "model"}, b"")
    assert svc.model.generation != before
    with pytest.raises(DeviceError, match="the model changed since"):
        svc.handle("checkpoint_next", {}, b"")
    svc.handle("restore", {"header": header}, key)
    assert svc.model.incomplete
    with pytest.raises(DeviceError, match="the model is incomplete: a restore is open"):
        svc.handle("train", {"train_off": 0, "train_len": 0, "val_off": 0, "val_len": 0, "fmt": "u16"}, b"")
