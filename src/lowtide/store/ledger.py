"""The GPU ledger: every interval in which a GPU is held, and by whom.

Invariant: each managed GPU has exactly one open row (``ended_at IS NULL``); handing a GPU from
one holder to another closes one row and opens the next at the same instant, so the ledger's
GPU-seconds add up to capacity × time. `hold` books only GPUs that are idle right now (guarded),
which is what makes double booking impossible even if two writers race.
Must not: decide who gets a GPU (policy does); it only records.
"""

from __future__ import annotations

from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy import Connection

from lowtide.control.records import GpuBusy, GpuHolding
from lowtide.domain.gpus import GpuRef
from lowtide.store.schema import attempts, gpu_ledger

IDLE = "idle"
ATTEMPT = "attempt"
REPLICA = "replica"


def ensure_gpus(conn: Connection, gpus: Iterable[GpuRef], now: float) -> None:
    """Open an idle row for every managed GPU without an open row; close idle rows of GPUs no
    longer managed (held ones stay open until their holder releases them)."""
    wanted = set(gpus)
    open_rows = conn.execute(
        sa.select(gpu_ledger.c.id, gpu_ledger.c.node, gpu_ledger.c.gpu_index, gpu_ledger.c.holder_kind).where(
            gpu_ledger.c.ended_at.is_(None)
        )
    ).all()
    have = {GpuRef(r.node, r.gpu_index) for r in open_rows}
    stale = [r.id for r in open_rows if GpuRef(r.node, r.gpu_index) not in wanted and r.holder_kind == IDLE]
    if stale:
        conn.execute(sa.update(gpu_ledger).where(gpu_ledger.c.id.in_(stale)).values(ended_at=now))
    missing = sorted(wanted - have)
    if missing:
        conn.execute(
            sa.insert(gpu_ledger),
            [{"node": g.node, "gpu_index": g.index, "holder_kind": IDLE, "started_at": now} for g in missing],
        )


def hold(
    conn: Connection,
    gpus: Iterable[GpuRef],
    *,
    kind: str,
    holder_id: str,
    job_id: str | None,
    team: str | None,
    now: float,
) -> None:
    """Hand idle GPUs to a holder. Raises GpuBusy if any of them is not idle right now."""
    rows = []
    for gpu in gpus:
        result = conn.execute(
            sa.update(gpu_ledger)
            .where(
                gpu_ledger.c.node == gpu.node,
                gpu_ledger.c.gpu_index == gpu.index,
                gpu_ledger.c.ended_at.is_(None),
                gpu_ledger.c.holder_kind == IDLE,
            )
            .values(ended_at=now)
        )
        if result.rowcount != 1:
            raise GpuBusy(f"GPU {gpu} is not idle")
        rows.append(
            {
                "node": gpu.node,
                "gpu_index": gpu.index,
                "holder_kind": kind,
                "holder_id": holder_id,
                "job_id": job_id,
                "team": team,
                "started_at": now,
            }
        )
    if rows:
        conn.execute(sa.insert(gpu_ledger), rows)


def release(conn: Connection, *, kind: str, holder_id: str, now: float) -> list[GpuRef]:
    """Close the holder's open rows and open idle rows for those GPUs; returns the GPUs freed."""
    held = conn.execute(
        sa.select(gpu_ledger.c.id, gpu_ledger.c.node, gpu_ledger.c.gpu_index).where(
            gpu_ledger.c.holder_kind == kind,
            gpu_ledger.c.holder_id == holder_id,
            gpu_ledger.c.ended_at.is_(None),
        )
    ).all()
    if not held:
        return []
    conn.execute(sa.update(gpu_ledger).where(gpu_ledger.c.id.in_([r.id for r in held])).values(ended_at=now))
    conn.execute(
        sa.insert(gpu_ledger),
        [{"node": r.node, "gpu_index": r.gpu_index, "holder_kind": IDLE, "started_at": now} for r in held],
    )
    return [GpuRef(r.node, r.gpu_index) for r in held]


def holdings(conn: Connection) -> list[GpuHolding]:
    """Who holds each GPU now (open rows), with the step name for attempt holders."""
    rows = conn.execute(
        sa.select(gpu_ledger, attempts.c.step_name)
        .select_from(
            gpu_ledger.outerjoin(
                attempts,
                sa.and_(
                    gpu_ledger.c.holder_kind == ATTEMPT,
                    attempts.c.id == sa.cast(gpu_ledger.c.holder_id, sa.Integer),
                ),
            )
        )
        .where(gpu_ledger.c.ended_at.is_(None))
        .order_by(gpu_ledger.c.node, gpu_ledger.c.gpu_index)
    ).all()
    return [
        GpuHolding(
            node=r.node,
            index=r.gpu_index,
            holder_kind=r.holder_kind,
            holder_id=r.holder_id,
            job_id=r.job_id,
            step=r.step_name,
            team=r.team,
            since=r.started_at,
        )
        for r in rows
    ]


def gpu_seconds_by_holder(conn: Connection, start: float, end: float) -> dict[str, float]:
    """GPU-seconds per holder kind inside [start, end] (open rows count up to `end`)."""
    rows = conn.execute(
        sa.select(gpu_ledger.c.holder_kind, gpu_ledger.c.started_at, gpu_ledger.c.ended_at).where(
            gpu_ledger.c.started_at < end,
            sa.or_(gpu_ledger.c.ended_at.is_(None), gpu_ledger.c.ended_at > start),
        )
    ).all()
    totals: dict[str, float] = {}
    for r in rows:
        seg = min(end, r.ended_at if r.ended_at is not None else end) - max(start, r.started_at)
        if seg > 0:
            totals[r.holder_kind] = totals.get(r.holder_kind, 0.0) + seg
    return totals
