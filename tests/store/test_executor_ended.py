"""Finished jobs the executor has not yet ended (`jobs_to_end`, `mark_jobs_ended`; migration 0009),
on SQLite, PostgreSQL and memory: what is listed, the guarded and fenced mark, the batch cursor,
a retry that reopens a job, and (SQL only) the migration and the partial index.
docs/cluster.md "When a job will start nothing more".
"""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa
from alembic import command
from storekit import finish, start, submit

from lowtide.control.clock import FakeClock
from lowtide.control.lease import Fence, LeaseCandidate
from lowtide.control.records import FencedOut
from lowtide.domain.states import JobState
from lowtide.policy.dag import advance
from lowtide.store.db import alembic_config
from lowtide.store.repo import Store
from lowtide.store.schema import jobs

ONE_STEP = [{"name": "t", "command": ["python", "t.py"], "gpus": 0}]


def one_step(store: Store, clock: FakeClock, job_id: str, retries: int = 0) -> str:
    return submit(store, clock, job_id, steps=ONE_STEP, max_retries=retries)


def run_to_end(store: Store, clock: FakeClock, job_id: str, exit_code: int) -> None:
    """Start the job's step, end it with `exit_code` and advance the DAG (the job finishes)."""
    launch = start(store, job_id, "t", clock.now())
    finish(store, launch.attempt_id, clock.now(), exit_code=exit_code)
    for view in store.job_views([job_id]):
        store.apply_dag(advance(view), clock.now())


def jobs_in_every_state(store: Store, clock: FakeClock) -> dict[str, str]:
    """One job per state: succeeded, failed, cancelled (queued: nothing ran), running, cancelling."""
    ids = {
        name: one_step(store, clock, f"job-00000000000{i}")
        for i, name in enumerate(["succeeded", "failed", "cancelled", "running", "cancelling"], start=1)
    }
    run_to_end(store, clock, ids["succeeded"], 0)
    run_to_end(store, clock, ids["failed"], 1)
    store.request_cancel(ids["cancelled"], by="alice", now=clock.now())
    start(store, ids["running"], "t", clock.now())
    start(store, ids["cancelling"], "t", clock.now())
    store.request_cancel(ids["cancelling"], by="alice", now=clock.now())
    states = {name: store.job(job_id).state for name, job_id in ids.items()}
    assert states == {
        "succeeded": JobState.SUCCEEDED,
        "failed": JobState.FAILED,
        "cancelled": JobState.CANCELLED,
        "running": JobState.RUNNING,
        "cancelling": JobState.CANCELLING,
    }
    return ids


def test_finished_jobs_are_listed_until_the_executor_ended_them(store: Store, clock: FakeClock) -> None:
    ids = jobs_in_every_state(store, clock)
    finished = sorted([ids["succeeded"], ids["failed"], ids["cancelled"]])
    assert store.jobs_to_end() == finished  # a cancel that stopped nothing running is listed too
    # The mark is guarded: only finished, unmarked jobs; a live job or an unknown id is skipped.
    marked = store.mark_jobs_ended(
        [ids["succeeded"], ids["running"], ids["cancelling"], "job-0000000000ff"], at=1.0
    )
    assert marked == 1
    assert store.jobs_to_end() == sorted([ids["failed"], ids["cancelled"]])
    assert store.mark_jobs_ended([ids["succeeded"]], at=2.0) == 0  # marked once only
    assert store.mark_jobs_ended([], at=2.0) == 0
    # The cancelling job, once its step ended, is CANCELLED and listed.
    (att,) = store.job_detail(ids["cancelling"]).attempts
    finish(store, att.id, clock.now(), exit_code=None, noticed=True)
    for view in store.job_views([ids["cancelling"]]):
        store.apply_dag(advance(view), clock.now())
    assert store.job(ids["cancelling"]).state == JobState.CANCELLED
    assert ids["cancelling"] in store.jobs_to_end()
    assert store.mark_jobs_ended(store.jobs_to_end(), at=3.0) == 3
    assert store.jobs_to_end() == []


def test_the_list_comes_in_bounded_batches_after_a_cursor(store: Store, clock: FakeClock) -> None:
    ids = [one_step(store, clock, f"job-0000000000{i:02x}") for i in range(5)]
    for job_id in ids:
        store.request_cancel(job_id, by="alice", now=clock.now())
    assert store.jobs_to_end(limit=2) == ids[:2]
    assert store.jobs_to_end(after=ids[1], limit=2) == ids[2:4]
    assert store.jobs_to_end(after=ids[3], limit=2) == ids[4:]
    assert store.jobs_to_end(after=ids[4], limit=2) == []
    store.mark_jobs_ended([ids[2]], at=1.0)
    assert store.jobs_to_end(after=ids[1], limit=2) == [ids[3], ids[4]]


