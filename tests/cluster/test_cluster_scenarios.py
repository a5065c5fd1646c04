"""The cluster test tier (issue 8; docs/cluster.md "The cluster test tier"): cluster-mode scenarios
written once against `cluster_backends.Backend`, run on two backends.

- `fake`: the fake API server with the simulated Argo controller and kubelet, on a fake clock
  (every `make test`).
- `real` (marker `cluster`, `make test-cluster`): a real cluster with Argo from
  `LOWTIDE_CLUSTER_KUBECONFIG`; skipped when it is unset (`make test-cluster` refuses to run
  then). Only there do the exits come from a real kubelet, `lowtide-step-shim` and Argo's
  executor, the admission patch from the real API server's pod update rules (and any admission
  webhooks), and the GPUs from the device plugin.

Scenarios: a two-step job through gate → admission → exit 0, the finished step untouched; a
preemption (notice → exit 75 → re-admitted → resumes from `LOWTIDE_RESUME_FROM`); a real failure
that exhausts its retries; a cancel → `spec.shutdown: Stop`. The last test runs the `real`
backend's own code against the fake API server (wall clock, kubeconfig, node discovery), so the
tier's real half is not dead code where no cluster is at hand.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cluster_backends import (
    MISSING_RESUME_EXIT,
    Backend,
    RealBackend,
    RealSettings,
    Run,
    fake_backend,
    real_backend,
    sim_script,
    step_command,
)

from argo_sim import ArgoSim
from k8sfake import ADMIN_TOKEN, FakeCluster
from lowtide.domain.states import AttemptState

#: How long a scenario may wait for one thing, in the backend's seconds (a real cluster pulls an
#: image and schedules pods: minutes; the fake: simulated seconds, milliseconds each).
TIMEOUT_S = 600.0
GRACE_S = 30


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.cluster)])
def cluster(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "fake":
        yield from fake_backend()
        return
    settings = RealSettings.from_env()
    if settings is None:
        pytest.skip("the cluster tier's real backend needs LOWTIDE_CLUSTER_KUBECONFIG (make test-cluster)")
    yield from real_backend(settings)


def two_step_job(train_gpus: int = 1) -> dict[str, Any]:
    return {
        "name": "tier",
        "grace_seconds": GRACE_S,
        "steps": [
            {"name": "prep", "gpus": 1},
            {"name": "train", "gpus": train_gpus, "depends": ["prep"], "checkpoint": True},
        ],
    }


def test_a_two_step_job_runs_through_the_gate_to_succeeded(cluster: Backend) -> None:
    job = cluster.submit(two_step_job(), {"prep": [Run(2)], "train": [Run(2)]})
    cluster.wait("prep runs", lambda: cluster.running(job, "prep"), TIMEOUT_S)
    (prep_pod,) = cluster.pods(job, "prep")
    prep = cluster.attempts(job, "prep")[-1]
    assert prep_pod["spec"].get("schedulingGates") is None  # admitted: the gate is gone ...
    assert prep_pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": prep.node}  # ... node pinned
    assert prep_pod["spec"]["nodeName"] == prep.node
    cluster.wait("the job succeeds", lambda: cluster.job_state(job) == "SUCCEEDED", TIMEOUT_S)

    attempts = cluster.attempts(job)
    assert [(a.step_name, a.state, a.exit_code) for a in attempts] == [
        ("prep", AttemptState.SUCCEEDED, 0),
        ("train", AttemptState.SUCCEEDED, 0),
    ]
    assert all(a.running_at is not None and a.running_at >= a.started_at for a in attempts)
    cluster.wait(
        "Argo's Workflow succeeds",
        lambda: (cluster.workflow(job).get("status") or {}).get("phase") == "Succeeded",
        TIMEOUT_S,
    )
    for task in ("prep", "train"):
        (child,) = cluster.retry_children(job, task)  # each step ran exactly once
        assert child["phase"] == "Succeeded"
    assert len(cluster.pods(job, "prep")) == 1  # the finished step: untouched by the second


def test_a_preempted_step_exits_75_and_resumes_from_its_checkpoint(cluster: Backend) -> None:
    runs = {"prep": [Run(1)], "train": [Run(until_notice=True), Run(2, resume_suffix="/step-50")]}
    job = cluster.submit(two_step_job(), runs)
    cluster.wait("train runs", lambda: cluster.running(job, "train"), TIMEOUT_S)
    first = cluster.attempts(job, "train")[-1]
    store, now = cluster.h.store, cluster.h.clock.now()
    store.record_checkpoint(first.id, label="step-50", progress=None, source="api", now=now)
    store.request_preemption(first.id, grace_s=GRACE_S, reason="cluster tier: preempt", now=now)  # type: ignore[attr-defined]
    cluster.wait("train is preempted", lambda: store.attempt(first.id).ended_at is not None, TIMEOUT_S)

    first = store.attempt(first.id)
    assert (first.state, first.exit_code) == (AttemptState.INTERRUPTED, 75)  # the shim's code
    step = cluster.h.step(job, "train")
    assert step.preemptions == 1 and step.retries_used == 0  # a preemption uses no retry
    cluster.wait("the job succeeds", lambda: cluster.job_state(job) == "SUCCEEDED", TIMEOUT_S)
    second = cluster.attempts(job, "train")[-1]
    # Exit 0, not MISSING_RESUME_EXIT: on a real cluster the step saw LOWTIDE_RESUME_FROM.
    assert second.id != first.id and (second.state, second.exit_code) == (AttemptState.SUCCEEDED, 0)
    # The resumed attempt's pod was told where to resume from, at admission.
    expected = f"{second.record['checkpoint_dir']}/step-50"
    resumed = [
        p["metadata"].get("annotations", {}).get("lowtide.io/resume-from")
        for p in cluster.pods(job, "train")
        if p["metadata"]["labels"].get("lowtide.io/attempt") == "2"
    ]
    assert resumed == [expected]
    children = cluster.retry_children(job, "train")
    assert [c["phase"] for c in children] == ["Failed", "Succeeded"]
    assert children[0]["message"] == "main: Error (exit code 75)"
    (prep,) = cluster.retry_children(job, "prep")  # the finished step: untouched
    assert prep["phase"] == "Succeeded"


def test_a_real_failure_exhausts_its_retries_and_fails_the_job(cluster: Backend) -> None:
    doc = {"name": "fails", "max_retries": 1, "steps": [{"name": "t", "gpus": 1}]}
    job = cluster.submit(doc, {"t": [Run(1, exit_code=3)]})
    cluster.wait("the job fails", lambda: cluster.job_state(job) == "FAILED", TIMEOUT_S)
    attempts = cluster.attempts(job)
    assert [(a.state, a.exit_code) for a in attempts] == [(AttemptState.FAILED, 3)] * 2
    assert cluster.h.step(job).retries_used == 1
    cluster.wait(
        "Argo's Workflow fails",
        lambda: (cluster.workflow(job).get("status") or {}).get("phase") == "Failed",
        TIMEOUT_S,
    )
    children = cluster.retry_children(job, "t")
    assert [c["message"] for c in children] == ["main: Error (exit code 3)"] * 2  # Argo agreed: no third
    cluster.wait("end_job stopped it", lambda: cluster.workflow(job)["spec"].get("shutdown") == "Stop", 30)


def test_a_cancel_stops_the_workflow(cluster: Backend) -> None:
    job = cluster.submit(two_step_job(), {"prep": [Run(until_notice=True)], "train": [Run(1)]})
    cluster.wait("prep runs", lambda: cluster.running(job, "prep"), TIMEOUT_S)
    cluster.h.store.request_cancel(job, by="cluster-tier", now=cluster.h.clock.now())  # type: ignore[attr-defined]
    cluster.wait("the job is cancelled", lambda: cluster.job_state(job) == "CANCELLED", TIMEOUT_S)
    assert cluster.workflow(job)["spec"].get("shutdown") == "Stop"
    (prep,) = cluster.attempts(job)
    assert prep.state == AttemptState.INTERRUPTED and prep.notice_at is not None, prep
    cluster.wait(
        "Argo's Workflow stops",
        lambda: (cluster.workflow(job).get("status") or {}).get("phase") == "Failed",
        TIMEOUT_S,
    )
    assert cluster.retry_children(job, "train") == []  # nothing new started
    assert cluster.pods(job, "train") == []


def test_step_commands_choose_the_attempts_run() -> None:
    """The real backend's step programs, run by `sh` here as the shim would run them."""
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    argv = step_command([Run(0, exit_code=4), Run(0, resume_suffix="/step-50")])

    def run(attempt: str, resume: str = "") -> int:
        env = {**os.environ, "LOWTIDE_ATTEMPT": attempt, "LOWTIDE_RESUME_FROM": resume}
        return subprocess.run(argv, env=env, capture_output=True, timeout=10, check=False).returncode

    assert run("1") == 4
    assert run("2", "s3://b/jobs/x/train/ckpt/step-50") == 0
    assert run("3", "s3://b/jobs/x/train/ckpt/step-49") == MISSING_RESUME_EXIT
    assert run("2") == MISSING_RESUME_EXIT


