"""The in-memory store's GPU pool, accounting and usage reports.

The counterpart of `store.pool_repo` and `store.reports_repo`: the managed GPUs (`ensure_gpus`,
through `ledger.Ledger`), who holds them, per-kind GPU-seconds, the counts `/metrics` shows,
preemption totals, and `usage_report`, which hands the ledger intervals meeting the period and
the attempts that ended in it to `policy.accounting.usage_report` exactly as the SQL store does.
`counts` and `preemption_totals` read running counters, not the history.
Neighbours: `base.MemoryBase` (state), `attempts` (books and releases GPUs for attempts),
`inference` (for replicas). Must not: compute a figure itself (policy does) or read the clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from lowtide.control.records import GpuHolding
from lowtide.domain.gpus import Node
from lowtide.policy.accounting import (
    ATTEMPT,
    AccountingPolicy,
    EndedAttempt,
    GroupBy,
    LedgerInterval,
    UsageReport,
    usage_report,
)
from lowtide.policy.pool_rules import gpu_seconds_by_kind
from lowtide.store.memory.base import MemoryBase


class PoolPart(MemoryBase):
    def ensure_gpus(self, nodes: Iterable[Node], now: float) -> None:
        with self._lock:
            self._ledger.ensure([g for n in nodes for g in n.refs()], now)

    def last_recorded_at(self) -> float | None:
        """The later of the last GPU handover and the last job event (`store.pool_repo`)."""
        with self._lock:
            times = [evs[-1].at for evs in self._events.values() if evs]
            handover = self._ledger.last_handover()
            if handover is not None:
                times.append(handover)
            return max(times, default=None)

    def holdings(self) -> list[GpuHolding]:
        """Who holds each GPU now, by node and index, with the step name for attempt holders."""
        with self._lock:
            out = []
            for iv in self._ledger.current():
                step = None
                if iv.holder_kind == ATTEMPT and iv.holder_id is not None:
                    att = self._attempts.get(int(iv.holder_id))
                    step = None if att is None else att.step_name
                out.append(
                    GpuHolding(
                        node=iv.gpu.node,
                        index=iv.gpu.index,
                        holder_kind=iv.holder_kind,
                        holder_id=iv.holder_id,
                        job_id=iv.job_id,
                        step=step,
                        team=iv.team,
                        since=iv.started_at,
                    )
                )
            return out

    def gpu_seconds_by_holder(self, start: float, end: float) -> dict[str, float]:
        with self._lock:
            rows = [(iv.holder_kind, iv.started_at, iv.ended_at) for iv in self._ledger.meeting(start, end)]
        return gpu_seconds_by_kind(rows, start, end)

    def counts(self) -> dict[str, dict[str, int]]:
        """Jobs by state, steps by state, GPUs by holder kind, reclaims by state (for /metrics)."""
        with self._lock:
            gpus: dict[str, int] = {}
            for iv in self._ledger.open.values():
                gpus[iv.holder_kind] = gpus.get(iv.holder_kind, 0) + 1
            return {
                "jobs": dict(sorted(self._job_counts.items())),
                "steps": dict(sorted(self._step_counts.items())),
                "gpus": dict(sorted(gpus.items())),
                "reclaims": dict(sorted(self._reclaim_counts.items())),
            }

    def preemption_totals(self) -> tuple[int, float]:
        """All-time preemptions recorded on steps, and the GPU-seconds of work they lost."""
        with self._lock:
            return self._preemptions, math.fsum(self._lost)

    def usage_report(
        self,
        start: float,
        end: float,
        *,
        group_by: GroupBy = "job",
        tz: str = "UTC",
        price_per_gpu_hour: float = 0.0,
        currency: str = "USD",
    ) -> UsageReport:
        """GPU usage of [start, end) from the ledger (see `policy.accounting` for every figure).
        Raises ValueError for an empty period, an unknown grouping or time zone."""
        policy = AccountingPolicy(price_per_gpu_hour=price_per_gpu_hour, currency=currency, timezone=tz)
        with self._lock:
            intervals = [
                LedgerInterval(
                    holder_kind=iv.holder_kind,
                    holder_id=iv.holder_id,
                    job_id=iv.job_id,
                    job_name=self._job_name(iv.job_id),
                    team=iv.team,
                    started_at=iv.started_at,
                    ended_at=iv.ended_at,
                )
                for iv in self._ledger.meeting(start, end)
            ]
            ended = [
                EndedAttempt(
                    attempt_id=a.id,
                    job_id=a.job_id,
                    job_name=a.job.name,
                    team=a.job.team,
                    state=a.state,
                    preempted=a.preempted,
                    ended_at=a.ended_at,
                    lost_gpu_seconds=a.lost_gpu_seconds or 0.0,
                )
                for a in self._reported_ended
                if a.ended_at is not None and start <= a.ended_at < end
            ]
        return usage_report(intervals, ended, start=start, end=end, group_by=group_by, policy=policy)

    def _job_name(self, job_id: str | None) -> str | None:
        job = None if job_id is None else self._jobs.get(job_id)
        return None if job is None else job.name
