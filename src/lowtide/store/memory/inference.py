"""The in-memory store's inference side: replicas and their GPUs in the ledger, the service event
log, reclaims, and small persisted values (the forecast profile, `instance_id`).

The counterpart of `store.replicas_repo`, with the same signatures, records and errors; when a
replica's move hands its GPUs back, which state a start goes to and what a reclaim update may
touch are `policy.pool_rules`, shared with it. Replicas and reclaims are kept as frozen records,
replaced on every change; the replicas in (service, slot) order and the open reclaims are
indexes, so `replicas()` and `reclaims(state=OPEN)` cost what they return.
Neighbours: `base.MemoryBase` (state), the ledger; `control.inference` and `control.reclaimer`
drive it. Must not: decide anything or read the clock.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from lowtide.control.records import NotFound, ReclaimRecord, ReplicaRecord, ServiceEventRecord, StaleState
from lowtide.domain.gpus import GpuRef
from lowtide.domain.states import RECLAIM_LIFECYCLE, REPLICA_LIFECYCLE, ReclaimState, ReplicaState
from lowtide.policy.accounting import REPLICA
from lowtide.policy.evolve import evolve
from lowtide.policy.pool_rules import check_reclaim_update, replica_releases_gpus, replica_start_state
from lowtide.store.memory.base import MemoryBase, count_state

#: What a replica move may set besides its state (the replicas table's other columns).
_REPLICA_COLUMNS = frozenset(f.name for f in fields(ReplicaRecord)) - {"id", "state"}


def _move_values(*, since: float, message: str, **values: Any) -> dict[str, Any]:
    """The columns a move sets; a column given twice raises TypeError, as in the SQL store."""
    return {"since": since, "message": message, **values}


class InferencePart(MemoryBase):
    def replicas(self, service: str | None = None) -> list[ReplicaRecord]:
        """By service and slot."""
        with self._lock:
            every = self._replica_order.values()
            return list(every) if service is None else [r for r in every if r.service == service]

    def replica_records(self) -> tuple[ReplicaRecord, ...]:
        """Every replica, by service and slot, as the tuple the store keeps (not part of the
        `Store` protocol: the simulator's world reads it to see whether anything moved; it is
        the same object until a replica changes)."""
        with self._lock:
            return self._replica_order.values()

    def replica(self, replica_id: str) -> ReplicaRecord:
        with self._lock:
            rec = self._replicas.get(replica_id)
        if rec is None:
            raise NotFound(f"replica '{replica_id}' not found")
        return rec

    def begin_replica(
        self,
        *,
        replica_id: str,
        service: str,
        slot: int,
        port: int,
        node: str,
        gpus: tuple[int, ...],
        wake: bool,
        now: float,
        reason: str,
    ) -> ReplicaRecord:
        """Book the GPUs and move the slot to STARTING (or WAKING when `wake`). Raises
        IllegalTransition or GpuBusy, changing nothing."""
        target = replica_start_state(wake)
        with self._lock:
            self._check_fence()
            current = self._replicas.get(replica_id)
            if current is not None:
                REPLICA_LIFECYCLE.check(current.state, target)
            refs = [GpuRef(node, i) for i in gpus]
            self._ledger.check_bookable(refs)
            values: dict[str, Any] = {
                "node": node,
                "gpus": tuple(gpus),
                "port": port,
                "parked_as": None,
                "since": now,
                "message": reason,
            }
            if current is None:
                rec = ReplicaRecord(
                    id=replica_id,
                    service=service,
                    slot=slot,
                    state=target,
                    failures=0,
                    retry_at=0.0,
                    **values,
                )
            else:
                rec = evolve(current, state=target, **values)
            self._put_replica(current, rec)
            self._ledger.hold(refs, kind=REPLICA, holder_id=replica_id, job_id=None, team=None, now=now)
            self._service_event(service, replica_id, now, target.value.lower(), reason)
            return rec

    def move_replica(
        self,
        replica_id: str,
        expected: ReplicaState,
        target: ReplicaState,
        *,
        now: float,
        message: str,
        **values: Any,
    ) -> None:
        """Guarded state move; leaving the GPU-holding states gives the GPUs back to the pool.
        Raises NotFound, IllegalTransition, ValueError (an unknown column) or StaleState."""
        with self._lock:
            self._check_fence()
            current = self._replicas.get(replica_id)
            if current is None:
                raise NotFound(f"replica '{replica_id}' not found")
            columns = _move_values(since=now, message=message, **values)
            REPLICA_LIFECYCLE.check(expected, target)
            unknown = set(columns) - _REPLICA_COLUMNS
            if unknown:
                raise ValueError(f"unknown replica columns: {sorted(unknown)}")
            if current.state != expected:
                raise StaleState(f"replica {replica_id}: expected {expected}, cannot move to {target}")
            if "gpus" in columns:
                columns["gpus"] = tuple(columns["gpus"])
            self._put_replica(current, evolve(current, state=target, **columns))
            if replica_releases_gpus(expected, target):
                self._ledger.release(kind=REPLICA, holder_id=replica_id, now=now)
            self._service_event(current.service, replica_id, now, target.value.lower(), message)

    def add_service_event(
        self, service: str, replica_id: str | None, *, at: float, kind: str, message: str
    ) -> None:
        with self._lock:
            self._service_event(service, replica_id, at, kind, message)

    def service_events(self, service: str, *, limit: int = 100) -> list[ServiceEventRecord]:
        """The last `limit` events of a service, oldest first (a negative limit: all)."""
        with self._lock:
            log = self._service_events.get(service, [])
            return list(log if limit < 0 else log[len(log) - min(limit, len(log)) :])

    # -- reclaims ------------------------------------------------------------------------------

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
    ) -> int:
        with self._lock:
            self._check_fence()
            rec = ReclaimRecord(
                id=next(self._reclaim_ids),
                service=service,
                replica_id=replica_id,
                reason=reason,
                gpus=gpus,
                victims=tuple(victims),
                state=ReclaimState.OPEN,
                detected_at=detected_at,
                decided_at=decided_at,
                notice_at=None,
                freed_at=None,
                healthy_at=None,
            )
            self._put_reclaim(None, rec)
            if service is not None:
                self._service_event(service, replica_id, decided_at, "reclaim", reason)
            return rec.id

    def update_reclaim(self, reclaim_id: int, **phases: Any) -> None:
        """Record phases of an OPEN reclaim and, with `state`, end it. Raises ValueError (an
        unknown field or state), IllegalTransition or StaleState (not open, or no such reclaim)."""
        check_reclaim_update(phases)
        with self._lock:
            self._check_fence()
            current = self._reclaims.get(reclaim_id)
            target = ReclaimState.OPEN
            if "state" in phases:
                target = ReclaimState(phases.pop("state"))
                RECLAIM_LIFECYCLE.check(ReclaimState.OPEN, target)
                if current is None or current.state != ReclaimState.OPEN:
                    raise StaleState(f"reclaim {reclaim_id}: expected OPEN, cannot move to {target}")
            elif current is None or current.state != ReclaimState.OPEN:
                raise StaleState(f"reclaim {reclaim_id} is not open")
            self._put_reclaim(current, evolve(current, state=target, **phases))

    def reclaims(self, *, state: ReclaimState | str | None = None, limit: int = 1000) -> list[ReclaimRecord]:
        """The last `limit` reclaims (in `state`, if given), oldest first (a negative limit: all)."""
        wanted = None if state is None else ReclaimState(state)
        with self._lock:
            if wanted == ReclaimState.OPEN:
                found = self._open_reclaims.values()
                return list(found if limit < 0 else found[len(found) - min(limit, len(found)) :])
            out: list[ReclaimRecord] = []
            for rec in reversed(self._reclaims.values()):
                if len(out) == limit:
                    break
                if wanted is None or rec.state == wanted:
                    out.append(rec)
            out.reverse()
            return out

    def get_value(self, key: str) -> str | None:
        with self._lock:
            return self._values.get(key)

    def set_value(self, key: str, value: str) -> None:
        with self._lock:
            self._values[key] = str(value)

    # -- helpers -------------------------------------------------------------------------------

    def _put_replica(self, old: ReplicaRecord | None, new: ReplicaRecord) -> None:
        if old is not None:
            self._replica_order.drop((old.service, old.slot, old.id))
        self._replicas[new.id] = new
        self._replica_order.put((new.service, new.slot, new.id), new)

    def _put_reclaim(self, old: ReclaimRecord | None, new: ReclaimRecord) -> None:
        if old is not None:
            count_state(self._reclaim_counts, old.state, -1)
        count_state(self._reclaim_counts, new.state, 1)
        self._reclaims[new.id] = new
        if new.state == ReclaimState.OPEN:
            self._open_reclaims.put(new.id, new)
        else:
            self._open_reclaims.drop(new.id)

    def _service_event(
        self, service: str, replica_id: str | None, at: float, kind: str, message: str
    ) -> None:
        self._service_events.setdefault(service, []).append(
            ServiceEventRecord(service, replica_id, at, kind, message)
        )
