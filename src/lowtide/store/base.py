"""The shared base of the store's parts: one engine, one transaction per call.

`StoreBase` holds the engine (`open`/`close`), the transaction helpers every part uses
(`_read()`: a read-only transaction; `_write()`: a write transaction, queued on an in-process lock
on SQLite, that first checks a leader's fencing token, `store.fence`) and `instance_id`. Both
helpers classify failures at this edge: one that may pass (a lock, a full disk, a lost
connection; `store.errors`) is raised as `records.StoreUnavailable`, logged once per outage, and
recorded in `health` (`control.store_health`), which the loop and the API read
(docs/architecture.md §4.4); `insert_event` appends to a job's event log inside a caller's
transaction. Neighbours: `db` makes the engine and migrates it; the mixins `jobs_repo`,
`pool_repo`, `attempts_repo` and `tokens_repo` subclass `StoreBase`, and `repo.Store` composes them.
Must not: hold queries of a single part (they live in that part), decide anything, or read the
clock (every time is passed in).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Self

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from lowtide.control.lease import Fence
from lowtide.control.records import FencedOut, StoreUnavailable
from lowtide.control.store_health import Access, StoreHealth
from lowtide.store.db import READONLY, SQLITE_BUSY_TIMEOUT_S, make_engine, migrate
from lowtide.store.errors import unavailable
from lowtide.store.fence import check_fence
from lowtide.store.schema import events, meta

log = logging.getLogger("lowtide.store")

#: During an outage, how long a write waits for this process's turn before it fails (seconds).
OUTAGE_QUEUE_WAIT_S = 0.5


class StoreBase:
    """The engine and the transaction helpers; the parts of `repo.Store` subclass this."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # SQLite has one writer at a time, and a writer that finds the lock taken polls for it
        # with growing sleeps (up to 100 ms each) until busy_timeout; this process's writers
        # queue on a mutex instead, so the next one starts the moment the lock is free.
        self._write_lock: threading.RLock | None = (
            threading.RLock() if engine.dialect.name == "sqlite" else None
        )
        #: How long a write waits for this process's turn (`open` sets the busy timeout).
        self.lock_wait_s = SQLITE_BUSY_TIMEOUT_S
        #: Outages seen by this process (wiring replaces it with one on the shared clock).
        self.health = StoreHealth()
        #: The leader's fencing token, checked by every write (`lease_repo.fence_writes`).
        self._fence: Fence | None = None
        self.on_fenced: Callable[[FencedOut], None] | None = None

    @classmethod
    def open(
        cls, url: str, *, migrate_schema: bool = True, busy_timeout_s: float = SQLITE_BUSY_TIMEOUT_S
    ) -> Self:
        engine = make_engine(url, busy_timeout_s=busy_timeout_s)
        if migrate_schema:
            migrate(engine)
        store = cls(engine)
        store.lock_wait_s = busy_timeout_s
        return store

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _write(self, *, fenced: bool = True) -> Iterator[Connection]:
        with self._classified("write"), self._queued(), self.engine.begin() as conn:
            if fenced and self._fence is not None:  # a leader's writes carry its token (store.fence)
                check_fence(conn, self._fence, self.on_fenced)
            yield conn

    @contextmanager
    def _queued(self) -> Iterator[None]:
        """This process's turn to write (SQLite). The wait is bounded like the database's own
        lock wait, and during an outage to `OUTAGE_QUEUE_WAIT_S`: writers queued behind one that
        waits out a held lock would otherwise each wait their own busy timeout in turn (an API
        request would hang for many of them instead of answering 503)."""
        lock = self._write_lock
        if lock is None:  # PostgreSQL: writers do not queue here
            yield
            return
        wait_s = OUTAGE_QUEUE_WAIT_S if self.health.outage() is not None else self.lock_wait_s
        if not lock.acquire(timeout=wait_s):
            raise StoreUnavailable(
                f"sqlite: the database is locked (another write of this process has waited for it "
                f"for {wait_s:g}s)"
            )
        try:
            yield
        finally:
            lock.release()

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with (
            self._classified("read"),
            self.engine.connect().execution_options(**{READONLY: True}) as conn,
            conn.begin(),
        ):
            yield conn

    @contextmanager
    def _classified(self, access: Access) -> Iterator[None]:
        """Raise a failure that may pass as `StoreUnavailable` and keep `health` up to date."""
        started = self.health.clock.now()
        try:
            yield
        except Exception as exc:
            outage = unavailable(exc)
            if outage is None:  # the database answered (a constraint, a stale row, a bug)
                self.health.succeeded(access)
                raise
            if self.health.failed(access, outage.reason, started=started):
                log.error("store %s failed: %s; retrying until it works again", access, outage.reason)
            if outage is exc:
                raise
            raise outage from exc
        ended = self.health.succeeded(access)
        if ended is not None:
            log.warning(
                "store %s works again after %.1fs (%d failures): %s",
                access,
                ended.age(self.health.clock.now()),
                ended.failures,
                ended.reason,
            )

    # -- meta ----------------------------------------------------------------------------------

    def instance_id(self) -> str:
        """A stable id of this installation (names its processes, so restarts find their own)."""
        with self._write() as conn:
            value = conn.execute(sa.select(meta.c.value).where(meta.c.key == "instance_id")).scalar()
            if value is None:
                value = secrets.token_hex(6)
                conn.execute(sa.insert(meta).values(key="instance_id", value=value))
            return str(value)


def insert_event(
    conn: Connection,
    job_id: str,
    step: str | None,
    attempt_id: int | None,
    at: float,
    kind: str,
    message: str,
) -> None:
    conn.execute(
        sa.insert(events).values(
            job_id=job_id, step_name=step, attempt_id=attempt_id, at=at, kind=kind, message=message
        )
    )
