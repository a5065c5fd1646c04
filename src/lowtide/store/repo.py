"""The store facade: every read and write the API and the control loop make, one transaction each.

Writes of job/step/attempt states go through `transitions` (guarded), GPU bookings through
`ledger`. Methods return records (`records`), never live rows. Neighbours: `control.loop` uses the
loop-facing half through the `control.store_port.StorePort` protocol; `api` uses the rest.
Must not: decide anything (retries, DAG progress and placement are policy) or read the clock
(every time is passed in).
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from lowtide.control.executor_port import ProcessIdentity
from lowtide.control.records import (
    AttemptLaunch,
    AttemptRecord,
    CheckpointRecord,
    EventRecord,
    ExitContext,
    GpuHolding,
    JobDetail,
    JobRecord,
    NewJob,
    NotFound,
    NoticeDue,
    StaleState,
    TokenRecord,
)
from lowtide.domain.gpus import GpuRef, Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.states import (
    QUEUED_STEP_STATES,
    TERMINAL_JOB_STATES,
    TERMINAL_STEP_STATES,
    AttemptState,
    JobState,
    StepState,
)
from lowtide.policy.dag import DagChanges, JobView, StepView
from lowtide.policy.fairshare import decay, decayed_integral
from lowtide.policy.outcomes import ExitDecision
from lowtide.policy.snapshot import QueuedStep, RunningStep, Snapshot
from lowtide.store import ledger
from lowtide.store.convert import (
    attempt_record,
    job_record,
    resolved_from_doc,
    resolved_to_doc,
    step_record,
)
from lowtide.store.db import READONLY, make_engine, migrate
from lowtide.store.schema import (
    attempts,
    checkpoints,
    events,
    gpu_ledger,
    jobs,
    meta,
    steps,
    team_usage,
    tokens,
)
from lowtide.store.transitions import move_attempt, move_job, move_job_steps, move_step

ROLES = ("admin", "user", "step")
_RUNNING_ATTEMPT = (AttemptState.RUNNING, AttemptState.STOPPING)


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


class Store:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # SQLite has one writer at a time, and a writer that finds the lock taken polls for it
        # with growing sleeps (up to 100 ms each) until busy_timeout; this process's writers
        # queue on a mutex instead, so the next one starts the moment the lock is free.
        self._write_lock: contextlib.AbstractContextManager[Any] = (
            threading.RLock() if engine.dialect.name == "sqlite" else contextlib.nullcontext()
        )

    @classmethod
    def open(cls, url: str, *, migrate_schema: bool = True) -> Store:
        engine = make_engine(url)
        if migrate_schema:
            migrate(engine)
        return cls(engine)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        with self._write_lock, self.engine.begin() as conn:
            yield conn

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self.engine.connect().execution_options(**{READONLY: True}) as conn, conn.begin():
            yield conn

    # -- meta ----------------------------------------------------------------------------------

    def instance_id(self) -> str:
        """A stable id of this installation (names its processes, so restarts find their own)."""
        with self._write() as conn:
            value = conn.execute(sa.select(meta.c.value).where(meta.c.key == "instance_id")).scalar()
            if value is None:
                value = secrets.token_hex(6)
                conn.execute(sa.insert(meta).values(key="instance_id", value=value))
            return str(value)

    # -- jobs: API side ------------------------------------------------------------------------

    def create_job(self, new: NewJob) -> JobRecord:
        """Store a new job and its steps; returns the job as stored (no second read)."""
        spec = new.spec
        now = new.submitted_at
        document = spec.to_document()
        step_states = [(StepState.PENDING if step.depends else StepState.READY).value for step in spec.steps]
        with self._write() as conn:
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
                        "retries_used": 0,
                        "preemptions": 0,
                        "eligible_at": 0.0,
                        "reason": "" if not step.depends else "waiting for " + ", ".join(step.depends),
                        "updated_at": now,
                    }
                    for i, (step, resolved) in enumerate(zip(spec.steps, new.resolved, strict=True))
                ],
            )
            note = f" (rerun of {new.rerun_of})" if new.rerun_of else ""
            _event(conn, new.id, None, None, now, "submitted", f"submitted by {new.owner}{note}")
        counts: dict[str, int] = {}
        for state in sorted(step_states):
            counts[state] = counts.get(state, 0) + 1
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
            step_states=counts,
        )

    def list_jobs(
        self,
        *,
        states: Sequence[JobState] = (),
        team: str | None = None,
        owner: str | None = None,
        name: str | None = None,
        limit: int = 100,
        before: float | None = None,
    ) -> list[JobRecord]:
        q = sa.select(jobs).order_by(jobs.c.submitted_at.desc(), jobs.c.id.desc()).limit(limit)
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
        counts: dict[str, int] = defaultdict(int)
        for s in step_recs:
            counts[s.state.value] += 1
        return JobDetail(
            job=job_record(row, dict(counts)),
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
            if state in TERMINAL_JOB_STATES:
                return job_record(row)
            # Not-started steps first: on PostgreSQL a concurrent start either commits before
            # (the step is then RUNNING and caught by the second update) or fails its guard.
            move_job_steps(
                conn,
                job_id,
                (StepState.PENDING, StepState.READY, StepState.PREEMPTED),
                StepState.CANCELLED,
                reason="job cancelled",
                updated_at=now,
            )
            moved = move_job_steps(
                conn,
                job_id,
                (StepState.RUNNING, StepState.PREEMPTING),
                StepState.CANCELLING,
                reason="job cancelled: stopping",
                updated_at=now,
            )
            move_job(conn, job_id, state, JobState.CANCELLED, cancel_requested_at=now, finished_at=now)
            detail = f"; stopping {moved} running step(s)" if moved else ""
            _event(conn, job_id, None, None, now, "cancelled", f"cancelled by {by}{detail}")
            row = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).one()
            return job_record(row, _step_counts(conn, [job_id]).get(job_id))

    def attempt(self, attempt_id: int) -> AttemptRecord:
        with self._read() as conn:
            row = conn.execute(sa.select(attempts).where(attempts.c.id == attempt_id)).first()
        if row is None:
            raise NotFound(f"attempt {attempt_id} not found")
        return attempt_record(row)

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

    # -- the pool and accounting ---------------------------------------------------------------

    def ensure_gpus(self, nodes: Iterable[Node], now: float) -> None:
        with self._write() as conn:
            ledger.ensure_gpus(conn, [g for n in nodes for g in n.refs()], now)

    def holdings(self) -> list[GpuHolding]:
        with self._read() as conn:
            return ledger.holdings(conn)

    def gpu_seconds_by_holder(self, start: float, end: float) -> dict[str, float]:
        with self._read() as conn:
            return ledger.gpu_seconds_by_holder(conn, start, end)

    def counts(self) -> dict[str, dict[str, int]]:
        """Jobs by state, steps by state and GPUs by holder kind (for /metrics)."""
        with self._read() as conn:
            job_counts = conn.execute(sa.select(jobs.c.state, sa.func.count()).group_by(jobs.c.state)).all()
            step_counts = conn.execute(
                sa.select(steps.c.state, sa.func.count()).group_by(steps.c.state)
            ).all()
            gpu_counts = conn.execute(
                sa.select(gpu_ledger.c.holder_kind, sa.func.count())
                .where(gpu_ledger.c.ended_at.is_(None))
                .group_by(gpu_ledger.c.holder_kind)
            ).all()
        return {
            "jobs": {s: int(n) for s, n in job_counts},
            "steps": {s: int(n) for s, n in step_counts},
            "gpus": {k: int(n) for k, n in gpu_counts},
        }

    # -- the control loop's side ---------------------------------------------------------------

    def snapshot(self, *, now: float, nodes: tuple[Node, ...], half_life_s: float) -> Snapshot:
        with self._read() as conn:
            queued_rows = conn.execute(
                sa.select(
                    steps.c.job_id,
                    steps.c.name,
                    steps.c.idx,
                    steps.c.state,
                    steps.c.gpus,
                    steps.c.eligible_at,
                    steps.c.retries_used,
                    steps.c.max_retries,
                    jobs.c.team,
                    jobs.c.priority,
                    jobs.c.submitted_at,
                )
                .select_from(steps.join(jobs, jobs.c.id == steps.c.job_id))
                .where(steps.c.state.in_([s.value for s in QUEUED_STEP_STATES]))
            ).all()
            running_rows = conn.execute(
                sa.select(
                    attempts.c.id,
                    attempts.c.job_id,
                    attempts.c.step_name,
                    attempts.c.node,
                    attempts.c.gpus,
                    attempts.c.started_at,
                    jobs.c.team,
                    jobs.c.priority,
                )
                .select_from(attempts.join(jobs, jobs.c.id == attempts.c.job_id))
                .where(attempts.c.state.in_([s.value for s in _RUNNING_ATTEMPT]))
            ).all()
            usage_rows = conn.execute(sa.select(team_usage)).all()
        queued = tuple(
            QueuedStep(
                job_id=r.job_id,
                step=r.name,
                team=r.team,
                priority=r.priority,
                gpus=r.gpus,
                submitted_at=r.submitted_at,
                step_index=r.idx,
                eligible_at=r.eligible_at,
                preempted=r.state == StepState.PREEMPTED.value,
                retry_note=(f"attempt {r.retries_used + 1} of {r.max_retries + 1}" if r.retries_used else ""),
            )
            for r in queued_rows
        )
        running = tuple(
            RunningStep(
                attempt_id=r.id,
                job_id=r.job_id,
                step=r.step_name,
                team=r.team,
                priority=r.priority,
                node=r.node,
                gpus=tuple(r.gpus),
                started_at=r.started_at,
            )
            for r in running_rows
        )
        usage = {r.team: decay(r.decayed_gpu_seconds, r.as_of, now, half_life_s) for r in usage_rows}
        return Snapshot(now=now, nodes=nodes, running=running, queued=queued, team_usage=usage)

    def begin_attempt(
        self,
        *,
        job_id: str,
        step: str,
        node: str,
        gpus: tuple[int, ...],
        layout: ArtifactLayout,
        now: float,
        reason: str,
    ) -> AttemptLaunch:
        """Book the step's GPUs and create its next attempt (state RUNNING) in one transaction.

        Raises StaleState if the step is no longer startable and GpuBusy if a GPU is taken:
        nothing is written then.
        """
        with self._write() as conn:
            row = conn.execute(
                sa.select(
                    steps,
                    jobs.c.team,
                    jobs.c.state.label("job_state"),
                    jobs.c.spec,
                    jobs.c.grace_seconds,
                )
                .select_from(steps.join(jobs, jobs.c.id == steps.c.job_id))
                .where(steps.c.job_id == job_id, steps.c.name == step)
            ).first()
            if row is None:
                raise NotFound(f"step '{step}' of job '{job_id}' not found")
            job_state = JobState(row.job_state)
            if job_state in TERMINAL_JOB_STATES:
                raise StaleState(f"job {job_id} is {job_state}")
            state = StepState(row.state)
            move_step(conn, row.id, state, StepState.RUNNING, reason=reason, updated_at=now)
            number = (
                conn.execute(
                    sa.select(sa.func.coalesce(sa.func.max(attempts.c.number), 0)).where(
                        attempts.c.step_id == row.id
                    )
                ).scalar_one()
                + 1
            )
            resolved = resolved_from_doc(row.resolved)
            params = dict(row.spec.get("params") or {})
            work_dir = layout.attempt_dir(job_id, step, number)
            record = {
                "spec": row.spec,
                "resolved": row.resolved,
                "params": params,
                "image": resolved.image,
                "inputs": dict(resolved.inputs),
                "outputs": resolved.outputs,
                "checkpoint_dir": resolved.checkpoint_dir,
                "resume_from": row.last_checkpoint,
                "node": node,
                "gpus": list(gpus),
            }
            attempt_id = conn.execute(
                sa.insert(attempts)
                .values(
                    job_id=job_id,
                    step_id=row.id,
                    step_name=step,
                    number=number,
                    state=AttemptState.RUNNING.value,
                    node=node,
                    gpus=list(gpus),
                    started_at=now,
                    work_dir=work_dir,
                    record=record,
                    message="",
                )
                .returning(attempts.c.id)
            ).scalar_one()
            ledger.hold(
                conn,
                [GpuRef(node, i) for i in gpus],
                kind=ledger.ATTEMPT,
                holder_id=str(attempt_id),
                job_id=job_id,
                team=row.team,
                now=now,
            )
            if job_state == JobState.QUEUED:
                move_job(conn, job_id, JobState.QUEUED, JobState.RUNNING, started_at=now)
            where = f"{node} GPUs {','.join(map(str, gpus))}" if gpus else f"{node} (no GPUs)"
            _event(conn, job_id, step, attempt_id, now, "started", f"attempt {number} started on {where}")
            return AttemptLaunch(
                attempt_id=attempt_id,
                number=number,
                job_id=job_id,
                step=step,
                team=row.team,
                node=node,
                gpus=gpus,
                resolved=resolved,
                params=params,
                work_dir=work_dir,
                last_checkpoint=row.last_checkpoint,
                grace_seconds=row.grace_seconds,
            )

    def set_attempt_process(self, attempt_id: int, identity: ProcessIdentity) -> None:
        with self._write() as conn:
            conn.execute(
                sa.update(attempts)
                .where(attempts.c.id == attempt_id)
                .values(pid=identity.pid, pid_started_at=identity.started_at)
            )

    def active_attempts(self) -> list[AttemptRecord]:
        with self._read() as conn:
            rows = conn.execute(
                sa.select(attempts)
                .where(attempts.c.state.in_([s.value for s in _RUNNING_ATTEMPT]))
                .order_by(attempts.c.id)
            ).all()
        return [attempt_record(r) for r in rows]

    def exit_context(self, attempt_id: int) -> ExitContext:
        with self._read() as conn:
            row = conn.execute(
                sa.select(
                    attempts.c.id,
                    attempts.c.job_id,
                    attempts.c.step_name,
                    attempts.c.state,
                    steps.c.state.label("step_state"),
                    steps.c.retries_used,
                    steps.c.max_retries,
                    steps.c.resolved,
                    steps.c.last_checkpoint,
                )
                .select_from(attempts.join(steps, steps.c.id == attempts.c.step_id))
                .where(attempts.c.id == attempt_id)
            ).first()
        if row is None:
            raise NotFound(f"attempt {attempt_id} not found")
        return ExitContext(
            attempt_id=row.id,
            job_id=row.job_id,
            step=row.step_name,
            attempt_state=AttemptState(row.state),
            step_state=StepState(row.step_state),
            retries_used=row.retries_used,
            max_retries=row.max_retries,
            checkpoint_dir=row.resolved.get("checkpoint_dir"),
            last_checkpoint=row.last_checkpoint,
        )

    def finish_attempt(
        self,
        ctx: ExitContext,
        decision: ExitDecision,
        *,
        ended_at: float,
        exit_code: int | None,
        signal: int | None,
        killed_at_deadline: bool,
        half_life_s: float,
    ) -> None:
        """Apply an exit decision: attempt and step states, GPUs back to idle, usage, tokens."""
        with self._write() as conn:
            move_attempt(
                conn,
                ctx.attempt_id,
                [ctx.attempt_state],
                decision.attempt_state,
                ended_at=ended_at,
                exit_code=exit_code,
                signal=signal,
                killed_at_deadline=killed_at_deadline,
                message=decision.message,
            )
            step_id = conn.execute(
                sa.select(attempts.c.step_id).where(attempts.c.id == ctx.attempt_id)
            ).scalar_one()
            values: dict[str, Any] = {
                "retries_used": decision.retries_used,
                "eligible_at": decision.eligible_at,
                "reason": decision.message,
                "updated_at": ended_at,
            }
            if decision.preempted:
                values["preemptions"] = steps.c.preemptions + 1
            move_step(conn, step_id, ctx.step_state, decision.step_state, **values)
            att = conn.execute(
                sa.select(attempts.c.started_at, attempts.c.gpus, jobs.c.team)
                .select_from(attempts.join(jobs, jobs.c.id == attempts.c.job_id))
                .where(attempts.c.id == ctx.attempt_id)
            ).one()
            ledger.release(conn, kind=ledger.ATTEMPT, holder_id=str(ctx.attempt_id), now=ended_at)
            if att.gpus:
                _fold_usage(conn, att.team, len(att.gpus), att.started_at, ended_at, ended_at, half_life_s)
            conn.execute(
                sa.update(tokens)
                .where(tokens.c.attempt_id == ctx.attempt_id, tokens.c.revoked_at.is_(None))
                .values(revoked_at=ended_at)
            )
            _event(
                conn,
                ctx.job_id,
                ctx.step,
                ctx.attempt_id,
                ended_at,
                decision.attempt_state.value.lower(),
                decision.message,
            )

    def notices_due(self) -> list[NoticeDue]:
        with self._read() as conn:
            rows = conn.execute(
                sa.select(
                    attempts.c.id,
                    attempts.c.job_id,
                    attempts.c.step_name,
                    steps.c.state.label("step_state"),
                    jobs.c.grace_seconds,
                )
                .select_from(
                    attempts.join(steps, steps.c.id == attempts.c.step_id).join(
                        jobs, jobs.c.id == attempts.c.job_id
                    )
                )
                .where(
                    attempts.c.state == AttemptState.RUNNING.value,
                    steps.c.state.in_([StepState.CANCELLING.value, StepState.PREEMPTING.value]),
                )
            ).all()
        return [
            NoticeDue(
                attempt_id=r.id,
                job_id=r.job_id,
                step=r.step_name,
                step_state=StepState(r.step_state),
                grace_seconds=r.grace_seconds,
            )
            for r in rows
        ]

    def mark_stopping(self, attempt_id: int, *, deadline: float, reason: str, now: float) -> None:
        with self._write() as conn:
            move_attempt(
                conn,
                attempt_id,
                [AttemptState.RUNNING],
                AttemptState.STOPPING,
                notice_at=now,
                stop_deadline=deadline,
                stop_reason=reason,
            )
            row = conn.execute(
                sa.select(attempts.c.job_id, attempts.c.step_name).where(attempts.c.id == attempt_id)
            ).one()
            _event(conn, row.job_id, row.step_name, attempt_id, now, "notice", reason)

    def job_views(self, job_ids: Iterable[str] | None = None) -> list[JobView]:
        """Jobs whose DAG may move: the given ones, or every job with a non-terminal step."""
        with self._read() as conn:
            if job_ids is None:
                open_jobs = sa.select(jobs.c.id).where(
                    jobs.c.state.not_in([s.value for s in TERMINAL_JOB_STATES])
                )
                open_steps = sa.select(steps.c.job_id).where(
                    steps.c.state.not_in([s.value for s in TERMINAL_STEP_STATES])
                )
                ids = [r[0] for r in conn.execute(sa.union(open_jobs, open_steps)).all()]
            else:
                ids = list(dict.fromkeys(job_ids))
            if not ids:
                return []
            job_rows = conn.execute(sa.select(jobs.c.id, jobs.c.state).where(jobs.c.id.in_(ids))).all()
            step_rows = conn.execute(
                sa.select(steps.c.job_id, steps.c.name, steps.c.state, steps.c.depends)
                .where(steps.c.job_id.in_(ids))
                .order_by(steps.c.job_id, steps.c.idx)
            ).all()
        by_job: dict[str, list[StepView]] = defaultdict(list)
        for r in step_rows:
            by_job[r.job_id].append(StepView(r.name, StepState(r.state), tuple(r.depends)))
        return [JobView(r.id, JobState(r.state), tuple(by_job[r.id])) for r in job_rows]

    def apply_dag(self, changes: DagChanges, now: float) -> None:
        if changes.empty:
            return
        with self._write() as conn:
            ids = dict(
                conn.execute(
                    sa.select(steps.c.name, steps.c.id).where(steps.c.job_id == changes.job_id)
                ).all()
            )
            for c in changes.steps:
                move_step(conn, ids[c.step], c.from_state, c.to_state, reason=c.reason, updated_at=now)
                if c.to_state != StepState.READY:
                    _event(conn, changes.job_id, c.step, None, now, c.to_state.value.lower(), c.reason)
            if changes.job is not None:
                move_job(
                    conn,
                    changes.job_id,
                    changes.job.from_state,
                    changes.job.to_state,
                    finished_at=now,
                    message=changes.job.reason,
                )
                _event(
                    conn,
                    changes.job_id,
                    None,
                    None,
                    now,
                    changes.job.to_state.value.lower(),
                    changes.job.reason,
                )

    def add_event(
        self, job_id: str, step: str | None, attempt_id: int | None, *, at: float, kind: str, message: str
    ) -> None:
        with self._write() as conn:
            _event(conn, job_id, step, attempt_id, at, kind, message)

    def set_waiting_reasons(self, reasons: Mapping[tuple[str, str], str]) -> None:
        if not reasons:
            return
        with self._write() as conn:
            conn.execute(
                sa.update(steps)
                .where(steps.c.job_id == sa.bindparam("j"), steps.c.name == sa.bindparam("s"))
                .values(reason=sa.bindparam("r")),
                [{"j": j, "s": s, "r": r} for (j, s), r in reasons.items()],
            )

    def record_checkpoint(
        self,
        attempt_id: int,
        *,
        label: str,
        progress: str | None,
        source: str,
        now: float,
    ) -> bool:
        """Record a checkpoint an attempt reported; returns False if it was already the latest."""
        with self._write() as conn:
            row = conn.execute(
                sa.select(
                    attempts.c.job_id, attempts.c.step_name, attempts.c.step_id, steps.c.last_checkpoint
                )
                .select_from(attempts.join(steps, steps.c.id == attempts.c.step_id))
                .where(attempts.c.id == attempt_id)
            ).first()
            if row is None:
                raise NotFound(f"attempt {attempt_id} not found")
            if row.last_checkpoint == label:
                return False
            conn.execute(
                sa.insert(checkpoints).values(
                    attempt_id=attempt_id,
                    job_id=row.job_id,
                    step_name=row.step_name,
                    label=label,
                    progress=progress,
                    source=source,
                    reported_at=now,
                )
            )
            conn.execute(
                sa.update(steps)
                .where(steps.c.id == row.step_id)
                .values(last_checkpoint=label, last_checkpoint_at=now)
            )
            detail = f" ({progress})" if progress else ""
            _event(
                conn, row.job_id, row.step_name, attempt_id, now, "checkpoint", f"checkpoint {label}{detail}"
            )
            return True

    # -- tokens --------------------------------------------------------------------------------

    def create_token(
        self, *, name: str, owner: str, role: str, now: float, attempt_id: int | None = None
    ) -> tuple[TokenRecord, str]:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        raw = f"lt_{secrets.token_urlsafe(32)}"
        with self._write() as conn:
            token_id = conn.execute(
                sa.insert(tokens)
                .values(
                    name=name,
                    owner=owner,
                    role=role,
                    token_hash=hash_token(raw),
                    attempt_id=attempt_id,
                    created_at=now,
                )
                .returning(tokens.c.id)
            ).scalar_one()
        return TokenRecord(token_id, name, owner, role, attempt_id, now, None), raw

    def authenticate(self, raw: str) -> TokenRecord | None:
        with self._read() as conn:
            row = conn.execute(
                sa.select(tokens).where(tokens.c.token_hash == hash_token(raw), tokens.c.revoked_at.is_(None))
            ).first()
        if row is None:
            return None
        return TokenRecord(
            row.id, row.name, row.owner, row.role, row.attempt_id, row.created_at, row.revoked_at
        )

    def list_tokens(self) -> list[TokenRecord]:
        with self._read() as conn:
            rows = conn.execute(sa.select(tokens).where(tokens.c.role != "step").order_by(tokens.c.id)).all()
        return [
            TokenRecord(r.id, r.name, r.owner, r.role, r.attempt_id, r.created_at, r.revoked_at) for r in rows
        ]

    def revoke_token(self, token_id: int, now: float) -> None:
        with self._write() as conn:
            result = conn.execute(
                sa.update(tokens)
                .where(tokens.c.id == token_id, tokens.c.revoked_at.is_(None))
                .values(revoked_at=now)
            )
            if result.rowcount != 1:
                raise NotFound(f"token {token_id} not found or already revoked")

    def has_admin_token(self) -> bool:
        with self._read() as conn:
            return (
                conn.execute(
                    sa.select(tokens.c.id)
                    .where(tokens.c.role == "admin", tokens.c.revoked_at.is_(None))
                    .limit(1)
                ).first()
                is not None
            )


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


def _event(
    conn: Connection,
    job_id: str,
    step: str | None,
    attempt_id: int | None,
    at: float,
    kind: str,
    message: str,
) -> None:
    conn.execute(
        sa.insert(events).values(
            job_id=job_id, step_name=step, attempt_id=attempt_id, at=at, kind=kind, message=message
        )
    )


def _fold_usage(
    conn: Connection, team: str, gpus: int, start: float, end: float, now: float, half_life_s: float
) -> None:
    """Add a finished attempt's decayed GPU-seconds to its team's accumulator (fair share)."""
    add = decayed_integral(gpus, start, end, now, half_life_s)
    row = conn.execute(sa.select(team_usage).where(team_usage.c.team == team)).first()
    if row is None:
        conn.execute(sa.insert(team_usage).values(team=team, decayed_gpu_seconds=add, as_of=now))
    else:
        value = decay(row.decayed_gpu_seconds, row.as_of, now, half_life_s) + add
        conn.execute(
            sa.update(team_usage)
            .where(team_usage.c.team == team)
            .values(decayed_gpu_seconds=value, as_of=now)
        )
