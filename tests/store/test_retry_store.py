"""`retry_job` against SQLite, the real PostgreSQL server and memory: a FAILED or CANCELLED job
goes back to work in place (`policy.retry`), its SUCCEEDED steps kept, with one guarded write."""

from __future__ import annotations

import threading

import pytest
from storekit import HALF_LIFE, NODES, advance_dag, finish, start, submit

from lowtide.control.clock import FakeClock
from lowtide.control.records import NotFound, NotRetriable, RetriedJob, StaleState
from lowtide.domain.states import JobState, StepState
from lowtide.store.repo import Store


def _three_steps(store: Store, clock: FakeClock, job_id: str = "job-000000000001") -> str:
    """prep -> train (one retry) -> eval, submitted."""
    return submit(
        store,
        clock,
        job_id,
        steps=[
            {"name": "prep", "command": ["true"], "gpus": 0},
            {"name": "train", "command": ["false"], "gpus": 2, "depends": ["prep"], "max_retries": 1},
            {"name": "eval", "command": ["true"], "gpus": 0, "depends": ["train"]},
        ],
    )


def _failed_job(store: Store, clock: FakeClock) -> str:
    """prep SUCCEEDED; train failed twice (its retry used): FAILED; eval SKIPPED; the job FAILED."""
    store.ensure_gpus(NODES, clock.now())
    job_id = _three_steps(store, clock)
    finish(store, start(store, job_id, "prep", clock.now()).attempt_id, clock.advance(1))
    advance_dag(store, job_id, clock.now())
    first = finish(
        store,
        start(store, job_id, "train", clock.now(), gpus=(0, 1)).attempt_id,
        clock.advance(1),
        exit_code=1,
    )
    assert first.step_state == StepState.READY  # its one retry
    second = finish(
        store,
        start(store, job_id, "train", clock.advance(30), gpus=(0, 1)).attempt_id,
        clock.advance(1),
        exit_code=1,
    )
    assert second.step_state == StepState.FAILED
    advance_dag(store, job_id, clock.now())
    assert store.job(job_id).state == JobState.FAILED
    return job_id


def _states(store: Store, job_id: str) -> dict[str, StepState]:
    return {s.name: s.state for s in store.job_detail(job_id).steps}


def test_a_failed_job_retries_its_failed_steps_and_keeps_the_succeeded_ones(
    store: Store, clock: FakeClock
) -> None:
    job_id = _failed_job(store, clock)
    before = store.job_detail(job_id)
    retried = store.retry_job(job_id, by="alice", now=clock.advance(60))
    assert (retried.queued, retried.waiting, retried.kept) == (("train",), ("eval",), ("prep",))
    record = retried.job
    assert (record.state, record.finished_at, record.cancel_requested_at) == (JobState.RUNNING, None, None)
    assert record.started_at == before.job.started_at
    assert record.message == "retried by alice: train, eval back to work"
    assert record.step_states == {"PENDING": 1, "READY": 1, "SUCCEEDED": 1}
    detail = store.job_detail(job_id)
    steps = {s.name: s for s in detail.steps}
    assert steps["prep"] == next(s for s in before.steps if s.name == "prep")  # untouched
    assert (steps["train"].state, steps["train"].retries_used, steps["train"].eligible_at) == (
        StepState.READY,
        0,
        clock.now(),
    )
    assert steps["train"].reason == "retried by alice"
    assert (steps["eval"].state, steps["eval"].reason) == (
        StepState.PENDING,
        "retried by alice: waiting for train",
    )
    assert detail.attempts == before.attempts  # the record of what ran is kept
    new_events = [(e.step_name, e.kind, e.message) for e in detail.events[len(before.events) :]]
    assert new_events == [
        ("train", "retried", "FAILED -> READY: retried by alice"),
        ("eval", "retried", "SKIPPED -> PENDING: retried by alice: waiting for train"),
        (None, "retried", "retried by alice: train, eval back to work"),
    ]
    # Only the retried step waits for the scheduler; the DAG may move the job again.
    queued = store.snapshot(now=clock.now(), nodes=NODES, half_life_s=HALF_LIFE).queued
    assert [(q.job_id, q.step) for q in queued] == [(job_id, "train")]
    assert [v.job_id for v in store.job_views()] == [job_id]


def test_a_retried_step_has_its_whole_retry_budget_again_and_the_job_can_succeed(
    store: Store, clock: FakeClock
) -> None:
    job_id = _failed_job(store, clock)
    store.retry_job(job_id, by="alice", now=clock.advance(60))
    launch = start(store, job_id, "train", clock.now(), gpus=(0, 1))
    assert launch.number == 3  # attempts are numbered on
    # Its old attempts do not count: this failure is retry 1 of 1 again, not the end.
    again = finish(store, launch.attempt_id, clock.advance(1), exit_code=1)
    assert (again.step_state, again.retries_used) == (StepState.READY, 1)
    finish(store, start(store, job_id, "train", clock.advance(30), gpus=(0, 1)).attempt_id, clock.advance(1))
    advance_dag(store, job_id, clock.now())
    assert _states(store, job_id)["eval"] == StepState.READY
    finish(store, start(store, job_id, "eval", clock.now()).attempt_id, clock.advance(1))
    advance_dag(store, job_id, clock.now())
    done = store.job_detail(job_id)
    assert done.job.state == JobState.SUCCEEDED
    assert [a.number for a in done.attempts if a.step_name == "prep"] == [1]  # prep never ran again


