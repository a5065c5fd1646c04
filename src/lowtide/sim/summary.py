"""The figures of a simulated run, read from the same store and ledger production reports from.

`summarize` turns a finished `SimWorld` into the `summary.json` document: GPU-hours by holder from
the GPU ledger (`gpu_hours_total` = capacity × time, `gpu_hours_inference` = replicas,
`gpu_hours_harvested` = research step attempts, `gpu_hours_idle`; they add up), work lost to
preemption (the attempts' `lost_gpu_seconds`, as `lowtide report` counts it), the oracle bound and
`harvest_efficiency`, SLO-violation minutes from the capacity model, reclaim latencies (surge
detected → replica healthy), job wait and completion percentiles, equivalent GPUs and savings.
Neighbours: `sim.world` (the run), `sim.oracle` (the bound), `sim.report` (HTML). Must not: run
anything or write files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lowtide.domain.states import JobState
from lowtide.policy.accounting import equivalent_gpus, savings
from lowtide.sim.world import RunTrace, SimWorld

SECONDS_PER_HOUR = 3600.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation between closest ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(
    world: SimWorld,
    trace: RunTrace,
    *,
    oracle_idle_s: float,
    oracle_harvest_s: float | None = None,
    price_per_gpu_hour: float = 0.0,
    currency: str = "USD",
    baseline: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    s = world.scenario
    start, end = s.start, s.end
    period = end - start
    by_holder = world.store.gpu_seconds_by_holder(start, end)
    inference = by_holder.get("replica", 0.0)
    harvested = by_holder.get("attempt", 0.0)
    idle = by_holder.get("idle", 0.0)
    details = [world.store.job_detail(job_id) for job_id in trace.submitted]
    attempts = [a for d in details for a in d.attempts]
    lost_preempt = sum(a.lost_gpu_seconds or 0.0 for a in attempts if a.preempted)
    preemptions = sum(st.preemptions for d in details for st in d.steps)
    waits = [d.job.started_at - d.job.submitted_at for d in details if d.job.started_at is not None]
    done = [
        d.job.finished_at - d.job.submitted_at
        for d in details
        if d.job.state == JobState.SUCCEEDED and d.job.finished_at is not None
    ]
    reclaims = world.store.reclaims(limit=1_000_000)
    # Surge detected → replica healthy; for reclaims of lending alone (no replica), → GPUs free.
    ends = [(r.healthy_at if r.healthy_at is not None else r.freed_at, r.detected_at) for r in reclaims]
    latencies = [end - detected for end, detected in ends if end is not None]
    slo_minutes = sum(trace.slo_violation_s.values()) / 60.0
    demand = sum(j.gpus * j.work_s for j in trace.submitted.values())
    summary: dict[str, Any] = {
        "policy": s.policy,
        "days": s.days,
        "seed": s.seed,
        "nodes": len(s.nodes),
        "gpus": s.pool_gpus,
        "services": [svc.name for svc in s.services],
        # >1: the trace was too light for the fleet and its rates were scaled up (`sim.fleet.fit_load`).
        "load_scale_by_service": {svc.name: svc.load_scale for svc in s.services},
        "jobs_submitted": len(trace.submitted),
        "jobs_succeeded": len(done),
        "jobs_unfinished": len(trace.submitted) - len(done),
        "research_demand_gpu_hours": demand / SECONDS_PER_HOUR,
        "gpu_hours_total": s.pool_gpus * period / SECONDS_PER_HOUR,
        "gpu_hours_inference": inference / SECONDS_PER_HOUR,
        "gpu_hours_harvested": harvested / SECONDS_PER_HOUR,
        "gpu_hours_idle": idle / SECONDS_PER_HOUR,
        "gpu_hours_lost_to_preemption": lost_preempt / SECONDS_PER_HOUR,
        "oracle_idle_gpu_hours": oracle_idle_s / SECONDS_PER_HOUR,
        "harvest_efficiency": harvested / oracle_idle_s if oracle_idle_s > 0 else None,
        "oracle_harvest_gpu_hours": None if oracle_harvest_s is None else oracle_harvest_s / SECONDS_PER_HOUR,
        "harvest_efficiency_of_demand": (harvested / oracle_harvest_s if oracle_harvest_s else None),
        "slo_violation_minutes": slo_minutes,
        "slo_violation_minutes_by_service": {k: v / 60.0 for k, v in trace.slo_violation_s.items()},
        "preemptions": preemptions,
        "reclaims": len(reclaims),
        "reclaim_latency_p50_s": percentile(latencies, 0.5),
        "reclaim_latency_p99_s": percentile(latencies, 0.99),
        "job_wait_p50_s": percentile(waits, 0.5),
        "job_wait_p90_s": percentile(waits, 0.9),
        "job_completion_p50_s": percentile(done, 0.5),
        "job_completion_p90_s": percentile(done, 0.9),
        "equivalent_gpus": equivalent_gpus(harvested, period),
        "price_per_gpu_hour": price_per_gpu_hour,
        "currency": currency,
        "savings": savings(harvested, price_per_gpu_hour),
        "ticks": trace.ticks,
        "tick_errors": trace.tick_errors,
    }
    if baseline is not None:
        summary["baseline_none"] = dict(baseline)
    return summary


def baseline_figures(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a `none` run's summary other policies compare against."""
    return {
        "slo_violation_minutes": summary["slo_violation_minutes"],
        "gpu_hours_inference": summary["gpu_hours_inference"],
        "gpu_hours_idle": summary["gpu_hours_idle"],
    }


def oracle_summary(base: Mapping[str, Any], oracle_idle_s: float, oracle_harvest_s: float) -> dict[str, Any]:
    """The `oracle` row of a comparison: not a run but the bounds of `sim.oracle` — every idle
    GPU-hour (`oracle_idle_gpu_hours`) and what these jobs could have used of it, with no notice,
    restart or lost work (`gpu_hours_harvested`)."""
    period = base["days"] * 86400.0
    price = base["price_per_gpu_hour"]
    return {
        **{k: base[k] for k in ("days", "seed", "nodes", "gpus", "services", "gpu_hours_total")},
        "policy": "oracle",
        "gpu_hours_harvested": oracle_harvest_s / SECONDS_PER_HOUR,
        "oracle_idle_gpu_hours": oracle_idle_s / SECONDS_PER_HOUR,
        "oracle_harvest_gpu_hours": oracle_harvest_s / SECONDS_PER_HOUR,
        "harvest_efficiency": oracle_harvest_s / oracle_idle_s if oracle_idle_s > 0 else None,
        "harvest_efficiency_of_demand": 1.0 if oracle_harvest_s > 0 else None,
        "gpu_hours_lost_to_preemption": 0.0,
        "preemptions": 0,
        "equivalent_gpus": equivalent_gpus(oracle_harvest_s, period),
        "price_per_gpu_hour": price,
        "currency": base["currency"],
        "savings": savings(oracle_harvest_s, price),
        "note": "bound from the load curve and the jobs (no loop run): idle GPUs fed by the jobs' work, "
        "with no notice, restart or lost work",
    }
