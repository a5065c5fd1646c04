"""Run a scenario under one or several lending policies and collect their summaries.

`simulate` runs the `none` baseline (services pinned at max, nothing lent) and then the chosen
policy on the same fleet, load, jobs and seed, and returns the policy's summary with the
baseline's figures inside it; `oracle` is the bound of `sim.oracle`, not a run. `compare` does
the same for several policies, sharing one baseline and one oracle computation. The oracle gives
two bounds: the idle GPU-hours (`oracle_idle_gpu_hours`, the denominator of `harvest_efficiency`)
and what the scenario's jobs could have used of them (`oracle_harvest_gpu_hours`, the `oracle`
row's harvest and the denominator of `harvest_efficiency_of_demand`), and how much of the idle
lies in spells of at least 10 minutes, 30 minutes and an hour (`oracle_idle_gpu_hours_in_spells`,
`sim.oracle.idle_in_spells`: what loans that must last that long could reach).
Neighbours: `cli.simulate_cmd`, `benchmarks/simulate.py`, the simulator tests.
Must not: print or write files (the callers do).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lowtide.sim.oracle import idle_in_spells_gpu_hours, oracle_harvest_gpu_seconds, oracle_idle_gpu_seconds
from lowtide.sim.policies import PolicyName
from lowtide.sim.scenario import Scenario, policy_variant
from lowtide.sim.summary import baseline_figures, oracle_summary, summarize
from lowtide.sim.world import RunTrace, SimWorld, cyclic_gc_paused


@dataclass
class PolicyRun:
    policy: PolicyName
    summary: dict[str, Any]
    world: SimWorld | None  # None for the oracle (no run)
    trace: RunTrace | None
    wall_s: float


def run_one(
    scenario: Scenario,
    policy: PolicyName,
    *,
    oracle_s: float,
    price: float,
    currency: str,
    baseline: dict[str, Any] | None,
    oracle_harvest_s: float | None = None,
) -> PolicyRun:
    started = time.perf_counter()
    with cyclic_gc_paused():  # the run, and the figures read from its large heap
        world = SimWorld(policy_variant(scenario, policy))
        trace = world.run()
        summary = summarize(
            world,
            trace,
            oracle_idle_s=oracle_s,
            oracle_harvest_s=oracle_harvest_s,
            price_per_gpu_hour=price,
            currency=currency,
            baseline=baseline,
        )
    wall = time.perf_counter() - started
    summary["wall_s"] = wall
    summary["simulated_s_per_wall_s"] = scenario.days * 86400.0 / wall if wall > 0 else None
    return PolicyRun(policy, summary, world, trace, wall)


def compare(
    scenario: Scenario, policies: Sequence[PolicyName], *, price: float = 0.0, currency: str = "USD"
) -> list[PolicyRun]:
    """Every policy in `policies`, in that order, on the same scenario (see the module docstring)."""
    duration = scenario.days * 86400.0
    oracle_s = oracle_idle_gpu_seconds(scenario.services, scenario.pool_gpus, duration)
    harvest_s = oracle_harvest_gpu_seconds(
        scenario.services, scenario.pool_gpus, duration, scenario.jobs, scenario.steps.restart_s
    )
    spells = idle_in_spells_gpu_hours(scenario.services, scenario.pool_gpus, duration)
    none = run_one(scenario, "none", oracle_s=oracle_s, price=price, currency=currency, baseline=None)
    base = baseline_figures(none.summary)
    runs: list[PolicyRun] = []
    for policy in policies:
        if policy == "none":
            runs.append(none)
        elif policy == "oracle":
            summary = oracle_summary(none.summary, oracle_s, harvest_s)
            summary["baseline_none"] = base
            summary["slo_violation_minutes"] = base["slo_violation_minutes"]
            runs.append(PolicyRun("oracle", summary, None, None, 0.0))
        else:
            runs.append(
                run_one(
                    scenario,
                    policy,
                    oracle_s=oracle_s,
                    oracle_harvest_s=harvest_s,
                    price=price,
                    currency=currency,
                    baseline=base,
                )
            )
    for run in runs:
        run.summary["oracle_idle_gpu_hours_in_spells"] = dict(spells)
    return runs


def simulate(
    scenario: Scenario, policy: PolicyName, *, price: float = 0.0, currency: str = "USD"
) -> PolicyRun:
    return compare(scenario, [policy], price=price, currency=currency)[0]
