"""The rules of a job's bookkeeping that every store applies the same way (pure).

Role: what a new job's steps start as, which steps a cancellation stops at once and which get
notice, which jobs the DAG may still move, how step states are counted for listings, and the
texts of the events these write.
Neighbours: `store.jobs_repo` and `store.attempts_repo` (SQL) and `store.memory` (in memory) call
these and only persist the results; `policy.dag.advance` decides the DAG's moves, these only say
how they are recorded; `domain.states` holds the transition tables every move is checked against.
Must not: read the clock, do I/O, import the store or SQLAlchemy, or decide DAG progress.

Rules
- A new step with upstream steps is PENDING ("waiting for a, b"); one without is READY.
- Cancelling a job that is not finished: steps not started (PENDING, READY, PREEMPTED) become
  CANCELLED at once ("job cancelled"); steps holding GPUs (RUNNING, PREEMPTING) become CANCELLING
  ("job cancelled: stopping") and the loop gives them notice; the job is CANCELLED. The
  not-started steps move first. Cancelling a finished job changes nothing.
- The DAG may still move a job that is not finished or that has a step not finished.
- A DAG move writes an event unless the step only became READY; the job's end always writes one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lowtide.domain.states import TERMINAL_JOB_STATES, TERMINAL_STEP_STATES, JobState, StepState
from lowtide.policy.dag import JobChange, StepChange


@dataclass(frozen=True, slots=True)
class CancelMove:
    """Steps in `sources` move to `target` with `reason` when their job is cancelled."""

    sources: tuple[StepState, ...]
    target: StepState
    reason: str


#: In this order: the steps not started first, then those that get notice.
CANCEL_MOVES = (
    CancelMove(
        (StepState.PENDING, StepState.READY, StepState.PREEMPTED), StepState.CANCELLED, "job cancelled"
    ),
    CancelMove((StepState.RUNNING, StepState.PREEMPTING), StepState.CANCELLING, "job cancelled: stopping"),
)


def initial_step_state(depends: Sequence[str]) -> StepState:
    return StepState.PENDING if depends else StepState.READY


def initial_reason(depends: Sequence[str]) -> str:
    return "waiting for " + ", ".join(depends) if depends else ""


def submit_message(owner: str, rerun_of: str | None) -> str:
    note = f" (rerun of {rerun_of})" if rerun_of else ""
    return f"submitted by {owner}{note}"


def step_counts(states: Iterable[StepState | str]) -> dict[str, int]:
    """State → number of steps in it, keys in order (a job listing's `step_states`)."""
    counts: dict[str, int] = {}
    for state in sorted(str(s) for s in states):
        counts[state] = counts.get(state, 0) + 1
    return counts


def cancels(job_state: JobState) -> bool:
    """Whether cancelling a job in this state changes anything (not when finished, nor when a
    cancel is already under way)."""
    return job_state not in TERMINAL_JOB_STATES and job_state != JobState.CANCELLING


def cancel_target(stopping: int) -> JobState:
    """A cancelled job's state: CANCELLING while `stopping` steps still hold GPUs (they got
    notice; `policy.dag.advance` makes it CANCELLED once every step has exited), else CANCELLED."""
    return JobState.CANCELLING if stopping else JobState.CANCELLED


def cancel_move(state: StepState) -> CancelMove | None:
    """What cancelling its job does to a step in `state` (None: nothing)."""
    for move in CANCEL_MOVES:
        if state in move.sources:
            return move
    return None


def cancel_message(by: str, stopping: int) -> str:
    detail = f"; stopping {stopping} running step(s)" if stopping else ""
    return f"cancelled by {by}{detail}"


def job_may_move(job_state: JobState, step_states: Iterable[StepState]) -> bool:
    """Whether the DAG may still move a job: it is not finished, or one of its steps is not."""
    return job_may_move_counted(job_state, sum(1 for s in step_states if is_open_step(s)))


def job_may_move_counted(job_state: JobState, open_steps: int) -> bool:
    """`job_may_move` given how many of the job's steps are not finished (`is_open_step`): what
    a store that keeps that count per job answers in O(1) on every step move."""
    return job_state not in TERMINAL_JOB_STATES or open_steps > 0


def is_open_step(state: StepState) -> bool:
    """A step not finished: what `job_may_move` counts."""
    return state not in TERMINAL_STEP_STATES


def dag_step_event(change: StepChange) -> tuple[str, str] | None:
    """(kind, message) of the event a DAG step move writes; None for a step that became READY."""
    if change.to_state == StepState.READY:
        return None
    return change.to_state.value.lower(), change.reason


def dag_job_event(change: JobChange) -> tuple[str, str]:
    return change.to_state.value.lower(), change.reason
