"""Which finished jobs the executor has not yet been told about (`jobs.executor_ended_at`, 0009).

Role: the durable half of "a job will start nothing more" (docs/cluster.md of that name). A job
that reached SUCCEEDED, FAILED or CANCELLED, by whatever path (the DAG, a cancel through the API
while none of its steps held GPUs, a takeover by another leader), is listed by `jobs_to_end` until
the control loop has called `Executor.end_job` for it and recorded that with `mark_jobs_ended`;
so a restart or a new leader still ends it. A retry reopens a job and clears its mark
(`jobs_repo.retry_job`): it is ended again when it finishes again.
Reads use the partial index `ix_jobs_executor_unended` (its predicate repeated verbatim, as
SQLite's planner requires, and named to SQLite: `_to_end_query`); the write is a leader's write,
fenced like the loop's others (`store.fence`, through `StoreBase._write`), and guarded: only
finished, unmarked jobs are marked.
`store.memory.job_end` has the same methods. Neighbours: `repo.Store` composes it; the loop
calls it through `control.ports.StorePort`.
Must not: call the executor, decide anything, or read the clock (every time is passed in).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from lowtide.domain.states import TERMINAL_JOB_STATES
from lowtide.store.base import StoreBase
from lowtide.store.schema import UNENDED_PREDICATE, jobs

_FINISHED = sorted(s.value for s in TERMINAL_JOB_STATES)
UNENDED_INDEX = "ix_jobs_executor_unended"


class JobEndRepo(StoreBase):
    def jobs_to_end(self, *, after: str | None = None, limit: int = 100) -> list[str]:
        """Ids of finished jobs not yet marked ended by the executor, in id order, after `after`
        (None: from the first), at most `limit`."""
        with self._read() as conn:
            return [str(r) for r in conn.execute(_to_end_query(conn.dialect.name, after, limit)).scalars()]

    def mark_jobs_ended(self, job_ids: Sequence[str], *, at: float) -> int:
        """Record that the executor took the end of these jobs; only jobs still finished and not
        yet marked are (a job retried meanwhile is not). Returns how many were marked."""
        if not job_ids:
            return 0
        with self._write() as conn:
            result = conn.execute(
                sa.update(jobs)
                .where(
                    jobs.c.id.in_(list(job_ids)),
                    jobs.c.executor_ended_at.is_(None),
                    jobs.c.state.in_(_FINISHED),
                )
                .values(executor_ended_at=at)
            )
            return int(result.rowcount)


def _to_end_query(dialect: str, after: str | None, limit: int) -> sa.Select[Any]:
    """The query of `jobs_to_end`. SQLite's planner, without statistics, prefers the full
    `ix_jobs_state` (every finished job of the history) to the partial index, so it is told
    (``INDEXED BY``: SQLite docs, "The INDEXED BY Clause": an error rather than a scan if the
    index cannot serve the query). PostgreSQL chooses by its statistics; the partial index holds
    only the unended rows."""
    hint = f" INDEXED BY {UNENDED_INDEX}" if dialect == "sqlite" else ""
    job_id, state = sa.column("id", sa.String), sa.column("state", sa.String)
    q = (
        sa.select(job_id)
        .select_from(sa.text(f"jobs{hint}"))
        .where(sa.text(UNENDED_PREDICATE), state.in_(_FINISHED))
        .order_by(job_id)
        .limit(limit)
    )
    return q if after is None else q.where(job_id > after)
