"""The in-memory store's rows: one mutable object per job, step and attempt, linked to each other.

Each row has the SQL table's column names as attributes (`store.schema`), so `store.convert`
turns it into the same record the SQL store returns; states are enums, JSON columns frozen
documents (`values.freeze`), list columns tuples. The links (a job's steps and attempts, a step's
job and attempts, an attempt's step) replace the SQL joins. Rows never leave the store: readers
get records (`control.records`). Neighbours: `base` owns and changes them (guarded, through its
`_set_*` helpers, which keep the indexes right). Must not: change anything themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lowtide.control.records import AttemptRecord, CheckpointRecord
from lowtide.domain.exit_reasons import ExitReason
from lowtide.domain.states import AttemptState, JobState, StepState
from lowtide.policy.attempt_rules import SpecIndex
from lowtide.policy.dag import JobView


@dataclass(slots=True, eq=False)
class JobRow:
    id: str
    name: str
    team: str
    owner: str
    priority: int
    state: JobState
    submitted_at: float
    grace_seconds: float
    template: str | None
    rerun_of: str | None
    spec: Any  # FrozenDict
    source_text: str
    started_at: float | None = None
    finished_at: float | None = None
    cancel_requested_at: float | None = None
    message: str = ""
    executor_ended_at: float | None = None  # when the executor took its end (`job_end`)
    steps: list[StepRow] = field(default_factory=list)  # in spec order (idx)
    step_by_name: dict[str, StepRow] = field(default_factory=dict)
    attempts: list[AttemptRow] = field(default_factory=list)  # in id order
    checkpoints: list[CheckpointRecord] = field(default_factory=list)
    open_steps: int = 0  # steps not finished (`job_rules.is_open_step`), kept by `base._set_step`
    view: JobView | None = None  # the DAG's view as last built; None after a job or step move
    spec_index: SpecIndex | None = None  # `attempt_rules.index_spec(spec)`, built at first start
    #: Per step: its scoped spec (`SpecIndex.scoped`) frozen, as each attempt's record holds it.
    scoped_specs: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class StepRow:
    id: int
    job: JobRow
    name: str
    idx: int
    state: StepState
    gpus: int
    depends: tuple[str, ...]
    resolved: Any  # FrozenDict
    max_retries: int
    min_runtime: float
    max_preemptions: int | None
    restart_seconds: float
    updated_at: float
    reason: str = ""
    retries_used: int = 0
    preemptions: int = 0
    eligible_at: float = 0.0
    last_checkpoint: str | None = None
    last_checkpoint_at: float | None = None
    retried_at: float | None = None
    stop_grace: float | None = None
    attempts: list[AttemptRow] = field(default_factory=list)  # in number order
    active: dict[int, AttemptRow] = field(default_factory=dict)  # attempts holding GPUs

    @property
    def job_id(self) -> str:
        return self.job.id


@dataclass(slots=True, eq=False)
class AttemptRow:
    id: int
    step: StepRow
    number: int
    state: AttemptState
    node: str
    gpus: tuple[int, ...]
    started_at: float
    work_dir: str
    record: Any  # FrozenDict
    message: str = ""
    ended_at: float | None = None
    handle: str | None = None
    handle_started_at: float | None = None
    running_at: float | None = None
    exit_reason: ExitReason | None = None
    exit_detail: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    notice_at: float | None = None
    stop_deadline: float | None = None
    stop_reason: str | None = None
    killed_at_deadline: bool = False
    lost_gpu_seconds: float | None = None
    preempted: bool = False
    cached: AttemptRecord | None = None  # the record as last built; None after a change

    @property
    def job(self) -> JobRow:
        return self.step.job

    @property
    def job_id(self) -> str:
        return self.step.job.id

    @property
    def step_name(self) -> str:
        return self.step.name


def assign(row: Any, values: dict[str, Any]) -> None:
    """Set columns on a row; an unknown column raises AttributeError (the rows have slots)."""
    for name, value in values.items():
        if name in (
            "cached",
            "job",
            "step",
            "steps",
            "attempts",
            "active",
            "open_steps",
            "view",
            "spec_index",
            "scoped_specs",
        ):
            raise AttributeError(f"{name!r} is not a column")
        setattr(row, name, value)
