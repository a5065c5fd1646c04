"""Lifecycle state machines for jobs, steps and attempts, each written once.

Every machine is an enum plus a table of legal transitions. `check()` raises
`IllegalTransition` for anything outside the table; the store's guarded writer
(`UPDATE ... WHERE state = :expected`) calls it before every write, so there is one
definition of what may happen and one place that makes it happen.

Must not: read the clock, touch the database, or know about executors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar


class IllegalTransition(ValueError):
    """A state change that the machine's transition table does not allow."""


class JobState(StrEnum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    CANCELLING = "CANCELLING"  # cancelled; its running steps have notice and still hold GPUs
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class StepState(StrEnum):
    PENDING = "PENDING"  # waiting for upstream steps
    READY = "READY"  # upstream done, waiting for GPUs (or for its retry backoff)
    RUNNING = "RUNNING"
    PREEMPTING = "PREEMPTING"  # notice given to give GPUs back; will be requeued
    PREEMPTED = "PREEMPTED"  # interrupted and requeued at the head of its class
    CANCELLING = "CANCELLING"  # notice given because the job was cancelled
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    SKIPPED = "SKIPPED"  # never ran: an upstream step failed or the job was stopped


class AttemptState(StrEnum):
    PENDING = "PENDING"  # the executor holds it, it does not run yet (image pull, scheduling)
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"  # notice given, waiting for exit or deadline
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    INTERRUPTED = "INTERRUPTED"  # exited non-zero or was killed after notice, or evicted
    LOST = "LOST"  # the process vanished while the control plane was down


_S = TypeVar("_S", bound=StrEnum)


@dataclass(frozen=True)
class Lifecycle(Generic[_S]):
    """A named transition table over one enum.

    `reopen` holds the moves out of a finished state that only a person's retry makes (a FAILED
    job back to RUNNING, its FAILED step back to READY): legal, but they do not make the state
    unfinished, so `is_terminal` (what the DAG, listings and the loop call finished) ignores them.
    """

    name: str
    transitions: Mapping[_S, frozenset[_S]]
    reopen: Mapping[_S, frozenset[_S]] = field(default_factory=dict)

    def allowed(self, current: _S, target: _S) -> bool:
        return target in self.transitions.get(current, frozenset()) or target in self.reopen.get(
            current, frozenset()
        )

    def check(self, current: _S, target: _S) -> None:
        if not self.allowed(current, target):
            raise IllegalTransition(f"{self.name}: {current} -> {target} is not a legal transition")

    def is_terminal(self, state: _S) -> bool:
        return not self.transitions.get(state)


J, S, A = JobState, StepState, AttemptState

JOB_LIFECYCLE: Lifecycle[JobState] = Lifecycle(
    "job",
    {
        J.QUEUED: frozenset({J.RUNNING, J.SUCCEEDED, J.FAILED, J.CANCELLED}),
        # A cancel with steps still holding GPUs: CANCELLING until every one has exited.
        J.RUNNING: frozenset({J.SUCCEEDED, J.FAILED, J.CANCELLING, J.CANCELLED}),
        J.CANCELLING: frozenset({J.CANCELLED}),
        J.SUCCEEDED: frozenset(),
        J.FAILED: frozenset(),
        J.CANCELLED: frozenset(),
    },
    # A retry (`policy.retry`): back to work in place, RUNNING if it had started, else QUEUED.
    reopen={
        J.FAILED: frozenset({J.RUNNING, J.QUEUED}),
        J.CANCELLED: frozenset({J.RUNNING, J.QUEUED}),
    },
)

STEP_LIFECYCLE: Lifecycle[StepState] = Lifecycle(
    "step",
    {
        S.PENDING: frozenset({S.READY, S.SKIPPED, S.CANCELLED}),
        S.READY: frozenset({S.RUNNING, S.SKIPPED, S.CANCELLED, S.FAILED}),
        # RUNNING -> READY: a retry after failure, or a requeue after the process was lost.
        S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.READY, S.PREEMPTING, S.CANCELLING}),
        # Exit 0 after notice means "done" by contract; a crash while checkpointing may retry.
        S.PREEMPTING: frozenset({S.PREEMPTED, S.SUCCEEDED, S.FAILED, S.READY, S.CANCELLING}),
        S.PREEMPTED: frozenset({S.RUNNING, S.CANCELLED, S.SKIPPED}),
        S.CANCELLING: frozenset({S.CANCELLED}),
        S.SUCCEEDED: frozenset(),
        S.FAILED: frozenset(),
        S.CANCELLED: frozenset(),
        S.SKIPPED: frozenset(),
    },
    # A retry of its job (`policy.retry`): READY when every upstream step SUCCEEDED, else PENDING.
    reopen={
        S.FAILED: frozenset({S.READY}),
        S.CANCELLED: frozenset({S.READY, S.PENDING}),
        S.SKIPPED: frozenset({S.READY, S.PENDING}),
    },
)

