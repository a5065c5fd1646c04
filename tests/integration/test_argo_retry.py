"""`lowtide retry` of a FAILED or CANCELLED job in cluster mode (docs/cluster.md "Retrying a job"):
each retry is a new Workflow generation, `<job id>-r<N>`, holding only the steps the store has not
SUCCEEDED, because the job's earlier Workflow was stopped when the job ended and Argo runs no more
pods in it.

With the Argo world (`tests/argo_world.py`: the real loop and `ArgoExecutor` with the unmodified
`kubernetes` client against the fake API server and the simulated Argo controller and kubelet):
a two-step job whose second step fails → FAILED → its Workflow stopped → retry → a new Workflow
with only that step, which runs, the first step's pod never made again, the job SUCCEEDED; a
restart between the retry and the new Workflow's create (an earlier process's create went through
unseen) → the same name, one Workflow, 409 and reuse; a cancelled job retried, with a restart
while its retried step runs (adopted from the new generation); a job retried before the loop
ended it, whose generation 0 was never stopped and still holds a gated pod → that pod is never
admitted, the old Workflow is stopped when the new one is first used (or, cancelled again before
any launch, by `end_job`). `end_job` when the job no longer
compiles stops its running Workflows by label, and when the store cannot be read, the Workflow the
executor last compiled. Attempt numbers go on across generations: a retried step's pods carry
`lowtide.io/attempt` and `LOWTIDE_ATTEMPT` equal to the store's attempt number (Argo counts the
new Workflow's retries from 0; the compiled expression adds the attempts before the retry), while
the retry expression's budget is the whole `max_retries` again in the new generation.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

from argo_sim import Script
from argo_world import NS, SETTINGS, World, argo_world, two_steps
from lowtide.adapters.argo.executor import ArgoExecutor
from lowtide.adapters.argo.workflow import ATTEMPT_VALUE, ArgoCompileError, CompiledWorkflow
from lowtide.domain.gpus import Node
from lowtide.domain.states import AttemptState
from lowtide.wiring import argo_workflows

TOKEN_FILE = "/var/run/lowtide-token/token"
WORKFLOW_LABEL = "workflows.argoproj.io/workflow"


@pytest.fixture
def w() -> Iterator[World]:
    yield from argo_world()


@pytest.fixture
def one_node() -> Iterator[World]:
    yield from argo_world(nodes=(Node("n1", (0, 1)),))


def retry(w: World, job: str) -> str:
    """Retry the job in the store (as `POST /v1/jobs/{id}/retry` does); the name its new
    Workflow must have: the retry's time in milliseconds."""
    now = w.h.clock.now()
    w.h.store.retry_job(job, by="alice", now=now)
    return f"{job}-r{math.floor(now * 1000)}"


def workflows(w: World, job: str) -> list[str]:
    """The names of the job's Workflows (by lowtide's label)."""
    listed = w.cluster.list("workflows", NS, label_selector=f"lowtide.io/job={job}")
    return sorted(wf["metadata"]["name"] for wf in listed)


def tasks(w: World, workflow: str) -> list[dict[str, Any]]:
    wf = w.sim.workflow(workflow)
    (dag,) = [t for t in wf["spec"]["templates"] if "dag" in t]
    return list(dag["dag"]["tasks"])


def pods_made(w: World, workflow: str, step: str) -> list[str]:
    """Names of the pods Argo made for `step` in `workflow` (v2 names `<wf>-<template>-<hash>`)."""
    return [p for p in w.sim.created if p.startswith(f"{workflow}-{step}-")]


def attempt_numbers(w: World, pod_names: list[str]) -> list[tuple[str, str]]:
    """(label `lowtide.io/attempt`, env `LOWTIDE_ATTEMPT`) of each pod, as Argo resolved them."""
    out = []
    for name in pod_names:
        pod = w.cluster.get("pods", NS, name)
        (env,) = [e["value"] for e in pod["spec"]["containers"][0]["env"] if e["name"] == "LOWTIDE_ATTEMPT"]
        out.append((pod["metadata"]["labels"]["lowtide.io/attempt"], env))
    return out


def stopped(w: World, workflow: str) -> bool:
    return w.sim.workflow(workflow)["spec"].get("shutdown") == "Stop"


