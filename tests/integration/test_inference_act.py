"""The acting half of `control.inference`: every item of a tick fails on its own. A replica start
whose GPUs turn out busy, or a replica event whose move finds the record moved, costs that item
and asks for a follow-up tick; the rest of the tick is decided on what the store really holds.
The real controller on the in-memory store, with the scripted service manager and metrics."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lowtide.control.inference import InferenceController, ServiceSetup
from lowtide.control.inference_ports import ReplicaEvent
from lowtide.control.records import GpuBusy, StaleState
from lowtide.domain.gpus import GpuRef, Node
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec
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


class FlakyStore(MemoryStore):
    """Fails the next `begin_replica` with GpuBusy, or the next `move_replica` with StaleState."""

    def __init__(self) -> None:
        super().__init__()
        self.busy_once = False
        self.stale_once = False

    def begin_replica(self, **kw: Any) -> Any:
        if self.busy_once:
            self.busy_once = False
            raise GpuBusy("someone took the GPUs")
        return super().begin_replica(**kw)

    def move_replica(self, *args: Any, **kw: Any) -> None:
        if self.stale_once:
            self.stale_once = False
            raise StaleState("moved meanwhile")
        super().move_replica(*args, **kw)


def controller(store: MemoryStore, manager: FakeServiceManager) -> InferenceController:
    store.ensure_gpus(NODES, T0)
    return InferenceController(
        store=store,
        manager=manager,
        sources={"chat": FakeMetrics()},
        gateway=None,
        services=(ServiceSetup(spec=SPEC, command=("serve",), base_port=9000),),
        lending=LendingPolicy(reclaim_lead_s=30, stale_after_s=10, stale_reclaim_after_s=60),
        nodes=NODES,
    )


def test_a_start_that_finds_its_gpus_busy_is_retried_and_research_sees_the_store_as_it_is() -> None:
    store, manager = FlakyStore(), FakeServiceManager()
    inference = controller(store, manager)
    # Its load data was fresh just now (a service never fresh since start lends nothing new,
    # issue 12; that is not what this test is about).
    inference.memory = replace(inference.memory, fresh_at={"chat": T0})
    store.busy_once = True
    tick = inference.tick(T0, running=())
    assert [a.kind for a in tick.plan.actions] == ["start"]
    assert tick.changed and store.replicas() == [] and manager.started == []
    # Nothing was booked: the GPUs the replica would have taken are not kept from research.
    assert tick.envelope.lendable_gpus == 2
    assert tick.unavailable == frozenset({GpuRef("n1", 2), GpuRef("n1", 3)})

    tick = inference.tick(T0 + 1, running=())
    assert manager.started == ["chat/0"] and not tick.changed
    assert [(r.id, r.state.value) for r in store.replicas()] == [("chat/0", "STARTING")]
    assert tick.unavailable == frozenset({GpuRef("n1", 0), GpuRef("n1", 1)})


def test_an_event_whose_move_is_stale_is_skipped_and_later_events_see_the_store() -> None:
    store, manager = FlakyStore(), FakeServiceManager()
    inference = controller(store, manager)
    inference.tick(T0, running=())  # chat/0 starts
    manager.running.clear()
    manager.poll = lambda now: [  # type: ignore[method-assign]
        ReplicaEvent("chat/0", "healthy", now),
        ReplicaEvent("chat/0", "failed", now, "crashed"),
    ]
    store.stale_once = True  # the healthy move fails; the failure is settled on STARTING
    tick = inference.tick(T0 + 1, running=())
    assert tick.changed
    rec = store.replica("chat/0")
    assert (rec.state.value, rec.failures, rec.message) == ("FAILED", 1, "failed: crashed; restart in 10s")
