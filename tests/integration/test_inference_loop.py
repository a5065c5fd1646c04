"""The real control loop with the inference side, a real SQLite store, a fake clock and fake
ports (service manager, metrics, executor): how load, staleness and lending windows decide which
GPUs research gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lowtide.control.clock import FakeClock
from lowtide.control.inference import ServiceSetup
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec, TimeWindow
from lowtide.sim.harness import LoopHarness
from lowtide.sim.scripted import FakeMetrics
from lowtide.store.repo import Store

NODES = (Node("n1", tuple(range(8))),)
LAYOUT = ArtifactLayout("/art", "/work")
# 2026-12-01 12:00 UTC: a Tuesday noon
NOON = 1_796_126_400.0

SPEC = ServiceSpec(
    name="chat",
    model="m",
    gpus_per_replica=2,
    min_replicas=1,
    max_replicas=3,
    park="sleep",
    autoscale=AutoscaleTargets(
        concurrency_per_replica=4,
        kv_usage=None,
        scale_up_window_s=5,
        scale_down_stabilization_s=20,
        tolerance=0,
    ),
)


def world(root: Path, lending: LendingPolicy | None = None, start: float = NOON) -> LoopHarness:
    w = LoopHarness(
        nodes=NODES,
        layout=LAYOUT,
        clock=FakeClock(start),
        store=Store.open(f"sqlite:///{root / 'db.sqlite'}"),
        services=(ServiceSetup(spec=SPEC, command=("serve", "{port}"), base_port=9000),),
        lending=lending or LendingPolicy(reclaim_lead_s=30, stale_after_s=10, stale_reclaim_after_s=60),
        sources={"chat": FakeMetrics()},
    )
    w.recover()
    return w


def job_doc(gpus: int) -> dict[str, Any]:
    return {"name": "r", "steps": [{"name": "s", "command": ["x"], "gpus": gpus}]}


def replica_states(w: LoopHarness) -> list[str]:
    return [r.state.value for r in w.store.replicas("chat")]


def test_load_takes_gpus_for_replicas_and_research_gets_what_is_left(tmp_path: Path) -> None:
    w = world(tmp_path)
    w.tick(n=2)
    assert replica_states(w) == ["SERVING"]  # min_replicas
    job = w.submit(job_doc(6))
    w.tick()
    assert w.step(job).state.value == "RUNNING"  # 8 − 2 for the one replica
    w.sources["chat"].concurrency = 10.0  # 10 per replica → 3 replicas needed
    w.tick(n=3)
    decision = w.inference.status["chat"].decision
    assert decision is not None and decision.desired == 3
    # No free GPUs for the new replicas: research holds them (taking them back is preemption).
    assert "largest free block is 0" in w.inference.status["chat"].blocked
    lending = w.inference.last.envelope  # type: ignore[union-attr]
    assert lending.lendable_gpus == 2
    late = w.submit(job_doc(1))
    w.tick()
    assert w.step(late).state.value == "READY"
    assert w.step(late).reason.endswith("; 2 GPUs of n1 not lendable now"), w.step(late).reason
    # The research step ends: its GPUs go to the waiting replicas first; research gets the rest.
    (attempt_id,) = w.executor.running
    w.executor.finish(attempt_id, 0)
    w.tick(n=3)
    assert replica_states(w) == ["SERVING", "SERVING", "SERVING"]
    assert w.step(late).state.value == "RUNNING"
    holders = [h.holder_kind for h in w.store.holdings()]
    assert (holders.count("replica"), holders.count("attempt"), holders.count("idle")) == (6, 1, 1)


def test_stale_metrics_lend_nothing_new_and_long_staleness_keeps_min_safe(tmp_path: Path) -> None:
    w = world(tmp_path)
    w.tick(n=2)
    w.sources["chat"].stale = True
    w.tick(n=3, dt=6)  # stale for > 10 s
    env = w.inference.last.envelope  # type: ignore[union-attr]
    assert env.fail_safe is not None and "no new lending" in env.fail_safe
    job = w.submit(job_doc(1))
    w.tick()
    assert w.step(job).state.value == "READY"  # 6 GPUs are free, but nothing new is lent
    w.sources["chat"].stale = False
    w.tick(n=2)
    assert w.step(job).state.value == "RUNNING"


def test_window_mode_lends_only_inside_the_window(tmp_path: Path) -> None:
    lending = LendingPolicy(
        mode="window",
        windows=(TimeWindow(20 * 60, 8 * 60),),
        timezone="UTC",
        reclaim_lead_s=60,
        stale_after_s=10,
        stale_reclaim_after_s=60,
    )
    w = world(tmp_path, lending, start=NOON)
    w.tick(n=2)
    job = w.submit(job_doc(2))
    w.tick()
    assert w.step(job).state.value == "READY"
    assert w.inference.last.envelope.lending_open is False  # type: ignore[union-attr]
    w.clock.set(NOON + 8 * 3600 + 1)  # 20:00:01
    w.tick(n=2)
    assert w.step(job).state.value == "RUNNING"


def test_a_replica_that_never_becomes_healthy_is_retried_with_backoff(tmp_path: Path) -> None:
    w = world(tmp_path)
    w.manager.broken.add("chat/0")
    w.tick(n=2)
    rec = w.store.replica("chat/0")
    assert rec.state.value == "FAILED" and rec.failures == 1 and rec.retry_at > w.clock.now()
    # Meanwhile another slot starts, so the service is not left without a replica.
    w.tick(n=2)
    states = {r.id: r.state.value for r in w.store.replicas("chat")}
    assert states["chat/1"] == "SERVING"
    events = [e.kind for e in w.store.service_events("chat")]
    assert events[:2] == ["starting", "failed"]


def test_replicas_that_keep_failing_raise_an_alert_and_stop_new_lending(tmp_path: Path) -> None:
    w = world(tmp_path)
    w.manager.broken.update({"chat/0", "chat/1", "chat/2"})
    for _ in range(120):
        w.tick(dt=1.0)
        if w.inference.status["chat"].alert:
            break
    status = w.inference.status["chat"]
    assert "replica start failures in a row" in status.alert
    env = w.inference.last.envelope  # type: ignore[union-attr]
    assert env.fail_safe is not None and "no new lending" in env.fail_safe
    job = w.submit(job_doc(1))
    w.tick()
    assert w.step(job).state.value == "READY"
    assert [e.kind for e in w.store.service_events("chat")].count("alert") == 1
    w.manager.broken.clear()  # fixed: the next restart serves, the alert clears, lending resumes
    for _ in range(120):
        w.tick(dt=1.0)
        if w.step(job).state.value == "RUNNING":
            break
    assert w.step(job).state.value == "RUNNING"
    assert w.inference.status["chat"].alert == ""
    assert any(r.failures == 0 and r.state.value == "SERVING" for r in w.store.replicas("chat"))
