"""The chart's rendered RBAC enforced by the fake API server: enough for lowtide, nothing more.

Requirements from the cluster-mode issue (least privilege): workflows create/get/list/patch;
pods get/list/watch/patch/delete; pods/log get (a step's log); the step tokens' Secrets
create/patch (never get/list); in each service's namespace its Deployment's scale get/update
(by name), pods list/watch/patch/delete, HPAs and ScaledObjects list (update/patch with steer),
EndpointSlices list/watch (with endpoint_service); the steps' ServiceAccount only
workflowtaskresults; leases; nodes get/patch; pods list cluster-wide (the node fit check,
`adapters.k8s_nodes`) and nothing else on pods outside the Argo namespace; no pods/exec, no
pods/log elsewhere, no Secret read, no Workflow watch or delete, no node list or watch (lowtide
makes none of these requests: measured by tests/integration/test_chart_rbac_coverage.py).
Requests go through the real client with the ServiceAccount's token; the fake answers 403
exactly as kube-apiserver would.
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


#: A service in its own namespace, with readiness from EndpointSlices and steering autoscalers.
SERVICE = {
    "name": "chat",
    "model": "m",
    "manager": "kubernetes",
    "park": "stop",
    "kubernetes": {
        "namespace": "serving",
        "deployment": "vllm",
        "endpoint_service": "chat",
        "on_autoscaler": "steer",
    },
}


@pytest.fixture
def chart_objects() -> list[dict[str, Any]]:
    required = {"artifactRoot": "s3://bucket/lowtide", "store": {"url": "postgresql://db/lowtide"}}
    return render(load_chart(), [required, {"services": [SERVICE]}], RELEASE)


@pytest.fixture
def sa(cluster: FakeCluster, chart_objects: list[dict[str, Any]]) -> tuple[client.ApiClient, str]:
    cluster.load_rbac(chart_objects)
    cluster.add_user("chart-sa", SA)
    workloads = next(
        o for o in chart_objects if o["kind"] == "Role" and o["metadata"]["name"].endswith("-workloads")
    )
    ns = workloads["metadata"]["namespace"]
    cluster.create("pods", ns, pod("step"))
    cluster.create("deployments", "serving", deployment("vllm"))
    cluster.create("deployments", "serving", deployment("other"))
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
    # The step tokens' Secret of a job: created, then one key patched (adapters.argo.step_tokens).
    secret = {"metadata": {"name": "job-1-step-tokens"}, "data": {"train": "dG9rZW4="}}
    core.create_namespaced_secret(ns, secret)
    core.patch_namespaced_secret("job-1-step-tokens", ns, {"data": {"eval": "dG9rZW4="}})
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
    # Kubernetes Events (adapters.k8s_events): events.k8s.io/v1, created and a series patched.
    events = client.EventsV1Api(api)
    for where in (ns, "serving"):  # the Argo namespace and a service's
        events.create_namespaced_event(where, event(where))
        events.patch_namespaced_event(
            "step.1",
            where,
            {"series": {"count": 2, "lastObservedTime": "2026-01-01T00:00:01.000000Z"}},
            _content_type="application/strategic-merge-patch+json",
        )
    core.patch_node("gpu-1", {"metadata": {"labels": {"lowtide.io/lent": "true"}}})
    # The fit check: every pod bound to a node, in any namespace.
    cluster.create("pods", "serving", pod("vllm-0"))
    everywhere = core.list_pod_for_all_namespaces(field_selector="spec.nodeName=gpu-1")
    assert everywhere.items == []
    assert {p.metadata.name for p in core.list_pod_for_all_namespaces().items} == {"step", "vllm-0"}
    leases = client.CoordinationV1Api(api)
    lease = leases.create_namespaced_lease(
        RELEASE.namespace, {"metadata": {"name": "lowtide-leader"}, "spec": {"holderIdentity": "a"}}
    )
    lease.spec.holder_identity = "b"
    leases.replace_namespaced_lease("lowtide-leader", RELEASE.namespace, lease)
    # A step's log, for `lowtide logs` (adapters.argo.pod_logs): its pod's main container.
    cluster.set_pod_log(ns, "step", "ok\n")
    core.read_namespaced_pod_log("step", ns, container="main", limit_bytes=10, _preload_content=False)
    core.delete_namespaced_pod("step", ns)

    # The service manager, in the service's namespace (adapters.k8s_services): its Deployment's
    # scale, its pods' cache and annotations, the autoscalers (steered), the EndpointSlices.
    scale = apps.read_namespaced_deployment_scale("vllm", "serving")
    scale.spec.replicas = 2
    apps.replace_namespaced_deployment_scale("vllm", "serving", scale)
    assert [p.metadata.name for p in core.list_namespaced_pod("serving").items] == ["vllm-0"]
    assert cluster.auth.authorize(SA, "watch", "", "pods", "", "serving", "")  # its pod cache
    core.patch_namespaced_pod(
        "vllm-0", "serving", {"metadata": {"annotations": {"lowtide.io/replica": "chat/0"}}}
    )
    autoscaling = client.AutoscalingV2Api(api)
    cluster.create(
        "horizontalpodautoscalers",
        "serving",
        {
            "metadata": {"name": "vllm"},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vllm"},
                "minReplicas": 1,
                "maxReplicas": 4,
            },
        },
    )
    (hpa,) = autoscaling.list_namespaced_horizontal_pod_autoscaler("serving").items
    hpa.spec.min_replicas = hpa.spec.max_replicas = 2
    autoscaling.replace_namespaced_horizontal_pod_autoscaler("vllm", "serving", hpa)
    cluster.create(
        "scaledobjects",
        "serving",
        {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "vllm"}, "spec": {}},
    )
    custom.list_namespaced_custom_object("keda.sh", "v1alpha1", "serving", "scaledobjects")
    custom.patch_namespaced_custom_object(
        "keda.sh", "v1alpha1", "serving", "scaledobjects", "vllm", {"spec": {"minReplicaCount": 2}}
    )
    client.DiscoveryV1Api(api).list_namespaced_endpoint_slice("serving")
    core.delete_namespaced_pod("vllm-0", "serving")


def event(namespace: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "step.1"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": "lowtide.io/control-plane",
        "reportingInstance": "lowtide-0",
        "action": "Admitted",
        "reason": "Admitted",
        "type": "Normal",
        "regarding": {"kind": "Pod", "name": "step", "namespace": namespace},
    }


def test_chart_rbac_refuses_everything_else(cluster: FakeCluster, sa: tuple[client.ApiClient, str]) -> None:
    api, ns = sa
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    assert f'cannot create resource "pods" in API group "" in the namespace "{ns}"' in forbidden(
        lambda: core.create_namespaced_pod(ns, pod("mine"))
    )
    forbidden(lambda: apps.patch_namespaced_deployment("vllm", "serving", {"spec": {"replicas": 5}}))
    # The service's Role: only its own Deployment's scale, and nothing of the services elsewhere.
    forbidden(lambda: apps.read_namespaced_deployment_scale("other", "serving"))
    forbidden(lambda: apps.read_namespaced_deployment("vllm", "serving"))
    forbidden(lambda: client.AutoscalingV2Api(api).list_namespaced_horizontal_pod_autoscaler(ns))
    forbidden(lambda: client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(ns))
    # The step tokens' Secrets are written, never read back; nothing else of secrets.
    assert 'cannot get resource "secrets"' in forbidden(
        lambda: core.read_namespaced_secret("job-1-step-tokens", ns)
    )
    forbidden(lambda: core.list_namespaced_secret(ns))
    forbidden(lambda: core.create_namespaced_secret("serving", {"metadata": {"name": "x"}}))
    forbidden(lambda: core.delete_node("gpu-1"))
    forbidden(core.list_node)  # read one by one (get), never listed or watched
    # Workflows are stopped (patch), never deleted.
    forbidden(
        lambda: client.CustomObjectsApi(api).delete_namespaced_custom_object(
            "argoproj.io", "v1alpha1", ns, "workflows", "job-1"
        )
    )
    # Events: only events.k8s.io, only where lowtide works, never read back.
    forbidden(lambda: core.create_namespaced_event(ns, {"metadata": {"name": "e"}, "involvedObject": {}}))
    forbidden(lambda: client.EventsV1Api(api).create_namespaced_event("kube-system", event("kube-system")))
    forbidden(lambda: client.EventsV1Api(api).list_namespaced_event(ns))
    # Pods outside the Argo namespace: listed (the fit check), never read one by one or changed.
    cluster.create("pods", "kube-system", pod("dns"))
    forbidden(lambda: core.read_namespaced_pod("dns", "kube-system"))
    assert 'cannot get resource "pods/log"' in forbidden(  # logs only of steps' pods
        lambda: core.read_namespaced_pod_log("dns", "kube-system", _preload_content=False)
    )
    forbidden(lambda: core.read_namespaced_pod_log("vllm-0", "serving", _preload_content=False))
    forbidden(lambda: core.patch_namespaced_pod("dns", "kube-system", {"metadata": {"labels": {"a": "b"}}}))
    forbidden(lambda: core.delete_namespaced_pod("dns", "kube-system"))
    forbidden(lambda: core.list_pod_for_all_namespaces(watch=True, timeout_seconds=1))
    forbidden(
        lambda: client.CoordinationV1Api(api).create_namespaced_lease(
            ns if ns != RELEASE.namespace else "elsewhere", {"metadata": {"name": "x"}, "spec": {}}
        )
    )
    # Resources the fake does not serve are still decided by the same authorizer.
    assert not cluster.auth.authorize(SA, "create", "", "pods", "exec", ns, "step")
    assert not cluster.auth.authorize(SA, "get", "", "secrets", "", RELEASE.namespace, "someone-elses")
    assert not cluster.auth.authorize(SA, "get", "", "secrets", "", RELEASE.namespace, "lowtide-store")
    assert not cluster.auth.authorize(SA, "watch", "argoproj.io", "workflows", "", ns, "")
    assert not cluster.auth.authorize(SA, "watch", "", "nodes", "", "", "")
    assert not cluster.auth.authorize(SA, "list", "", "secrets", "", RELEASE.namespace, "")
    assert not cluster.auth.authorize(SA, "delete", "", "secrets", "", ns, "job-1-step-tokens")


def test_the_steps_service_account_may_only_report_task_results(
    cluster: FakeCluster, chart_objects: list[dict[str, Any]]
) -> None:
    """Argo's executor in a step's pod: workflowtaskresults create/patch (argo-workflows
    docs/workflow-rbac.md); never the step tokens' Secrets, pods or Workflows."""
    cluster.load_rbac(chart_objects)
    step_sa = "system:serviceaccount:lowtide:lowtide-step"
    for verb in ("create", "patch"):
        assert cluster.auth.authorize(step_sa, verb, "argoproj.io", "workflowtaskresults", "", "lowtide", "x")
    for verb, group, resource in (
        ("get", "", "secrets"),
        ("list", "", "secrets"),
        ("get", "argoproj.io", "workflowtaskresults"),
        ("list", "", "pods"),
        ("get", "argoproj.io", "workflows"),
    ):
        assert not cluster.auth.authorize(step_sa, verb, group, resource, "", "lowtide", "x"), (
            verb,
            resource,
        )
    assert not cluster.auth.authorize(
        step_sa, "create", "argoproj.io", "workflowtaskresults", "", "serving", "x"
    )
