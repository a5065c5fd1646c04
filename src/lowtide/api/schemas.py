"""Response bodies of the REST API (pydantic), and their construction from store records.

Times are float seconds since the epoch (UTC). Must not: query the store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, Field

from lowtide.control.records import (
    AttemptRecord,
    CheckpointRecord,
    EventRecord,
    GpuHolding,
    JobDetail,
    JobRecord,
    StepRecord,
    TokenRecord,
)
from lowtide.domain.gpus import Node

#: A team name in a token ("*": every team): the job spec's name rule.
TEAM_PATTERN = r"^(\*|[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)$"
#: How the pool shows an attempt of a team the caller does not see.
OTHER_TEAM = "(another team)"


def _all(team: str | None) -> bool:
    return True


class ErrorItem(BaseModel):
    loc: str
    msg: str


class ErrorOut(BaseModel):
    error: str
    message: str
    errors: list[ErrorItem] = Field(default_factory=list)


class JobOut(BaseModel):
    id: str
    name: str
    team: str
    owner: str
    priority: int
    state: str
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    template: str | None
    rerun_of: str | None
    message: str
    steps: dict[str, int] = Field(description="number of steps in each state")
    warnings: list[ErrorItem] = Field(
        default_factory=list,
        description="what of the spec this lowtide ignores (e.g. `image` with the process runtime); "
        "only in the answer to a submit",
    )


class StepOut(BaseModel):
    name: str
    state: str
    gpus: int
    depends: list[str]
    reason: str
    retries_used: int
    max_retries: int
    preemptions: int
    eligible_at: float
    last_checkpoint: str | None
    last_checkpoint_at: float | None
    command: list[str]
    image: str | None
    inputs: dict[str, str]
    outputs: str
    checkpoint_dir: str | None


class AttemptOut(BaseModel):
    id: int
    step: str
    number: int
    state: str
    node: str
    gpus: list[int]
    started_at: float
    ended_at: float | None
    handle: str | None = Field(
        default=None, description="what runs it, as its executor names it (a pid locally, a pod in a cluster)"
    )
    running_at: float | None = Field(
        default=None, description="when it began to run; null while PENDING (image pull, scheduling)"
    )
    exit_code: int | None
    signal: int | None
    notice_at: float | None
    stop_deadline: float | None
    stop_reason: str | None
    killed_at_deadline: bool
    exit_reason: str | None = Field(
        default=None,
        description="why it ended, as its executor saw it: EXITED, SIGNALLED, DEADLINE, OOM_KILLED, "
        "EVICTED, DELETED, UNSCHEDULABLE, IMAGE_PULL or INFRASTRUCTURE",
    )
    exit_detail: str | None = Field(default=None, description="the executor's own words about the end")
    message: str
    record: dict[str, Any]
    lost_gpu_seconds: float | None = Field(
        default=None, description="GPU-seconds of work lost since the last checkpoint; null while running"
    )
    preempted: bool = Field(default=False, description="ended by preemption (not cancellation or failure)")


class CheckpointOut(BaseModel):
    attempt_id: int
    step: str
    label: str
    progress: str | None
    source: str
    reported_at: float


class NoticeOut(BaseModel):
    """A running attempt's notice, as its step (or its shim) asks for it."""

    attempt_id: int
    noticed: bool
    #: Seconds from this answer to the deadline (never below 0); None while no notice was given.
    seconds_left: float | None
    reason: str | None


class EventOut(BaseModel):
    at: float
    step: str | None
    attempt_id: int | None
    kind: str
    message: str


class JobDetailOut(BaseModel):
    job: JobOut
    spec: dict[str, Any]
    source_text: str
    steps: list[StepOut]
    attempts: list[AttemptOut]
    checkpoints: list[CheckpointOut]
    events: list[EventOut]


class RetryOut(BaseModel):
    job: JobOut
    queued: list[str] = Field(description="steps back in the queue (READY)")
    waiting: list[str] = Field(description="steps waiting for their upstream steps (PENDING)")
    kept: list[str] = Field(description="steps that SUCCEEDED: kept, not run again")


class JobListOut(BaseModel):
    jobs: list[JobOut]
    next_before: float | None = Field(description="pass as ?before= to get the next page")


class DryRunOut(BaseModel):
    valid: bool
    spec: dict[str, Any]
    warnings: list[ErrorItem] = Field(
        default_factory=list, description="what of the spec this lowtide would ignore"
    )


class GpuOut(BaseModel):
    index: int
    holder: str = Field(description="idle | attempt | replica")
    job_id: str | None
    step: str | None
    attempt_id: int | None
    team: str | None
    since: float


class NodeOut(BaseModel):
    name: str
    gpus: list[GpuOut]
    free: int


class PoolOut(BaseModel):
    nodes: list[NodeOut]
    total: int
    free: int


class TokenIn(BaseModel):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._@-]+$")
    role: str = Field(default="user", pattern=r"^(admin|user|viewer)$")
    owner: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9._@-]+$",
        description="who the token acts as (default: the name)",
    )
    teams: list[Annotated[str, Field(pattern=TEAM_PATTERN)]] | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="teams it may submit for and see ('*': all; default: [default]); admins: all",
    )
    max_priority: int | None = Field(
        default=None, ge=0, le=100, description="highest priority it may submit (default: 50); admins: 100"
    )


class TokenOut(BaseModel):
    id: int
    name: str
    owner: str
    role: str
    teams: list[str]
    max_priority: int
    created_at: float
    revoked_at: float | None
    token: str | None = Field(default=None, description="the secret, shown only once when created")


