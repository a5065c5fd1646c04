"""Fixtures for the fake API server's own tests: a fresh cluster per test on a fake clock."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from k8sfake import FakeCluster


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cluster(clock: Clock) -> Iterator[FakeCluster]:
    with FakeCluster(clock=clock, bookmark_interval=0.1, window=50) as c:
        yield c