def failed_second_step(w: World) -> str:
    """A two-step job whose `train` fails with no retry left: FAILED, its Workflow stopped."""
    job = w.h.submit(two_steps({"max_retries": 0}))
    w.sim.script(job, "train", Script(run_s=3, exit_code=1))
    w.run(lambda: w.job_state(job) == "FAILED")
    w.h.tick()
    assert stopped(w, job) and w.h.store.jobs_to_end() == []
    return job


def test_a_failed_job_retried_runs_only_its_failed_step_in_a_new_workflow(w: World) -> None:
    job = failed_second_step(w)
    gen = retry(w, job)
    w.run(lambda: w.job_state(job) == "SUCCEEDED")

    assert workflows(w, job) == [job, gen]
    new = w.sim.workflow(gen)
    assert new["metadata"]["labels"] == {"lowtide.io/job": job}
    assert new["metadata"]["annotations"]["lowtide.io/generation"] == gen.rsplit("-r", 1)[1]
    assert tasks(w, gen) == [{"name": "train", "template": "train"}]  # prep's dependency dropped
    assert new["status"]["phase"] == "Succeeded"
    assert stopped(w, job) and w.sim.workflow(job)["status"]["phase"] == "Failed"  # left as it was
    # prep ran once, in generation 0: its pod was never made again.
    assert len(pods_made(w, job, "prep")) == 1 and pods_made(w, gen, "prep") == []
    (child,) = w.sim.retry_children(gen, "train")
    assert child["phase"] == "Succeeded"
    attempts = w.h.store.job_detail(job).attempts
    assert [(a.step_name, a.state) for a in attempts] == [
        ("prep", AttemptState.SUCCEEDED),
        ("train", AttemptState.FAILED),
        ("train", AttemptState.SUCCEEDED),
    ]
    (pod_name,) = pods_made(w, gen, "train")  # one pod: the retried attempt's
    # Its attempt number goes on from generation 0's (train's attempt 1 there): 2, as the store's.
    assert [a.number for a in attempts if a.step_name == "train"] == [1, 2]
    assert attempt_numbers(w, [pod_name]) == [("2", "2")]
    assert attempt_numbers(w, pods_made(w, job, "train")) == [("1", "1")]
    assert w.workflow_creates() == [201, 201]
    # The attempt's token went into the new generation's own Secret, owned by that Workflow.
    secret = w.cluster.get("secrets", NS, f"{gen}-step-tokens")
    assert secret["metadata"]["labels"] == {"lowtide.io/job": job}
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["name"], owner["uid"]) == (gen, new["metadata"]["uid"])
    assert w.sim.secret_files[pod_name][TOKEN_FILE]
    # The job SUCCEEDED: ended in the executor (its Workflow, already over, patched; no error).
    w.h.tick()
    assert w.h.store.jobs_to_end() == []
    stops = [r.name for r in w.cluster.requests if r.verb == "patch" and r.resource == "workflows"]
    assert stops == [job, gen]


def test_a_restart_between_the_retry_and_the_create_finds_the_same_single_workflow(w: World) -> None:
    job = failed_second_step(w)
    gen = retry(w, job)
    # A control plane created the new generation and died before it saw the answer ...
    compiled = argo_workflows(w.store, SETTINGS)(job)
    assert compiled.name == gen
    w.cluster.create("workflows", NS, compiled.manifest)
    # ... and a new one, whose executor knows nothing, takes over.
    w.h.executor.close()
    w.h.executor = w.executor()
    w.h.restart()
    w.run(lambda: w.job_state(job) == "SUCCEEDED")
    assert workflows(w, job) == [job, gen]
    assert w.workflow_creates() == [201, 409]  # answered AlreadyExists: read back and reused
    assert len(w.sim.retry_children(gen, "train")) == 1  # the step ran once in it
    assert pods_made(w, gen, "prep") == []


