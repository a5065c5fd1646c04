"""The store against SQLite and the real PostgreSQL server: the same tests, both backends."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from lowtide.control.clock import FakeClock
from lowtide.control.executor_port import ProcessIdentity
from lowtide.control.records import GpuBusy, NewJob, StaleState
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.spec_parse import build_job_spec
from lowtide.domain.spec_render import render_step
from lowtide.domain.states import AttemptState, IllegalTransition, JobState, ReclaimState, StepState
from lowtide.policy.dag import advance
from lowtide.policy.outcomes import RetryPolicy, classify_exit
from lowtide.store.repo import Store, hash_token
from lowtide.store.schema import metadata, tokens
from lowtide.store.transitions import move_step

LAYOUT = ArtifactLayout("/art", "/work")
NODES = (Node("n1", (0, 1, 2, 3)), Node("n2", (0, 1)))
HALF_LIFE = 3600.0


def job_doc(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "sft",
        "team": "nlp",
        "steps": [
            {"name": "prep", "command": ["python", "prep.py"], "gpus": 0},
            {
                "name": "train",
                "command": ["python", "train.py"],
                "gpus": 2,
                "depends": ["prep"],
                "checkpoint": True,
            },
        ],
    }
    doc.update(overrides)
    return doc


def submit(store: Store, clock: FakeClock, job_id: str = "job-000000000001", **overrides: Any) -> str:
    spec = build_job_spec(job_doc(**overrides))
    resolved = tuple(render_step(spec, s, job_id=job_id, layout=LAYOUT) for s in spec.steps)
    store.create_job(
        NewJob(
            id=job_id,
            spec=spec,
            resolved=resolved,
            source_text="name: sft\n",
            owner="alice",
            submitted_at=clock.now(),
        )
    )
    return job_id


def test_migrations_create_exactly_the_declared_schema(store: Store) -> None:
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    assert diff == []


def test_migrating_twice_is_harmless(store_url: str) -> None:
    Store.open(store_url).close()
    s = Store.open(store_url)
    assert s.list_jobs() == []
    s.close()


def test_a_new_job_has_its_roots_ready_and_the_rest_pending(store: Store, clock: FakeClock) -> None:
    job_id = submit(store, clock)
    detail = store.job_detail(job_id)
    assert detail.job.state == JobState.QUEUED
    assert {s.name: s.state for s in detail.steps} == {"prep": StepState.READY, "train": StepState.PENDING}
    assert detail.steps[1].resolved["checkpoint_dir"] == "/art/jobs/job-000000000001/train/checkpoints"
    assert detail.events[0].kind == "submitted"
    assert store.list_jobs()[0].step_states == {"READY": 1, "PENDING": 1}


def test_listing_filters_by_state_team_and_owner(store: Store, clock: FakeClock) -> None:
    submit(store, clock, "job-000000000001")
    clock.advance(1)
    submit(store, clock, "job-000000000002", team="vision")
    assert [j.id for j in store.list_jobs()] == ["job-000000000002", "job-000000000001"]
    assert [j.id for j in store.list_jobs(team="vision")] == ["job-000000000002"]
    assert store.list_jobs(owner="bob") == []
    assert len(store.list_jobs(states=[JobState.QUEUED])) == 2
    first_page = store.list_jobs(limit=1)
    assert [j.id for j in store.list_jobs(limit=1, before=first_page[0].submitted_at)] == ["job-000000000001"]


def test_starting_a_step_books_its_gpus_and_the_ledger_records_it(store: Store, clock: FakeClock) -> None:
    store.ensure_gpus(NODES, clock.now())
    job_id = submit(store, clock)
    launch = store.begin_attempt(
        job_id=job_id, step="prep", node="n1", gpus=(), layout=LAYOUT, now=clock.now(), reason="test"
    )
    assert launch.number == 1
    assert launch.work_dir == "/work/jobs/job-000000000001/prep/attempt-1"
    assert store.job(job_id).state == JobState.RUNNING
    # A GPU step: its GPUs move from idle to the attempt in the ledger.
    with store.engine.begin() as conn:
        step_id = conn.execute(sa.text("select id from steps where name='train'")).scalar_one()
        move_step(conn, step_id, StepState.PENDING, StepState.READY)
    launch2 = store.begin_attempt(
        job_id=job_id, step="train", node="n1", gpus=(0, 1), layout=LAYOUT, now=clock.now(), reason="test"
    )
    held = {(h.node, h.index): h for h in store.holdings()}
    assert held[("n1", 0)].holder_kind == "attempt"
    assert held[("n1", 0)].holder_id == str(launch2.attempt_id)
    assert held[("n1", 0)].step == "train"
    assert held[("n1", 2)].holder_kind == "idle"
    assert len(held) == 6


def test_a_gpu_cannot_be_booked_twice_and_a_failed_booking_writes_nothing(
    store: Store, clock: FakeClock
) -> None:
    store.ensure_gpus(NODES, clock.now())
    a = submit(store, clock, "job-00000000000a", steps=[{"name": "x", "command": ["true"], "gpus": 2}])
    b = submit(store, clock, "job-00000000000b", steps=[{"name": "x", "command": ["true"], "gpus": 2}])
    store.begin_attempt(job_id=a, step="x", node="n2", gpus=(0, 1), layout=LAYOUT, now=clock.now(), reason="")
    with pytest.raises(GpuBusy):
        store.begin_attempt(
            job_id=b, step="x", node="n2", gpus=(1, 0), layout=LAYOUT, now=clock.now(), reason=""
        )
    detail = store.job_detail(b)
    assert detail.attempts == ()
    assert detail.steps[0].state == StepState.READY
    assert detail.job.state == JobState.QUEUED


def test_a_step_that_is_no_longer_ready_cannot_be_started(store: Store, clock: FakeClock) -> None:
    job_id = submit(store, clock)
    store.ensure_gpus(NODES, clock.now())
    with pytest.raises(IllegalTransition):  # PENDING -> RUNNING is not in the table
        store.begin_attempt(
            job_id=job_id, step="train", node="n1", gpus=(0,), layout=LAYOUT, now=clock.now(), reason=""
        )
    store.request_cancel(job_id, by="alice", now=clock.now())
    with pytest.raises(StaleState):
        store.begin_attempt(
            job_id=job_id, step="prep", node="n1", gpus=(), layout=LAYOUT, now=clock.now(), reason=""
        )


def test_guarded_writes_refuse_a_stale_expected_state(store: Store, clock: FakeClock) -> None:
    submit(store, clock)
    with store.engine.begin() as conn:
        step_id = conn.execute(sa.text("select id from steps where name='prep'")).scalar_one()
    with pytest.raises(StaleState), store.engine.begin() as conn:
        move_step(conn, step_id, StepState.PENDING, StepState.READY)  # it is READY, not PENDING
    with pytest.raises(IllegalTransition), store.engine.begin() as conn:
        move_step(conn, step_id, StepState.READY, StepState.SUCCEEDED)


def test_cancel_stops_running_steps_with_notice_and_cancels_the_rest(store: Store, clock: FakeClock) -> None:
    store.ensure_gpus(NODES, clock.now())
    job_id = submit(store, clock)
    launch = store.begin_attempt(
        job_id=job_id, step="prep", node="n1", gpus=(), layout=LAYOUT, now=clock.now(), reason=""
    )
    record = store.request_cancel(job_id, by="alice", now=clock.now())
    assert record.state == JobState.CANCELLED
    states = {s.name: s.state for s in store.job_detail(job_id).steps}
    assert states == {"prep": StepState.CANCELLING, "train": StepState.CANCELLED}
    due = store.notices_due()
    assert [(d.attempt_id, d.step_state) for d in due] == [(launch.attempt_id, StepState.CANCELLING)]
    store.mark_stopping(launch.attempt_id, deadline=clock.now() + 30, reason="job cancelled", now=clock.now())
    assert store.notices_due() == []
    assert store.attempt(launch.attempt_id).state == AttemptState.STOPPING
    # Cancelling again changes nothing.
    assert store.request_cancel(job_id, by="alice", now=clock.now()).state == JobState.CANCELLED


def test_an_exit_releases_gpus_folds_usage_and_the_ledger_adds_up(store: Store, clock: FakeClock) -> None:
    t0 = clock.now()
    store.ensure_gpus(NODES, t0)
    job_id = submit(store, clock, steps=[{"name": "x", "command": ["false"], "gpus": 2}], max_retries=1)
    launch = store.begin_attempt(
        job_id=job_id, step="x", node="n1", gpus=(2, 3), layout=LAYOUT, now=clock.advance(10), reason=""
    )
    store.set_attempt_process(launch.attempt_id, ProcessIdentity(4242, 123.5))
    end = clock.advance(100)
    ctx = store.exit_context(launch.attempt_id)
    decision = classify_exit(
        step_state=ctx.step_state,
        exit_code=1,
        signal=None,
        killed_at_deadline=False,
        retries_used=ctx.retries_used,
        max_retries=ctx.max_retries,
        now=end,
        retry=RetryPolicy(10, 600),
    )
    store.finish_attempt(
        ctx, decision, ended_at=end, exit_code=1, signal=None, killed_at_deadline=False, half_life_s=HALF_LIFE
    )
    step = store.job_detail(job_id).steps[0]
    assert step.state == StepState.READY and step.retries_used == 1 and step.eligible_at == end + 10
    att = store.attempt(launch.attempt_id)
    assert (att.state, att.exit_code, att.pid) == (AttemptState.FAILED, 1, 4242)
    assert all(h.holder_kind == "idle" for h in store.holdings())
    by_holder = store.gpu_seconds_by_holder(t0, clock.advance(50))
    assert by_holder["attempt"] == pytest.approx(200.0)
    assert sum(by_holder.values()) == pytest.approx(6 * 160.0)  # capacity × time
    snap = store.snapshot(now=clock.now(), nodes=NODES, half_life_s=HALF_LIFE)
    assert 0 < snap.team_usage["nlp"] < 200.0  # decayed
    assert [(q.step, q.eligible_at, q.retry_note) for q in snap.queued] == [("x", end + 10, "attempt 2 of 2")]


def test_a_stale_exit_decision_is_refused(store: Store, clock: FakeClock) -> None:
    store.ensure_gpus(NODES, clock.now())
    job_id = submit(store, clock)
    launch = store.begin_attempt(
        job_id=job_id, step="prep", node="n1", gpus=(), layout=LAYOUT, now=clock.now(), reason=""
    )
    ctx = store.exit_context(launch.attempt_id)  # step RUNNING
    store.request_cancel(job_id, by="alice", now=clock.now())  # step now CANCELLING
    decision = classify_exit(
        step_state=ctx.step_state,
        exit_code=0,
        signal=None,
        killed_at_deadline=False,
        retries_used=0,
        max_retries=0,
        now=clock.now(),
        retry=RetryPolicy(),
    )
    with pytest.raises(StaleState):
        store.finish_attempt(
            ctx,
            decision,
            ended_at=clock.now(),
            exit_code=0,
            signal=None,
            killed_at_deadline=False,
            half_life_s=HALF_LIFE,
        )
    assert store.attempt(launch.attempt_id).state == AttemptState.RUNNING  # rolled back


def test_dag_changes_apply_with_guards(store: Store, clock: FakeClock) -> None:
    store.ensure_gpus(NODES, clock.now())
    job_id = submit(store, clock)
    launch = store.begin_attempt(
        job_id=job_id, step="prep", node="n1", gpus=(), layout=LAYOUT, now=clock.now(), reason=""
    )
    ctx = store.exit_context(launch.attempt_id)
    decision = classify_exit(
        step_state=ctx.step_state,
        exit_code=0,
        signal=None,
        killed_at_deadline=False,
        retries_used=0,
        max_retries=0,
        now=clock.now(),
        retry=RetryPolicy(),
    )
    store.finish_attempt(
        ctx,
        decision,
        ended_at=clock.now(),
        exit_code=0,
        signal=None,
        killed_at_deadline=False,
        half_life_s=HALF_LIFE,
    )
    (view,) = store.job_views([job_id])
    changes = advance(view)
    assert [(c.step, c.to_state) for c in changes.steps] == [("train", StepState.READY)]
    store.apply_dag(changes, clock.now())
    assert {s.name: s.state for s in store.job_detail(job_id).steps}["train"] == StepState.READY
    with pytest.raises(StaleState):
        store.apply_dag(changes, clock.now())  # already applied: the guard refuses it
    assert [v.job_id for v in store.job_views()] == [job_id]


def test_checkpoints_are_recorded_once_per_label(store: Store, clock: FakeClock) -> None:
    store.ensure_gpus(NODES, clock.now())
    job_id = submit(store, clock)
    launch = store.begin_attempt(
        job_id=job_id, step="prep", node="n1", gpus=(), layout=LAYOUT, now=clock.now(), reason=""
    )
    assert store.record_checkpoint(
        launch.attempt_id, label="step-10", progress="10/100", source="file", now=clock.now()
    )
    assert not store.record_checkpoint(
        launch.attempt_id, label="step-10", progress=None, source="api", now=clock.now()
    )
    assert store.record_checkpoint(
        launch.attempt_id, label="step-20", progress=None, source="api", now=clock.now()
    )
    detail = store.job_detail(job_id)
    assert [c.label for c in detail.checkpoints] == ["step-10", "step-20"]
    assert detail.steps[0].last_checkpoint == "step-20"


def test_tokens_are_stored_hashed_and_can_be_revoked(store: Store, clock: FakeClock) -> None:
    record, raw = store.create_token(name="alice", owner="alice", role="user", now=clock.now())
    assert raw.startswith("lt_") and len(raw) > 40
    with store.engine.connect() as conn:
        stored = conn.execute(sa.select(tokens.c.token_hash)).scalar_one()
    assert stored == hash_token(raw) and raw not in stored
    who = store.authenticate(raw)
    assert who is not None and (who.owner, who.role) == ("alice", "user")
    assert store.authenticate(raw + "x") is None
    store.revoke_token(record.id, clock.now())
    assert store.authenticate(raw) is None
    with pytest.raises(ValueError, match="role"):
        store.create_token(name="x", owner="x", role="root", now=clock.now())


def test_instance_id_is_stable(store: Store) -> None:
    assert store.instance_id() == store.instance_id()


def test_a_reclaim_records_phases_while_open_and_ends_once(store: Store) -> None:
    rid = store.open_reclaim(
        service="chat",
        replica_id="chat/1",
        reason="r",
        gpus=2,
        victims=(4, 5),
        detected_at=1.0,
        decided_at=1.5,
    )
    store.update_reclaim(rid, notice_at=1.5, freed_at=3.0)
    with pytest.raises(IllegalTransition):
        store.update_reclaim(rid, state=ReclaimState.OPEN)
    with pytest.raises(ValueError):
        store.update_reclaim(rid, victims=[1])
    store.update_reclaim(rid, healthy_at=4.0, state=ReclaimState.DONE)
    (rec,) = store.reclaims()
    assert (rec.state, rec.notice_at, rec.freed_at, rec.healthy_at) == (ReclaimState.DONE, 1.5, 3.0, 4.0)
    assert rec.victims == (4, 5)
    # One writer, guarded: a finished reclaim does not change any more.
    with pytest.raises(StaleState):
        store.update_reclaim(rid, state=ReclaimState.ABANDONED)
    with pytest.raises(StaleState):
        store.update_reclaim(rid, healthy_at=9.0)
    assert store.reclaims(state=ReclaimState.OPEN) == []
    assert store.reclaims(state="DONE")[0].healthy_at == 4.0
