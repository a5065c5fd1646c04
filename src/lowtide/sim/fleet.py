"""Build a `Scenario` from what a user gives `lowtide simulate`: a load, jobs, a cluster, a policy.

Without `--cluster` the fleet is the default of `lowtide simulate`: `nodes` × `gpus_per_node`
GPUs, one service of 4-GPU replicas with as many replicas as the pool holds, sized so that the
busiest 10-minute window of the load needs every replica but one headroom replica; the
per-replica capacity is derived from the load (`sim.capacity.derive_replica_capacity`). A trace
too light for the fleet (its busiest window would need every replica only if each ran slower than
the emulator's engine: a few requests per second over 63 replicas) is scaled up instead, by the
factor that fills the fleet at engine speed (`fit_load`, recorded as the service's `load_scale`):
slowing the replicas by that factor gives the autoscaler the same concurrency, but stretches
every request to minutes, so TTFT would exceed any real SLO even with every replica up and the
per-stretch steady state of the capacity model would stop holding (docs/architecture.md §9.2). With
`--cluster FILE` (lowtide.yaml's own format: `nodes`, `services`, `lending`, `scheduler`), the
nodes must declare their GPUs, each service's `simulation:` section may give its replica
capacity (else it is derived the same way, at the service's `max_replicas − headroom`), and the
load is split evenly over the services unless a service sets `simulation.load_share`.
Neighbours: `cli.simulate_cmd` (the command), `sim.scenario`, `sim.load`, `sim.jobs`.
Must not: run the simulation or write files.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

from lowtide.config import (
    ConfigError,
    Settings,
    lending_policy,
    load_settings,
    scheduler_policy,
    service_spec,
)
from lowtide.control.inference import ServiceSetup
from lowtide.domain.gpus import Node
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec
from lowtide.sim.capacity import ReplicaCapacity, derive_replica_capacity
from lowtide.sim.jobs import ResearchJob
from lowtide.sim.load import LoadCurve
from lowtide.sim.ports import ReplicaTimes
from lowtide.sim.scenario import DEFAULT_WINDOW, Scenario, SimService, StepDefaults

#: t = 0 of every trace is local midnight of this Monday (ServeGen's t = 0 is 00:00 of day 1).
EPOCH_DAY = (2026, 1, 5)
DEFAULT_GPUS_PER_REPLICA = 4
DEFAULT_SLO_TTFT_P90_S = 2.0
DEFAULT_TICK_S = 2.0


@dataclass(frozen=True)
class FleetOptions:
    nodes: int = 32
    gpus_per_node: int = 8
    gpus_per_replica: int = DEFAULT_GPUS_PER_REPLICA
    headroom_replicas: int = 1
    park: str = "sleep"
    startup_s: float = 120.0
    wake_s: float = 10.0
    reclaim_grace_s: float = 60.0
    slo_ttft_p90_s: float = DEFAULT_SLO_TTFT_P90_S


def start_epoch(timezone: str) -> float:
    y, m, d = EPOCH_DAY
    return datetime(y, m, d, tzinfo=ZoneInfo(timezone)).timestamp()


def default_scenario(
    curve: LoadCurve, jobs: tuple[ResearchJob, ...], *, days: float, seed: int, options: FleetOptions
) -> Scenario:
    """The default fleet for `curve` (see the module docstring)."""
    nodes = tuple(Node(f"node-{i:02d}", tuple(range(options.gpus_per_node))) for i in range(options.nodes))
    pool = options.nodes * options.gpus_per_node
    replicas = pool // options.gpus_per_replica
    if replicas < 2:
        raise ConfigError("the default fleet needs room for at least 2 replicas")
    targets = AutoscaleTargets(ttft_p90_slo_s=None)
    capacity, curve, load_scale = fit_load(
        curve,
        days=days,
        replicas_at_peak=replicas - options.headroom_replicas,
        target_concurrency=targets.concurrency_per_replica or 32.0,
    )
    spec = ServiceSpec(
        name="llm",
        model="servegen-m-large",
        gpus_per_replica=options.gpus_per_replica,
        min_replicas=1,
        max_replicas=replicas,
        headroom_replicas=options.headroom_replicas,
        min_safe_replicas=1,
        park="sleep" if options.park == "sleep" else "stop",
        startup_s=options.startup_s,
        wake_s=options.wake_s,
        autoscale=targets,
    )
    service = SimService(
        setup=ServiceSetup(
            spec=spec, command=("simulated",), base_port=1, reclaim_grace_s=options.reclaim_grace_s
        ),
        capacity=capacity,
        curve=curve,
        times=ReplicaTimes(startup_s=options.startup_s, wake_s=options.wake_s),
        slo_ttft_p90_s=options.slo_ttft_p90_s,
        load_scale=load_scale,
    )
    lead = DEFAULT_TICK_S + options.reclaim_grace_s + spec.unpark_s
    lending = LendingPolicy(mode="continuous", reclaim_lead_s=lead)
    return Scenario(
        nodes=nodes,
        services=(service,),
        lending=lending,
        jobs=jobs,
        start=start_epoch(lending.timezone),
        days=days,
        steps=StepDefaults(),
        tick_s=DEFAULT_TICK_S,
        seed=seed,
    )


def cluster_scenario(
    settings: Settings, curve: LoadCurve, jobs: tuple[ResearchJob, ...], *, days: float, seed: int
) -> Scenario:
    """A scenario from a lowtide.yaml (see the module docstring); ConfigError names the field."""
    nodes = []
    for i, node in enumerate(settings.nodes):
        if node.gpus == "auto":
            raise ConfigError(
                f"nodes[{i}].gpus: the simulator needs a declared GPU count or list, not 'auto'"
            )
        indices = tuple(range(node.gpus)) if isinstance(node.gpus, int) else tuple(sorted(node.gpus))
        nodes.append(Node(node.name, indices))
    if not settings.services:
        raise ConfigError("services: the simulator needs at least one inference service")
    shares = [cfg.simulation.load_share for cfg in settings.services]
    given = sum(s for s in shares if s is not None)
    missing = sum(1 for s in shares if s is None)
    if given > 1.0 + 1e-9:
        raise ConfigError("services[*].simulation.load_share: the shares add up to more than 1")
    rest = (1.0 - given) / missing if missing else 0.0
    services = []
    for i, cfg in enumerate(settings.services):
        spec = service_spec(cfg)
        share = shares[i] if shares[i] is not None else rest
        svc_curve = curve.scaled(share or 0.0)
        load_scale = 1.0
        sim = cfg.simulation
        if sim.replica_capacity_rps is not None:
            capacity = derive_replica_capacity(
                sim.replica_capacity_rps,
                svc_curve.prompt_tokens,
                svc_curve.output_tokens,
                replicas_at_peak=1,
                target_concurrency=spec.autoscale.concurrency_per_replica or 32.0,
            )
        else:
            capacity, svc_curve, load_scale = fit_load(
                svc_curve,
                days=days,
                replicas_at_peak=max(1, spec.max_replicas - spec.headroom_replicas),
                target_concurrency=spec.autoscale.concurrency_per_replica or 32.0,
            )
        slo = cfg.autoscale.ttft_p90_slo if cfg.autoscale.ttft_p90_slo is not None else sim.slo_ttft_p90
        services.append(
            SimService(
                setup=ServiceSetup(
                    spec=spec,
                    command=("simulated",),
                    base_port=cfg.base_port,
                    drain_timeout_s=cfg.drain_timeout,
                    reclaim_grace_s=cfg.reclaim_grace,
                ),
                capacity=capacity,
                curve=svc_curve,
                times=ReplicaTimes(startup_s=spec.startup_s, wake_s=spec.wake_s),
                slo_ttft_p90_s=slo,
                load_scale=load_scale,
            )
        )
    lending = lending_policy(settings)
    # Simulated nodes are not this host: `max_cpu_steps_per_node: auto` sets no limit there.
    scheduler = scheduler_policy(settings, cpus_per_node=None)
    window = lending.windows or (DEFAULT_WINDOW,)
    return Scenario(
        nodes=tuple(nodes),
        services=tuple(services),
        lending=lending,
        jobs=jobs,
        start=start_epoch(lending.timezone),
        days=days,
        scheduler=scheduler,
        tick_s=settings.tick_seconds,
        window=tuple(window),
        seed=seed,
    )


def fit_load(
    curve: LoadCurve, *, days: float, replicas_at_peak: int, target_concurrency: float
) -> tuple[ReplicaCapacity, LoadCurve, float]:
    """The replica capacity for which `replicas_at_peak` replicas carry the busiest 10-minute
    window of `curve` at `target_concurrency` each, the curve they serve, and the factor its
    rates were multiplied by (1: the trace as given). A replica is never made slower than the
    emulator's engine: when the trace is that light, its rates are scaled up by the slowdown
    instead (the module docstring says why). ValueError as `derive_replica_capacity`."""
    peak = curve.peak_window_rate(600.0, until_s=days * 86400.0)
    capacity = derive_replica_capacity(
        peak,
        curve.prompt_tokens,
        curve.output_tokens,
        replicas_at_peak=replicas_at_peak,
        target_concurrency=target_concurrency,
    )
    slowdown = (
        capacity.service_s / ReplicaCapacity.from_engine(curve.prompt_tokens, curve.output_tokens).service_s
    )
    if not slowdown > 1.0:
        return capacity, curve, 1.0
    scaled = curve.scaled(slowdown)
    capacity = derive_replica_capacity(
        scaled.peak_window_rate(600.0, until_s=days * 86400.0),
        scaled.prompt_tokens,
        scaled.output_tokens,
        replicas_at_peak=replicas_at_peak,
        target_concurrency=target_concurrency,
    )
    return capacity, scaled, slowdown


def load_cluster(path: Path) -> Settings:
    """The cluster file as settings; ConfigError names the field and the reason."""
    return load_settings(path)
