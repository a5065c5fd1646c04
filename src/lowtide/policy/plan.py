"""What the scheduling policy returns: data, never effects. The actuator (control.actuator) applies it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StartStep:
    """Start `job_id/step` now on these GPUs of `node`."""

    job_id: str
    step: str
    node: str
    gpus: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Waiting:
    """A queued step that stays queued this tick, and the human-readable reason why."""

    job_id: str
    step: str
    reason: str


@dataclass(frozen=True, slots=True)
class Reservation:
    """Free GPUs on `node` held back for a blocked head-of-queue step, so backfill cannot delay it."""

    job_id: str
    step: str
    node: str
    gpus_needed: int


@dataclass(frozen=True, slots=True)
class SchedulePlan:
    starts: tuple[StartStep, ...] = ()
    waiting: tuple[Waiting, ...] = ()
    reservations: tuple[Reservation, ...] = ()
