"""The chart's rendered RBAC enforced by the fake API server: enough for lowtide, nothing more.

Requirements from the cluster-mode issue (least privilege): workflows create/get/list/watch/
patch/delete; pods get/list/watch/patch/delete; pods/log get; deployments get/list/watch and
deployments/scale get/update/patch; HPAs and ScaledObjects get/list/watch; leases; nodes
get/list/watch/patch; no pods/exec, no secrets beyond its own. Requests go through the real
client with the ServiceAccount's token; the fake answers 403 exactly as kube-apiserver would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiException

from k8sfake import FakeCluster
from lowtide.deploy.chart import load_chart, render
from lowtide.deploy.manifests import Release

from .test_fake_apiserver import deployment, pod

RELEASE = Release("lowtide", "lowtide-system")
SA = f"system:serviceaccount:{RELEASE.namespace}:{RELEASE.name}"


@pytest.fixture
def chart_objects() -> list[dict[str, Any]]:
    required = {"artifactRoot": "s3://bucket/lowtide", "store": {"url": "postgresql://db/lowtide"}}
    return render(load_chart(), [required], RELEASE)


@pytest.fixture
def sa(cluster: FakeCluster, chart_objects: list[dict[str, Any]]) -> tuple[client.ApiClient, str]:
    cluster.load_rbac(chart_objects)
    cluster.add_user("chart-sa", SA)
    workloads = next(
        o for o in chart_objects if o["kind"] == "Role" and o["metadata"]["name"].endswith("-workloads")
    )
    ns = workloads["metadata"]["namespace"]
    cluster.create("pods", ns, pod("step"))
    cluster.create("deployments", ns, deployment("vllm"))
    cluster.create("nodes", "", {"metadata": {"name": "gpu-1"}})
    return cluster.api_client("chart-sa"), ns


def forbidden(call: Callable[[], Any]) -> str:
    with pytest.raises(ApiException) as exc:
        call()
    assert exc.value.status == 403, exc.value.body
    message: str = json.loads(exc.value.body)["message"]
    return message


def test_chart_rbac_grants_what_lowtide_needs(cluster: FakeCluster, sa: tuple[client.ApiClient, str]) -> None:
    api, ns = sa
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    custom = client.CustomObjectsApi(api)
    assert [p.metadata.name for p in core.list_namespaced_pod(ns).items] == ["step"]
    core.patch_namespaced_pod("step", ns, {"metadata": {"labels": {"lowtide.io/attempt": "1"}}})
    cluster.set_pod_log(ns, "step", "ok\n")
    assert core.read_namespaced_pod_log("step", ns, _preload_content=False).data == b"ok\n"
    apps.patch_namespaced_deployment_scale("vllm", ns, {"spec": {"replicas": 2}})
    assert apps.read_namespaced_deployment("vllm", ns).spec.replicas == 2
    custom.create_namespaced_custom_object(
        "argoproj.io",
        "v1alpha1",
        ns,
        "workflows",
        {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": "job-1"}, "spec": {}},
    )
    custom.patch_namespaced_custom_object(
        "argoproj.io", "v1alpha1", ns, "workflows", "job-1", {"spec": {"shutdown": "Stop"}}
    )
    client.AutoscalingV2Api(api).list_namespaced_horizontal_pod_autoscaler(ns)
    custom.list_namespaced_custom_object("keda.sh", "v1alpha1", ns, "scaledobjects")
    core.create_namespaced_event(
        ns,
        {
            "metadata": {"name": "e"},
            "reason": "Preempted",
            "involvedObject": {"kind": "Pod", "name": "step", "namespace": ns},
        },
    )
    core.patch_node("gpu-1", {"metadata": {"labels": {"lowtide.io/lent": "true"}}})
    leases = client.CoordinationV1Api(api)
    lease = leases.create_namespaced_lease(
        RELEASE.namespace, {"metadata": {"name": "lowtide-leader"}, "spec": {"holderIdentity": "a"}}
    )
    lease.spec.holder_identity = "b"
    leases.replace_namespaced_lease("lowtide-leader", RELEASE.namespace, lease)
    core.delete_namespaced_pod("step", ns)


def test_chart_rbac_refuses_everything_else(cluster: FakeCluster, sa: tuple[client.ApiClient, str]) -> None:
    api, ns = sa
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    assert f'cannot create resource "pods" in API group "" in the namespace "{ns}"' in forbidden(
        lambda: core.create_namespaced_pod(ns, pod("mine"))
    )
    forbidden(lambda: apps.patch_namespaced_deployment("vllm", ns, {"spec": {"replicas": 5}}))
    forbidden(lambda: core.delete_node("gpu-1"))
    forbidden(lambda: core.list_namespaced_pod("kube-system"))
    forbidden(core.list_pod_for_all_namespaces)
    forbidden(
        lambda: client.CoordinationV1Api(api).create_namespaced_lease(
            ns if ns != RELEASE.namespace else "elsewhere", {"metadata": {"name": "x"}, "spec": {}}
        )
    )
    # Resources the fake does not serve are still decided by the same authorizer.
    assert not cluster.auth.authorize(SA, "create", "", "pods", "exec", ns, "step")
    assert not cluster.auth.authorize(SA, "get", "", "secrets", "", RELEASE.namespace, "someone-elses")
    assert not cluster.auth.authorize(SA, "list", "", "secrets", "", RELEASE.namespace, "")
