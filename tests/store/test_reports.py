"""Store.usage_report against SQLite, the real PostgreSQL server and memory: a hand-built ledger
read back exactly, a preemption and a cancellation written by the store's own functions, and the
add-up property over random hold/release sequences.

The hand-built ledger (rows and attempts written as raw SQL, with lost work no API call would
produce) and the ledger-module property run on the SQL backends only (`sql_store`); the add-up
property is checked again on every backend through the public API (attempts and replicas booked
and released by the store's own calls).
Times are whole seconds (hours in the hand-built ledger), so GPU-second figures compare with `==`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowtide.control.clock import FakeClock
from lowtide.control.records import GpuBusy, NewJob
from lowtide.domain.gpus import GpuRef, Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.spec_parse import build_job_spec
from lowtide.domain.spec_render import render_step
from lowtide.domain.states import AttemptState, ReplicaState, StepState
from lowtide.policy.outcomes import RetryPolicy, classify_exit
from lowtide.store import ledger
from lowtide.store.db import alembic_config
from lowtide.store.repo import Store
from lowtide.store.schema import attempts, gpu_ledger, steps
from support import running

H = 3600
T0 = 1_789_999_200  # a whole hour (2026-09-21 14:00 UTC)
LAYOUT = ArtifactLayout("/art", "/work")


def add_job(store: Store, job_id: str, name: str, team: str, gpus: int = 2) -> None:
    spec = build_job_spec(
        {
            "name": name,
            "team": team,
            "steps": [{"name": "train", "command": ["true"], "gpus": gpus, "checkpoint": True}],
        }
    )
    resolved = tuple(render_step(spec, s, job_id=job_id, layout=LAYOUT) for s in spec.steps)
    store.create_job(
        NewJob(
            id=job_id, spec=spec, resolved=resolved, source_text="", owner="alice", submitted_at=T0 - 10 * H
        )
    )


def add_attempt(
    store: Store,
    attempt_id: int,
    job_id: str,
    number: int,
    state: str,
    ended_at: float,
    lost: float,
    message: str,
) -> None:
    with store.engine.begin() as conn:
        step_id = conn.execute(sa.select(steps.c.id).where(steps.c.job_id == job_id)).scalar_one()
        conn.execute(
            sa.insert(attempts).values(
                id=attempt_id,
                job_id=job_id,
                step_id=step_id,
                step_name="train",
                number=number,
                state=state,
                node="n1",
                gpus=[0],
                started_at=ended_at - H,
                ended_at=ended_at,
                work_dir="/w",
                record={},
                message=message,
                lost_gpu_seconds=lost,
                preempted=message.startswith("preempted") or "during preemption" in message,
            )
        )


def add_row(store: Store, gpu: int, kind: str, start: float, end: float | None, **holder: Any) -> None:
    with store.engine.begin() as conn:
        conn.execute(
            sa.insert(gpu_ledger).values(
                node="n1", gpu_index=gpu, holder_kind=kind, started_at=start, ended_at=end, **holder
            )
        )


def build_ledger(store: Store) -> None:
    """Two GPUs over [T0, T0 + 10 h) (hours relative to T0):
    gpu 0: idle [-5, 1), attempt 1 of j1 (nlp) [1, 6), idle [6, open)
    gpu 1: replica chat/0 [-1, 4), attempt 2 of j2 (cv) [4, 13), idle [13, open)
    and a row long before the period."""
    add_job(store, "j1", "sft-8b", "nlp")
    add_job(store, "j2", "eval", "cv")
    add_row(store, 0, "idle", T0 - 5 * H, T0 + 1 * H)
    add_row(store, 0, "attempt", T0 + 1 * H, T0 + 6 * H, holder_id="1", job_id="j1", team="nlp")
    add_row(store, 0, "idle", T0 + 6 * H, None)
    add_row(store, 1, "replica", T0 - 1 * H, T0 + 4 * H, holder_id="chat/0")
    add_row(store, 1, "attempt", T0 + 4 * H, T0 + 13 * H, holder_id="2", job_id="j2", team="cv")
    add_row(store, 1, "idle", T0 + 13 * H, None)
    add_row(store, 1, "attempt", T0 - 9 * H, T0 - 5 * H, holder_id="9", job_id="j1", team="nlp")
    add_attempt(store, 1, "j1", 1, "INTERRUPTED", T0 + 6 * H, 2 * H, "preempted (exit code 143); requeued")
    add_attempt(store, 3, "j1", 2, "LOST", T0 + 7 * H, 1 * H, "process lost during preemption; requeued")
    add_attempt(store, 4, "j2", 1, "INTERRUPTED", T0 + 8 * H, 5 * H, "cancelled (exit code 143)")
    add_attempt(store, 5, "j2", 2, "FAILED", T0 + 9 * H, 4 * H, "failed (exit code 1)")
    add_attempt(store, 6, "j2", 3, "INTERRUPTED", T0 + 10 * H, 7 * H, "preempted (exit code 1); requeued")
    add_attempt(store, 7, "j2", 4, "INTERRUPTED", T0 - 1, 7 * H, "preempted (exit code 1); requeued")


def test_a_hand_built_ledger_reads_back_exactly(sql_store: Store) -> None:
    store = sql_store
    build_ledger(store)
    r = store.usage_report(T0, T0 + 10 * H, group_by="job", tz="UTC", price_per_gpu_hour=2.5, currency="EUR")
    t = r.totals
    assert (t.idle_gpu_seconds, t.research_gpu_seconds, t.inference_gpu_seconds) == (5 * H, 11 * H, 4 * H)
    assert t.capacity_gpu_seconds == 20 * H and t.lent_gpu_seconds == 16 * H
    assert (t.capacity_gpus, t.lent_gpus, t.research_gpus, t.inference_gpus) == (2.0, 1.6, 1.1, 0.4)
    # Preempted: attempts 1 and 3 (lost during preemption). Not 4 (cancelled), 5 (failed), 6 and 7
    # (ended at the period's end and before its start).
    assert (t.lost_gpu_seconds, t.preemptions, t.savings) == (3 * H, 2, 27.5)
    assert (r.currency, r.price_per_gpu_hour, r.timezone, r.hours) == ("EUR", 2.5, "UTC", 10.0)
    assert [
        (x.key, x.job_name, x.team, x.research_gpu_seconds, x.lost_gpu_seconds, x.preemptions) for x in r.rows
    ] == [
        ("j2", "eval", "cv", 6 * H, 0.0, 0),
        ("j1", "sft-8b", "nlp", 5 * H, 3 * H, 2),
    ]
    by_team = store.usage_report(T0, T0 + 10 * H, group_by="team", tz="UTC")
    assert [(x.key, x.research_gpu_seconds, x.savings) for x in by_team.rows] == [
        ("cv", 6 * H, 0.0),
        ("nlp", 5 * H, 0.0),
    ]
    holders = store.usage_report(T0, T0 + 10 * H, group_by="holder", tz="UTC")
    assert {x.key: x.capacity_gpu_seconds for x in holders.rows} == {
        "attempt:2": 6 * H,
        "idle": 5 * H,
        "attempt:1": 5 * H,
        "replica:chat/0": 4 * H,
        "attempt:3": 0.0,
    }
    # The quick per-kind sum of the pool agrees.
    assert store.gpu_seconds_by_holder(T0, T0 + 10 * H) == {
        "idle": 5 * H,
        "attempt": 11 * H,
        "replica": 4 * H,
    }


def test_open_rows_count_up_to_the_end_of_the_period_and_days_follow_the_zone(sql_store: Store) -> None:
    store = sql_store
    build_ledger(store)
    # Up to T0 + 20 h: the open idle rows run to the end; attempt 2 ended at 13 h.
    t = store.usage_report(T0, T0 + 20 * H, group_by="job", tz="UTC").totals
    assert (t.idle_gpu_seconds, t.research_gpu_seconds, t.inference_gpu_seconds) == (
        1 * H + 14 * H + 7 * H,
        5 * H + 9 * H,
        4 * H,
    )
    assert t.capacity_gpu_seconds == 40 * H
    # T0 is 16:00 in Berlin (CEST): the first local day ends 8 hours in.
    days = store.usage_report(T0, T0 + 20 * H, group_by="day", tz="Europe/Berlin")
    assert [(d.key, d.period_seconds, d.capacity_gpu_seconds) for d in days.rows] == [
        ("2026-09-21", 8 * H, 16 * H),
        ("2026-09-22", 12 * H, 24 * H),
    ]
    assert [(d.preemptions, d.lost_gpu_seconds) for d in days.rows] == [(2, 3 * H), (1, 7 * H)]


def test_bad_requests_raise_value_errors(store: Store) -> None:
    with pytest.raises(ValueError, match="empty"):
        store.usage_report(T0, T0, group_by="job", tz="UTC")
    with pytest.raises(ValueError, match="time zone"):
        store.usage_report(T0, T0 + H, group_by="job", tz="Nowhere/Town")


def test_a_preemption_and_a_cancellation_written_by_the_store_are_told_apart(store: Store) -> None:
    """The loop's path: start, checkpoint, preempt with notice, exit; then resume and cancel."""
    clock = FakeClock(T0)
    nodes = (Node("n1", (0, 1, 2, 3)),)
    store.ensure_gpus(nodes, clock.now())
    add_job(store, "job-1", "sft", "nlp", gpus=2)

    def run_until_stopped(step_state: StepState, *, checkpoint_after: float | None, runs: float) -> int:
        launch = running(
            store,
            store.begin_attempt(
                job_id="job-1",
                step="train",
                node="n1",
                gpus=(0, 1),
                layout=LAYOUT,
                now=clock.now(),
                reason="test",
            ),
        )
        if checkpoint_after is not None:
            clock.advance(checkpoint_after)
            store.record_checkpoint(
                launch.attempt_id, label=f"c{launch.number}", progress=None, source="api", now=clock.now()
            )
        clock.advance(runs)
        if step_state == StepState.PREEMPTING:
            store.request_preemption(launch.attempt_id, grace_s=30, reason="GPUs reclaimed", now=clock.now())
        else:
            store.request_cancel("job-1", by="alice", now=clock.now())
        store.mark_stopping(launch.attempt_id, deadline=clock.now() + 30, reason="notice", now=clock.now())
        clock.advance(10)
        ctx = store.exit_context(launch.attempt_id)
        decision = classify_exit(
            step_state=ctx.step_state,
            noticed=True,
            exit_code=143,
            signal=None,
            killed_at_deadline=False,
            retries_used=ctx.retries_used,
            max_retries=ctx.max_retries,
            now=clock.now(),
            retry=RetryPolicy(),
            preemptions=ctx.preemptions,
        )
        store.finish_attempt(
            ctx,
            decision,
            ended_at=clock.now(),
            exit_code=143,
            signal=None,
            killed_at_deadline=False,
            half_life_s=H,
        )
        return launch.attempt_id

    first = run_until_stopped(StepState.PREEMPTING, checkpoint_after=600, runs=300)  # 2 GPUs × 310 s lost
    clock.advance(50)
    second = run_until_stopped(StepState.CANCELLING, checkpoint_after=None, runs=200)  # 2 × 210 s, cancelled
    detail = {a.id: a for a in store.job_detail("job-1").attempts}
    assert (detail[first].state, detail[first].lost_gpu_seconds) == (AttemptState.INTERRUPTED, 620.0)
    assert (detail[second].state, detail[second].lost_gpu_seconds) == (AttemptState.INTERRUPTED, 420.0)
    assert detail[first].preempted and not detail[second].preempted  # the decision, recorded

    r = store.usage_report(T0, clock.now(), group_by="job", tz="UTC")
    assert (r.totals.preemptions, r.totals.lost_gpu_seconds) == (1, 620.0)
    assert r.totals.research_gpu_seconds == 2 * (910 + 210)
    assert r.totals.capacity_gpu_seconds == 4 * (clock.now() - T0)
    assert [(x.key, x.preemptions, x.lost_gpu_seconds) for x in r.rows] == [("job-1", 1, 620.0)]
    assert store.job_detail("job-1").steps[0].preemptions == 1


