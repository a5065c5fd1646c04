"""How a job's DAG moves forward, as a pure function of its steps' states.

Rules (Argo's fail-fast DAG semantics):
- a PENDING step becomes READY when every upstream step SUCCEEDED;
- once any step FAILED, steps that have not started (PENDING, READY, PREEMPTED) are SKIPPED and
  running ones are left to finish; the job FAILS when nothing is active any more;
- the job SUCCEEDS when every step SUCCEEDED;
- a cancelled job's steps that have not started are CANCELLED (running ones are stopped by the
  loop with notice, see control.loop); a CANCELLING job becomes CANCELLED once none of its steps
  holds GPUs any more (issue 12: it showed CANCELLED while a step still held GPUs for its grace).
Neighbours: the loop calls `advance` for jobs whose steps changed; the store applies the result
with guarded writes. Must not: read the clock or the store.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowtide.domain.states import (
    ACTIVE_STEP_STATES,
    TERMINAL_JOB_STATES,
    JobState,
    StepState,
)

_NOT_STARTED = frozenset({StepState.PENDING, StepState.READY, StepState.PREEMPTED})


@dataclass(frozen=True, slots=True)
class StepView:
    name: str
    state: StepState
    depends: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class JobView:
    job_id: str
    state: JobState
    steps: tuple[StepView, ...]


@dataclass(frozen=True, slots=True)
class StepChange:
    step: str
    from_state: StepState
    to_state: StepState
    reason: str


@dataclass(frozen=True, slots=True)
class JobChange:
    from_state: JobState
    to_state: JobState
    reason: str


@dataclass(frozen=True, slots=True)
class DagChanges:
    job_id: str
    steps: tuple[StepChange, ...] = ()
    job: JobChange | None = None

    @property
    def empty(self) -> bool:
        return not self.steps and self.job is None


def advance(job: JobView) -> DagChanges:
    """The step and job transitions that follow from the current step states."""
    states = {s.name: s.state for s in job.steps}
    changes: list[StepChange] = []

    if job.state in (JobState.CANCELLED, JobState.CANCELLING):
        for s in job.steps:
            if s.state in _NOT_STARTED:
                changes.append(StepChange(s.name, s.state, StepState.CANCELLED, "job cancelled"))
        new = {**states, **{c.step: c.to_state for c in changes}}
        if job.state == JobState.CANCELLING and not any(st in ACTIVE_STEP_STATES for st in new.values()):
            done = JobChange(JobState.CANCELLING, JobState.CANCELLED, "cancelled: every step has stopped")
            return DagChanges(job.job_id, tuple(changes), done)
        return DagChanges(job.job_id, tuple(changes))

    failed = [s.name for s in job.steps if s.state == StepState.FAILED]
    if failed:
        for s in job.steps:
            if s.state in _NOT_STARTED:
                changes.append(StepChange(s.name, s.state, StepState.SKIPPED, f"step '{failed[0]}' failed"))
        new = {**states, **{c.step: c.to_state for c in changes}}
        if not any(st in ACTIVE_STEP_STATES for st in new.values()) and job.state not in TERMINAL_JOB_STATES:
            return DagChanges(
                job.job_id,
                tuple(changes),
                JobChange(job.state, JobState.FAILED, f"step '{failed[0]}' failed"),
            )
        return DagChanges(job.job_id, tuple(changes))

    for s in job.steps:
        if s.state == StepState.PENDING and all(states.get(d) == StepState.SUCCEEDED for d in s.depends):
            reason = "upstream done: " + ", ".join(s.depends) if s.depends else "no upstream steps"
            changes.append(StepChange(s.name, s.state, StepState.READY, reason))

    if job.state not in TERMINAL_JOB_STATES and all(st == StepState.SUCCEEDED for st in states.values()):
        return DagChanges(
            job.job_id, tuple(changes), JobChange(job.state, JobState.SUCCEEDED, "all steps succeeded")
        )
    return DagChanges(job.job_id, tuple(changes))
