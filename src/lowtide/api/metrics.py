"""Prometheus metrics of the control plane (``lowtide_*``), computed from the store at scrape time.

A fresh registry per scrape keeps the numbers exactly what the store says now (no stale series
for states that emptied). Must not: keep counters of its own that could drift from the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from lowtide.control.inference import InferenceController
from lowtide.domain.gpus import Node
from lowtide.domain.states import (
    ACTIVE_STEP_STATES,
    QUEUED_STEP_STATES,
    JobState,
    ReclaimState,
    ReplicaState,
    StepState,
)
from lowtide.store.repo import Store


@dataclass(frozen=True, slots=True)
class LoopStatus:
    last_tick_at: float | None
    last_tick_duration_s: float
    ticks: int
    tick_errors: int
    queued_waiting: int
    clock_jumps: int = 0  # wall-clock jumps seen since start (control.clock.ClockWatch)
    clock_skew_s: float = 0.0  # wall − control time at the last check
    #: Infrastructure alerts now (kind → last message) and launch failures by kind since start
    #: (`control.loop.ControlLoop.infrastructure_alerts`, docs/architecture.md §4.4).
    infrastructure_alerts: Mapping[str, str] = field(default_factory=dict)
    infrastructure_failures: Mapping[str, int] = field(default_factory=dict)
    #: Leader or standby, and who holds the lease (`control.leadership.Leadership.status`); None
    #: when this process runs without a lease (tests that build lowtide by hand).
    control: Mapping[str, Any] | None = None


def metrics_text(
    store: Store,
    nodes: tuple[Node, ...],
    loop: LoopStatus | None,
    inference: InferenceController | None = None,
) -> tuple[bytes, str]:
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
    reclaims = Gauge("lowtide_reclaims", "Reclaims of lent GPUs by state (all time)", ["state"], registry=reg)
    for reclaim_state in ReclaimState:
        reclaims.labels(reclaim_state.value).set(counts["reclaims"].get(reclaim_state.value, 0))
    outage = store.health.outage()  # docs/architecture.md §4.4
    up = Gauge("lowtide_store_up", "0 while reads or writes of the store fail", registry=reg)
    up.set(int(outage is None))
    Gauge(
        "lowtide_store_failing_seconds", "How long the store has been failing (0: it works)", registry=reg
    ).set(outage.age(store.health.clock.now()) if outage is not None else 0.0)
    preemptions, lost = store.preemption_totals()
    Gauge("lowtide_preemptions", "Step preemptions recorded (all time)", registry=reg).set(preemptions)
    Gauge("lowtide_lost_gpu_seconds", "GPU-seconds of work lost to preemptions (all time)", registry=reg).set(
        lost
    )
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
        Gauge(
            "lowtide_clock_jumps_total",
            "Wall-clock jumps seen since start (deadlines ignore them)",
            registry=reg,
        ).set(loop.clock_jumps)
        Gauge("lowtide_clock_skew_seconds", "Wall clock minus control (monotonic) time", registry=reg).set(
            loop.clock_skew_s
        )
        failures = Counter(
            "lowtide_infrastructure_failures",
            "Launches that failed because of the infrastructure, not the step (since start)",
            ["kind"],
            registry=reg,
        )
        for kind, n in loop.infrastructure_failures.items():
            failures.labels(kind).inc(n)
        alert = Gauge(
            "lowtide_infrastructure_alert",
            "1 while launches fail because of this part of the infrastructure (see /healthz)",
            ["kind"],
            registry=reg,
        )
        for kind in loop.infrastructure_alerts:
            alert.labels(kind).set(1)
    if loop is not None and loop.control is not None:
        Gauge(
            "lowtide_leader",
            "1 while this control plane holds the lease and acts, 0 on a standby",
            registry=reg,
        ).set(1 if loop.control.get("role") == "leader" else 0)
    if inference is not None:
        _inference_metrics(reg, store, inference)
    return generate_latest(reg), CONTENT_TYPE_LATEST


def _inference_metrics(reg: CollectorRegistry, store: Store, inference: InferenceController) -> None:
    desired = Gauge(
        "lowtide_service_desired_replicas", "Replicas the autoscaler wants", ["service"], registry=reg
    )
    needed = Gauge("lowtide_service_needed_replicas", "Replicas the load needs", ["service"], registry=reg)
    replicas = Gauge("lowtide_service_replicas", "Replicas by state", ["service", "state"], registry=reg)
    alerts = Gauge(
        "lowtide_service_alert",
        "1 while a service has an alert (see /v1/services)",
        ["service"],
        registry=reg,
    )
    records = store.replicas()
    for name in inference.services:
        alerts.labels(name).set(int(bool(inference.status[name].alert)))
        decision = inference.status[name].decision
        if decision is not None:
            desired.labels(name).set(decision.desired)
            needed.labels(name).set(decision.needed)
        for state in ReplicaState:
            replicas.labels(name, state.value).set(
                sum(r.service == name and r.state == state for r in records)
            )
    last = inference.last
    if last is not None:
        env = last.envelope
        Gauge("lowtide_lendable_gpus", "GPUs research may hold now (the envelope)", registry=reg).set(
            env.lendable_gpus
        )
        Gauge("lowtide_inference_claim_gpus", "GPUs inference keeps (claims + reserve)", registry=reg).set(
            env.inference_claim_gpus
        )
        Gauge("lowtide_lending_open", "1 when new lending is allowed", registry=reg).set(
            int(env.lending_open)
        )
