"""The lending envelope's history: its points, when the inference controller records one, and how
long they are kept (pure; docs/architecture.md §12).

Why it is needed: the envelope (`policy.lending.envelope`) is worked out afresh at every tick and
kept nowhere, so the dashboard's timeline could not tell GPUs that were lendable and unused (lent,
idle) from GPUs inference kept back (its claim and reserve: free). The inference controller, the
one writer, records `(at, lendable_gpus, mode)` when the lendable count or the mode changes, and
at least every `RECORD_EVERY_S` while it stays the same (so a long steady span has points inside
it, and the cost stays a few hundred rows a day, also in the simulator). The store keeps
`KEEP_S` of them (older rows are deleted when a point is written).
A point holds from its `at` until the next point; before the first point nothing is known.
Neighbours: `control.inference` (asks `record_due` each tick and writes through the store),
`store.lending_repo` / `store.memory.lending` (keep the points), `policy.timeline` (weighs them
over a bucket). Must not: read the clock (`now` is passed), do I/O, or decide the envelope itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: A point is recorded at least this often while the envelope does not change (seconds).
RECORD_EVERY_S = 600.0
#: How long points are kept (seconds): the timeline shows 24 h, so 48 h leaves room.
KEEP_S = 48 * 3600.0
#: The longest mode name the store holds (its column is String(16)).
MAX_MODE_LENGTH = 16


@dataclass(frozen=True, slots=True)
class LendingPoint:
    """From `at` on, research could hold at most `lendable_gpus` GPUs, under lending `mode`."""

    at: float
    lendable_gpus: int
    mode: str

    def __post_init__(self) -> None:
        if not math.isfinite(self.at):
            raise ValueError(f"lending point: at must be a finite time, not {self.at!r}")
        if isinstance(self.lendable_gpus, bool) or not isinstance(self.lendable_gpus, int):
            raise ValueError(f"lending point: lendable_gpus must be an integer, not {self.lendable_gpus!r}")
        if self.lendable_gpus < 0:
            raise ValueError(f"lending point: lendable_gpus cannot be negative ({self.lendable_gpus})")
        if not self.mode or len(self.mode) > MAX_MODE_LENGTH:
            raise ValueError(f"lending point: mode must be 1..{MAX_MODE_LENGTH} characters: {self.mode!r}")


def record_due(
    last: LendingPoint | None,
    lendable_gpus: int,
    mode: str,
    *,
    now: float,
    every_s: float = RECORD_EVERY_S,
) -> bool:
    """Whether the envelope seen at `now` is to be recorded, `last` being the point recorded
    last (None: none yet, e.g. after a restart): yes when the count or the mode differs, or when
    `every_s` has passed since `last` (a clock that went back waits until it passes `last` again)."""
    if last is None or lendable_gpus != last.lendable_gpus or mode != last.mode:
        return True
    return now - last.at >= every_s


def keep_after(now: float, *, keep_s: float = KEEP_S) -> float:
    """Points older than this are deleted when a point is written at `now`."""
    return now - keep_s
