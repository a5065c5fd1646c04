"""The production loop over a store that fails on command (docs/architecture.md §4.4): nothing
the loop observed or did during an outage is lost. Exits stay with the executor until recorded,
a failed launch and a lost attempt are retried every tick, the tick itself never raises, and
when the store works again one tick applies everything."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest

from lowtide.control.clock import FakeClock
from lowtide.control.records import StoreUnavailable
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.states import AttemptState, StepState
from lowtide.policy.outcomes import RetryPolicy
from lowtide.sim.harness import HarnessStore, LoopHarness
from lowtide.sim.scripted import FakeExecutor, MemoryArtifacts
from lowtide.store.memory import MemoryStore

NODES = (Node("n1", (0, 1)),)
LAYOUT = ArtifactLayout("/art", "/work")

#: Everything the loop writes (reads keep working, as with SQLite in WAL mode under a lock).
WRITES = frozenset(
    {
        "finish_attempt",
        "begin_attempt",
        "record_launch",
        "mark_running",
        "mark_stopping",
        "apply_dag",
        "set_waiting_reasons",
        "record_checkpoint",
        "add_event",
        "create_token",
    }
)


class FlakyStore:
    """A `MemoryStore` whose writes raise `StoreUnavailable` while `down` (counting them)."""

    def __init__(self) -> None:
        self.inner = MemoryStore()
        self.down = False
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in WRITES:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                self.refused += 1
                raise StoreUnavailable("sqlite: database is locked")
            return attr(*args, **kwargs)

        return call


class BrokenArtifacts(MemoryArtifacts):
    """Artifact storage whose directories cannot be made while `broken`."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = False

    def ensure_dir(self, uri: str) -> None:
        if self.broken:
            raise NotADirectoryError(20, "Not a directory", uri)


@pytest.fixture
def world() -> Iterator[tuple[LoopHarness, FlakyStore, FakeExecutor, BrokenArtifacts]]:
    store, executor, artifacts = FlakyStore(), FakeExecutor(), BrokenArtifacts()
    h = LoopHarness(
        nodes=NODES,
        layout=LAYOUT,
        clock=FakeClock(),
        store=cast(HarnessStore, store),
        executor=executor,
        artifacts=artifacts,
        retry=RetryPolicy(5.0, 20.0),
    )
    h.recover()
    yield h, store, executor, artifacts
    h.close()


JOB = {"name": "j", "max_retries": 0, "steps": [{"name": "s", "command": ["x"], "gpus": 1}]}


def test_an_exit_during_an_outage_is_kept_and_recorded_after_it(world: Any) -> None:
    h, store, executor, _ = world
    job = h.submit(JOB)
    h.tick()
    attempt = h.last_attempt(job).id
    store.down = True
    executor.finish(attempt, 0)
    for _ in range(5):
        report = h.tick(check=False)  # never raises
        assert report.store_unavailable and report.exits == 0
    assert set(executor.unacked) == {attempt}  # still reported, never forgotten
    assert h.last_attempt(job).state == AttemptState.RUNNING
    assert h.loop.store_retry_s() == 5.0  # 0.5, 1, 2, 4, then the 5 s cap
    store.down = False
    report = h.tick()
    assert report.exits == 1 and not report.store_unavailable
    assert executor.unacked == {}
    assert h.last_attempt(job).state == AttemptState.SUCCEEDED
    assert h.loop.store_retry_s() is None


def test_a_failed_launch_the_store_could_not_record_is_recorded_later(world: Any) -> None:
    h, store, executor, artifacts = world
    job = h.submit(JOB)
    artifacts.broken = True
    original = store.inner.finish_attempt

    def down_after_booking(*args: Any, **kwargs: Any) -> Any:
        store.down = True  # the store goes away between the booking and the failure's record
        raise StoreUnavailable("sqlite: database is locked")

    store.inner.finish_attempt = down_after_booking
    report = h.tick(check=False)
    assert report.store_unavailable and report.started == 0
    store.inner.finish_attempt = original
    h.tick(check=False)
    attempt = h.last_attempt(job)
    assert attempt.state == AttemptState.PENDING  # booked, never launched; its failure is not recorded yet
    store.down = False
    artifacts.broken = False
    h.tick()
    failed = h.store.job_detail(job).attempts[0]
    assert failed.state == AttemptState.FAILED and "not the step's failure" in failed.message
    step = h.step(job)
    assert step.retries_used == 0 and step.state in (StepState.READY, StepState.RUNNING)
    assert "storage" in h.loop.infrastructure_alerts
    h.tick(n=6)  # past the backoff: launched, and the alert clears
    assert h.last_attempt(job).state == AttemptState.RUNNING and len(executor.launched) == 1
    assert h.loop.infrastructure_alerts == {}
