"""A step's `gpu_memory_gib` reaches the scheduler's queued view on every backend (SQLite,
PostgreSQL, memory): read from the resolved step's document, no column of its own."""

from __future__ import annotations

from storekit import HALF_LIFE, NODES, submit

from lowtide.control.clock import FakeClock
from lowtide.store.repo import Store


def test_the_queued_view_carries_the_memory_a_step_needs_and_none_when_it_declares_none(
    store: Store, clock: FakeClock
) -> None:
    job_id = submit(
        store,
        clock,
        steps=[
            {"name": "big", "command": ["t"], "gpus": 2, "gpu_memory_gib": 70.5},
            {"name": "any", "command": ["t"], "gpus": 1},
        ],
    )
    snap = store.snapshot(now=clock.now(), nodes=NODES, half_life_s=HALF_LIFE)
    needs = {q.step: q.gpu_memory_gib for q in snap.queued if q.job_id == job_id}
    assert needs == {"big": 70.5, "any": None}
    detail = store.job_detail(job_id)
    assert detail.job.spec["steps"][0]["gpu_memory_gib"] == 70.5