def test_a_cancelled_job_retried_resumes_in_a_new_workflow_across_a_restart(w: World) -> None:
    job = w.h.submit(two_steps())
    w.run(lambda: w.running(job, "train"))
    w.h.store.request_cancel(job, by="alice", now=w.h.clock.now())
    w.run(lambda: w.job_state(job) == "CANCELLED")
    w.h.tick()
    assert stopped(w, job) and w.h.store.jobs_to_end() == []
    gen = retry(w, job)
    w.sim.script(gen, "train", Script(run_s=30))
    w.run(lambda: w.running(job, "train"))
    running = w.h.last_attempt(job)
    (pod_name,) = pods_made(w, gen, "train")

    # A new control plane adopts the attempt from the new generation's pod; nothing is reaped.
    w.h.executor.close()
    w.h.executor = w.executor()
    report = w.h.restart()
    assert report.adopted == (running.id,) and report.lost == ()
    w.run(lambda: w.job_state(job) == "SUCCEEDED")
    assert w.h.store.attempt(running.id).state == AttemptState.SUCCEEDED  # its exit, from gen's node
    assert workflows(w, job) == [job, gen]
    assert tasks(w, gen) == [{"name": "train", "template": "train"}]
    assert len(pods_made(w, job, "prep")) == 1 and pods_made(w, gen, "prep") == []
    assert len(pods_made(w, job, "train")) == 1  # generation 0 made no pod after its Stop
    assert [t for t in w.sim.sigterms if t[0] == pod_name] == []  # the adopted pod was not reaped


def old_gated(w: World, job: str) -> list[dict[str, Any]]:
    """train's gated pods of the job's generation 0."""
    selector = f"{WORKFLOW_LABEL}={job},lowtide.io/step=train"
    return [
        p for p in w.cluster.list("pods", NS, label_selector=selector) if p["spec"].get("schedulingGates")
    ]


def retried_before_it_was_ended(w: World) -> tuple[str, str, str]:
    """On one node of 2 GPUs, a two-step job whose train (2 GPUs) waits for a filler's GPU, gated in
    generation 0, is cancelled through the API (no step holds GPUs: CANCELLED at once) and retried
    before the loop's next tick: the loop never ended generation 0, whose gated pod still waits.
    Returns (job, the new generation's name, the filler job)."""
    job = w.h.submit(two_steps())
    filler = w.h.submit({"name": "filler", "steps": [{"name": "f", "command": ["f"], "gpus": 1}]})
    w.sim.script(filler, "f", Script(run_s=100_000))
    w.sim.script(job, "prep", Script(run_s=3))
    w.run(lambda: w.h.step(job, "prep").state.value == "SUCCEEDED" and bool(old_gated(w, job)))
    w.h.store.request_cancel(job, by="alice", now=w.h.clock.now())
    gen = retry(w, job)
    assert w.job_state(job) == "RUNNING" and w.h.store.jobs_to_end() == []  # nothing to end now
    assert not stopped(w, job) and len(old_gated(w, job)) == 1
    return job, gen, filler


def test_a_gated_pod_of_an_older_generation_is_never_admitted(one_node: World) -> None:
    w = one_node
    job, gen, filler = retried_before_it_was_ended(w)
    (left,) = old_gated(w, job)
    w.h.store.request_cancel(filler, by="alice", now=w.h.clock.now())  # train's GPUs come free

    w.run(lambda: any(a.step_name == "train" for a in w.h.store.job_detail(job).attempts))
    # The launch created the new generation and stopped the old one; the old gated pod, still
    # there in this instant, was not taken: the attempt waits for the new generation's pod.
    attempt = w.h.last_attempt(job)
    assert attempt.handle == f"{NS}/@{job}/train"
    assert w.cluster.get("pods", NS, left["metadata"]["name"])["spec"].get("schedulingGates")
    assert stopped(w, job)
    assert workflows(w, job) == [job, gen]

    w.run(lambda: w.job_state(job) == "SUCCEEDED")
    admitted = {r.name for r in w.cluster.requests if r.verb == "patch" and r.resource == "pods"}
    assert left["metadata"]["name"] not in admitted
    assert [a.state for a in w.h.store.job_detail(job).attempts if a.step_name == "train"] == [
        AttemptState.SUCCEEDED
    ]
    assert len(pods_made(w, gen, "train")) == 1


def test_a_retried_job_cancelled_before_it_launched_stops_its_older_generation(one_node: World) -> None:
    w = one_node
    job, gen, _ = retried_before_it_was_ended(w)
    w.h.store.request_cancel(job, by="alice", now=w.h.clock.now())
    w.h.tick()  # end_job: the new generation was never made (404), generation 0 still ran
    assert w.h.store.jobs_to_end() == []
    assert workflows(w, job) == [job] and stopped(w, job)
    patches = [
        (r.name, r.code) for r in w.cluster.requests if r.verb == "patch" and r.resource == "workflows"
    ]
    assert patches == [(gen, 404), (job, 200)]
    w.sim.step()
    assert old_gated(w, job) == []  # Argo deleted the gated pod


