"""scripts/lora_step_ab.py (issue 32): the device's ``Trainer`` step and ``bench train``'s plain-loop step, taken in
turn in one process, on a tiny random Llama folder. Fed the same batches, the two loops give the same losses bit
for bit: the step the A/B compares is the same arithmetic on both sides, so a CPU difference is not the work's."""

from __future__ import annotations

from pathlib import Path

from helpers import load_script


def test_plain_and_trainer_steps_match_and_are_accounted(tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    assert load_script("make_random_llama").main(["--shape", "llama-tiny", "--out", str(folder)]) == 0
    got = load_script("lora_step_ab").main([str(folder), "--rank", "4", "--steps", "3", "--seq-len", "32",
                                           "--variants", "plain,trainer,trainer_step"])
    assert got["same_losses"] is True
    runs = got["variants"]
    assert set(runs) == {"plain", "trainer", "trainer_step"}
    for rec in runs.values():
        assert len(rec["cpu_s"]) == len(rec["minflt"]) == len(rec["csw"]) == len(rec["losses"]) == 3
        assert all(c > 0 for c in rec["cpu_s"]) and rec["median_cpu_s"] > 0
        assert all(loss > 0 for loss in rec["losses"])
    # LoRA's B starts at zero: the first step's loss is the base model's, whichever loop takes it
    assert runs["plain"]["losses"][0] == runs["trainer_step"]["losses"][0]
    # the slice draws its own batches (the trainer's generator): other losses, same step count
    assert runs["trainer"]["losses"] != runs["plain"]["losses"]
