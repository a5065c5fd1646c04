"""Taking lent GPUs back, as a decision: what inference is missing, which steps get notice with
which grace, which reclaims open, and how far each open reclaim has come (pure).

Role: once per tick, after the replica plan and the envelope (`policy.inference`), turn what the
services could not place into `ReplicaNeed`s, let `policy.reclaim.plan_reclaim` choose the
victims, and say what to record. Neighbours: `policy.inference` calls `decide_reclaim` with the
replicas as they are after this tick's actions; `control.reclaimer` books the result (notice
requests, reclaim records, phases); the loop's executor gives notice. Must not: read the clock
(`now` is passed), do I/O, give notice, mutate its inputs, or decide replica counts.

Rules
- Surge time: a service with a deficit (replicas it wants beyond those serving, starting or
  waking) keeps the time its deficit began (`surge_at`); a service without one forgets it. The
  growing service is the one with the largest deficit (ties: name); with no deficit left (this
  tick's replica actions already started what it wants on free GPUs, while its larger claim
  shrank lending), the one with the most replicas starting or waking (`coming_up`) while lending
  is open (a window closing or a fail safe takes GPUs back for no service), else none.
- Needs: for each service the replica plan left blocked, services below `min_replicas` first
  (they may take steps inside their `min_runtime`), then by name: each sleeping replica (PARKED as
  `sleep`, by slot) with all of its `gpus_per_replica` GPUs needs those GPUs back (`exact`); each
  other missing replica needs any block of `gpus_per_replica` GPUs on one node.
- Excess: research steps without notice holding more than the envelope's `lendable_gpus`.
- Nothing needed and no excess: no victim, and the running steps are not even converted.
- Grace: min(the victim's job grace, the service's `reclaim_grace_s`) — the store takes the
  minimum; a victim for lending gets the largest `reclaim_grace_s` of all services (60 s: none).
- A reclaim opens per need served (keyed by `Victim.for_need`), in the order of its first victim;
  one for lending belongs to the growing service, if any (none: lending shrank for no replica —
  a window closing, a growth or forecast reserve, a fail safe). Its detected time is the service's
  surge time, its replica the first need of that service naming one.
- Phases of an OPEN reclaim: notice when every victim has notice (the latest notice), freed when
  every victim has ended (the latest end); without a service it is DONE once freed (no replica
  waits, so it has no `healthy_at`); with one it is DONE, with `healthy_at`, at the first time a
  replica of that service (the one named, if any) serves since the decision, and ABANDONED when
  none does within `ABANDON_AFTER_S` of the GPUs being freed: a reclaim for a service never ends
  DONE without `healthy_at`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence, Set
from dataclasses import dataclass

from lowtide.domain.gpus import GpuRef, Node
from lowtide.domain.services import ServiceSpec
from lowtide.domain.states import (
    GPU_HOLDING_REPLICA_STATES,
    SUPPLY_REPLICA_STATES,
    ReclaimState,
    ReplicaState,
)
from lowtide.policy.inference_snapshot import ReclaimFact
from lowtide.policy.lending import Envelope
from lowtide.policy.memo import Last
from lowtide.policy.reclaim import ReclaimPlan, ReclaimRequest, ReplicaNeed, RunningVictim, plan_reclaim
from lowtide.policy.replicas import ReplicaPlan, ReplicaView
from lowtide.policy.snapshot import RunningStep

R = ReplicaState
#: A reclaim whose replica has not become healthy this long after its GPUs were freed is abandoned.
ABANDON_AFTER_S = 900.0
#: The grace of a victim for lending when no service is configured.
DEFAULT_GRACE_S = 60.0


@dataclass(frozen=True, slots=True)
class PhaseUpdate:
    """Phases to record on an OPEN reclaim: `notice_at`, `freed_at`, `healthy_at` and, to end
    it, `state` (DONE or ABANDONED), in that order, only those that changed."""

    reclaim_id: int
    phases: tuple[tuple[str, float | ReclaimState], ...]

    def values(self) -> dict[str, float | ReclaimState]:
        return dict(self.phases)


@dataclass(frozen=True, slots=True)
class Preemption:
    """Notice to request for one victim (the store moves its step to PREEMPTING)."""

    attempt_id: int
    grace_s: float
    reason: str
    for_need: str  # `Victim.for_need`: the need's service, or "lending"
    service: str | None  # the service the GPUs are for (None: lending shrank)


@dataclass(frozen=True, slots=True)
class ReclaimOpening:
    """A reclaim record to open for the victims of one need."""

    service: str | None
    replica_id: str | None
    what: str  # what inference is missing, e.g. "start a replica of chat"
    victims: tuple[tuple[int, int], ...]  # (attempt id, GPUs it holds), in plan order
    detected_at: float
    decided_at: float

    @property
    def attempt_ids(self) -> tuple[int, ...]:
        return tuple(a for a, _ in self.victims)

    @property
    def gpus(self) -> int:
        return sum(g for _, g in self.victims)

    @property
    def reason(self) -> str:
        return f"{self.what}: preempting {len(self.victims)} step(s), {self.gpus} GPU(s)"


@dataclass(frozen=True, slots=True)
class ReclaimDecision:
    plan: ReclaimPlan  # the victims and why (empty on the common tick)
    needs: tuple[tuple[ReplicaNeed, str], ...]  # what is missing, with a description
    preemptions: tuple[Preemption, ...]
    phases: tuple[PhaseUpdate, ...]
    surge_at: Mapping[str, float]  # the memory for the next tick
    growing: str | None  # the service with the largest deficit
    decided_at: float
    abandon_at: float | None = None  # the earliest time an open reclaim is to be abandoned

    def openings(self, preempted: Collection[int] | None = None) -> tuple[ReclaimOpening, ...]:
        """The reclaims to open once the preemptions are booked: only the victims in `preempted`
        (None: all of them) count; a need none of whose victims was preempted opens none."""
        by_need: dict[str, list[tuple[int, int]]] = {}
        for p, v in zip(self.preemptions, self.plan.victims, strict=True):
            if preempted is None or p.attempt_id in preempted:
                by_need.setdefault(p.for_need, []).append((v.attempt_id, len(v.gpus)))
        out = []
        services = {p.for_need: p.service for p in self.preemptions}
        for target, victims in by_need.items():
            # Lending shrank because a service is growing: the reclaim is for that service.
            service = services[target] if services[target] is not None else self.growing
            replica = next(
                (n.replica_id for n, _ in self.needs if n.service == service and n.replica_id), None
            )
            what = next((d for n, d in self.needs if n.service == service), None) or (
                f"lending shrank while {service} grows" if service else "lending shrank"
            )
            out.append(
                ReclaimOpening(
                    service=service,
                    replica_id=replica,
                    what=what,
                    victims=tuple(victims),
                    detected_at=self.surge_at.get(service or "", self.decided_at),
                    decided_at=self.decided_at,
                )
            )
        return tuple(out)


def decide_reclaim(
    *,
    now: float,
    nodes: tuple[Node, ...],
    specs: Mapping[str, ServiceSpec],
    reclaim_grace: Mapping[str, float],
    running: tuple[RunningStep, ...],
    replicas: Sequence[ReplicaView],
    replica_plan: ReplicaPlan,
    envelope: Envelope,
    deficits: Mapping[str, int],
    surge_at: Mapping[str, float],
    reclaims: Sequence[ReclaimFact] = (),
    step_gpus: Mapping[str, Set[int]] | None = None,
    active_lent: int | None = None,
) -> ReclaimDecision:
    """This tick's reclaim decision; see the module docstring. `replicas`: as they are after this
    tick's replica actions. `step_gpus` (the running steps' GPU indices per node) and
    `active_lent` (GPUs of the running steps without notice): when the caller has them already."""
    surge = {s: t for s, t in surge_at.items() if deficits.get(s, 0) > 0}  # satisfied: forgotten
    for service, missing in deficits.items():
        if missing > 0:
            surge.setdefault(service, now)
    growing = max((s for s, d in deficits.items() if d > 0), key=lambda s: (deficits[s], s), default=None)
    if growing is None and envelope.lending_open:  # closed (window, fail safe): shrank for no service
        growing = coming_up(replicas)
    phases, abandon_at = track_reclaims(now, reclaims, replicas)
    needs = replica_needs(specs, replicas, replica_plan)
    for need, _ in needs:
        surge.setdefault(need.service, now)
    if active_lent is None:
        active_lent = sum(len(s.gpus) for s in running if not s.stopping)
    plan = _NO_RECLAIM
    if needs or active_lent > envelope.lendable_gpus:
        # Only now are the running steps worth converting: on the common tick nothing is missing
        # and nothing is over the envelope, so `plan_reclaim` would choose no victim.
        request = ReclaimRequest(
            now=now,
            nodes=nodes,
            free=free_gpus(nodes, replicas, running, step_gpus),
            running=tuple(running_victim(s) for s in running),
            needs=tuple(n for n, _ in needs),
            excess_lent_gpus=max(0, active_lent - envelope.lendable_gpus),
        )
        plan = plan_reclaim(request)
    fallback = max(reclaim_grace.values(), default=DEFAULT_GRACE_S)
    preemptions = []
    for v in plan.victims:
        for_service = v.for_need if v.for_need in specs else None
        grace = reclaim_grace.get(for_service or "", fallback)
        preemptions.append(Preemption(v.attempt_id, grace, v.reason, v.for_need, for_service))
    return ReclaimDecision(
        plan=plan,
        needs=tuple(needs),
        preemptions=tuple(preemptions),
        phases=phases,
        surge_at=surge,
        growing=growing,
        decided_at=now,
        abandon_at=abandon_at,
    )


_COMING_UP = frozenset({R.STARTING, R.WAKING})
_NO_RECLAIM = ReclaimPlan()  # the common tick's plan (frozen: one for all)


#: The last `coming_up`, with the very tuple of (frozen) replicas it came from.
_last_coming_up: Last[tuple[Sequence[ReplicaView], str | None]] = Last()


def coming_up(replicas: Sequence[ReplicaView]) -> str | None:
    """The service with the most replicas starting or waking (ties: name), or None: when lending
    shrinks with no deficit left, the GPUs come back for the service whose claim grew this way.
    Kept for the same tuple of replicas (most ticks hand in the last tick's)."""
    last = _last_coming_up.entry
    if last is not None and last[0] is replicas:
        return last[1]
    counts: dict[str, int] = {}
    for r in replicas:
        if r.state in _COMING_UP:
            counts[r.service] = counts.get(r.service, 0) + 1
    result = max(counts, key=lambda s: (counts[s], s), default=None)
    if isinstance(replicas, tuple):
        _last_coming_up.entry = (replicas, result)
    return result


def replica_needs(
    specs: Mapping[str, ServiceSpec], replicas: Sequence[ReplicaView], replica_plan: ReplicaPlan
) -> list[tuple[ReplicaNeed, str]]:
    """What each blocked service is missing, in replica terms, with a description."""
    blocked = {b.service: b.missing for b in replica_plan.blocked if b.missing > 0}
    if not blocked:
        return []
    below = {s: _below_min(specs[s], replicas) for s in blocked}
    out: list[tuple[ReplicaNeed, str]] = []
    for service in sorted(blocked, key=lambda s: (not below[s], s)):
        missing = blocked[service]
        spec = specs[service]
        mine = sorted((r for r in replicas if r.service == service), key=lambda r: r.slot)
        for r in mine:
            if missing == 0:
                break
            if r.state == R.PARKED and r.parked_as == "sleep" and len(r.gpus) == spec.gpus_per_replica:
                need = ReplicaNeed(service, r.id, spec.gpus_per_replica, _refs(r), below[service])
                out.append((need, f"wake {r.id} on its own GPUs"))
                missing -= 1
        for _ in range(missing):
            need = ReplicaNeed(service, None, spec.gpus_per_replica, (), below[service])
            out.append((need, f"start a replica of {service}"))
    return out


def track_reclaims(
    now: float, reclaims: Sequence[ReclaimFact], replicas: Sequence[ReplicaView]
) -> tuple[tuple[PhaseUpdate, ...], float | None]:
    """The phases to record on the open reclaims, and the earliest time one of them is to be
    abandoned if nothing changes (None: none)."""
    updates: list[PhaseUpdate] = []
    abandon: list[float] = []
    for rec in reclaims:
        phases: dict[str, float | ReclaimState] = {}
        notices = [t[0] for t in rec.victim_times]
        ends = [t[1] for t in rec.victim_times]
        if rec.notice_at is None and notices and all(t is not None for t in notices):
            phases["notice_at"] = max(t for t in notices if t is not None)
        freed_at = rec.freed_at
        if freed_at is None and ends and all(t is not None for t in ends):
            freed_at = max(t for t in ends if t is not None)
            phases["freed_at"] = freed_at
        if freed_at is not None:
            if rec.service is None:
                phases["state"] = ReclaimState.DONE
            else:
                healthy = [
                    r.since
                    for r in replicas
                    if r.service == rec.service
                    and r.state == R.SERVING
                    and r.since >= rec.decided_at
                    and (rec.replica_id is None or r.id == rec.replica_id)
                ]
                if healthy:
                    phases["healthy_at"] = min(healthy)
                    phases["state"] = ReclaimState.DONE
                elif now - freed_at > ABANDON_AFTER_S:
                    phases["state"] = ReclaimState.ABANDONED
                else:
                    abandon.append(freed_at + ABANDON_AFTER_S + 1.0)
        if phases:
            updates.append(PhaseUpdate(rec.id, tuple(phases.items())))
    return tuple(updates), min(abandon, default=None)


def free_gpus(
    nodes: tuple[Node, ...],
    replicas: Sequence[ReplicaView],
    running: Sequence[RunningStep],
    step_gpus: Mapping[str, Set[int]] | None = None,
) -> frozenset[GpuRef]:
    """The pool's GPUs that neither a replica (in a GPU-holding state) nor a step holds."""
    busy: dict[str, set[int]] = {}
    for r in replicas:
        if r.state in GPU_HOLDING_REPLICA_STATES and r.node:
            busy.setdefault(r.node, set()).update(r.gpus)
    if step_gpus is None:
        for s in running:
            busy.setdefault(s.node, set()).update(s.gpus)
    else:
        for node, held in step_gpus.items():
            busy.setdefault(node, set()).update(held)
    return frozenset(
        ref for n in nodes for i, ref in zip(n.gpus, n.refs(), strict=True) if i not in busy.get(n.name, ())
    )


def running_victim(s: RunningStep) -> RunningVictim:
    """A running step as a candidate victim."""
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


def _below_min(spec: ServiceSpec, replicas: Sequence[ReplicaView]) -> bool:
    supply = sum(r.service == spec.name and r.state in SUPPLY_REPLICA_STATES for r in replicas)
    return supply < spec.min_replicas


def _refs(r: ReplicaView) -> tuple[GpuRef, ...]:
    return tuple(GpuRef(r.node, i) for i in r.gpus) if r.node else ()
