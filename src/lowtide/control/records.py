"""Plain values the store returns and the loop and API consume: rows as frozen dataclasses,
never live ORM objects; plus the store errors the loop must be able to catch.

They live here, below the store, so that `control` can name them without importing the store.
Must not: query or mutate anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lowtide.domain.exit_reasons import ExitReason
from lowtide.domain.spec import JobSpec, ResolvedStep
from lowtide.domain.states import AttemptState, JobState, ReclaimState, ReplicaState, StepState


class StoreError(Exception):
    """Base class of the store's own errors."""


class NotFound(StoreError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class StaleState(StoreError):
    """A guarded write found the row in another state than expected: someone else moved it first."""


class GpuBusy(StoreError):
    """A GPU to be booked is already held by another holder (a double booking was prevented)."""


class StoreUnavailable(StoreError):
    """The store cannot be read or written now, for a reason that may pass (a lock, a full disk,
    a lost connection): the caller retries later (docs/architecture.md §4.4). `reason` is one
    line naming the cause; the SQL store classifies at its edge (`store.errors`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class FencedOut(StoreError):
    """This control plane does not hold the lease any more (another took it over, or its own
    acting deadline passed): the write was refused and rolled back, and nothing may act on it
    (`control.lease`). Not an outage of the store (the database answered); to an API client it
    is a 503 to retry (the next write goes unfenced once this control plane is a standby)."""


class IdempotencyConflict(StoreError):
    """The owner already used this idempotency key for a different request (`job_id` names the
    job that request created)."""

    def __init__(self, key: str, job_id: str) -> None:
        super().__init__(f"idempotency key {key!r} was used for another request (job {job_id})")
        self.key = key
        self.job_id = job_id


class NotRetriable(StoreError):
    """A retry of a job that is not FAILED or CANCELLED, or has a step still holding GPUs, or
    nothing to retry (`policy.retry`); `state` is the job's state, `reason` says why."""

    def __init__(self, job_id: str, state: JobState, reason: str) -> None:
        super().__init__(f"job {job_id} is {state.value}: {reason}")
        self.job_id = job_id
        self.state = state
        self.reason = reason


@dataclass(frozen=True, slots=True)
class NewJob:
    id: str
    spec: JobSpec
    resolved: tuple[ResolvedStep, ...]
    source_text: str
    owner: str
    submitted_at: float
    rerun_of: str | None = None
    #: The client's `Idempotency-Key` and the digest of its request: a second submit by the same
    #: owner with the same key returns the first job (same digest) or `IdempotencyConflict`.
    idempotency_key: str | None = None
    request_digest: str | None = None


@dataclass(frozen=True, slots=True)
class JobRecord:
    id: str
    name: str
    team: str
    owner: str
    priority: int
    state: JobState
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    cancel_requested_at: float | None
    grace_seconds: float
    template: str | None
    rerun_of: str | None
    spec: Mapping[str, Any]
    source_text: str
    message: str
    step_states: Mapping[str, int] = field(default_factory=dict)  # state -> count (listings)


@dataclass(frozen=True, slots=True)
class RetriedJob:
    """A job as a retry left it (`policy.retry`): the steps back in the queue (READY), those
    waiting for upstream steps (PENDING), and the SUCCEEDED ones kept, as the retry decided them
    (the loop may start the queued ones a moment later)."""

    job: JobRecord
    queued: tuple[str, ...]
    waiting: tuple[str, ...]
    kept: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StepRecord:
    id: int
    job_id: str
    name: str
    idx: int
    state: StepState
    gpus: int
    depends: tuple[str, ...]
    resolved: Mapping[str, Any]
    max_retries: int
    retries_used: int
    preemptions: int
    eligible_at: float
    reason: str
    last_checkpoint: str | None
    last_checkpoint_at: float | None
    updated_at: float
    retried_at: float | None = None  # when `lowtide retry` last reopened it


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    id: int
    job_id: str
    step_name: str
    number: int
    state: AttemptState
    node: str
    gpus: tuple[int, ...]
    started_at: float
    ended_at: float | None
    handle: str | None  # the executor's name for what runs it (opaque)
    handle_started_at: float | None
    running_at: float | None  # None while PENDING (or if it never ran)
    exit_code: int | None
    signal: int | None
    notice_at: float | None
    stop_deadline: float | None
    stop_reason: str | None
    killed_at_deadline: bool
    work_dir: str
    record: Mapping[str, Any]
    message: str
    exit_reason: ExitReason | None = None
    exit_detail: str | None = None
    lost_gpu_seconds: float | None = None
    preempted: bool = False  # ended by a preemption (notice for GPUs, interrupted or lost)


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    attempt_id: int
    job_id: str
    step_name: str
    label: str
    progress: str | None
    source: str
    reported_at: float


@dataclass(frozen=True, slots=True)
class EventRecord:
    job_id: str
    step_name: str | None
    attempt_id: int | None
    at: float
    kind: str
    message: str


@dataclass(frozen=True, slots=True)
class JobDetail:
    job: JobRecord
    steps: tuple[StepRecord, ...]
    attempts: tuple[AttemptRecord, ...]
    checkpoints: tuple[CheckpointRecord, ...]
    events: tuple[EventRecord, ...]


@dataclass(frozen=True, slots=True)
class AttemptLaunch:
    """What the actuator needs to launch an attempt the store has just booked."""

    attempt_id: int
    number: int
    job_id: str
    step: str
    team: str
    node: str
    gpus: tuple[int, ...]
    resolved: ResolvedStep
    params: Mapping[str, Any]
    work_dir: str
    last_checkpoint: str | None
    grace_seconds: float


@dataclass(frozen=True, slots=True)
class ExitContext:
    """What the exit classification needs to know about an attempt that ended."""

    attempt_id: int
    job_id: str
    step: str
    attempt_state: AttemptState
    step_state: StepState
    retries_used: int
    max_retries: int
    checkpoint_dir: str | None
    last_checkpoint: str | None
    preemptions: int = 0
    max_preemptions: int | None = None
    #: When the attempt started (control time): a reported end is never earlier (None: unknown).
    started_at: float | None = None


@dataclass(frozen=True, slots=True)
class NoticeDue:
    """A running attempt whose step must be stopped (cancelled or preempted) and has no notice yet."""

    attempt_id: int
    job_id: str
    step: str
    step_state: StepState
    grace_seconds: float


@dataclass(frozen=True, slots=True)
class GpuHolding:
    node: str
    index: int
    holder_kind: str  # idle | attempt | replica
    holder_id: str | None
    job_id: str | None
    step: str | None
    team: str | None
    since: float


@dataclass(frozen=True, slots=True)
class TokenRecord:
    id: int
    name: str
    owner: str
    role: str
    attempt_id: int | None
    created_at: float
    revoked_at: float | None
    #: The teams the holder may submit for and see ("*": every team); docs/architecture.md §11.
    teams: tuple[str, ...] = ()
    #: The highest job priority the holder may submit (0..100).
    max_priority: int = 0


class LastAdminToken(StoreError):
    """Revoking this token would leave no active admin token (nobody could mint another)."""


@dataclass(frozen=True, slots=True)
class JobScope:
    """Which jobs a person may see: their own, and those of `teams` ("*" in it: every team).

    `list_jobs(visible_to=...)` filters by it in the store query; `api.auth` checks single jobs
    with `allows`. docs/architecture.md §11.
    """

    owner: str
    teams: tuple[str, ...]

    @property
    def all_teams(self) -> bool:
        return "*" in self.teams

    def allows(self, *, owner: str, team: str) -> bool:
        return owner == self.owner or self.all_teams or team in self.teams


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    id: str
    service: str
    slot: int
    state: ReplicaState
    node: str | None
    gpus: tuple[int, ...]
    port: int
    parked_as: str | None
    since: float
    failures: int
    retry_at: float
    message: str


@dataclass(frozen=True, slots=True)
class ServiceEventRecord:
    service: str
    replica_id: str | None
    at: float
    kind: str
    message: str


@dataclass(frozen=True, slots=True)
class ReclaimRecord:
    """One reclaim: inference taking GPUs back from research, phase by phase."""

    id: int
    service: str | None
    replica_id: str | None
    reason: str
    gpus: int
    victims: tuple[int, ...]  # attempt ids
    state: ReclaimState
    detected_at: float
    decided_at: float
    notice_at: float | None
    freed_at: float | None
    healthy_at: float | None