class CheckpointIn(BaseModel):
    # No NUL: PostgreSQL text cannot hold it, and the label becomes LOWTIDE_RESUME_FROM. The route
    # checks the rest with `control.contract.parse_checkpoint_label`, the rule LATEST follows too.
    label: str = Field(
        min_length=1,
        max_length=1024,
        pattern=r"^[^\x00]*$",
        description="the checkpoint's name relative to LOWTIDE_CHECKPOINT_DIR (no '..'), or an absolute "
        "path or URL inside it; one line of printable characters",
    )
    progress: str | None = Field(
        default=None, max_length=256, pattern=r"^[^\x00]*$", description="e.g. 'step 1200'"
    )


class WhoAmIOut(BaseModel):
    name: str
    role: str
    teams: list[str] = Field(description="teams whose jobs it sees and may submit for ('*': all)")
    max_priority: int


def job_out(j: JobRecord) -> JobOut:
    return JobOut(
        id=j.id,
        name=j.name,
        team=j.team,
        owner=j.owner,
        priority=j.priority,
        state=j.state.value,
        submitted_at=j.submitted_at,
        started_at=j.started_at,
        finished_at=j.finished_at,
        template=j.template,
        rerun_of=j.rerun_of,
        message=j.message,
        steps=dict(j.step_states),
    )


def step_out(s: StepRecord) -> StepOut:
    r = s.resolved
    return StepOut(
        name=s.name,
        state=s.state.value,
        gpus=s.gpus,
        depends=list(s.depends),
        reason=s.reason,
        retries_used=s.retries_used,
        max_retries=s.max_retries,
        preemptions=s.preemptions,
        eligible_at=s.eligible_at,
        last_checkpoint=s.last_checkpoint,
        last_checkpoint_at=s.last_checkpoint_at,
        command=list(r.get("command", [])),
        image=r.get("image"),
        inputs=dict(r.get("inputs") or {}),
        outputs=r.get("outputs", ""),
        checkpoint_dir=r.get("checkpoint_dir"),
    )


def attempt_out(a: AttemptRecord) -> AttemptOut:
    return AttemptOut(
        id=a.id,
        step=a.step_name,
        number=a.number,
        state=a.state.value,
        node=a.node,
        gpus=list(a.gpus),
        started_at=a.started_at,
        ended_at=a.ended_at,
        handle=a.handle,
        running_at=a.running_at,
        exit_code=a.exit_code,
        signal=a.signal,
        notice_at=a.notice_at,
        stop_deadline=a.stop_deadline,
        stop_reason=a.stop_reason,
        killed_at_deadline=a.killed_at_deadline,
        exit_reason=None if a.exit_reason is None else a.exit_reason.value,
        exit_detail=a.exit_detail,
        message=a.message,
        record=dict(a.record),
        lost_gpu_seconds=a.lost_gpu_seconds,
        preempted=a.preempted,
    )


def checkpoint_out(c: CheckpointRecord) -> CheckpointOut:
    return CheckpointOut(
        attempt_id=c.attempt_id,
        step=c.step_name,
        label=c.label,
        progress=c.progress,
        source=c.source,
        reported_at=c.reported_at,
    )


def event_out(e: EventRecord) -> EventOut:
    return EventOut(at=e.at, step=e.step_name, attempt_id=e.attempt_id, kind=e.kind, message=e.message)


def job_detail_out(d: JobDetail) -> JobDetailOut:
    return JobDetailOut(
        job=job_out(d.job),
        spec=dict(d.job.spec),
        source_text=d.job.source_text,
        steps=[step_out(s) for s in d.steps],
        attempts=[attempt_out(a) for a in d.attempts],
        checkpoints=[checkpoint_out(c) for c in d.checkpoints],
        events=[event_out(e) for e in d.events],
    )


def pool_out(
    nodes: tuple[Node, ...], holdings: list[GpuHolding], visible_team: Callable[[str | None], bool] = _all
) -> PoolOut:
    """Every GPU and its holder; an attempt of a team `visible_team` refuses shows no job, step
    or attempt, and its team as OTHER_TEAM (docs/architecture.md §11)."""
    by_gpu = {(h.node, h.index): h for h in holdings}
    out_nodes = []
    total = free = 0
    for node in nodes:
        gpus = []
        for index in node.gpus:
            h = by_gpu.get((node.name, index))
            kind = h.holder_kind if h else "idle"
            if h is not None and kind == "attempt" and not visible_team(h.team):
                gpus.append(
                    GpuOut(
                        index=index,
                        holder=kind,
                        job_id=None,
                        step=None,
                        attempt_id=None,
                        team=OTHER_TEAM,
                        since=h.since,
                    )
                )
                continue
            gpus.append(
                GpuOut(
                    index=index,
                    holder=kind,
                    job_id=h.job_id if h else None,
                    step=h.step if h else None,
                    attempt_id=int(h.holder_id) if h and h.holder_kind == "attempt" and h.holder_id else None,
                    team=h.team if h else None,
                    since=h.since if h else 0.0,
                )
            )
        node_free = sum(1 for g in gpus if g.holder == "idle")
        total += len(gpus)
        free += node_free
        out_nodes.append(NodeOut(name=node.name, gpus=gpus, free=node_free))
    return PoolOut(nodes=out_nodes, total=total, free=free)


def token_out(t: TokenRecord, raw: str | None = None) -> TokenOut:
    return TokenOut(
        id=t.id,
        name=t.name,
        owner=t.owner,
        role=t.role,
        teams=list(t.teams),
        max_priority=t.max_priority,
        created_at=t.created_at,
        revoked_at=t.revoked_at,
        token=raw,
    )
