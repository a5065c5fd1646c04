"""The gateway's routing table and its Prometheus metrics: which replica takes the next request.

`GatewayRouter` implements the `Gateway` port (`control/inference_ports.py`) in-process; in
production it lives in the gateway process (`gateway_process`), and lowtide reads what it counts
through `gateway_supervisor`. Per service it keeps
the live backend set (`replica id -> base URL`, replaced wholesale by `set_backends`) and a counter
of requests in flight per replica, including replicas that were removed but still finish requests
(draining). The control loop calls it from its own thread while the proxy (`gateway_app`) calls
`acquire`/`release` from the gateway's event loop, so every access holds one `threading.Lock`; no
method blocks or awaits while holding it.

Choice of backend: the live backend with the fewest requests in flight; among equals, the one
picked least recently (a backend never picked yet comes first, then the lowest replica id). Equal
load therefore rotates round robin, and the choice is a deterministic function of the calls made
(and of the clock, for the next rule). A backend that refused a connection (`connect_failed`) is
passed over for `connect_cooldown_s` while another one can take the request, so a replica that died
costs one refused connection, not one per request, until the control loop takes it out; if only
such backends are left they are tried anyway (better a retry than a 503).
Upstream failures in a row are counted per live replica (`upstream_failed`, reset by
`upstream_answered`); the control loop reads them through the `Gateway` port as one of the signals
that a replica is hung (vLLM's `/health` stays 200 while its engine is stuck).
Draining: once `set_backends` has returned without a replica, no `acquire` can return it; every
request that got it earlier is already counted, so `in_flight(service, replica)` only counts down
from then on and 0 means the replica may be parked.
Held requests (scale from zero, docs/architecture.md §4.2): while a service has no live replica
the proxy holds its requests (`gateway_app`) and counts them here (`held_begin` / `held_end`);
the control loop reads `held(service)` through the `Gateway` port as demand, and `on_held` (the
loop's `wake`, or in the gateway process an immediate status write) is called when a request
starts waiting so that the next tick comes at once.
`set_backends` with at least one live replica calls the service's listeners (`listen`): the proxy
then releases what it holds (no polling).

Neighbours: `gateway_app` (the ASGI proxy that acquires and releases), `gateway` (the server
that runs it). Must not: do I/O, decide which replicas should serve (the control loop does), or
hold the lock across anything slow.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

NO_REPLICA = "none"  # the `replica` label of requests answered without any backend

# Generations take from milliseconds (a cached short answer) to minutes (long streams).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True, slots=True)
class Pick:
    """A backend chosen for one request; its in-flight count includes that request until released."""

    replica_id: str
    url: str  # base URL without a trailing slash


@dataclass(slots=True)
class _Service:
    live: dict[str, str] = field(default_factory=dict)  # replica id -> base URL
    in_flight: dict[str, int] = field(default_factory=dict)  # live or draining; no zero entries
    last_pick: dict[str, int] = field(default_factory=dict)  # live replicas only
    cooling: dict[str, float] = field(default_factory=dict)  # live replica -> passed over until then
    failing: dict[str, int] = field(default_factory=dict)  # live replica -> upstream failures in a row
    held: int = 0  # requests waiting for a live replica (no replica could take them yet)
    listeners: list[Callable[[], None]] = field(default_factory=list)  # told when replicas go live


class GatewayRouter:
    """Routing state for every service of the gateway; thread-safe. Implements the `Gateway` port."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        connect_cooldown_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        on_held: Callable[[], None] | None = None,
    ) -> None:
        self.connect_cooldown_s = connect_cooldown_s
        self._clock = clock
        self._on_held = on_held
        self._lock = threading.Lock()
        self._services: dict[str, _Service] = {}
        self._picks = 0
        self.metrics = GatewayMetrics(self, registry if registry is not None else CollectorRegistry())

    # -- the Gateway port (control loop side) -------------------------------------------------

    def set_backends(self, service: str, backends: Mapping[str, str]) -> None:
        """Replace the replicas that take new requests; removed ones keep serving what they have."""
        live = {replica: url.rstrip("/") for replica, url in backends.items()}
        with self._lock:
            state = self._services.setdefault(service, _Service())
            # A replica back at another address is a new process: its old refusals do not count.
            state.cooling = {r: t for r, t in state.cooling.items() if state.live.get(r) == live.get(r)}
            state.failing = {r: n for r, n in state.failing.items() if state.live.get(r) == live.get(r)}
            state.live = live
            state.last_pick = {r: n for r, n in state.last_pick.items() if r in live}
            listeners = tuple(state.listeners) if live else ()
        for listener in listeners:  # outside the lock: a listener only posts to its event loop
            listener()

    def in_flight(self, service: str, replica_id: str) -> int:
        """Requests that replica is still serving through the gateway (0 for unknown ones)."""
        with self._lock:
            state = self._services.get(service)
            return state.in_flight.get(replica_id, 0) if state else 0

    def upstream_failures(self, service: str, replica_id: str) -> int:
        """Requests in a row that failed on that live replica (timeouts, refused connections,
        broken answers); reset by an answer and when it leaves the live set or changes address."""
        with self._lock:
            state = self._services.get(service)
            return state.failing.get(replica_id, 0) if state else 0

    def held(self, service: str) -> int:
        """Requests the gateway holds for `service` because no replica can take them yet."""
        with self._lock:
            state = self._services.get(service)
            return state.held if state else 0

    # -- introspection --------------------------------------------------------------------------

    def services(self) -> list[str]:
        with self._lock:
            return sorted(self._services)

    def backends(self, service: str) -> dict[str, str]:
        """The live backends of a service (`replica id -> base URL`)."""
        with self._lock:
            state = self._services.get(service)
            return dict(state.live) if state else {}

    def draining(self, service: str) -> dict[str, int]:
        """Replicas removed from the live set that still have requests in flight, with their counts."""
        with self._lock:
            state = self._services.get(service)
            if state is None:
                return {}
            return {r: n for r, n in state.in_flight.items() if r not in state.live}

    def held_all(self) -> dict[str, int]:
        """`service -> held requests` for every service the router knows (0 included)."""
        with self._lock:
            return {service: state.held for service, state in self._services.items()}

    def in_flight_all(self) -> dict[str, dict[str, int]]:
        """`service -> replica -> in flight` for every live or draining replica (live ones even at 0)."""
        with self._lock:
            return {
                service: {**dict.fromkeys(state.live, 0), **state.in_flight}
                for service, state in self._services.items()
            }

    # -- the proxy side -------------------------------------------------------------------------

    def acquire(self, service: str, exclude: Iterable[str] = ()) -> Pick | None:
        """Choose a live backend not in `exclude` and count the request on it; None if there is none."""
        excluded = set(exclude)
        with self._lock:
            state = self._services.get(service)
            if state is None:
                return None
            now = self._clock() if state.cooling else 0.0
            best: tuple[bool, int, int, str] | None = None
            for replica in state.live:
                if replica in excluded:
                    continue
                key = (
                    state.cooling.get(replica, 0.0) > now,
                    state.in_flight.get(replica, 0),
                    state.last_pick.get(replica, -1),
                    replica,
                )
                if best is None or key < best:
                    best = key
            if best is None:
                return None
            replica = best[3]
            self._picks += 1
            state.last_pick[replica] = self._picks
            state.in_flight[replica] = state.in_flight.get(replica, 0) + 1
            return Pick(replica, state.live[replica])

    def others(self, service: str, exclude: Iterable[str]) -> int:
        """How many live backends are not in `exclude` (could take a retried request)."""
        excluded = set(exclude)
        with self._lock:
            state = self._services.get(service)
            return sum(1 for r in state.live if r not in excluded) if state else 0

    def upstream_failed(self, service: str, replica_id: str) -> None:
        """A request failed on that replica (the control loop reads the count: a replica whose
        requests keep failing is hung, `policy.inference.hung_replicas`)."""
        with self._lock:
            state = self._services.get(service)
            if state is not None and replica_id in state.live:
                state.failing[replica_id] = state.failing.get(replica_id, 0) + 1

    def upstream_answered(self, service: str, replica_id: str) -> None:
        """That replica answered (any status): its failures in a row end."""
        with self._lock:
            state = self._services.get(service)
            if state is not None and state.failing:
                state.failing.pop(replica_id, None)

    def connect_failed(self, service: str, replica_id: str) -> None:
        """That replica refused a connection (or did not accept in time): pass it over for a while."""
        with self._lock:
            state = self._services.get(service)
            if state is not None and replica_id in state.live:
                state.cooling[replica_id] = self._clock() + self.connect_cooldown_s

    def listen(self, service: str, listener: Callable[[], None]) -> None:
        """Call `listener` (from the caller of `set_backends`, without the lock held) each time
        `service` is given at least one live replica."""
        with self._lock:
            self._services.setdefault(service, _Service()).listeners.append(listener)

    def held_begin(self, service: str) -> None:
        """A request of `service` starts waiting for a live replica."""
        with self._lock:
            self._services.setdefault(service, _Service()).held += 1
        if self._on_held is not None:
            self._on_held()

    def held_end(self, service: str) -> None:
        """A held request stopped waiting (a replica took it, it timed out, or its client left)."""
        with self._lock:
            state = self._services.get(service)
            if state is not None and state.held > 0:
                state.held -= 1

    def release(self, service: str, replica_id: str) -> None:
        """The request `acquire` counted on that replica is over (answered, failed or abandoned)."""
        with self._lock:
            state = self._services.get(service)
            if state is None or replica_id not in state.in_flight:
                return
            left = state.in_flight[replica_id] - 1
            if left > 0:
                state.in_flight[replica_id] = left
            else:
                del state.in_flight[replica_id]  # a drained replica is forgotten here


