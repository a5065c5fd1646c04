"""The Kubernetes service manager with `on_autoscaler: steer`, run as the chart's ServiceAccount with
exactly the Role the chart renders for that service in the service's own namespace (the fake API
server enforces it): steering an HPA and scaling pass with no 403; the same service without
`steer` in its values gets a Role without HPA update, and the manager's problem names the 403.
(Refuse mode as the chart's ServiceAccount: tests/integration/test_k8s_services.py.)
"""

from __future__ import annotations

from typing import Any

from k8s_deploy_sim import DeploymentSim, SimClock, deployment, replica_launch
from k8sfake import FakeCluster
from lowtide.adapters.k8s_services import DeploymentTarget, KubernetesServiceManager
from lowtide.control.inference_ports import ReplicaEvent, ReplicaLaunch
from lowtide.deploy.chart import load_chart, render
from lowtide.deploy.manifests import Release

NS = "serving"
DEP = "chat-vllm"
START = 1_796_126_400.0
RELEASE = Release("lowtide", "lowtide-system")
SA = f"system:serviceaccount:{RELEASE.namespace}:{RELEASE.name}"


def chart_objects(on_autoscaler: str) -> list[dict[str, Any]]:
    service = {
        "name": "chat",
        "model": "m",
        "manager": "kubernetes",
        "park": "stop",
        "kubernetes": {"namespace": NS, "deployment": DEP, "on_autoscaler": on_autoscaler},
    }
    values = {"artifactRoot": "s3://b/l", "store": {"url": "postgresql://db/l"}, "services": [service]}
    return render(load_chart(), [values], RELEASE)


def launch(slot: int) -> ReplicaLaunch:
    return replica_launch(slot)


def hpa() -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "chat-hpa"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": DEP},
            "minReplicas": 1,
            "maxReplicas": 10,
        },
    }


def cluster_as_chart_sa(clock: SimClock, objects: list[dict[str, Any]]) -> FakeCluster:
    cluster = FakeCluster(clock=clock)
    cluster.load_rbac(objects)
    cluster.add_user("sa-token", SA)
    return cluster


def test_steer_as_the_charts_service_account_steers_the_hpa_and_scales() -> None:
    clock = SimClock(START)
    with cluster_as_chart_sa(clock, chart_objects("steer")) as cluster:
        cluster.create("deployments", NS, deployment(DEP))
        cluster.create("horizontalpodautoscalers", NS, hpa())
        sim = DeploymentSim(cluster, clock, NS, DEP, service="chat")
        target = DeploymentTarget("chat", NS, DEP, on_autoscaler="steer")
        sa = KubernetesServiceManager(cluster.api_client("sa-token"), [target], refresh_s=0.0)
        for slot in range(2):
            sa.start(launch(slot), clock.now)
        spec = cluster.get("horizontalpodautoscalers", NS, "chat-hpa")["spec"]
        assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 2)  # steered, as the chart's SA
        assert cluster.get("deployments", NS, DEP)["spec"]["replicas"] == 2
        events: list[ReplicaEvent] = []
        for _ in range(10):
            clock.now += 1
            sim.step()
            sa.caught_up("chat", cluster.last_write("pods", NS), None, 10.0)
            events += sa.poll(clock.now)
        assert sorted((e.replica_id, e.kind) for e in events) == [
            ("chat/0", "healthy"),
            ("chat/1", "healthy"),
        ]
        assert not [r for r in cluster.requests if r.code == 403]
        assert ("update", "horizontalpodautoscalers") in {(r.verb, r.resource) for r in cluster.requests}
        sa.close()


def test_without_steer_in_the_values_the_role_cannot_steer_and_the_problem_names_the_403() -> None:
    clock = SimClock(START)
    with cluster_as_chart_sa(clock, chart_objects("refuse")) as cluster:
        cluster.create("deployments", NS, deployment(DEP))
        cluster.create("horizontalpodautoscalers", NS, hpa())
        # The configuration says steer, the chart was rendered for refuse: no HPA update granted.
        target = DeploymentTarget("chat", NS, DEP, on_autoscaler="steer")
        sa = KubernetesServiceManager(cluster.api_client("sa-token"), [target], refresh_s=0.0)
        sa.start(launch(0), clock.now)
        problem = sa.problem("chat")
        assert "403" in problem and 'cannot update resource "horizontalpodautoscalers"' in problem, problem
        spec = cluster.get("horizontalpodautoscalers", NS, "chat-hpa")["spec"]
        assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 10)
        assert cluster.get("deployments", NS, DEP)["spec"]["replicas"] == 0  # nothing written blind
        sa.close()
