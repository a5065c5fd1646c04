"""Shared fixtures: stores on SQLite, on the real PostgreSQL server and in memory, a fake clock,
service gates.

`store_url`/`store` run a test on all three backends ("memory://" is `store.memory.MemoryStore`);
`sql_store_url`/`sql_store` only on the SQL ones, for tests of SQL itself (migrations, raw rows);
`new_store` makes fresh empty stores of the `store_url` backend (one per hypothesis example).
`open_store(url)` opens either kind.

Tests that need a service (PostgreSQL, a local S3 server, ...) call `require_service`; with
``LOWTIDE_REQUIRE_SERVICES=1`` (set by CI) a missing service fails the test instead of skipping.
PostgreSQL: ``LOWTIDE_TEST_PG_URL`` (default postgresql+psycopg://postgres@127.0.0.1:5432/test);
each test session creates its own database there and drops it at the end.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from lowtide.control.clock import FakeClock
from lowtide.store.memory import URL_SCHEME, MemoryStore
from lowtide.store.repo import Store

# The CLI's consoles read $COLUMNS when `lowtide.cli` is imported; pytest-xdist workers set it to
# 80, which cuts ids and headers out of the tables the CLI tests read. Tests want wide tables.
os.environ["COLUMNS"] = "200"

PG_ADMIN_URL = os.environ.get("LOWTIDE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REQUIRE_SERVICES = os.environ.get("LOWTIDE_REQUIRE_SERVICES") == "1"
REPO = Path(__file__).resolve().parents[1]


def require_service(name: str, problem: str) -> None:
    message = f"service unavailable: {name}: {problem}"
    if REQUIRE_SERVICES:
        pytest.fail(message + " (LOWTIDE_REQUIRE_SERVICES=1: services must run)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def pg_database_url() -> Iterator[str]:
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"lowtide_test_{secrets.token_hex(4)}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError as exc:
        admin.dispose()
        require_service("postgresql", str(exc).splitlines()[0])
    url = admin.url.set(database=name).render_as_string(hide_password=False)
    yield url
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _fresh_pg(url: str) -> None:
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text("DROP SCHEMA public CASCADE"))
        conn.execute(sa.text("CREATE SCHEMA public"))
    engine.dispose()


SQL_BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
BACKENDS = [*SQL_BACKENDS, "memory"]


def _url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return URL_SCHEME
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'lowtide.db'}"
    url: str = request.getfixturevalue("pg_database_url")
    _fresh_pg(url)
    return url


def open_store(url: str) -> Store:
    """A store at `url`: the SQL store, or a new, empty `MemoryStore` for "memory://" (typed as
    `Store`: it has every public method of it, with the same signatures)."""
    if url.startswith(URL_SCHEME):
        return MemoryStore.open(url)  # type: ignore[return-value]
    return Store.open(url)


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return _url(request, tmp_path)


@pytest.fixture(params=SQL_BACKENDS)
def sql_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return _url(request, tmp_path)


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = open_store(store_url)
    yield s
    s.close()


@pytest.fixture
def new_store(store_url: str, tmp_path: Path) -> Iterator[Callable[[], Store]]:
    """A factory of new, empty stores of the `store_url` backend (for one per hypothesis example);
    the stores it opened are closed at the end of the test."""
    opened: list[Store] = []

    def make() -> Store:
        url = store_url
        if url.startswith("sqlite"):
            url = f"sqlite:///{tmp_path / f'lowtide-{len(opened)}.db'}"
        elif not url.startswith(URL_SCHEME):
            for s in opened:
                s.close()
            _fresh_pg(url)
        opened.append(open_store(url))
        return opened[-1]

    yield make
    for s in opened:
        s.close()


@pytest.fixture
def sql_store(sql_store_url: str) -> Iterator[Store]:
    s = Store.open(sql_store_url)
    yield s
    s.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_790_000_000.0)


@pytest.fixture(autouse=True, scope="session")
def _python_on_path() -> None:
    """Steps say `python`: make it this interpreter (the venv's), as `make` does with its PATH."""
    bindir = str(Path(os.sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int) -> None:
    """With LOWTIDE_REQUIRE_SERVICES=1 (CI), a test skipped for a missing service fails the run."""
    if not REQUIRE_SERVICES:
        return
    missing = [
        rep for rep in terminalreporter.stats.get("skipped", []) if "service unavailable" in str(rep.longrepr)
    ]
    if missing:
        terminalreporter.write_line(
            f"{len(missing)} test(s) skipped for a missing service while LOWTIDE_REQUIRE_SERVICES=1", red=True
        )
        terminalreporter._session.exitstatus = pytest.ExitCode.TESTS_FAILED
