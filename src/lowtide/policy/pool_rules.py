"""The rules of the GPU pool's bookkeeping that every store applies the same way (pure): the
ledger, replicas' GPUs, reclaims' phases, and which records a usage report reads.

Role: which ledger intervals to open and close when the managed GPUs change, which GPUs may be
booked, when a replica's move hands its GPUs back, what a reclaim update may touch, and which
intervals and ended attempts meet a report's period (with their quick per-kind sum).
Neighbours: `store.ledger`, `store.pool_repo`, `store.replicas_repo`, `store.reports_repo` (SQL)
and `store.memory` (in memory) call these and only persist; `policy.accounting` does the report's
arithmetic and names the holder kinds; `domain.states` holds the lifecycles.
Must not: read the clock, do I/O, import the store or SQLAlchemy, or decide who gets a GPU
(`policy.scheduler`, `policy.replicas` and `policy.reclaim` do).

Rules
- The ledger has exactly one open interval per managed GPU. When the managed set changes, every
  managed GPU without an open interval gets an idle one; an idle GPU no longer managed has its
  interval closed; a held one stays open until its holder releases it (then it turns idle and
  the next reconcile closes it).
- Only a GPU whose open interval is idle can be booked; booking the same GPU twice in one request
  is a double booking.
- A GPU changes hands at one instant, never before its open interval began (`handover_at`): an
  end earlier than the start (an exit stamped a moment after the tick that books its GPUs for
  the replacement, a clock that went back across a restart) is clamped to the start, so no
  interval has a negative duration and the intervals of one GPU never overlap.
- A replica holds its GPUs in `GPU_HOLDING_REPLICA_STATES`; a move out of them releases them.
  Starting a replica books its GPUs and moves it to STARTING, or WAKING when it wakes from sleep.
- A reclaim update may record `notice_at`, `freed_at` and `healthy_at`, and end it with `state`.
- An interval [s, e) (open: e = ∞) meets a period [start, end) when s < end and e > start.
- Usage reports count ended attempts that were INTERRUPTED or LOST (preemption candidates).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from lowtide.domain.gpus import GpuRef
from lowtide.domain.states import GPU_HOLDING_REPLICA_STATES, AttemptState, ReplicaState
from lowtide.policy.accounting import IDLE, clip

#: Ended attempts a usage report reads (whether each was a preemption is on the attempt).
REPORTED_ENDED_STATES = frozenset({AttemptState.INTERRUPTED, AttemptState.LOST})
#: The phases of a reclaim that an update may record, besides ending it with `state`.
RECLAIM_PHASES = frozenset({"notice_at", "freed_at", "healthy_at"})


def reconcile_gpus(
    open_kinds: Mapping[GpuRef, str], managed: Iterable[GpuRef]
) -> tuple[list[GpuRef], list[GpuRef]]:
    """(intervals to close, GPUs to open an idle interval for), each sorted.

    `open_kinds`: the holder kind of every GPU's open interval.
    """
    wanted = set(managed)
    close = sorted(g for g, kind in open_kinds.items() if g not in wanted and kind == IDLE)
    missing = sorted(wanted - open_kinds.keys())
    return close, missing


def bookable(open_kind: str | None) -> bool:
    """Whether a GPU whose open interval has this holder kind (None: no open interval) can be booked."""
    return open_kind == IDLE


def handover_at(now: float, open_started_at: float) -> float:
    """When a GPU whose open interval began at `open_started_at` changes hands if asked at `now`:
    `now`, clamped to no earlier than that start (the closed interval may be empty, never negative)."""
    return max(now, open_started_at)


def replica_start_state(wake: bool) -> ReplicaState:
    return ReplicaState.WAKING if wake else ReplicaState.STARTING


def replica_releases_gpus(expected: ReplicaState, target: ReplicaState) -> bool:
    """A move out of the GPU-holding states gives the replica's GPUs back to the pool."""
    return expected in GPU_HOLDING_REPLICA_STATES and target not in GPU_HOLDING_REPLICA_STATES


def check_reclaim_update(fields: Iterable[str]) -> None:
    """Raise ValueError for anything but phases and `state` in a reclaim update."""
    unknown = set(fields) - RECLAIM_PHASES - {"state"}
    if unknown:
        raise ValueError(f"unknown reclaim fields: {sorted(unknown)}")


def meets_period(started_at: float, ended_at: float | None, start: float, end: float) -> bool:
    return started_at < end and (ended_at is None or ended_at > start)


def gpu_seconds_by_kind(
    intervals: Iterable[tuple[str, float, float | None]], start: float, end: float
) -> dict[str, float]:
    """GPU-seconds per holder kind inside [start, end] of (kind, started_at, ended_at) intervals
    (open ones count up to `end`); summed exactly (`math.fsum`), so the order does not matter."""
    parts: dict[str, list[float]] = {}
    for kind, started_at, ended_at in intervals:
        seg = clip(started_at, ended_at, start, end)
        if seg is not None:
            parts.setdefault(kind, []).append(seg[1] - seg[0])
    return {kind: math.fsum(values) for kind, values in parts.items()}
