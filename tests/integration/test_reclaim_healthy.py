"""A reclaim for a service ends DONE only with `healthy_at` (issue 11: the demo's reclaims showed
"replica healthy: -"). Through the production loop (`sim.harness.LoopHarness`, continuous
lending): a service grows while free GPUs remain, so this tick's replica action starts what it
wants there (no deficit left) and its larger claim and growth reserve shrink lending; the lent
GPUs that come back are for that service, and the reclaim waits for its replica to serve. Lending
that shrinks for no replica (a window closing: tests/integration/test_reclaim_loop.py) is the one
reclaim that ends DONE without `healthy_at`."""

from __future__ import annotations

from typing import Any

import pytest

from lowtide.control.clock import FakeClock
from lowtide.control.inference import ServiceSetup
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec
from lowtide.sim.harness import LoopHarness
from lowtide.sim.scripted import FakeMetrics
from lowtide.store.memory import MemoryStore

T0 = 1_796_126_400.0
GRACE = 30.0
SPEC = ServiceSpec(
    name="chat",
    model="m",
    gpus_per_replica=2,
    min_replicas=1,
    max_replicas=3,
    park="sleep",
    startup_s=5.0,
    wake_s=5.0,
    autoscale=AutoscaleTargets(
        concurrency_per_replica=4,
        kv_usage=None,
        scale_up_window_s=2,
        scale_down_stabilization_s=20,
        tolerance=0,
    ),
)


def job_doc(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "grace_seconds": 120,
        "steps": [{"name": "train", "command": ["train"], "gpus": 2, "checkpoint": True}],
    }


@pytest.mark.parametrize("concurrency", [6.0, 12.0])
def test_a_reclaim_for_a_growing_service_ends_done_only_once_a_replica_serves(concurrency: float) -> None:
    nodes = tuple(Node(f"n{i}", (0, 1)) for i in range(1, 5))
    w = LoopHarness(
        nodes=nodes,
        layout=ArtifactLayout("/art", "/work"),
        clock=FakeClock(T0),
        store=MemoryStore(),
        services=(ServiceSetup(spec=SPEC, command=("serve",), base_port=9000, reclaim_grace_s=GRACE),),
        lending=LendingPolicy(reclaim_lead_s=1 + GRACE + 5, stale_after_s=30, stale_reclaim_after_s=120),
        sources={"chat": FakeMetrics()},
        tick_s=1.0,
    )
    w.recover()
    w.tick(2)
    jobs = [w.submit(job_doc("a")), w.submit(job_doc("b"))]
    w.tick(60)
    assert sorted(h.holder_kind for h in w.store.holdings()).count("idle") == 2  # one node free
    w.sources["chat"].concurrency = concurrency  # 6: two replicas wanted, one starts on the free node
    finished: set[int] = set()
    for _ in range(120):
        w.tick()
        for job in jobs:
            att = w.last_attempt(job)
            if att.state.value == "STOPPING" and att.id not in finished:
                w.executor.finish(att.id, 143)  # checkpoints and leaves on notice
                finished.add(att.id)
    reclaims = w.store.reclaims()
    assert reclaims, "lending shrank: some lent GPUs came back"
    for r in reclaims:
        assert r.service == "chat", r  # not a reclaim "for lending" that no replica waits for
        assert r.state == "DONE", r
        assert r.healthy_at is not None, r
        assert r.decided_at <= r.healthy_at
        assert r.freed_at is not None and r.notice_at is not None
    assert {x.state.value for x in w.store.replicas()} == {"SERVING"}
