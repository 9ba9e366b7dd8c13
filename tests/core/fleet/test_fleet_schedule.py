"""The fleet's lock-step schedule (pure)."""

from __future__ import annotations

import pytest

from gputravel.core.errors import ConfigError, DataError
from gputravel.core.fleet.schedule import plan_fleet
from gputravel.core.travel.holders import HolderInfo
from gputravel.core.travel.schedule import plan_visits


def _holders(sizes: dict[str, int]) -> list[HolderInfo]:
    return [HolderInfo(name, "byte", n, 512, 1, "sha", "local") for name, n in sizes.items()]


def _visits(sizes: dict[str, int], *, rounds: int, buffer_bytes: int = 8192):
    return plan_visits(_holders(sizes), rounds=rounds, buffer_bytes=buffer_bytes, val_share=0.1, min_train_bytes=200)


def _check(plan, visits) -> None:
    seen = []
    for step in plan.steps:
        assert len(step.slots) == plan.gpus
        busy = [v.holder for v in step.slots if v is not None]
        assert len(busy) == len(set(busy)), f"a holder hosts two GPUs in step {step.index}"
        assert all(v.round == step.round for v in step.slots if v is not None)
        seen.extend(v.index for v in step.slots if v is not None)
    assert sorted(seen) == [v.index for v in visits]  # every visit exactly once


@pytest.mark.parametrize(("n_holders", "gpus"), [(3, 2), (4, 2), (5, 4), (2, 4), (1, 1), (6, 3)])
def test_every_visit_once_and_no_holder_hosts_two_gpus(n_holders: int, gpus: int) -> None:
    visits = _visits({f"h{i}": 4000 for i in range(n_holders)}, rounds=2)
    plan = plan_fleet(visits, gpus=gpus)
    _check(plan, visits)
    assert plan.rounds == 2
    per_round = -(-n_holders // gpus)
    assert len(plan.steps) == 2 * per_round


def test_h_not_a_multiple_of_n_leaves_idle_gpus_that_rotate() -> None:
    visits = _visits({"a": 4000, "b": 4000, "c": 4000}, rounds=2)
    plan = plan_fleet(visits, gpus=2)
    idle = [[g for g, v in enumerate(s.slots) if v is None] for s in plan.steps]
    assert [len(i) for i in idle] == [0, 1, 0, 1]  # the round's last step has one idle GPU
    assert idle[1] != idle[3]  # the idle GPU is not always the same one
    assert plan.to_dict()["idle_slots"] == 2


def test_each_gpu_sees_different_holders_over_rounds() -> None:
    visits = _visits({"a": 4000, "b": 4000}, rounds=2)
    plan = plan_fleet(visits, gpus=2)
    assert plan.steps[0].holders != plan.steps[1].holders  # GPU 0 visits a, then b
    for gpu in range(2):
        assert {v.holder for _, v in plan.for_gpu(gpu) if v} == {"a", "b"}


def test_parts_of_one_holder_never_share_a_step() -> None:
    visits = _visits({"big": 20000, "small": 4000}, rounds=1, buffer_bytes=8192)
    assert sum(1 for v in visits if v.holder == "big") == 3
    plan = plan_fleet(visits, gpus=2)
    _check(plan, visits)
    assert len(plan.steps) == 3  # big's three parts need three steps


def test_digest_names_the_schedule() -> None:
    visits = _visits({"a": 4000, "b": 4000, "c": 4000}, rounds=1)
    assert plan_fleet(visits, gpus=2).digest() == plan_fleet(visits, gpus=2).digest()
    assert plan_fleet(visits, gpus=2).digest() != plan_fleet(visits, gpus=3).digest()


def test_bad_gpu_counts_are_named_errors() -> None:
    visits = _visits({"a": 4000}, rounds=1)
    with pytest.raises(ConfigError):
        plan_fleet(visits, gpus=0)
    with pytest.raises(ConfigError):
        plan_fleet(visits, gpus=2).for_gpu(2)
    with pytest.raises(DataError):
        _visits({"a": 10}, rounds=1)
