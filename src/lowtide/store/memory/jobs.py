"""The in-memory store's API side for jobs: submit, list, read, cancel, retry, and read attempts.

The counterpart of `store.jobs_repo`, with the same signatures, records and errors; the rules
(initial step states, what a cancel does to each step, step counts, event texts) are
`policy.job_rules`, what a retry reopens `policy.retry`, shared with it. Listing walks the jobs
in (submitted_at, id) order from the `before` cursor, so a page costs what it returns plus the
jobs its filters skip.
Neighbours: `base.MemoryBase` (state, guarded moves), `attempts` (the loop's side).
Must not: decide anything or read the clock (every time is passed in).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from lowtide.control.records import (
    AttemptRecord,
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
from lowtide.domain.states import STEP_LIFECYCLE, JobState, StepState
from lowtide.policy.dag import StepView
from lowtide.policy.job_rules import (
    CANCEL_MOVES,
    cancel_message,
    cancel_move,
    cancel_target,
    cancels,
    initial_reason,
    initial_step_state,
    is_open_step,
    step_counts,
    submit_message,
)
from lowtide.policy.retry import RetryRefused, plan_retry
from lowtide.policy.retry import step_event as retry_step_event
from lowtide.store.convert import job_record, resolved_to_doc, step_record
from lowtide.store.memory.base import MemoryBase, count_state
from lowtide.store.memory.rows import JobRow, StepRow
from lowtide.store.memory.values import freeze


class JobsPart(MemoryBase):
    def create_job(self, new: NewJob) -> JobRecord:
        """Store a new job and its steps; returns the job as stored. Raises ValueError if the id
        is taken (the SQL store's primary key refuses it)."""
        spec = new.spec
        now = new.submitted_at
        pairs = list(zip(spec.steps, new.resolved, strict=True))
        job = JobRow(
            id=new.id,
            name=spec.name,
            team=spec.team,
            owner=new.owner,
            priority=spec.priority,
            state=JobState.QUEUED,
            submitted_at=now,
            grace_seconds=spec.grace_seconds,
            template=spec.template,
            rerun_of=new.rerun_of,
            spec=freeze(spec.to_document()),
            source_text=new.source_text,
        )
        with self._lock:
            if new.idempotency_key is not None:  # as the SQL store's unique (owner, key) index
                known = self._idempotency.get((new.owner, new.idempotency_key))
                if known is not None:
                    job_id, digest = known
                    if digest != new.request_digest:
                        raise IdempotencyConflict(new.idempotency_key, job_id)
                    found = self._jobs[job_id]
                    return job_record(found, step_counts(s.state for s in found.steps))
            if new.id in self._jobs:
                raise ValueError(f"job '{new.id}' already exists")
            if new.idempotency_key is not None:
                self._idempotency[(new.owner, new.idempotency_key)] = (new.id, new.request_digest)
            for i, (step, resolved) in enumerate(pairs):
                row = StepRow(
                    id=next(self._step_ids),
                    job=job,
                    name=step.name,
                    idx=i,
                    state=initial_step_state(step.depends),
                    gpus=step.gpus,
                    depends=tuple(step.depends),
                    resolved=freeze(resolved_to_doc(resolved)),
                    max_retries=spec.retries_for(step),
                    min_runtime=step.min_runtime,
                    max_preemptions=step.max_preemptions,
                    restart_seconds=step.restart_seconds,
                    updated_at=now,
                    reason=initial_reason(step.depends),
                )
                job.steps.append(row)
                job.step_by_name[row.name] = row
            self._jobs[job.id] = job
            bisect.insort(self._job_order, (now, job.id))
            count_state(self._job_counts, job.state, 1)
            for row in job.steps:
                count_state(self._step_counts, row.state, 1)
                job.open_steps += is_open_step(row.state)
                self._refresh_step(row)
            self._refresh_job(job)
            self._event(job.id, None, None, now, "submitted", submit_message(new.owner, new.rerun_of))
            return job_record(job, step_counts(s.state for s in job.steps))

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
        """Newest first (submitted_at, then id, descending). A negative `limit` means no limit
        (as SQLite reads it). `visible_to` keeps only the jobs that scope may see."""
        wanted = {JobState(s) for s in states}
        out: list[JobRecord] = []
        with self._lock:
            order = self._job_order
            i = len(order) if before is None else bisect.bisect_left(order, before, key=lambda k: k[0])
            while i > 0 and len(out) != limit:
                i -= 1
                job = self._jobs[order[i][1]]
                if (
                    (wanted and job.state not in wanted)
                    or (team and job.team != team)
                    or (owner and job.owner != owner)
                    or (name and job.name != name)
                    or (visible_to is not None and not visible_to.allows(owner=job.owner, team=job.team))
                ):
                    continue
                out.append(job_record(job, step_counts(s.state for s in job.steps)))
        return out

    def job(self, job_id: str) -> JobRecord:
        with self._lock:
            job = self._job_row(job_id)
            return job_record(job, step_counts(s.state for s in job.steps))

    def job_detail(self, job_id: str) -> JobDetail:
        with self._lock:
            job = self._job_row(job_id)
            steps = tuple(step_record(s) for s in job.steps)
            return JobDetail(
                job=job_record(job, step_counts(s.state for s in steps)),
                steps=steps,
                attempts=tuple(self._attempt_record(a) for a in job.attempts),
                checkpoints=tuple(job.checkpoints),
                events=tuple(self._events.get(job_id, ())),
            )

    def request_cancel(self, job_id: str, *, by: str, now: float) -> JobRecord:
        """Cancel a job (`job_rules.CANCEL_MOVES`); cancelling a finished job changes nothing and
        returns its record (without step counts, as the SQL store does)."""
        with self._lock:
            job = self._job_row(job_id)
            if not cancels(job.state):
                return job_record(job)
            for move in CANCEL_MOVES:
                for source in move.sources:
                    STEP_LIFECYCLE.check(source, move.target)
            stopping = sum(
                1
                for step in job.steps
                if (m := cancel_move(step.state)) is not None and m.target == StepState.CANCELLING
            )
            target = cancel_target(stopping)
            self._check_job(job, job.state, target)
            moved: dict[StepState, int] = {}
            for move in CANCEL_MOVES:
                for step in job.steps:
                    if step.state in move.sources:
                        self._set_step(step, move.target, reason=move.reason, updated_at=now)
                        moved[move.target] = moved.get(move.target, 0) + 1
            finished = {"finished_at": now} if target == JobState.CANCELLED else {}
            self._set_job(job, target, cancel_requested_at=now, **finished)
            message = cancel_message(by, moved.get(StepState.CANCELLING, 0))
            self._event(job_id, None, None, now, "cancelled", message)
            return job_record(job, step_counts(s.state for s in job.steps))

    def retry_job(self, job_id: str, *, by: str, now: float) -> RetriedJob:
        """Retry a FAILED or CANCELLED job in place (`policy.retry.plan_retry`), as
        `store.jobs_repo.JobsRepo.retry_job`: every move is checked before any is made."""
        with self._lock:
            self._check_fence()
            job = self._job_row(job_id)
            views = [StepView(s.name, s.state, s.depends) for s in job.steps]
            plan = plan_retry(job_id, job.state, job.started_at is not None, views, by=by)
            if isinstance(plan, RetryRefused):
                raise NotRetriable(job_id, plan.state, plan.reason)
            self._check_job(job, plan.from_state, plan.to_state)
            for move in plan.steps:
                self._check_step(job.step_by_name[move.step], move.from_state, move.to_state)
            self._set_job(
                job,
                plan.to_state,
                finished_at=None,
                cancel_requested_at=None,
                executor_ended_at=None,  # it will end again (`job_end`)
                message=plan.message,
            )
            for move in plan.steps:
                self._set_step(
                    job.step_by_name[move.step],
                    move.to_state,
                    retries_used=0,
                    preemptions=0,
                    eligible_at=now,
                    stop_grace=None,
                    retried_at=now,
                    reason=move.reason,
                    updated_at=now,
                )
                self._event(job_id, move.step, None, now, *retry_step_event(move))
            self._event(job_id, None, None, now, "retried", plan.message)
            record = job_record(job, step_counts(s.state for s in job.steps))
        return RetriedJob(record, plan.ready, plan.pending, plan.kept)

    def attempt(self, attempt_id: int) -> AttemptRecord:
        with self._lock:
            att = self._attempts.get(attempt_id)
            if att is None:
                raise NotFound(f"attempt {attempt_id} not found")
            return self._attempt_record(att)

    def step(self, job_id: str, step: str) -> StepRecord:
        with self._lock:
            return step_record(self._step_row(job_id, step))

    def step_attempts(self, job_id: str, step: str) -> list[AttemptRecord]:
        with self._lock:
            row = self._step_row(job_id, step)
            return [self._attempt_record(a) for a in row.attempts]

    def job_serial(self, job_id: str) -> int:
        """The job's smallest step id, as `store.jobs_repo.JobsRepo.job_serial`."""
        with self._lock:
            job = self._job_row(job_id)
            if not job.steps:
                raise NotFound(f"job '{job_id}' not found")
            return min(s.id for s in job.steps)
