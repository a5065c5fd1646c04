"""`policy.retry.plan_retry`: what a retry reopens, and the `reopen` moves of the lifecycles."""

from __future__ import annotations

import pytest

from lowtide.domain.states import (
    JOB_LIFECYCLE,
    STEP_LIFECYCLE,
    TERMINAL_JOB_STATES,
    TERMINAL_STEP_STATES,
    IllegalTransition,
    JobState,
    StepState,
)
from lowtide.policy.dag import JobView, StepChange, StepView, advance
from lowtide.policy.retry import RetryPlan, RetryRefused, plan_retry

J, S = JobState, StepState


def _steps(**states: StepState) -> list[StepView]:
    """A chain in the given order: each step depends on the one before."""
    names = list(states)
    return [StepView(n, st, (names[i - 1],) if i else ()) for i, (n, st) in enumerate(states.items())]


def test_reopening_moves_are_legal_but_finished_states_stay_finished() -> None:
    JOB_LIFECYCLE.check(J.FAILED, J.RUNNING)
    JOB_LIFECYCLE.check(J.CANCELLED, J.QUEUED)
    STEP_LIFECYCLE.check(S.FAILED, S.READY)
    STEP_LIFECYCLE.check(S.SKIPPED, S.PENDING)
    with pytest.raises(IllegalTransition):
        JOB_LIFECYCLE.check(J.SUCCEEDED, J.RUNNING)
    with pytest.raises(IllegalTransition):
        STEP_LIFECYCLE.check(S.SUCCEEDED, S.READY)
    with pytest.raises(IllegalTransition):
        STEP_LIFECYCLE.check(S.FAILED, S.PENDING)  # a failed step's upstream steps all succeeded
    assert {J.FAILED, J.CANCELLED, J.SUCCEEDED} == TERMINAL_JOB_STATES
    assert {S.FAILED, S.CANCELLED, S.SKIPPED, S.SUCCEEDED} <= TERMINAL_STEP_STATES


def test_a_failed_chain_reopens_from_its_failed_step() -> None:
    plan = plan_retry(
        "job-1", J.FAILED, True, _steps(prep=S.SUCCEEDED, train=S.FAILED, eval=S.SKIPPED), by="alice"
    )
    assert plan == RetryPlan(
        "job-1",
        J.FAILED,
        J.RUNNING,
        (
            StepChange("train", S.FAILED, S.READY, "retried by alice"),
            StepChange("eval", S.SKIPPED, S.PENDING, "retried by alice: waiting for train"),
        ),
        "retried by alice: train, eval back to work",
        kept=("prep",),
    )
    assert (plan.ready, plan.pending) == (("train",), ("eval",))


def test_a_skipped_sibling_whose_upstream_succeeded_is_ready_at_once() -> None:
    steps = [
        StepView("prep", S.SUCCEEDED, ()),
        StepView("a", S.FAILED, ("prep",)),
        StepView("b", S.SKIPPED, ("prep",)),
        StepView("join", S.SKIPPED, ("a", "b")),
    ]
    plan = plan_retry("job-1", J.FAILED, True, steps, by="bob")
    assert isinstance(plan, RetryPlan)
    assert [(m.step, m.to_state) for m in plan.steps] == [("a", S.READY), ("b", S.READY), ("join", S.PENDING)]
    # From there the DAG behaves as for a new job: nothing is skipped again, join waits.
    after = {s.name: s.state for s in steps} | {m.step: m.to_state for m in plan.steps}
    view = JobView("job-1", plan.to_state, tuple(StepView(s.name, after[s.name], s.depends) for s in steps))
    assert advance(view).empty


def test_a_job_cancelled_before_it_started_goes_back_to_queued() -> None:
    plan = plan_retry("job-1", J.CANCELLED, False, _steps(prep=S.CANCELLED, train=S.CANCELLED), by="a")
    assert isinstance(plan, RetryPlan)
    assert plan.to_state == J.QUEUED
    assert [(m.step, m.to_state) for m in plan.steps] == [("prep", S.READY), ("train", S.PENDING)]


@pytest.mark.parametrize(
    ("state", "steps", "reason"),
    [
        (J.QUEUED, {"prep": S.READY}, "already running"),
        (J.RUNNING, {"prep": S.RUNNING}, "already running"),
        (J.CANCELLING, {"prep": S.CANCELLING}, "still stopping: retry it once it is CANCELLED"),
        (J.SUCCEEDED, {"prep": S.SUCCEEDED}, "nothing failed: it SUCCEEDED (rerun makes a new job)"),
        (J.CANCELLED, {"prep": S.SUCCEEDED}, "nothing to retry: every step SUCCEEDED"),
        (J.FAILED, {"prep": S.FAILED, "x": S.PREEMPTING}, "still stopping: step x holds GPUs"),
    ],
)
def test_what_is_refused_and_why(state: JobState, steps: dict[str, StepState], reason: str) -> None:
    refused = plan_retry("job-1", state, True, _steps(**steps), by="alice")
    assert refused == RetryRefused("job-1", state, reason)
    assert isinstance(refused, RetryRefused) and refused.message == f"job job-1 is {state.value}: {reason}"