def test_retrying_twice_is_refused_the_second_time(store: Store, clock: FakeClock) -> None:
    job_id = _failed_job(store, clock)
    store.retry_job(job_id, by="alice", now=clock.now())
    before = store.job_detail(job_id)
    with pytest.raises(NotRetriable, match="is RUNNING: already running") as info:
        store.retry_job(job_id, by="alice", now=clock.advance(1))
    assert (info.value.state, info.value.reason) == (JobState.RUNNING, "already running")
    assert store.job_detail(job_id) == before  # nothing written


def test_a_queued_or_succeeded_job_is_not_retried(store: Store, clock: FakeClock) -> None:
    job_id = _three_steps(store, clock)
    with pytest.raises(NotRetriable, match="QUEUED: already running"):
        store.retry_job(job_id, by="alice", now=clock.now())
    store.ensure_gpus(NODES, clock.now())
    for step in ("prep", "train", "eval"):
        finish(
            store,
            start(store, job_id, step, clock.now(), gpus=(0, 1) if step == "train" else ()).attempt_id,
            clock.advance(1),
        )
        advance_dag(store, job_id, clock.now())
    assert store.job(job_id).state == JobState.SUCCEEDED
    with pytest.raises(NotRetriable, match="SUCCEEDED: nothing failed"):
        store.retry_job(job_id, by="alice", now=clock.now())
    with pytest.raises(NotFound):
        store.retry_job("job-00000000ffff", by="alice", now=clock.now())


def test_a_job_cancelled_before_it_started_goes_back_to_the_queue(store: Store, clock: FakeClock) -> None:
    job_id = _three_steps(store, clock)
    assert store.request_cancel(job_id, by="alice", now=clock.now()).state == JobState.CANCELLED
    record = store.retry_job(job_id, by="bob", now=clock.advance(5)).job
    assert (record.state, record.started_at, record.finished_at) == (JobState.QUEUED, None, None)
    assert _states(store, job_id) == {
        "prep": StepState.READY,
        "train": StepState.PENDING,
        "eval": StepState.PENDING,
    }


def test_a_cancelling_job_is_retried_only_once_its_steps_have_stopped(store: Store, clock: FakeClock) -> None:
    store.ensure_gpus(NODES, clock.now())
    job_id = _three_steps(store, clock)
    finish(store, start(store, job_id, "prep", clock.now()).attempt_id, clock.advance(1))
    advance_dag(store, job_id, clock.now())
    launch = start(store, job_id, "train", clock.now(), gpus=(0, 1))
    assert store.request_cancel(job_id, by="alice", now=clock.now()).state == JobState.CANCELLING
    with pytest.raises(NotRetriable, match="CANCELLING: still stopping"):
        store.retry_job(job_id, by="alice", now=clock.now())
    store.mark_stopping(launch.attempt_id, deadline=clock.now() + 30, reason="job cancelled", now=clock.now())
    finish(store, launch.attempt_id, clock.advance(2), exit_code=143, noticed=True)
    advance_dag(store, job_id, clock.now())
    assert store.job(job_id).state == JobState.CANCELLED
    record = store.retry_job(job_id, by="alice", now=clock.advance(1)).job
    assert record.state == JobState.RUNNING
    assert _states(store, job_id) == {
        "prep": StepState.SUCCEEDED,
        "train": StepState.READY,
        "eval": StepState.PENDING,
    }
    # GPUs: the cancelled attempt gave them back; the retried step may have them again.
    assert start(store, job_id, "train", clock.now(), gpus=(0, 1)).number == 2


def test_two_retries_at_once_reopen_the_job_once(store: Store, clock: FakeClock) -> None:
    job_id = _failed_job(store, clock)
    before = len(store.job_detail(job_id).events)
    barrier = threading.Barrier(2)
    results: list[RetriedJob | Exception] = []

    def retry() -> None:
        barrier.wait()
        try:
            results.append(store.retry_job(job_id, by="alice", now=clock.now()))
        except (NotRetriable, StaleState) as exc:
            results.append(exc)

    threads = [threading.Thread(target=retry) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(type(r).__name__ for r in results) in (
        ["NotRetriable", "RetriedJob"],
        ["RetriedJob", "StaleState"],
    )
    detail = store.job_detail(job_id)
    assert detail.job.state == JobState.RUNNING
    assert [e.kind for e in detail.events[before:]] == ["retried"] * 3  # two steps and the job, once