class GatewayMetrics:
    """The gateway's own Prometheus metrics, in their own registry (never the process default).

    - `lowtide_gateway_requests_total{service,replica,code}`: answered requests by the status the
      client got (`replica="none"` when no backend took it; `code="499"` when the client went away
      before the response was complete).
    - `lowtide_gateway_in_flight{service,replica}`: read from the router at scrape time; live
      replicas appear at 0, draining ones until they reach 0.
    - `lowtide_gateway_request_duration_seconds{service}`: from the request's arrival to the last
      byte of its response (whole streams included).
    - `lowtide_gateway_upstream_errors_total{service,replica,kind}`: `connect` / `connect_timeout`
      (nothing was sent; retried on another replica), `timeout` (no answer within the read
      timeout: 504), `protocol` (the backend failed before answering: 502), `stream` (it failed
      after the response began; the client's stream is cut), `unavailable` (it answered 503, e.g.
      vLLM's full queue, and the request was retried on another replica).
    - `lowtide_gateway_no_backend_total{service}`: requests answered 503 because no replica could
      take them (the hold queue full, a held request past its timeout, or every replica refused).
    - `lowtide_gateway_held{service}`: requests held now because the service has no live replica
      (scale from zero); read from the router at scrape time.
    """

    def __init__(self, router: GatewayRouter, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "lowtide_gateway_requests_total",
            "Requests answered by the gateway, by replica and HTTP status sent to the client.",
            ["service", "replica", "code"],
            registry=registry,
        )
        self.duration = Histogram(
            "lowtide_gateway_request_duration_seconds",
            "Time from a request's arrival to the end of its response, streams included.",
            ["service"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.upstream_errors = Counter(
            "lowtide_gateway_upstream_errors_total",
            "Failures talking to a replica (connect, connect_timeout, timeout, protocol, stream).",
            ["service", "replica", "kind"],
            registry=registry,
        )
        self.no_backend = Counter(
            "lowtide_gateway_no_backend_total",
            "Requests answered 503 because no replica of the service could take them.",
            ["service"],
            registry=registry,
        )
        registry.register(_InFlightCollector(router))

    def text(self, service: str | None = None) -> bytes:
        """Prometheus text exposition: every series, or only those labelled with `service`."""
        if service is None:
            return generate_latest(self.registry)
        return generate_latest(_OneService(self.registry, service))


class _InFlightCollector(Collector):
    def __init__(self, router: GatewayRouter) -> None:
        self._router = router

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            "lowtide_gateway_in_flight",
            "Requests in flight per replica, live or draining.",
            labels=["service", "replica"],
        )
        for service, replicas in sorted(self._router.in_flight_all().items()):
            for replica, count in sorted(replicas.items()):
                family.add_metric([service, replica], count)
        yield family
        held = GaugeMetricFamily(
            "lowtide_gateway_held",
            "Requests held because the service has no live replica yet (scale from zero).",
            labels=["service"],
        )
        for service, count in sorted(self._router.held_all().items()):
            held.add_metric([service], count)
        yield held

    def describe(self) -> Iterable[Metric]:
        # Without describe(), registering would call collect() (harmless, but it takes the lock).
        yield GaugeMetricFamily("lowtide_gateway_in_flight", "", labels=["service", "replica"])
        yield GaugeMetricFamily("lowtide_gateway_held", "", labels=["service"])


class _OneService(Collector):
    """A view of a registry that keeps only the samples labelled with one service."""

    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self._registry = registry
        self._service = service

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            view = Metric(family.name, family.documentation, family.type, family.unit)
            view.samples = [s for s in family.samples if s.labels.get("service") == self._service]
            yield view
