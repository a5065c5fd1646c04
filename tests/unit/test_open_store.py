"""`wiring.open_store`: `lowtide up` waits for a store that is not there yet, and says why it
gives up; a failure that waiting cannot mend is a configuration error naming `store_url`."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa

from lowtide.config import ConfigError, Settings
from lowtide.store.repo import Store
from lowtide.wiring import ServeError, open_store


def _locked() -> sa.exc.OperationalError:
    return sa.exc.OperationalError("BEGIN IMMEDIATE", {}, sqlite3.OperationalError("database is locked"))


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s

    def monotonic(self) -> float:
        return self.now


def settings(tmp_path: Path, **kw: object) -> Settings:
    return Settings(state_dir=str(tmp_path / "state"), **kw)  # type: ignore[arg-type]


def test_a_store_that_answers_later_is_waited_for_with_growing_pauses(tmp_path: Path) -> None:
    fails = iter([_locked(), _locked(), _locked()])
    real = Store.open(f"sqlite:///{tmp_path / 'x.db'}")

    def opener(url: str, busy: float) -> Store:
        assert busy == 5.0  # the configured lock wait goes to the store
        exc = next(fails, None)
        if exc is not None:
            raise exc
        return real

    clock = FakeTime()
    assert open_store(settings(tmp_path), opener=opener, sleep=clock.sleep, monotonic=clock.monotonic) is real
    assert clock.slept == [0.5, 1.0, 2.0]
    real.close()


def test_it_gives_up_after_store_start_timeout_and_says_why(tmp_path: Path) -> None:
    def opener(url: str, busy: float) -> Store:
        raise _locked()

    clock = FakeTime()
    why = r"did not answer within 3s \(store_start_timeout\): sqlite: database is locked"
    with pytest.raises(ServeError, match=why):
        cfg = settings(tmp_path, store_start_timeout=3)
        open_store(cfg, opener=opener, sleep=clock.sleep, monotonic=clock.monotonic)
    assert sum(clock.slept) == pytest.approx(3.0)


def test_a_failure_waiting_cannot_mend_is_a_config_error_without_the_password(tmp_path: Path) -> None:
    def opener(url: str, busy: float) -> Store:
        raise sa.exc.ArgumentError("Could not parse SQLAlchemy URL")

    url = "postgresql+psycopg://lowtide:s3cret@db.example/lowtide"
    with pytest.raises(ConfigError, match=r"store_url .*cannot open the store: Could not parse") as info:
        open_store(settings(tmp_path, store_url=url), opener=opener, sleep=lambda s: None)
    assert "s3cret" not in str(info.value)
