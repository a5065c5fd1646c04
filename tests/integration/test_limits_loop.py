"""Step timeouts and CPU-only step limits, driven through the real control loop on a fake clock
with the scripted executor, on a real SQLite store and on the in-memory store.

The walltime stories: notice at the deadline with reason "timeout", the grace, FAILED without a
retry, downstream SKIPPED and the job FAILED; deadlines derived from stored start times, so a
control-plane restart before or after the notice changes nothing; the budget summed over attempts
(queue time not counted); the configured default; a cancel during the grace still cancels.
The fan-out story: never more CPU-only steps running than the node limit, and all of them finish.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from lowtide.control.clock import FakeClock
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.policy.outcomes import RetryPolicy
from lowtide.policy.scheduler import SchedulerPolicy
from lowtide.sim.harness import LoopHarness
from lowtide.sim.scripted import FakeExecutor
from lowtide.store.memory import MemoryStore
from lowtide.store.repo import Store

NODES = (Node("n1", (0, 1, 2, 3)),)
LAYOUT = ArtifactLayout("/art", "/work")
T0 = 1_800_000_000.0


@pytest.fixture(params=["sqlite", "memory"])
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LoopHarness]:
    store = Store.open(f"sqlite:///{tmp_path / 'db.sqlite'}") if request.param == "sqlite" else MemoryStore()
    harness = LoopHarness(
        nodes=NODES,
        layout=LAYOUT,
        clock=FakeClock(T0),
        store=store,
        retry=RetryPolicy(10.0, 10.0),
        tick_s=1.0,
    )
    harness.recover()
    yield harness
    harness.close()


def executor(h: LoopHarness) -> FakeExecutor:
    assert isinstance(h.executor, FakeExecutor)
    return h.executor


def timed_job(timeout: Any = 100, *, retries: int = 2, grace: float = 30) -> dict[str, Any]:
    return {
        "name": "hangs",
        "grace_seconds": grace,
        "max_retries": retries,
        "steps": [
            {"name": "train", "command": ["sleep", "inf"], "gpus": 2, "timeout": timeout},
            {"name": "eval", "command": ["true"], "depends": ["train"]},
        ],
    }


def states(h: LoopHarness, job: str) -> dict[str, str]:
    return {s.name: s.state.value for s in h.store.job_detail(job).steps}


def test_a_step_over_its_timeout_gets_notice_then_fails_without_a_retry(h: LoopHarness) -> None:
    job = h.submit(timed_job())
    report = h.tick()
    att = h.last_attempt(job)
    started = att.started_at
    assert report.next_due == started + 100  # the loop wakes for the deadline, idle or simulated
    h.tick(99)  # now = started + 99
    assert executor(h).notices == [] and h.store.attempt(att.id).state.value == "RUNNING"
    report = h.tick()  # now = started + 100: the deadline
    assert report.notices == 1
    assert executor(h).notices == [(att.id, started + 100)]
    noticed = h.store.attempt(att.id)
    assert noticed.state.value == "STOPPING"
    assert noticed.stop_reason == "timeout: walltime limit of 1m 40s reached; notice given, deadline in 30s"
    assert noticed.stop_deadline == started + 130
    assert (
        h.step(job, "train").reason == "walltime limit of 1m 40s reached: stopping (grace 30s), then FAILED"
    )
    assert h.tick(5).notices == 0  # notice is given once

    executor(h).finish(att.id, 143)  # it checkpointed and exited non-zero, as the contract asks
    h.tick()
    train = h.step(job, "train")
    assert train.state.value == "FAILED" and train.retries_used == 0
    assert train.reason == "timed out after 1m 40s (walltime limit); exit code 143"
    h.tick()
    assert states(h, job) == {"train": "FAILED", "eval": "SKIPPED"}
    assert h.store.job(job).state.value == "FAILED"
    assert len(h.store.job_detail(job).attempts) == 1  # no retry, although max_retries is 2
    assert all(g.holder_kind == "idle" for g in h.store.holdings())  # the GPUs are free again


def test_a_step_that_ignores_its_notice_is_killed_at_the_deadline_and_fails(h: LoopHarness) -> None:
    job = h.submit(timed_job(timeout="1m"))
    h.tick(61)
    att = h.last_attempt(job)
    assert h.store.attempt(att.id).state.value == "STOPPING"
    h.tick(30)
    train = h.step(job, "train")
    assert train.state.value == "FAILED"
    assert train.reason == "timed out after 1m (walltime limit); killed at the grace deadline"
    assert h.store.attempt(att.id).killed_at_deadline


def test_a_restart_before_the_deadline_keeps_it(h: LoopHarness) -> None:
    job = h.submit(timed_job())
    h.tick()
    started = h.last_attempt(job).started_at
    h.tick(50)
    report = h.restart()
    assert report.adopted  # the fake process is still there
    assert h.tick().next_due == started + 100  # from the stored start time, not from the restart
    h.clock.advance(started + 100 - h.clock.now() - 1)
    h.tick()
    assert executor(h).notices == [(h.last_attempt(job).id, started + 100)]


def test_a_restart_between_notice_and_exit_still_fails_the_step_as_timed_out(h: LoopHarness) -> None:
    job = h.submit(timed_job())
    h.tick(101)
    att = h.last_attempt(job)
    assert h.store.attempt(att.id).state.value == "STOPPING"
    h.restart()  # a new loop: nothing in memory says "timeout", only the stored stop reason
    executor(h).finish(att.id, 1)
    h.tick()
    assert h.step(job, "train").reason == "timed out after 1m 40s (walltime limit); exit code 1"
    assert h.step(job, "train").state.value == "FAILED"


def test_the_budget_is_summed_over_attempts_and_queue_time_does_not_count(h: LoopHarness) -> None:
    job = h.submit(timed_job(timeout=100))
    h.tick()
    first = h.last_attempt(job)
    h.tick(59)
    executor(h).finish(first.id, 1)  # crashes after 60 s: retried after a 10 s backoff
    h.tick()
    h.tick(12)
    second = h.last_attempt(job)
    assert second.number == 2
    ran_first = h.store.attempt(first.id).ended_at - first.started_at  # type: ignore[operator]
    assert ran_first == 60
    h.tick(int(second.started_at + 40 - h.clock.now()) - 1)
    assert executor(h).notices == []
    h.tick()  # 60 s + 40 s = the 100 s budget; the backoff in between did not count
    assert executor(h).notices == [(second.id, second.started_at + 40)]
    assert h.store.attempt(second.id).stop_reason.startswith(  # type: ignore[union-attr]
        "timeout: walltime limit of 1m 40s reached, summed over 2 attempts"
    )
    executor(h).finish(second.id, 1)
    h.tick()
    assert h.step(job, "train").state.value == "FAILED"
    assert h.step(job, "train").retries_used == 1  # the first crash's retry; none for the timeout


def test_the_configured_default_applies_to_steps_without_a_timeout(h: LoopHarness) -> None:
    h.settings = replace(h.settings, default_step_timeout_s=20.0)
    h.restart()
    doc = timed_job()
    del doc["steps"][0]["timeout"]
    job = h.submit(doc)
    h.tick(21)
    assert h.store.attempt(h.last_attempt(job).id).stop_reason.startswith(  # type: ignore[union-attr]
        "timeout: walltime limit of 20s reached"
    )


def test_a_cancel_during_the_timeout_grace_still_cancels(h: LoopHarness) -> None:
    job = h.submit(timed_job())
    h.tick(101)
    att = h.last_attempt(job)
    h.store.request_cancel(job, by="alice", now=h.clock.now())
    executor(h).finish(att.id, 143)
    h.tick(2)
    assert states(h, job) == {"train": "CANCELLED", "eval": "CANCELLED"}


def test_exit_zero_after_the_timeout_notice_means_done(h: LoopHarness) -> None:
    job = h.submit(timed_job())
    h.tick(101)
    executor(h).finish(h.last_attempt(job).id, 0)
    h.tick(2)
    assert states(h, job)["train"] == "SUCCEEDED"


# --- CPU-only fan-out ---------------------------------------------------------------------------


def test_a_cpu_fan_out_never_runs_more_than_the_node_limit_and_all_finish(h: LoopHarness) -> None:
    # Every attempt copies the job's spec into its record, so on SQLite the run grows with
    # steps²: 200 steps there, 1,000 in memory (the pure decision is benchmarked at 10,000).
    steps = 1000 if isinstance(h.store, MemoryStore) else 200
    limit = 7
    h.settings = replace(h.settings, scheduler=SchedulerPolicy(max_cpu_steps_per_node=limit))
    h.restart()
    job = h.submit(
        {
            "name": "fan",
            "steps": [{"name": f"s{i:05d}", "command": ["true"], "gpus": 0} for i in range(steps)],
        }
    )
    most = 0
    for _ in range(steps):
        h.tick()
        active = h.store.active_attempts()
        most = max(most, len(active))
        assert len(active) <= limit
        if not active:
            break
        for att in active:
            executor(h).finish(att.id, 0)
    h.tick(2)
    assert most == limit
    assert h.store.job(job).state.value == "SUCCEEDED"
    waiting = [s.reason for s in h.store.job_detail(job).steps if s.state.value == "READY"]
    assert waiting == []


def test_waiting_cpu_steps_say_which_limit_holds_them(h: LoopHarness) -> None:
    h.settings = replace(
        h.settings, scheduler=SchedulerPolicy(max_cpu_steps_per_node=3, max_cpu_steps_per_user=2)
    )
    h.restart()
    a = h.submit(
        {"name": "a", "steps": [{"name": f"s{i}", "command": ["x"], "gpus": 0} for i in range(3)]},
        owner="alice",
    )
    b = h.submit(
        {"name": "b", "steps": [{"name": f"s{i}", "command": ["x"], "gpus": 0} for i in range(3)]},
        owner="bob",
    )
    h.tick()
    assert sorted(states(h, a).values()) == ["READY", "RUNNING", "RUNNING"]
    assert sorted(states(h, b).values()) == ["READY", "READY", "RUNNING"]
    reasons = {s.reason for j in (a, b) for s in h.store.job_detail(j).steps if s.state.value == "READY"}
    assert reasons == {
        "user alice has 2 CPU-only steps running, the limit",
        "node limit of 3 CPU-only steps reached",
    }
