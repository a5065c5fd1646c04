"""The control loop acts only while it holds the lease (docs/architecture.md §4.4), driven on a
fake clock with the scripted executor, on the in-memory store and on SQLite.

A standby's tick does nothing; a leader that loses the lease between booking a start and
launching it launches nothing, and the next leader requeues that booking without using a retry;
no notice is given by a control plane that does not hold the lease.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lowtide.control.clock import FakeClock
from lowtide.control.records import FencedOut
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.sim.harness import LoopHarness
from lowtide.sim.scripted import FakeExecutor
from lowtide.store.memory import MemoryStore
from lowtide.store.repo import Store

NODES = (Node("n1", (0, 1, 2, 3)),)
LAYOUT = ArtifactLayout("/art", "/work")
JOB = {"name": "j", "max_retries": 1, "steps": [{"name": "train", "command": ["sleep", "inf"], "gpus": 2}]}


class Guard:
    """A lease guard the test turns on and off; `lose_after` checks pass, then it is lost."""

    def __init__(self) -> None:
        self.acting = True
        self.lose_after: int | None = None
        self.checks = 0

    def may_act(self) -> bool:
        return self.acting

    def check(self) -> None:
        self.checks += 1
        if self.lose_after is not None and self.checks > self.lose_after:
            self.acting = False
        if not self.acting:
            raise FencedOut("lost the lease (test)")


@pytest.fixture(params=["sqlite", "memory"])
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LoopHarness]:
    store = Store.open(f"sqlite:///{tmp_path / 'db.sqlite'}") if request.param == "sqlite" else MemoryStore()
    harness = LoopHarness(nodes=NODES, layout=LAYOUT, clock=FakeClock(1_800_000_000.0), store=store)
    harness.recover()
    yield harness
    harness.close()


def launched(h: LoopHarness) -> int:
    assert isinstance(h.executor, FakeExecutor)
    return len(h.executor.launched)


def test_a_standby_tick_does_nothing_and_the_leader_launches(h: LoopHarness) -> None:
    guard = Guard()
    guard.acting = False
    h.loop.lease = guard
    job = h.submit(JOB)
    h.tick(3)
    assert launched(h) == 0 and not h.store.job_detail(job).attempts
    guard.acting = True
    h.tick()
    assert launched(h) == 1 and h.step(job, "train").state.value == "RUNNING"


def test_a_lease_lost_between_booking_and_launch_launches_nothing_and_costs_no_retry(h: LoopHarness) -> None:
    guard = Guard()
    guard.lose_after = 1  # the check before the booking passes, the one before the launch fails
    h.loop.lease = guard
    job = h.submit(JOB)
    report = h.tick(check=False)
    assert launched(h) == 0 and report.started == 0
    booked = h.last_attempt(job)
    assert booked.state.value == "PENDING" and booked.handle is None  # booked, never launched
    h.loop.lease = None
    h.restart()  # the next leader: the booking's process is not found, so it is requeued
    assert h.store.attempt(booked.id).state.value == "LOST"
    assert h.step(job, "train").retries_used == 0
    h.tick(2)
    assert launched(h) == 1 and h.last_attempt(job).id != booked.id


def test_no_notice_without_the_lease(h: LoopHarness) -> None:
    guard = Guard()
    h.loop.lease = guard
    job = h.submit(JOB)
    h.tick()
    assert launched(h) == 1
    h.store.request_cancel(job, by="u", now=h.clock.now())
    guard.acting = False
    h.tick(2, check=False)
    assert isinstance(h.executor, FakeExecutor) and h.executor.notices == []
    guard.acting = True
    h.tick()
    assert [a for a, _ in h.executor.notices] == [h.last_attempt(job).id]
