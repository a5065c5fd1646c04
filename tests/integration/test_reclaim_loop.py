"""Lend, reclaim, resume — the story driven by the real control loop with a fake clock and fake
ports (executor, service manager, metrics) on a real SQLite store and on the in-memory store: a
load surge takes GPUs back from the research step that loses the least work, the replica serves
within the bound, and the step resumes from its checkpoint when the load is gone. Every story
runs on both stores, and both must leave exactly the same records behind."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from lowtide.control.clock import FakeClock
from lowtide.control.inference import ServiceSetup
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec, TimeWindow
from lowtide.sim.harness import LoopHarness
from lowtide.sim.scripted import FakeMetrics
from lowtide.store.memory import MemoryStore
from lowtide.store.repo import Store

NODES = (Node("n1", (0, 1)), Node("n2", (0, 1)), Node("n3", (0, 1)))
LAYOUT = ArtifactLayout("/art", "/work")
T0 = 1_796_126_400.0
TICK = 1.0
GRACE = 30.0
WAKE = 5.0
SPEC = ServiceSpec(
    name="chat",
    model="m",
    gpus_per_replica=2,
    min_replicas=1,
    max_replicas=2,
    park="sleep",
    startup_s=WAKE,
    wake_s=WAKE,
    autoscale=AutoscaleTargets(
        concurrency_per_replica=4,
        kv_usage=None,
        scale_up_window_s=2,
        scale_down_stabilization_s=20,
        tolerance=0,
    ),
)


BACKENDS = ("sqlite", "memory")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def world(
    root: Path, lending: LendingPolicy | None = None, start: float = T0, backend: str = "sqlite"
) -> LoopHarness:
    store = Store.open(f"sqlite:///{root / 'db.sqlite'}") if backend == "sqlite" else MemoryStore()
    w = LoopHarness(
        nodes=NODES,
        layout=LAYOUT,
        clock=FakeClock(start),
        store=store,
        services=(ServiceSetup(spec=SPEC, command=("serve",), base_port=9000, reclaim_grace_s=GRACE),),
        lending=lending
        or LendingPolicy(reclaim_lead_s=TICK + GRACE + WAKE, stale_after_s=30, stale_reclaim_after_s=120),
        sources={"chat": FakeMetrics()},
        tick_s=TICK,
    )
    w.recover()
    return w


def job_doc(name: str, gpus: int, grace: float = 120.0) -> dict[str, Any]:
    return {
        "name": name,
        "grace_seconds": grace,
        "steps": [{"name": "train", "command": ["train"], "gpus": gpus, "checkpoint": True}],
    }


def surge_story(root: Path, backend: str) -> LoopHarness:
    w = world(root, backend=backend)
    w.tick(2)
    assert [r.state.value for r in w.store.replicas("chat")] == ["SERVING"]
    a = w.submit(job_doc("often-checkpoints", gpus=2))
    b = w.submit(job_doc("never-checkpoints", gpus=2))
    w.tick()
    att_a, att_b = w.last_attempt(a), w.last_attempt(b)
    assert {att_a.node, att_b.node} == {"n2", "n3"}
    # A checkpointed recently; B never did.
    w.tick(50)
    w.store.record_checkpoint(att_a.id, label="step-50", progress=None, source="api", now=w.clock.now())
    w.tick(40)

    # The surge: 8 requests per replica → 2 replicas wanted, no free block of 2.
    w.sources["chat"].concurrency = 8.0
    surge_at = w.clock.now()
    w.tick(2)
    a_step = w.store.job_detail(a).steps[0]
    assert a_step.state.value == "PREEMPTING", a_step
    assert w.store.job_detail(b).steps[0].state.value == "RUNNING"
    assert [aid for aid, _ in w.executor.notices] == [att_a.id]
    (reclaim,) = w.store.reclaims()
    assert reclaim.victims == (att_a.id,) and reclaim.service == "chat" and reclaim.state == "OPEN"
    att = w.store.attempt(att_a.id)
    assert att.stop_deadline is not None and att.stop_deadline - att.notice_at == GRACE  # type: ignore[operator]

    # A checkpoints and exits within its grace; the GPUs go to the replica, which serves.
    w.clock.advance(3)
    w.store.record_checkpoint(att_a.id, label="step-93", progress=None, source="file", now=w.clock.now())
    w.executor.finish(att_a.id, 143)
    w.tick(3)
    states = {r.id: r.state.value for r in w.store.replicas("chat")}
    assert states == {"chat/0": "SERVING", "chat/1": "SERVING"}
    assert w.store.replica("chat/1").node == att_a.node
    (reclaim,) = w.store.reclaims()
    assert reclaim.state == "DONE"
    assert (
        reclaim.detected_at
        <= reclaim.decided_at
        <= reclaim.notice_at
        <= reclaim.freed_at
        <= reclaim.healthy_at
    )  # type: ignore[operator]
    assert reclaim.healthy_at - surge_at <= TICK + GRACE + WAKE + 1  # type: ignore[operator]
    done = w.store.attempt(att_a.id)
    assert done.state.value == "INTERRUPTED"
    # It checkpointed just before exiting; the exit is seen at the next tick: 2 GPUs × 1 s lost.
    assert done.lost_gpu_seconds == 2 * TICK
    step = w.store.job_detail(a).steps[0]
    assert (step.state.value, step.preemptions, step.retries_used) == ("PREEMPTED", 1, 0)

    # The load goes; after the stabilisation window the replica sleeps and A resumes on its GPUs.
    w.sources["chat"].concurrency = 0.0
    for _ in range(60):
        w.tick()
        if w.store.job_detail(a).steps[0].state.value == "RUNNING":
            break
    assert w.store.replica("chat/1").state.value == "PARKED"
    resumed = w.last_attempt(a)
    assert resumed.number == 2
    launch = w.executor.launched[-1]
    assert launch.env["LOWTIDE_ATTEMPT"] == "2"
    assert launch.env["LOWTIDE_RESUME_FROM"] == "/art/jobs/job-000000000000/train/checkpoints/step-93"
    w.executor.finish(resumed.id, 0)
    w.tick(2)
    assert w.store.job(a).state.value == "SUCCEEDED"
    assert w.store.job_detail(b).steps[0].state.value == "RUNNING"  # never touched
    return w


def stubborn_story(root: Path, backend: str) -> LoopHarness:
    w = world(root, backend=backend)
    w.tick(2)
    a = w.submit(job_doc("stubborn", gpus=2))
    b = w.submit(job_doc("other", gpus=2))
    w.tick(10)
    w.sources["chat"].concurrency = 8.0
    w.tick(2)
    victim = next(att for j in (a, b) for att in [w.last_attempt(j)] if att.state.value == "STOPPING")
    w.tick(int(GRACE) + 2)  # the fake executor kills at the deadline
    killed = w.store.attempt(victim.id)
    assert killed.killed_at_deadline and killed.state.value == "INTERRUPTED"
    assert killed.lost_gpu_seconds and killed.lost_gpu_seconds > 0
    job = a if victim.job_id == a else b
    assert w.store.job_detail(job).steps[0].state.value == "PREEMPTED"
    return w


def window_story(root: Path, backend: str) -> LoopHarness:
    lead = TICK + GRACE + WAKE
    close = T0 + 20 * 3600  # T0 is 12:00 UTC; the window is 20:00–08:00, so it closes at 08:00 next day
    lending = LendingPolicy(
        mode="window",
        windows=(TimeWindow(20 * 60, 8 * 60),),
        timezone="UTC",
        reclaim_lead_s=lead,
        stale_after_s=30,
        stale_reclaim_after_s=120,
    )
    w = world(root, lending, start=close - 600, backend=backend)  # 07:50: lending is open
    w.tick(2)
    polite = w.submit(job_doc("polite", gpus=2))
    stubborn = w.submit(job_doc("stubborn", gpus=2))
    w.tick()
    assert {w.last_attempt(j).state.value for j in (polite, stubborn)} == {"RUNNING"}
    while w.clock.now() < close - lead - TICK:
        w.tick()
    assert not w.executor.notices  # nothing is reclaimed before close − lead
    w.tick(2)
    noticed = {aid for aid, _ in w.executor.notices}
    assert noticed == {w.last_attempt(polite).id, w.last_attempt(stubborn).id}
    assert all(at <= close - lead + TICK for _, at in w.executor.notices)
    w.executor.finish(w.last_attempt(polite).id, 143)  # checkpoints and leaves; the other ignores notice
    while w.clock.now() < close:
        w.tick()
    held = [h for h in w.store.holdings() if h.holder_kind == "attempt"]
    assert held == []  # every lent GPU is back when the window closes
    assert w.store.attempt(w.last_attempt(stubborn).id).killed_at_deadline
    reclaims = w.store.reclaims()
    assert reclaims and all(r.service is None and r.state == "DONE" for r in reclaims)
    assert all(
        j.steps[0].state.value == "PREEMPTED"
        for j in (w.store.job_detail(polite), w.store.job_detail(stubborn))
    )
    return w


def test_surge_preempts_the_cheapest_step_the_replica_serves_in_time_and_the_step_resumes(
    tmp_path: Path, backend: str
) -> None:
    surge_story(tmp_path, backend)


def test_a_step_that_ignores_notice_is_killed_at_its_deadline_and_still_requeued(
    tmp_path: Path, backend: str
) -> None:
    stubborn_story(tmp_path, backend)


def test_window_mode_gets_every_lent_gpu_back_before_the_window_closes(tmp_path: Path, backend: str) -> None:
    window_story(tmp_path, backend)


def digest(w: LoopHarness) -> dict[str, Any]:
    """Everything the store and the fakes recorded, as comparable values."""
    store = w.store
    now = w.clock.now()
    return {
        "jobs": [store.job_detail(j.id) for j in store.list_jobs(limit=1000)],
        "replicas": store.replicas(),
        "service_events": store.service_events("chat", limit=10_000),
        "reclaims": store.reclaims(),
        "holdings": store.holdings(),
        "counts": store.counts(),
        "preemptions": store.preemption_totals(),
        "snapshot": store.snapshot(now=now, nodes=NODES, half_life_s=600.0),
        "report": [store.usage_report(T0 - 86_400, now + 1, group_by=g) for g in ("job", "day", "holder")],
        "by_holder": store.gpu_seconds_by_holder(T0 - 86_400, now + 1),
        "notices": w.executor.notices,
        # Step tokens are random: everything else a launch carries must match.
        "launched": [
            replace(r, env={k: v for k, v in r.env.items() if k != "LOWTIDE_STEP_TOKEN"})
            for r in w.executor.launched
        ],
        "replicas_started": w.manager.started,
        "plan": w.loop.last_plan,
    }


@pytest.mark.parametrize("story", [surge_story, stubborn_story, window_story], ids=lambda f: f.__name__)
def test_the_loop_leaves_the_same_records_on_sqlite_and_in_memory(
    tmp_path: Path, story: Callable[[Path, str], LoopHarness]
) -> None:
    on_sqlite = digest(story(tmp_path / "sqlite", "sqlite"))
    in_memory = digest(story(tmp_path / "memory", "memory"))
    assert on_sqlite.keys() == in_memory.keys()
    for key, value in on_sqlite.items():
        assert value == in_memory[key], key
    assert on_sqlite["jobs"] and on_sqlite["reclaims"]
