"""The step token reaches the pod in cluster mode (docs/cluster.md "Jobs as Argo Workflows"): the
real loop and `ArgoExecutor` with the unmodified `kubernetes` client against the fake API server,
the simulated Argo controller and kubelet (`argo_sim`, which reads a pod's secret volumes when
its container starts, as the kubelet does), on the loop's fake clock.

Shown: each gated attempt's container starts with its own attempt's token in the mounted file
(written into the job's Secret before the admission patch; a second step or a retry replaces its
key); the Secret is labelled and owned by the Workflow; CPU-only steps get no token; the token
never appears in the Workflow or a pod; a control plane without `secrets create` fails the
admission naming that rule.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from argo_sim import ArgoSim, Script
from argo_world import settling
from k8sfake import FakeCluster
from lowtide.adapters.argo.executor import ArgoExecutor
from lowtide.adapters.argo.workflow import ArgoSettings
from lowtide.control.clock import FakeClock
from lowtide.control.executor_port import ExitReason
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.states import AttemptState
from lowtide.policy.outcomes import RetryPolicy
from lowtide.sim.harness import LoopHarness
from lowtide.store.memory import MemoryStore
from lowtide.wiring import argo_workflows

NS = "lowtide"
SETTINGS = ArgoSettings(
    artifact_root="s3://bucket/lowtide", namespace=NS, default_image="registry.example/step:1"
)
T0 = 1_800_000_000.0
TOKEN_FILE = "/var/run/lowtide-token/token"


class World:
    def __init__(self, cluster: FakeCluster, sim: ArgoSim, store: MemoryStore, h: LoopHarness) -> None:
        self.cluster, self.sim, self.store, self.h = cluster, sim, store, h

    def run(self, until: Any, limit: int = 300) -> None:
        for _ in range(limit):
            self.sim.step()
            self.h.tick()
            if until():
                return
        raise AssertionError(f"not reached after {limit} ticks")

    def job_state(self, job: str) -> str:
        return self.h.store.job_detail(job).job.state.value

    def pod_of(self, attempt_handle: str | None) -> str:
        assert attempt_handle is not None
        return attempt_handle.split("/")[1]


def _world(token: str | None = None) -> Iterator[World]:
    clock = FakeClock(T0)
    cluster = FakeCluster(clock=lambda: datetime.fromtimestamp(clock.now(), UTC))
    with cluster:
        store = MemoryStore()
        sim = ArgoSim(cluster, clock.now, NS)
        api = cluster.api_client(token) if token else cluster.api_client()
        executor = ArgoExecutor(api, SETTINGS, argo_workflows(store, SETTINGS))
        h = LoopHarness(
            nodes=(Node("n1", (0, 1)), Node("n2", (0, 1))),
            layout=ArtifactLayout(SETTINGS.artifact_root, "/work"),
            clock=clock,
            store=store,
            executor=executor,
            retry=RetryPolicy(5.0, 5.0),
        )
        h.recover()
        settling(sim, lambda: h.executor)  # each step waits for the executor's pod cache
        try:
            yield World(cluster, sim, store, h)
        finally:
            h.executor.close()  # its pod watch thread too, also when the generator is closed


@pytest.fixture
def w() -> Iterator[World]:
    yield from _world()


JOB = {
    "name": "sft",
    "steps": [
        {"name": "fetch", "command": ["fetch"]},  # CPU-only: not gated
        {"name": "prep", "command": ["prep"], "gpus": 1, "depends": ["fetch"]},
        {"name": "train", "command": ["train"], "gpus": 2, "depends": ["prep"]},
    ],
}


def running(w: World, job: str, step: str) -> Any:
    """The step's latest attempt once it runs (its pod is Running), else None."""
    attempts = [a for a in w.store.job_detail(job).attempts if a.step_name == step]
    return attempts[-1] if attempts and attempts[-1].state == AttemptState.RUNNING else None