def test_a_retried_job_is_ended_again_when_it_finishes_again(store: Store, clock: FakeClock) -> None:
    job_id = one_step(store, clock, "job-000000000001")
    run_to_end(store, clock, job_id, 1)
    assert store.mark_jobs_ended([job_id], at=1.0) == 1
    store.retry_job(job_id, by="alice", now=clock.now())
    assert store.job(job_id).state == JobState.RUNNING
    assert store.jobs_to_end() == []
    assert store.mark_jobs_ended([job_id], at=2.0) == 0  # a live job is not marked
    clock.advance(10)
    run_to_end(store, clock, job_id, 1)
    assert store.jobs_to_end() == [job_id]


def test_marking_is_a_fenced_write(store: Store, clock: FakeClock) -> None:
    job_id = one_step(store, clock, "job-000000000001")
    store.request_cancel(job_id, by="alice", now=clock.now())
    now = time.time()
    claim = store.claim_lease(LeaseCandidate("a", "seat", "host", 1), ttl_s=30, now=now)
    assert claim.granted and claim.lease is not None
    store.fence_writes(Fence("control", claim.lease.token + 1))  # a leader whose lease moved on
    with pytest.raises(FencedOut):
        store.mark_jobs_ended([job_id], at=1.0)
    store.fence_writes(None)
    assert store.jobs_to_end() == [job_id]  # nothing was marked
    store.fence_writes(Fence("control", claim.lease.token))
    assert store.mark_jobs_ended([job_id], at=1.0) == 1


def test_migration_0009_marks_the_jobs_already_finished(sql_store: Store, clock: FakeClock) -> None:
    """An upgrade does not replay `end_job` for history: finished jobs are marked at their finish,
    live ones are not; a downgrade and upgrade round-trip shows both directions work. SQL only."""
    ids = jobs_in_every_state(sql_store, clock)
    cfg = alembic_config(sql_store.engine.url.render_as_string(hide_password=False))
    with sql_store.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0008")
        assert "executor_ended_at" not in {c["name"] for c in sa.inspect(conn).get_columns("jobs")}
        command.upgrade(cfg, "head")
    with sql_store.engine.connect() as conn:
        rows = dict(conn.execute(sa.select(jobs.c.id, jobs.c.executor_ended_at)).all())
    for name in ("succeeded", "failed", "cancelled"):
        assert rows[ids[name]] == sql_store.job(ids[name]).finished_at
    assert rows[ids["running"]] is None and rows[ids["cancelling"]] is None
    assert sql_store.jobs_to_end() == []


def test_the_query_reads_the_partial_index(sql_store: Store, clock: FakeClock) -> None:
    """SQL only: with a long history of ended jobs, the per-tick read uses `ix_jobs_executor_unended`
    (SQLite: named in the query; PostgreSQL: chosen by its planner from the statistics)."""
    from lowtide.store.job_end_repo import _to_end_query  # noqa: PLC0415 - the query under test

    engine = sql_store.engine
    spec = {"name": "x", "steps": []}
    history = [
        {
            "id": f"job-{i:012x}",
            "name": "x",
            "team": "t",
            "owner": "o",
            "priority": 50,
            "state": "SUCCEEDED",
            "submitted_at": 1.0,
            "finished_at": 2.0,
            "grace_seconds": 30.0,
            "spec": spec,
            "source_text": "",
            "executor_ended_at": 2.0 if i % 500 else None,
        }
        for i in range(5000)
    ]
    with engine.begin() as conn:
        conn.execute(sa.insert(jobs), history)
        if engine.dialect.name == "postgresql":
            conn.execute(sa.text("ANALYZE jobs"))
    assert sql_store.jobs_to_end(limit=3) == [h["id"] for h in history if h["executor_ended_at"] is None][:3]
    query = _to_end_query(engine.dialect.name, "job-000000000000", 50)
    compiled = query.compile(engine, compile_kwargs={"literal_binds": True})
    explain = "EXPLAIN QUERY PLAN" if engine.dialect.name == "sqlite" else "EXPLAIN"
    with engine.connect() as conn:
        plan = " ".join(str(r) for r in conn.execute(sa.text(f"{explain} {compiled}")).all())
    assert "ix_jobs_executor_unended" in plan, plan
