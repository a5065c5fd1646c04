"""The store's control-loop side: snapshots, attempts from start to exit, DAG moves, events.

A mixin over `base.StoreBase`, composed into `repo.Store`; `control.loop` calls it through
`control.ports.StorePort`. State writes go through `transitions` (guarded), GPU bookings through
`ledger`; finishing an attempt also folds its GPU time into the team's fair-share usage and revokes
its step tokens. Every rule it applies (which checkpoint counts, lost work, notice grace, when a
step is stopping, the usage fold, the attempt record, event texts) is a pure function of
`policy.attempt_rules`, `policy.job_rules` or `policy.fairshare`, shared with `store.memory`.
Neighbours: `jobs_repo` (the API side), `pool_repo`, `tokens_repo`.
Scaling (a job of 10,000 steps, issue 10): what never changes after submit is decoded once per job
and kept for the most recently used jobs (`_JobCache`: the spec's `attempt_rules.index_spec` for
attempt starts, the steps' `depends` for `job_views`); the snapshot reuses the `QueuedStep` built
from an identical row at the previous snapshot. Each is keyed by everything it was built from, so
nothing needs invalidating; each read still returns what the database holds now.
Must not: decide anything (retries, DAG progress and placement arrive as policy's decisions),
compute a rule itself, or read the clock (every time is passed in).
"""

from __future__ import annotations

import copy
import functools
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from lowtide.control.executor_port import AttemptHandle
from lowtide.control.records import (
    AttemptLaunch,
    AttemptRecord,
    CheckpointRecord,
    ExitContext,
    NotFound,
    NoticeDue,
    StaleState,
)
from lowtide.domain.exit_reasons import ExitReason
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
from lowtide.policy import attempt_rules as rules
from lowtide.policy.dag import DagChanges, JobView, StepView
from lowtide.policy.fairshare import decay, fold_usage
from lowtide.policy.job_rules import dag_job_event, dag_step_event
from lowtide.policy.outcomes import ExitDecision
from lowtide.policy.snapshot import QueuedStep, Snapshot
from lowtide.store import ledger
from lowtide.store.base import StoreBase, insert_event
from lowtide.store.convert import attempt_record, resolved_from_doc
from lowtide.store.schema import attempts, checkpoints, jobs, steps, team_usage, tokens
from lowtide.store.transitions import move_attempt, move_job, move_step

_ACTIVE = [s.value for s in sorted(rules.ACTIVE_ATTEMPT_STATES)]
_QUEUED = [s.value for s in sorted(QUEUED_STEP_STATES)]
# A column's text to its state by one dict lookup: 10,000 queued rows per tick make the
# `StepState(text)` call (enum lookup machinery) a visible part of a snapshot.
_STEP_STATE: dict[str, StepState] = {s.value: s for s in StepState}
#: Jobs whose spec index (`attempt_rules.index_spec`) and whose steps' `depends` are kept.
SPEC_CACHE_JOBS = 16
DEPENDS_CACHE_JOBS = 1024

_V = TypeVar("_V")


