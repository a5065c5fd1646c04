"""The store's usage reports: the ledger rows and ended attempts of a period, summed by policy.

A mixin over `base.StoreBase`, composed into `repo.Store`; `api.reports` calls `usage_report`.
It reads, in one read transaction, every `gpu_ledger` row that meets [start, end) (with its job's
name) and every attempt that ended in [start, end) interrupted or lost (the candidates for
preemption, with `lost_gpu_seconds`), and hands them to `policy.accounting.usage_report`, which
does all the arithmetic (clipping, days in a time zone, preemption vs cancellation, savings).
Which rows meet the period and which ended attempts count is `policy.pool_rules` (as a query here),
shared with `store.memory`. Neighbours: `ledger` writes the rows, `pool_repo.gpu_seconds_by_holder`
is the quick per-kind sum.
Must not: compute anything itself, write, or read the clock (the period is passed in).
"""

from __future__ import annotations

import sqlalchemy as sa

from lowtide.domain.states import AttemptState
from lowtide.policy.accounting import (
    AccountingPolicy,
    EndedAttempt,
    GroupBy,
    LedgerInterval,
    UsageReport,
    usage_report,
)
from lowtide.policy.pool_rules import REPORTED_ENDED_STATES
from lowtide.store.base import StoreBase
from lowtide.store.schema import attempts, gpu_ledger, jobs

_ENDED_STOPPED = [s.value for s in sorted(REPORTED_ENDED_STATES)]


class ReportsRepo(StoreBase):
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
        with self._read() as conn:
            ledger_rows = conn.execute(
                sa.select(
                    gpu_ledger.c.holder_kind,
                    gpu_ledger.c.holder_id,
                    gpu_ledger.c.job_id,
                    gpu_ledger.c.team,
                    gpu_ledger.c.started_at,
                    gpu_ledger.c.ended_at,
                    jobs.c.name.label("job_name"),
                )
                .select_from(gpu_ledger.outerjoin(jobs, jobs.c.id == gpu_ledger.c.job_id))
                .where(
                    gpu_ledger.c.started_at < end,
                    sa.or_(gpu_ledger.c.ended_at.is_(None), gpu_ledger.c.ended_at > start),
                )
            ).all()
            ended_rows = conn.execute(
                sa.select(
                    attempts.c.id,
                    attempts.c.job_id,
                    attempts.c.state,
                    attempts.c.preempted,
                    attempts.c.ended_at,
                    attempts.c.lost_gpu_seconds,
                    jobs.c.name.label("job_name"),
                    jobs.c.team,
                )
                .select_from(attempts.join(jobs, jobs.c.id == attempts.c.job_id))
                .where(
                    attempts.c.ended_at >= start,
                    attempts.c.ended_at < end,
                    attempts.c.state.in_(_ENDED_STOPPED),
                )
            ).all()
        intervals = [
            LedgerInterval(
                holder_kind=r.holder_kind,
                holder_id=r.holder_id,
                job_id=r.job_id,
                job_name=r.job_name,
                team=r.team,
                started_at=r.started_at,
                ended_at=r.ended_at,
            )
            for r in ledger_rows
        ]
        ended = [
            EndedAttempt(
                attempt_id=r.id,
                job_id=r.job_id,
                job_name=r.job_name,
                team=r.team,
                state=AttemptState(r.state),
                preempted=bool(r.preempted),
                ended_at=r.ended_at,
                lost_gpu_seconds=r.lost_gpu_seconds or 0.0,
            )
            for r in ended_rows
        ]
        return usage_report(intervals, ended, start=start, end=end, group_by=group_by, policy=policy)