# -- the add-up property on the store ------------------------------------------------------------

GPUS = [GpuRef("n1", i) for i in range(3)]
operations = st.lists(
    st.tuples(
        st.integers(1, 4 * H),  # time since the previous operation
        st.sampled_from(["hold-attempt", "hold-replica", "release"]),
        st.integers(0, 2),  # which GPU
        st.integers(1, 4),  # which holder
    ),
    max_size=12,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations, start_off=st.integers(-2 * H, 30 * H), length=st.integers(1, 40 * H))
def test_ledger_gpu_seconds_add_up_to_capacity_times_time(
    sql_store: Store, ops: list[tuple[int, str, int, int]], start_off: int, length: int
) -> None:
    store = sql_store
    with store.engine.begin() as conn:
        conn.execute(sa.delete(gpu_ledger))
        ledger.ensure_gpus(conn, GPUS, T0)
        now = T0
        for gap, op, gpu, holder in ops:
            now += gap
            if op == "release":
                for kind in (ledger.ATTEMPT, ledger.REPLICA):
                    ledger.release(conn, kind=kind, holder_id=str(holder), now=now)
                continue
            kind = ledger.ATTEMPT if op == "hold-attempt" else ledger.REPLICA
            with contextlib.suppress(GpuBusy):  # one GPU: a busy one fails before anything is written
                ledger.hold(
                    conn,
                    [GPUS[gpu]],
                    kind=kind,
                    holder_id=str(holder),
                    job_id=f"j{holder}" if kind == ledger.ATTEMPT else None,
                    team="nlp" if kind == ledger.ATTEMPT else None,
                    now=now,
                )
    start, end = float(T0 + start_off), float(T0 + start_off + length)
    for group_by in ("holder", "day"):
        r = store.usage_report(start, end, group_by=group_by, tz="Europe/Berlin")  # type: ignore[arg-type]
        t = r.totals
        covered = max(0.0, end - max(start, T0))  # every GPU is in the ledger from T0 on
        assert t.capacity_gpu_seconds == len(GPUS) * covered
        assert t.idle_gpu_seconds + t.research_gpu_seconds + t.inference_gpu_seconds == t.capacity_gpu_seconds
        assert sum(x.capacity_gpu_seconds for x in r.rows) == t.capacity_gpu_seconds
    by_kind = store.gpu_seconds_by_holder(start, end)
    assert by_kind.get("attempt", 0.0) == t.research_gpu_seconds
    assert by_kind.get("replica", 0.0) == t.inference_gpu_seconds


