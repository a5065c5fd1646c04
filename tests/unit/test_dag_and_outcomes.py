"""DAG progression and exit classification: pure tables."""

from __future__ import annotations

import pytest

from lowtide.domain.states import (
    ATTEMPT_LIFECYCLE,
    JOB_LIFECYCLE,
    STEP_LIFECYCLE,
    AttemptState,
    IllegalTransition,
    JobState,
    StepState,
)
from lowtide.policy.dag import JobView, StepView, advance
from lowtide.policy.outcomes import RetryPolicy, classify_exit, classify_launch_failure, classify_lost

S = StepState


def job(state: JobState, **steps: tuple[StepState, tuple[str, ...]]) -> JobView:
    return JobView("job-1", state, tuple(StepView(n, st, deps) for n, (st, deps) in steps.items()))


def test_a_pending_step_becomes_ready_when_all_its_upstream_succeeded() -> None:
    view = job(
        JobState.RUNNING,
        a=(S.SUCCEEDED, ()),
        b=(S.RUNNING, ()),
        c=(S.PENDING, ("a",)),
        d=(S.PENDING, ("a", "b")),
    )
    changes = advance(view)
    assert [(c.step, c.to_state) for c in changes.steps] == [("c", S.READY)]
    assert changes.job is None


def test_a_failure_skips_what_has_not_started_and_fails_the_job_once_nothing_runs() -> None:
    running = job(
        JobState.RUNNING, a=(S.FAILED, ()), b=(S.RUNNING, ()), c=(S.PENDING, ("a",)), d=(S.READY, ())
    )
    changes = advance(running)
    assert sorted((c.step, c.to_state) for c in changes.steps) == [("c", S.SKIPPED), ("d", S.SKIPPED)]
    assert changes.job is None  # b still runs: fail-fast waits for it
    done = job(JobState.RUNNING, a=(S.FAILED, ()), b=(S.SUCCEEDED, ()), c=(S.SKIPPED, ("a",)))
    changes = advance(done)
    assert changes.job is not None and changes.job.to_state == JobState.FAILED
    assert "'a' failed" in changes.job.reason


def test_the_job_succeeds_when_every_step_succeeded_and_terminal_jobs_do_not_move() -> None:
    assert advance(job(JobState.RUNNING, a=(S.SUCCEEDED, ()))).job.to_state == JobState.SUCCEEDED  # type: ignore[union-attr]
    assert advance(job(JobState.SUCCEEDED, a=(S.SUCCEEDED, ()))).empty


def test_a_cancelled_job_cancels_steps_that_have_not_started() -> None:
    changes = advance(
        job(JobState.CANCELLED, a=(S.CANCELLING, ()), b=(S.PENDING, ("a",)), c=(S.PREEMPTED, ()))
    )
    assert sorted((c.step, c.to_state) for c in changes.steps) == [("b", S.CANCELLED), ("c", S.CANCELLED)]


def test_a_cancelling_job_is_cancelled_once_no_step_holds_gpus() -> None:
    """Issue 12: a cancelled job showed CANCELLED while its step still held GPUs for the grace."""
    stopping = advance(job(JobState.CANCELLING, a=(S.CANCELLING, ()), b=(S.PENDING, ("a",))))
    assert [(c.step, c.to_state) for c in stopping.steps] == [("b", S.CANCELLED)]
    assert stopping.job is None
    done = advance(job(JobState.CANCELLING, a=(S.CANCELLED, ()), b=(S.PENDING, ("a",))))
    assert done.job is not None and (done.job.from_state, done.job.to_state) == (
        JobState.CANCELLING,
        JobState.CANCELLED,
    )


RETRY = RetryPolicy(backoff_s=10, backoff_max_s=60)


