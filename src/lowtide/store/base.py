"""The shared base of the store's parts: one engine, one transaction per call.

`StoreBase` holds the engine (`open`/`close`), the transaction helpers every part uses
(`_read()`: a read-only transaction; `_write()`: a write transaction, queued on an in-process lock
on SQLite) and `instance_id`; `insert_event` appends to a job's event log inside a caller's
transaction. Neighbours: `db` makes the engine and migrates it; the mixins `jobs_repo`,
`pool_repo`, `attempts_repo` and `tokens_repo` subclass `StoreBase`, and `repo.Store` composes them.
Must not: hold queries of a single part (they live in that part), decide anything, or read the
clock (every time is passed in).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Self

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from lowtide.store.db import READONLY, make_engine, migrate
from lowtide.store.schema import events, meta


class StoreBase:
    """The engine and the transaction helpers; the parts of `repo.Store` subclass this."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # SQLite has one writer at a time, and a writer that finds the lock taken polls for it
        # with growing sleeps (up to 100 ms each) until busy_timeout; this process's writers
        # queue on a mutex instead, so the next one starts the moment the lock is free.
        self._write_lock: contextlib.AbstractContextManager[Any] = (
            threading.RLock() if engine.dialect.name == "sqlite" else contextlib.nullcontext()
        )

    @classmethod
    def open(cls, url: str, *, migrate_schema: bool = True) -> Self:
        engine = make_engine(url)
        if migrate_schema:
            migrate(engine)
        return cls(engine)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        with self._write_lock, self.engine.begin() as conn:
            yield conn

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self.engine.connect().execution_options(**{READONLY: True}) as conn, conn.begin():
            yield conn

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
