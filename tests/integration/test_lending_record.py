"""The inference controller records the lending envelope's history (`policy.lending_history`):
a point at its first tick, one at every change of the lendable count, one every `RECORD_EVERY_S`
while it holds still, none otherwise; a write that fails is tried again at the next tick. The
real controller on the in-memory store, with the scripted service manager and metrics."""

from __future__ import annotations

from typing import Any

from lowtide.control.inference import InferenceController, ServiceSetup
from lowtide.control.records import StoreUnavailable
from lowtide.domain.gpus import Node
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec
from lowtide.policy.lending_history import RECORD_EVERY_S, LendingPoint
from lowtide.sim.scripted import FakeMetrics, FakeServiceManager
from lowtide.store.memory import MemoryStore

NODES = (Node("n1", (0, 1, 2, 3)),)
T0 = 1_796_126_400.0
SPEC = ServiceSpec(
    name="chat",
    model="m",
    gpus_per_replica=2,
    min_replicas=1,
    max_replicas=2,
    park="sleep",
    autoscale=AutoscaleTargets(concurrency_per_replica=4, kv_usage=None, tolerance=0),
)


class OutageStore(MemoryStore):
    """`record_lending` fails while `down` is set, as the SQL store does in an outage."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.attempts = 0

    def record_lending(self, point: LendingPoint, **kw: Any) -> None:
        self.attempts += 1
        if self.down:
            raise StoreUnavailable("sqlite: database is locked")
        super().record_lending(point, **kw)


def controller(store: MemoryStore) -> InferenceController:
    store.ensure_gpus(NODES, T0)
    return InferenceController(
        store=store,
        manager=FakeServiceManager(),
        sources={"chat": FakeMetrics()},
        gateway=None,
        services=(ServiceSetup(spec=SPEC, command=("serve",), base_port=9000),),
        lending=LendingPolicy(reclaim_lead_s=30, stale_after_s=10, stale_reclaim_after_s=600),
        nodes=NODES,
    )


def points(store: MemoryStore) -> list[tuple[float, int, str]]:
    return [(p.at - T0, p.lendable_gpus, p.mode) for p in store.lending_points(T0 - 1, T0 + 86400)]


def test_the_envelope_is_recorded_on_change_and_every_period_and_not_at_every_tick() -> None:
    store = OutageStore()
    inference = controller(store)
    # Never fresh since start: the fail safe lends nothing new (lendable 0); chat/0 starts.
    assert inference.tick(T0, running=()).envelope.lendable_gpus == 0
    assert points(store) == [(0.0, 0, "continuous")]
    # chat/0 serves with fresh metrics: it claims 2 GPUs, the other 2 are lendable at once.
    assert inference.tick(T0 + 1, running=()).envelope.lendable_gpus == 2
    assert points(store) == [(0.0, 0, "continuous"), (1.0, 2, "continuous")]
    for dt in (2.0, 3.0, RECORD_EVERY_S):  # steady: nothing new before the period has passed
        assert inference.tick(T0 + dt, running=()).envelope.lendable_gpus == 2
    assert len(points(store)) == 2 and store.attempts == 2
    inference.tick(T0 + 1 + RECORD_EVERY_S, running=())
    assert points(store)[2:] == [(1.0 + RECORD_EVERY_S, 2, "continuous")] and store.attempts == 3


def test_a_failed_write_is_tried_again_at_the_next_tick() -> None:
    store = OutageStore()
    inference = controller(store)
    inference.tick(T0, running=())
    store.down = True
    inference.tick(T0 + 1, running=())  # the loop goes on: the outage is logged, not raised
    assert points(store) == [(0.0, 0, "continuous")] and store.attempts == 2
    store.down = False
    inference.tick(T0 + 2, running=())
    assert points(store) == [(0.0, 0, "continuous"), (2.0, 2, "continuous")] and store.attempts == 3
