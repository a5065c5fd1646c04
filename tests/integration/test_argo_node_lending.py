"""Lent GPUs on Kubernetes nodes (docs/cluster.md "Lent GPUs on nodes"): `ArgoExecutor` with its
`NodeLending`, the unmodified `kubernetes` client running as the chart's ServiceAccount (the fake
API server enforces the chart's RBAC), the simulated Argo controller and kubelet, and the real
control loop on a fake clock.

Scenarios: a node whose GPUs a pod of another namespace holds defers the step with words naming
who holds what, and the step is admitted once that pod is gone (a pod being deleted still holds
its devices); a cordoned, NotReady or foreign-NoSchedule-tainted node defers it too; lowtide's
label and PreferNoSchedule taint go on before the admission patch, follow two steps on one node,
and come off after the last pod is gone, keeping every other label and taint; a concurrent edit
between read and write is re-read and kept; no write when nothing changes, and a resync repairs
an edit by someone else, and a restarted control plane reads every node and writes nothing; a
node outside lowtide's config is never written; without the chart's cluster-wide pods list rule
the step fails with the rule named; 503s on nodes are temporary; the refusal names every holder,
lowtide's own pods included; a node with fewer GPUs than configured is warned about once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client

from argo_sim import ArgoSim, Script
from argo_world import LAYOUT, NS, RELEASE, ROOT, SA, SA_TOKEN, SETTINGS, T0, node_object, settling
from k8sfake import FakeCluster
from lowtide.adapters.argo.executor import ArgoExecutor
from lowtide.adapters.k8s_nodes import LENT_LABEL, LENT_TAINT_KEY, NodeLending, lent_taint
from lowtide.control.clock import FakeClock
from lowtide.deploy.chart import load_chart, render
from lowtide.domain.gpus import Node
from lowtide.domain.states import AttemptState
from lowtide.policy.outcomes import RetryPolicy
from lowtide.sim.harness import LoopHarness
from lowtide.store.memory import MemoryStore
from lowtide.wiring import argo_workflows

#: Someone else's taint on every node (kept as it is by lowtide's writes).
FOREIGN_TAINT = {"key": "example.com/maintenance-window", "value": "sunday", "effect": "PreferNoSchedule"}


def infra_node(name: str, gpus: int) -> dict[str, Any]:
    """A GPU node with someone else's label and taint, which lowtide's writes must keep."""
    return node_object(
        name, gpus, labels={"team": "infra"}, taints=[dict(FOREIGN_TAINT)], allocatable={"cpu": "64"}
    )


def serving_pod(name: str, gpus: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app": "chat-vllm"}},
        "spec": {
            "containers": [
                {"name": "vllm", "image": "vllm", "resources": {"limits": {"nvidia.com/gpu": gpus}}}
            ],
        },
    }


@dataclass
class World:
    h: LoopHarness
    sim: ArgoSim
    cluster: FakeCluster
    store: MemoryStore
    clock: FakeClock
    #: The label value of each node after each tick (None: no label).
    history: dict[str, list[str | None]] = field(default_factory=dict)

    def tick(self) -> None:
        self.sim.step()
        self.h.tick()
        for n in [*self.h.nodes, Node("outsider", ())]:
            self.history.setdefault(n.name, []).append(self.label(n.name))

    def run(self, until: Callable[[], bool], limit: int = 300) -> None:
        for _ in range(limit):
            self.tick()
            if until():
                return
        detail = self.h.store.job_detail(self.h.jobs[-1])
        said = [(a.state.value, a.exit_detail or a.message) for a in detail.attempts[-3:]]
        raise AssertionError(f"not reached after {limit} ticks: {detail.job.state}, last attempts {said}")

    def node(self, name: str) -> dict[str, Any]:
        return self.cluster.get("nodes", "", name)

    def label(self, name: str) -> str | None:
        value = (self.node(name)["metadata"].get("labels") or {}).get(LENT_LABEL)
        return value if isinstance(value, str) else None

    def taints(self, name: str) -> list[dict[str, Any]]:
        return list(self.node(name)["spec"].get("taints") or [])

    def running(self, job: str, step: str) -> bool:
        attempts = [a for a in self.h.store.job_detail(job).attempts if a.step_name == step]
        return bool(attempts) and attempts[-1].state == AttemptState.RUNNING

    def job_state(self, job: str) -> str:
        return self.h.store.job_detail(job).job.state.value

    def node_writes(self) -> list[tuple[str, int]]:
        return [
            (r.name, r.code) for r in self.cluster.requests if r.verb == "patch" and r.resource == "nodes"
        ]


CONFIG = {"n1": 4, "n2": 4}
NODES = (Node("n1", (0, 1, 2, 3)), Node("n2", (0, 1, 2, 3)))


def chart_rbac(drop_cluster_pods_list: bool = False) -> list[dict[str, Any]]:
    objects = render(load_chart(), [{"artifactRoot": ROOT, "store": {"url": "postgresql://db/l"}}], RELEASE)
    if drop_cluster_pods_list:
        for o in objects:
            if o["kind"] == "ClusterRole":
                o["rules"] = [r for r in o["rules"] if r["resources"] != ["pods"]]
    return objects


def _world(nodes: tuple[Node, ...] = NODES, *, drop_cluster_pods_list: bool = False) -> Iterator[World]:
    clock = FakeClock(T0)
    cluster = FakeCluster(clock=lambda: datetime.fromtimestamp(clock.now(), UTC))
    with cluster:
        cluster.load_rbac(chart_rbac(drop_cluster_pods_list))
        cluster.add_user(SA_TOKEN, SA)
        for n in nodes:
            cluster.create("nodes", "", infra_node(n.name, len(n.gpus)))
        cluster.create("nodes", "", infra_node("outsider", 8))
        store = MemoryStore()
        world = World(None, ArgoSim(cluster, clock.now, NS), cluster, store, clock)  # type: ignore[arg-type]
        world.h = LoopHarness(
            nodes=nodes,
            layout=LAYOUT,
            clock=clock,
            store=store,
            executor=ArgoExecutor(
                cluster.api_client(SA_TOKEN),
                SETTINGS,
                argo_workflows(store, SETTINGS),
                nodes={n.name: len(n.gpus) for n in nodes},
            ),
            retry=RetryPolicy(5.0, 5.0),
        )
        world.h.recover()
        settling(world.sim, lambda: world.h.executor)  # each step waits for the executor's pod cache
        yield world
        world.h.executor.close()


ONE_NODE = {"nodes": (Node("n1", (0, 1, 2, 3)),)}


@pytest.fixture
def w(request: pytest.FixtureRequest) -> Iterator[World]:
    """The world; `@pytest.mark.parametrize("w", [kwargs of _world], indirect=True)` changes it."""
    yield from _world(**getattr(request, "param", {}))


def one_step(gpus: int, run_s_name: str = "t") -> dict[str, Any]:
    return {"name": "j", "steps": [{"name": run_s_name, "command": ["t"], "gpus": gpus}]}


@pytest.mark.parametrize("w", [ONE_NODE], indirect=True)
def test_a_node_full_of_another_namespaces_pods_defers_the_step_until_they_are_gone(w: World) -> None:
    w.cluster.create("pods", "serving", serving_pod("chat-vllm-7f9c", 3))
    w.cluster.bind_pod("serving", "chat-vllm-7f9c", "n1")
    job = w.h.submit(one_step(2))
    w.run(lambda: any(a.state == AttemptState.FAILED for a in w.h.store.job_detail(job).attempts))
    failed = w.h.store.job_detail(job).attempts[0]
    expected = "node n1: 1 of 4 GPUs free (serving/chat-vllm-7f9c holds 3); the step needs 2"
    assert expected in (failed.exit_detail or failed.message)
    assert w.h.step(job).retries_used == 0  # the cluster's doing, not the step's
    (pod,) = w.cluster.list("pods", NS)
    assert pod["spec"].get("schedulingGates")  # never admitted
    assert w.label("n1") is None and w.taints("n1") == [FOREIGN_TAINT]  # nothing lent
    # Graceful deletion: the pod still holds its devices until it is gone.
    w.cluster.delete("pods", "serving", "chat-vllm-7f9c", grace_period_seconds=30)
    for _ in range(15):
        w.tick()
    assert all(a.running_at is None for a in w.h.store.job_detail(job).attempts)  # never ran
    assert w.cluster.list("pods", NS)[0]["spec"].get("schedulingGates")  # never admitted
    w.cluster.finish_pod_deletion("serving", "chat-vllm-7f9c")
    w.run(lambda: w.running(job, "t"))
    assert w.h.step(job).retries_used == 0
    assert w.label("n1") == "2"
    w.run(lambda: w.job_state(job) == "SUCCEEDED")


@pytest.mark.parametrize(
    ("spoil", "words"),
    [
        (lambda n: n["spec"].update(unschedulable=True), "node n1 is cordoned (spec.unschedulable)"),
        (
            lambda n: n["status"].update(
                conditions=[{"type": "Ready", "status": "False", "reason": "KubeletNotReady"}]
            ),
            "node n1 is not Ready (Ready=False: KubeletNotReady)",
        ),
        (
            lambda n: n["spec"]["taints"].append(
                {"key": "dedicated", "value": "inference", "effect": "NoSchedule"}
            ),
            "node n1 has the taint dedicated=inference:NoSchedule, which the step's pod does not tolerate",
        ),
    ],
)
@pytest.mark.parametrize("w", [ONE_NODE], indirect=True)
def test_a_cordoned_not_ready_or_foreign_tainted_node_defers_the_step(
    w: World, spoil: Callable[[dict[str, Any]], None], words: str
) -> None:
    original = w.node("n1")
    w.cluster.modify("nodes", "", "n1", spoil)
    job = w.h.submit(one_step(1))
    w.run(lambda: any(a.state == AttemptState.FAILED for a in w.h.store.job_detail(job).attempts))
    failed = w.h.store.job_detail(job).attempts[0]
    assert words in (failed.exit_detail or failed.message)
    assert w.h.step(job).retries_used == 0

    def restore(n: dict[str, Any]) -> None:
        n["spec"], n["status"] = original["spec"], original["status"]

    w.cluster.modify("nodes", "", "n1", restore)  # the node is fine again: the next try runs
    w.run(lambda: w.running(job, "t"))


def test_label_and_taint_go_on_before_admission_follow_two_steps_and_come_off(w: World) -> None:
    job = w.h.submit(
        {
            "name": "pair",
            "steps": [
                {"name": "short", "command": ["s"], "gpus": 1},
                {"name": "long", "command": ["l"], "gpus": 2},
            ],
        }
    )
    w.sim.script(job, "short", Script(run_s=5))
    w.sim.script(job, "long", Script(run_s=20))
    w.run(lambda: w.running(job, "short") and w.running(job, "long"))
    nodes = {a.step_name: a.node for a in w.h.store.job_detail(job).attempts}
    assert nodes["short"] == nodes["long"]  # the ledger packs them on one node
    node = nodes["short"]
    assert w.label(node) == "3"
    assert w.taints(node) == [FOREIGN_TAINT, lent_taint()]
    # Each admission patch came after the node write that counted it.
    order = [
        r.resource
        for r in w.cluster.requests
        if r.code == 200 and r.verb == "patch" and r.resource in ("nodes", "pods")
    ]
    assert order[:4] == ["nodes", "pods", "nodes", "pods"]
    w.run(lambda: w.job_state(job) == "SUCCEEDED")
    w.run(lambda: w.label(node) is None)
    # Both admitted in one tick (two node writes, 1 or 2 then 3, each before its pod's patch); the
    # short one ends first, then the long one.
    changes = [v for i, v in enumerate(w.history[node]) if i == 0 or v != w.history[node][i - 1]]
    assert changes == [None, "3", "2", None]
    after = w.node(node)
    assert after["spec"]["taints"] == [FOREIGN_TAINT]  # lowtide's taint gone, the other kept
    assert after["metadata"]["labels"] == {"kubernetes.io/hostname": node, "team": "infra"}
    # The other node and the node outside lowtide's config were never written.
    other = "n2" if node == "n1" else "n1"
    assert {name for name, _ in w.node_writes()} == {node}
    assert w.history[other] == [None] * len(w.history[other])
    assert w.node("outsider")["metadata"]["labels"] == {"kubernetes.io/hostname": "outsider", "team": "infra"}


def test_no_write_when_nothing_changes_and_a_resync_repairs_an_edit(w: World) -> None:
    job = w.h.submit(one_step(2))
    w.sim.script(job, "t", Script(run_s=10_000))
    w.run(lambda: w.running(job, "t"))
    node = w.h.last_attempt(job).node
    writes = len(w.node_writes())
    for _ in range(70):  # past a resync (60 s)
        w.tick()
    assert len(w.node_writes()) == writes  # the same count: nothing written, resyncs included

    # Someone removes lowtide's label and taint (and adds their own): a resync puts ours back.
    def strip(n: dict[str, Any]) -> None:
        n["metadata"]["labels"].pop(LENT_LABEL)
        n["metadata"]["labels"]["owner"] = "ops"
        n["spec"]["taints"] = [t for t in n["spec"]["taints"] if t["key"] != LENT_TAINT_KEY]

    w.cluster.modify("nodes", "", node, strip)
    w.run(lambda: w.label(node) == "2", limit=61)
    assert w.node(node)["metadata"]["labels"]["owner"] == "ops"
    assert w.taints(node) == [FOREIGN_TAINT, lent_taint()]

    # A restarted control plane reads every configured node at its first poll (adoption) and
    # finds them right: nothing written.
    w.h.executor.close()
    w.h.executor = ArgoExecutor(
        w.cluster.api_client(SA_TOKEN), SETTINGS, argo_workflows(w.store, SETTINGS), nodes=CONFIG
    )
    assert w.h.restart().adopted == (w.h.last_attempt(job).id,)
    writes, reads = len(w.node_writes()), len(w.cluster.requests)
    w.tick()
    after = [(r.verb, r.name) for r in w.cluster.requests[reads:] if r.resource == "nodes"]
    assert sorted(after) == [("get", "n1"), ("get", "n2")] and len(w.node_writes()) == writes
    assert w.label(node) == "2"


def test_a_concurrent_edit_between_read_and_write_is_read_again_and_kept(w: World) -> None:
    lending = NodeLending(w.cluster.api_client(SA_TOKEN), CONFIG)
    core = lending._core
    real_read = core.read_node
    edits = iter([1, 2])

    def read_then_edit(name: str, **kw: Any) -> Any:
        answer = real_read(name, **kw)
        n = next(edits, None)
        if n is not None:  # someone else writes the node after our read, before our write
            w.cluster.modify("nodes", "", name, lambda o: o["metadata"]["labels"].update({f"edit{n}": "x"}))
        return answer

    core.read_node = read_then_edit  # type: ignore[method-assign]
    lending.reconcile([_admitted("n1", 3)], T0)
    node = w.node("n1")
    assert node["metadata"]["labels"][LENT_LABEL] == "3"
    assert node["metadata"]["labels"]["edit1"] == "x" and node["metadata"]["labels"]["edit2"] == "x"
    assert [code for name, code in w.node_writes() if name == "n1"] == [409, 409, 200]
    # Three conflicts in a row: nothing lost, the next reconcile writes it.
    w.cluster.inject("patch", "nodes", status=409, times=3)
    lending.reconcile([_admitted("n1", 1)], T0 + 1)
    assert w.label("n1") == "3"
    lending.reconcile([_admitted("n1", 1)], T0 + 2)
    assert w.label("n1") == "1"


def _admitted(node: str, gpus: int) -> dict[str, Any]:
    return {
        "metadata": {"uid": f"uid-{node}", "namespace": NS, "name": f"pod-{node}"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": gpus}}}],
        },
        "status": {"phase": "Running"},
    }


def test_a_node_outside_the_config_is_never_written(w: World) -> None:
    lending = NodeLending(w.cluster.api_client(SA_TOKEN), CONFIG)
    before = w.node("outsider")["metadata"]["resourceVersion"]
    lending.reconcile([_admitted("outsider", 4), _admitted("n2", 1)], T0)
    assert w.node("outsider")["metadata"]["resourceVersion"] == before
    assert {name for name, _ in w.node_writes()} == {"n2"}
    gated = {
        "metadata": {"uid": "g", "namespace": NS, "name": "g"},
        "spec": {"containers": [{"name": "m", "resources": {"limits": {"nvidia.com/gpu": 1}}}]},
    }
    lending.prepare_admission("outsider", gated, [])  # a fit check, but no write
    assert w.node("outsider")["metadata"]["resourceVersion"] == before


@pytest.mark.parametrize("w", [{**ONE_NODE, "drop_cluster_pods_list": True}], indirect=True)
def test_without_the_cluster_wide_pods_list_rule_the_step_fails_naming_it(w: World) -> None:
    job = w.h.submit(one_step(1))
    w.run(lambda: any(a.state == AttemptState.FAILED for a in w.h.store.job_detail(job).attempts))
    failed = w.h.store.job_detail(job).attempts[0]
    words = failed.exit_detail or failed.message
    assert "list pods in all namespaces: forbidden" in words
    assert "verbs [list] on pods cluster-wide" in words
    assert w.h.step(job).retries_used == 0
    assert any(r.code == 403 and r.resource == "pods" and r.namespace == "" for r in w.cluster.requests)


def test_the_executor_runs_as_the_charts_service_account(w: World) -> None:
    job = w.h.submit(one_step(1))
    w.run(lambda: w.job_state(job) == "SUCCEEDED")
    users = {r.user for r in w.cluster.requests}
    assert users == {SA}
    assert all(r.code != 403 for r in w.cluster.requests)
    # ... which cannot write pods outside the Argo namespace (the RBAC is enforced).
    with pytest.raises(client.ApiException) as exc:
        client.CoreV1Api(w.cluster.api_client(SA_TOKEN)).delete_namespaced_pod("x", "kube-system")
    assert exc.value.status == 403


def test_a_node_with_fewer_gpus_than_configured_is_warned_about_once(
    w: World, caplog: pytest.LogCaptureFixture
) -> None:
    lending = NodeLending(w.cluster.api_client(SA_TOKEN), {"n1": 8, "n2": 4})
    with caplog.at_level("WARNING", logger="lowtide.adapters.k8s_nodes"):
        for t in range(3):
            lending.reconcile([], T0 + 61 * t)  # a resync each time: every node read
    warned = [r.getMessage() for r in caplog.records if "declares" in r.getMessage()]
    assert warned == [
        "node n1: lowtide.yaml declares 8 GPUs but the Node's allocatable nvidia.com/gpu is 4; "
        "steps placed beyond it wait for the node"
    ]


def test_api_errors_on_nodes_are_temporary_and_named(w: World, caplog: pytest.LogCaptureFixture) -> None:
    w.cluster.inject("get", "nodes", status=503, times=3)
    w.cluster.inject("list", "pods", status=500, times=1)
    job = w.h.submit(one_step(1))
    with caplog.at_level("INFO"):
        w.run(lambda: w.running(job, "t"))
    assert w.h.step(job).retries_used == 0
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "get nodes (node n1): the Kubernetes API failed (HTTP 503" in said
    assert w.label(w.h.last_attempt(job).node) == "1"


@pytest.mark.parametrize("w", [ONE_NODE], indirect=True)
def test_the_refusal_names_every_holder_lowtides_own_pods_included(w: World) -> None:
    w.cluster.create("pods", "serving", serving_pod("chat-vllm-0", 1))
    w.cluster.bind_pod("serving", "chat-vllm-0", "n1")
    first = w.h.submit(one_step(2, "a"))
    w.sim.script(first, "a", Script(run_s=10_000))
    w.run(lambda: w.running(first, "a"))
    (train,) = [p["metadata"]["name"] for p in w.cluster.list("pods", NS)]
    second = w.h.submit(one_step(2, "b"))  # the ledger sees 2 GPUs free; the node has 1
    w.run(lambda: any(a.state == AttemptState.FAILED for a in w.h.store.job_detail(second).attempts))
    failed = w.h.store.job_detail(second).attempts[0]
    expected = (
        f"node n1: 1 of 4 GPUs free ({NS}/{train} holds 2, serving/chat-vllm-0 holds 1); the step needs 2"
    )
    assert (failed.exit_detail or failed.message) == expected
    assert w.label("n1") == "2"  # the refused step was never counted
