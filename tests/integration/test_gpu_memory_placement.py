"""A step that declares `gpu_memory_gib` waits while the GPUs lent to research are a sleeping
replica's with less memory left; a step without a need runs there (issue 9, defect 4; the loop,
the inference side and the SQLite store together)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lowtide.control.clock import FakeClock
from lowtide.control.inference import ServiceSetup
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec
from lowtide.sim.harness import LoopHarness
from lowtide.sim.scripted import FakeMetrics
from lowtide.store.repo import Store

NOON = 1_796_126_400.0  # 2026-12-01 12:00 UTC

SPEC = ServiceSpec(
    name="chat",
    model="m",
    gpus_per_replica=2,
    min_replicas=1,
    max_replicas=3,
    park="sleep",
    sleep_residual_gib=2.5,
    autoscale=AutoscaleTargets(
        concurrency_per_replica=4,
        kv_usage=None,
        scale_up_window_s=5,
        scale_down_stabilization_s=20,
        tolerance=0,
    ),
)


def job_doc(gpus: int, gpu_memory_gib: float | None = None) -> dict[str, Any]:
    step: dict[str, Any] = {"name": "s", "command": ["x"], "gpus": gpus}
    if gpu_memory_gib is not None:
        step["gpu_memory_gib"] = gpu_memory_gib
    return {"name": "r", "steps": [step]}


def test_a_step_needing_more_than_a_sleeping_replicas_gpus_have_left_waits_while_one_without_a_need_runs(
    tmp_path: Path,
) -> None:
    """Three replicas of 2 GPUs on a node of 6 GPUs of 80 GiB: scaled down to one, the other two
    sleep holding 2.5 GiB per GPU, so the 4 GPUs lent to research have 77.5 GiB left each."""
    w = LoopHarness(
        nodes=(Node("n1", tuple(range(6)), gpu_memory_gib=80.0),),
        layout=ArtifactLayout("/art", "/work"),
        clock=FakeClock(NOON),
        store=Store.open(f"sqlite:///{tmp_path / 'db.sqlite'}"),
        services=(ServiceSetup(spec=SPEC, command=("serve", "{port}"), base_port=9000),),
        lending=LendingPolicy(reclaim_lead_s=30, stale_after_s=10, stale_reclaim_after_s=60),
        sources={"chat": FakeMetrics()},
    )
    w.recover()
    w.sources["chat"].concurrency = 12.0  # 3 replicas
    w.tick(n=20)
    assert [r.state.value for r in w.store.replicas("chat")] == ["SERVING"] * 3
    w.sources["chat"].concurrency = 0.0
    w.tick(n=30)  # past the scale-down stabilisation: two replicas drain and sleep
    sleeping = [r for r in w.store.replicas("chat") if r.state.value == "PARKED" and r.parked_as == "sleep"]
    assert len(sleeping) == 2
    sleeping_gpus = {g for r in sleeping for g in r.gpus}

    needs = w.submit(job_doc(2, gpu_memory_gib=78.0))
    fits = w.submit(job_doc(2, gpu_memory_gib=77.5))
    plain = w.submit(job_doc(2))
    w.tick(n=3)
    assert w.step(needs).state.value == "READY"
    assert w.step(needs).reason.startswith(
        "needs 78 GiB per GPU (2 GPUs on one node): 4 GPUs under sleeping replicas have "
        "80 − 2.5 = 77.5 GiB free"
    ), w.step(needs).reason
    assert w.step(fits).state.value == "RUNNING"
    assert w.step(plain).state.value == "RUNNING"
    assert len(w.executor.launched) == 2
    assert {g for request in w.executor.launched for g in request.gpus} == sleeping_gpus
    for request in w.executor.launched:
        assert request.env["LOWTIDE_GPU_MEMORY_LIMIT_GIB"] == "77.5"
