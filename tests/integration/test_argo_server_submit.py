"""Submission through argo-server's REST API (`argo.submit_via: argo-server`; docs/cluster.md
"Submission paths"): the real loop drives `ArgoExecutor`, whose Workflows are created, read and
stopped by Hera's unmodified `WorkflowsService` against the fake argo-server
(`tests/argo_server_fake.py`), while pods are read through the Kubernetes API of the same fake
cluster the simulated Argo controller works on.

Scenarios: a two-step job succeeds with every Workflow call through argo-server (none through the
Kubernetes API) across a control-plane restart; a create whose answer was lost (a 503 from the
proxy, or a client timeout, the Workflow created anyway) is answered 409 on retry and reused, one
Workflow, nothing run twice; cancel's `stop` goes through argo-server (404 → False, a completed
Workflow → nothing to stop); a bad token or a token without RBAC is a permanent error naming
`argo.server_token_file`; config and wiring name their fields.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import requests

from argo_server_fake import CREATOR, FakeArgoServer
from argo_sim import ArgoSim
from argo_world import LAYOUT, NODES, NS, ROOT, SETTINGS, T0, World, two_steps
from k8sfake import ADMIN_TOKEN, FakeCluster
from lowtide.adapters.argo.executor import ArgoExecutor
from lowtide.adapters.argo.workflow_store import ArgoServerWorkflows
from lowtide.config import ConfigError, load_settings
from lowtide.control.clock import FakeClock
from lowtide.control.executor_port import ExecutorError, LaunchRequest
from lowtide.domain.states import AttemptState
from lowtide.policy.outcomes import RetryPolicy
from lowtide.sim.harness import LoopHarness
from lowtide.store.memory import MemoryStore
from lowtide.wiring import argo_workflows, build_argo_executor

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("LOWTIDE_DATA_DIR") or REPO.parent / "shared" / "data")
SWAGGER = DATA / "reference" / "argo-workflows-swagger.json"


@dataclass
class ServerWorld(World):
    server: FakeArgoServer = None  # type: ignore[assignment]
    token: str = ADMIN_TOKEN

    def executor(self, **kw: Any) -> ArgoExecutor:
        timeout = kw.pop("request_timeout_s", 10.0)
        api = ArgoServerWorkflows(self.server.url, self.token, NS, timeout_s=timeout)
        made = ArgoExecutor(
            self.cluster.api_client(),
            SETTINGS,
            argo_workflows(self.store, SETTINGS),
            request_timeout_s=timeout,
            workflows_api=api,
            **kw,
        )
        self.made.append(made)  # closed with the world (its pod watch thread too)
        return made

    def server_calls(self, verb: str) -> list[int]:
        return [c.status for c in self.server.calls if c.verb == verb]


@pytest.fixture
def w() -> Iterator[ServerWorld]:
    if not SWAGGER.is_file():
        pytest.skip(f"argo-server's swagger is absent ({SWAGGER}): request bodies cannot be validated")
    clock = FakeClock(T0)
    cluster = FakeCluster(clock=lambda: datetime.fromtimestamp(clock.now(), UTC))
    with cluster, FakeArgoServer(cluster, SWAGGER) as server:
        store = MemoryStore()
        world = ServerWorld(None, ArgoSim(cluster, clock.now, NS), cluster, store, server)  # type: ignore[arg-type]
        world.sim.settle = world.settle  # each step waits for the executor's pod cache (argo_world)
        world.h = LoopHarness(
            nodes=NODES,
            layout=LAYOUT,
            clock=clock,
            store=store,
            executor=world.executor(),
            retry=RetryPolicy(5.0, 5.0),
        )
        world.h.recover()
        yield world
        world.h.executor.close()
        for made in world.made:
            made.close()


def test_a_two_step_job_runs_with_its_workflow_submitted_through_argo_server(w: ServerWorld) -> None:
    job = w.h.submit(two_steps())
    w.run(lambda: w.running(job, "prep"))
    # A new control-plane process: it adopts the pod and submits nothing again.
    w.h.executor = w.executor()
    report = w.h.restart()
    assert report.adopted == (w.h.last_attempt(job).id,)
    w.run(lambda: w.job_state(job) == "SUCCEEDED")

    assert w.server_calls("create") == [200]  # one Workflow, through argo-server
    assert set(w.server_calls("get")) == {200}  # the executor read its node tree there
    assert [r for r in w.cluster.requests if r.resource == "workflows"] == []  # never through Kubernetes
    assert all(c.authorization == f"Bearer {ADMIN_TOKEN}" for c in w.server.calls)  # Hera's prefix
    wf = w.sim.workflow(job)
    assert wf["status"]["phase"] == "Succeeded" and wf["metadata"]["labels"][CREATOR] == "admin"
    # Hera's model takes quantities only as strings (the adapter converts them); Go writes them so too.
    limits = [t["container"]["resources"]["limits"] for t in wf["spec"]["templates"] if "container" in t]
    assert sorted(lim["nvidia.com/gpu"] for lim in limits) == ["1", "2"]
    for task in ("prep", "train"):
        (child,) = w.sim.retry_children(job, task)
        assert child["phase"] == "Succeeded"
    assert [a.state for a in w.h.store.job_detail(job).attempts] == [AttemptState.SUCCEEDED] * 2


@pytest.mark.parametrize(
    ("fault", "words", "answered"),
    [
        ({"status": 503}, "argo-server failed (HTTP 503", 503),  # a proxy in front of argo-server
        ({"latency": 0.8}, "argo-server failed (no answer", 200),  # the client gave up waiting
    ],
)
def test_a_create_whose_answer_was_lost_is_answered_409_and_reused(
    w: ServerWorld, fault: dict[str, Any], words: str, answered: int
) -> None:
    w.h.executor = w.executor(request_timeout_s=0.3)
    w.h.restart()
    w.server.inject("create", after=True, **fault)  # created, but the answer never arrives
    job = w.h.submit(two_steps())
    w.sim.step()
    w.h.tick()
    first = w.h.last_attempt(job)
    assert first.state == AttemptState.FAILED and words in first.message
    assert w.h.step(job, "prep").retries_used == 0  # the machinery's fault: no retry used
    w.run(lambda: w.job_state(job) == "SUCCEEDED")

    for _ in range(500):  # the fake records a call when it answers: the slow one answers last
        if len(w.server_calls("create")) >= 2:
            break
        time.sleep(0.01)
    # The retry: AlreadyExists, read back, its lowtide.io/job label checked, reused. (On a loaded
    # machine a retry's own read-back can pass the 0.3 s timeout too: another retry, another 409.)
    calls = sorted(w.server_calls("create"))
    assert answered in calls and calls.count(409) >= 1
    assert len(calls) - calls.count(409) == 1  # the lost answer; every retry met AlreadyExists
    assert len(w.cluster.list("workflows", NS)) == 1
    for task in ("prep", "train"):
        assert len(w.sim.retry_children(job, task)) == 1  # nothing ran twice
    attempts = w.h.store.job_detail(job).attempts
    assert [a.state for a in attempts] == [
        AttemptState.FAILED,
        AttemptState.SUCCEEDED,
        AttemptState.SUCCEEDED,
    ]


def test_a_workflow_of_that_name_not_lowtides_is_refused(w: ServerWorld) -> None:
    job = w.h.submit(two_steps())
    foreign = argo_workflows(w.store, SETTINGS)(job).manifest
    foreign["metadata"]["labels"] = {"team": "other"}
    w.cluster.create("workflows", NS, foreign)
    executor = w.executor()
    with pytest.raises(ExecutorError, match="exists but is not lowtide's job") as err:
        executor.launch(_request(job), T0)
    assert not err.value.temporary
    assert w.server_calls("create") == [409]
    executor.close()


def test_cancel_stops_the_workflow_through_argo_server(w: ServerWorld) -> None:
    job = w.h.submit(two_steps() | {"max_retries": 1})
    w.run(lambda: w.running(job, "prep"))
    executor = w.h.executor
    assert isinstance(executor, ArgoExecutor)
    assert executor.stop_workflow(job) is True
    assert executor.stop_workflow("job-000000000fff") is False  # argo-server's 404 (code 5)
    wf = w.sim.workflow(job)
    assert wf["spec"]["shutdown"] == "Stop"
    assert wf["metadata"]["labels"]["workflows.argoproj.io/action"] == "Stop"  # argo-server's actor labels
    for _ in range(5):
        w.sim.step()
        w.h.clock.advance(1)
    assert w.sim.workflow(job)["status"]["phase"] == "Failed"
    assert w.sim.retry_children(job, "train") == []
    # Stopping it again: argo-server refuses a completed Workflow with a 500; nothing is left to stop.
    assert executor.stop_workflow(job) is True
    assert w.server_calls("stop") == [200, 404, 500]
    assert [r for r in w.cluster.requests if r.resource == "workflows"] == []


def _request(job: str) -> LaunchRequest:
    return LaunchRequest(1, job, "prep", 1, "n1", (0,), ("prep",), None, {}, "/w", "/l", "/n")


def test_a_bad_token_or_missing_rbac_is_permanent_and_names_the_token_file(w: ServerWorld) -> None:
    job = w.h.submit(two_steps())
    w.token = "not-a-token"
    executor = w.executor()
    with pytest.raises(ExecutorError) as err:
        executor.launch(_request(job), T0)
    assert not err.value.temporary and err.value.infrastructure == "argo-server"
    assert "HTTP 401" in str(err.value) and "argo.server_token_file" in str(err.value)
    executor.close()

    w.cluster.add_user("weak-token", "system:serviceaccount:lowtide:weak")
    w.cluster.grant("system:serviceaccount:lowtide:weak", [_rule(["get", "list"])], NS)
    w.token = "weak-token"
    executor = w.executor()
    with pytest.raises(ExecutorError) as err:
        executor.launch(_request(job), T0)
    assert not err.value.temporary and "HTTP 403" in str(err.value)
    assert "argo.server_token_file needs the rule verbs [create] on workflows.argoproj.io" in str(err.value)
    assert w.cluster.list("workflows", NS) == []
    executor.close()


def _rule(verbs: list[str]) -> dict[str, Any]:
    return {"apiGroups": ["argoproj.io"], "resources": ["workflows"], "verbs": verbs}


def test_an_argo_server_that_is_down_is_temporary(w: ServerWorld) -> None:
    job = w.h.submit(two_steps())
    w.server.stop()
    executor = w.executor(request_timeout_s=0.5)
    with pytest.raises(ExecutorError, match="no answer") as err:
        executor.launch(_request(job), T0)
    assert err.value.temporary and err.value.infrastructure == "argo-server"
    executor.close()


def test_config_and_wiring_name_the_argo_server_fields(w: ServerWorld, tmp_path: Path) -> None:
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
    token = tmp_path / "token"
    token.write_text(ADMIN_TOKEN + "\n")

    def settings(argo: str) -> Any:
        cfg = tmp_path / "lowtide.yaml"
        cfg.write_text(
            f"executor: {{kind: argo}}\nargo: {{artifact_root: {ROOT}, kubeconfig: {kubeconfig}, {argo}}}\n"
        )
        return load_settings(cfg)

    executor = build_argo_executor(
        settings(f"submit_via: argo-server, server_url: '{w.server.url}', server_token_file: {token}"),
        w.store,  # type: ignore[arg-type]
    )
    assert isinstance(executor, ArgoExecutor)
    job = w.h.submit(two_steps())
    assert executor.stop_workflow(job) is False  # it reaches argo-server: no such Workflow yet
    assert w.server_calls("stop") == [404]
    executor.close()

    with pytest.raises(ConfigError, match=r"server_url: required with submit_via: argo-server"):
        settings("submit_via: argo-server")
    with pytest.raises(ConfigError, match=r"server_url"):
        settings("submit_via: argo-server, server_url: 'argo-server:2746'")
    with pytest.raises(ConfigError, match=r"submit_via"):
        settings("submit_via: hera")
    missing = settings(
        f"submit_via: argo-server, server_url: '{w.server.url}', server_token_file: {tmp_path}/no"
    )
    with pytest.raises(ConfigError, match=r"argo\.server_token_file: cannot read"):
        build_argo_executor(missing, w.store)  # type: ignore[arg-type]
    (tmp_path / "empty").write_text("\n")
    empty = settings(
        f"submit_via: argo-server, server_url: '{w.server.url}', server_token_file: {tmp_path}/empty"
    )
    with pytest.raises(ConfigError, match=r"argo\.server_token_file: .* is empty"):
        build_argo_executor(empty, w.store)  # type: ignore[arg-type]


def test_the_fake_answers_like_argo_server(w: ServerWorld) -> None:
    """The wire shapes the adapter relies on (tests/argo_server_fake.py docstring cites the source)."""
    url = f"{w.server.url}/api/v1/workflows/{NS}"
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    job = w.h.submit(two_steps())
    manifest = argo_workflows(w.store, SETTINGS)(job).manifest
    no_token = requests.post(url, json={"workflow": manifest}, timeout=5)
    assert no_token.status_code == 401 and no_token.json()["code"] == 16
    assert no_token.json()["message"].startswith("token not valid")
    # Go reads a numeric quantity and writes it back as a string.
    created = requests.post(url, json={"workflow": manifest}, headers=admin, timeout=5)
    assert created.status_code == 200
    limits = [
        t["container"]["resources"]["limits"] for t in created.json()["spec"]["templates"] if "container" in t
    ]
    assert sorted(lim["nvidia.com/gpu"] for lim in limits) == ["1", "2"]
    no_body = requests.post(url, json={}, headers=admin, timeout=5)
    assert no_body.json() == {"code": 3, "message": "workflow body not specified", "details": []}
    bad = requests.post(url, json={"workflow": {"spec": {"templates": "none"}}}, headers=admin, timeout=5)
    assert bad.status_code == 400 and bad.json()["code"] == 3  # the swagger's shape
    body = {"workflow": {"metadata": {"name": job}, "spec": {"entrypoint": "main"}}}
    exists = requests.post(url, json=body, headers=admin, timeout=5)
    assert exists.status_code == 409 and exists.json()["code"] == 6
    assert exists.json()["message"] == f'workflows.argoproj.io "{job}" already exists'
    missing = requests.get(f"{url}/nope", headers=admin, timeout=5)
    assert missing.status_code == 404 and missing.json()["code"] == 5
