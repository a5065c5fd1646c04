"""The rules of an attempt's life that every store applies the same way (pure).

Role: what a store has to work out, rather than merely record, when it shows the scheduler its
queued and running steps, starts an attempt, gives notice, records a checkpoint or finishes an
attempt: which checkpoint counts, how much work a stop loses, how long a notice lasts, when a
running step counts as stopping, what an attempt's reproducibility record holds, and the texts of
the events those moves write.
Neighbours: `store.attempts_repo` (SQL) and `store.memory` (in memory) call these and only persist
the results; `policy.reclaim` prices victims with `lost_work`; `policy.snapshot` defines the rows
built here; `policy.fairshare.fold_usage` adds a finished attempt to its team's usage.
Must not: read the clock (every time is passed in), do I/O, import the store or SQLAlchemy, or
decide what happens next (exit outcomes are `policy.outcomes`, DAG moves `policy.dag`).

Rules
- Attempts hold GPUs while RUNNING or STOPPING (`ACTIVE_ATTEMPT_STATES`).
- A step's last checkpoint counts for an attempt only if it was taken during that attempt
  (`last_checkpoint_at >= started_at`); an older one belongs to an earlier attempt.
- Lost work of an attempt stopped at t holding g GPUs: g × max(0, t − since), since = the
  checkpoint that counts, else the attempt's start. An attempt that SUCCEEDED lost nothing.
- A running step counts as stopping (its GPUs come back soon; nobody preempts it again) when its
  attempt is STOPPING or its step is no longer RUNNING (notice requested, not yet given).
- Notice is due for an attempt still RUNNING whose step is CANCELLING or PREEMPTING
  (`NOTICE_STEP_STATES`). Its grace is the step's `stop_grace` (the shorter grace of a reclaim in
  progress) when set, else the job's grace; a preemption asks for `grace_s` but never gets more
  than the job's grace.
- A step starts only while its job is not finished; the first start moves a QUEUED job to
  RUNNING. Attempts of a step are numbered 1, 2, ... in order.
- A checkpoint is recorded only when its label differs from the step's latest one.
- Where an attempt resumes, and a checkpoint it crashed on, are kept in its record
  (``resume_from``, ``resume_fingerprint``, ``bad_checkpoint``: `with_resume`, `with_bad_checkpoint`).
- A finished attempt's step: a preemption (the decision says so) adds one to `preemptions`; the
  stop's `stop_grace` is cleared.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lowtide.domain.spec import ResolvedStep
from lowtide.domain.states import TERMINAL_JOB_STATES, AttemptState, JobState, StepState
from lowtide.policy.outcomes import ExitDecision
from lowtide.policy.snapshot import QueuedStep, RunningStep

#: Attempts that hold their GPUs: launched (pending or running) and not yet ended.
ACTIVE_ATTEMPT_STATES = frozenset({AttemptState.PENDING, AttemptState.RUNNING, AttemptState.STOPPING})
#: Attempts that may be given notice or asked to give their GPUs back (not yet noticed).
UNNOTICED_ATTEMPT_STATES = frozenset({AttemptState.PENDING, AttemptState.RUNNING})
#: Step states in which a RUNNING attempt is owed notice (cancelled or preempted).
NOTICE_STEP_STATES = frozenset({StepState.CANCELLING, StepState.PREEMPTING})


# -- checkpoints and lost work -------------------------------------------------------------------


def counted_checkpoint(last_checkpoint_at: float | None, started_at: float) -> float | None:
    """The step's last checkpoint time if it was taken during the attempt started at `started_at`."""
    if last_checkpoint_at is not None and last_checkpoint_at >= started_at:
        return last_checkpoint_at
    return None


def work_started_at(started_at: float, running_at: float | None, ended_at: float) -> float:
    """When an attempt's work began: when it began to run, not when it was launched (an image
    pull or a pod waiting for its node does no work); one that never ran did none (its end)."""
    if running_at is None:
        return ended_at
    return max(started_at, running_at)


def lost_work(gpus: int, started_at: float, last_checkpoint_at: float | None, at: float) -> float:
    """GPU-seconds of work lost if the attempt stops at `at`: since its checkpoint, else its start."""
    counted = counted_checkpoint(last_checkpoint_at, started_at)
    since = started_at if counted is None else counted
    return gpus * max(0.0, at - since)


