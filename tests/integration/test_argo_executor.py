"""The Argo executor at runtime, driven by the real control loop (docs/cluster.md "The Argo
executor at runtime"): `ArgoExecutor` with the unmodified `kubernetes` client against the fake API
server (`k8sfake`), a simulated Argo controller and kubelet (`argo_sim`) on the loop's fake clock
(the world: `tests/argo_world.py`).

Scenarios: a two-step job through gate → admission → Running → exit 0, with the Workflow created
once across a control-plane restart; a preemption (graceful delete, exit 75, PREEMPTED, re-admitted
on another node, resumed, the finished step untouched); an OOMKill that uses a retry and then
fails the job; exit 0 after SIGTERM without the shim's marker; an API server answering 503/409
and losing a create's response; RBAC refusals named; cancel by `spec.shutdown: Stop`; pods read
from a watch (a steady poll makes no request; a watch that fails makes the poll keep what it
knew, and it recovers with nothing lost); a missing watch permission named.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from argo_sim import Script
from argo_world import NS, ROOT, SETTINGS, T0, World, argo_world, two_steps
from k8sfake import ADMIN_TOKEN
from k8sfake.server import CLIENT_CLOSED_REQUEST
from lowtide.adapters.argo.executor import ArgoExecutor
from lowtide.config import ConfigError, load_settings
from lowtide.control.executor_port import ExecutorError, ExitReason, LaunchRequest
from lowtide.control.inference import ServiceSetup
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec
from lowtide.domain.states import AttemptState
from lowtide.wiring import argo_workflows, build_argo_executor


@pytest.fixture
def w() -> Iterator[World]:
    yield from argo_world()


def test_a_two_step_job_runs_through_the_gate_and_survives_a_restart(w: World) -> None:
    job = w.h.submit(two_steps())
    w.run(lambda: w.running(job, "prep"))
    prep = w.h.last_attempt(job)
    pod = w.cluster.get("pods", NS, w.sim.created[0])
    assert pod["spec"].get("schedulingGates") is None  # admitted: the gate is gone ...
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": prep.node}  # ... and the node pinned
    assert pod["spec"]["nodeName"] == prep.node
    assert prep.running_at is not None and prep.running_at > prep.started_at  # pending, then running

    # A new control-plane process, with a new executor that knows nothing: it adopts the pod.
    w.h.executor = w.executor()
    report = w.h.restart()
    assert report.adopted == (prep.id,) and report.lost == ()
    # Launched before its pod existed, its handle named the step; the pod's name and uid reached
    # the store with its start (the log port reads that pod), and adoption keeps them.
    ref = f"{NS}/{pod['metadata']['name']}/{pod['metadata']['uid']}"
    assert prep.handle == ref
    assert w.h.store.attempt(prep.id).handle == ref
    # The API server goes away for a while: the loop goes on, nothing is lost or done twice.
    w.cluster.stop_listening()
    for _ in range(3):
        w.sim.step()
        w.h.tick()
    w.cluster.resume_listening()
    w.run(lambda: w.job_state(job) == "SUCCEEDED")

    assert w.workflow_creates() == [201]  # one Workflow, never submitted twice
    wf = w.sim.workflow(job)
    assert wf["status"]["phase"] == "Succeeded"
    for task in ("prep", "train"):
        (child,) = w.sim.retry_children(job, task)  # each step ran exactly once
        assert child["phase"] == "Succeeded"
    attempts = w.h.store.job_detail(job).attempts
    assert [(a.step_name, a.state, a.exit_code) for a in attempts] == [
        ("prep", AttemptState.SUCCEEDED, 0),
        ("train", AttemptState.SUCCEEDED, 0),
    ]
    assert all(a.handle and a.handle.startswith(f"{NS}/") for a in attempts)


def test_a_create_that_went_through_unseen_is_answered_409_and_reused(w: World) -> None:
    w.h.executor = w.executor(request_timeout_s=0.3)
    w.h.restart()
    # The first create times out (a temporary failure: the step waits, no retry used) ...
    w.cluster.inject("create", "workflows", latency=0.8)
    w.cluster.inject("create", "secrets", status=503, times=1)  # the step tokens' Secret: admission waits
    w.cluster.inject("patch", "pods", status=409, times=1)
    w.cluster.inject("get", "workflows", status=500, times=2)
    job = w.h.submit(two_steps())
    w.sim.step()
    w.h.tick()
    first = w.h.last_attempt(job)
    assert first.state == AttemptState.FAILED and "no answer" in first.message
    assert w.h.step(job, "prep").retries_used == 0
    # ... while an earlier process's create had gone through without its answer being seen.
    w.cluster.create("workflows", NS, argo_workflows(w.store, SETTINGS)(job).manifest)
    w.run(lambda: w.job_state(job) == "SUCCEEDED")
    # Every later try was answered AlreadyExists (the 500s on reading it back were retried): reused.
    # (The first create's client gave up during the injected latency: 499, nothing created.)
    assert set(w.workflow_creates()) - {CLIENT_CLOSED_REQUEST} == {409}
    assert len(w.cluster.list("workflows", NS)) == 1
    for task in ("prep", "train"):
        assert len(w.sim.retry_children(job, task)) == 1  # nothing ran twice
    attempts = w.h.store.job_detail(job).attempts
    assert [a.state for a in attempts if a.state != AttemptState.FAILED] == [AttemptState.SUCCEEDED] * 2
    assert all("Kubernetes API failed" in a.message for a in attempts if a.state == AttemptState.FAILED)
    assert any(r.code == 503 for r in w.cluster.requests) and any(r.code == 500 for r in w.cluster.requests)


def test_an_oomkill_uses_a_retry_and_exhausting_them_fails_the_job(w: World) -> None:
    job = w.h.submit({"name": "big", "max_retries": 1, "steps": [{"name": "t", "command": ["t"], "gpus": 1}]})
    w.sim.script(job, "t", Script(run_s=3, oom=True))
    w.run(lambda: w.job_state(job) == "FAILED")
    attempts = w.h.store.job_detail(job).attempts
    assert [(a.exit_reason, a.exit_code) for a in attempts] == [(ExitReason.OOM_KILLED, 137)] * 2
    assert "OOMKilled" in (attempts[0].exit_detail or "")
    assert w.h.step(job).retries_used == 1
    children = w.sim.retry_children(job, "t")
    assert [c["message"] for c in children] == ["main: OOMKilled (exit code 137)"] * 2
    assert w.sim.workflow(job)["status"]["phase"] == "Failed"  # Argo's expression agreed: no third pod


def test_an_image_that_cannot_be_pulled_fails_the_step_after_the_bound(w: World) -> None:
    w.h.executor = w.executor(image_pull_bound_s=20)
    w.h.restart()
    job = w.h.submit(
        {"name": "typo", "max_retries": 1, "steps": [{"name": "t", "command": ["t"], "gpus": 1}]}
    )
    w.sim.script(job, "t", Script(image_error="ErrImagePull"))
    w.run(lambda: w.job_state(job) == "FAILED")
    attempts = w.h.store.job_detail(job).attempts
    assert [a.exit_reason for a in attempts] == [ExitReason.IMAGE_PULL] * 2  # the step's fault: a retry each
    assert all(a.running_at is None for a in attempts)  # pulling is not running: no GPU time billed
    assert "ErrImagePull" in (attempts[0].exit_detail or "")
    # Argo kept its node Pending and made the pod again each time (for the second attempt, and
    # once more after it: that gated pod waits until the Workflow is stopped, `stop_workflow`).
    (child,) = w.sim.retry_children(job, "t")
    assert child["phase"] == "Pending" and len(w.sim.created) >= 2


def test_a_pod_no_node_takes_is_withdrawn_and_requeued_without_a_retry(w: World) -> None:
    w.h.executor = w.executor(unschedulable_bound_s=20)
    w.h.restart()
    job = w.h.submit({"name": "fit", "steps": [{"name": "t", "command": ["t"], "gpus": 2}]})
    why = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    w.sim.script(job, "t", Script(unschedulable=why))
    w.run(lambda: w.h.store.job_detail(job).attempts[-1].exit_reason is not None)
    first = w.h.last_attempt(job)
    assert first.exit_reason == ExitReason.UNSCHEDULABLE and first.exit_detail == f"Unschedulable: {why}"
    assert first.running_at is None
    w.sim.script(job, "t", Script(run_s=2))  # room again: Argo's re-made pod runs this time
    w.run(lambda: w.job_state(job) == "SUCCEEDED")
    assert w.h.step(job).retries_used == 0  # the machinery's fault: no retry used
    (child,) = w.sim.retry_children(job, "t")  # still Argo's first attempt: its pod was made again
    assert child["phase"] == "Succeeded" and len(w.sim.created) == 2


def test_exit_0_after_sigterm_without_the_marker_is_not_success(w: World) -> None:
    job = w.h.submit(
        {
            "name": "hazard",
            "steps": [{"name": "t", "command": ["t"], "gpus": 1, "timeout": 20}],
            "grace_seconds": 10,
        }
    )
    w.sim.script(job, "t", Script(run_s=1000, on_term="exit0"))
    w.run(lambda: w.job_state(job) in ("FAILED", "SUCCEEDED"))
    (child,) = w.sim.retry_children(job, "t")
    assert child["phase"] == "Succeeded"  # Kubernetes and Argo call it a success ...
    att = w.h.last_attempt(job)
    assert att.state != AttemptState.SUCCEEDED and att.exit_code is None  # ... lowtide does not
    assert "completion marker" in (att.exit_detail or "")
    assert w.job_state(job) == "FAILED"  # its walltime was spent and it did not finish


def test_a_pod_gone_before_argo_saw_its_exit_reads_pod_deleted(w: World) -> None:
    w.sim.race_delete = True  # the kubelet removes the pod before the controller looks
    job = w.h.submit(
        {
            "name": "race",
            "grace_seconds": 5,
            "steps": [{"name": "t", "command": ["t"], "gpus": 1, "timeout": 20}],
        }
    )
    w.sim.script(job, "t", Script(run_s=1000))
    w.run(lambda: w.job_state(job) == "FAILED")
    att = w.h.last_attempt(job)
    # lowtide deleted it (its walltime notice): the SIGTERM it sent is the signal, Argo's words kept.
    assert (att.exit_code, att.signal, att.exit_detail) == (None, 15, "pod deleted")
    first = w.sim.retry_children(job, "t")[0]
    assert (first["phase"], first["message"]) == ("Error", "pod deleted")
    # Argo's expression would retry a deleted pod; the loop stopped the failed job's Workflow
    # (`Executor.end_job`), so no new pod waits at the gate.
    assert w.sim.workflow(job)["spec"].get("shutdown") == "Stop"
    for _ in range(3):
        w.sim.step()
    assert len(w.sim.created) == 1


CHAT = ServiceSpec(
    name="chat",
    model="m",
    gpus_per_replica=2,
    min_replicas=1,
    max_replicas=2,
    park="sleep",
    startup_s=5,
    wake_s=5,
    autoscale=AutoscaleTargets(
        concurrency_per_replica=4,
        kv_usage=None,
        scale_up_window_s=2,
        scale_down_stabilization_s=20,
        tolerance=0,
    ),
)


@pytest.fixture
def surge() -> Iterator[World]:
    yield from argo_world(
        services=(ServiceSetup(spec=CHAT, command=("serve",), base_port=9000, reclaim_grace_s=30.0),),
        lending=LendingPolicy(reclaim_lead_s=36, stale_after_s=30, stale_reclaim_after_s=120),
    )


def test_a_preempted_step_exits_75_and_is_readmitted_on_another_node(surge: World) -> None:
    w = surge
    w.run(lambda: any(r.state.value == "SERVING" for r in w.h.store.replicas("chat")), limit=10)
    job = w.h.submit(two_steps())
    filler = w.h.submit({"name": "filler", "steps": [{"name": "f", "command": ["f"], "gpus": 2}]})
    w.sim.script(job, "train", Script(run_s=10_000), Script(run_s=5))
    w.sim.script(filler, "f", Script(run_s=10_000))
    w.run(
        lambda: w.h.step(job, "train").state.value == "RUNNING" and w.h.step(filler).state.value == "RUNNING"
    )
    first = w.h.last_attempt(job)
    w.h.store.record_checkpoint(first.id, label="step-50", progress=None, source="api", now=w.h.clock.now())
    w.h.sources["chat"].concurrency = 8.0  # type: ignore[attr-defined]
    w.run(lambda: w.h.step(job, "train").state.value == "PREEMPTED", limit=60)

    first = w.h.store.attempt(first.id)
    assert first.state == AttemptState.INTERRUPTED and first.exit_code == 75
    term = [t for t in w.sim.sigterms if t[0].startswith(f"{job}-train")]
    # Deleted with the job's grace plus the margin (the shim exits before the kubelet kills it),
    # SIGTERM, exit 75.
    assert len(term) == 1 and term[0][1] == 30 + SETTINGS.grace_margin_seconds
    assert w.h.step(job, "train").preemptions == 1 and w.h.step(job, "train").retries_used == 0

    w.h.sources["chat"].concurrency = 0.0  # type: ignore[attr-defined]
    w.sim.script(filler, "f", Script(run_s=1))  # the filler ends: its node frees up
    w.run(lambda: w.job_state(job) == "SUCCEEDED", limit=200)
    second = w.h.last_attempt(job)
    assert (
        second.step_name == "train" and second.node != first.node and second.state == AttemptState.SUCCEEDED
    )
    # The resumed attempt's pod was told where to resume from: an annotation set at admission,
    # which the step shim reads through the downward-API file (LOWTIDE_RESUME_FROM).
    resumed = [
        p["metadata"].get("annotations", {}).get("lowtide.io/resume-from")
        for p in w.cluster.list("pods", NS)
        if p["metadata"]["labels"].get("lowtide.io/step") == "train"
        and (p.get("spec") or {}).get("nodeName") == second.node
    ]
    assert resumed == [f"{second.record['checkpoint_dir']}/step-50"], resumed
    children = w.sim.retry_children(job, "train")
    assert [c["phase"] for c in children] == ["Failed", "Succeeded"]
    assert children[0]["message"] == "main: Error (exit code 75)"
    assert children[1]["hostNodeName"] == second.node
    (prep,) = w.sim.retry_children(job, "prep")  # the finished step: untouched
    assert prep["phase"] == "Succeeded"
    assert not [t for t in w.sim.sigterms if t[0].startswith(f"{job}-prep")]


def test_cancel_stops_the_workflow(w: World) -> None:
    job = w.h.submit(two_steps() | {"max_retries": 1})
    w.run(lambda: w.running(job, "prep"))
    executor = w.h.executor
    assert isinstance(executor, ArgoExecutor)
    assert executor.stop_workflow(job) is True
    assert executor.stop_workflow("job-000000000fff") is False
    for _ in range(5):
        w.sim.step()
        w.h.clock.advance(1)
    wf = w.sim.workflow(job)
    assert wf["spec"]["shutdown"] == "Stop" and wf["status"]["phase"] == "Failed"
    assert wf["status"]["message"] == "Stopped with strategy 'Stop'"
    assert w.sim.retry_children(job, "train") == []  # nothing new started
    assert w.sim.sigterms == [(w.sim.created[0], None)]  # Argo signalled the running pod
    # The loop was not told (it should call stop_workflow on cancel, not the other way round):
    # the stopped step fails with Argo's words, and its retry finds a Workflow that runs nothing
    # more: a failure of the step too, so the job ends rather than waits.
    w.run(lambda: w.job_state(job) == "FAILED", limit=60)
    first, last = w.h.store.job_detail(job).attempts[0], w.h.last_attempt(job)
    assert first.exit_detail == "workflow shutdown with strategy:  Stop"
    assert last.id != first.id and "Argo runs no more pods for it" in (last.exit_detail or "")


def test_rbac_refusals_name_the_missing_rule(w: World) -> None:
    w.cluster.add_user("weak-token", "weak")
    w.cluster.grant("weak", [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}], NS)
    job = w.h.submit(two_steps())
    executor = ArgoExecutor(w.cluster.api_client("weak-token"), SETTINGS, argo_workflows(w.store, SETTINGS))
    request = LaunchRequest(1, job, "prep", 1, "n1", (0,), ("prep",), None, {}, "/w", "/l", "/n")
    with pytest.raises(ExecutorError) as err:
        executor.launch(request, T0)
    assert not err.value.temporary and err.value.infrastructure == "kubernetes"
    assert "verbs [create] on workflows in namespace lowtide" in str(err.value)
    executor.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("executor: {kind: argo}", "executor.kind: argo needs remote object storage"),
        ("executor: {kind: argo}\nartifact_root: /data/art", "'/data/art': pods cannot reach lowtide's disk"),
        ("executor: {kind: argo, runtime: docker}\nartifact_root: s3://b/p", "executor.runtime"),
        ("executor: {kind: slurm}", "executor.kind"),
    ],
)
def test_bad_argo_executor_settings_name_the_field(tmp_path: Path, text: str, expected: str) -> None:
    cfg = tmp_path / "lowtide.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    assert expected in str(err.value)


def test_wiring_builds_the_argo_executor_from_a_kubeconfig(w: World, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        f"""apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "{w.cluster.host}"}}}}]
users: [{{name: admin, user: {{token: {ADMIN_TOKEN}}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: admin}}}}]
current-context: fake
"""
    )
    cfg = tmp_path / "lowtide.yaml"
    cfg.write_text(f"executor: {{kind: argo}}\nargo: {{artifact_root: {ROOT}, kubeconfig: {kubeconfig}}}\n")
    settings = load_settings(cfg)
    executor = build_argo_executor(settings, w.store)  # type: ignore[arg-type]
    assert isinstance(executor, ArgoExecutor)
    job = w.h.submit(two_steps())
    assert executor.stop_workflow(job) is False  # it reaches the cluster: no such Workflow yet
    bad = tmp_path / "other.yaml"
    missing = tmp_path / "nope"
    bad.write_text(f"executor: {{kind: argo}}\nargo: {{artifact_root: {ROOT}, kubeconfig: {missing}}}\n")
    with pytest.raises(ConfigError, match=r"argo\.kubeconfig"):
        build_argo_executor(load_settings(bad), w.store)  # type: ignore[arg-type]
    executor.close()


def pod_requests(w: World, verb: str) -> int:
    return sum(1 for r in w.cluster.requests if r.resource == "pods" and r.verb == verb)


def test_a_steady_poll_reads_pods_from_the_watch_and_makes_no_request(w: World) -> None:
    job = w.h.submit(two_steps())
    w.sim.script(job, "train", Script(run_s=60))
    w.run(lambda: w.running(job, "train"))
    seen = len(w.cluster.requests)
    for _ in range(20):  # train runs: every tick polls
        w.sim.step()
        w.h.tick()
    assert w.running(job, "train")
    assert w.cluster.requests[seen:] == []  # no pods LIST, nothing else either
    w.run(lambda: w.job_state(job) == "SUCCEEDED")
    # One LIST and one WATCH in the executor's life: its informer's, at its first read (recover).
    assert (pod_requests(w, "list"), pod_requests(w, "watch")) == (1, 1)
    executor = w.h.executor
    assert isinstance(executor, ArgoExecutor) and executor.pod_cache_problem == ""
    assert executor.pods_resource_version is not None


def test_a_failing_watch_makes_the_poll_keep_what_it_knew_and_it_recovers(w: World) -> None:
    """The pods watch fails (503) while the rest of the API answers: the stale cache is not read as
    the truth (the step that finished meanwhile is not reported, nothing is launched or lost); once
    the watch is back (a fresh LIST), the exit is read and the job goes on."""
    job = w.h.submit(two_steps())
    w.sim.script(job, "prep", Script(run_s=5))
    w.run(lambda: w.running(job, "prep"))
    prep = w.h.last_attempt(job)
    executor = w.h.executor
    assert isinstance(executor, ArgoExecutor)
    w.settling = False
    w.cluster.inject("watch", "pods", status=503, times=10_000)
    w.cluster.app.streams.close_all()  # the watch ends; opening it again fails
    deadline = time.monotonic() + 10
    while "HTTP 503" not in executor.pod_cache_problem:
        assert time.monotonic() < deadline, executor.pod_cache_problem
        time.sleep(0.01)
    for _ in range(15):  # prep's pod ends, Argo records it, the Workflow makes train's pod
        w.sim.step()
        w.h.tick()
    assert w.sim.retry_children(job, "prep")[0]["phase"] == "Succeeded"
    # Don't know: not "prep ended", not "prep's pod is gone"; train is not launched.
    assert [(a.id, a.state) for a in w.h.store.job_detail(job).attempts] == [(prep.id, AttemptState.RUNNING)]
    assert "watching pods lowtide.io/job in lowtide" in executor.pod_cache_problem

    w.cluster.clear_faults()
    w.settling = True
    w.run(lambda: w.job_state(job) == "SUCCEEDED")
    attempts = w.h.store.job_detail(job).attempts
    assert [(a.step_name, a.state, a.exit_code) for a in attempts] == [
        ("prep", AttemptState.SUCCEEDED, 0),
        ("train", AttemptState.SUCCEEDED, 0),
    ]
    assert executor.pod_cache_problem == ""
    assert pod_requests(w, "list") >= 2  # the informer listed again after the failed watches


def test_a_missing_watch_permission_is_named(w: World) -> None:
    w.cluster.add_user("nowatch", "nowatch")
    rules = [
        {
            "apiGroups": ["argoproj.io"],
            "resources": ["workflows"],
            "verbs": ["create", "get", "list", "patch"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "patch", "delete"]},
    ]
    w.cluster.grant("nowatch", rules, NS)
    job = w.h.submit(two_steps())
    executor = ArgoExecutor(
        w.cluster.api_client("nowatch"), SETTINGS, argo_workflows(w.store, SETTINGS), request_timeout_s=2.0
    )
    try:
        request = LaunchRequest(1, job, "prep", 1, "n1", (0,), ("prep",), None, {}, "/w", "/l", "/n")
        with pytest.raises(ExecutorError) as err:  # as a forbidden LIST: permanent, the rule named
            executor.launch(request, T0)
        assert not err.value.temporary and err.value.infrastructure == "kubernetes"
        assert "verbs [watch] on pods in namespace lowtide" in str(err.value)
    finally:
        executor.close()
