"""Taking lent GPUs back, the acting half: read the open reclaims, and book what
`policy.reclaim_phases` decided (phases, notice requests, new reclaim records).

Per tick, inside `control.inference`: `observe` reads the OPEN reclaims and their victims' notice
and end times (one store call each) for the inference snapshot; the pure decision
(`policy.reclaim_phases.decide_reclaim`, run by `policy.inference`) says which phases to record,
which steps get notice with which grace, and which reclaims open; `act` books them in that order.
A victim whose step moved meanwhile (`StaleState`) is skipped and opens no reclaim; every item
fails on its own and asks for a follow-up tick. The loop then gives notice (its executor); when
the victims have exited, the replica plan finds the GPUs free and starts or wakes the replica.
Neighbours: `control.inference` (wiring, memory), `policy.reclaim_phases` (the decision),
`policy.reclaim` (the victims). Must not: read the clock (`now` comes in), decide anything,
signal processes (the loop's executor does), or decide replica counts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from lowtide.control.records import GpuBusy, ReclaimRecord, StaleState
from lowtide.domain.states import ReclaimState
from lowtide.policy.inference_snapshot import ReclaimFact
from lowtide.policy.reclaim import ReclaimPlan
from lowtide.policy.reclaim_phases import ReclaimDecision

log = logging.getLogger("lowtide.reclaim")


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
    #: When each service began to want replicas it has not got (the last decision's memory).
    surge_at: Mapping[str, float] = field(default_factory=dict)
    last_plan: ReclaimPlan | None = None

    def observe(self) -> tuple[ReclaimFact, ...]:
        """The OPEN reclaims, with the notice and end times of their victims."""
        records = self.store.reclaims(state=ReclaimState.OPEN)
        if not records:
            return ()
        times = self.store.attempt_times({a for rec in records for a in rec.victims})
        return tuple(
            ReclaimFact(
                id=rec.id,
                service=rec.service,
                replica_id=rec.replica_id,
                decided_at=rec.decided_at,
                notice_at=rec.notice_at,
                freed_at=rec.freed_at,
                victim_times=tuple(times[a] for a in dict.fromkeys(rec.victims) if a in times),
            )
            for rec in records
        )

    def act(self, decision: ReclaimDecision, now: float) -> bool:
        """Book `decision`: phases, then notice requests, then the reclaims they open. Returns
        whether an item failed (the next tick decides again)."""
        self.surge_at = decision.surge_at
        self.last_plan = decision.plan
        failed = False
        for update in decision.phases:
            try:
                self.store.update_reclaim(update.reclaim_id, **update.values())
            except StaleState:
                failed = True
                log.info("reclaim %s ended meanwhile; phases not recorded", update.reclaim_id)
            except Exception:
                failed = True
                log.exception("recording the phases of reclaim %s failed", update.reclaim_id)
        if not decision.preemptions:
            return failed
        preempted: set[int] = set()
        for p in decision.preemptions:
            try:
                self.store.request_preemption(p.attempt_id, grace_s=p.grace_s, reason=p.reason, now=now)
            except (StaleState, GpuBusy) as exc:
                failed = True
                log.info("not preempting attempt %s: %s", p.attempt_id, exc)
                continue
            except Exception:
                failed = True
                log.exception("preempting attempt %s failed", p.attempt_id)
                continue
            preempted.add(p.attempt_id)
        for opening in decision.openings(preempted):
            try:
                self.store.open_reclaim(
                    service=opening.service,
                    replica_id=opening.replica_id,
                    reason=opening.reason,
                    gpus=opening.gpus,
                    victims=opening.attempt_ids,
                    detected_at=opening.detected_at,
                    decided_at=opening.decided_at,
                )
            except Exception:
                failed = True
                log.exception("recording the reclaim for %s failed", opening.service or "lending")
        return failed
