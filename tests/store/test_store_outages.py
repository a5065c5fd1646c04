"""Store outages classified at the adapter edge (docs/architecture.md §4.4): a real SQLite lock
held by another connection and a PostgreSQL backend terminated mid-transaction both surface as
`StoreUnavailable`, are recorded in `store.health`, and clear when the store works again; errors
that will not pass by themselves keep their own exception."""

from __future__ import annotations

import secrets
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from storekit import submit

from lowtide.control.clock import FakeClock
from lowtide.control.records import StoreUnavailable
from lowtide.control.store_health import StoreHealth
from lowtide.store.errors import unavailable
from lowtide.store.repo import Store


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    store = Store.open(f"sqlite:///{tmp_path / 'lowtide.db'}", busy_timeout_s=0.1)
    yield store
    store.close()


def _wrapped(orig: Exception, cls: type[sa.exc.DBAPIError] = sa.exc.OperationalError) -> sa.exc.DBAPIError:
    return cls("INSERT ...", {}, orig)


@pytest.mark.parametrize(
    "message",
    [
        "database is locked",
        "disk I/O error",
        "database or disk is full",
        "attempt to write a readonly database",
        "unable to open database file",
    ],
)
def test_sqlite_failures_that_may_pass_are_unavailable(message: str) -> None:
    found = unavailable(_wrapped(sqlite3.OperationalError(message)))
    assert isinstance(found, StoreUnavailable) and message in found.reason


def test_errors_that_will_not_pass_keep_their_exception() -> None:
    assert (
        unavailable(_wrapped(sqlite3.IntegrityError("UNIQUE constraint failed"), sa.exc.IntegrityError))
        is None
    )
    assert unavailable(_wrapped(sqlite3.OperationalError("no such table: jobs"))) is None
    assert (
        unavailable(_wrapped(sqlite3.DatabaseError("database disk image is malformed"), sa.exc.DatabaseError))
        is None
    )
    assert unavailable(ValueError("a bug")) is None


class _PgError(Exception):
    def __init__(self, sqlstate: str | None) -> None:
        super().__init__(f"pg error {sqlstate}")
        self.sqlstate = sqlstate


@pytest.mark.parametrize("code", ["08006", "57P01", "53100", "55P03", "40001", "25006"])
def test_postgresql_codes_that_may_pass_are_unavailable(code: str) -> None:
    assert isinstance(unavailable(_wrapped(_PgError(code))), StoreUnavailable)


def test_postgresql_errors_of_the_request_keep_their_exception() -> None:
    assert unavailable(_wrapped(_PgError("23505"), sa.exc.IntegrityError)) is None  # unique_violation
    assert unavailable(_wrapped(_PgError("42P01"), sa.exc.ProgrammingError)) is None  # undefined_table
    assert isinstance(unavailable(_wrapped(_PgError(None))), StoreUnavailable)  # connection refused


def test_a_sqlite_lock_held_elsewhere_is_an_outage_until_released(
    sqlite_store: Store, tmp_path: Path
) -> None:
    clock = FakeClock()
    sqlite_store.health = StoreHealth(clock)
    submit(sqlite_store, clock, "job-000000000001")
    other = sqlite3.connect(tmp_path / "lowtide.db", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreUnavailable, match="database is locked"):
            submit(sqlite_store, clock, "job-000000000002")
        clock.advance(5)
        with pytest.raises(StoreUnavailable):
            submit(sqlite_store, clock, "job-000000000002")
        assert sqlite_store.job("job-000000000001").id  # WAL: readers go on
        outage = sqlite_store.health.outage()
        assert outage is not None and outage.access == "write" and outage.failures == 2
        assert sqlite_store.health.unhealthy(4.0) is outage  # a read that works hides nothing
        assert sqlite_store.health.unhealthy(10.0) is None
    finally:
        other.execute("ROLLBACK")
        other.close()
    submit(sqlite_store, clock, "job-000000000002")
    assert sqlite_store.health.outage() is None
    assert sqlite_store.health.unhealthy(0.0) is None


@pytest.mark.postgres
def test_a_terminated_postgresql_backend_is_an_outage(pg_database_url: str) -> None:
    store = Store.open(pg_database_url)
    admin = sa.create_engine(pg_database_url, isolation_level="AUTOCOMMIT")
    try:
        with pytest.raises(StoreUnavailable, match=r"postgresql|connection"), store._write() as conn:
            pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar()
            with admin.connect() as a:
                a.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            conn.execute(sa.text("SELECT 1"))
        assert store.health.outage() is not None
        assert store.counts()["jobs"] is not None  # the pool replaces the dead connection
        assert store.health.outage() is not None  # a read does not prove writes work
        # The session's database is shared by the tests of this worker: an id of its own.
        submit(store, FakeClock(), f"job-{secrets.token_hex(6)}")
        assert store.health.outage() is None
    finally:
        admin.dispose()
        store.close()


def test_an_outage_starts_when_the_failed_transaction_began_not_when_it_gave_up() -> None:
    """A SQLite write waits out the busy timeout before it fails: the store has been failing
    since the write began, so /healthz's bound counts from then (a 40 s outage with a 5 s busy
    timeout turns /healthz 503 at 30 s, not 35 s)."""
    clock = FakeClock(start=1_000.0)
    health = StoreHealth(clock)
    began = clock.now()
    clock.advance(5.0)  # the busy timeout
    assert health.failed("write", "sqlite: database is locked", started=began)
    outage = health.outage()
    assert outage is not None and outage.since == began
    assert outage.since_wall == clock.wall() - 5.0
    clock.advance(25.5)
    assert health.unhealthy(30.0) is outage
    # A later failure keeps the outage's start.
    assert not health.failed("write", "again", started=clock.now())
    later = health.outage()
    assert later is not None and later.since == began and later.failures == 2
    # A start after now (a clock that moved under it) is taken as now.
    assert health.failed("read", "reads fail too", started=clock.now() + 9.0)
    assert health.succeeded("write") is not None and health.outage() is None
