"""An attempt that ended because the container engine failed is not the step's failure (§6.4)."""

from __future__ import annotations

from typing import Any

import pytest

from lowtide.domain.states import AttemptState, StepState
from lowtide.policy.outcomes import ExitDecision, RetryPolicy, classify_exit, classify_launch_failure

RETRY = RetryPolicy(backoff_s=10.0, backoff_max_s=600.0)
REASON = "container engine failed (exit 125): Cannot connect to the Docker daemon"


def decide(
    step_state: StepState, *, infrastructure: str | None, retries_used: int = 1, **kw: Any
) -> ExitDecision:
    return classify_exit(
        step_state=step_state,
        exit_code=125,
        signal=None,
        killed_at_deadline=False,
        retries_used=retries_used,
        max_retries=1,
        now=1000.0,
        retry=RETRY,
        infrastructure=infrastructure,
        **kw,
    )


def test_an_engine_failure_requeues_with_backoff_and_uses_no_retry() -> None:
    d = decide(StepState.RUNNING, infrastructure=REASON, retries_used=1)
    assert (d.attempt_state, d.step_state, d.retries_used) == (AttemptState.FAILED, StepState.READY, 1)
    assert d.requeued and not d.preempted
    assert d.eligible_at == 1000.0 + RETRY.delay(1)
    assert d.message.startswith(REASON)


def test_the_same_exit_without_the_engine_flag_is_the_steps_last_failure() -> None:
    d = decide(StepState.RUNNING, infrastructure=None, retries_used=1)
    assert (d.attempt_state, d.step_state) == (AttemptState.FAILED, StepState.FAILED)
    assert "exit code 125" in d.message


def test_a_cancelled_step_ends_cancelled_even_when_the_engine_failed() -> None:
    d = decide(StepState.CANCELLING, infrastructure=REASON, noticed=True)
    assert d.step_state == StepState.CANCELLED


@pytest.mark.parametrize("max_preemptions", [None, 5])
def test_a_preempted_step_stays_a_preemption(max_preemptions: int | None) -> None:
    d = decide(StepState.PREEMPTING, infrastructure=REASON, noticed=True, max_preemptions=max_preemptions)
    assert d.step_state == StepState.PREEMPTED and d.preempted and d.retries_used == 1


# -- launch failures of the infrastructure (docs/architecture.md §4.4) ----------------------------


def launch_failure(step_state: StepState, *, infrastructure: str | None, streak: int = 0) -> ExitDecision:
    return classify_launch_failure(
        step_state=step_state,
        message="cannot create /art/jobs/j/out: Not a directory",
        temporary=True,
        retries_used=0,
        max_retries=0,
        now=1000.0,
        retry=RETRY,
        infrastructure=infrastructure,
        infrastructure_failures=streak,
    )


def test_an_infrastructure_launch_failure_uses_no_retry_and_backs_off_growing() -> None:
    delays = []
    for streak in range(8):
        d = launch_failure(StepState.RUNNING, infrastructure="storage", streak=streak)
        assert (d.attempt_state, d.step_state, d.retries_used, d.requeued) == (
            AttemptState.FAILED,
            StepState.READY,
            0,
            True,
        )
        assert "storage" in d.message and "not the step's failure" in d.message
        delays.append(d.eligible_at - 1000.0)
    assert delays == [10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 600.0, 600.0]  # growing, capped


def test_an_infrastructure_launch_failure_of_a_cancelled_step_still_cancels() -> None:
    d = launch_failure(StepState.CANCELLING, infrastructure="storage")
    assert d.step_state == StepState.CANCELLED