class _RealOverFake(RealBackend):
    """The real backend's code against the fake API server: its kubelet and controller are the
    simulator's, stepped before every round, on the wall clock."""

    sim: ArgoSim

    def script(self, job: str, step: str, runs: list[Run]) -> None:  # type: ignore[override]
        self.sim.script(job, step, *(sim_script(r) for r in runs))

    def round(self) -> None:
        self.sim.step()
        super().round()


@pytest.fixture
def real_over_fake(tmp_path: Path) -> Iterator[_RealOverFake]:
    import time  # noqa: PLC0415

    cluster = FakeCluster(clock=lambda: datetime.now(UTC))
    with cluster:
        ready = [{"type": "Ready", "status": "True"}]
        for name, allocatable in (
            ("gpu-a", {"nvidia.com/gpu": "2", "cpu": "8"}),
            ("gpu-b", {"nvidia.com/gpu": "2", "cpu": "8"}),
            ("cpu-only", {"cpu": "8"}),
        ):
            status = {"allocatable": allocatable, "capacity": allocatable, "conditions": ready}
            labels = {"kubernetes.io/hostname": name}
            cluster.create("nodes", "", {"metadata": {"name": name, "labels": labels}, "status": status})
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            f"""apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "{cluster.host}"}}}}]
users: [{{name: admin, user: {{token: {ADMIN_TOKEN}}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: admin}}, namespace: tier}}]
current-context: fake
"""
        )
        env = {
            "LOWTIDE_CLUSTER_KUBECONFIG": str(kubeconfig),
            "LOWTIDE_CLUSTER_NAMESPACE": "tier",
            "LOWTIDE_CLUSTER_IMAGE": "registry.example/lowtide-step:1",
        }
        settings = RealSettings.from_env(env)
        assert settings is not None
        backend = _RealOverFake(settings, poll_s=0.05)
        backend.sim = ArgoSim(cluster, time.time, "tier")
        try:
            yield backend
        finally:
            backend.close()
        assert cluster.list("workflows", "tier") == []  # it deletes the Workflows it made


def test_the_real_backend_drives_a_cluster_api_on_the_wall_clock(real_over_fake: _RealOverFake) -> None:
    backend = real_over_fake
    assert [(n.name, n.gpu_count) for n in backend.h.nodes] == [("gpu-a", 2), ("gpu-b", 2)]  # discovered
    job = backend.submit(two_step_job(), {"prep": [Run(0.2)], "train": [Run(0.2)]})
    backend.wait("the job succeeds", lambda: backend.job_state(job) == "SUCCEEDED", 60)
    (prep,) = [t for t in backend.workflow(job)["spec"]["templates"] if t["name"] == "prep"]
    assert prep["container"]["image"] == "registry.example/lowtide-step:1"  # LOWTIDE_CLUSTER_IMAGE
    assert prep["container"]["args"] == step_command([Run(0.2)])  # what a real kubelet would run
    with pytest.raises(ValueError, match="LOWTIDE_CLUSTER_IMAGE"):
        RealSettings.from_env({"LOWTIDE_CLUSTER_KUBECONFIG": "k", "LOWTIDE_CLUSTER_NAMESPACE": "n"})