ATTEMPT_LIFECYCLE: Lifecycle[AttemptState] = Lifecycle(
    "attempt",
    {
        # PENDING -> SUCCEEDED: it ran, but its start was never recorded (the store failed
        # right after the launch); its exit code is the executor's proof that it ran.
        A.PENDING: frozenset({A.RUNNING, A.STOPPING, A.SUCCEEDED, A.FAILED, A.INTERRUPTED, A.LOST}),
        # RUNNING -> INTERRUPTED: ended by the platform without notice (evicted, its pod deleted).
        A.RUNNING: frozenset({A.STOPPING, A.SUCCEEDED, A.FAILED, A.INTERRUPTED, A.LOST}),
        A.STOPPING: frozenset({A.INTERRUPTED, A.SUCCEEDED, A.FAILED, A.LOST}),
        A.SUCCEEDED: frozenset(),
        A.FAILED: frozenset(),
        A.INTERRUPTED: frozenset(),
        A.LOST: frozenset(),
    },
)

#: Steps that wait for the scheduler (they may be started when GPUs allow).
QUEUED_STEP_STATES = frozenset({S.READY, S.PREEMPTED})
#: Steps whose attempt holds GPUs right now.
ACTIVE_STEP_STATES = frozenset({S.RUNNING, S.PREEMPTING, S.CANCELLING})
TERMINAL_STEP_STATES = frozenset(s for s in StepState if STEP_LIFECYCLE.is_terminal(s))
TERMINAL_JOB_STATES = frozenset(s for s in JobState if JOB_LIFECYCLE.is_terminal(s))


class ReplicaState(StrEnum):
    """An inference replica's life. GPUs are held by the replica in every state but PARKED
    (asleep or stopped: its GPUs may be lent), STOPPED and FAILED."""

    STARTING = "STARTING"  # process launched, waiting for /health (cold start)
    SERVING = "SERVING"  # healthy and in the gateway
    DRAINING = "DRAINING"  # out of the gateway, in-flight requests finishing
    PARKING = "PARKING"  # being put to sleep or stopped
    PARKED = "PARKED"  # asleep (weights in host RAM, process alive) or stopped; GPUs lendable
    WAKING = "WAKING"  # woken or restarting; back to SERVING once healthy
    FAILED = "FAILED"  # never became healthy, or died; retried by the autoscaler with backoff


R = ReplicaState

REPLICA_LIFECYCLE: Lifecycle[ReplicaState] = Lifecycle(
    "replica",
    {
        R.STARTING: frozenset({R.SERVING, R.FAILED, R.PARKING}),
        R.SERVING: frozenset({R.DRAINING, R.FAILED}),
        R.DRAINING: frozenset({R.PARKING, R.SERVING, R.FAILED}),
        R.PARKING: frozenset({R.PARKED, R.FAILED}),
        R.PARKED: frozenset({R.WAKING, R.STARTING, R.FAILED}),  # STARTING: a stopped one starts cold
        R.WAKING: frozenset({R.SERVING, R.FAILED, R.PARKING}),
        R.FAILED: frozenset({R.STARTING, R.PARKED}),
    },
)

#: Replica states in which the replica's GPUs are its own (not lendable).
GPU_HOLDING_REPLICA_STATES = frozenset({R.STARTING, R.SERVING, R.DRAINING, R.PARKING, R.WAKING})
#: Replica states that count as inference capacity now or soon (supply for the autoscaler).
SUPPLY_REPLICA_STATES = frozenset({R.STARTING, R.SERVING, R.WAKING})


class ReclaimState(StrEnum):
    """One taking-back of lent GPUs (`control.reclaimer` is its only writer)."""

    OPEN = "OPEN"  # victims chosen; notice, GPUs free and replica healthy are being recorded
    DONE = "DONE"  # GPUs back (and, for a service, its replica healthy)
    ABANDONED = "ABANDONED"  # GPUs back, but the replica never became healthy in time


RECLAIM_LIFECYCLE: Lifecycle[ReclaimState] = Lifecycle(
    "reclaim",
    {
        ReclaimState.OPEN: frozenset({ReclaimState.DONE, ReclaimState.ABANDONED}),
        ReclaimState.DONE: frozenset(),
        ReclaimState.ABANDONED: frozenset(),
    },
)
