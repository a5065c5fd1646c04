"""The ledger's clamps on SQLite, the real PostgreSQL server and memory (issue 12, item 8 and
defect 4): a GPU changes hands at one instant, never before its open interval began, so no
interval is negative and one GPU's intervals never overlap, even when an exit is stamped a moment
after the tick that books its GPUs for the replacement, or a time from before a clock went back
reaches the store. Also `last_recorded_at`, the floor a restart's control time starts from.

Everything goes through the store's own calls; the rows are then read back raw (`_intervals`) to
check the invariant, and through `usage_report` to check that GPU-seconds = capacity × time.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

import pytest
import sqlalchemy as sa
from storekit import finish, start, submit

from lowtide.control.clock import FakeClock
from lowtide.domain.gpus import GpuRef, Node
from lowtide.domain.states import ReplicaState, StepState
from lowtide.store.memory import MemoryStore
from lowtide.store.repo import Store
from lowtide.store.schema import gpu_ledger

NODES = (Node("n1", (0, 1)),)
ONE_STEP = [{"name": "train", "command": ["python", "train.py"], "gpus": 2}]

Row = tuple[str, str | None, float, float | None]  # holder kind, holder id, started, ended


def _intervals(store: Store | MemoryStore) -> dict[GpuRef, list[Row]]:
    """Every ledger interval per GPU, in the order opened."""
    out: dict[GpuRef, list[Row]] = defaultdict(list)
    if isinstance(store, MemoryStore):
        for iv in store._ledger.intervals:
            out[iv.gpu].append((iv.holder_kind, iv.holder_id, iv.started_at, iv.ended_at))
        return out
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(gpu_ledger).order_by(gpu_ledger.c.id)).all()
    for r in rows:
        out[GpuRef(r.node, r.gpu_index)].append((r.holder_kind, r.holder_id, r.started_at, r.ended_at))
    return out


def assert_ledger_sound(store: Store) -> None:
    """No interval ends before it starts; per GPU the intervals follow each other end to start
    (no overlap, no gap) and only the last is open."""
    for gpu, rows in _intervals(store).items():
        for kind, holder, started, ended in rows:
            assert ended is None or ended >= started, (gpu, kind, holder, started, ended)
        for (_, _, _, ended), (_, _, next_started, _) in pairwise(rows):
            assert ended == next_started, (gpu, rows)
        assert [r[3] is None for r in rows].count(True) == 1, (gpu, rows)


def test_an_exit_stamped_after_the_tick_that_books_its_gpus_credits_no_gpu_twice(
    store: Store, clock: FakeClock
) -> None:
    """The issue's item 8: the evicted step's exit is stamped 0.5 s after the tick's time, and
    the replacement books its GPUs at the tick's time. Before: the evicted step held them until
    t + 0.5 while the replacement held them from t, and the idle row between ran backwards."""
    t0 = clock.now()
    store.ensure_gpus(NODES, t0)
    victim_job = submit(store, clock, "job-000000000001", steps=ONE_STEP)
    victim = start(store, victim_job, "train", clock.advance(10), gpus=(0, 1))
    tick = clock.advance(100)
    finish(store, victim.attempt_id, tick + 0.5, exit_code=1)  # the shim's own, later, time
    replacement_job = submit(store, clock, "job-000000000002", steps=ONE_STEP)
    replacement = start(store, replacement_job, "train", tick, gpus=(0, 1))
    end = clock.advance(50)

    assert_ledger_sound(store)
    rows = _intervals(store)[GpuRef("n1", 0)]
    assert [(k, h) for k, h, _, _ in rows] == [
        ("idle", None),
        ("attempt", str(victim.attempt_id)),
        ("idle", None),
        ("attempt", str(replacement.attempt_id)),
    ]
    assert rows[3][2] == tick + 0.5  # the replacement's interval starts where the victim's ends
    report = store.usage_report(t0, end, group_by="holder")
    assert report.totals.capacity_gpu_seconds == pytest.approx(2 * (end - t0), abs=1e-6)
    by_holder = {r.holder_id: r.research_gpu_seconds for r in report.rows if r.holder_kind == "attempt"}
    assert by_holder[str(victim.attempt_id)] + by_holder[str(replacement.attempt_id)] == pytest.approx(
        2 * (end - t0 - 10), abs=1e-6
    )


def test_an_end_before_its_start_is_clamped_to_the_start(store: Store, clock: FakeClock) -> None:
    """A time from before the clock went back (an exit converted from a wall clock that was
    stepped back): the attempt's interval is empty, not negative, and the GPUs are idle from its
    start on."""
    t0 = clock.now()
    store.ensure_gpus(NODES, t0)
    job = submit(store, clock, steps=ONE_STEP)
    launch = start(store, job, "train", clock.advance(60), gpus=(0, 1))
    finish(store, launch.attempt_id, t0 + 30, exit_code=0)  # 30 s before it started
    end = clock.advance(40)
    assert_ledger_sound(store)
    attempt_rows = [r for r in _intervals(store)[GpuRef("n1", 1)] if r[0] == "attempt"]
    assert attempt_rows == [("attempt", str(launch.attempt_id), t0 + 60, t0 + 60)]
    report = store.usage_report(t0, end, group_by="holder")
    assert report.totals.capacity_gpu_seconds == pytest.approx(2 * (end - t0))
    assert report.totals.research_gpu_seconds == 0.0


def test_preemption_and_replica_handover_add_up_to_capacity_times_time(
    store: Store, clock: FakeClock
) -> None:
    """Across a preemption (notice, an exit stamped after the tick, the replica booking the freed
    GPUs in the same tick) every GPU's intervals add up to exactly the time covered."""
    t0 = clock.now()
    store.ensure_gpus(NODES, t0)
    job = submit(store, clock, steps=ONE_STEP)
    launch = start(store, job, "train", clock.advance(5), gpus=(0, 1))
    store.request_preemption(launch.attempt_id, grace_s=30, reason="inference", now=clock.advance(100))
    store.mark_stopping(launch.attempt_id, deadline=clock.now() + 30, reason="inference", now=clock.now())
    tick = clock.advance(10)
    decision = finish(store, launch.attempt_id, tick + 0.25, exit_code=1, noticed=True)
    assert decision.step_state == StepState.PREEMPTED
    store.begin_replica(
        replica_id="chat/0",
        service="chat",
        slot=0,
        port=9000,
        node="n1",
        gpus=(0, 1),
        wake=False,
        now=tick,
        reason="reclaim",
    )
    store.move_replica(
        "chat/0", ReplicaState.STARTING, ReplicaState.FAILED, now=clock.advance(20), message="x"
    )
    end = clock.advance(30)
    assert_ledger_sound(store)
    report = store.usage_report(t0, end, group_by="holder")
    t = report.totals
    assert t.capacity_gpu_seconds == pytest.approx(2 * (end - t0), abs=1e-6)
    assert t.research_gpu_seconds == pytest.approx(2 * (tick + 0.25 - (t0 + 5)), abs=1e-6)
    assert t.inference_gpu_seconds == pytest.approx(2 * (20 - 0.25), abs=1e-6)
    assert t.idle_gpu_seconds + t.research_gpu_seconds + t.inference_gpu_seconds == pytest.approx(
        t.capacity_gpu_seconds
    )


def test_last_recorded_at_is_the_later_of_the_last_handover_and_the_last_event(
    store: Store, clock: FakeClock
) -> None:
    assert store.last_recorded_at() is None
    t0 = clock.now()
    store.ensure_gpus(NODES, t0)
    assert store.last_recorded_at() == t0
    job = submit(store, clock, steps=ONE_STEP)
    launch = start(store, job, "train", clock.advance(10), gpus=(0, 1))
    assert store.last_recorded_at() == t0 + 10
    store.request_cancel(job, by="alice", now=clock.advance(15))  # an event, no handover
    assert store.last_recorded_at() == t0 + 25
    finish(store, launch.attempt_id, clock.advance(5), exit_code=0)
    assert store.last_recorded_at() == t0 + 30
