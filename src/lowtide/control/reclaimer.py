"""Taking lent GPUs back: turn what inference is missing into preemptions, and record each reclaim
phase by phase (surge detected → decision → notice → GPUs free → replica healthy).

Each tick, after the replica plan and the envelope: the replicas a service wants but cannot place
become needs (a sleeping replica needs its own GPUs back; any other needs a block of
`gpus_per_replica` on one node), research holding more than the envelope allows becomes an excess;
`policy.reclaim.plan_reclaim` picks the victims at the least cost, and each victim's step moves to
PREEMPTING with a grace of min(its job's grace, the service's `reclaim_grace`). The loop then gives
notice; when the victims have exited, the replica plan finds the GPUs free and starts or wakes the
replica. Steps that already have notice count as GPUs coming back, so nobody is preempted twice
for the same need.
Must not: read the clock (`now` comes in), signal processes (the loop's executor does), or decide
replica counts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from lowtide.control.records import ReclaimRecord, ReplicaRecord, StaleState
from lowtide.domain.gpus import GpuRef, Node
from lowtide.domain.services import ServiceSpec
from lowtide.domain.states import SUPPLY_REPLICA_STATES, ReclaimState, ReplicaState
from lowtide.policy.lending import Envelope
from lowtide.policy.reclaim import ReclaimPlan, ReclaimRequest, ReplicaNeed, RunningVictim, plan_reclaim
from lowtide.policy.replicas import ReplicaPlan
from lowtide.policy.snapshot import RunningStep

log = logging.getLogger("lowtide.reclaim")
R = ReplicaState
#: A reclaim whose replica has not become healthy this long after its GPUs were freed is abandoned.
ABANDON_AFTER_S = 900.0


class ReclaimStore(Protocol):
    def request_preemption(self, attempt_id: int, *, grace_s: float, reason: str, now: float) -> None: ...

    def open_reclaim(
        self,
        *,
        service: str | None,
        replica_id: str | None,
        reason: str,
        gpus: int,
        victims: tuple[int, ...],
        detected_at: float,
        decided_at: float,
    ) -> int: ...

    def update_reclaim(self, reclaim_id: int, **phases: object) -> None: ...

    def reclaims(self, *, state: ReclaimState | None = None, limit: int = 1000) -> list[ReclaimRecord]: ...

    def attempt_times(
        self, attempt_ids: Iterable[int]
    ) -> Mapping[int, tuple[float | None, float | None]]: ...


@dataclass
class Reclaimer:
    store: ReclaimStore
    nodes: tuple[Node, ...]
    specs: Mapping[str, ServiceSpec]
    reclaim_grace: Mapping[str, float]
    surge_at: dict[str, float] = field(default_factory=dict)
    last_plan: ReclaimPlan | None = None
    _growing: str | None = None
    _abandon_at: float | None = None

    def tick(
        self,
        now: float,
        *,
        running: tuple[RunningStep, ...],
        replicas: Mapping[str, ReplicaRecord],
        replica_plan: ReplicaPlan,
        envelope: Envelope,
        deficits: Mapping[str, int] | None = None,
    ) -> ReclaimPlan:
        """`deficits`: replicas each service wants beyond those serving, starting or waking (a
        surge); reclaims for lending are attributed to the service with the largest one."""
        deficits = deficits or {}
        for service in list(self.surge_at):
            if deficits.get(service, 0) <= 0:
                del self.surge_at[service]  # satisfied (or no longer wanted)
        for service, missing in deficits.items():
            if missing > 0:
                self.surge_at.setdefault(service, now)
        self._growing = max(
            (s for s, d in deficits.items() if d > 0), key=lambda s: (deficits[s], s), default=None
        )
        self._track(now, replicas)
        needs = self._needs(now, replicas, replica_plan)
        active_lent = sum(len(s.gpus) for s in running if not s.stopping)
        if not needs and active_lent <= envelope.lendable_gpus:
            # Nothing is missing and nothing is over the envelope: `plan_reclaim` would choose no
            # victim, so skip building its request (the common tick).
            plan = ReclaimPlan()
            self.last_plan = plan
            return plan
        held = frozenset(g for r in replicas.values() for g in _refs(r) if r.state in _HOLDING)
        busy = held | {GpuRef(s.node, g) for s in running for g in s.gpus}
        free = frozenset(g for n in self.nodes for g in n.refs() if g not in busy)
        request = ReclaimRequest(
            now=now,
            nodes=self.nodes,
            free=free,
            running=tuple(_victim(s) for s in running),
            needs=tuple(n for n, _ in needs),
            excess_lent_gpus=max(0, active_lent - envelope.lendable_gpus),
        )
        plan = plan_reclaim(request)
        self.last_plan = plan
        if plan.victims:
            self._preempt(plan, needs, now)
        return plan

    def next_due(self, now: float) -> float | None:
        """When an open reclaim whose GPUs are free must be abandoned (None: none pending)."""
        return self._abandon_at if self._abandon_at is not None and self._abandon_at > now else None

    # -- needs ---------------------------------------------------------------------------------

    def _needs(
        self, now: float, replicas: Mapping[str, ReplicaRecord], plan: ReplicaPlan
    ) -> list[tuple[ReplicaNeed, str]]:
        """What each blocked service is missing, in replica terms, with a description."""
        out: list[tuple[ReplicaNeed, str]] = []
        blocked = {b.service: b.missing for b in plan.blocked if b.missing > 0}
        # Services below min_replicas first: they may take steps inside their min_runtime.
        order = sorted(blocked, key=lambda s: (not self._below_min(s, replicas), s))
        for service in order:
            missing = blocked[service]
            self.surge_at.setdefault(service, now)
            spec = self.specs[service]
            below = self._below_min(service, replicas)
            mine = sorted((r for r in replicas.values() if r.service == service), key=lambda r: r.slot)
            for r in mine:
                if missing == 0:
                    break
                if r.state == R.PARKED and r.parked_as == "sleep" and len(r.gpus) == spec.gpus_per_replica:
                    out.append(
                        (
                            ReplicaNeed(service, r.id, spec.gpus_per_replica, _refs(r), below),
                            f"wake {r.id} on its own GPUs",
                        )
                    )
                    missing -= 1
            for _ in range(missing):
                out.append(
                    (
                        ReplicaNeed(service, None, spec.gpus_per_replica, (), below),
                        f"start a replica of {service}",
                    )
                )
        return out

    def _below_min(self, service: str, replicas: Mapping[str, ReplicaRecord]) -> bool:
        supply = sum(r.service == service and r.state in SUPPLY_REPLICA_STATES for r in replicas.values())
        return supply < self.specs[service].min_replicas

    # -- act -----------------------------------------------------------------------------------

    def _preempt(self, plan: ReclaimPlan, needs: list[tuple[ReplicaNeed, str]], now: float) -> None:
        by_need: dict[str, list[int]] = {}
        for victim in plan.victims:
            service = victim.for_need if victim.for_need in self.specs else None
            grace = self.reclaim_grace.get(service or "", max(self.reclaim_grace.values(), default=60.0))
            try:
                self.store.request_preemption(victim.attempt_id, grace_s=grace, reason=victim.reason, now=now)
            except StaleState as exc:
                log.info("not preempting attempt %s: %s", victim.attempt_id, exc)
                continue
            by_need.setdefault(victim.for_need, []).append(victim.attempt_id)
        for target, attempt_ids in by_need.items():
            # Lending shrank because a service is growing: the reclaim is for that service.
            service = target if target in self.specs else self._growing
            replica = next((n.replica_id for n, _ in needs if n.service == service and n.replica_id), None)
            gpus = sum(len(v.gpus) for v in plan.victims if v.attempt_id in attempt_ids)
            what = next((d for n, d in needs if n.service == service), None) or (
                f"lending shrank while {service} grows" if service else "lending shrank"
            )
            self.store.open_reclaim(
                service=service,
                replica_id=replica,
                reason=f"{what}: preempting {len(attempt_ids)} step(s), {gpus} GPU(s)",
                gpus=gpus,
                victims=tuple(attempt_ids),
                detected_at=self.surge_at.get(service or "", now),
                decided_at=now,
            )

    # -- phases --------------------------------------------------------------------------------

    def _track(self, now: float, replicas: Mapping[str, ReplicaRecord]) -> None:
        """Fill in notice / freed / healthy times of open reclaims from what the store says."""
        abandon: list[float] = []
        for rec in self.store.reclaims(state=ReclaimState.OPEN):
            times = self.store.attempt_times(rec.victims)
            phases: dict[str, object] = {}
            notices = [t[0] for t in times.values()]
            ends = [t[1] for t in times.values()]
            if rec.notice_at is None and notices and all(t is not None for t in notices):
                phases["notice_at"] = max(t for t in notices if t is not None)
            if rec.freed_at is None and ends and all(t is not None for t in ends):
                phases["freed_at"] = max(t for t in ends if t is not None)
            freed_at = phases.get("freed_at", rec.freed_at)
            if rec.service is None:
                if freed_at is not None:
                    phases["state"] = ReclaimState.DONE
            elif freed_at is not None:
                healthy = [
                    r.since
                    for r in replicas.values()
                    if r.service == rec.service
                    and r.state == R.SERVING
                    and r.since >= rec.decided_at
                    and (rec.replica_id is None or r.id == rec.replica_id)
                ]
                if healthy:
                    phases["healthy_at"] = min(healthy)
                    phases["state"] = ReclaimState.DONE
                elif isinstance(freed_at, float) and now - freed_at > ABANDON_AFTER_S:
                    phases["state"] = ReclaimState.ABANDONED
                elif isinstance(freed_at, float):
                    abandon.append(freed_at + ABANDON_AFTER_S + 1.0)
            if phases:
                try:
                    self.store.update_reclaim(rec.id, **phases)
                except StaleState:
                    log.info("reclaim %s ended meanwhile; phases not recorded", rec.id)
        self._abandon_at = min(abandon, default=None)


_HOLDING = frozenset({R.STARTING, R.SERVING, R.DRAINING, R.PARKING, R.WAKING})


def _refs(r: ReplicaRecord) -> tuple[GpuRef, ...]:
    return tuple(GpuRef(r.node, i) for i in r.gpus) if r.node else ()


def _victim(s: RunningStep) -> RunningVictim:
    return RunningVictim(
        attempt_id=s.attempt_id,
        job_id=s.job_id,
        step=s.step,
        team=s.team,
        priority=s.priority,
        node=s.node,
        gpus=s.gpus,
        started_at=s.started_at,
        last_checkpoint_at=s.last_checkpoint_at,
        min_runtime_s=s.min_runtime,
        restart_s=s.restart_seconds,
        stopping=s.stopping,
    )
