"""The in-memory store's state and the one writer of its job, step and attempt states.

`MemoryBase` holds every table as Python objects (rows in `rows`, the ledger in `ledger`,
frozen records for the rest), the indexes the loop's per-tick reads answer from, one lock (each
public call is one "transaction"), `open`/`close` and `instance_id`.
Guarded transitions mirror `store.transitions`: `_check_*` checks a move against the domain's
lifecycle table (`IllegalTransition`) and the row's current state (`StaleState`) and changes
nothing; `_set_*` makes a checked move and keeps every index right. A public call runs all its
checks (and raises) before its first `_set_*`, so a call that raises leaves nothing changed.
Indexes (each a `values.SortedIndex` in id order, refreshed on every change of what it shows):
queued steps (as `QueuedStep`), active attempts (as `RunningStep` and as `AttemptRecord`),
notices due, finished jobs the executor has not yet ended, and the jobs the DAG may move (their
rows: a job's `JobView` is built when read and kept until the job or one of its steps moves, so a
step move costs O(1) here, not O(steps); each job row counts its unfinished steps for
`job_rules.job_may_move_counted`). An index entry equal to the one it holds is kept as the same
object, and an attempt's record is rebuilt only when its own row changes (not when its step
moves or checkpoints), so the loop's per-tick reads hand back the same tuples while nothing it
sees changed.
Neighbours: the parts (`jobs`, `attempts`, `pool`, `inference`, `tokens`) subclass this;
`MemoryStore` in `__init__` composes them. Every rule comes from `policy` (`attempt_rules`,
`job_rules`, `pool_rules`, `fairshare`), as in the SQL store.
Must not: decide anything, read the clock, or hand out a row or a mutable part of one.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections.abc import Callable
from typing import Any, Self, TypeVar

from lowtide.control.lease import Fence, LeaseRecord, fenced_message
from lowtide.control.records import (
    AttemptRecord,
    EventRecord,
    FencedOut,
    NotFound,
    NoticeDue,
    ReclaimRecord,
    ReplicaRecord,
    ServiceEventRecord,
    StaleState,
    TokenRecord,
)
from lowtide.control.store_health import StoreHealth
from lowtide.domain.states import (
    ATTEMPT_LIFECYCLE,
    JOB_LIFECYCLE,
    QUEUED_STEP_STATES,
    STEP_LIFECYCLE,
    TERMINAL_JOB_STATES,
    AttemptState,
    JobState,
    StepState,
)
from lowtide.policy import attempt_rules as rules
from lowtide.policy.dag import JobView, StepView
from lowtide.policy.evolve import evolve
from lowtide.policy.job_rules import is_open_step, job_may_move_counted
from lowtide.policy.lending_history import LendingPoint
from lowtide.policy.snapshot import QueuedStep, RunningStep
from lowtide.store.convert import attempt_record
from lowtide.store.memory.ledger import Ledger
from lowtide.store.memory.rows import AttemptRow, JobRow, StepRow, assign
from lowtide.store.memory.values import SortedIndex

URL_SCHEME = "memory://"
T = TypeVar("T")


class MemoryBase:
    """Every table, index and counter of the in-memory store (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        #: Never records an outage: memory is always there (the SQL store's `health`'s twin).
        self.health = StoreHealth()
        # jobs, steps, attempts (rows), events
        self._jobs: dict[str, JobRow] = {}
        # (owner, idempotency key) -> (job id, request digest): the SQL store's unique index
        self._idempotency: dict[tuple[str, str], tuple[str, str | None]] = {}
        self._job_order: list[tuple[float, str]] = []  # (submitted_at, id), ascending
        self._attempts: dict[int, AttemptRow] = {}
        self._events: dict[str, list[EventRecord]] = {}
        self._step_ids = itertools.count(1)
        self._attempt_ids = itertools.count(1)
        self._job_counts: dict[str, int] = {}
        self._step_counts: dict[str, int] = {}
        self._preemptions = 0
        self._lost: list[float] = []  # lost_gpu_seconds of every ended attempt
        self._reported_ended: list[AttemptRow] = []  # ended in `pool_rules.REPORTED_ENDED_STATES`
        # indexes for the loop's per-tick reads
        self._queued: SortedIndex[int, QueuedStep] = SortedIndex()
        self._running: SortedIndex[int, RunningStep] = SortedIndex()
        self._active: SortedIndex[int, AttemptRecord] = SortedIndex()
        self._notices: SortedIndex[int, NoticeDue] = SortedIndex()
        self._movable: SortedIndex[str, JobRow] = SortedIndex()  # views built when read
        # finished jobs the executor has not yet ended (`job_end.JobEndPart`), by id
        self._unended: SortedIndex[str, JobRow] = SortedIndex()
        # the pool, fair share, inference, tokens, key/value
        self._ledger = Ledger()
        self._usage: dict[str, tuple[float, float]] = {}  # team -> (decayed GPU-s, as of)
        self._replicas: dict[str, ReplicaRecord] = {}
        self._replica_order: SortedIndex[tuple[str, int, str], ReplicaRecord] = SortedIndex()
        self._service_events: dict[str, list[ServiceEventRecord]] = {}
        self._reclaims: dict[int, ReclaimRecord] = {}  # in id order
        self._open_reclaims: SortedIndex[int, ReclaimRecord] = SortedIndex()
        self._reclaim_counts: dict[str, int] = {}
        self._reclaim_ids = itertools.count(1)
        self._tokens: dict[int, TokenRecord] = {}
        self._token_by_hash: dict[str, int] = {}
        self._tokens_of_attempt: dict[int, list[int]] = {}  # step tokens by attempt
        self._listed_tokens: list[int] = []  # every other token, in id order
        self._token_ids = itertools.count(1)
        self._values: dict[str, str] = {}
        # the control plane's lease (`lease.LeasePart`) and the fence of this store's writes
        self._leases: dict[str, LeaseRecord] = {}
        self._fence: Fence | None = None
        self._on_fenced: Callable[[FencedOut], None] | None = None
        self._control_state: dict[str, tuple[str, float]] = {}  # key -> (JSON text, updated_at)
        # the lending envelope's history (`lending.LendingPart`): ((at, seq), point), by time
        self._lending: list[tuple[tuple[float, int], LendingPoint]] = []
        self._lending_seq = itertools.count(1)

    @classmethod
    def open(cls, url: str, *, migrate_schema: bool = True, busy_timeout_s: float = 5.0) -> Self:
        """A new, empty store. `url` must be "memory://" (anything after it is ignored);
        `migrate_schema` is accepted for the SQL store's signature and means nothing here."""
        if not url.startswith(URL_SCHEME):
            raise ValueError(f"not a memory store URL: {url!r} (use {URL_SCHEME!r})")
        return cls()

    def close(self) -> None:
        """Nothing to release: the data lives as long as the object."""

    def instance_id(self) -> str:
        """A stable id of this store (as the SQL store keeps in its `meta` table)."""
        with self._lock:
            value = self._values.get("instance_id")
            if value is None:
                value = self._values["instance_id"] = secrets.token_hex(6)
            return value

    # -- lookups -------------------------------------------------------------------------------

    def _job_row(self, job_id: str) -> JobRow:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"job '{job_id}' not found")
        return job

    def _step_row(self, job_id: str, step: str) -> StepRow:
        job = self._jobs.get(job_id)
        row = None if job is None else job.step_by_name.get(step)
        if row is None:
            raise NotFound(f"step '{step}' of job '{job_id}' not found")
        return row

    def _attempt_record(self, att: AttemptRow) -> AttemptRecord:
        if att.cached is None:
            att.cached = attempt_record(att)
        return att.cached

    def _event(
        self, job_id: str, step: str | None, attempt_id: int | None, at: float, kind: str, message: str
    ) -> None:
        self._events.setdefault(job_id, []).append(EventRecord(job_id, step, attempt_id, at, kind, message))

    # -- guarded transitions: checks (change nothing) ------------------------------------------

    def _check_fence(self) -> None:
        """Raise FencedOut when this store's writes are fenced and the lease moved on."""
        fence = self._fence
        if fence is None:
            return
        row = self._leases.get(fence.name)
        if row is not None and row.token == fence.token:
            return
        holder, token = (row.holder, row.token) if row is not None else (None, None)
        exc = FencedOut(fenced_message(fence, holder, token))
        if self._on_fenced is not None:
            self._on_fenced(exc)
        raise exc

    @staticmethod
    def _check_job(job: JobRow, expected: JobState, target: JobState) -> None:
        JOB_LIFECYCLE.check(expected, target)
        if job.state != expected:
            raise StaleState(f"job {job.id}: expected {expected}, cannot move to {target}")

    @staticmethod
    def _check_step(step: StepRow, expected: StepState, target: StepState) -> None:
        STEP_LIFECYCLE.check(expected, target)
        if step.state != expected:
            raise StaleState(f"step {step.id}: expected {expected}, cannot move to {target}")

    def _check_attempt(self, attempt_id: int, expected: AttemptState, target: AttemptState) -> AttemptRow:
        ATTEMPT_LIFECYCLE.check(expected, target)
        att = self._attempts.get(attempt_id)
        if att is None or att.state != expected:
            raise StaleState(f"attempt {attempt_id}: not in {[expected.value]}, cannot move to {target}")
        return att

    # -- guarded transitions: moves (after the checks) -----------------------------------------

    def _set_job(self, job: JobRow, target: JobState, **values: Any) -> None:
        count_state(self._job_counts, job.state, -1)
        assign(job, values)
        job.state = target
        count_state(self._job_counts, target, 1)
        self._refresh_job(job)

    def _set_step(self, step: StepRow, target: StepState, **values: Any) -> None:
        old = step.state
        assign(step, values)
        step.state = target
        count_state(self._step_counts, old, -1)
        count_state(self._step_counts, target, 1)
        step.job.open_steps += is_open_step(target) - is_open_step(old)
        self._refresh_step(step)
        self._refresh_job(step.job)

    def _set_attempt(self, att: AttemptRow, target: AttemptState, **values: Any) -> None:
        assign(att, values)
        att.state = target
        self._refresh_attempt(att)

    # -- indexes -------------------------------------------------------------------------------

    def _refresh_job(self, job: JobRow) -> None:
        """The job's place among the jobs the DAG may move (`job_rules.job_may_move`), in O(1):
        its view is rebuilt only when read (`_job_view`), so a job of n steps whose steps move
        one by one costs O(n) per read, not O(n) per move; and among the finished jobs the
        executor has not yet ended (`job_end`)."""
        job.view = None
        if job_may_move_counted(job.state, job.open_steps):
            if job.id not in self._movable:
                self._movable.put(job.id, job)
        else:
            self._movable.drop(job.id)
        if job.state in TERMINAL_JOB_STATES and job.executor_ended_at is None:
            if job.id not in self._unended:
                self._unended.put(job.id, job)
        else:
            self._unended.drop(job.id)

    @staticmethod
    def _job_view(job: JobRow) -> JobView:
        """The DAG's view of a job, as last built unless the job or a step moved since."""
        if job.view is None:
            steps = tuple(StepView(s.name, s.state, s.depends) for s in job.steps)
            job.view = JobView(job.id, job.state, steps)
        return job.view

    def _refresh_step(self, step: StepRow) -> None:
        """The step among the queued ones, and what its active attempts show."""
        if step.state in QUEUED_STEP_STATES:
            job = step.job
            self._queued.put(
                step.id,
                rules.queued_step(
                    job_id=job.id,
                    step=step.name,
                    step_index=step.idx,
                    state=step.state,
                    gpus=step.gpus,
                    eligible_at=step.eligible_at,
                    retries_used=step.retries_used,
                    max_retries=step.max_retries,
                    team=job.team,
                    priority=job.priority,
                    submitted_at=job.submitted_at,
                    owner=job.owner,
                    gpu_memory_gib=step.resolved.get("gpu_memory_gib"),
                ),
            )
        else:
            self._queued.drop(step.id)
        for att in list(step.active.values()):
            self._refresh_attempt(att, row_changed=False)

    def _refresh_attempt(self, att: AttemptRow, *, row_changed: bool = True) -> None:
        """The attempt's record, and its place among the active attempts and notices due.
        `row_changed` False: only its step moved (its state, its last checkpoint), so its record,
        a function of the attempt row alone, stays the one built last. An index entry equal to
        the one it holds is kept as it is (the same object), so its tuple is not rebuilt."""
        if row_changed:
            att.cached = None
        step = att.step
        if att.state not in rules.ACTIVE_ATTEMPT_STATES:
            step.active.pop(att.id, None)
            self._running.drop(att.id)
            self._active.drop(att.id)
            self._notices.drop(att.id)
            return
        job = step.job
        step.active[att.id] = att
        self._active.put(att.id, self._attempt_record(att))
        running = rules.running_step(
            attempt_id=att.id,
            attempt_state=att.state,
            job_id=job.id,
            step=step.name,
            step_state=step.state,
            team=job.team,
            priority=job.priority,
            node=att.node,
            gpus=att.gpus,
            started_at=att.started_at,
            last_checkpoint_at=step.last_checkpoint_at,
            min_runtime=step.min_runtime,
            restart_seconds=step.restart_seconds,
            owner=job.owner,
        )
        self._running.put(att.id, _same_or(self._running.get(att.id), running))
        if rules.notice_due(att.state, step.state):
            grace = rules.notice_grace(step.stop_grace, job.grace_seconds)
            due = NoticeDue(att.id, job.id, step.name, step.state, grace)
            self._notices.put(att.id, _same_or(self._notices.get(att.id), due))
        else:
            self._notices.drop(att.id)

    def _revoke(self, token_id: int, now: float) -> bool:
        """Revoke a token unless it is revoked already; whether it was."""
        token = self._tokens.get(token_id)
        if token is None or token.revoked_at is not None:
            return False
        self._tokens[token_id] = evolve(token, revoked_at=now)
        return True


def _same_or(old: T | None, new: T) -> T:
    """`old` when it equals `new` (frozen values: the index keeps the object it has), else `new`."""
    return old if old is not None and old == new else new


def count_state(counts: dict[str, int], state: Any, delta: int) -> None:
    key = str(state)
    n = counts.get(key, 0) + delta
    if n:
        counts[key] = n
    else:
        counts.pop(key, None)