def lost_work_at_exit(
    state: AttemptState, gpus: int, started_at: float, last_checkpoint_at: float | None, ended_at: float
) -> float:
    """The lost work recorded on an attempt that ended in `state` (none if it succeeded)."""
    if state == AttemptState.SUCCEEDED:
        return 0.0
    return lost_work(gpus, started_at, last_checkpoint_at, ended_at)


def checkpoint_is_new(latest_label: str | None, label: str) -> bool:
    """A reported checkpoint is recorded only if it is not the step's latest already."""
    return latest_label != label


def checkpoint_message(label: str, progress: str | None) -> str:
    detail = f" ({progress})" if progress else ""
    return f"checkpoint {label}{detail}"


def with_resume(
    record: Mapping[str, Any], resume_from: str | None, fingerprint: str | None
) -> dict[str, Any]:
    """An attempt's record once the loop chose where it resumes (`policy.checkpoints`)."""
    return {**record, "resume_from": resume_from, "resume_fingerprint": fingerprint}


def with_bad_checkpoint(record: Mapping[str, Any], label: str, fingerprint: str | None) -> dict[str, Any]:
    """An attempt's record once it crashed on resuming from `label` (`policy.checkpoints`)."""
    return {**record, "bad_checkpoint": {"label": label, "fingerprint": fingerprint}}


# -- stopping and notice -------------------------------------------------------------------------


def is_stopping(attempt_state: AttemptState, step_state: StepState) -> bool:
    """A running step whose GPUs come back soon: notice given, or asked for and not yet given."""
    return attempt_state == AttemptState.STOPPING or step_state != StepState.RUNNING


def notice_due(attempt_state: AttemptState, step_state: StepState) -> bool:
    return attempt_state in UNNOTICED_ATTEMPT_STATES and step_state in NOTICE_STEP_STATES


def running_transition(
    state: AttemptState, running_at: float | None, started_at: float, at: float
) -> tuple[AttemptState, float] | None:
    """What "it began to run at `at`" does to an attempt: PENDING -> RUNNING; an attempt noticed
    while pending (STOPPING) keeps its state but learns when it ran; anything else: nothing.
    The time is clamped to the launch (a start cannot come before it)."""
    if running_at is not None:
        return None
    if state == AttemptState.PENDING:
        return AttemptState.RUNNING, max(at, started_at)
    if state == AttemptState.STOPPING:
        return AttemptState.STOPPING, max(at, started_at)
    return None


def notice_grace(stop_grace: float | None, job_grace: float) -> float:
    """The grace a notice gives: the stop's own (shorter) grace if one was set, else the job's."""
    return job_grace if stop_grace is None else stop_grace


def preemption_grace(requested_s: float, job_grace: float) -> float:
    """A preemption's grace: what the reclaim asks for, at most the job's grace."""
    return min(requested_s, job_grace)


# -- what the scheduler sees ---------------------------------------------------------------------


def retry_note(retries_used: int, max_retries: int) -> str:
    """E.g. "attempt 2 of 3" for a step being retried; "" before its first retry."""
    return f"attempt {retries_used + 1} of {max_retries + 1}" if retries_used else ""


def queued_step(
    *,
    job_id: str,
    step: str,
    step_index: int,
    state: StepState,
    gpus: int,
    eligible_at: float,
    retries_used: int,
    max_retries: int,
    team: str,
    priority: int,
    submitted_at: float,
    owner: str = "",
    gpu_memory_gib: float | None = None,
) -> QueuedStep:
    """The scheduler's view of a step in `QUEUED_STEP_STATES`; `owner` is the job's submitter,
    `gpu_memory_gib` the GiB per GPU its spec declares (read from the resolved step's document)."""
    return QueuedStep(
        job_id=job_id,
        step=step,
        team=team,
        priority=priority,
        gpus=gpus,
        submitted_at=submitted_at,
        step_index=step_index,
        eligible_at=eligible_at,
        preempted=state == StepState.PREEMPTED,
        retry_note=retry_note(retries_used, max_retries),
        owner=owner,
        gpu_memory_gib=None if gpu_memory_gib is None else float(gpu_memory_gib),
    )


def running_step(
    *,
    attempt_id: int,
    attempt_state: AttemptState,
    job_id: str,
    step: str,
    step_state: StepState,
    team: str,
    priority: int,
    node: str,
    gpus: Sequence[int],
    started_at: float,
    last_checkpoint_at: float | None,
    min_runtime: float,
    restart_seconds: float,
    owner: str = "",
) -> RunningStep:
    """The scheduler's (and the reclaimer's) view of an attempt in `ACTIVE_ATTEMPT_STATES`."""
    return RunningStep(
        attempt_id=attempt_id,
        job_id=job_id,
        step=step,
        team=team,
        priority=priority,
        node=node,
        gpus=tuple(gpus),
        started_at=started_at,
        last_checkpoint_at=counted_checkpoint(last_checkpoint_at, started_at),
        min_runtime=min_runtime,
        restart_seconds=restart_seconds,
        stopping=is_stopping(attempt_state, step_state),
        owner=owner,
    )


