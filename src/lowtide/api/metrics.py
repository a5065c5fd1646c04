"""Prometheus metrics of the control plane (``lowtide_*``), computed from the store at scrape time.

A fresh registry per scrape keeps the numbers exactly what the store says now (no stale series
for states that emptied). Must not: keep counters of its own that could drift from the store.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from lowtide.domain.gpus import Node
from lowtide.domain.states import ACTIVE_STEP_STATES, QUEUED_STEP_STATES, JobState, StepState
from lowtide.store.repo import Store


@dataclass(frozen=True, slots=True)
class LoopStatus:
    last_tick_at: float | None
    last_tick_duration_s: float
    ticks: int
    tick_errors: int
    queued_waiting: int


def metrics_text(store: Store, nodes: tuple[Node, ...], loop: LoopStatus | None) -> tuple[bytes, str]:
    counts = store.counts()
    reg = CollectorRegistry()
    jobs = Gauge("lowtide_jobs", "Jobs by state", ["state"], registry=reg)
    for state in JobState:
        jobs.labels(state.value).set(counts["jobs"].get(state.value, 0))
    steps = Gauge("lowtide_steps", "Steps by state", ["state"], registry=reg)
    for step_state in StepState:
        steps.labels(step_state.value).set(counts["steps"].get(step_state.value, 0))
    Gauge("lowtide_queue_steps", "Steps waiting for GPUs (READY or PREEMPTED)", registry=reg).set(
        sum(counts["steps"].get(s.value, 0) for s in QUEUED_STEP_STATES)
    )
    Gauge("lowtide_running_steps", "Steps holding GPUs or a process now", registry=reg).set(
        sum(counts["steps"].get(s.value, 0) for s in ACTIVE_STEP_STATES)
    )
    gpus = Gauge("lowtide_gpus", "GPUs by current holder kind", ["holder"], registry=reg)
    for kind in ("idle", "attempt", "replica"):
        gpus.labels(kind).set(counts["gpus"].get(kind, 0))
    Gauge("lowtide_gpus_total", "GPUs managed by lowtide", registry=reg).set(sum(n.gpu_count for n in nodes))
    if loop is not None:
        Gauge("lowtide_loop_ticks", "Control-loop ticks since start", registry=reg).set(loop.ticks)
        Gauge("lowtide_loop_tick_errors", "Items that failed inside ticks since start", registry=reg).set(
            loop.tick_errors
        )
        Gauge("lowtide_loop_last_tick_duration_seconds", "Duration of the last tick", registry=reg).set(
            loop.last_tick_duration_s
        )
        if loop.last_tick_at is not None:
            Gauge("lowtide_loop_last_tick_timestamp_seconds", "When the last tick ran", registry=reg).set(
                loop.last_tick_at
            )
    return generate_latest(reg), CONTENT_TYPE_LATEST
