"""The lending envelope's history in the store: the `lending_history` table.

Role: keep the `policy.lending_history.LendingPoint`s the inference controller records, drop
those older than `policy.lending_history.KEEP_S` in the same transaction as a new point, and read
the points that cover a span of time (the dashboard's timeline). The write is a leader's write,
fenced like every controller write (`store.fence`, through `StoreBase._write`).
`store.memory.lending` has the same methods over a list. Neighbours: `store.repo.Store` composes
it; `control.inference` writes, `api.dashboard` reads. Must not: decide when to record (policy
does) or read the clock (every time is passed in).
"""

from __future__ import annotations

import sqlalchemy as sa

from lowtide.policy.lending_history import KEEP_S, LendingPoint, keep_after
from lowtide.store.base import StoreBase
from lowtide.store.schema import lending_history


class LendingRepo(StoreBase):
    def record_lending(self, point: LendingPoint, *, keep_s: float = KEEP_S) -> None:
        """Add `point`, deleting the points older than `keep_s` before it."""
        with self._write() as conn:
            conn.execute(
                sa.delete(lending_history).where(lending_history.c.at < keep_after(point.at, keep_s=keep_s))
            )
            conn.execute(
                sa.insert(lending_history).values(
                    at=point.at, lendable_gpus=point.lendable_gpus, mode=point.mode
                )
            )

    def lending_points(self, start: float, end: float) -> list[LendingPoint]:
        """The points with start ≤ at < end, after the last point before `start` (the one in
        force at `start`, if any), by time (equal times in the order written)."""
        t = lending_history
        order = (t.c.at, t.c.id)
        with self._read() as conn:
            before = conn.execute(
                sa.select(t).where(t.c.at < start).order_by(t.c.at.desc(), t.c.id.desc()).limit(1)
            ).all()
            inside = conn.execute(sa.select(t).where(t.c.at >= start, t.c.at < end).order_by(*order)).all()
        return [LendingPoint(float(r.at), int(r.lendable_gpus), str(r.mode)) for r in [*before, *inside]]
