"""The immutable inputs the inference half of a tick decides on (docs/architecture.md §4.2).

Role: what `policy.inference.decide_inference` (and `policy.reclaim_phases` inside it) needs to
know, as values: `now`, the nodes, each service's spec and its timeouts, the replicas (after this
tick's service-manager events), each service's signals and what the gateway still has in flight
(and the upstream failures in a row it saw per replica, and the requests it holds per service
because no replica could take them),
the step side's running steps, the open reclaims with their victims' notice and end times, and
`InferenceMemory`: what the decisions remember from one tick to the next (scale states, needed
history, forecast profiles, surge times, alert texts, when each service's data was last fresh).
Neighbours: `control.inference` observes the store and the ports and builds it once per tick;
`policy.replicas.ReplicaView` is the replica value (the store's record less its message).
Must not: hold references to the store, ports or anything mutable; read the clock (`now` is a
field); decide anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from lowtide.domain.gpus import Node
from lowtide.domain.metrics import ServiceSignals
from lowtide.domain.services import LendingPolicy, ServiceSpec
from lowtide.policy.autoscale import ScaleState, initial_state
from lowtide.policy.forecast import WeeklyProfile
from lowtide.policy.replicas import ReplicaView
from lowtide.policy.snapshot import RunningStep


@dataclass(frozen=True, slots=True)
class ServiceRules:
    """A service as the inference decisions see it: its spec and the times that bound it."""

    spec: ServiceSpec
    drain_timeout_s: float = 30.0
    reclaim_grace_s: float = 60.0  # the longest notice a research step gets when it reclaims
    base_port: int = 0  # slot s serves on base_port + s
    #: A SERVING or DRAINING replica whose own metrics have failed (or stood frozen with requests
    #: in flight) for this long is hung: out of routing and restarted (None: never).
    hung_after_s: float | None = None
    #: No gateway counts this service's requests: a draining replica has drained when its own
    #: metrics say nothing runs or waits (unknown or stale: not yet; the drain timeout still parks).
    drain_from_metrics: bool = False

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True, slots=True)
class ReclaimFact:
    """An OPEN reclaim as the store recorded it, with (notice_at, ended_at) of each victim the
    store knows (either None while it has not happened)."""

    id: int
    service: str | None
    replica_id: str | None
    decided_at: float
    notice_at: float | None
    freed_at: float | None
    victim_times: tuple[tuple[float | None, float | None], ...] = ()


@dataclass(frozen=True, slots=True)
class InferenceMemory:
    """What the inference decisions carry from one tick to the next; each decision returns the
    next one. Every mapping is keyed by service name (a missing key: nothing remembered)."""

    scale_states: Mapping[str, ScaleState] = field(default_factory=dict)
    #: (time, needed replicas) of the ticks with known load within the growth slope's window.
    needed_history: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    profiles: Mapping[str, WeeklyProfile] = field(default_factory=dict)  # mode `forecast` only
    #: When each service began to want replicas it has not got (a reclaim's "detected" time).
    surge_at: Mapping[str, float] = field(default_factory=dict)
    alerts: Mapping[str, str] = field(default_factory=dict)  # the alert raised and not yet cleared
    fresh_at: Mapping[str, float | None] = field(default_factory=dict)  # data last trustworthy at

    @classmethod
    def start(cls, services: tuple[ServiceRules, ...]) -> InferenceMemory:
        """The memory before the first tick."""
        return cls(
            scale_states={s.name: initial_state(s.spec) for s in services},
            needed_history={s.name: () for s in services},
        )


@dataclass(frozen=True, slots=True)
class InferenceSnapshot:
    now: float
    nodes: tuple[Node, ...]
    services: tuple[ServiceRules, ...]  # in configured order
    lending: LendingPolicy
    #: Every replica the store knows, by service and slot, after this tick's events.
    replicas: tuple[ReplicaView, ...]
    #: Per service: its signals this tick (no source or nothing serving: empty, `at` = now).
    signals: Mapping[str, ServiceSignals]
    running: tuple[RunningStep, ...]  # the step side's attempts that hold GPUs now
    reclaims: tuple[ReclaimFact, ...] = ()  # the OPEN reclaims
    memory: InferenceMemory = field(default_factory=InferenceMemory)
    #: Requests the gateway still has on a replica (by replica id; absent: 0).
    in_flight: Mapping[str, int] = field(default_factory=dict)
    #: Upstream failures in a row the gateway saw on a replica (timeouts, refused connections,
    #: broken answers; by replica id; absent: 0; reset by any answer).
    upstream_failures: Mapping[str, int] = field(default_factory=dict)
    #: Requests the gateway holds because the service has no live replica (by service name;
    #: absent: 0). Demand: a service holding requests gets at least one replica.
    held: Mapping[str, int] = field(default_factory=dict)
