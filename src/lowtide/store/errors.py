"""Store errors classified at the adapter edge: which database failures mean "try again later".

`unavailable(exc)` turns a SQLAlchemy/DBAPI error that may pass on its own into
`records.StoreUnavailable` (one line naming the cause), and answers None for everything else
(a constraint violation, a bug in a query, a corrupt file: those keep their own exception).
`store.base` applies it in `_read`/`_write`, so every part of the SQL store raises the same
error for an outage, and the control loop and API handle one exception (docs/architecture.md §4.4).

Temporary, on SQLite (https://www.sqlite.org/rescode.html, SQLite 3.x): SQLITE_BUSY "database
is locked" (another connection holds the lock past busy_timeout), SQLITE_LOCKED "database table
is locked", SQLITE_IOERR "disk I/O error", SQLITE_FULL "database or disk is full",
SQLITE_READONLY "attempt to write a readonly database", SQLITE_CANTOPEN "unable to open database
file". On PostgreSQL (Appendix A "PostgreSQL Error Codes", PostgreSQL 16): class 08 (connection
exception), 40001 serialization_failure, 40P01 deadlock_detected, 25006
read_only_sql_transaction (a standby or `default_transaction_read_only`), class 53
(insufficient resources: 53100 disk_full, 53200 out_of_memory, 53300 too_many_connections),
55P03 lock_not_available (`lock_timeout`), 57014 query_canceled (`statement_timeout`), 57P01
admin_shutdown, 57P02 crash_shutdown, 57P03 cannot_connect_now; and any psycopg
OperationalError without a SQLSTATE (connection refused, reset, or closed by the server).
Must not: retry, sleep, or log (the caller decides what an outage means).
"""

from __future__ import annotations

import sqlite3

import sqlalchemy as sa

from lowtide.control.records import StoreUnavailable

_SQLITE_TEMPORARY = (
    "database is locked",
    "database table is locked",
    "disk i/o error",
    "database or disk is full",
    "attempt to write a readonly database",
    "unable to open database file",
)
_PG_TEMPORARY_CODES = frozenset({"40001", "40P01", "25006", "55P03", "57014", "57P01", "57P02", "57P03"})
_PG_TEMPORARY_CLASSES = ("08", "53")


def _sqlstate(orig: BaseException | None) -> str | None:
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return code if isinstance(code, str) else None


def _first_line(exc: BaseException | None) -> str:
    text = str(exc).strip() if exc is not None else ""
    return text.splitlines()[0][:300] if text else type(exc).__name__


def unavailable(exc: BaseException) -> StoreUnavailable | None:
    """`StoreUnavailable` when `exc` is a database failure that may pass if retried, else None."""
    if isinstance(exc, StoreUnavailable):
        return exc
    if isinstance(exc, sa.exc.TimeoutError):  # no pooled connection came free in time
        return StoreUnavailable(f"database connection pool exhausted: {_first_line(exc)}")
    if not isinstance(exc, sa.exc.DBAPIError):
        return None
    orig = exc.orig
    if isinstance(orig, sqlite3.Error):
        message = str(orig).lower()
        if isinstance(orig, sqlite3.OperationalError) and any(m in message for m in _SQLITE_TEMPORARY):
            return StoreUnavailable(f"sqlite: {_first_line(orig)}")
        return None
    code = _sqlstate(orig)
    if exc.connection_invalidated:
        return StoreUnavailable(f"database connection lost: {_first_line(orig)}")
    if code is not None:
        if code in _PG_TEMPORARY_CODES or code.startswith(_PG_TEMPORARY_CLASSES):
            return StoreUnavailable(f"postgresql {code}: {_first_line(orig)}")
        return None
    if isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError):
        return StoreUnavailable(f"database unreachable: {_first_line(orig)}")
    return None
