"""The GPU ledger: every interval in which a GPU is held, and by whom.

Invariant: each managed GPU has exactly one open row (``ended_at IS NULL``); handing a GPU from
one holder to another closes one row and opens the next at the same instant, so the ledger's
GPU-seconds add up to capacity × time. That instant is never before the open row began
(`policy.pool_rules.handover_at`; a clamp is logged): no row has a negative duration and the rows
of one GPU never overlap, whatever time the caller passes (an exit stamped after the tick that
books the GPU again, a clock that went back across a restart). `hold` books only GPUs that are
idle right now (guarded), which is what makes double booking impossible even if two writers race.
The rules (which rows `ensure_gpus` opens and closes, the handover instant, the per-kind sum) are
`policy.pool_rules`, shared with the in-memory ledger (`store.memory.ledger`); the holder kinds
are `policy.accounting`'s.
Must not: decide who gets a GPU (policy does); it only records.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy import Connection

from lowtide.control.records import GpuBusy, GpuHolding
from lowtide.domain.gpus import GpuRef
from lowtide.policy.accounting import ATTEMPT, IDLE, REPLICA
from lowtide.policy.pool_rules import gpu_seconds_by_kind, handover_at, reconcile_gpus
from lowtide.store.schema import attempts, gpu_ledger

log = logging.getLogger("lowtide")

__all__ = [
    "ATTEMPT",
    "IDLE",
    "REPLICA",
    "ensure_gpus",
    "gpu_seconds_by_holder",
    "hold",
    "holdings",
    "last_handover",
    "release",
]


def _clamped(gpu: GpuRef, now: float, started_at: float) -> float:
    at = handover_at(now, started_at)
    if at != now:  # a few ms: an exit stamped after the tick's time; more: a clock gone back
        log.log(
            logging.WARNING if at - now > 1.0 else logging.INFO,
            "ledger: GPU %s changes hands %.3f s before its interval began; clamped to its start",
            gpu,
            at - now,
        )
    return at


def ensure_gpus(conn: Connection, gpus: Iterable[GpuRef], now: float) -> None:
    """Open an idle row for every managed GPU without an open row; close idle rows of GPUs no
    longer managed (held ones stay open until their holder releases them)."""
    open_rows = conn.execute(
        sa.select(
            gpu_ledger.c.id,
            gpu_ledger.c.node,
            gpu_ledger.c.gpu_index,
            gpu_ledger.c.holder_kind,
            gpu_ledger.c.started_at,
        ).where(gpu_ledger.c.ended_at.is_(None))
    ).all()
    row_of = {GpuRef(r.node, r.gpu_index): r for r in open_rows}
    close, missing = reconcile_gpus({g: r.holder_kind for g, r in row_of.items()}, gpus)
    for g in close:
        row = row_of[g]
        conn.execute(
            sa.update(gpu_ledger)
            .where(gpu_ledger.c.id == row.id)
            .values(ended_at=_clamped(g, now, row.started_at))
        )
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
    """Hand idle GPUs to a holder, each at `now` or, if later, when its idle row began. Raises
    GpuBusy if any of them is not idle right now."""
    rows = []
    for gpu in gpus:
        idle = conn.execute(
            sa.select(gpu_ledger.c.id, gpu_ledger.c.started_at).where(
                gpu_ledger.c.node == gpu.node,
                gpu_ledger.c.gpu_index == gpu.index,
                gpu_ledger.c.ended_at.is_(None),
                gpu_ledger.c.holder_kind == IDLE,
            )
        ).first()
        if idle is None:
            raise GpuBusy(f"GPU {gpu} is not idle")
        at = _clamped(gpu, now, idle.started_at)
        # Guarded like a state move: a writer that booked it since our read leaves no row to match.
        result = conn.execute(
            sa.update(gpu_ledger)
            .where(
                gpu_ledger.c.id == idle.id,
                gpu_ledger.c.ended_at.is_(None),
                gpu_ledger.c.holder_kind == IDLE,
            )
            .values(ended_at=at)
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
                "started_at": at,
            }
        )
    if rows:
        conn.execute(sa.insert(gpu_ledger), rows)


def release(conn: Connection, *, kind: str, holder_id: str, now: float) -> list[GpuRef]:
    """Close the holder's open rows (at `now`, or when a row began if that is later) and open idle
    rows for those GPUs at the same instant; returns the GPUs freed."""
    held = conn.execute(
        sa.select(gpu_ledger.c.id, gpu_ledger.c.node, gpu_ledger.c.gpu_index, gpu_ledger.c.started_at).where(
            gpu_ledger.c.holder_kind == kind,
            gpu_ledger.c.holder_id == holder_id,
            gpu_ledger.c.ended_at.is_(None),
        )
    ).all()
    if not held:
        return []
    at_of = {r.id: _clamped(GpuRef(r.node, r.gpu_index), now, r.started_at) for r in held}
    for at in sorted(set(at_of.values())):
        ids = [i for i, a in at_of.items() if a == at]
        conn.execute(sa.update(gpu_ledger).where(gpu_ledger.c.id.in_(ids)).values(ended_at=at))
    conn.execute(
        sa.insert(gpu_ledger),
        [
            {"node": r.node, "gpu_index": r.gpu_index, "holder_kind": IDLE, "started_at": at_of[r.id]}
            for r in held
        ],
    )
    return [GpuRef(r.node, r.gpu_index) for r in held]


def last_handover(conn: Connection) -> float | None:
    """The latest instant at which any GPU changed hands (the latest start of an open row), or
    None when the ledger is empty."""
    latest = conn.execute(
        sa.select(sa.func.max(gpu_ledger.c.started_at)).where(gpu_ledger.c.ended_at.is_(None))
    ).scalar_one()
    return None if latest is None else float(latest)


def holdings(conn: Connection) -> list[GpuHolding]:
    """Who holds each GPU now (open rows), with the step name for attempt holders."""
    rows = conn.execute(
        sa.select(gpu_ledger, attempts.c.step_name)
        .select_from(
            gpu_ledger.outerjoin(
                attempts,
                sa.and_(
                    gpu_ledger.c.holder_kind == ATTEMPT,
                    # Compared as text: PostgreSQL may cast every row's holder_id, and a
                    # replica's ("chat/0") is no integer.
                    gpu_ledger.c.holder_id == sa.cast(attempts.c.id, sa.String),
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
    return gpu_seconds_by_kind(((r.holder_kind, r.started_at, r.ended_at) for r in rows), start, end)