def test_migration_0004_marks_earlier_preemptions_from_their_messages(sql_store: Store) -> None:
    """Attempts that ended before the `preempted` column existed get it from the exit message,
    the only record of it then; a downgrade and upgrade round-trip shows both directions work.
    SQL only: a migration."""
    store = sql_store
    add_job(store, "j1", "a", "nlp")
    add_attempt(store, 1, "j1", 1, "INTERRUPTED", T0, H, "preempted (exit code 143); requeued")
    add_attempt(store, 2, "j1", 2, "LOST", T0 + 1, H, "process lost during preemption; requeued")
    add_attempt(store, 3, "j1", 3, "INTERRUPTED", T0 + 2, H, "cancelled (exit code 143)")
    add_attempt(store, 4, "j1", 4, "FAILED", T0 + 3, H, "preempted (exit code 1) 3 times; failed")
    cfg = alembic_config(store.engine.url.render_as_string(hide_password=False))
    with store.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0003")
        assert "preempted" not in {c["name"] for c in sa.inspect(conn).get_columns("attempts")}
        command.upgrade(cfg, "head")
    flags = {a.id: a.preempted for a in store.job_detail("j1").attempts}
    assert flags == {1: True, 2: True, 3: False, 4: False}


api_operations = st.lists(
    st.tuples(
        st.integers(1, 4 * H),  # time since the previous operation
        st.sampled_from(["hold-attempt", "hold-replica", "release"]),
        st.integers(0, 2),  # which GPU
        st.integers(1, 3),  # which holder
    ),
    max_size=12,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=api_operations, start_off=st.integers(-2 * H, 30 * H), length=st.integers(1, 40 * H))
