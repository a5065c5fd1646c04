"""The in-memory store's finished jobs not yet ended by the executor, as `store.job_end_repo`.

The jobs come from an index (`base.MemoryBase._unended`, kept by every job move), so the loop's
per-tick read costs what it returns, not the job history. The write checks the leader's fence
first, as the SQL store's write transaction does (`store.fence`), and marks only finished,
unmarked jobs. Must not: call the executor, decide anything, or read the clock.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from lowtide.domain.states import TERMINAL_JOB_STATES
from lowtide.store.memory.base import MemoryBase


class JobEndPart(MemoryBase):
    def jobs_to_end(self, *, after: str | None = None, limit: int = 100) -> list[str]:
        """Ids of finished jobs not yet marked ended by the executor, in id order, after `after`
        (None: from the first), at most `limit` (a negative `limit`: no limit, as SQLite reads it)."""
        with self._lock:
            rows = self._unended.values()
            first = 0 if after is None else bisect.bisect_right(rows, after, key=lambda j: j.id)
            last = len(rows) if limit < 0 else first + limit
            return [j.id for j in rows[first:last]]

    def mark_jobs_ended(self, job_ids: Sequence[str], *, at: float) -> int:
        """Record that the executor took the end of these jobs; only jobs still finished and not
        yet marked are (unknown ids are skipped). Returns how many were marked."""
        with self._lock:
            self._check_fence()
            marked = 0
            for job_id in dict.fromkeys(job_ids):
                job = self._jobs.get(job_id)
                if job is None or job.state not in TERMINAL_JOB_STATES or job.executor_ended_at is not None:
                    continue
                job.executor_ended_at = at
                self._refresh_job(job)
                marked += 1
            return marked
