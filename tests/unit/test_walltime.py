"""policy.walltime (which attempts are past their step's timeout, the cumulative budget, the
verdict at exit) and how policy.outcomes turns that verdict into FAILED without a retry."""

from __future__ import annotations

import pytest

from lowtide.domain.spec_parse import build_job_spec
from lowtide.domain.states import AttemptState, StepState
from lowtide.policy import walltime
from lowtide.policy.outcomes import ExitDecision, RetryPolicy, classify_exit, classify_lost
from lowtide.policy.walltime import WalltimeBudget

T0 = 1_000_000.0


def budget(
    attempt_id: int = 1,
    *,
    started_at: float = T0,
    limit: float | None = 7200.0,
    used: float = 0.0,
    number: int = 1,
) -> WalltimeBudget:
    return WalltimeBudget(attempt_id, "job-1", "train", number, started_at, limit, used, grace_s=30.0)


# --- where the limit comes from ------------------------------------------------------------------


def test_a_steps_own_timeout_beats_the_jobs_which_beats_the_default() -> None:
    spec = build_job_spec(
        {
            "name": "j",
            "timeout": "3h",
            "grace_seconds": 45,
            "steps": [{"name": "a", "command": ["x"], "timeout": "90m"}, {"name": "b", "command": ["x"]}],
        }
    )
    timeouts = walltime.job_timeouts(spec.to_document())
    assert timeouts.limit("a", 60.0) == 5400.0
    assert timeouts.limit("b", 60.0) == 10800.0
    assert timeouts.grace_s == 45.0
    bare = walltime.job_timeouts(
        build_job_spec({"name": "j", "steps": [{"name": "a", "command": ["x"]}]}).to_document()
    )
    assert bare.limit("a", 60.0) == 60.0
    assert bare.limit("a", None) is None


def test_what_is_not_a_positive_number_in_a_stored_spec_is_no_limit() -> None:
    timeouts = walltime.job_timeouts(
        {"timeout": "2h", "steps": [{"name": "a", "timeout": True}, {"name": "b", "timeout": -5}, "junk"]}
    )
    assert timeouts.limit("a", None) is None and timeouts.limit("b", 7.0) == 7.0
    assert timeouts.grace_s == 30.0  # no grace in the document: the spec's default


# --- deadlines: the budget is summed over attempts ------------------------------------------------


def test_the_deadline_is_the_start_plus_what_is_left_of_the_budget() -> None:
    assert budget(limit=None).deadline is None
    assert budget().deadline == T0 + 7200
    assert budget(used=5000).deadline == T0 + 2200
    assert budget(used=9000).deadline == T0  # spent before it started: due at once


def test_earlier_attempts_count_from_start_to_end_and_queue_time_does_not() -> None:
    # Attempt 1 ran 0→3000 (preempted), waited in the queue 3000→5000, attempt 2 ran 5000→6000.
    attempts = [(1, 0.0, 3000.0), (2, 5000.0, 6000.0), (3, 9000.0, None)]
    assert walltime.used_before(attempts, 3) == 4000.0
    assert walltime.used_before(attempts, 2) == 3000.0
    assert walltime.used_before(attempts, 1) == 0.0


def test_overdue_picks_the_attempts_past_their_deadline_earliest_first() -> None:
    budgets = [
        budget(1, started_at=T0),  # due T0+7200
        budget(2, started_at=T0 - 100),  # due T0+7100
        budget(3, started_at=T0 + 10),  # due T0+7210: not yet
        budget(4, limit=None),
        budget(5, started_at=T0 + 500, used=7700),  # spent already: due at its start
    ]
    due = walltime.overdue(budgets, T0 + 7200)
    assert [b.attempt_id for b in due] == [5, 2, 1]
    assert walltime.next_deadline(budgets, T0 + 7200) == T0 + 7210
    assert walltime.next_deadline([budget(limit=None)], T0) is None


def test_the_answer_derives_from_stored_values_only_so_a_restart_changes_nothing() -> None:
    # A new control plane rebuilds the budget from the same stored rows: same deadline, same verdict.
    stored_attempts = [(1, T0 - 4000, T0 - 1000), (2, T0, None)]
    rebuilt = [
        budget(2, started_at=T0, used=walltime.used_before(stored_attempts, 2), number=2) for _ in range(2)
    ]
    assert rebuilt[0] == rebuilt[1]
    assert rebuilt[0].deadline == T0 + 4200
    assert walltime.overdue(rebuilt[:1], T0 + 4199) == []
    assert walltime.overdue(rebuilt[:1], T0 + 4200) == rebuilt[:1]


# --- reasons and verdicts -----------------------------------------------------------------------


