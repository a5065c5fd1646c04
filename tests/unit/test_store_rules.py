"""The rules both stores apply, as pure functions: `policy.attempt_rules`, `policy.job_rules`,
`policy.pool_rules` and `policy.fairshare.fold_usage`."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowtide.domain.gpus import GpuRef
from lowtide.domain.spec import ResolvedStep
from lowtide.domain.states import AttemptState, JobState, ReplicaState, StepState
from lowtide.policy import attempt_rules as ar
from lowtide.policy import job_rules as jr
from lowtide.policy import pool_rules as pr
from lowtide.policy.dag import JobChange, StepChange
from lowtide.policy.fairshare import decay, decayed_integral, fold_usage
from lowtide.policy.outcomes import ExitDecision
from lowtide.policy.reclaim import RunningVictim, victim_cost

A, S, J, R = AttemptState, StepState, JobState, ReplicaState

# -- attempt_rules -------------------------------------------------------------------------------


def test_a_checkpoint_counts_only_if_taken_during_the_attempt() -> None:
    assert ar.counted_checkpoint(None, 100.0) is None
    assert ar.counted_checkpoint(99.0, 100.0) is None  # an earlier attempt's
    assert ar.counted_checkpoint(100.0, 100.0) == 100.0
    assert ar.counted_checkpoint(150.0, 100.0) == 150.0


def test_lost_work_runs_from_the_counted_checkpoint_or_the_start() -> None:
    assert ar.lost_work(2, 100.0, None, 160.0) == 120.0
    assert ar.lost_work(2, 100.0, 150.0, 160.0) == 20.0
    assert ar.lost_work(2, 100.0, 50.0, 160.0) == 120.0  # the old checkpoint does not count
    assert ar.lost_work(2, 100.0, None, 90.0) == 0.0  # never negative
    assert ar.lost_work(0, 100.0, None, 160.0) == 0.0
    assert ar.lost_work_at_exit(A.SUCCEEDED, 2, 100.0, None, 160.0) == 0.0
    for state in (A.FAILED, A.INTERRUPTED, A.LOST):
        assert ar.lost_work_at_exit(state, 2, 100.0, 150.0, 160.0) == 20.0


@given(
    gpus=st.integers(1, 8),
    start=st.floats(0, 1e6),
    ckpt=st.one_of(st.none(), st.floats(0, 2e6)),
    now=st.floats(0, 2e6),
    restart=st.floats(0, 1e3),
)
def test_reclaim_prices_a_victim_with_the_lost_work_the_store_records(
    gpus: int, start: float, ckpt: float | None, now: float, restart: float
) -> None:
    victim = RunningVictim(1, "j", "s", "t", 50, "n1", tuple(range(gpus)), start, ckpt, restart_s=restart)
    cost, lost = victim_cost(victim, now)
    assert lost == ar.lost_work_at_exit(A.INTERRUPTED, gpus, start, ckpt, now)
    assert cost == lost + gpus * restart


def test_notice_is_due_for_running_attempts_of_cancelled_or_preempted_steps() -> None:
    assert ar.notice_due(A.RUNNING, S.CANCELLING) and ar.notice_due(A.RUNNING, S.PREEMPTING)
    assert not ar.notice_due(A.STOPPING, S.PREEMPTING)  # notice given already
    assert not ar.notice_due(A.RUNNING, S.RUNNING)
    assert ar.notice_grace(None, 30.0) == 30.0
    assert ar.notice_grace(5.0, 30.0) == 5.0
    assert ar.notice_grace(0.0, 30.0) == 0.0  # a zero grace is a grace
    assert ar.preemption_grace(60.0, 30.0) == 30.0 and ar.preemption_grace(10.0, 30.0) == 10.0


def test_a_running_step_is_stopping_once_notice_is_asked_for_or_given() -> None:
    assert not ar.is_stopping(A.RUNNING, S.RUNNING)
    assert ar.is_stopping(A.STOPPING, S.RUNNING)
    assert ar.is_stopping(A.RUNNING, S.PREEMPTING) and ar.is_stopping(A.RUNNING, S.CANCELLING)


def test_the_scheduler_rows() -> None:
    q = ar.queued_step(
        job_id="j",
        step="s",
        step_index=1,
        state=S.PREEMPTED,
        gpus=2,
        eligible_at=5.0,
        retries_used=1,
        max_retries=2,
        team="t",
        priority=50,
        submitted_at=1.0,
    )
    assert (q.preempted, q.retry_note, q.key) == (True, "attempt 2 of 3", ("j", "s"))
    assert ar.retry_note(0, 3) == ""
    r = ar.running_step(
        attempt_id=7,
        attempt_state=A.RUNNING,
        job_id="j",
        step="s",
        step_state=S.RUNNING,
        team="t",
        priority=50,
        node="n1",
        gpus=[0, 1],
        started_at=100.0,
        last_checkpoint_at=90.0,
        min_runtime=10.0,
        restart_seconds=5.0,
    )
    assert (r.gpus, r.last_checkpoint_at, r.stopping) == ((0, 1), None, False)


def test_starting_an_attempt() -> None:
    assert ar.can_start(J.QUEUED) and ar.can_start(J.RUNNING)
    assert not any(ar.can_start(s) for s in (J.SUCCEEDED, J.FAILED, J.CANCELLED))
    assert ar.job_state_on_start(J.QUEUED) == J.RUNNING and ar.job_state_on_start(J.RUNNING) is None
    assert ar.next_attempt_number(None) == 1 and ar.next_attempt_number(3) == 4
    assert ar.start_message(2, "n1", (0, 3)) == "attempt 2 started on n1 GPUs 0,3"
    assert ar.start_message(1, "n1", ()) == "attempt 1 started on n1 (no GPUs)"
    resolved = ResolvedStep("s", ("run",), 1, None, {}, {"up": "/o"}, "/out", "/ck")
    spec = {"params": {"lr": 1}}
    record = ar.reproducibility_record(
        spec=spec, resolved_doc={"name": "s"}, resolved=resolved, last_checkpoint="c3", node="n1", gpus=(1,)
    )
    assert record["params"] == {"lr": 1} and record["params"] is not spec["params"]
    assert (record["resume_from"], record["gpus"], record["inputs"]) == ("c3", [1], {"up": "/o"})
    assert ar.launch_params({}) == {}


def test_the_attempt_record_keeps_the_job_fields_and_only_its_own_step() -> None:
    spec = {"name": "j", "timeout": 60, "steps": [{"name": f"s{i}", "command": ["x"]} for i in range(3)]}
    resolved = ResolvedStep("s1", ("x",), 0, None, {}, {}, "/out", None)
    record = ar.reproducibility_record(
        spec=spec, resolved_doc={"name": "s1"}, resolved=resolved, last_checkpoint=None, node="n", gpus=()
    )
    assert record["spec"] == {"name": "j", "timeout": 60, "steps": [{"name": "s1", "command": ["x"]}]}
    assert len(spec["steps"]) == 3  # the job's own spec is untouched


def test_checkpoints_and_exits() -> None:
    assert ar.checkpoint_is_new(None, "c1") and not ar.checkpoint_is_new("c1", "c1")
    assert ar.checkpoint_message("c1", "3/9") == "checkpoint c1 (3/9)"
    assert ar.checkpoint_message("c1", None) == "checkpoint c1"
    preempted = ExitDecision(A.INTERRUPTED, S.PREEMPTED, 0, 0.0, "preempted", requeued=True, preempted=True)
    assert ar.preemption_increment(preempted) == 1
    assert ar.preemption_increment(ExitDecision(A.FAILED, S.FAILED, 0, 0.0, "failed")) == 0
    assert ar.exit_event_kind(A.INTERRUPTED) == "interrupted"


# -- fairshare.fold_usage ------------------------------------------------------------------------


def test_fold_usage_decays_the_old_value_and_adds_the_decayed_integral() -> None:
    h = 3600.0
    assert fold_usage(None, gpus=0, start=0.0, end=10.0, now=10.0, half_life_s=h) is None
    assert fold_usage((5.0, 0.0), gpus=0, start=0.0, end=10.0, now=10.0, half_life_s=h) is None
    first = fold_usage(None, gpus=2, start=0.0, end=100.0, now=100.0, half_life_s=h)
    assert first == (decayed_integral(2, 0.0, 100.0, 100.0, h), 100.0)
    assert first is not None and 0 < first[0] < 200.0
    again = fold_usage(first, gpus=1, start=100.0, end=h + 100.0, now=h + 100.0, half_life_s=h)
    assert again is not None
    assert again[1] == h + 100.0
    assert again[0] == pytest.approx(first[0] / 2 + h / math.log(2) / 2)
    assert again[0] == decay(first[0], 100.0, h + 100.0, h) + decayed_integral(
        1, 100.0, h + 100.0, h + 100.0, h
    )


# -- job_rules -----------------------------------------------------------------------------------


def test_new_steps_and_cancelling() -> None:
    assert jr.initial_step_state(()) == S.READY and jr.initial_reason(()) == ""
    assert jr.initial_step_state(("a", "b")) == S.PENDING
    assert jr.initial_reason(("a", "b")) == "waiting for a, b"
    assert jr.submit_message("al", None) == "submitted by al"
    assert jr.submit_message("al", "job-1") == "submitted by al (rerun of job-1)"
    assert jr.step_counts([S.READY, S.PENDING, S.READY]) == {"PENDING": 1, "READY": 2}
    assert list(jr.step_counts(["RUNNING", "FAILED"])) == ["FAILED", "RUNNING"]
    assert jr.cancels(J.QUEUED) and jr.cancels(J.RUNNING) and not jr.cancels(J.SUCCEEDED)
    moves = {s: jr.cancel_move(s) for s in StepState}
    assert {s for s, m in moves.items() if m and m.target == S.CANCELLED} == {S.PENDING, S.READY, S.PREEMPTED}
    assert {s for s, m in moves.items() if m and m.target == S.CANCELLING} == {S.RUNNING, S.PREEMPTING}
    assert moves[S.CANCELLING] is None and moves[S.SUCCEEDED] is None
    assert jr.CANCEL_MOVES[0].target == S.CANCELLED  # not-started steps move first
    assert jr.cancel_message("al", 0) == "cancelled by al"
    assert jr.cancel_message("al", 2) == "cancelled by al; stopping 2 running step(s)"


def test_which_jobs_the_dag_may_move_and_its_events() -> None:
    assert jr.job_may_move(J.RUNNING, [S.SUCCEEDED])
    assert jr.job_may_move(J.CANCELLED, [S.CANCELLING])  # a step still stopping
    assert not jr.job_may_move(J.CANCELLED, [S.CANCELLED, S.SUCCEEDED])
    assert not jr.job_may_move(J.SUCCEEDED, [])
    assert jr.dag_step_event(StepChange("s", S.PENDING, S.READY, "up")) is None
    assert jr.dag_step_event(StepChange("s", S.PENDING, S.SKIPPED, "why")) == ("skipped", "why")
    assert jr.dag_job_event(JobChange(J.RUNNING, J.FAILED, "x")) == ("failed", "x")


# -- pool_rules ----------------------------------------------------------------------------------


def test_reconciling_the_managed_gpus_keeps_one_open_interval_each() -> None:
    a0, a1, b0 = GpuRef("a", 0), GpuRef("a", 1), GpuRef("b", 0)
    close, missing = pr.reconcile_gpus({a0: "idle", a1: "attempt"}, [b0, a0])
    assert (close, missing) == ([], [b0])
    close, missing = pr.reconcile_gpus({a0: "idle", a1: "attempt", b0: "idle"}, [b0])
    assert (close, missing) == ([a0], [])  # a1 stays open until its holder releases it
    assert pr.bookable("idle") and not pr.bookable("replica") and not pr.bookable(None)


def test_replicas_and_reclaims() -> None:
    assert pr.replica_start_state(True) == R.WAKING and pr.replica_start_state(False) == R.STARTING
    assert pr.replica_releases_gpus(R.PARKING, R.PARKED) and pr.replica_releases_gpus(R.SERVING, R.FAILED)
    assert not pr.replica_releases_gpus(R.PARKED, R.FAILED)  # held nothing
    assert not pr.replica_releases_gpus(R.SERVING, R.DRAINING)
    pr.check_reclaim_update(["notice_at", "state"])
    with pytest.raises(ValueError, match="victims"):
        pr.check_reclaim_update(["victims"])


def test_which_intervals_meet_a_period_and_their_sum() -> None:
    assert pr.meets_period(0.0, None, 5.0, 10.0) and pr.meets_period(0.0, 6.0, 5.0, 10.0)
    assert not pr.meets_period(0.0, 5.0, 5.0, 10.0) and not pr.meets_period(10.0, None, 5.0, 10.0)
    rows = [("idle", 0.0, 6.0), ("attempt", 6.0, None), ("replica", 0.0, 1.0), ("idle", 20.0, None)]
    assert pr.gpu_seconds_by_kind(rows, 5.0, 10.0) == {"idle": 1.0, "attempt": 4.0}
    assert pr.gpu_seconds_by_kind(reversed(rows), 5.0, 10.0) == pr.gpu_seconds_by_kind(rows, 5.0, 10.0)
    assert {A.INTERRUPTED, A.LOST} == pr.REPORTED_ENDED_STATES
