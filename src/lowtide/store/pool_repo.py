"""The store's GPU pool and accounting: the managed GPUs, who holds them, and totals.

A mixin over `base.StoreBase`, composed into `repo.Store`; the control loop calls `ensure_gpus`
each round, `api` (metrics, usage) reads the rest, `wiring` reads `last_recorded_at` when it starts
acting (the floor of control time, docs/architecture.md §4.3). The ledger itself (one open row per GPU,
guarded booking) is `ledger`; booking and releasing GPUs for attempts happens in `attempts_repo`.
Must not: decide who gets a GPU (policy does) or read the clock (every time is passed in).
"""

from __future__ import annotations

from collections.abc import Iterable

import sqlalchemy as sa

from lowtide.control.records import GpuHolding
from lowtide.domain.gpus import Node
from lowtide.store import ledger
from lowtide.store.base import StoreBase
from lowtide.store.schema import attempts, events, gpu_ledger, jobs, reclaims, steps


class PoolRepo(StoreBase):
    def ensure_gpus(self, nodes: Iterable[Node], now: float) -> None:
        with self._write() as conn:
            ledger.ensure_gpus(conn, [g for n in nodes for g in n.refs()], now)

    def holdings(self) -> list[GpuHolding]:
        with self._read() as conn:
            return ledger.holdings(conn)

    def gpu_seconds_by_holder(self, start: float, end: float) -> dict[str, float]:
        with self._read() as conn:
            return ledger.gpu_seconds_by_holder(conn, start, end)

    def last_recorded_at(self) -> float | None:
        """The latest time the control plane recorded that a restart must not go back before: the
        last GPU handover in the ledger or the last job event, whichever is later (None: neither).
        `SystemClock.not_before` takes it at start-up (docs/architecture.md §4.3)."""
        with self._read() as conn:
            handover = ledger.last_handover(conn)
            event = conn.execute(sa.select(events.c.at).order_by(events.c.id.desc()).limit(1)).scalar()
        times = [float(t) for t in (handover, event) if t is not None]
        return max(times, default=None)

    def counts(self) -> dict[str, dict[str, int]]:
        """Jobs by state, steps by state, GPUs by holder kind, reclaims by state (for /metrics)."""
        with self._read() as conn:
            job_counts = conn.execute(sa.select(jobs.c.state, sa.func.count()).group_by(jobs.c.state)).all()
            step_counts = conn.execute(
                sa.select(steps.c.state, sa.func.count()).group_by(steps.c.state)
            ).all()
            gpu_counts = conn.execute(
                sa.select(gpu_ledger.c.holder_kind, sa.func.count())
                .where(gpu_ledger.c.ended_at.is_(None))
                .group_by(gpu_ledger.c.holder_kind)
            ).all()
            reclaim_counts = conn.execute(
                sa.select(reclaims.c.state, sa.func.count()).group_by(reclaims.c.state)
            ).all()
        return {
            "jobs": {s: int(n) for s, n in job_counts},
            "steps": {s: int(n) for s, n in step_counts},
            "gpus": {k: int(n) for k, n in gpu_counts},
            "reclaims": {s: int(n) for s, n in reclaim_counts},
        }

    def preemption_totals(self) -> tuple[int, float]:
        """All-time preemptions recorded on steps, and the GPU-seconds of work they lost."""
        with self._read() as conn:
            count = conn.execute(
                sa.select(sa.func.coalesce(sa.func.sum(steps.c.preemptions), 0))
            ).scalar_one()
            lost = conn.execute(
                sa.select(sa.func.coalesce(sa.func.sum(attempts.c.lost_gpu_seconds), 0.0))
            ).scalar_one()
        return int(count), float(lost)
