"""Retrying a finished job in place: which steps go back to work and what the job becomes (pure).

Role: the rule behind `lowtide retry JOB` / `POST /v1/jobs/{id}/retry`. The habit it follows:
Argo's `argo retry` "rerun[s] all failed steps. The same Workflow object is used and no new
Workflows are created"; only a Failed or Error workflow is retried (a Succeeded one only with
`--restart-successful` and a node selector, which lowtide does not offer) (argo-workflows
docs/cli/argo_retry.md and `workflow/util.FormulateRetryWorkflow`, main at 011b97cd). Slurm's
`scontrol requeue` puts a finished batch job back "into pending state" under its job id
(scontrol(1), slurm.schedmd.com, Slurm 26.05), though Slurm restarts the whole script. Unlike
`rerun`, which submits a new job from the same spec, a retry reopens the same job.
Neighbours: `store.jobs_repo` (SQL) and `store.memory.jobs` call `plan_retry` inside one write and
apply the plan through their guarded writers; `domain.states` holds the reopening moves
(`Lifecycle.reopen`); `policy.dag.advance` takes the job on from there, and the scheduler starts
its READY steps like any others. `policy.outcomes` counts a step's retries from the
`retries_used` the plan resets.
Must not: read the clock, do I/O, import the store, or decide anything about running steps.

Rules (docs/architecture.md §7.1)
- Only a FAILED or CANCELLED job is retried, and only when none of its steps holds GPUs any more;
  anything else is refused with the reason (`RetryRefused`): QUEUED or RUNNING "already running",
  CANCELLING "still stopping", SUCCEEDED "nothing failed". A job whose steps all SUCCEEDED has
  nothing to retry either.
- SUCCEEDED steps stay SUCCEEDED, with their attempts, outputs and checkpoints: not rerun.
- FAILED, CANCELLED and SKIPPED steps go back to work: READY when every step it
  depends on SUCCEEDED (the failed step itself, a cancelled root), else PENDING (the DAG makes it
  READY once its upstream steps succeed again). A retried step gets a fresh budget: its
  `retries_used` and `preemptions` start again at 0, and it may start at once (no backoff).
  Its attempts are kept and numbered on (attempt 2 follows attempt 1), and it resumes from its
  newest valid checkpoint like any later attempt (docs/architecture.md §6.2).
- The job becomes RUNNING when it had started before (`started_at` set), else QUEUED (a job
  cancelled before any step started); its end (`finished_at`) and cancel request are cleared.

The walltime budget starts again too: the store records when it reopened the step
(`steps.retried_at`) and the loop counts only the running time of the attempts since then
(`policy.walltime`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lowtide.domain.states import ACTIVE_STEP_STATES, JobState, StepState
from lowtide.policy.dag import StepChange, StepView

#: Job states a retry reopens.
RETRIABLE_JOB_STATES = frozenset({JobState.FAILED, JobState.CANCELLED})
#: Step states a retry sends back to work.
REOPENED_STEP_STATES = frozenset({StepState.FAILED, StepState.CANCELLED, StepState.SKIPPED})

_REFUSALS = {
    JobState.QUEUED: "already running",
    JobState.RUNNING: "already running",
    JobState.CANCELLING: "still stopping: retry it once it is CANCELLED",
    JobState.SUCCEEDED: "nothing failed: it SUCCEEDED (rerun makes a new job)",
}


@dataclass(frozen=True, slots=True)
class RetryPlan:
    """What a retry does: the job's move and each reopened step's, in the job's step order."""

    job_id: str
    from_state: JobState
    to_state: JobState
    steps: tuple[StepChange, ...]
    message: str  # the job's message and the text of its "retried" event
    kept: tuple[str, ...] = ()  # the SUCCEEDED steps, not run again

    @property
    def ready(self) -> tuple[str, ...]:
        """The steps that go straight back to the queue."""
        return tuple(s.step for s in self.steps if s.to_state == StepState.READY)

    @property
    def pending(self) -> tuple[str, ...]:
        """The steps that wait for their upstream steps to succeed again."""
        return tuple(s.step for s in self.steps if s.to_state == StepState.PENDING)


@dataclass(frozen=True, slots=True)
class RetryRefused:
    """Why a job cannot be retried now (the API answers 409 with it)."""

    job_id: str
    state: JobState
    reason: str

    @property
    def message(self) -> str:
        return f"job {self.job_id} is {self.state.value}: {self.reason}"


def plan_retry(
    job_id: str, state: JobState, started: bool, steps: Sequence[StepView], *, by: str
) -> RetryPlan | RetryRefused:
    """The retry of job `job_id` (in `state`, `started` if any step of it ever started) by `by`."""
    if state not in RETRIABLE_JOB_STATES:
        return RetryRefused(job_id, state, _REFUSALS.get(state, "not retriable"))
    busy = [s.name for s in steps if s.state in ACTIVE_STEP_STATES]
    if busy:
        return RetryRefused(job_id, state, "still stopping: step " + ", ".join(busy) + " holds GPUs")
    succeeded = {s.name for s in steps if s.state == StepState.SUCCEEDED}
    moves: list[StepChange] = []
    for s in steps:
        if s.state not in REOPENED_STEP_STATES:  # SUCCEEDED stays; nothing else is finished here
            continue
        waiting = [d for d in s.depends if d not in succeeded]
        if waiting:
            moves.append(
                StepChange(
                    s.name, s.state, StepState.PENDING, f"retried by {by}: waiting for {', '.join(waiting)}"
                )
            )
        else:
            moves.append(StepChange(s.name, s.state, StepState.READY, f"retried by {by}"))
    if not moves:
        return RetryRefused(job_id, state, "nothing to retry: every step SUCCEEDED")
    target = JobState.RUNNING if started else JobState.QUEUED
    names = ", ".join(m.step for m in moves)
    kept = tuple(s.name for s in steps if s.state == StepState.SUCCEEDED)
    return RetryPlan(job_id, state, target, tuple(moves), f"retried by {by}: {names} back to work", kept)


def step_event(move: StepChange) -> tuple[str, str]:
    """(kind, message) of the event a reopened step writes."""
    return "retried", f"{move.from_state.value} -> {move.to_state.value}: {move.reason}"
