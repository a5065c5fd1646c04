"""The store against SQLite, the real PostgreSQL server and memory: the same tests, every backend.

A few tests are about SQL itself (the Alembic migrations, the guarded `UPDATE` writer) and run on
the SQL backends only (`sql_store`); what they check that a caller can see is checked again
through the public API on every backend.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from storekit import HALF_LIFE, LAYOUT, NODES, advance_dag, finish, start, submit

from lowtide.control.clock import FakeClock
from lowtide.control.executor_port import AttemptHandle, ExitReason
from lowtide.control.records import GpuBusy, LastAdminToken, StaleState
from lowtide.domain.states import AttemptState, IllegalTransition, JobState, ReclaimState, StepState
from lowtide.domain.states import ReplicaState as R
from lowtide.policy.dag import DagChanges, JobChange, StepChange, advance
from lowtide.policy.outcomes import RetryPolicy, classify_exit
from lowtide.store.memory import MemoryStore
from lowtide.store.repo import Store, hash_token
from lowtide.store.schema import metadata, tokens
from lowtide.store.transitions import move_step
from support import running


def test_migrations_create_exactly_the_declared_schema(sql_store: Store) -> None:
    """SQL only: the Alembic migrations against `schema.metadata` (the memory store has no schema)."""
    with sql_store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    assert diff == []


def test_migrating_twice_is_harmless(sql_store_url: str) -> None:
    """SQL only: migrations are idempotent (a memory store starts empty every time)."""
    Store.open(sql_store_url).close()
    s = Store.open(sql_store_url)
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
    launch = running(
        store,
        store.begin_attempt(
            job_id=job_id, step="prep", node="n1", gpus=(), layout=LAYOUT, now=clock.now(), reason="test"
        ),
    )
    assert launch.number == 1
    assert launch.work_dir == "/work/jobs/job-000000000001/prep/attempt-1"
    assert store.job(job_id).state == JobState.RUNNING
    # A GPU step: its GPUs move from idle to the attempt in the ledger.
    finish(store, launch.attempt_id, clock.now())
    advance_dag(store, job_id, clock.now())
    launch2 = running(
        store,
        store.begin_attempt(
            job_id=job_id, step="train", node="n1", gpus=(0, 1), layout=LAYOUT, now=clock.now(), reason="test"
        ),
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
    running(
        store,
        store.begin_attempt(
            job_id=a, step="x", node="n2", gpus=(0, 1), layout=LAYOUT, now=clock.now(), reason=""
        ),
    )
    with pytest.raises(GpuBusy):
        running(
            store,
            store.begin_attempt(
                job_id=b, step="x", node="n2", gpus=(1, 0), layout=LAYOUT, now=clock.now(), reason=""
            ),
        )
    detail = store.job_detail(b)
    assert detail.attempts == ()
    assert detail.steps[0].state == StepState.READY
    assert detail.job.state == JobState.QUEUED


def test_a_step_that_is_no_longer_ready_cannot_be_started(store: Store, clock: FakeClock) -> None:
    job_id = submit(store, clock)
    store.ensure_gpus(NODES, clock.now())
    with pytest.raises(IllegalTransition):  # PENDING -> RUNNING is not in the table
        running(
            store,
            store.begin_attempt(
                job_id=job_id, step="train", node="n1", gpus=(0,), layout=LAYOUT, now=clock.now(), reason=""
            ),
        )
    store.request_cancel(job_id, by="alice", now=clock.now())
    with pytest.raises(StaleState):
        running(
            store,
            store.begin_attempt(
                job_id=job_id, step="prep", node="n1", gpus=(), layout=LAYOUT, now=clock.now(), reason=""
            ),
        )


def test_the_sql_guarded_writer_refuses_a_stale_expected_state(sql_store: Store, clock: FakeClock) -> None:
    """SQL only: `transitions.move_step` on a connection (the memory store has no connections;
    `test_guarded_writes_refuse_a_stale_expected_state` checks the same through the API)."""
    submit(sql_store, clock)
    with sql_store.engine.begin() as conn:
        step_id = conn.execute(sa.text("select id from steps where name='prep'")).scalar_one()
    with pytest.raises(StaleState), sql_store.engine.begin() as conn:
        move_step(conn, step_id, StepState.PENDING, StepState.READY)  # it is READY, not PENDING
    with pytest.raises(IllegalTransition), sql_store.engine.begin() as conn:
        move_step(conn, step_id, StepState.READY, StepState.SUCCEEDED)


def test_guarded_writes_refuse_a_stale_expected_state(store: Store, clock: FakeClock) -> None:
    job_id = submit(store, clock)
    before = store.job_detail(job_id)
    with pytest.raises(StaleState):  # prep is READY, not PENDING
        store.apply_dag(
            DagChanges(job_id, (StepChange("prep", StepState.PENDING, StepState.READY, "x"),)), clock.now()
        )
    with pytest.raises(IllegalTransition):
        store.apply_dag(
            DagChanges(job_id, (StepChange("prep", StepState.READY, StepState.SUCCEEDED, "x"),)), clock.now()
        )
    # A batch whose last move is stale changes nothing, not even its first moves.
    with pytest.raises(StaleState):
        store.apply_dag(
            DagChanges(
                job_id,
                (
                    StepChange("prep", StepState.READY, StepState.CANCELLED, "x"),
                    StepChange("train", StepState.READY, StepState.CANCELLED, "x"),
                ),
                JobChange(JobState.QUEUED, JobState.CANCELLED, "x"),
            ),
            clock.now(),
        )
    with pytest.raises(StaleState):  # the job is QUEUED, not RUNNING
        store.apply_dag(
            DagChanges(job_id, job=JobChange(JobState.RUNNING, JobState.FAILED, "x")), clock.now()
        )
    with pytest.raises(KeyError):  # NotFound is a KeyError
        store.apply_dag(
            DagChanges(job_id, (StepChange("nope", StepState.READY, StepState.CANCELLED, "x"),)), clock.now()
        )
    assert store.job_detail(job_id) == before
    with pytest.raises(StaleState):
        store.mark_stopping(999, deadline=1.0, reason="x", now=clock.now())  # no such attempt


def test_cancel_stops_running_steps_with_notice_and_cancels_the_rest(store: Store, clock: FakeClock) -> None:
    store.ensure_gpus(NODES, clock.now())
    job_id = submit(store, clock)
    launch = running(
        store,
        store.begin_attempt(
            job_id=job_id, step="prep", node="n1", gpus=(), layout=LAYOUT, now=clock.now(), reason=""
        ),
    )
    record = store.request_cancel(job_id, by="alice", now=clock.now())
    # A step still holds GPUs: the job is CANCELLING until it has exited (issue 12).
    assert (record.state, record.finished_at, record.cancel_requested_at) == (
        JobState.CANCELLING,
        None,
        clock.now(),
    )
    states = {s.name: s.state for s in store.job_detail(job_id).steps}
    assert states == {"prep": StepState.CANCELLING, "train": StepState.CANCELLED}
    due = store.notices_due()
    assert [(d.attempt_id, d.step_state) for d in due] == [(launch.attempt_id, StepState.CANCELLING)]
    store.mark_stopping(launch.attempt_id, deadline=clock.now() + 30, reason="job cancelled", now=clock.now())
    assert store.notices_due() == []
    assert store.attempt(launch.attempt_id).state == AttemptState.STOPPING
    # Cancelling again changes nothing.
    assert store.request_cancel(job_id, by="alice", now=clock.now()).state == JobState.CANCELLING
    # The step exits: the job is CANCELLED once the DAG moves.
    ctx = store.exit_context(launch.attempt_id)
    decision = classify_exit(
        step_state=ctx.step_state,
        noticed=True,
        exit_code=143,
        signal=None,
        killed_at_deadline=False,
        retries_used=0,
        max_retries=0,
        now=clock.advance(5),
        retry=RetryPolicy(),
    )
    store.finish_attempt(
        ctx,
        decision,
        ended_at=clock.now(),
        exit_code=143,
        signal=None,
        killed_at_deadline=False,
        half_life_s=HALF_LIFE,
    )
    (view,) = store.job_views([job_id])
    store.apply_dag(advance(view), clock.now())
    done = store.job(job_id)
    assert (done.state, done.finished_at) == (JobState.CANCELLED, clock.now())
    # A job with nothing running is CANCELLED at once.
    other = submit(store, clock, "job-000000000002")
    assert store.request_cancel(other, by="alice", now=clock.now()).state == JobState.CANCELLED


def test_an_exit_releases_gpus_folds_usage_and_the_ledger_adds_up(store: Store, clock: FakeClock) -> None:
    t0 = clock.now()
    store.ensure_gpus(NODES, t0)
    job_id = submit(store, clock, steps=[{"name": "x", "command": ["false"], "gpus": 2}], max_retries=1)
    launch = running(
        store,
        store.begin_attempt(
            job_id=job_id, step="x", node="n1", gpus=(2, 3), layout=LAYOUT, now=clock.advance(10), reason=""
        ),
    )
    store.record_launch(launch.attempt_id, AttemptHandle("4242", 123.5, clock.now()))
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
    assert (att.state, att.exit_code, att.handle, att.handle_started_at) == (
        AttemptState.FAILED,
        1,
        "4242",
        123.5,
    )
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
    launch = running(
        store,
        store.begin_attempt(
            job_id=job_id, step="prep", node="n1", gpus=(), layout=LAYOUT, now=clock.now(), reason=""
        ),
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
    launch = running(
        store,
        store.begin_attempt(
            job_id=job_id, step="prep", node="n1", gpus=(), layout=LAYOUT, now=clock.now(), reason=""
        ),
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
    launch = running(
        store,
        store.begin_attempt(
            job_id=job_id, step="prep", node="n1", gpus=(), layout=LAYOUT, now=clock.now(), reason=""
        ),
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


def stored_token_hashes(store: Store) -> list[str]:
    if isinstance(store, MemoryStore):
        return list(store._token_by_hash)
    with store.engine.connect() as conn:
        return list(conn.execute(sa.select(tokens.c.token_hash)).scalars())


def test_tokens_are_stored_hashed_and_can_be_revoked(store: Store, clock: FakeClock) -> None:
    assert not store.has_admin_token()
    record, raw = store.create_token(name="alice", owner="alice", role="user", now=clock.now())
    assert raw.startswith("lt_") and len(raw) > 40
    (stored,) = stored_token_hashes(store)
    assert stored == hash_token(raw) and raw not in stored
    who = store.authenticate(raw)
    assert who is not None and (who.owner, who.role) == ("alice", "user")
    assert store.authenticate(raw + "x") is None
    store.revoke_token(record.id, clock.now())
    assert store.authenticate(raw) is None
    with pytest.raises(ValueError, match="role"):
        store.create_token(name="x", owner="x", role="root", now=clock.now())
    with pytest.raises(KeyError):  # NotFound: already revoked
        store.revoke_token(record.id, clock.now())
    admin, admin_raw = store.create_token(name="ops", owner="ops", role="admin", now=clock.now())
    _, step_raw = store.create_token(name="s", owner="loop", role="step", now=clock.now(), attempt_id=7)
    assert store.has_admin_token()
    assert [t.id for t in store.list_tokens()] == [record.id, admin.id]  # step tokens are not listed
    assert store.authenticate(step_raw) is not None
    with pytest.raises(LastAdminToken):  # nobody could mint another one
        store.revoke_token(admin.id, clock.now())
    assert store.authenticate(admin_raw) is not None
    second, _ = store.create_token(name="ops2", owner="ops2", role="admin", now=clock.now())
    store.revoke_token(admin.id, clock.now())
    assert store.has_admin_token() and store.authenticate(admin_raw) is None
    with pytest.raises(LastAdminToken):
        store.revoke_token(second.id, clock.now())


def test_a_token_is_read_by_id_revoked_or_not(store: Store, clock: FakeClock) -> None:
    record, _ = store.create_token(name="alice", owner="alice", role="user", now=clock.now(), teams=["nlp"])
    step, _ = store.create_token(name="s", owner="loop", role="step", now=clock.now(), attempt_id=7)
    assert store.token(record.id) == record
    assert store.token(step.id).role == "step"
    store.revoke_token(record.id, clock.now() + 5)
    revoked = store.token(record.id)
    assert revoked.revoked_at == clock.now() + 5 and revoked.teams == ("nlp",)
    with pytest.raises(KeyError, match="not found"):  # NotFound
        store.token(record.id + 1000)


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


def test_preemption_gives_notice_with_the_shorter_grace_and_the_snapshot_shows_it_stopping(
    store: Store, clock: FakeClock
) -> None:
    store.ensure_gpus(NODES, clock.now())
    job_id = submit(store, clock, steps=[{"name": "x", "command": ["t"], "gpus": 2, "checkpoint": True}])
    job_id2 = submit(
        store, clock, "job-000000000002", grace_seconds=10, steps=[{"name": "y", "command": ["t"]}]
    )
    a = start(store, job_id, "x", clock.now(), gpus=(0, 1))
    b = start(store, job_id2, "y", clock.now(), node="n2")
    # A checkpoint from before an attempt started does not count for it; one during it does.
    snap = store.snapshot(now=clock.advance(5), nodes=NODES, half_life_s=HALF_LIFE)
    assert [(r.attempt_id, r.last_checkpoint_at, r.stopping) for r in snap.running] == [
        (a.attempt_id, None, False),
        (b.attempt_id, None, False),
    ]
    assert store.record_checkpoint(a.attempt_id, label="c1", progress=None, source="api", now=clock.now())
    snap = store.snapshot(now=clock.now(), nodes=NODES, half_life_s=HALF_LIFE)
    assert snap.running[0].last_checkpoint_at == clock.now()
    store.request_preemption(a.attempt_id, grace_s=60, reason="GPUs reclaimed", now=clock.now())
    store.request_preemption(b.attempt_id, grace_s=60, reason="GPUs reclaimed", now=clock.now())
    with pytest.raises(StaleState):  # PREEMPTING already
        store.request_preemption(a.attempt_id, grace_s=60, reason="again", now=clock.now())
    with pytest.raises(StaleState):
        store.request_preemption(12345, grace_s=60, reason="none", now=clock.now())
    due = {d.attempt_id: (d.step_state, d.grace_seconds) for d in store.notices_due()}
    assert due == {a.attempt_id: (StepState.PREEMPTING, 30.0), b.attempt_id: (StepState.PREEMPTING, 10.0)}
    snap = store.snapshot(now=clock.now(), nodes=NODES, half_life_s=HALF_LIFE)
    assert all(r.stopping for r in snap.running)  # notice asked for, not given yet
    # Cancelling while preempting keeps the stop's grace; the notice is then a cancel's.
    store.request_cancel(job_id, by="alice", now=clock.now())
    due = {d.attempt_id: (d.step_state, d.grace_seconds) for d in store.notices_due()}
    assert due[a.attempt_id] == (StepState.CANCELLING, 30.0)
    store.mark_stopping(a.attempt_id, deadline=clock.now() + 30, reason="notice", now=clock.now())
    assert [d.attempt_id for d in store.notices_due()] == [b.attempt_id]
    assert store.attempt_times([a.attempt_id, b.attempt_id, 999]) == {
        a.attempt_id: (clock.now(), None),
        b.attempt_id: (None, None),
    }
    clock.advance(7)
    decision = finish(store, a.attempt_id, clock.now(), exit_code=143, noticed=True)
    assert decision.step_state == StepState.CANCELLED and not decision.preempted
    assert store.attempt(a.attempt_id).lost_gpu_seconds == 2 * 7.0  # since the checkpoint
    store.mark_stopping(b.attempt_id, deadline=clock.now() + 10, reason="notice", now=clock.now())
    clock.advance(4)
    decision = finish(store, b.attempt_id, clock.now(), exit_code=143, noticed=True)
    assert decision.preempted
    assert store.attempt(b.attempt_id).lost_gpu_seconds == 0.0  # it held no GPU
    assert store.preemption_totals() == (1, 14.0)
    snap = store.snapshot(now=clock.now(), nodes=NODES, half_life_s=HALF_LIFE)
    assert snap.running == ()
    assert [(q.job_id, q.preempted) for q in snap.queued] == [(job_id2, True)]
    assert set(snap.team_usage) == {"nlp"}  # an attempt without GPUs adds no usage


def test_replicas_hold_gpus_in_the_ledger_until_they_leave_the_holding_states(
    store: Store, clock: FakeClock
) -> None:
    store.ensure_gpus(NODES, clock.now())
    rec = store.begin_replica(
        replica_id="chat/0",
        service="chat",
        slot=0,
        port=9000,
        node="n2",
        gpus=(0, 1),
        wake=False,
        now=clock.now(),
        reason="start",
    )
    assert (rec.state, rec.gpus, rec.failures, rec.node) == (R.STARTING, (0, 1), 0, "n2")
    with pytest.raises(GpuBusy):  # n2:1 is the replica's: nothing changes
        store.begin_replica(
            replica_id="chat/1",
            service="chat",
            slot=1,
            port=9001,
            node="n2",
            gpus=(1,),
            wake=False,
            now=clock.now(),
            reason="start",
        )
    with pytest.raises(KeyError):
        store.replica("chat/1")
    job_id = submit(store, clock, steps=[{"name": "x", "command": ["t"], "gpus": 1}])
    with pytest.raises(GpuBusy):
        start(store, job_id, "x", clock.now(), node="n2", gpus=(0,))
    with pytest.raises(GpuBusy):  # the same GPU twice
        start(store, job_id, "x", clock.now(), node="n1", gpus=(3, 3))
    with pytest.raises(GpuBusy):  # not a managed GPU
        start(store, job_id, "x", clock.now(), node="n9", gpus=(0,))
    assert store.job_detail(job_id).attempts == ()
    store.move_replica("chat/0", R.STARTING, R.SERVING, now=clock.advance(5), message="healthy", failures=0)
    with pytest.raises(StaleState):
        store.move_replica("chat/0", R.STARTING, R.SERVING, now=clock.now(), message="again")
    with pytest.raises(IllegalTransition):
        store.move_replica("chat/0", R.SERVING, R.PARKED, now=clock.now(), message="no")
    with pytest.raises(KeyError):
        store.move_replica("nope/0", R.SERVING, R.DRAINING, now=clock.now(), message="no")
    held = {(h.node, h.index): (h.holder_kind, h.holder_id) for h in store.holdings()}
    assert held[("n2", 0)] == ("replica", "chat/0") and held[("n1", 0)] == ("idle", None)
    store.move_replica("chat/0", R.SERVING, R.DRAINING, now=clock.advance(1), message="drain")
    store.move_replica("chat/0", R.DRAINING, R.PARKING, now=clock.now(), message="park")
    store.move_replica(
        "chat/0", R.PARKING, R.PARKED, now=clock.advance(2), message="asleep", parked_as="sleep"
    )
    assert all(h.holder_kind == "idle" for h in store.holdings())
    woken = store.begin_replica(
        replica_id="chat/0",
        service="chat",
        slot=0,
        port=9000,
        node="n2",
        gpus=(0, 1),
        wake=True,
        now=clock.advance(10),
        reason="wake",
    )
    assert (woken.state, woken.parked_as, woken.since) == (R.WAKING, None, clock.now())
    assert [r.id for r in store.replicas()] == ["chat/0"] and store.replicas("other") == []
    kinds = [e.kind for e in store.service_events("chat")]
    assert kinds == ["starting", "serving", "draining", "parking", "parked", "waking"]
    assert [e.kind for e in store.service_events("chat", limit=2)] == ["parked", "waking"]
    store.add_service_event("chat", None, at=clock.now(), kind="scale", message="up")
    assert store.service_events("chat", limit=1)[0].kind == "scale"
    by_kind = store.gpu_seconds_by_holder(clock.now() - 18, clock.now())
    assert by_kind == {"replica": 2 * 8.0, "idle": 6 * 18.0 - 16.0}
    counts = store.counts()
    assert counts["gpus"] == {"idle": 4, "replica": 2}
    assert counts["jobs"] == {"QUEUED": 1} and counts["steps"] == {"READY": 1} and counts["reclaims"] == {}


def test_values_are_kept_and_replaced(store: Store) -> None:
    assert store.get_value("forecast") is None
    store.set_value("forecast", "{}")
    store.set_value("forecast", '{"a": 1}')
    assert store.get_value("forecast") == '{"a": 1}'
    assert store.get_value("instance_id") is None
    iid = store.instance_id()
    assert store.get_value("instance_id") == iid


def test_listing_orders_pages_and_counts_like_every_other_backend(store: Store, clock: FakeClock) -> None:
    ids = [submit(store, clock, f"job-00000000000{i}", owner="bob" if i % 2 else "alice") for i in range(5)]
    clock.advance(1)
    late = submit(store, clock, "job-000000000000x", name="other")
    assert [j.id for j in store.list_jobs()] == [late, *reversed(ids)]  # same submit time: by id
    assert [j.id for j in store.list_jobs(owner="bob", limit=1)] == [ids[3]]
    assert [j.id for j in store.list_jobs(name="other")] == [late]
    assert [j.id for j in store.list_jobs(before=clock.now(), limit=2)] == [ids[4], ids[3]]
    assert store.list_jobs(limit=0) == []
    store.request_cancel(ids[0], by="bob", now=clock.now())
    assert [j.id for j in store.list_jobs(states=[JobState.CANCELLED])] == [ids[0]]
    assert store.list_jobs(states=[JobState.CANCELLED])[0].step_states == {"CANCELLED": 2}
    assert store.job(ids[1]).step_states == {"PENDING": 1, "READY": 1}
    done = store.request_cancel(ids[0], by="bob", now=clock.now())
    assert (done.state, done.step_states) == (JobState.CANCELLED, {})  # a finished job: as it is
    counts = store.counts()
    assert counts["jobs"] == {"CANCELLED": 1, "QUEUED": 5}
    assert counts["steps"] == {"CANCELLED": 2, "PENDING": 5, "READY": 5}
    with pytest.raises(KeyError):
        store.job("job-nope")
    with pytest.raises(KeyError):
        store.job_detail("job-nope")
    with pytest.raises(KeyError):
        store.request_cancel("job-nope", by="x", now=clock.now())
    with pytest.raises(KeyError):
        store.step_attempts(ids[1], "nope")
    with pytest.raises(KeyError):
        store.attempt(404)
    with pytest.raises(KeyError):
        store.exit_context(404)
    with pytest.raises(KeyError):
        store.record_checkpoint(404, label="x", progress=None, source="api", now=clock.now())
    assert store.step_attempts(ids[1], "prep") == []


def test_a_launch_carries_the_attempt_record_and_resumes_from_the_last_checkpoint(
    store: Store, clock: FakeClock
) -> None:
    store.ensure_gpus(NODES, clock.now())
    job_id = submit(
        store,
        clock,
        params={"lr": 0.1, "layers": [1, 2]},
        steps=[{"name": "x", "command": ["t", "{params.lr}"], "gpus": 1, "checkpoint": True}],
        max_retries=2,
    )
    first = start(store, job_id, "x", clock.now(), gpus=(0,))
    assert (first.number, first.last_checkpoint, first.grace_seconds) == (1, None, 30.0)
    assert first.params == {"lr": 0.1, "layers": [1, 2]}
    store.record_checkpoint(first.attempt_id, label="s1", progress="1/9", source="file", now=clock.advance(3))
    finish(store, first.attempt_id, clock.advance(2), exit_code=1, retry=RetryPolicy(0, 0))
    second = start(store, job_id, "x", clock.now(), gpus=(1,))
    assert (second.number, second.last_checkpoint) == (2, "s1")
    att = store.attempt(second.attempt_id)
    assert att.record["resume_from"] == "s1" and att.record["gpus"] == [1]
    assert att.record["params"] == {"lr": 0.1, "layers": [1, 2]}
    assert [s["command"] for s in att.record["spec"]["steps"]] == [["t", "{params.lr}"]]
    assert [a.number for a in store.step_attempts(job_id, "x")] == [1, 2]
    assert [a.id for a in store.active_attempts()] == [second.attempt_id]
    snap = store.snapshot(now=clock.now(), nodes=NODES, half_life_s=HALF_LIFE)
    assert snap.running[0].last_checkpoint_at is None  # "s1" was taken by attempt 1
    kinds = [e.kind for e in store.job_detail(job_id).events]
    assert kinds == ["submitted", "started", "checkpoint", "failed", "started"]
    store.add_event(job_id, "x", second.attempt_id, at=clock.now(), kind="note", message="hello")
    store.set_waiting_reasons({(job_id, "x"): "whatever", ("job-nope", "x"): "ignored"})
    detail = store.job_detail(job_id)
    assert detail.events[-1].message == "hello" and detail.steps[0].reason == "whatever"


def test_a_pending_attempt_books_gpus_runs_when_told_and_keeps_why_it_ended(
    store: Store, clock: FakeClock
) -> None:
    t0 = clock.now()
    store.ensure_gpus(NODES, t0)
    job_id = submit(store, clock, steps=[{"name": "x", "command": ["true"], "gpus": 2}], max_retries=1)
    launch = store.begin_attempt(
        job_id=job_id, step="x", node="n1", gpus=(0, 1), layout=LAYOUT, now=clock.advance(10), reason=""
    )
    # Launched but not running (an image being pulled): PENDING, its GPUs booked.
    store.record_launch(launch.attempt_id, AttemptHandle("ns/pod-x-1/uid-1", clock.now(), None))
    att = store.attempt(launch.attempt_id)
    assert (att.state, att.handle, att.running_at) == (AttemptState.PENDING, "ns/pod-x-1/uid-1", None)
    assert [a.id for a in store.active_attempts()] == [launch.attempt_id]
    assert sorted(h.index for h in store.holdings() if h.holder_kind == "attempt") == [0, 1]
    ran_at = clock.advance(30)
    store.mark_running(launch.attempt_id, ran_at)
    store.mark_running(launch.attempt_id, clock.advance(5))  # reported twice: the first start stands
    att = store.attempt(launch.attempt_id)
    assert (att.state, att.running_at) == (AttemptState.RUNNING, ran_at)

    # An OOMKill: the step's own failure, the reason and the executor's words kept.
    end = clock.advance(100)
    ctx = store.exit_context(launch.attempt_id)
    decision = classify_exit(
        step_state=ctx.step_state,
        exit_code=137,
        signal=None,
        killed_at_deadline=False,
        retries_used=ctx.retries_used,
        max_retries=ctx.max_retries,
        now=end,
        retry=RetryPolicy(10, 600),
        reason=ExitReason.OOM_KILLED,
        detail="OOMKilled (exit code 137)",
    )
    store.finish_attempt(
        ctx,
        decision,
        ended_at=end,
        exit_code=137,
        signal=None,
        killed_at_deadline=False,
        half_life_s=HALF_LIFE,
        reason=ExitReason.OOM_KILLED,
        detail="OOMKilled (exit code 137)",
    )
    att = store.attempt(launch.attempt_id)
    assert (att.state, att.exit_reason, att.exit_detail) == (
        AttemptState.FAILED,
        ExitReason.OOM_KILLED,
        "OOMKilled (exit code 137)",
    )
    assert "OOMKilled" in att.message
    # Work is lost from when it began to run (the image pull did none): 2 GPUs × 105 s.
    assert att.lost_gpu_seconds == pytest.approx(2 * (end - ran_at))


def test_a_pending_attempt_can_be_preempted_and_loses_no_work(store: Store, clock: FakeClock) -> None:
    store.ensure_gpus(NODES, clock.now())
    job_id = submit(store, clock, steps=[{"name": "x", "command": ["true"], "gpus": 1}])
    launch = store.begin_attempt(
        job_id=job_id, step="x", node="n1", gpus=(0,), layout=LAYOUT, now=clock.advance(1), reason=""
    )
    store.record_launch(launch.attempt_id, AttemptHandle("p", clock.now(), None))
    store.request_preemption(launch.attempt_id, grace_s=5, reason="GPUs reclaimed", now=clock.advance(1))
    due = store.notices_due()
    assert [n.attempt_id for n in due] == [launch.attempt_id]
    store.mark_stopping(launch.attempt_id, deadline=clock.now() + 5, reason="GPUs reclaimed", now=clock.now())
    end = clock.advance(1)
    ctx = store.exit_context(launch.attempt_id)
    assert ctx.attempt_state == AttemptState.STOPPING
    decision = classify_exit(
        step_state=ctx.step_state,
        noticed=True,
        exit_code=None,
        signal=None,
        killed_at_deadline=False,
        retries_used=0,
        max_retries=0,
        now=end,
        retry=RetryPolicy(10, 600),
        reason=ExitReason.DELETED,
        detail="withdrawn while pending",
    )
    store.finish_attempt(
        ctx,
        decision,
        ended_at=end,
        exit_code=None,
        signal=None,
        killed_at_deadline=False,
        half_life_s=HALF_LIFE,
    )
    att = store.attempt(launch.attempt_id)
    assert (att.state, att.running_at, att.lost_gpu_seconds) == (AttemptState.INTERRUPTED, None, 0.0)
    assert store.job_detail(job_id).steps[0].state == StepState.PREEMPTED
