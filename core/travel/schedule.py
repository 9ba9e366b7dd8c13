"""The schedule: round-robin over holders for R rounds, a holder bigger than the buffer in passes."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from gputravel.core.errors import ConfigError, DataError
from gputravel.core.protocol.shards import TOKEN_BYTES
from gputravel.core.travel.holders import HolderInfo

#: bytes of one token in each format
UNIT = TOKEN_BYTES

#: The most visits one run's schedule may hold (it is built in memory, about 200 bytes a visit).
MAX_PLANNED_VISITS = 1_000_000


@dataclass(frozen=True, slots=True)
class VisitPlan:
    index: int
    round: int
    holder: str
    part: int
    parts: int
    train_start: int
    train_len: int
    val_start: int
    val_len: int

    @property
    def window_len(self) -> int:
        return self.train_len + self.val_len

    @property
    def part_id(self) -> str:
        return f"{self.holder}/r{self.round}/p{self.part}"


def plan_visits(infos: list[HolderInfo], *, rounds: int, buffer_bytes: int, val_share: float,
                min_train_bytes: int) -> list[VisitPlan]:
    """Each round covers every holder's training data once, in parts no larger than the buffer."""
    per_holder: list[tuple[HolderInfo, list[tuple[int, int]], int]] = []
    for info in infos:
        unit = UNIT[info.fmt]
        val_cap = int(buffer_bytes * val_share) // unit * unit
        train_cap = (buffer_bytes - val_cap) // unit * unit
        val_len = min(val_cap, info.val_bytes) // unit * unit
        if info.train_bytes < min_train_bytes:
            raise DataError(f"holder {info.name} has {info.train_bytes} training bytes; "
                            f"at least {min_train_bytes} are needed for one batch window")
        if train_cap < min_train_bytes:
            raise DataError(f"a {buffer_bytes}-byte buffer leaves {train_cap} training bytes per visit; "
                            f"at least {min_train_bytes} are needed")
        n_parts = -(-info.train_bytes // train_cap)
        size = -(-info.train_bytes // n_parts)
        size = -(-size // unit) * unit
        parts = []
        for p in range(n_parts):
            start = p * size
            parts.append((start, min(size, info.train_bytes - start)))
        per_holder.append((info, parts, val_len))
    total = rounds * sum(len(parts) for _, parts, _ in per_holder)
    if total > MAX_PLANNED_VISITS:
        raise ConfigError(f"the schedule would hold {total:,} visits ({rounds:,} rounds); the limit is "
                          f"{MAX_PLANNED_VISITS:,}: fewer --rounds or a bigger --buffer-mib")
    plans: list[VisitPlan] = []
    for r in range(rounds):
        for p in range(max(len(parts) for _, parts, _ in per_holder)):
            for info, parts, val_len in per_holder:
                if p < len(parts):
                    start, n = parts[p]
                    plans.append(VisitPlan(len(plans), r, info.name, p, len(parts), start, n, 0, val_len))
    return plans


def plan_digest(plans: list[VisitPlan]) -> str:
    """Names a schedule, so a resumed run can prove it continues the same one."""
    return hashlib.sha256(json.dumps([asdict(p) for p in plans], sort_keys=True).encode()).hexdigest()