@pytest.mark.parametrize(
    ("step", "code", "sig", "killed", "used", "max_", "attempt", "after", "eligible"),
    [
        (S.RUNNING, 0, None, False, 0, 0, AttemptState.SUCCEEDED, S.SUCCEEDED, 0.0),
        (S.RUNNING, 1, None, False, 0, 2, AttemptState.FAILED, S.READY, 110.0),
        (S.RUNNING, None, 9, False, 1, 2, AttemptState.FAILED, S.READY, 120.0),
        (S.RUNNING, 1, None, False, 4, 5, AttemptState.FAILED, S.READY, 160.0),  # capped at 60
        (S.RUNNING, 1, None, False, 2, 2, AttemptState.FAILED, S.FAILED, 0.0),
        (S.CANCELLING, 143, None, False, 0, 3, AttemptState.INTERRUPTED, S.CANCELLED, 0.0),
        (S.CANCELLING, 0, None, False, 0, 3, AttemptState.SUCCEEDED, S.CANCELLED, 0.0),
        (S.CANCELLING, None, 9, True, 0, 3, AttemptState.INTERRUPTED, S.CANCELLED, 0.0),
        (S.PREEMPTING, 143, None, False, 0, 0, AttemptState.INTERRUPTED, S.PREEMPTED, 0.0),
        (S.PREEMPTING, 0, None, False, 0, 0, AttemptState.SUCCEEDED, S.SUCCEEDED, 0.0),
    ],
)
def test_exit_classification(
    step: StepState,
    code: int | None,
    sig: int | None,
    killed: bool,
    used: int,
    max_: int,
    attempt: AttemptState,
    after: StepState,
    eligible: float,
) -> None:
    noticed = step in (S.CANCELLING, S.PREEMPTING)
    d = classify_exit(
        step_state=step,
        noticed=noticed,
        exit_code=code,
        signal=sig,
        killed_at_deadline=killed,
        retries_used=used,
        max_retries=max_,
        now=100.0,
        retry=RETRY,
    )
    assert (d.attempt_state, d.step_state, d.eligible_at) == (attempt, after, eligible)
    # Every decision is a legal move of both machines.
    ATTEMPT_LIFECYCLE.check(AttemptState.STOPPING if noticed else AttemptState.RUNNING, d.attempt_state)
    STEP_LIFECYCLE.check(step, d.step_state)
    if after == S.READY:
        assert d.retries_used == used + 1 and "retry" in d.message
    if step == S.PREEMPTING and code != 0:
        assert d.preempted and d.retries_used == used  # preemption never uses a retry


@pytest.mark.parametrize("step", [S.CANCELLING, S.PREEMPTING])
def test_an_attempt_that_ends_on_its_own_before_notice_is_judged_by_its_exit(step: StepState) -> None:
    d = classify_exit(
        step_state=step,
        noticed=False,
        exit_code=3,
        signal=None,
        killed_at_deadline=False,
        retries_used=0,
        max_retries=0,
        now=1.0,
        retry=RETRY,
    )
    assert d.attempt_state == AttemptState.FAILED
    ATTEMPT_LIFECYCLE.check(AttemptState.RUNNING, d.attempt_state)
    STEP_LIFECYCLE.check(step, d.step_state)
    assert d.step_state == (S.CANCELLED if step == S.CANCELLING else S.FAILED)


def test_lost_and_failed_launches() -> None:
    lost = classify_lost(step_state=S.RUNNING, retries_used=1)
    assert (lost.attempt_state, lost.step_state, lost.retries_used) == (AttemptState.LOST, S.READY, 1)
    temp = classify_launch_failure(
        step_state=S.RUNNING,
        message="EAGAIN",
        temporary=True,
        retries_used=0,
        max_retries=0,
        now=5.0,
        retry=RETRY,
    )
    assert (temp.step_state, temp.eligible_at, temp.retries_used) == (S.READY, 15.0, 0)
    perm = classify_launch_failure(
        step_state=S.RUNNING,
        message="command not found",
        temporary=False,
        retries_used=0,
        max_retries=0,
        now=5.0,
        retry=RETRY,
    )
    assert perm.step_state == S.FAILED and "launch failed: command not found" in perm.message


def test_illegal_transitions_raise() -> None:
    with pytest.raises(IllegalTransition, match="job: SUCCEEDED -> RUNNING"):
        JOB_LIFECYCLE.check(JobState.SUCCEEDED, JobState.RUNNING)
    with pytest.raises(IllegalTransition):
        STEP_LIFECYCLE.check(S.PENDING, S.RUNNING)
    assert STEP_LIFECYCLE.is_terminal(S.SKIPPED) and not STEP_LIFECYCLE.is_terminal(S.PREEMPTED)
