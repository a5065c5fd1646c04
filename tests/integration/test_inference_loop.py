"""The real control loop with the inference side, a real SQLite store, a fake clock and fake
ports (service manager, metrics, executor): how load, staleness and lending windows decide which
GPUs research gets."""

from __future__ import annotations

import itertools
from dataclasses import replace
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


def world(
    root: Path, lending: LendingPolicy | None = None, start: float = NOON, spec: ServiceSpec = SPEC
) -> LoopHarness:
    w = LoopHarness(
        nodes=NODES,
        layout=LAYOUT,
        clock=FakeClock(start),
        store=Store.open(f"sqlite:///{root / 'db.sqlite'}"),
        services=(ServiceSetup(spec=spec, command=("serve", "{port}"), base_port=9000),),
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
    # The panic window sees it first (1 → 2: the step cap doubles at most), a scale-up window
    # (5 s) later the rest.
    w.tick(n=8)
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


def test_a_step_lent_a_sleeping_replicas_gpus_gets_a_memory_limit_and_past_the_host_ram_budget_replicas_stop(
    tmp_path: Path,
) -> None:
    """Issue 9, defect 4: four replicas of 2 GPUs on one node whose sleeping replicas may hold
    100 GiB of host RAM, 40 GiB of weights each: scaled down to one, two of the three drained
    replicas sleep and the third parks by stop, saying why; a research step placed on the
    sleepers' GPUs gets LOWTIDE_GPU_MEMORY_LIMIT_GIB = 80 − 2.5 GiB in its environment."""
    spec = ServiceSpec(
        name="chat",
        model="m",
        gpus_per_replica=2,
        min_replicas=1,
        max_replicas=4,
        park="sleep",
        sleep_residual_gib=2.5,
        weights_host_gib=40.0,
        autoscale=SPEC.autoscale,
    )
    w = LoopHarness(
        nodes=(Node("n1", tuple(range(8)), gpu_memory_gib=80.0, sleep_host_ram_gib=100.0),),
        layout=LAYOUT,
        clock=FakeClock(NOON),
        store=Store.open(f"sqlite:///{tmp_path / 'db.sqlite'}"),
        services=(ServiceSetup(spec=spec, command=("serve", "{port}"), base_port=9000),),
        lending=LendingPolicy(reclaim_lead_s=30, stale_after_s=10, stale_reclaim_after_s=60),
        sources={"chat": FakeMetrics()},
    )
    w.recover()
    w.sources["chat"].concurrency = 16.0  # 4 per replica → 4 replicas (step by step: capped)
    w.tick(n=20)
    assert replica_states(w) == ["SERVING"] * 4
    w.sources["chat"].concurrency = 0.0
    w.tick(n=30)  # past the scale-down stabilisation: drain three, then park them
    replicas = {r.id: r for r in w.store.replicas("chat")}
    parked = sorted((r.id, r.parked_as) for r in replicas.values() if r.state.value == "PARKED")
    assert [p for _, p in parked] == ["sleep", "sleep", "stop"], parked
    stopped = next(rid for rid, p in parked if p == "stop")
    messages = [e.message for e in w.store.service_events("chat") if e.replica_id == stopped]
    assert any("parked by stop, not sleep" in m and "80 of 100 GiB" in m for m in messages), messages

    job = w.submit(job_doc(6))  # every GPU but the serving replica's
    w.tick(n=2)
    assert w.step(job).state.value == "RUNNING"
    (request,) = w.executor.launched
    sleeping_gpus = {g for r in replicas.values() if r.parked_as == "sleep" for g in r.gpus}
    assert sleeping_gpus <= set(request.gpus)
    assert request.env["LOWTIDE_GPU_MEMORY_LIMIT_GIB"] == "77.5"
    assert request.env["LOWTIDE_GPU_MEMORY_RESERVED_GIB"] == "2.5"


def preempted_by_a_spike(root: Path, max_scale_up_rate: float | None) -> tuple[int, int]:
    """One replica serving, six 1-GPU research steps on the other six GPUs; then a spike of 16
    requests per replica (4 replicas' worth at 4 per replica) for 4 s and back to 1. Returns (research
    attempts told to stop, the most replicas desired).

    The lending growth reserve is off (`reclaim_lead_s=0`): it extrapolates the slope of the
    needed count over the lead time up to max_replicas, so even one capped step (1 → 2) would
    reserve every GPU of max_replicas — that is policy.lending's to bound, not the autoscaler's."""
    spec = replace(
        SPEC,
        max_replicas=4,
        park="stop",
        autoscale=replace(SPEC.autoscale, max_scale_up_rate=max_scale_up_rate),
    )
    lending = LendingPolicy(reclaim_lead_s=0, stale_after_s=10, stale_reclaim_after_s=60)
    w = world(root, lending, spec=spec)
    w.tick(n=2)
    jobs = [w.submit(job_doc(1)) for _ in range(6)]
    w.tick(n=2)
    assert [w.step(j).state.value for j in jobs] == ["RUNNING"] * 6
    executor = w.executor
    most = 0

    def tick() -> None:
        nonlocal most
        w.tick()
        for attempt_id, _ in executor.notices:
            if attempt_id in executor.running:
                executor.finish(attempt_id, 143)  # checkpointed, exits
        decision = w.inference.status["chat"].decision
        most = max(most, decision.desired if decision is not None else 0)

    w.sources["chat"].concurrency = 16.0
    for _ in range(4):
        tick()
    w.sources["chat"].concurrency = 1.0
    for _ in range(60):
        tick()
    return len({a for a, _ in executor.notices}), most


def test_a_single_spike_does_not_preempt_more_than_the_step_cap_allows(tmp_path: Path) -> None:
    """Issue 9, defect 5: one short spike took a service from 1 replica to many and preempted
    research on every GPU they needed. With the step cap (×2 or +1 per scale-up window) one step
    from 1 replica is 2: one more 2-GPU replica, so at most two 1-GPU research steps are stopped."""
    preempted, most = preempted_by_a_spike(tmp_path / "capped", 2.0)
    assert most == 2
    assert 1 <= preempted <= 2
    # The same spike without the cap: every replica it asked for, and research on all their GPUs.
    preempted, most = preempted_by_a_spike(tmp_path / "uncapped", None)
    assert most == 4
    assert preempted == 6


def test_the_services_page_gets_the_last_hour_of_load_from_the_control_plane(tmp_path: Path) -> None:
    w = world(tmp_path)
    w.tick(n=2)
    w.sources["chat"].concurrency = 3.0
    w.tick(n=30)  # 30 s of 1 s ticks: one sample every 5 s at most
    w.sources["chat"].stale = True
    w.tick(n=10)  # stale readings are no load sample
    samples = w.inference.status["chat"].history.samples()
    assert 7 <= len(samples) <= 9  # 32 s of readings
    assert all(b.at - a.at >= 5 for a, b in itertools.pairwise(samples))
    assert samples[-1].running == 3.0 and samples[-1].desired == 1
    assert samples[-1].at <= w.clock.now() - 10  # nothing kept while stale
    w.sources["chat"].stale = False
    w.tick(dt=3600)  # an hour later: the hour before is dropped
    assert [s.at for s in w.inference.status["chat"].history.samples()] == [w.clock.now()]
