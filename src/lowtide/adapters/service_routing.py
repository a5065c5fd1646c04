"""One service manager over several: each service's replicas go to the manager that runs them.

Used by `wiring` when some services run as local processes (`adapters.local_services`) and
others as pods of a Kubernetes Deployment (`adapters.k8s_services`): `services[].manager` picks
one per service. A replica id is ``<service>/<slot>``, so every call is routed by its service.
Must not: decide anything, or change what the managers report (events are passed on as they
come, in the managers' order).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from lowtide.control.inference_ports import KillsReplicas, ReplicaEvent, ReplicaLaunch, ServiceManager
from lowtide.domain.services import ParkMode


@runtime_checkable
class ForgetsReplicas(Protocol):
    """A manager that can stop tracking its replicas and leave them running (a control plane
    that lost its lease hands them to the next leader)."""

    def forget(self) -> None: ...


class RoutedServiceManager:
    """`ServiceManager` that sends each service to its own manager (`by_service`)."""

    def __init__(self, by_service: Mapping[str, ServiceManager]) -> None:
        if not by_service:
            raise ValueError("no services to route")
        self._by_service = dict(by_service)
        self._managers: list[ServiceManager] = []
        for m in self._by_service.values():
            if all(m is not seen for seen in self._managers):
                self._managers.append(m)

    def _for(self, replica_id: str) -> ServiceManager:
        service = replica_id.rsplit("/", 1)[0]
        manager = self._by_service.get(service)
        if manager is None:
            raise ValueError(f"replica {replica_id}: service {service!r} has no manager")
        return manager

    def start(self, launch: ReplicaLaunch, now: float) -> None:
        self._for(launch.replica_id).start(launch, now)

    def park(self, replica_id: str, mode: ParkMode, now: float) -> None:
        self._for(replica_id).park(replica_id, mode, now)

    def unpark(self, replica_id: str, now: float) -> None:
        self._for(replica_id).unpark(replica_id, now)

    def poll(self, now: float) -> list[ReplicaEvent]:
        return [e for m in self._managers for e in m.poll(now)]

    def url(self, replica_id: str) -> str | None:
        return self._for(replica_id).url(replica_id)

    def adopt(self, replica_id: str, launch: ReplicaLaunch, now: float) -> bool:
        return self._for(replica_id).adopt(replica_id, launch, now)

    def reap_orphans(self, known_ids: set[str]) -> list[str]:
        return [rid for m in self._managers for rid in m.reap_orphans(known_ids)]

    def kill(self, replica_id: str, now: float, reason: str) -> None:
        """End a hung replica now where its manager can (`KillsReplicas`), else stop it."""
        manager = self._for(replica_id)
        if isinstance(manager, KillsReplicas):
            manager.kill(replica_id, now, reason)
        else:
            manager.park(replica_id, "stop", now)

    def forget(self) -> None:
        """Stop watching every replica (they keep running) in the managers that can."""
        for m in self._managers:
            if isinstance(m, ForgetsReplicas):
                m.forget()

    def close(self) -> None:
        for m in self._managers:
            m.close()
