"""The one writer of job, step, attempt and replica states: guarded ``UPDATE ... WHERE state = :expected``.

Each function first checks the move against the domain's transition table (an illegal move
raises `IllegalTransition` before any SQL), then updates only if the row is still in the
expected state; if another writer got there first, `StaleState` is raised and the caller's
transaction rolls back. Must not: decide which transition to make (policy does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection

from lowtide.control.records import StaleState
from lowtide.domain.states import (
    ATTEMPT_LIFECYCLE,
    JOB_LIFECYCLE,
    RECLAIM_LIFECYCLE,
    REPLICA_LIFECYCLE,
    STEP_LIFECYCLE,
    AttemptState,
    JobState,
    ReclaimState,
    ReplicaState,
    StepState,
)
from lowtide.store.schema import attempts, jobs, reclaims, replicas, steps


def move_job(conn: Connection, job_id: str, expected: JobState, target: JobState, **values: Any) -> None:
    JOB_LIFECYCLE.check(expected, target)
    result = conn.execute(
        sa.update(jobs)
        .where(jobs.c.id == job_id, jobs.c.state == expected.value)
        .values(state=target.value, **values)
    )
    if result.rowcount != 1:
        raise StaleState(f"job {job_id}: expected {expected}, cannot move to {target}")


def move_step(conn: Connection, step_id: int, expected: StepState, target: StepState, **values: Any) -> None:
    STEP_LIFECYCLE.check(expected, target)
    result = conn.execute(
        sa.update(steps)
        .where(steps.c.id == step_id, steps.c.state == expected.value)
        .values(state=target.value, **values)
    )
    if result.rowcount != 1:
        raise StaleState(f"step {step_id}: expected {expected}, cannot move to {target}")


def move_job_steps(
    conn: Connection, job_id: str, expected: Iterable[StepState], target: StepState, **values: Any
) -> int:
    """Move every step of a job that is in one of `expected` to `target`; returns how many moved."""
    sources = list(expected)
    for source in sources:
        STEP_LIFECYCLE.check(source, target)
    result = conn.execute(
        sa.update(steps)
        .where(steps.c.job_id == job_id, steps.c.state.in_([s.value for s in sources]))
        .values(state=target.value, **values)
    )
    return int(result.rowcount)


def move_attempt(
    conn: Connection,
    attempt_id: int,
    expected: Iterable[AttemptState],
    target: AttemptState,
    **values: Any,
) -> None:
    sources = list(expected)
    for source in sources:
        ATTEMPT_LIFECYCLE.check(source, target)
    result = conn.execute(
        sa.update(attempts)
        .where(attempts.c.id == attempt_id, attempts.c.state.in_([s.value for s in sources]))
        .values(state=target.value, **values)
    )
    if result.rowcount != 1:
        raise StaleState(
            f"attempt {attempt_id}: not in {[s.value for s in sources]}, cannot move to {target}"
        )


def move_replica(
    conn: Connection, replica_id: str, expected: ReplicaState, target: ReplicaState, **values: Any
) -> None:
    REPLICA_LIFECYCLE.check(expected, target)
    result = conn.execute(
        sa.update(replicas)
        .where(replicas.c.id == replica_id, replicas.c.state == expected.value)
        .values(state=target.value, **values)
    )
    if result.rowcount != 1:
        raise StaleState(f"replica {replica_id}: expected {expected}, cannot move to {target}")


def move_reclaim(
    conn: Connection, reclaim_id: int, expected: ReclaimState, target: ReclaimState, **values: Any
) -> None:
    RECLAIM_LIFECYCLE.check(expected, target)
    result = conn.execute(
        sa.update(reclaims)
        .where(reclaims.c.id == reclaim_id, reclaims.c.state == expected.value)
        .values(state=target.value, **values)
    )
    if result.rowcount != 1:
        raise StaleState(f"reclaim {reclaim_id}: expected {expected}, cannot move to {target}")
