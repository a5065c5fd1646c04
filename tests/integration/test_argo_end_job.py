"""Every job that will start nothing more reaches the executor, durably (docs/cluster.md "When a
job will start nothing more"): the store lists finished jobs until `Executor.end_job` took them
(`jobs_to_end`, `mark_jobs_ended`), so neither a cancel the loop never saw nor a restart leaves a
Workflow with a gated pod waiting.

With the Argo world (`tests/argo_world.py`: the real loop and `ArgoExecutor` against the fake API
server and the simulated Argo controller): a cancel through the API of a job none of whose steps
holds GPUs, while Argo already made the next step's gated pod → `spec.shutdown: Stop`, the pod is
gone; a restart between the job's end and `end_job` → the new loop stops it; `end_job` failing
(503) → retried at the next tick; a failed job stopped once; a queued job cancelled before it
had a Workflow (nothing to stop) marked all the same. With the scripted executor, on SQLite,
PostgreSQL and memory: a job whose `end_job` keeps failing holds back neither the others nor,
past a batch, later jobs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from argo_sim import Script
from argo_world import NS, World, argo_world, two_steps
from conftest import open_store
from lowtide.control import loop as loop_module
from lowtide.control.clock import FakeClock
from lowtide.control.executor_port import ExecutorError
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.states import JobState
from lowtide.sim.harness import LoopHarness
from lowtide.sim.scripted import FakeExecutor

ONE_NODE = (Node("n1", (0, 1)),)


@pytest.fixture
def w() -> Iterator[World]:
    yield from argo_world(nodes=ONE_NODE)


def waiting_at_the_gate(w: World) -> str:
    """A two-step job whose `prep` finished while a filler holds a GPU, so `train` (2 GPUs) waits
    for lowtide: Argo made its pod, gated. Returns the job id."""
    job = w.h.submit(two_steps())
    filler = w.h.submit({"name": "filler", "steps": [{"name": "f", "command": ["f"], "gpus": 1}]})
    w.sim.script(filler, "f", Script(run_s=100_000))
    w.sim.script(job, "prep", Script(run_s=3))
    w.run(lambda: w.h.step(job, "prep").state.value == "SUCCEEDED" and gated_pod(w, job) is not None)
    w.run(lambda: w.h.step(job, "train").state.value == "READY", limit=5)
    assert w.running(filler, "f")
    return job


def gated_pod(w: World, job: str) -> dict[str, Any] | None:
    pods = [
        p
        for p in w.cluster.list("pods", NS)
        if p["metadata"]["labels"].get("lowtide.io/job") == job
        and p["metadata"]["labels"].get("lowtide.io/step") == "train"
    ]
    return next((p for p in pods if p["spec"].get("schedulingGates")), None)


def stopped(w: World, job: str) -> bool:
    return w.sim.workflow(job)["spec"].get("shutdown") == "Stop"


def test_an_api_cancel_of_a_job_holding_no_gpus_stops_its_workflow(w: World) -> None:
    job = waiting_at_the_gate(w)
    assert not stopped(w, job)
    w.h.store.request_cancel(job, by="alice", now=w.h.clock.now())
    assert w.job_state(job) == "CANCELLED"  # at once: no step had notice to wait for
    w.h.tick()
    assert stopped(w, job)
    assert w.h.store.jobs_to_end() == []  # marked: not ended again
    w.sim.step()  # Argo deletes the pending pod and starts nothing more
    w.sim.step()
    assert gated_pod(w, job) is None
    assert w.sim.workflow(job)["status"]["phase"] == "Failed"
    patches = [r for r in w.cluster.requests if r.verb == "patch" and r.resource == "workflows"]
    assert [r.code for r in patches] == [200]  # once


def test_a_restart_between_the_jobs_end_and_end_job_still_stops_it(w: World) -> None:
    job = waiting_at_the_gate(w)
    w.h.store.request_cancel(job, by="alice", now=w.h.clock.now())
    # The control plane dies before its next tick; a new one, whose executor knows nothing, starts.
    w.h.executor.close()
    w.h.executor = w.executor()
    w.h.restart()
    w.h.tick()
    assert stopped(w, job)
    w.sim.step()
    w.sim.step()
    assert gated_pod(w, job) is None


def test_an_end_job_that_fails_is_retried_at_the_next_tick(w: World) -> None:
    job = waiting_at_the_gate(w)
    w.cluster.inject("patch", "workflows", status=503, times=2)
    w.h.store.request_cancel(job, by="alice", now=w.h.clock.now())
    w.h.tick()
    assert not stopped(w, job) and w.h.store.jobs_to_end() == [job]  # 503: still to end
    w.h.tick()
    assert not stopped(w, job) and w.h.store.jobs_to_end() == [job]
    w.h.tick()
    assert stopped(w, job) and w.h.store.jobs_to_end() == []
    patches = [r.code for r in w.cluster.requests if r.verb == "patch" and r.resource == "workflows"]
    assert patches == [503, 503, 200]


def test_a_failed_job_stops_its_workflow_once_and_is_marked(w: World) -> None:
    job = w.h.submit({"name": "f", "max_retries": 0, "steps": [{"name": "t", "command": ["t"], "gpus": 1}]})
    w.sim.script(job, "t", Script(run_s=2, exit_code=1))
    w.run(lambda: w.job_state(job) == "FAILED")
    w.h.tick(3)
    assert stopped(w, job) and w.h.store.jobs_to_end() == []
    patches = [r.code for r in w.cluster.requests if r.verb == "patch" and r.resource == "workflows"]
    assert patches == [200]


# -- the loop's side, with the scripted executor, on every store backend ------------------------


@dataclass
class FlakyEnds(FakeExecutor):
    """`end_job` raises a temporary ExecutorError for the jobs in `failing`."""

    failing: set[str] = field(default_factory=set)
    tries: list[str] = field(default_factory=list)

    def end_job(self, job_id: str, now: float) -> None:
        self.tries.append(job_id)
        if job_id in self.failing:
            raise ExecutorError("the API server answered 503", temporary=True)
        super().end_job(job_id, now)


def harness(store_url: str, executor: FlakyEnds) -> LoopHarness:
    h = LoopHarness(
        nodes=(Node("n1", (0, 1, 2, 3)),),
        layout=ArtifactLayout("/art", "/work"),
        clock=FakeClock(1_800_000_000.0),
        store=open_store(store_url),  # type: ignore[arg-type]
        executor=executor,
    )
    h.recover()
    return h


def small(name: str) -> dict[str, Any]:
    return {"name": name, "steps": [{"name": "t", "command": ["t"], "gpus": 1}]}


def test_one_failing_end_job_stops_no_other_and_is_retried_across_a_restart(store_url: str) -> None:
    executor = FlakyEnds()
    h = harness(store_url, executor)
    try:
        bad, good = h.submit(small("bad")), h.submit(small("good"))
        executor.failing.add(bad)
        for job in (bad, good):
            h.store.request_cancel(job, by="alice", now=h.clock.now())
        h.tick()
        assert executor.ended_jobs == [good]
        assert h.store.jobs_to_end() == [bad]
        h.tick(2)
        assert executor.tries.count(bad) == 3 and executor.ended_jobs == [good]  # every tick
        h.restart()  # the store remembers what is left to end, not the loop
        executor.failing.clear()
        h.tick()
        assert executor.ended_jobs == [good, bad] and h.store.jobs_to_end() == []
        h.tick(2)
        assert executor.ended_jobs == [good, bad]  # each once
        assert h.store.job(bad).state == JobState.CANCELLED
    finally:
        h.close()


def test_jobs_that_keep_failing_do_not_hold_back_later_ones(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loop_module, "END_JOBS_BATCH", 2)
    executor = FlakyEnds()
    h = harness(store_url, executor)
    try:
        jobs = [h.submit(small(f"j{i}")) for i in range(5)]
        executor.failing.update(jobs[:3])  # more failing jobs than a batch holds
        for job in jobs:
            h.store.request_cancel(job, by="alice", now=h.clock.now())
        h.tick(3)
        assert sorted(executor.ended_jobs) == jobs[3:]
        assert h.store.jobs_to_end() == jobs[:3]
    finally:
        h.close()


def test_a_queued_job_cancelled_before_its_workflow_exists_is_marked_ended(w: World) -> None:
    blocker = w.h.submit({"name": "b", "steps": [{"name": "b", "command": ["b"], "gpus": 2}]})
    w.sim.script(blocker, "b", Script(run_s=100_000))
    w.run(lambda: w.running(blocker, "b"))
    job = w.h.submit({"name": "q", "steps": [{"name": "t", "command": ["t"], "gpus": 1}]})
    w.h.tick()  # it waits for a GPU: no attempt, no Workflow
    w.h.store.request_cancel(job, by="alice", now=w.h.clock.now())
    w.h.tick()
    assert w.h.store.jobs_to_end() == []  # nothing to stop (404) is done: marked
    assert [wf["metadata"]["name"] for wf in w.cluster.list("workflows", NS)] == [blocker]
    patches = [r.code for r in w.cluster.requests if r.verb == "patch" and r.resource == "workflows"]
    assert patches == [404]
