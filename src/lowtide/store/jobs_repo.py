"""The store's API side for jobs: submit, list, read, cancel, retry, and read attempts.

A mixin over `base.StoreBase` (one transaction per call), composed into `repo.Store`; `api` calls
it. Step states start as PENDING/READY here and cancelling moves them through `transitions`
(guarded); the control loop's writes live in `attempts_repo`, the GPU pool in `pool_repo`.
The rules it applies (initial step states, which steps a cancel stops now and which get notice,
step counts, event texts) are `policy.job_rules`, and what a retry reopens `policy.retry`, both
shared with `store.memory`.
Must not: decide anything (what runs when is policy; cancelling only records the request and the
loop gives notice) or read the clock (every time is passed in).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection

from lowtide.control.records import (
    AttemptRecord,
    CheckpointRecord,
    EventRecord,
    IdempotencyConflict,
    JobDetail,
    JobRecord,
    JobScope,
    NewJob,
    NotFound,
    NotRetriable,
    RetriedJob,
    StepRecord,
)
from lowtide.domain.states import JobState, StepState
from lowtide.policy.dag import StepView
from lowtide.policy.job_rules import (
    CANCEL_MOVES,
    cancel_message,
    cancel_target,
    cancels,
    initial_reason,
    initial_step_state,
    step_counts,
    submit_message,
)
from lowtide.policy.retry import RetryRefused, plan_retry
from lowtide.policy.retry import step_event as retry_step_event
from lowtide.store.base import StoreBase, insert_event
from lowtide.store.convert import attempt_record, job_record, resolved_to_doc, step_record
from lowtide.store.schema import attempts, checkpoints, events, jobs, steps
from lowtide.store.transitions import move_job, move_job_steps, move_step


class JobsRepo(StoreBase):
    def create_job(self, new: NewJob) -> JobRecord:
        """Store a new job and its steps; returns the job as stored (no second read).

        With `new.idempotency_key`, a job of the same owner with that key is returned instead
        (its id differs from `new.id`: a replay) when its request digest matches, else
        `IdempotencyConflict`. Two such submits racing make one job: the loser's insert breaks
        the unique (owner, idempotency_key) index and it returns the winner's job."""
        try:
            return self._insert_job(new)
        except sa.exc.IntegrityError:
            if new.idempotency_key is None:
                raise
            with self._read() as conn:
                found = _idempotent_job_id(conn, new)
            if found is None:
                raise
            return self.job(found)

    def _insert_job(self, new: NewJob) -> JobRecord:
        spec = new.spec
        now = new.submitted_at
        document = spec.to_document()
        step_states = [initial_step_state(step.depends).value for step in spec.steps]
        with self._write() as conn:
            if new.idempotency_key is not None and (found := _idempotent_job_id(conn, new)) is not None:
                replayed = found
            else:
                replayed = None
                self._insert_job_rows(conn, new, document, step_states)
        if replayed is not None:
            return self.job(replayed)
        return JobRecord(
            id=new.id,
            name=spec.name,
            team=spec.team,
            owner=new.owner,
            priority=spec.priority,
            state=JobState.QUEUED,
            submitted_at=now,
            started_at=None,
            finished_at=None,
            cancel_requested_at=None,
            grace_seconds=spec.grace_seconds,
            template=spec.template,
            rerun_of=new.rerun_of,
            spec=document,
            source_text=new.source_text,
            message="",
            step_states=step_counts(step_states),
        )

    def _insert_job_rows(
        self, conn: Connection, new: NewJob, document: dict[str, Any], step_states: list[str]
    ) -> None:
        spec = new.spec
        now = new.submitted_at
        conn.execute(
            sa.insert(jobs).values(
                id=new.id,
                name=spec.name,
                team=spec.team,
                owner=new.owner,
                priority=spec.priority,
                state=JobState.QUEUED.value,
                submitted_at=now,
                grace_seconds=spec.grace_seconds,
                template=spec.template,
                rerun_of=new.rerun_of,
                spec=document,
                source_text=new.source_text,
                message="",
                idempotency_key=new.idempotency_key,
                request_digest=new.request_digest,
            )
        )
        conn.execute(
            sa.insert(steps),
            [
                {
                    "job_id": new.id,
                    "name": step.name,
                    "idx": i,
                    "state": step_states[i],
                    "gpus": step.gpus,
                    "depends": list(step.depends),
                    "resolved": resolved_to_doc(resolved),
                    "max_retries": spec.retries_for(step),
                    "min_runtime": step.min_runtime,
                    "max_preemptions": step.max_preemptions,
                    "restart_seconds": step.restart_seconds,
                    "retries_used": 0,
                    "preemptions": 0,
                    "eligible_at": 0.0,
                    "reason": initial_reason(step.depends),
                    "updated_at": now,
                }
                for i, (step, resolved) in enumerate(zip(spec.steps, new.resolved, strict=True))
            ],
        )
        insert_event(conn, new.id, None, None, now, "submitted", submit_message(new.owner, new.rerun_of))

    def list_jobs(
        self,
        *,
        states: Sequence[JobState] = (),
        team: str | None = None,
        owner: str | None = None,
        name: str | None = None,
        limit: int = 100,
        before: float | None = None,
        visible_to: JobScope | None = None,
    ) -> list[JobRecord]:
        """Newest first; `visible_to` keeps only the jobs that scope may see (its owner's, its
        teams'), in the query, so `limit` counts visible jobs (docs/architecture.md §11)."""
        q = sa.select(jobs).order_by(jobs.c.submitted_at.desc(), jobs.c.id.desc()).limit(limit)
        if visible_to is not None and not visible_to.all_teams:
            q = q.where(sa.or_(jobs.c.owner == visible_to.owner, jobs.c.team.in_(visible_to.teams)))
        if states:
            q = q.where(jobs.c.state.in_([s.value for s in states]))
        if team:
            q = q.where(jobs.c.team == team)
        if owner:
            q = q.where(jobs.c.owner == owner)
        if name:
            q = q.where(jobs.c.name == name)
        if before is not None:
            q = q.where(jobs.c.submitted_at < before)
        with self._read() as conn:
            rows = conn.execute(q).all()
            counts = _step_counts(conn, [r.id for r in rows])
        return [job_record(r, counts.get(r.id)) for r in rows]

    def job(self, job_id: str) -> JobRecord:
        with self._read() as conn:
            row = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).first()
            if row is None:
                raise NotFound(f"job '{job_id}' not found")
            return job_record(row, _step_counts(conn, [job_id]).get(job_id))

    def job_detail(self, job_id: str) -> JobDetail:
        with self._read() as conn:
            row = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).first()
            if row is None:
                raise NotFound(f"job '{job_id}' not found")
            step_rows = conn.execute(
                sa.select(steps).where(steps.c.job_id == job_id).order_by(steps.c.idx)
            ).all()
            attempt_rows = conn.execute(
                sa.select(attempts).where(attempts.c.job_id == job_id).order_by(attempts.c.id)
            ).all()
            ckpt_rows = conn.execute(
                sa.select(checkpoints).where(checkpoints.c.job_id == job_id).order_by(checkpoints.c.id)
            ).all()
            event_rows = conn.execute(
                sa.select(events).where(events.c.job_id == job_id).order_by(events.c.id)
            ).all()
        step_recs = tuple(step_record(r) for r in step_rows)
        return JobDetail(
            job=job_record(row, step_counts(s.state for s in step_recs)),
            steps=step_recs,
            attempts=tuple(attempt_record(r) for r in attempt_rows),
            checkpoints=tuple(
                CheckpointRecord(
                    attempt_id=r.attempt_id,
                    job_id=r.job_id,
                    step_name=r.step_name,
                    label=r.label,
                    progress=r.progress,
                    source=r.source,
                    reported_at=r.reported_at,
                )
                for r in ckpt_rows
            ),
            events=tuple(
                EventRecord(
                    job_id=r.job_id,
                    step_name=r.step_name,
                    attempt_id=r.attempt_id,
                    at=r.at,
                    kind=r.kind,
                    message=r.message,
                )
                for r in event_rows
            ),
        )

    def request_cancel(self, job_id: str, *, by: str, now: float) -> JobRecord:
        """Cancel a job: steps not started are CANCELLED now, running ones CANCELLING (the loop
        gives them notice). Cancelling a finished job changes nothing (the record is returned)."""
        with self._write() as conn:
            row = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).first()
            if row is None:
                raise NotFound(f"job '{job_id}' not found")
            state = JobState(row.state)
            if not cancels(state):
                return job_record(row)
            # Not-started steps first (`CANCEL_MOVES` order): on PostgreSQL a concurrent start either
            # commits before (the step is then RUNNING and caught by the second update) or fails its guard.
            moved = {
                move.target: move_job_steps(
                    conn, job_id, move.sources, move.target, reason=move.reason, updated_at=now
                )
                for move in CANCEL_MOVES
            }
            stopping = moved.get(StepState.CANCELLING, 0)
            target = cancel_target(stopping)
            finished = {"finished_at": now} if target == JobState.CANCELLED else {}
            move_job(conn, job_id, state, target, cancel_requested_at=now, **finished)
            message = cancel_message(by, stopping)
            insert_event(conn, job_id, None, None, now, "cancelled", message)
            row = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).one()
            return job_record(row, _step_counts(conn, [job_id]).get(job_id))

    def retry_job(self, job_id: str, *, by: str, now: float) -> RetriedJob:
        """Retry a FAILED or CANCELLED job in place (`policy.retry.plan_retry`): its SUCCEEDED
        steps are kept, the others go back to READY or PENDING with a fresh retry budget, the job
        to RUNNING (QUEUED if it never started). One transaction; the job row is locked first (on
        PostgreSQL a second retry waits and then finds it RUNNING). Raises `NotRetriable` with the
        plan's reason, `NotFound`, or `StaleState` when the job moved under it."""
        with self._write() as conn:
            row = conn.execute(sa.select(jobs).where(jobs.c.id == job_id).with_for_update()).first()
            if row is None:
                raise NotFound(f"job '{job_id}' not found")
            step_rows = conn.execute(
                sa.select(steps.c.id, steps.c.name, steps.c.state, steps.c.depends)
                .where(steps.c.job_id == job_id)
                .order_by(steps.c.idx)
            ).all()
            views = [StepView(r.name, StepState(r.state), tuple(r.depends)) for r in step_rows]
            plan = plan_retry(job_id, JobState(row.state), row.started_at is not None, views, by=by)
            if isinstance(plan, RetryRefused):
                raise NotRetriable(job_id, plan.state, plan.reason)
            move_job(
                conn,
                job_id,
                plan.from_state,
                plan.to_state,
                finished_at=None,
                cancel_requested_at=None,
                executor_ended_at=None,  # it will end again (`job_end_repo`)
                message=plan.message,
            )
            ids = {r.name: r.id for r in step_rows}
            for move in plan.steps:
                move_step(
                    conn,
                    ids[move.step],
                    move.from_state,
                    move.to_state,
                    retries_used=0,
                    preemptions=0,
                    eligible_at=now,
                    stop_grace=None,
                    retried_at=now,
                    reason=move.reason,
                    updated_at=now,
                )
                insert_event(conn, job_id, move.step, None, now, *retry_step_event(move))
            insert_event(conn, job_id, None, None, now, "retried", plan.message)
            row = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).one()
            record = job_record(row, _step_counts(conn, [job_id]).get(job_id))
        return RetriedJob(record, plan.ready, plan.pending, plan.kept)

    def attempt(self, attempt_id: int) -> AttemptRecord:
        with self._read() as conn:
            row = conn.execute(sa.select(attempts).where(attempts.c.id == attempt_id)).first()
        if row is None:
            raise NotFound(f"attempt {attempt_id} not found")
        return attempt_record(row)

    def step(self, job_id: str, step: str) -> StepRecord:
        with self._read() as conn:
            row = conn.execute(sa.select(steps).where(steps.c.job_id == job_id, steps.c.name == step)).first()
        if row is None:
            raise NotFound(f"step '{step}' of job '{job_id}' not found")
        return step_record(row)

    def step_attempts(self, job_id: str, step: str) -> list[AttemptRecord]:
        with self._read() as conn:
            exists = conn.execute(
                sa.select(steps.c.id).where(steps.c.job_id == job_id, steps.c.name == step)
            ).first()
            if exists is None:
                raise NotFound(f"step '{step}' of job '{job_id}' not found")
            rows = conn.execute(
                sa.select(attempts)
                .where(attempts.c.job_id == job_id, attempts.c.step_name == step)
                .order_by(attempts.c.number)
            ).all()
        return [attempt_record(r) for r in rows]

    def job_serial(self, job_id: str) -> int:
        """A number unique to the job and stable for its life: its smallest step id (ids are
        never reused). The executor derives the job's Unix uid from it (docs/architecture.md §6.4)."""
        with self._read() as conn:
            serial = conn.execute(sa.select(sa.func.min(steps.c.id)).where(steps.c.job_id == job_id)).scalar()
        if serial is None:
            raise NotFound(f"job '{job_id}' not found")
        return int(serial)


def _step_counts(conn: Connection, job_ids: list[str]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = defaultdict(dict)
    if job_ids:
        for job_id, state, n in conn.execute(
            sa.select(steps.c.job_id, steps.c.state, sa.func.count())
            .where(steps.c.job_id.in_(job_ids))
            .group_by(steps.c.job_id, steps.c.state)
        ).all():
            counts[job_id][state] = int(n)
    return counts


def _idempotent_job_id(conn: Connection, new: NewJob) -> str | None:
    """The id of the owner's job made with `new.idempotency_key` (None: none yet); raises
    `IdempotencyConflict` when that job came from a different request."""
    row = conn.execute(
        sa.select(jobs.c.id, jobs.c.request_digest).where(
            jobs.c.owner == new.owner, jobs.c.idempotency_key == new.idempotency_key
        )
    ).first()
    if row is None:
        return None
    if row.request_digest != new.request_digest:
        raise IdempotencyConflict(str(new.idempotency_key), row.id)
    return str(row.id)
