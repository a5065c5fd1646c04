"""What a simulation runs: the fleet, its services and their load, the lending policy, the jobs.

A `Scenario` is a plain value: `sim.fleet` builds one from trace specs or a cluster file, and
`sim.world` runs it. `policy_variant` turns one scenario into the variant a lending policy name
asks for (`none`, `window`, `continuous`, `forecast`), so a comparison runs every policy on the
same fleet, load and jobs. Must not: run anything, read files or the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lowtide.control.inference import ServiceSetup
from lowtide.domain.gpus import Node
from lowtide.domain.services import LendingPolicy, TimeWindow
from lowtide.policy.fairshare import FairSharePolicy
from lowtide.policy.scheduler import SchedulerPolicy
from lowtide.sim.capacity import ReplicaCapacity
from lowtide.sim.jobs import ResearchJob
from lowtide.sim.load import LoadCurve
from lowtide.sim.policies import PolicyName
from lowtide.sim.ports import ReplicaTimes

#: The seed's night lending window, used by `window` when the scenario names none.
DEFAULT_WINDOW = TimeWindow(20 * 60, 8 * 60)


@dataclass(frozen=True)
class SimService:
    """An inference service as simulated: how lowtide runs it plus what the world does to it."""

    setup: ServiceSetup
    capacity: ReplicaCapacity  # one replica's capacity (the capacity model's parameters)
    curve: LoadCurve  # its request rate over time
    times: ReplicaTimes  # cold start, wake, park durations
    slo_ttft_p90_s: float  # a minute is a violation when the modelled TTFT p90 exceeds this
    #: The trace's rates were multiplied by this to fill the fleet (`sim.fleet.fit_load`; 1: as given).
    load_scale: float = 1.0

    @property
    def name(self) -> str:
        return self.setup.spec.name


@dataclass(frozen=True)
class StepDefaults:
    """How simulated research steps behave (the job traces give only size and duration)."""

    grace_s: float = 120.0
    restart_s: float = 120.0
    checkpoint_every_s: float = 1800.0
    checkpoint_write_s: float = 20.0


@dataclass(frozen=True)
class Scenario:
    nodes: tuple[Node, ...]
    services: tuple[SimService, ...]
    lending: LendingPolicy
    jobs: tuple[ResearchJob, ...]
    start: float  # epoch seconds of t = 0 (local midnight of day 1 in the lending time zone)
    days: float
    steps: StepDefaults = field(default_factory=StepDefaults)
    scheduler: SchedulerPolicy = field(default_factory=lambda: SchedulerPolicy(FairSharePolicy()))
    tick_s: float = 2.0  # the production tick: how soon the loop looks again after something moved
    max_gap_s: float = 300.0  # the longest the simulator jumps without a tick
    window: tuple[TimeWindow, ...] = (DEFAULT_WINDOW,)
    policy: PolicyName = "continuous"
    seed: int = 0

    @property
    def end(self) -> float:
        return self.start + self.days * 86400.0

    @property
    def pool_gpus(self) -> int:
        return sum(n.gpu_count for n in self.nodes)


def policy_variant(scenario: Scenario, policy: PolicyName) -> Scenario:
    """The scenario as `policy` runs it.

    `none` is the service's baseline without lowtide: every service pinned at `max_replicas`
    (provisioned for peak, as before lending) and nothing lent. `window` lends only inside the
    scenario's windows; `continuous` whenever the envelope allows; `forecast` adds the learned
    weekly profile. `oracle` is not a loop run (see `sim.oracle`); it keeps the scenario as is.
    """
    lending = scenario.lending
    services = scenario.services
    if policy == "none":
        lending = replace(lending, mode="window", windows=())
        services = tuple(
            replace(
                s,
                setup=replace(s.setup, spec=replace(s.setup.spec, min_replicas=s.setup.spec.max_replicas)),
            )
            for s in services
        )
    elif policy == "window":
        lending = replace(lending, mode="window", windows=scenario.window)
    elif policy in ("continuous", "forecast"):
        lending = replace(lending, mode=policy)
    return replace(scenario, lending=lending, services=services, policy=policy)
