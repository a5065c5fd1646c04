"""Ports of the inference side: metrics sources, the service manager and the gateway.

Implemented by `adapters.metrics_sources` (direct scrape or PromQL), `adapters.local_services`
(local vLLM / emulator processes; a Kubernetes scaler later) and `adapters.gateway_supervisor`
(the gateway process; `adapters.gateway_router` in-process). The loop
owns every decision; these only observe and carry out. Errors are classified at their edge:
a metrics failure becomes a stale/unknown signal, never an exception out of `collect`.
Must not: contain implementations or decide anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from lowtide.domain.metrics import ServiceSignals
from lowtide.domain.services import ParkMode


class MetricsSource(Protocol):
    def collect(self, service: str, replicas: Mapping[str, str], now: float) -> ServiceSignals:
        """Signals for each replica (`replica id -> base URL`, e.g. http://127.0.0.1:8101).
        Never raises: failures come back as stale signals or `source_error`."""
        ...


@dataclass(frozen=True, slots=True)
class ReplicaLaunch:
    replica_id: str  # "<service>/<slot>"
    service: str
    model: str
    node: str
    gpus: tuple[int, ...]
    port: int
    command: tuple[str, ...]  # already rendered ({model}, {port}, {gpus} filled in)
    env: Mapping[str, str]  # includes CUDA_VISIBLE_DEVICES
    work_dir: str
    log_path: str
    health_timeout_s: float  # FAILED if not healthy within this
    sleep_level: int = 1  # vLLM sleep level for park "sleep" (2: the wake reloads the weights)


ReplicaEventKind = Literal["healthy", "asleep", "stopped", "failed"]


@dataclass(frozen=True, slots=True)
class ReplicaEvent:
    replica_id: str
    kind: ReplicaEventKind
    at: float
    detail: str = ""


class ServiceManager(Protocol):
    def start(self, launch: ReplicaLaunch, now: float) -> None:
        """Start (or restart) a replica; `poll` reports `healthy` once /health answers."""
        ...

    def park(self, replica_id: str, mode: ParkMode, now: float) -> None:
        """`sleep`: POST /sleep?level=1 (weights to host RAM; the process stays); `stop`: graceful
        stop of the process. `poll` reports `asleep` / `stopped` when done."""
        ...

    def unpark(self, replica_id: str, now: float) -> None:
        """Wake a sleeping replica (POST /wake_up) or start a stopped one again; `poll` reports
        `healthy` when it serves."""
        ...

    def poll(self, now: float) -> list[ReplicaEvent]:
        """What happened since the last poll (health reached, parked, died, timed out)."""
        ...

    def url(self, replica_id: str) -> str | None:
        """The replica's base URL while it exists, as the manager reaches it (a loopback port for
        the local manager, a pod address in a cluster); None when it has none. The control code
        never builds an address itself (docs/architecture.md §5)."""
        ...

    def adopt(self, replica_id: str, launch: ReplicaLaunch, now: float) -> bool:
        """Re-attach to a replica an earlier control plane started (True), or report it gone."""
        ...

    def reap_orphans(self, known_ids: set[str]) -> list[str]:
        """Kill replica processes of this installation that no record knows; returns their ids."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class KillsReplicas(Protocol):
    """A service manager that can end a hung replica at once (the local one can). Optional: with a
    manager without it (the simulator's), a hung replica is stopped by `park(..., "stop", ...)`."""

    def kill(self, replica_id: str, now: float, reason: str) -> None:
        """SIGKILL the replica's processes now (a SIGSTOPped or stuck process ignores SIGTERM);
        `poll` reports `failed` with `reason` once they are gone."""
        ...


class Gateway(Protocol):
    def set_backends(self, service: str, backends: Mapping[str, str]) -> None:
        """The replicas that take new requests now (`replica id -> base URL`)."""
        ...

    def in_flight(self, service: str, replica_id: str) -> int:
        """Requests still being served by that replica (for draining)."""
        ...

    def upstream_failures(self, service: str, replica_id: str) -> int:
        """Requests in a row that failed on that replica at the gateway (timeouts, refused
        connections, broken answers); any answer resets it, and so does leaving the live set."""
        ...

    def held(self, service: str) -> int:
        """Requests the gateway holds for `service` because no replica can take them yet (scale
        from zero: they are demand, `policy.inference.held_floor`)."""
        ...