def test_gpu_seconds_booked_through_the_api_add_up_to_capacity_times_time(
    new_store: Callable[[], Store], ops: list[tuple[int, str, int, int]], start_off: int, length: int
) -> None:
    """Every backend: attempts and replicas take and give back GPUs through the store's own calls
    (a busy GPU fails the call and changes nothing); the ledger still adds up."""
    store = new_store()
    nodes = (Node("n1", (0, 1, 2)),)
    store.ensure_gpus(nodes, T0)
    now = T0
    attempt_of: dict[int, int] = {}
    jobs = 0
    for gap, op, gpu, holder in ops:
        now += gap
        replica_id = f"r/{holder}"
        try:
            replica: Any = store.replica(replica_id)
        except KeyError:
            replica = None
        replica_holds = replica is not None and replica.state == ReplicaState.STARTING
        if op == "release":
            if holder in attempt_of:
                ctx = store.exit_context(attempt_of.pop(holder))
                decision = classify_exit(
                    step_state=ctx.step_state,
                    exit_code=0,
                    signal=None,
                    killed_at_deadline=False,
                    retries_used=0,
                    max_retries=0,
                    now=now,
                    retry=RetryPolicy(),
                )
                store.finish_attempt(
                    ctx,
                    decision,
                    ended_at=now,
                    exit_code=0,
                    signal=None,
                    killed_at_deadline=False,
                    half_life_s=H,
                )
            if replica_holds:
                store.move_replica(
                    replica_id, ReplicaState.STARTING, ReplicaState.FAILED, now=now, message="x"
                )
        elif op == "hold-attempt" and holder not in attempt_of:
            jobs += 1
            add_job(store, f"job-{jobs}", "j", "nlp", gpus=1)
            with contextlib.suppress(GpuBusy):
                launch = running(
                    store,
                    store.begin_attempt(
                        job_id=f"job-{jobs}",
                        step="train",
                        node="n1",
                        gpus=(gpu,),
                        layout=LAYOUT,
                        now=now,
                        reason="",
                    ),
                )
                attempt_of[holder] = launch.attempt_id
        elif op == "hold-replica" and not replica_holds:
            with contextlib.suppress(GpuBusy):
                store.begin_replica(
                    replica_id=replica_id,
                    service="r",
                    slot=holder,
                    port=9000 + holder,
                    node="n1",
                    gpus=(gpu,),
                    wake=False,
                    now=now,
                    reason="",
                )
    held = [h for h in store.holdings() if h.holder_kind != "idle"]
    assert len(held) == len(attempt_of) + sum(r.state == ReplicaState.STARTING for r in store.replicas())
    start, end = float(T0 + start_off), float(T0 + start_off + length)
    for group_by in ("holder", "day"):
        r = store.usage_report(start, end, group_by=group_by, tz="Europe/Berlin")  # type: ignore[arg-type]
        t = r.totals
        covered = max(0.0, end - max(start, T0))
        assert t.capacity_gpu_seconds == 3 * covered
        assert t.idle_gpu_seconds + t.research_gpu_seconds + t.inference_gpu_seconds == t.capacity_gpu_seconds
        assert sum(x.capacity_gpu_seconds for x in r.rows) == t.capacity_gpu_seconds
    by_kind = store.gpu_seconds_by_holder(start, end)
    assert by_kind.get("attempt", 0.0) == t.research_gpu_seconds
    assert by_kind.get("replica", 0.0) == t.inference_gpu_seconds
