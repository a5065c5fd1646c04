"""The in-memory store's lending envelope history, as `store.lending_repo` keeps it.

Points are kept sorted by (at, order written), so a span's points are found by bisection and the
points past retention are a prefix. The write checks the leader's fence first, as the SQL store's
write transaction does (`store.fence`). Must not: decide when to record, read the clock, or do I/O.
"""

from __future__ import annotations

import bisect

from lowtide.policy.lending_history import KEEP_S, LendingPoint, keep_after
from lowtide.store.memory.base import MemoryBase


class LendingPart(MemoryBase):
    def record_lending(self, point: LendingPoint, *, keep_s: float = KEEP_S) -> None:
        with self._lock:
            self._check_fence()
            rows = self._lending
            cutoff = bisect.bisect_left(rows, keep_after(point.at, keep_s=keep_s), key=lambda r: r[0][0])
            del rows[:cutoff]
            bisect.insort(rows, ((point.at, next(self._lending_seq)), point), key=lambda r: r[0])

    def lending_points(self, start: float, end: float) -> list[LendingPoint]:
        with self._lock:
            rows = self._lending
            lo = bisect.bisect_left(rows, start, key=lambda r: r[0][0])
            hi = bisect.bisect_left(rows, end, key=lambda r: r[0][0])
            first = max(lo - 1, 0)
            return [p for _, p in rows[first : max(hi, lo)]]
