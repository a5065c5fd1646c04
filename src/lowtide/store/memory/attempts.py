"""The in-memory store's control-loop side: snapshots, attempts from start to exit, DAG moves,
events and checkpoints.

The counterpart of `store.attempts_repo` (the loop reaches it through `control.ports.StorePort`),
with the same signatures, records and errors; every rule (which checkpoint counts, lost work,
notice grace, when a running step is stopping, the usage fold, the attempt record, event texts)
is the `policy` function the SQL store calls too. The per-tick reads (`snapshot`,
`active_attempts`, `notices_due`, `job_views()`) return `base`'s indexes: O(what they return).
Neighbours: `base.MemoryBase` (state, guarded moves, indexes), `jobs` (the API side), the ledger.
Must not: decide anything (retries, DAG progress and placement arrive as policy's decisions) or
read the clock (every time is passed in).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

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
from lowtide.domain.states import JOB_LIFECYCLE, STEP_LIFECYCLE, AttemptState, StepState
from lowtide.policy import attempt_rules as rules
from lowtide.policy.accounting import ATTEMPT
from lowtide.policy.dag import DagChanges, JobView
from lowtide.policy.fairshare import decay, fold_usage
from lowtide.policy.job_rules import dag_job_event, dag_step_event
from lowtide.policy.outcomes import ExitDecision
from lowtide.policy.pool_rules import REPORTED_ENDED_STATES
from lowtide.policy.snapshot import Snapshot
from lowtide.store.convert import resolved_from_doc
from lowtide.store.memory.base import MemoryBase
from lowtide.store.memory.rows import AttemptRow, StepRow
from lowtide.store.memory.values import freeze, thaw


class AttemptsPart(MemoryBase):
    def snapshot(self, *, now: float, nodes: tuple[Node, ...], half_life_s: float) -> Snapshot:
        with self._lock:
            usage = {team: decay(v, as_of, now, half_life_s) for team, (v, as_of) in self._usage.items()}
            return Snapshot(
                now=now,
                nodes=nodes,
                running=self._running.values(),
                queued=self._queued.values(),
                team_usage=usage,
            )

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
        """Book the step's GPUs and create its next attempt (state RUNNING). Raises NotFound,
        StaleState (the job is finished), IllegalTransition (the step is not startable) or
        GpuBusy, in that order, and then changes nothing."""
        with self._lock:
            self._check_fence()
            row = self._step_row(job_id, step)
            job = row.job
            if not rules.can_start(job.state):
                raise StaleState(f"job {job_id} is {job.state}")
            self._check_step(row, row.state, StepState.RUNNING)
            refs = [GpuRef(node, i) for i in gpus]
            self._ledger.check_bookable(refs)
            job_target = rules.job_state_on_start(job.state)
            if job_target is not None:
                self._check_job(job, job.state, job_target)

            number = rules.next_attempt_number(row.attempts[-1].number if row.attempts else None)
            resolved = resolved_from_doc(row.resolved)
            work_dir = layout.attempt_dir(job_id, step, number)
            if job.spec_index is None:  # the spec never changes: split once per job, not per start
                job.spec_index = rules.index_spec(job.spec)
            record = rules.reproducibility_record(
                spec=job.spec_index,
                resolved_doc=row.resolved,
                resolved=resolved,
                last_checkpoint=row.last_checkpoint,
                node=node,
                gpus=gpus,
            )
            # The step's part of the spec never changes: frozen once per step, shared by its
            # attempts' records (equal to freezing it anew).
            scoped = job.scoped_specs.get(step)
            if scoped is None:
                scoped = job.scoped_specs[step] = freeze(record["spec"])
            record["spec"] = scoped
            last_checkpoint = row.last_checkpoint
            self._set_step(row, StepState.RUNNING, reason=reason, updated_at=now)
            att = AttemptRow(
                id=next(self._attempt_ids),
                step=row,
                number=number,
                state=AttemptState.PENDING,  # RUNNING once the executor says it runs
                node=node,
                gpus=tuple(gpus),
                started_at=now,
                work_dir=work_dir,
                record=freeze(record),
            )
            self._attempts[att.id] = att
            row.attempts.append(att)
            job.attempts.append(att)
            self._ledger.hold(
                refs, kind=ATTEMPT, holder_id=str(att.id), job_id=job_id, team=job.team, now=now
            )
            self._refresh_attempt(att)
            if job_target is not None:
                self._set_job(job, job_target, started_at=now)
            self._event(job_id, step, att.id, now, "started", rules.start_message(number, node, gpus))
            return AttemptLaunch(
                attempt_id=att.id,
                number=number,
                job_id=job_id,
                step=step,
                team=job.team,
                node=node,
                gpus=gpus,
                resolved=resolved,
                params=thaw(rules.launch_params(job.spec)),
                work_dir=work_dir,
                last_checkpoint=last_checkpoint,
                grace_seconds=job.grace_seconds,
            )

    def record_launch(self, attempt_id: int, handle: AttemptHandle) -> None:
        with self._lock:
            self._check_fence()
            att = self._attempts.get(attempt_id)
            if att is None:  # as an UPDATE of no row: nothing happens
                return
            values: dict[str, Any] = {"handle": handle.ref, "handle_started_at": handle.started_at}
            target = att.state
            # The handle and the start it reports in one move (one refresh of the indexes); the
            # handle alone is recorded when that start is refused, as two moves would leave it.
            change = None
            if handle.running_at is not None:
                change = rules.running_transition(
                    att.state, att.running_at, att.started_at, handle.running_at
                )
            if change is not None:
                if change[0] != att.state:
                    try:
                        self._check_attempt(att.id, att.state, change[0])
                    except Exception:
                        self._set_attempt(att, att.state, **values)
                        raise
                target, values["running_at"] = change
            self._set_attempt(att, target, **values)

    def mark_running(self, attempt_id: int, at: float) -> None:
        with self._lock:
            self._check_fence()
            att = self._attempts.get(attempt_id)
            if att is not None:
                self._mark_running(att, at)

    def _mark_running(self, att: AttemptRow, at: float) -> None:
        change = rules.running_transition(att.state, att.running_at, att.started_at, at)
        if change is not None:
            target, running_at = change
            if target != att.state:
                self._check_attempt(att.id, att.state, target)
            self._set_attempt(att, target, running_at=running_at)

    def active_attempts(self) -> list[AttemptRecord]:
        with self._lock:
            return list(self._active.values())

    def exit_context(self, attempt_id: int) -> ExitContext:
        with self._lock:
            att = self._attempts.get(attempt_id)
            if att is None:
                raise NotFound(f"attempt {attempt_id} not found")
            step = att.step
            return ExitContext(
                attempt_id=att.id,
                job_id=step.job.id,
                step=step.name,
                attempt_state=att.state,
                step_state=step.state,
                retries_used=step.retries_used,
                max_retries=step.max_retries,
                checkpoint_dir=step.resolved.get("checkpoint_dir"),
                last_checkpoint=step.last_checkpoint,
                preemptions=step.preemptions,
                max_preemptions=step.max_preemptions,
                started_at=att.started_at,
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
        with self._lock:
            self._check_fence()
            att = self._check_attempt(ctx.attempt_id, ctx.attempt_state, decision.attempt_state)
            step = att.step
            self._check_step(step, ctx.step_state, decision.step_state)

            n = len(att.gpus)
            lost = rules.lost_work_at_exit(
                decision.attempt_state,
                n,
                rules.work_started_at(att.started_at, att.running_at, ended_at),
                step.last_checkpoint_at,
                ended_at,
            )
            self._set_attempt(
                att,
                decision.attempt_state,
                ended_at=ended_at,
                exit_code=exit_code,
                signal=signal,
                killed_at_deadline=killed_at_deadline,
                message=decision.message,
                preempted=decision.preempted,
                lost_gpu_seconds=lost,
                exit_reason=reason,
                exit_detail=detail,
            )
            increment = rules.preemption_increment(decision)
            self._set_step(
                step,
                decision.step_state,
                retries_used=decision.retries_used,
                eligible_at=decision.eligible_at,
                reason=decision.message,
                updated_at=ended_at,
                stop_grace=None,
                preemptions=step.preemptions + increment,
            )
            self._preemptions += increment
            self._lost.append(lost)
            if decision.attempt_state in REPORTED_ENDED_STATES:
                self._reported_ended.append(att)
            self._ledger.release(kind=ATTEMPT, holder_id=str(att.id), now=ended_at)
            team = step.job.team
            folded = fold_usage(
                self._usage.get(team),
                gpus=n,
                start=att.started_at,
                end=ended_at,
                now=ended_at,
                half_life_s=half_life_s,
            )
            if folded is not None:
                self._usage[team] = folded
            for token_id in self._tokens_of_attempt.pop(att.id, []):
                self._revoke(token_id, ended_at)
            kind = rules.exit_event_kind(decision.attempt_state)
            self._event(ctx.job_id, ctx.step, ctx.attempt_id, ended_at, kind, decision.message)

    def request_preemption(self, attempt_id: int, *, grace_s: float, reason: str, now: float) -> None:
        """Move a running step to PREEMPTING with `attempt_rules.preemption_grace`. Raises
        StaleState if the attempt or its step is no longer RUNNING."""
        with self._lock:
            self._check_fence()
            att = self._attempts.get(attempt_id)
            if att is None or att.state not in rules.UNNOTICED_ATTEMPT_STATES:
                raise StaleState(f"attempt {attempt_id} is not running")
            step = att.step
            self._check_step(step, StepState.RUNNING, StepState.PREEMPTING)
            self._set_step(
                step,
                StepState.PREEMPTING,
                stop_grace=rules.preemption_grace(grace_s, step.job.grace_seconds),
                reason=f"preempting: {reason}",
                updated_at=now,
            )
            self._event(step.job.id, step.name, attempt_id, now, "preempting", reason)

    def attempt_times(self, attempt_ids: Iterable[int]) -> dict[int, tuple[float | None, float | None]]:
        """`attempt id -> (notice_at, ended_at)` for the given attempts."""
        with self._lock:
            found = (self._attempts.get(i) for i in attempt_ids)
            return {a.id: (a.notice_at, a.ended_at) for a in found if a is not None}

    def notices_due(self) -> list[NoticeDue]:
        with self._lock:
            return list(self._notices.values())

    def mark_stopping(self, attempt_id: int, *, deadline: float, reason: str, now: float) -> None:
        with self._lock:
            self._check_fence()
            found = self._attempts.get(attempt_id)
            current = found.state if found is not None else AttemptState.RUNNING
            expected = current if current in rules.UNNOTICED_ATTEMPT_STATES else AttemptState.RUNNING
            att = self._check_attempt(attempt_id, expected, AttemptState.STOPPING)
            self._set_attempt(
                att, AttemptState.STOPPING, notice_at=now, stop_deadline=deadline, stop_reason=reason
            )
            self._event(att.job_id, att.step_name, attempt_id, now, "notice", reason)

    def job_views(self, job_ids: Iterable[str] | None = None) -> list[JobView]:
        """Jobs whose DAG may move (`job_rules.job_may_move`): the given ones (those that exist),
        or every such job; in job id order."""
        with self._lock:
            if job_ids is None:
                return [self._job_view(job) for job in self._movable.values()]
            jobs = (self._jobs.get(job_id) for job_id in sorted(set(job_ids)))
            return [self._job_view(job) for job in jobs if job is not None]

    def apply_dag(self, changes: DagChanges, now: float) -> None:
        if changes.empty:
            return
        with self._lock:
            self._check_fence()
            job = self._jobs.get(changes.job_id)
            rows: list[StepRow] = []
            pending: dict[str, StepState] = {}
            for c in changes.steps:
                row = None if job is None else job.step_by_name.get(c.step)
                if row is None:
                    raise NotFound(f"step '{c.step}' of job '{changes.job_id}' not found")
                STEP_LIFECYCLE.check(c.from_state, c.to_state)
                if pending.get(c.step, row.state) != c.from_state:
                    raise StaleState(f"step {row.id}: expected {c.from_state}, cannot move to {c.to_state}")
                pending[c.step] = c.to_state
                rows.append(row)
            if changes.job is not None:
                JOB_LIFECYCLE.check(changes.job.from_state, changes.job.to_state)
                if job is None or job.state != changes.job.from_state:
                    raise StaleState(
                        f"job {changes.job_id}: expected {changes.job.from_state}, "
                        f"cannot move to {changes.job.to_state}"
                    )

            for c, row in zip(changes.steps, rows, strict=True):
                self._set_step(row, c.to_state, reason=c.reason, updated_at=now)
                if (event := dag_step_event(c)) is not None:
                    self._event(changes.job_id, c.step, None, now, *event)
            if changes.job is not None and job is not None:
                self._set_job(job, changes.job.to_state, finished_at=now, message=changes.job.reason)
                self._event(changes.job_id, None, None, now, *dag_job_event(changes.job))

    def add_event(
        self, job_id: str, step: str | None, attempt_id: int | None, *, at: float, kind: str, message: str
    ) -> None:
        with self._lock:
            self._event(job_id, step, attempt_id, at, kind, message)

    def set_waiting_reasons(self, reasons: Mapping[tuple[str, str], str]) -> None:
        with self._lock:
            for (job_id, step), reason in reasons.items():
                job = self._jobs.get(job_id)
                row = None if job is None else job.step_by_name.get(step)
                if row is not None:  # as an UPDATE of no row: nothing happens
                    row.reason = reason

    def step_checkpoints(self, job_id: str, step: str) -> list[CheckpointRecord]:
        """Every checkpoint the step reported, in the order reported."""
        with self._lock:
            row = self._step_row(job_id, step)
            return [c for c in row.job.checkpoints if c.step_name == step]

    def record_resume(
        self,
        attempt_id: int,
        *,
        resume_from: str | None,
        fingerprint: str | None,
        skipped: Sequence[tuple[str, str]],
        now: float,
    ) -> None:
        """Where the attempt resumes, into its record, with an event per checkpoint skipped."""
        with self._lock:
            att = self._attempts.get(attempt_id)
            if att is None:
                raise NotFound(f"attempt {attempt_id} not found")
            att.record = freeze(rules.with_resume(thaw(att.record), resume_from, fingerprint))
            self._refresh_attempt(att)
            for _label, message in skipped:
                self._event(att.job_id, att.step.name, attempt_id, now, "checkpoint_invalid", message)

    def mark_checkpoint_bad(
        self, attempt_id: int, *, label: str, fingerprint: str | None, message: str, now: float
    ) -> None:
        """Record with the attempt that it crashed on resuming from `label`, and an event."""
        with self._lock:
            att = self._attempts.get(attempt_id)
            if att is None:
                raise NotFound(f"attempt {attempt_id} not found")
            att.record = freeze(rules.with_bad_checkpoint(thaw(att.record), label, fingerprint))
            self._refresh_attempt(att)
            self._event(att.job_id, att.step.name, attempt_id, now, "checkpoint_bad", message)

    def record_checkpoint(
        self, attempt_id: int, *, label: str, progress: str | None, source: str, now: float
    ) -> bool:
        """Record a checkpoint an attempt reported; returns False if it was already the latest."""
        with self._lock:
            att = self._attempts.get(attempt_id)
            if att is None:
                raise NotFound(f"attempt {attempt_id} not found")
            step = att.step
            if not rules.checkpoint_is_new(step.last_checkpoint, label):
                return False
            job = step.job
            job.checkpoints.append(
                CheckpointRecord(attempt_id, job.id, step.name, label, progress, source, now)
            )
            step.last_checkpoint, step.last_checkpoint_at = label, now
            for active in list(step.active.values()):
                self._refresh_attempt(active, row_changed=False)
            message = rules.checkpoint_message(label, progress)
            self._event(job.id, step.name, attempt_id, now, "checkpoint", message)
            return True
