"""The control plane's lease in the SQL store: claim (acquire or renew), release, read, fence.

One row per lease in `control_lease` (migration 0006). `claim_lease` applies `control.lease`'s
rules in one write transaction that is never fenced itself:

- PostgreSQL: the row is read ``SELECT ... FOR UPDATE`` (PostgreSQL 16 docs, §13.3.2 "Row-Level
  Locks"), so two claimers, or a claimer and the leader's in-flight writes (which hold the row
  ``FOR SHARE``, `store.fence`), are serialised; a first insert races through ``INSERT ... ON
  CONFLICT DO NOTHING`` (§ "INSERT": the loser waits for the winner's commit and inserts nothing)
  and is then decided again on the winner's row. Expiry is judged and stamped by the *database
  server's* clock, ``clock_timestamp()`` read after the row lock was granted (§9.9.5 "Current
  Date/Time": it changes during a transaction, unlike ``now()``), so hosts whose clocks disagree
  still agree on when a lease expired. The `now` callers pass is not used there.
- SQLite: write transactions are exclusive (``BEGIN IMMEDIATE``), and a claimer must also hold an
  ``fcntl.flock`` on a lock file next to the database (``<db>.lease``) for as long as it holds the
  lease: while a live leader holds it, nobody else can take over, whatever the wall clocks say; a
  killed leader's lock is released by the kernel (flock(2), Linux). Expiry uses the caller's `now`.

`fence_writes(Fence)` makes every later write of this store check the token (`store.base._write`);
`fence_writes(None)` stops it (a standby's writes are plain records the leader picks up).
Neighbours: `control.leadership` drives it; `store.memory.lease` is its in-memory twin.
Must not: decide who may hold the lease (`control.lease.claim_action` does) or sleep.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import sqlalchemy as sa
from sqlalchemy import Connection
from sqlalchemy.dialects import postgresql

from lowtide.control.lease import (
    LEASE_NAME,
    ClaimAction,
    Fence,
    LeaseCandidate,
    LeaseClaim,
    LeaseRecord,
    claim_action,
    granted_row,
)
from lowtide.control.records import FencedOut
from lowtide.store.base import StoreBase
from lowtide.store.schema import control_lease


class LeaseRepo(StoreBase):
    """See the module docstring."""

    _lease_lock: TextIO | None = None

    # -- claim, release, read ------------------------------------------------------------------

    def claim_lease(
        self, candidate: LeaseCandidate, *, ttl_s: float, now: float, name: str = LEASE_NAME
    ) -> LeaseClaim:
        """Acquire or renew the lease `name` for `candidate` (see `control.lease.claim_action`)."""
        if not self._take_lease_lock():
            row, at = self.lease(now=now, name=name)
            return LeaseClaim(False, row, None, at)
        with self._write(fenced=False) as conn:
            for _ in range(2):  # a second round only when a concurrent first insert won
                row = _lease_row(conn, name, lock=True)
                at = self._store_now(conn, now)
                action = claim_action(row, candidate, at)
                new = granted_row(action, row, candidate, name=name, now=at, ttl_s=ttl_s)
                if new is None:
                    break
                if action == ClaimAction.INSERT:
                    if not self._insert_lease(conn, new):
                        continue
                else:
                    conn.execute(
                        sa.update(control_lease).where(control_lease.c.name == name).values(**_values(new))
                    )
                return LeaseClaim(True, new, row if action == ClaimAction.TAKEOVER else None, at)
            row = _lease_row(conn, name, lock=False)
            at = self._store_now(conn, now)
        # Refused (a failure above keeps the SQLite lock: a leader whose renew failed still leads).
        self._drop_lease_lock()
        return LeaseClaim(False, row, None, at)

    def release_lease(self, holder: str, *, now: float, name: str = LEASE_NAME) -> bool:
        """Let the lease expire now if `holder` holds it (a standby takes over at its next claim);
        whether it did. The token stays: the next holder increments it."""
        try:
            with self._write(fenced=False) as conn:
                at = self._store_now(conn, now)
                done = conn.execute(
                    sa.update(control_lease)
                    .where(control_lease.c.name == name, control_lease.c.holder == holder)
                    .values(expires_at=at)
                ).rowcount
                return bool(done)
        finally:
            self._drop_lease_lock()

    def lease(self, *, now: float, name: str = LEASE_NAME) -> tuple[LeaseRecord | None, float]:
        """The lease row (None: never claimed) and the store's time to judge it by."""
        with self._read() as conn:
            return _lease_row(conn, name, lock=False), self._store_now(conn, now)

    def fence_writes(self, fence: Fence | None, on_fenced: Callable[[FencedOut], None] | None = None) -> None:
        """Check `fence` in every later write transaction (None: stop checking)."""
        self._fence = fence
        self.on_fenced = on_fenced if fence is not None else None

    def close(self) -> None:
        self._drop_lease_lock()
        super().close()

    # -- helpers -------------------------------------------------------------------------------

    def _store_now(self, conn: Connection, now: float) -> float:
        if conn.dialect.name == "postgresql":
            return float(conn.execute(sa.text("SELECT EXTRACT(EPOCH FROM clock_timestamp())")).scalar_one())
        return now

    def _insert_lease(self, conn: Connection, row: LeaseRecord) -> bool:
        """Insert the first lease row; False when a concurrent claimer inserted it first."""
        if conn.dialect.name == "postgresql":
            stmt = postgresql.insert(control_lease).values(**_values(row)).on_conflict_do_nothing()
            return bool(conn.execute(stmt).rowcount)
        conn.execute(sa.insert(control_lease).values(**_values(row)))  # BEGIN IMMEDIATE: no race
        return True

    def _lease_lock_path(self) -> Path | None:
        if self.engine.dialect.name != "sqlite":
            return None
        db = self.engine.url.database
        if not db or db == ":memory:" or db.startswith("file:"):
            return None
        return Path(db).with_name(Path(db).name + ".lease")

    def _take_lease_lock(self) -> bool:
        """Hold the SQLite lease lock file (True: held now, or not needed on this backend)."""
        if self._lease_lock is not None:
            return True
        path = self._lease_lock_path()
        if path is None:
            return True
        fh = path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            return False
        self._lease_lock = fh
        return True

    def _drop_lease_lock(self) -> None:
        fh, self._lease_lock = self._lease_lock, None
        if fh is not None:
            with contextlib.suppress(OSError):
                fh.close()  # closing the last descriptor releases the flock


def _lease_row(conn: Connection, name: str, *, lock: bool) -> LeaseRecord | None:
    query = sa.select(control_lease).where(control_lease.c.name == name)
    row = conn.execute(query.with_for_update() if lock else query).first()
    if row is None:
        return None
    return LeaseRecord(
        name=row.name,
        holder=row.holder,
        host=row.host,
        pid=int(row.pid),
        token=int(row.token),
        acquired_at=float(row.acquired_at),
        renewed_at=float(row.renewed_at),
        expires_at=float(row.expires_at),
    )


def _values(row: LeaseRecord) -> dict[str, Any]:
    return {
        "name": row.name,
        "holder": row.holder,
        "host": row.host,
        "pid": row.pid,
        "token": row.token,
        "acquired_at": row.acquired_at,
        "renewed_at": row.renewed_at,
        "expires_at": row.expires_at,
    }