def test_the_stop_reason_marks_a_timeout_and_says_the_limit() -> None:
    reason = walltime.stop_reason(budget())
    assert reason == "timeout: walltime limit of 2h reached; notice given, deadline in 30s"
    assert walltime.is_timeout_stop(reason)
    assert not walltime.is_timeout_stop("GPUs reclaimed: notice given, deadline in 30s")
    assert not walltime.is_timeout_stop(None)
    assert walltime.stopping_reason(budget(used=60, number=2)) == (
        "walltime limit of 2h reached, summed over 2 attempts: stopping (grace 30s), then FAILED"
    )


def test_the_verdict_at_exit() -> None:
    stop = walltime.stop_reason(budget())
    assert (
        walltime.timed_out(budget(), ended_at=T0 + 7230, stop_reason=stop)
        == "timed out after 2h (walltime limit)"
    )
    # Ended on its own after its deadline, before the loop noticed: timed out too.
    assert walltime.timed_out(budget(), ended_at=T0 + 7201, stop_reason=None) is not None
    # Ended before: no verdict, whatever notice it had for another reason.
    assert walltime.timed_out(budget(), ended_at=T0 + 100, stop_reason="GPUs reclaimed: ...") is None
    # Preempted after the budget was spent: timed out, summed over its attempts.
    assert walltime.timed_out(
        budget(used=7000, number=3), ended_at=T0 + 300, stop_reason="GPUs reclaimed"
    ) == ("timed out after 2h (walltime limit, summed over 3 attempts)")
    assert walltime.timed_out(None, ended_at=T0, stop_reason=stop) == "timed out (walltime limit)"
    assert walltime.timed_out(None, ended_at=T0, stop_reason=None) is None


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(2, "2s"), (1.5, "1.5s"), (90, "1m 30s"), (5400, "1h 30m"), (7200, "2h"), (273600, "3d 4h")],
)
def test_durations_read_as_people_write_them(seconds: float, text: str) -> None:
    assert walltime.format_duration(seconds) == text


# --- the exit decision (policy.outcomes) ---------------------------------------------------------

RETRY = RetryPolicy(10, 600)


def decide(
    step_state: StepState, *, exit_code: int | None = 1, noticed: bool = True, killed: bool = False
) -> ExitDecision:
    return classify_exit(
        step_state=step_state,
        noticed=noticed,
        exit_code=exit_code,
        signal=9 if killed else None,
        killed_at_deadline=killed,
        retries_used=0,
        max_retries=3,
        now=T0,
        retry=RETRY,
        timed_out="timed out after 2h (walltime limit)",
    )


def test_a_timed_out_step_fails_without_a_retry_even_with_retries_left() -> None:
    d = decide(StepState.RUNNING, exit_code=143)
    assert (d.attempt_state, d.step_state, d.retries_used, d.requeued) == (
        AttemptState.INTERRUPTED,
        StepState.FAILED,
        0,
        False,
    )
    assert d.message == "timed out after 2h (walltime limit); exit code 143"
    killed = decide(StepState.RUNNING, exit_code=None, killed=True)
    assert killed.message == "timed out after 2h (walltime limit); killed at the grace deadline"
    on_its_own = decide(StepState.RUNNING, noticed=False)
    assert (on_its_own.attempt_state, on_its_own.step_state) == (AttemptState.FAILED, StepState.FAILED)


def test_exit_zero_still_means_done_and_a_cancel_still_wins() -> None:
    assert decide(StepState.RUNNING, exit_code=0).step_state == StepState.SUCCEEDED
    assert decide(StepState.CANCELLING).step_state == StepState.CANCELLED


def test_a_step_preempted_after_its_budget_ran_out_fails_instead_of_requeueing() -> None:
    d = decide(StepState.PREEMPTING)
    assert (d.step_state, d.requeued, d.preempted) == (StepState.FAILED, False, True)


def test_without_a_verdict_nothing_changes() -> None:
    d = classify_exit(
        step_state=StepState.RUNNING,
        exit_code=1,
        signal=None,
        killed_at_deadline=False,
        retries_used=0,
        max_retries=1,
        now=T0,
        retry=RETRY,
    )
    assert (d.step_state, d.requeued) == (StepState.READY, True)


def test_an_attempt_lost_after_its_timeout_notice_fails() -> None:
    d = classify_lost(
        step_state=StepState.RUNNING, retries_used=0, timed_out="timed out after 2h (walltime limit)"
    )
    assert (d.attempt_state, d.step_state, d.message) == (
        AttemptState.LOST,
        StepState.FAILED,
        "timed out after 2h (walltime limit); process lost",
    )
    assert classify_lost(step_state=StepState.RUNNING, retries_used=0).step_state == StepState.READY