# -- starting and finishing ----------------------------------------------------------------------


def can_start(job_state: JobState) -> bool:
    """A step of a finished (or cancelled) job never starts."""
    return job_state not in TERMINAL_JOB_STATES and job_state != JobState.CANCELLING


def job_state_on_start(job_state: JobState) -> JobState | None:
    """The job's new state when one of its steps starts (None: it stays as it is)."""
    return JobState.RUNNING if job_state == JobState.QUEUED else None


def next_attempt_number(last_number: int | None) -> int:
    return 1 if last_number is None else last_number + 1


def launch_params(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The job's parameters as an attempt gets them (a copy of the spec's `params`)."""
    return dict(spec.get("params") or {})


def reproducibility_record(
    *,
    spec: Mapping[str, Any] | SpecIndex,
    resolved_doc: Mapping[str, Any],
    resolved: ResolvedStep,
    last_checkpoint: str | None,
    node: str,
    gpus: Sequence[int],
) -> dict[str, Any]:
    """What an attempt ran, kept with it: the job's spec scoped to this step (`step_scoped_spec`),
    the resolved step, where, and what it resumed. `spec` is the job's spec or its `index_spec`
    (the same record either way; the index costs O(1) per start instead of O(steps))."""
    index = spec if isinstance(spec, SpecIndex) else index_spec(spec)
    return {
        "spec": index.scoped(resolved.name),
        "resolved": resolved_doc,
        "params": launch_params(index.job_fields),
        "image": resolved.image,
        "inputs": dict(resolved.inputs),
        "outputs": resolved.outputs,
        "checkpoint_dir": resolved.checkpoint_dir,
        "resume_from": last_checkpoint,
        "node": node,
        "gpus": list(gpus),
    }


def step_scoped_spec(spec: Mapping[str, Any], step: str) -> dict[str, Any]:
    """The job's spec with only `step` in its ``steps``: every job-level field an attempt ran
    under, without a copy of every other step (a 10,000-step job would store the whole spec with
    each of its attempts: quadratic in the number of steps). The job keeps the full spec."""
    return index_spec(spec).scoped(step)


@dataclass(frozen=True, slots=True)
class SpecIndex:
    """A job's spec split once for its attempt starts (`index_spec`): the job-level fields (every
    key but ``steps``, in the spec's order) and each step's entries by name. A store may keep it
    per job, since a job's spec never changes after submit (docs/architecture.md §4.1: starts are
    per tick; re-reading a 10,000-step spec per start made each start O(steps))."""

    job_fields: Mapping[str, Any]
    steps: Mapping[str, tuple[Mapping[str, Any], ...]]

    def scoped(self, step: str) -> dict[str, Any]:
        """`step_scoped_spec` of the indexed spec: its job-level fields, then ``steps``."""
        return {**self.job_fields, "steps": list(self.steps.get(step, ()))}


def index_spec(spec: Mapping[str, Any]) -> SpecIndex:
    """Split a job's spec into a `SpecIndex`; entries of ``steps`` that are not mappings with a
    name are left out (as `step_scoped_spec` never picks them)."""
    by_name: dict[str, list[Mapping[str, Any]]] = {}
    steps = spec.get("steps")
    if isinstance(steps, list):
        for entry in steps:
            if isinstance(entry, Mapping):
                name = entry.get("name")
                if isinstance(name, str):
                    by_name.setdefault(name, []).append(entry)
    return SpecIndex(
        job_fields={k: v for k, v in spec.items() if k != "steps"},
        steps={name: tuple(entries) for name, entries in by_name.items()},
    )


def start_message(number: int, node: str, gpus: Sequence[int]) -> str:
    where = f"{node} GPUs {','.join(map(str, gpus))}" if gpus else f"{node} (no GPUs)"
    return f"attempt {number} started on {where}"


def preemption_increment(decision: ExitDecision) -> int:
    """How much a finished attempt adds to its step's `preemptions`."""
    return 1 if decision.preempted else 0


def exit_event_kind(state: AttemptState) -> str:
    return state.value.lower()
