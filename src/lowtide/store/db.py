"""Engines and migrations.

SQLite runs in WAL mode with a busy timeout and foreign keys on; write transactions take the
write lock up front (``BEGIN IMMEDIATE``) so that two writers wait for each other instead of
failing on a lock upgrade. PostgreSQL is used as is (READ COMMITTED; state writes are guarded).
Must not: contain queries (see `repo`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event

MIGRATIONS = Path(__file__).parent / "migrations"
READONLY = "lowtide_readonly"


#: How long a writer waits for a lock another connection holds before the write fails as a store
#: outage (SQLite: busy_timeout, "database is locked"; PostgreSQL: lock_timeout, SQLSTATE 55P03).
#: Short, so that an outage is seen (503, /healthz) instead of hanging every request behind it.
SQLITE_BUSY_TIMEOUT_S = 5.0
#: How long a PostgreSQL connection attempt may take (libpq connect_timeout, whole seconds).
PG_CONNECT_TIMEOUT_S = 5


def make_engine(url: str, *, busy_timeout_s: float = SQLITE_BUSY_TIMEOUT_S, **kwargs: Any) -> Engine:
    """An engine for `url`; `busy_timeout_s` bounds the wait for a lock another connection holds
    (SQLite's busy_timeout, PostgreSQL's lock_timeout), after which the statement fails as
    `StoreUnavailable` (`store.errors`)."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": busy_timeout_s}, **kwargs
        )
        _sqlite_setup(engine, busy_timeout_s)
        return engine
    # PostgreSQL 15 docs §20.11 (lock_timeout) and libpq §34.1.2 (connect_timeout): a lock held
    # by someone else or a server that does not answer becomes an error we classify, not a hang.
    lock_ms = max(1, round(busy_timeout_s * 1000))
    connect_args = {"connect_timeout": PG_CONNECT_TIMEOUT_S, "options": f"-c lock_timeout={lock_ms}"}
    return create_engine(
        url, pool_pre_ping=True, pool_size=10, max_overflow=10, connect_args=connect_args, **kwargs
    )


def _sqlite_setup(engine: Engine, busy_timeout_s: float) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={max(0, round(busy_timeout_s * 1000))}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        if conn.get_execution_options().get(READONLY):
            conn.exec_driver_sql("BEGIN")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def migrate(engine: Engine) -> None:
    """Bring the schema up to the newest migration (idempotent)."""
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
