"""The executor port's pending phase and exit reasons, through the real control loop on a fake
clock with the scripted executor, on SQLite and in memory (docs/architecture.md §5).

A cluster executor launches attempts that do not run yet (an image pull, a pod waiting for its
node): the attempt is PENDING with its GPUs booked, RUNNING when the executor says so, and a
notice withdraws it without losing work. An exit says why it happened: an OOMKill and an image
that cannot be pulled are the step's failures (a retry each), an eviction or a pod deleted
outside lowtide is the platform's (requeued, no retry), a pod that finds no node is the
machinery's (requeued after a backoff); each keeps the executor's words for the user.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lowtide.control.clock import FakeClock
from lowtide.control.executor_port import ExitReason
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.states import AttemptState, StepState
from lowtide.policy.outcomes import RetryPolicy
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
        executor=FakeExecutor(pending_launches=True),
        retry=RetryPolicy(10.0, 10.0),
        tick_s=1.0,
    )
    harness.recover()
    yield harness
    harness.close()


def executor(h: LoopHarness) -> FakeExecutor:
    assert isinstance(h.executor, FakeExecutor)
    return h.executor


def one_step(retries: int = 1) -> dict[str, Any]:
    return {"name": "train", "max_retries": retries, "steps": [{"name": "t", "command": ["x"], "gpus": 2}]}


def booked_gpus(h: LoopHarness) -> list[int]:
    return sorted(g.index for g in h.store.holdings() if g.holder_kind == "attempt")


def test_a_pending_attempt_holds_its_gpus_and_runs_when_the_executor_says_so(h: LoopHarness) -> None:
    job = h.submit(one_step())
    h.tick()
    att = h.last_attempt(job)
    assert (att.state, att.running_at, att.handle) == (AttemptState.PENDING, None, f"fake/{att.id}")
    assert booked_gpus(h) == [0, 1]  # booked while the image is pulled: nobody else gets them
    h.tick(20)
    assert h.last_attempt(job).state == AttemptState.PENDING
    pulled_at = h.clock.now()
    executor(h).start(att.id, pulled_at)
    h.tick()
    att = h.last_attempt(job)
    assert (att.state, att.running_at) == (AttemptState.RUNNING, pulled_at)
    executor(h).finish(att.id, 0)
    h.tick()
    assert h.last_attempt(job).state == AttemptState.SUCCEEDED
    assert h.step(job).state == StepState.SUCCEEDED


def test_a_pending_attempt_given_notice_is_withdrawn_and_requeued_without_lost_work(h: LoopHarness) -> None:
    job = h.submit(one_step())
    h.tick()
    att = h.last_attempt(job)
    h.tick(5)
    h.store.request_preemption(att.id, grace_s=30, reason="GPUs reclaimed", now=h.clock.now())
    h.tick()  # the notice: a pending attempt is withdrawn at once
    assert executor(h).notices and executor(h).notices[-1][0] == att.id
    h.tick()  # its exit is recorded
    ended = h.store.attempt(att.id)
    assert ended.state == AttemptState.INTERRUPTED
    assert (ended.exit_reason, ended.lost_gpu_seconds) == (ExitReason.DELETED, 0.0)
    assert h.step(job).preemptions == 1
    h.tick()
    again = h.last_attempt(job)
    assert again.id != att.id and again.state == AttemptState.PENDING  # relaunched at the head


def run_then_end(h: LoopHarness, job: str, reason: ExitReason, code: int | None, detail: str) -> int:
    h.tick()
    att = h.last_attempt(job)
    executor(h).start(att.id, h.clock.now())
    h.tick(10)
    executor(h).end(att.id, h.clock.now(), reason, exit_code=code, detail=detail)
    h.tick()
    return att.id


def test_an_oomkill_is_the_steps_failure_and_says_so(h: LoopHarness) -> None:
    job = h.submit(one_step(retries=1))
    aid = run_then_end(h, job, ExitReason.OOM_KILLED, 137, "OOMKilled (exit code 137)")
    att = h.store.attempt(aid)
    assert (att.state, att.exit_code, att.exit_reason) == (AttemptState.FAILED, 137, ExitReason.OOM_KILLED)
    assert "OOMKilled" in att.message and "retry 1 of 1" in att.message
    step = h.step(job)
    assert (step.state, step.retries_used) == (StepState.READY, 1)
    assert att.lost_gpu_seconds == pytest.approx(2 * 10.0)  # from when it began to run


def test_an_eviction_is_the_platforms_doing_requeued_without_a_retry(h: LoopHarness) -> None:
    job = h.submit(one_step(retries=0))
    aid = run_then_end(h, job, ExitReason.EVICTED, None, "The node was low on resource: memory.")
    att = h.store.attempt(aid)
    assert (att.state, att.exit_reason) == (AttemptState.INTERRUPTED, ExitReason.EVICTED)
    assert att.exit_detail == "The node was low on resource: memory."
    assert "evicted" in att.message and "requeued" in att.message
    step = h.step(job)
    assert step.retries_used == 0  # no retry used, even with none left
    assert h.last_attempt(job).id != aid  # relaunched in the same tick, without a backoff


def test_a_pod_that_finds_no_node_is_the_machinerys_fault(h: LoopHarness) -> None:
    job = h.submit(one_step(retries=0))
    h.tick()
    att = h.last_attempt(job)
    executor(h).end(att.id, h.clock.now(), ExitReason.UNSCHEDULABLE, detail="0/3 nodes are available")
    h.tick()
    step = h.step(job)
    assert (step.state, step.retries_used) == (StepState.READY, 0)
    assert step.eligible_at > h.clock.now()  # after a backoff
    ended = h.store.attempt(att.id)
    assert ended.exit_reason == ExitReason.UNSCHEDULABLE
    assert "scheduling: 0/3 nodes are available" in ended.message


def test_an_image_that_cannot_be_pulled_fails_the_step_with_the_executors_words(h: LoopHarness) -> None:
    job = h.submit(one_step(retries=0))
    h.tick()
    att = h.last_attempt(job)
    words = 'Back-off pulling image "registry.example/none:latest"'
    executor(h).end(att.id, h.clock.now(), ExitReason.IMAGE_PULL, detail=words)
    h.tick()
    assert h.step(job).state == StepState.FAILED
    ended = h.store.attempt(att.id)
    assert "image could not be pulled" in ended.message and words in ended.message
    assert (ended.state, ended.running_at, ended.lost_gpu_seconds) == (AttemptState.FAILED, None, 0.0)


def test_the_walltime_counts_from_when_the_attempt_runs_not_from_its_launch(h: LoopHarness) -> None:
    job = h.submit({"name": "timed", "steps": [{"name": "t", "command": ["x"], "gpus": 1, "timeout": 100}]})
    h.tick()
    att = h.last_attempt(job)
    h.tick(60)  # an image pull of 60 s: no running time
    executor(h).start(att.id, h.clock.now())
    ran_at = h.clock.now()
    report = h.tick()
    assert report.next_due == ran_at + 100
    h.tick(98)  # 100 s after the launch, 99 s of running
    assert executor(h).notices == [] and h.store.attempt(att.id).state == AttemptState.RUNNING
    h.tick()
    assert [a for a, _ in executor(h).notices] == [att.id]  # at 100 s of running
    assert h.store.attempt(att.id).stop_reason is not None


def test_a_retried_step_gets_its_whole_walltime_again(h: LoopHarness) -> None:
    job = h.submit(
        {
            "name": "timed",
            "grace_seconds": 5,
            "steps": [{"name": "t", "command": ["x"], "gpus": 1, "timeout": 100}],
        }
    )
    h.tick()
    first = h.last_attempt(job)
    executor(h).start(first.id, h.clock.now())
    h.tick(101)  # over its walltime: notice
    h.tick(6)  # killed at the grace deadline
    h.tick()
    assert h.step(job).state == StepState.FAILED and "timed out" in h.step(job).reason
    h.store.retry_job(job, by="u", now=h.clock.now())
    h.tick()
    second = h.last_attempt(job)
    assert second.id != first.id
    executor(h).start(second.id, h.clock.now())
    h.tick(50)  # 50 s into a fresh 100 s budget: no notice yet
    assert [a for a, _ in executor(h).notices] == [first.id]
    assert h.store.attempt(second.id).state == AttemptState.RUNNING
    executor(h).finish(second.id, 0)
    h.tick()
    assert h.step(job).state == StepState.SUCCEEDED


def test_the_executor_hears_when_a_job_will_start_nothing_more(h: LoopHarness) -> None:
    # A cluster executor stops the job's Workflow then, so that Argo's retries start no new pod.
    def small(retries: int = 1) -> dict[str, Any]:
        return {"name": "s", "max_retries": retries, "steps": [{"name": "t", "command": ["x"], "gpus": 1}]}

    cancelled = h.submit(small())
    failed = h.submit(small(retries=0))
    done = h.submit(small())
    h.tick()
    atts = {job: h.last_attempt(job) for job in (cancelled, failed, done)}
    for att in atts.values():
        executor(h).start(att.id, h.clock.now())
    h.tick()
    assert executor(h).ended_jobs == []
    h.store.request_cancel(cancelled, by="u", now=h.clock.now())
    executor(h).finish(atts[failed].id, 1)
    executor(h).finish(atts[done].id, 0)
    h.tick()  # the cancel's notice; the other two end
    h.tick()
    assert h.store.job(failed).state.value == "FAILED" and h.store.job(done).state.value == "SUCCEEDED"
    assert sorted(executor(h).ended_jobs) == sorted([cancelled, failed, done])  # each once
