"""The inference side of the store: replica rows, their guarded state moves, their GPUs in the
ledger, the service event log, and small persisted values (the forecast profile).

A replica's GPUs are booked in the ledger (holder_kind "replica") when it starts or wakes, and
released when it leaves the GPU-holding states (parked, failed); these rules, and which fields a
reclaim update may touch, are `policy.pool_rules`, shared with `store.memory`. Neighbours:
`control.inference` drives it; `api` reads it. Must not: decide anything (policy does) or read
the clock.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection

from lowtide.control.records import NotFound, ReclaimRecord, ReplicaRecord, ServiceEventRecord, StaleState
from lowtide.domain.gpus import GpuRef
from lowtide.domain.states import ReclaimState, ReplicaState
from lowtide.policy.pool_rules import check_reclaim_update, replica_releases_gpus, replica_start_state
from lowtide.store import ledger
from lowtide.store.base import StoreBase
from lowtide.store.schema import meta, reclaims, replicas, service_events
from lowtide.store.transitions import move_reclaim, move_replica


def _record(r: Any) -> ReplicaRecord:
    return ReplicaRecord(
        id=r.id,
        service=r.service,
        slot=r.slot,
        state=ReplicaState(r.state),
        node=r.node,
        gpus=tuple(r.gpus),
        port=r.port,
        parked_as=r.parked_as,
        since=r.since,
        failures=r.failures,
        retry_at=r.retry_at,
        message=r.message,
    )


def insert_service_event(
    conn: Connection, service: str, replica_id: str | None, at: float, kind: str, message: str
) -> None:
    conn.execute(
        sa.insert(service_events).values(
            service=service, replica_id=replica_id, at=at, kind=kind, message=message
        )
    )


class ReplicasRepo(StoreBase):
    def replicas(self, service: str | None = None) -> list[ReplicaRecord]:
        q = sa.select(replicas).order_by(replicas.c.service, replicas.c.slot)
        if service is not None:
            q = q.where(replicas.c.service == service)
        with self._read() as conn:
            return [_record(r) for r in conn.execute(q).all()]

    def replica(self, replica_id: str) -> ReplicaRecord:
        with self._read() as conn:
            row = conn.execute(sa.select(replicas).where(replicas.c.id == replica_id)).first()
        if row is None:
            raise NotFound(f"replica '{replica_id}' not found")
        return _record(row)

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
        """Book the GPUs and move the slot to STARTING (or WAKING when `wake`), in one transaction.
        Raises GpuBusy if a GPU is taken and StaleState if the replica moved meanwhile."""
        target = replica_start_state(wake)
        with self._write() as conn:
            row = conn.execute(sa.select(replicas).where(replicas.c.id == replica_id)).first()
            values = {
                "node": node,
                "gpus": list(gpus),
                "port": port,
                "parked_as": None,
                "since": now,
                "message": reason,
            }
            if row is None:
                conn.execute(
                    sa.insert(replicas).values(
                        id=replica_id,
                        service=service,
                        slot=slot,
                        state=target.value,
                        failures=0,
                        retry_at=0.0,
                        **values,
                    )
                )
            else:
                move_replica(conn, replica_id, ReplicaState(row.state), target, **values)
            ledger.hold(
                conn,
                [GpuRef(node, i) for i in gpus],
                kind=ledger.REPLICA,
                holder_id=replica_id,
                job_id=None,
                team=None,
                now=now,
            )
            insert_service_event(conn, service, replica_id, now, target.value.lower(), reason)
            return _record(conn.execute(sa.select(replicas).where(replicas.c.id == replica_id)).one())

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
        """Guarded state move; leaving the GPU-holding states gives the GPUs back to the pool."""
        with self._write() as conn:
            row = conn.execute(sa.select(replicas.c.service).where(replicas.c.id == replica_id)).first()
            if row is None:
                raise NotFound(f"replica '{replica_id}' not found")
            move_replica(conn, replica_id, expected, target, since=now, message=message, **values)
            if replica_releases_gpus(expected, target):
                ledger.release(conn, kind=ledger.REPLICA, holder_id=replica_id, now=now)
            insert_service_event(conn, row.service, replica_id, now, target.value.lower(), message)

    def add_service_event(
        self, service: str, replica_id: str | None, *, at: float, kind: str, message: str
    ) -> None:
        with self._write() as conn:
            insert_service_event(conn, service, replica_id, at, kind, message)

    def service_events(self, service: str, *, limit: int = 100) -> list[ServiceEventRecord]:
        with self._read() as conn:
            rows = conn.execute(
                sa.select(service_events)
                .where(service_events.c.service == service)
                .order_by(service_events.c.id.desc())
                .limit(limit)
            ).all()
        return [ServiceEventRecord(r.service, r.replica_id, r.at, r.kind, r.message) for r in reversed(rows)]

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
        with self._write() as conn:
            reclaim_id = conn.execute(
                sa.insert(reclaims)
                .values(
                    service=service,
                    replica_id=replica_id,
                    reason=reason,
                    gpus=gpus,
                    victims=list(victims),
                    state=ReclaimState.OPEN.value,
                    detected_at=detected_at,
                    decided_at=decided_at,
                )
                .returning(reclaims.c.id)
            ).scalar_one()
            if service is not None:
                insert_service_event(conn, service, replica_id, decided_at, "reclaim", reason)
            return int(reclaim_id)

    def update_reclaim(self, reclaim_id: int, **phases: Any) -> None:
        """Record phases (`notice_at`, `freed_at`, `healthy_at`) of an OPEN reclaim and, with
        `state`, end it (`RECLAIM_LIFECYCLE`). Guarded: a reclaim that is no longer OPEN (or does
        not exist) raises StaleState and is left as it is."""
        check_reclaim_update(phases)
        with self._write() as conn:
            if "state" in phases:
                target = ReclaimState(phases.pop("state"))
                move_reclaim(conn, reclaim_id, ReclaimState.OPEN, target, **phases)
                return
            done = conn.execute(
                sa.update(reclaims)
                .where(reclaims.c.id == reclaim_id, reclaims.c.state == ReclaimState.OPEN.value)
                .values(**phases)
            ).rowcount
        if done != 1:
            raise StaleState(f"reclaim {reclaim_id} is not open")

    def reclaims(self, *, state: ReclaimState | str | None = None, limit: int = 1000) -> list[ReclaimRecord]:
        q = sa.select(reclaims).order_by(reclaims.c.id.desc()).limit(limit)
        if state is not None:
            q = q.where(reclaims.c.state == ReclaimState(state).value)
        with self._read() as conn:
            rows = conn.execute(q).all()
        return [
            ReclaimRecord(
                id=r.id,
                service=r.service,
                replica_id=r.replica_id,
                reason=r.reason,
                gpus=r.gpus,
                victims=tuple(r.victims),
                state=ReclaimState(r.state),
                detected_at=r.detected_at,
                decided_at=r.decided_at,
                notice_at=r.notice_at,
                freed_at=r.freed_at,
                healthy_at=r.healthy_at,
            )
            for r in reversed(rows)
        ]

    def get_value(self, key: str) -> str | None:
        with self._read() as conn:
            value = conn.execute(sa.select(meta.c.value).where(meta.c.key == key)).scalar()
        return None if value is None else str(value)

    def set_value(self, key: str, value: str) -> None:
        with self._write() as conn:
            updated = conn.execute(sa.update(meta).where(meta.c.key == key).values(value=value)).rowcount
            if not updated:
                conn.execute(sa.insert(meta).values(key=key, value=value))
