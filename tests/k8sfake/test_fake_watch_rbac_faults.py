"""Watch streams, RBAC 403s and injected faults of the fake API server, through the real client."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import urllib3
from kubernetes import client, watch
from kubernetes.client import ApiException

from k8sfake import FakeCluster

from .test_fake_apiserver import NS, deployment, pod, status_of


@pytest.fixture
def core(cluster: FakeCluster) -> client.CoreV1Api:
    return client.CoreV1Api(cluster.api_client())


def take(stream: Any, n: int) -> list[tuple[str, str, str]]:
    """The first n events as (type, name, resourceVersion); leaving the loop closes the stream."""
    seen: list[tuple[str, str, str]] = []
    for event in stream:
        obj = event["raw_object"]
        seen.append((event["type"], obj["metadata"].get("name", ""), obj["metadata"]["resourceVersion"]))
        if len(seen) == n:
            break
    return seen


# ---------------------------------------------------------------- watch


def test_watch_replays_from_a_resource_version_then_streams_live(
    cluster: FakeCluster, core: client.CoreV1Api
) -> None:
    start = core.create_namespaced_pod(NS, pod("a")).metadata.resource_version
    core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"x": "1"}}})
    core.create_namespaced_pod(NS, pod("b"))
    w = watch.Watch()
    stream = w.stream(core.list_namespaced_pod, NS, resource_version=start, timeout_seconds=5)
    first = take(stream, 2)
    assert [(t, n) for t, n, _ in first] == [("MODIFIED", "a"), ("ADDED", "b")]
    core.delete_namespaced_pod("b", NS)  # unscheduled: period 0, deleted at once (in two writes)
    live = take(stream, 2)
    assert [(t, n) for t, n, _ in live] == [("MODIFIED", "b"), ("DELETED", "b")]
    versions = [int(rv) for _, _, rv in first + live]
    assert versions == sorted(versions) and versions[0] > int(start)
    assert w.resource_version == live[-1][2]


def test_watch_without_version_lists_current_objects_first(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("a"))
    core.create_namespaced_pod("elsewhere", pod("z"))
    events = take(watch.Watch().stream(core.list_namespaced_pod, NS, timeout_seconds=5), 1)
    assert [(t, n) for t, n, _ in events] == [("ADDED", "a")]


def test_watch_selector_transitions_become_added_and_deleted(core: client.CoreV1Api) -> None:
    rv = core.create_namespaced_pod(NS, pod("a", labels={"role": "step"})).metadata.resource_version
    stream = watch.Watch().stream(
        core.list_namespaced_pod, NS, label_selector="role=step", resource_version=rv, timeout_seconds=5
    )
    core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"role": "other"}}})
    core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"extra": "1"}}})  # invisible
    core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"role": "step"}}})
    assert [(t, n) for t, n, _ in take(stream, 2)] == [("DELETED", "a"), ("ADDED", "a")]


def test_graceful_delete_is_seen_as_modified_then_deleted(
    cluster: FakeCluster, core: client.CoreV1Api
) -> None:
    core.create_namespaced_pod(NS, pod("step"))
    bound = cluster.bind_pod(NS, "step", "gpu-1")
    stream = watch.Watch().stream(
        core.list_namespaced_pod, NS, resource_version=bound["metadata"]["resourceVersion"], timeout_seconds=5
    )
    core.delete_namespaced_pod("step", NS, body=client.V1DeleteOptions(grace_period_seconds=30))
    cluster.finish_pod_deletion(NS, "step")
    events = []
    for event in stream:
        events.append((event["type"], event["raw_object"]["metadata"].get("deletionGracePeriodSeconds")))
        if len(events) == 3:
            break
    # the kubelet's grace-0 delete is two writes: the update to period 0, then the removal
    assert events == [("MODIFIED", 30), ("MODIFIED", 0), ("DELETED", 0)]


def test_bookmarks_advance_the_clients_resource_version(cluster: FakeCluster, core: client.CoreV1Api) -> None:
    rv = core.create_namespaced_pod(NS, pod("a")).metadata.resource_version
    client.AppsV1Api(cluster.api_client()).create_namespaced_deployment(NS, deployment("vllm"))  # other kind
    w = watch.Watch()
    for event in w.stream(
        core.list_namespaced_pod, NS, resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=5
    ):
        assert event["type"] == "BOOKMARK"
        assert event["raw_object"]["kind"] == "Pod" and set(event["raw_object"]) == {
            "kind",
            "apiVersion",
            "metadata",
        }
        break
    assert w.resource_version == str(cluster.resource_version)


def test_timeout_seconds_ends_the_stream(core: client.CoreV1Api) -> None:
    rv = core.create_namespaced_pod(NS, pod("a")).metadata.resource_version
    assert (
        list(watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=rv, timeout_seconds=1)) == []
    )


def test_too_old_resource_version_is_410_expired(cluster: FakeCluster, core: client.CoreV1Api) -> None:
    old = core.create_namespaced_pod(NS, pod("a")).metadata.resource_version
    for i in range(60):  # the test cluster keeps 50 events
        core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"n": str(i)}}})
    with pytest.raises(ApiException) as exc:
        list(watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=old, timeout_seconds=2))
    assert exc.value.status == 410 and exc.value.reason.startswith("Expired: too old resource version: ")
    raw = core.list_namespaced_pod(
        NS, watch=True, resource_version=old, timeout_seconds=1, _preload_content=False
    )
    event = json.loads(raw.data.splitlines()[0])
    assert (
        event["type"] == "ERROR" and event["object"]["code"] == 410 and event["object"]["reason"] == "Expired"
    )


def test_watch_from_a_future_version_times_out(cluster: FakeCluster, core: client.CoreV1Api) -> None:
    future = str(cluster.resource_version + 10)
    with pytest.raises(ApiException) as exc:
        list(watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=future, timeout_seconds=1))
    assert exc.value.status == 504 and "Too large resource version" in exc.value.reason


def test_watch_custom_objects(cluster: FakeCluster) -> None:
    custom = client.CustomObjectsApi(cluster.api_client())
    rv = custom.list_namespaced_custom_object("argoproj.io", "v1alpha1", NS, "workflows")["metadata"][
        "resourceVersion"
    ]
    # the generator sends its request on first iteration, so start from a listed version
    stream = watch.Watch().stream(
        custom.list_namespaced_custom_object,
        "argoproj.io",
        "v1alpha1",
        NS,
        "workflows",
        resource_version=rv,
        timeout_seconds=5,
    )
    cluster.create("workflows", NS, {"metadata": {"name": "wf"}, "spec": {}})
    cluster.modify("workflows", NS, "wf", lambda wf: wf.update(status={"phase": "Running"}))
    events = []
    for event in stream:
        events.append((event["type"], event["object"].get("status", {}).get("phase")))
        if len(events) == 2:
            break
    assert events == [("ADDED", None), ("MODIFIED", "Running")]


# ---------------------------------------------------------------- RBAC

CHART_RBAC: list[dict[str, Any]] = [
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "lowtide", "namespace": NS},
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch", "delete"]},
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get"]},
        ],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "lowtide", "namespace": NS},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "lowtide"},
        "subjects": [{"kind": "ServiceAccount", "name": "lowtide", "namespace": NS}],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "lowtide-nodes"},
        "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "lowtide-nodes"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "lowtide-nodes"},
        "subjects": [{"kind": "ServiceAccount", "name": "lowtide", "namespace": NS}],
    },
]
SA = f"system:serviceaccount:{NS}:lowtide"


@pytest.fixture
def sa(cluster: FakeCluster) -> client.ApiClient:
    cluster.load_rbac(CHART_RBAC)
    cluster.add_user("sa-token", SA)
    cluster.create("pods", NS, pod("step"))
    cluster.create("deployments", NS, deployment("vllm"))
    cluster.create("nodes", "", {"metadata": {"name": "gpu-1"}})
    return cluster.api_client("sa-token")


def test_rbac_allows_the_granted_verbs(sa: client.ApiClient) -> None:
    assert [p.metadata.name for p in client.CoreV1Api(sa).list_namespaced_pod(NS).items] == ["step"]
    assert client.AppsV1Api(sa).read_namespaced_deployment_scale("vllm", NS).spec.replicas == 1
    assert [n.metadata.name for n in client.CoreV1Api(sa).list_node().items] == ["gpu-1"]


def test_rbac_subresources_need_their_own_rules(sa: client.ApiClient) -> None:
    with pytest.raises(ApiException) as exc:
        client.CoreV1Api(sa).read_namespaced_pod_log("step", NS)
    body = status_of(exc.value)
    assert (exc.value.status, body["reason"]) == (403, "Forbidden")
    assert body["message"] == (
        f'pods "step" is forbidden: User "{SA}" cannot get resource "pods/log" '
        f'in API group "" in the namespace "{NS}"'
    )
    assert body["details"] == {"name": "step", "kind": "pods"}
    with pytest.raises(ApiException) as exc:
        client.AppsV1Api(sa).patch_namespaced_deployment_scale("vllm", NS, {"spec": {"replicas": 2}})
    assert status_of(exc.value)["message"] == (
        f'deployments.apps "vllm" is forbidden: User "{SA}" cannot patch resource "deployments/scale" '
        f'in API group "apps" in the namespace "{NS}"'
    )


def test_rbac_collection_cluster_scope_and_other_namespaces(sa: client.ApiClient) -> None:
    with pytest.raises(ApiException) as exc:
        client.CoreV1Api(sa).create_namespaced_pod(NS, pod("new"))
    assert status_of(exc.value)["message"] == (
        f'pods is forbidden: User "{SA}" cannot create resource "pods" in API group "" '
        f'in the namespace "{NS}"'
    )
    with pytest.raises(ApiException) as exc:
        client.CoreV1Api(sa).patch_node("gpu-1", {"metadata": {"labels": {"a": "b"}}})
    assert status_of(exc.value)["message"] == (
        f'nodes "gpu-1" is forbidden: User "{SA}" cannot patch resource "nodes" in API group "" '
        "at the cluster scope"
    )
    with pytest.raises(ApiException) as exc:
        client.CoreV1Api(sa).list_pod_for_all_namespaces()
    assert "at the cluster scope" in status_of(exc.value)["message"]
    with pytest.raises(ApiException) as exc:
        client.CoreV1Api(sa).list_namespaced_pod("kube-system")
    assert exc.value.status == 403


def test_unknown_token_is_401(cluster: FakeCluster) -> None:
    with pytest.raises(ApiException) as exc:
        client.CoreV1Api(cluster.api_client("wrong")).list_namespaced_pod(NS)
    assert exc.value.status == 401 and status_of(exc.value)["reason"] == "Unauthorized"


# ---------------------------------------------------------------- faults and hooks


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (409, "Conflict"),
        (410, "Expired"),
        (429, "TooManyRequests"),
        (500, "InternalError"),
        (503, "ServiceUnavailable"),
    ],
)
def test_injected_status_answers_the_next_matching_requests(
    cluster: FakeCluster, core: client.CoreV1Api, code: int, reason: str
) -> None:
    core.create_namespaced_pod(NS, pod("a"))
    cluster.inject("patch", "pods", status=code, times=2)
    core.read_namespaced_pod("a", NS)  # other verbs are untouched
    for _ in range(2):
        with pytest.raises(ApiException) as exc:
            core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"x": "1"}}})
        assert (exc.value.status, status_of(exc.value)["reason"]) == (code, reason)
    if code == 429:
        assert exc.value.headers["Retry-After"] == "1"
    assert core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"x": "1"}}}).metadata.labels == {
        "x": "1"
    }


def test_injected_fault_on_a_subresource_only(cluster: FakeCluster) -> None:
    apps = client.AppsV1Api(cluster.api_client())
    apps.create_namespaced_deployment(NS, deployment("vllm"))
    cluster.inject("update", "deployments/scale", status=409)
    scale = apps.read_namespaced_deployment_scale("vllm", NS)
    with pytest.raises(ApiException) as exc:
        apps.replace_namespaced_deployment_scale("vllm", NS, scale)
    assert exc.value.status == 409
    assert apps.replace_namespaced_deployment_scale("vllm", NS, scale).spec.replicas == 1


def test_injected_latency_and_request_log(cluster: FakeCluster, core: client.CoreV1Api) -> None:
    cluster.inject("list", "pods", latency=0.05)
    core.list_namespaced_pod(NS)
    assert cluster.requests[-1].verb == "list" and cluster.requests[-1].code == 200


def test_server_goes_away_and_comes_back_with_its_state(cluster: FakeCluster) -> None:
    config = cluster.configuration()
    config.retries = 0
    core = client.CoreV1Api(client.ApiClient(config))
    before = core.create_namespaced_pod(NS, pod("a"))
    cluster.stop_listening()
    with pytest.raises(urllib3.exceptions.HTTPError):
        core.read_namespaced_pod("a", NS)
    cluster.resume_listening()
    after = core.read_namespaced_pod("a", NS)
    assert (after.metadata.uid, after.metadata.resource_version) == (
        before.metadata.uid,
        before.metadata.resource_version,
    )


def test_go_away_comes_back_by_itself(cluster: FakeCluster) -> None:
    config = cluster.configuration()
    config.retries = 0
    core = client.CoreV1Api(client.ApiClient(config))
    core.create_namespaced_pod(NS, pod("a"))
    cluster.go_away(0.2)
    assert not cluster.listening
    with pytest.raises(urllib3.exceptions.HTTPError):
        core.read_namespaced_pod("a", NS)
    for _ in range(200):  # wait (bounded) for the timer to bring it back; nothing is timed
        if cluster.listening:
            break
        time.sleep(0.05)
    assert core.read_namespaced_pod("a", NS).metadata.name == "a"


def test_stopping_ends_open_watches(cluster: FakeCluster, core: client.CoreV1Api) -> None:
    rv = core.create_namespaced_pod(NS, pod("a")).metadata.resource_version
    stream = watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=rv, timeout_seconds=30)
    cluster.modify("pods", NS, "a", lambda p: p["metadata"].setdefault("labels", {}).update(x="1"))
    assert [t for t, _, _ in take(stream, 1)] == ["MODIFIED"]
    cluster.stop_listening()
    assert list(stream) == []  # the stream ends; nothing hangs
    cluster.resume_listening()


def test_hooks_bump_versions_like_api_writes(cluster: FakeCluster, core: client.CoreV1Api) -> None:
    created = cluster.create("pods", NS, pod("a", gates=True))
    with pytest.raises(ValueError, match="scheduling gates"):
        cluster.bind_pod(NS, "a", "gpu-1")
    changed = cluster.modify("pods", NS, "a", lambda p: p["status"].update(phase="Running"))
    assert int(changed["metadata"]["resourceVersion"]) == int(created["metadata"]["resourceVersion"]) + 1
    assert core.read_namespaced_pod("a", NS).status.phase == "Running"