def test_each_gated_attempt_starts_with_its_own_token_from_the_jobs_secret(w: World) -> None:
    job = w.h.submit(JOB)
    seen: dict[str, str] = {}
    for step in ("prep", "train"):
        w.run(lambda step=step: running(w, job, step) is not None)
        attempt = running(w, job, step)
        seen[step] = w.sim.secret_files[w.pod_of(attempt.handle)][TOKEN_FILE]
        record = w.store.authenticate(seen[step])  # the very token lowtide minted ...
        assert record is not None and record.attempt_id == attempt.id  # ... for this attempt
        assert record.role == "step"
    w.run(lambda: w.job_state(job) == "SUCCEEDED")
    assert all(w.store.authenticate(token) is None for token in seen.values())  # over: revoked
    (fetch,) = w.cluster.list("pods", NS, label_selector="lowtide.io/step=fetch")
    assert w.sim.secret_files[fetch["metadata"]["name"]] == {}  # CPU-only: no token volume

    secret = w.cluster.get("secrets", NS, f"{job}-step-tokens")
    workflow = w.sim.workflow(job)
    assert secret["metadata"]["labels"] == {"lowtide.io/job": job}
    assert secret["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": "Workflow",
            "name": job,
            "uid": workflow["metadata"]["uid"],
        }
    ]  # garbage-collected with the Workflow; no blockOwnerDeletion (it would need workflows/finalizers)
    assert sorted(secret["data"]) == ["prep", "train"]

    # Written before the patch that removed each gate; the second step's write was a 409 and a patch.
    writes = [
        (r.verb, r.resource, r.code)
        for r in w.cluster.requests
        if (r.resource == "secrets") or (r.resource == "pods" and r.verb == "patch")
    ]
    assert writes == [
        ("create", "secrets", 201),
        ("patch", "pods", 200),
        ("create", "secrets", 409),
        ("patch", "secrets", 200),
        ("patch", "pods", 200),
    ]
    # The token is in no Workflow and no pod (an annotation or env would be readable by pod readers).
    tokens = [base64.b64decode(v).decode() for v in secret["data"].values()]
    visible = json.dumps([workflow, *w.cluster.list("pods", NS)])
    assert all(t not in visible for t in tokens)


def test_a_retry_gets_the_new_attempts_token(w: World) -> None:
    job = w.h.submit({"name": "big", "max_retries": 1, "steps": [{"name": "t", "command": ["t"], "gpus": 1}]})
    w.sim.script(job, "t", Script(run_s=3, oom=True))
    w.run(lambda: w.job_state(job) == "FAILED")
    attempts = w.store.job_detail(job).attempts
    assert [a.exit_reason for a in attempts] == [ExitReason.OOM_KILLED] * 2
    assert len(w.sim.created) == 2  # one pod per attempt, in order
    seen = [w.sim.secret_files[pod][TOKEN_FILE] for pod in w.sim.created]
    assert seen[0] != seen[1]  # the Secret's key was replaced before the retry's pod was admitted
    secret = w.cluster.get("secrets", NS, f"{job}-step-tokens")
    assert base64.b64decode(secret["data"]["t"]).decode() == seen[1]


def test_without_secrets_create_the_admission_fails_naming_the_rule() -> None:
    everything_but_secrets = [
        {
            "apiGroups": ["argoproj.io"],
            "resources": ["workflows"],
            "verbs": ["create", "get", "list", "patch"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch", "delete"]},
    ]
    worlds = _world(token="no-secrets-token")
    world = next(worlds)
    world.cluster.add_user("no-secrets-token", "no-secrets")
    world.cluster.grant("no-secrets", everything_but_secrets, NS)
    job = world.h.submit({"name": "j", "steps": [{"name": "t", "command": ["t"], "gpus": 1}]})

    def failed() -> bool:
        attempts = world.store.job_detail(job).attempts
        return bool(attempts) and attempts[-1].state == AttemptState.FAILED

    world.run(failed)
    attempt = world.h.last_attempt(job)
    assert "verbs [create] on secrets in namespace lowtide" in attempt.message
    (pod,) = world.cluster.list("pods", NS)
    assert pod["spec"].get("schedulingGates")  # never admitted without its token
    worlds.close()