def test_end_job_during_a_store_outage_stops_the_workflow_last_compiled(w: World) -> None:
    compile_job = argo_workflows(w.store, SETTINGS)
    failure: list[Exception] = []

    def flaky(job_id: str) -> CompiledWorkflow:
        if failure:
            raise failure[0]
        return compile_job(job_id)

    w.h.executor.close()
    w.h.executor = ArgoExecutor(w.cluster.api_client(), SETTINGS, flaky)
    w.h.restart()
    job = w.h.submit(two_steps())
    w.run(lambda: w.running(job, "prep"))
    failure.append(RuntimeError("the store is unavailable"))
    fresh = ArgoExecutor(w.cluster.api_client(), SETTINGS, flaky)
    try:
        with pytest.raises(RuntimeError):  # never compiled the job: the loop tries again next tick
            fresh.end_job(job, w.h.clock.now())
    finally:
        fresh.close()
    assert not stopped(w, job)
    w.h.executor.end_job(job, w.h.clock.now())  # compiled it at launch: that Workflow is stopped
    assert stopped(w, job)


def test_end_job_of_a_job_that_no_longer_compiles_stops_its_running_workflows(w: World) -> None:
    job = w.h.submit(two_steps())
    w.run(lambda: w.running(job, "prep"))

    def refused(job_id: str) -> CompiledWorkflow:
        raise ArgoCompileError("steps.train.image: cluster mode runs images")

    executor = ArgoExecutor(w.cluster.api_client(), SETTINGS, refused)
    try:
        executor.end_job(job, w.h.clock.now())
        assert stopped(w, job)
    finally:
        executor.close()


def test_attempt_numbers_go_on_across_generations_and_the_retry_budget_is_whole_again(w: World) -> None:
    # Generation 0: attempt 1 OOMs, its retry (attempt 2) OOMs too: no retry left, FAILED.
    job = w.h.submit({"name": "big", "max_retries": 1, "steps": [{"name": "t", "command": ["t"], "gpus": 1}]})
    w.sim.script(job, "t", Script(run_s=3, oom=True))
    w.run(lambda: w.job_state(job) == "FAILED")
    w.h.tick()
    assert stopped(w, job)
    gen = retry(w, job)
    # The new generation: attempt 3 OOMs and Argo retries it (a fresh budget of 1, as the store's
    # retry gives); attempt 4 succeeds.
    w.sim.script(gen, "t", Script(run_s=3, oom=True), Script(run_s=3))
    first = argo_workflows(w.store, SETTINGS)(job)
    assert first.name == gen
    w.run(lambda: w.running(job, "t"))
    # Every compile of the generation gives the same Workflow: the offset is what the step had
    # before the retry, not what it has had since.
    assert argo_workflows(w.store, SETTINGS)(job).manifest == first.manifest
    w.run(lambda: w.job_state(job) == "SUCCEEDED")

    attempts = w.h.store.job_detail(job).attempts
    assert [(a.number, a.state) for a in attempts] == [
        (1, AttemptState.FAILED),
        (2, AttemptState.FAILED),
        (3, AttemptState.FAILED),
        (4, AttemptState.SUCCEEDED),
    ]
    assert attempt_numbers(w, pods_made(w, job, "t")) == [("1", "1"), ("2", "2")]
    assert attempt_numbers(w, pods_made(w, gen, "t")) == [("3", "3"), ("4", "4")]
    assert [c["phase"] for c in w.sim.retry_children(gen, "t")] == ["Failed", "Succeeded"]
    # The compiled expressions: generation 0's is the plain one; the retry's adds the 2 before it,
    # and its retry clause still allows max_retries (1) retries in this generation.
    (t0,) = [t for t in w.sim.workflow(job)["spec"]["templates"] if t["name"] == "t"]
    (t1,) = [t for t in w.sim.workflow(gen)["spec"]["templates"] if t["name"] == "t"]
    assert t0["metadata"]["labels"]["lowtide.io/attempt"] == ATTEMPT_VALUE
    assert t1["metadata"]["labels"]["lowtide.io/attempt"] == "{{=asInt(retries) + 1 + 2}}"
    assert t1["retryStrategy"] == t0["retryStrategy"]
    assert t1["retryStrategy"]["expression"].endswith("asInt(retries) < 1")