class _JobCache(Generic[_V]):
    """Values derived from what never changes after a job's submit (its spec, its steps'
    `depends` with `_DagSteps`), for the most recently used jobs, keyed by (job id, submitted_at).

    Why: a 10,000-step job's spec is ~1.5 MB of JSON and its steps' `depends` 10,000 JSON
    values; decoding them on every attempt start and every DAG read made each tick O(steps)
    in JSON decoding. Nothing invalidates an entry because nothing changes what it was derived
    from (jobs are never updated in these columns, and a job id is never reused; the submit time
    in the key guards even that). Thread-safe: the API and the loop share a store.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[tuple[str, float], _V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, float], load: Callable[[], _V]) -> _V:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = load()
        with self._lock:
            self._items[key] = value
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return value


class AttemptsRepo(StoreBase):
    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self._spec_indexes: _JobCache[rules.SpecIndex] = _JobCache(SPEC_CACHE_JOBS)
        self._dag_steps: _JobCache[_DagSteps] = _JobCache(DEPENDS_CACHE_JOBS)
        # The last snapshot's queued steps by the row each was built from (see `snapshot`).
        self._queued_views: dict[tuple[Any, ...], QueuedStep] = {}

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
                    jobs.c.owner,
                    # In the resolved step's document (no column): NULL when not declared.
                    steps.c.resolved["gpu_memory_gib"].as_float(),
                )
                .select_from(steps.join(jobs, jobs.c.id == steps.c.job_id))
                .where(steps.c.state.in_(_QUEUED))
                .order_by(steps.c.id)
            ).all()
            running_rows = conn.execute(
                sa.select(
                    attempts.c.id,
                    attempts.c.job_id,
                    attempts.c.step_name,
                    attempts.c.node,
                    attempts.c.gpus,
                    attempts.c.started_at,
                    attempts.c.state,
                    jobs.c.team,
                    jobs.c.priority,
                    steps.c.state.label("step_state"),
                    steps.c.last_checkpoint_at,
                    steps.c.min_runtime,
                    steps.c.restart_seconds,
                    jobs.c.owner,
                )
                .select_from(
                    attempts.join(jobs, jobs.c.id == attempts.c.job_id).join(
                        steps, steps.c.id == attempts.c.step_id
                    )
                )
                .where(attempts.c.state.in_(_ACTIVE))
                .order_by(attempts.c.id)
            ).all()
            usage_rows = conn.execute(sa.select(team_usage)).all()
        # Most queued rows are the same from one tick to the next: reuse the view built from an
        # equal row (every column it is built from is in the row), and keep only this snapshot's.
        previous = self._queued_views
        built: dict[tuple[Any, ...], QueuedStep] = {}
        for row in queued_rows:
            key = tuple(row)
            view = previous.get(key)
            if view is None:
                view = _queued_step(*key)
            built[key] = view
        self._queued_views = built
        queued = tuple(built.values())
        running = tuple(
            rules.running_step(
                attempt_id=r.id,
                attempt_state=AttemptState(r.state),
                job_id=r.job_id,
                step=r.step_name,
                step_state=StepState(r.step_state),
                team=r.team,
                priority=r.priority,
                node=r.node,
                gpus=r.gpus,
                started_at=r.started_at,
                last_checkpoint_at=r.last_checkpoint_at,
                min_runtime=r.min_runtime,
                restart_seconds=r.restart_seconds,
                owner=r.owner,
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
                    jobs.c.submitted_at.label("job_submitted_at"),
                    jobs.c.grace_seconds,
                )
                .select_from(steps.join(jobs, jobs.c.id == steps.c.job_id))
                .where(steps.c.job_id == job_id, steps.c.name == step)
            ).first()
            if row is None:
                raise NotFound(f"step '{step}' of job '{job_id}' not found")
            job_state = JobState(row.job_state)
            if not rules.can_start(job_state):
                raise StaleState(f"job {job_id} is {job_state}")
            state = StepState(row.state)
            move_step(conn, row.id, state, StepState.RUNNING, reason=reason, updated_at=now)
            number = rules.next_attempt_number(
                conn.execute(
                    sa.select(sa.func.max(attempts.c.number)).where(attempts.c.step_id == row.id)
                ).scalar()
            )
            resolved = resolved_from_doc(row.resolved)
            spec = self._spec_indexes.get(
                (job_id, row.job_submitted_at),
                lambda: rules.index_spec(
                    conn.execute(sa.select(jobs.c.spec).where(jobs.c.id == job_id)).scalar_one()
                ),
            )
            # A deep copy: the index is shared by every start of the job, the params are the caller's.
            params = copy.deepcopy(rules.launch_params(spec.job_fields))
            work_dir = layout.attempt_dir(job_id, step, number)
            record = rules.reproducibility_record(
                spec=spec,
                resolved_doc=row.resolved,
                resolved=resolved,
                last_checkpoint=row.last_checkpoint,
                node=node,
                gpus=gpus,
            )
            attempt_id = conn.execute(
                sa.insert(attempts)
                .values(
                    job_id=job_id,
                    step_id=row.id,
                    step_name=step,
                    number=number,
                    state=AttemptState.PENDING.value,  # RUNNING once the executor says it runs
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
            job_target = rules.job_state_on_start(job_state)
            if job_target is not None:
                move_job(conn, job_id, job_state, job_target, started_at=now)
            insert_event(
                conn, job_id, step, attempt_id, now, "started", rules.start_message(number, node, gpus)
            )
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

    def record_launch(self, attempt_id: int, handle: AttemptHandle) -> None:
        """Keep what runs the attempt; if it already runs, move it PENDING -> RUNNING."""
        with self._write() as conn:
            conn.execute(
                sa.update(attempts)
                .where(attempts.c.id == attempt_id)
                .values(handle=handle.ref, handle_started_at=handle.started_at)
            )
            if handle.running_at is not None:
                self._mark_running(conn, attempt_id, handle.running_at)

    def mark_running(self, attempt_id: int, at: float) -> None:
        """A pending attempt began to run at `at` (`attempt_rules.running_transition`)."""
        with self._write() as conn:
            self._mark_running(conn, attempt_id, at)

    @staticmethod
    def _mark_running(conn: sa.Connection, attempt_id: int, at: float) -> None:
        row = conn.execute(
            sa.select(attempts.c.state, attempts.c.running_at, attempts.c.started_at).where(
                attempts.c.id == attempt_id
            )
        ).first()
        if row is None:
            return  # as an UPDATE of no row
        change = rules.running_transition(AttemptState(row.state), row.running_at, row.started_at, at)
        if change is None:
            return
        target, running_at = change
        if target.value == row.state:  # noticed while pending: it only learns when it ran
            conn.execute(sa.update(attempts).where(attempts.c.id == attempt_id).values(running_at=running_at))
        else:
            move_attempt(conn, attempt_id, [AttemptState(row.state)], target, running_at=running_at)

    def active_attempts(self) -> list[AttemptRecord]:
        with self._read() as conn:
            rows = conn.execute(
                sa.select(attempts).where(attempts.c.state.in_(_ACTIVE)).order_by(attempts.c.id)
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
                    attempts.c.started_at,
                    steps.c.state.label("step_state"),
                    steps.c.retries_used,
                    steps.c.max_retries,
                    steps.c.resolved,
                    steps.c.last_checkpoint,
                    steps.c.preemptions,
                    steps.c.max_preemptions,
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
            preemptions=row.preemptions,
            max_preemptions=row.max_preemptions,
            started_at=row.started_at,
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
        reason: ExitReason | None = None,
        detail: str | None = None,
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
                preempted=decision.preempted,
                exit_reason=None if reason is None else reason.value,
                exit_detail=detail,
            )
            step_id = conn.execute(
                sa.select(attempts.c.step_id).where(attempts.c.id == ctx.attempt_id)
            ).scalar_one()
            values: dict[str, Any] = {
                "retries_used": decision.retries_used,
                "eligible_at": decision.eligible_at,
                "reason": decision.message,
                "updated_at": ended_at,
                "stop_grace": None,
            }
            if increment := rules.preemption_increment(decision):
                values["preemptions"] = steps.c.preemptions + increment
            move_step(conn, step_id, ctx.step_state, decision.step_state, **values)
            att = conn.execute(
                sa.select(
                    attempts.c.started_at,
                    attempts.c.running_at,
                    attempts.c.gpus,
                    jobs.c.team,
                    steps.c.last_checkpoint_at,
                )
                .select_from(
                    attempts.join(jobs, jobs.c.id == attempts.c.job_id).join(
                        steps, steps.c.id == attempts.c.step_id
                    )
                )
                .where(attempts.c.id == ctx.attempt_id)
            ).one()
            lost = rules.lost_work_at_exit(
                decision.attempt_state,
                len(att.gpus),
                rules.work_started_at(att.started_at, att.running_at, ended_at),
                att.last_checkpoint_at,
                ended_at,
            )
            conn.execute(
                sa.update(attempts).where(attempts.c.id == ctx.attempt_id).values(lost_gpu_seconds=lost)
            )
            ledger.release(conn, kind=ledger.ATTEMPT, holder_id=str(ctx.attempt_id), now=ended_at)
            _fold_usage(conn, att.team, len(att.gpus), att.started_at, ended_at, half_life_s)
            conn.execute(
                sa.update(tokens)
                .where(tokens.c.attempt_id == ctx.attempt_id, tokens.c.revoked_at.is_(None))
                .values(revoked_at=ended_at)
            )
            insert_event(
                conn,
                ctx.job_id,
                ctx.step,
                ctx.attempt_id,
                ended_at,
                rules.exit_event_kind(decision.attempt_state),
                decision.message,
            )

    def request_preemption(self, attempt_id: int, *, grace_s: float, reason: str, now: float) -> None:
        """Move a running step to PREEMPTING: the loop gives it notice with `grace_s` (at most its
        job's grace). Raises StaleState if the step is no longer RUNNING."""
        with self._write() as conn:
            row = conn.execute(
                sa.select(steps.c.id, attempts.c.job_id, attempts.c.step_name, jobs.c.grace_seconds)
                .select_from(
                    attempts.join(steps, steps.c.id == attempts.c.step_id).join(
                        jobs, jobs.c.id == attempts.c.job_id
                    )
                )
                .where(
                    attempts.c.id == attempt_id,
                    attempts.c.state.in_([s.value for s in sorted(rules.UNNOTICED_ATTEMPT_STATES)]),
                )
            ).first()
            if row is None:
                raise StaleState(f"attempt {attempt_id} is not running")
            grace = rules.preemption_grace(grace_s, row.grace_seconds)
            move_step(
                conn,
                row.id,
                StepState.RUNNING,
                StepState.PREEMPTING,
                stop_grace=grace,
                reason=f"preempting: {reason}",
                updated_at=now,
            )
            insert_event(conn, row.job_id, row.step_name, attempt_id, now, "preempting", reason)

    def attempt_times(self, attempt_ids: Iterable[int]) -> dict[int, tuple[float | None, float | None]]:
        """`attempt id -> (notice_at, ended_at)` for the given attempts."""
        ids = list(attempt_ids)
        if not ids:
            return {}
        with self._read() as conn:
            rows = conn.execute(
                sa.select(attempts.c.id, attempts.c.notice_at, attempts.c.ended_at).where(
                    attempts.c.id.in_(ids)
                )
            ).all()
        return {r.id: (r.notice_at, r.ended_at) for r in rows}

    def notices_due(self) -> list[NoticeDue]:
        with self._read() as conn:
            rows = conn.execute(
                sa.select(
                    attempts.c.id,
                    attempts.c.job_id,
                    attempts.c.step_name,
                    steps.c.state.label("step_state"),
                    steps.c.stop_grace,
                    jobs.c.grace_seconds,
                )
                .select_from(
                    attempts.join(steps, steps.c.id == attempts.c.step_id).join(
                        jobs, jobs.c.id == attempts.c.job_id
                    )
                )
                .where(
                    attempts.c.state.in_([s.value for s in sorted(rules.UNNOTICED_ATTEMPT_STATES)]),
                    steps.c.state.in_([s.value for s in sorted(rules.NOTICE_STEP_STATES)]),
                )
                .order_by(attempts.c.id)
            ).all()
        return [
            NoticeDue(
                attempt_id=r.id,
                job_id=r.job_id,
                step=r.step_name,
                step_state=StepState(r.step_state),
                grace_seconds=rules.notice_grace(r.stop_grace, r.grace_seconds),
            )
            for r in rows
        ]

    def mark_stopping(self, attempt_id: int, *, deadline: float, reason: str, now: float) -> None:
        with self._write() as conn:
            move_attempt(
                conn,
                attempt_id,
                sorted(rules.UNNOTICED_ATTEMPT_STATES),
                AttemptState.STOPPING,
                notice_at=now,
                stop_deadline=deadline,
                stop_reason=reason,
            )
            row = conn.execute(
                sa.select(attempts.c.job_id, attempts.c.step_name).where(attempts.c.id == attempt_id)
            ).one()
            insert_event(conn, row.job_id, row.step_name, attempt_id, now, "notice", reason)

    def job_views(self, job_ids: Iterable[str] | None = None) -> list[JobView]:
        """Jobs whose DAG may move (`job_rules.job_may_move`, as a query): the given ones, or every
        job not finished or with a step not finished; in job id order."""
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
            job_rows = conn.execute(
                sa.select(jobs.c.id, jobs.c.state, jobs.c.submitted_at)
                .where(jobs.c.id.in_(ids))
                .order_by(jobs.c.id)
            ).all()
            # `depends` never changes after submit: decoded once per job (`_JobCache`), so a
            # job read here every tick costs its steps' names and states, not their JSON.
            dag_steps = {
                job_id: self._dag_steps.get(
                    (job_id, submitted_at), functools.partial(_DagSteps.load, conn, job_id)
                )
                for job_id, _, submitted_at in job_rows
            }
            step_rows = conn.execute(
                sa.select(steps.c.job_id, steps.c.name, steps.c.state)
                .where(steps.c.job_id.in_(ids))
                .order_by(steps.c.job_id, steps.c.idx)
            ).all()
        by_job: dict[str, list[StepView]] = defaultdict(list)
        for job_id, name, state in step_rows:
            by_job[job_id].append(dag_steps[job_id].view(name, _STEP_STATE[state]))
        return [JobView(job_id, JobState(state), tuple(by_job[job_id])) for job_id, state, _ in job_rows]

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
                if c.step not in ids:
                    raise NotFound(f"step '{c.step}' of job '{changes.job_id}' not found")
                move_step(conn, ids[c.step], c.from_state, c.to_state, reason=c.reason, updated_at=now)
                if (event := dag_step_event(c)) is not None:
                    insert_event(conn, changes.job_id, c.step, None, now, *event)
            if changes.job is not None:
                move_job(
                    conn,
                    changes.job_id,
                    changes.job.from_state,
                    changes.job.to_state,
                    finished_at=now,
                    message=changes.job.reason,
                )
                insert_event(conn, changes.job_id, None, None, now, *dag_job_event(changes.job))

    def add_event(
        self, job_id: str, step: str | None, attempt_id: int | None, *, at: float, kind: str, message: str
    ) -> None:
        with self._write() as conn:
            insert_event(conn, job_id, step, attempt_id, at, kind, message)

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
            if not rules.checkpoint_is_new(row.last_checkpoint, label):
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
            insert_event(
                conn,
                row.job_id,
                row.step_name,
                attempt_id,
                now,
                "checkpoint",
                rules.checkpoint_message(label, progress),
            )
            return True

    def step_checkpoints(self, job_id: str, step: str) -> list[CheckpointRecord]:
        """Every checkpoint the step reported, in the order reported."""
        with self._read() as conn:
            rows = conn.execute(
                sa.select(checkpoints)
                .where(checkpoints.c.job_id == job_id, checkpoints.c.step_name == step)
                .order_by(checkpoints.c.id)
            ).all()
        return [
            CheckpointRecord(
                r.attempt_id, r.job_id, r.step_name, r.label, r.progress, r.source, r.reported_at
            )
            for r in rows
        ]

    def record_resume(
        self,
        attempt_id: int,
        *,
        resume_from: str | None,
        fingerprint: str | None,
        skipped: Sequence[tuple[str, str]],
        now: float,
    ) -> None:
        """Where the attempt resumes (`policy.checkpoints`): into its record, with an event per
        checkpoint skipped."""
        with self._write() as conn:
            row = conn.execute(
                sa.select(attempts.c.job_id, attempts.c.step_name, attempts.c.record).where(
                    attempts.c.id == attempt_id
                )
            ).first()
            if row is None:
                raise NotFound(f"attempt {attempt_id} not found")
            record = rules.with_resume(row.record, resume_from, fingerprint)
            conn.execute(sa.update(attempts).where(attempts.c.id == attempt_id).values(record=record))
            for _label, message in skipped:
                insert_event(conn, row.job_id, row.step_name, attempt_id, now, "checkpoint_invalid", message)

    def mark_checkpoint_bad(
        self, attempt_id: int, *, label: str, fingerprint: str | None, message: str, now: float
    ) -> None:
        """Record with the attempt that it crashed on resuming from `label`, and an event."""
        with self._write() as conn:
            row = conn.execute(
                sa.select(attempts.c.job_id, attempts.c.step_name, attempts.c.record).where(
                    attempts.c.id == attempt_id
                )
            ).first()
            if row is None:
                raise NotFound(f"attempt {attempt_id} not found")
            record = rules.with_bad_checkpoint(row.record, label, fingerprint)
            conn.execute(sa.update(attempts).where(attempts.c.id == attempt_id).values(record=record))
            insert_event(conn, row.job_id, row.step_name, attempt_id, now, "checkpoint_bad", message)


def _queued_step(
    job_id: str,
    name: str,
    idx: int,
    state: str,
    gpus: int,
    eligible_at: float,
    retries_used: int,
    max_retries: int,
    team: str,
    priority: int,
    submitted_at: float,
    owner: str,
    gpu_memory_gib: float | None,
) -> QueuedStep:
    """`attempt_rules.queued_step` of one row of `snapshot`'s queued query, column by column."""
    return rules.queued_step(
        job_id=job_id,
        step=name,
        step_index=idx,
        state=_STEP_STATE[state],
        gpus=gpus,
        eligible_at=eligible_at,
        retries_used=retries_used,
        max_retries=max_retries,
        team=team,
        priority=priority,
        submitted_at=submitted_at,
        owner=owner,
        gpu_memory_gib=gpu_memory_gib,
    )


class _DagSteps:
    """What `job_views` keeps per job (in a `_JobCache`): each step's `depends`, which never
    changes, and the `StepView` last built for each step, reused while its state is the same."""

    __slots__ = ("_depends", "_views")

    def __init__(self, depends: dict[str, tuple[str, ...]]) -> None:
        self._depends = depends
        self._views: dict[str, StepView] = {}

    @classmethod
    def load(cls, conn: Connection, job_id: str) -> _DagSteps:
        rows = conn.execute(sa.select(steps.c.name, steps.c.depends).where(steps.c.job_id == job_id)).all()
        return cls({name: tuple(depends) for name, depends in rows})

    def view(self, name: str, state: StepState) -> StepView:
        view = self._views.get(name)
        if view is None or view.state is not state:
            view = self._views[name] = StepView(name, state, self._depends[name])
        return view


def _fold_usage(conn: Connection, team: str, gpus: int, start: float, end: float, half_life_s: float) -> None:
    """Add a finished attempt's GPU time to its team's accumulator (`fairshare.fold_usage`)."""
    row = conn.execute(sa.select(team_usage).where(team_usage.c.team == team)).first()
    prior = None if row is None else (row.decayed_gpu_seconds, row.as_of)
    folded = fold_usage(prior, gpus=gpus, start=start, end=end, now=end, half_life_s=half_life_s)
    if folded is None:
        return
    value, as_of = folded
    if row is None:
        conn.execute(sa.insert(team_usage).values(team=team, decayed_gpu_seconds=value, as_of=as_of))
    else:
        conn.execute(
            sa.update(team_usage)
            .where(team_usage.c.team == team)
            .values(decayed_gpu_seconds=value, as_of=as_of)
        )
