"""The fake API server's object semantics, driven only through the real `kubernetes` client.

Each test names the Kubernetes behaviour it pins (sources cited in k8sfake's module docstrings).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiException

from k8sfake import FakeCluster

from .conftest import Clock

NS = "research"
GATE = "lowtide.io/admission"


def pod(
    name: str, *, gates: bool = False, labels: dict[str, str] | None = None, **spec: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"containers": [{"name": "main", "image": "img:1"}], **spec},
    }
    if gates:
        body["spec"]["schedulingGates"] = [{"name": GATE}]
    return body


def deployment(name: str, replicas: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "vllm", "image": "vllm:1"}]},
            },
        },
    }


def status_of(exc: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(exc.body)
    assert body["kind"] == "Status" and body["status"] == "Failure" and body["code"] == exc.status
    return body


@pytest.fixture
def core(cluster: FakeCluster) -> client.CoreV1Api:
    return client.CoreV1Api(cluster.api_client())


@pytest.fixture
def apps(cluster: FakeCluster) -> client.AppsV1Api:
    return client.AppsV1Api(cluster.api_client())


# ---------------------------------------------------------------- discovery, metadata, versions


def test_discovery_endpoints_answer_the_client(cluster: FakeCluster) -> None:
    api = cluster.api_client()
    assert client.VersionApi(api).get_code().major == "1"
    assert client.CoreApi(api).get_api_versions().versions == ["v1"]
    groups = {g.name for g in client.ApisApi(api).get_api_versions().groups}
    assert {"apps", "coordination.k8s.io", "argoproj.io", "keda.sh", "discovery.k8s.io"} <= groups
    names = {r.name for r in client.AppsV1Api(api).get_api_resources().resources}
    assert {"deployments", "deployments/scale", "deployments/status"} <= names


def test_resource_version_is_global_and_increasing_and_metadata_is_filled(
    cluster: FakeCluster, core: client.CoreV1Api, apps: client.AppsV1Api
) -> None:
    p = core.create_namespaced_pod(NS, pod("a"))
    d = apps.create_namespaced_deployment(NS, deployment("vllm"))
    lease = client.CoordinationV1Api(cluster.api_client()).create_namespaced_lease(
        NS, {"metadata": {"name": "leader"}, "spec": {"holderIdentity": "x"}}
    )
    versions = [p.metadata.resource_version, d.metadata.resource_version, lease.metadata.resource_version]
    assert all(isinstance(v, str) for v in versions)
    assert [int(v) for v in versions] == sorted({int(v) for v in versions})
    assert p.metadata.uid and p.metadata.uid != d.metadata.uid
    assert p.metadata.creation_timestamp.isoformat().startswith("2026-01-01T12:00:00")
    assert p.metadata.generation == 1 and d.metadata.generation == 1 and lease.metadata.generation is None
    assert p.status.phase == "Pending" and p.spec.termination_grace_period_seconds == 30


def test_generate_name_adds_a_suffix(core: client.CoreV1Api) -> None:
    a = core.create_namespaced_pod(NS, {**pod(""), "metadata": {"generateName": "step-"}})
    b = core.create_namespaced_pod(NS, {**pod(""), "metadata": {"generateName": "step-"}})
    assert a.metadata.name.startswith("step-") and len(a.metadata.name) == len("step-") + 5
    assert a.metadata.name != b.metadata.name


def test_create_errors_already_exists_missing_name_and_resource_version(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("a"))
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod(NS, pod("a"))
    body = status_of(exc.value)
    assert (exc.value.status, body["reason"], body["message"]) == (
        409,
        "AlreadyExists",
        'pods "a" already exists',
    )
    assert body["details"] == {"name": "a", "kind": "pods"}
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod(NS, {"metadata": {}, "spec": pod("x")["spec"]})
    assert exc.value.status == 422 and "name or generateName is required" in status_of(exc.value)["message"]
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod(NS, {**pod("b"), "metadata": {"name": "b", "resourceVersion": "7"}})
    assert exc.value.status == 500 and "resourceVersion should not be set" in status_of(exc.value)["message"]


def test_names_labels_and_kinds_are_validated(cluster: FakeCluster, core: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod(NS, pod("Job_1"))
    assert exc.value.status == 422
    assert status_of(exc.value)["message"].startswith(
        'Pod "Job_1" is invalid: metadata.name: Invalid value: "Job_1": a lowercase RFC 1123 subdomain'
    )
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod(NS, pod("ok", labels={"lowtide.io/job": "x" * 64}))
    assert "must be no more than 63 characters" in status_of(exc.value)["message"]
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod(NS, pod("ok", labels={"lowtide.io/job": "a b"}))
    assert "a valid label must be an empty string" in status_of(exc.value)["message"]
    custom = client.CustomObjectsApi(cluster.api_client())
    with pytest.raises(ApiException) as exc:
        custom.create_namespaced_custom_object(
            "argoproj.io", "v1alpha1", NS, "workflows", {"metadata": {"name": "w"}}
        )
    assert exc.value.status == 400 and "Object 'Kind' is missing" in status_of(exc.value)["message"]


def test_not_found_is_a_status_with_details(core: client.CoreV1Api, apps: client.AppsV1Api) -> None:
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_pod("nope", NS)
    body = status_of(exc.value)
    assert (body["reason"], body["message"], body["details"]) == (
        "NotFound",
        'pods "nope" not found',
        {"name": "nope", "kind": "pods"},
    )
    with pytest.raises(ApiException) as exc:
        apps.read_namespaced_deployment_scale("nope", NS)
    assert status_of(exc.value)["details"] == {"name": "nope", "kind": "deployments", "group": "apps"}
    assert status_of(exc.value)["message"] == 'deployments.apps "nope" not found'


def test_put_with_stale_resource_version_conflicts(apps: client.AppsV1Api) -> None:
    d = apps.create_namespaced_deployment(NS, deployment("vllm"))
    d.metadata.labels = {"touched": "yes"}
    fresh = apps.replace_namespaced_deployment("vllm", NS, d)
    assert int(fresh.metadata.resource_version) > int(d.metadata.resource_version)
    assert fresh.metadata.generation == 1  # metadata-only change
    d.spec.replicas = 3  # d still carries the old resourceVersion
    with pytest.raises(ApiException) as exc:
        apps.replace_namespaced_deployment("vllm", NS, d)
    body = status_of(exc.value)
    assert body["reason"] == "Conflict" and body["message"] == (
        'Operation cannot be fulfilled on deployments.apps "vllm": the object has been modified; '
        "please apply your changes to the latest version and try again"
    )
    fresh.spec.replicas = 3
    updated = apps.replace_namespaced_deployment("vllm", NS, fresh)
    assert updated.spec.replicas == 3 and updated.metadata.generation == 2


def test_a_no_op_update_does_not_bump_the_version(apps: client.AppsV1Api) -> None:
    d = apps.create_namespaced_deployment(NS, deployment("vllm"))
    again = apps.replace_namespaced_deployment("vllm", NS, d)
    assert again.metadata.resource_version == d.metadata.resource_version


def test_status_subresource_separates_spec_and_status(cluster: FakeCluster, core: client.CoreV1Api) -> None:
    p = core.create_namespaced_pod(NS, pod("a"))
    p.status.phase = "Running"
    p.spec.containers[0].image = "img:2"
    after = core.replace_namespaced_pod_status("a", NS, p)
    assert after.status.phase == "Running" and after.spec.containers[0].image == "img:1"
    after.status.phase = "Failed"
    main = core.replace_namespaced_pod("a", NS, after)
    assert main.status.phase == "Running"  # the main resource ignores status


# ---------------------------------------------------------------- delete


def bound_pod(cluster: FakeCluster, core: client.CoreV1Api, name: str, **spec: Any) -> client.V1Pod:
    core.create_namespaced_pod(NS, pod(name, **spec))
    cluster.bind_pod(NS, name, "gpu-node-1")
    return core.read_namespaced_pod(name, NS)


def test_graceful_pod_delete_keeps_the_pod_until_the_kubelet_finishes(
    cluster: FakeCluster, core: client.CoreV1Api, clock: Clock
) -> None:
    p = bound_pod(cluster, core, "step")
    out = core.delete_namespaced_pod(
        "step",
        NS,
        body=client.V1DeleteOptions(
            grace_period_seconds=45, preconditions=client.V1Preconditions(uid=p.metadata.uid)
        ),
    )
    assert out.metadata.deletion_grace_period_seconds == 45
    assert out.metadata.deletion_timestamp.isoformat().startswith("2026-01-01T12:00:45")
    assert out.metadata.generation == p.metadata.generation + 1
    still = core.read_namespaced_pod("step", NS)
    assert still.metadata.deletion_timestamp is not None
    # a second delete may only shorten the grace period
    longer = core.delete_namespaced_pod("step", NS, body=client.V1DeleteOptions(grace_period_seconds=90))
    assert longer.metadata.deletion_grace_period_seconds == 45
    clock.advance(5)
    shorter = core.delete_namespaced_pod("step", NS, body=client.V1DeleteOptions(grace_period_seconds=10))
    assert shorter.metadata.deletion_grace_period_seconds == 10
    # rest.BeforeDelete: the new deadline counts from the first request, not from now
    assert shorter.metadata.deletion_timestamp.isoformat().startswith("2026-01-01T12:00:10")
    cluster.finish_pod_deletion(NS, "step")
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_pod("step", NS)
    assert exc.value.status == 404


def test_grace_comes_from_the_body_when_there_is_one(cluster: FakeCluster, core: client.CoreV1Api) -> None:
    bound_pod(cluster, core, "q", terminationGracePeriodSeconds=20)
    # handlers/delete.go decodes the query only when the body is empty
    out = core.delete_namespaced_pod("q", NS, grace_period_seconds=5, body=client.V1DeleteOptions())
    assert out.metadata.deletion_grace_period_seconds == 20
    bound_pod(cluster, core, "r", terminationGracePeriodSeconds=20)
    out = core.delete_namespaced_pod("r", NS, grace_period_seconds=5)
    assert out.metadata.deletion_grace_period_seconds == 5


def test_unscheduled_pod_and_zero_grace_delete_immediately(
    cluster: FakeCluster, core: client.CoreV1Api
) -> None:
    core.create_namespaced_pod(NS, pod("gated", gates=True))
    core.delete_namespaced_pod("gated", NS, body=client.V1DeleteOptions(grace_period_seconds=30))
    bound_pod(cluster, core, "bound")
    core.delete_namespaced_pod("bound", NS, body=client.V1DeleteOptions(grace_period_seconds=0))
    assert cluster.list("pods", NS) == []


def test_delete_preconditions_conflict(cluster: FakeCluster, core: client.CoreV1Api) -> None:
    p = bound_pod(cluster, core, "step")
    with pytest.raises(ApiException) as exc:
        core.delete_namespaced_pod(
            "step", NS, body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="not-the-uid"))
        )
    body = status_of(exc.value)
    assert exc.value.status == 409 and body["reason"] == "Conflict"
    assert body["message"] == (
        'Operation cannot be fulfilled on Pod "step": the UID in the precondition (not-the-uid) '
        f"does not match the UID in record ({p.metadata.uid}). "
        "The object might have been deleted and then recreated"
    )
    with pytest.raises(ApiException) as exc:
        core.delete_namespaced_pod(
            "step",
            NS,
            body=client.V1DeleteOptions(preconditions=client.V1Preconditions(resource_version="1")),
        )
    assert exc.value.status == 409
    assert "the ResourceVersion in the precondition (1) does not match" in status_of(exc.value)["message"]
    assert cluster.get("pods", NS, "step")["metadata"].get("deletionTimestamp") is None


def test_finalizers_hold_an_object_until_removed(apps: client.AppsV1Api) -> None:
    body = deployment("vllm")
    body["metadata"]["finalizers"] = ["lowtide.io/cleanup"]
    apps.create_namespaced_deployment(NS, body)
    answer = apps.delete_namespaced_deployment("vllm", NS, _preload_content=False)
    assert json.loads(answer.data)["kind"] == "Deployment"  # not yet deleted: the object, not a Status
    held = apps.read_namespaced_deployment("vllm", NS)
    assert held.metadata.deletion_timestamp is not None and held.metadata.finalizers == ["lowtide.io/cleanup"]
    with pytest.raises(ApiException) as exc:
        apps.patch_namespaced_deployment(
            "vllm", NS, {"metadata": {"finalizers": ["lowtide.io/cleanup", "x"]}}
        )
    assert exc.value.status == 422 and "no new finalizers can be added" in status_of(exc.value)["message"]
    apps.patch_namespaced_deployment(
        "vllm", NS, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["lowtide.io/cleanup"]}}
    )
    with pytest.raises(ApiException) as exc:
        apps.read_namespaced_deployment("vllm", NS)
    assert exc.value.status == 404


def test_non_pod_delete_answers_a_success_status(apps: client.AppsV1Api) -> None:
    d = apps.create_namespaced_deployment(NS, deployment("vllm"))
    out = apps.delete_namespaced_deployment("vllm", NS)
    assert out.status == "Success"
    assert (out.details.name, out.details.kind, out.details.group, out.details.uid) == (
        "vllm",
        "deployments",
        "apps",
        d.metadata.uid,
    )


# ---------------------------------------------------------------- patches and pod update rules


def test_strategic_merge_removes_the_gate_and_pins_the_node(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("step", gates=True, labels={"a": "1", "b": "2"}))
    out = core.patch_namespaced_pod(
        "step",
        NS,
        {
            "metadata": {"labels": {"b": None}},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": "gpu-2"},
                "schedulingGates": [{"name": GATE, "$patch": "delete"}],
            },
        },
    )
    assert out.spec.scheduling_gates is None
    assert out.spec.node_selector == {"kubernetes.io/hostname": "gpu-2"}
    assert out.metadata.labels == {"a": "1"}
    assert out.metadata.generation == 2


def test_strategic_merge_merges_containers_by_name(core: client.CoreV1Api) -> None:
    body = pod("two")
    body["spec"]["containers"].append({"name": "side", "image": "side:1"})
    core.create_namespaced_pod(NS, body)
    out = core.patch_namespaced_pod(
        "two", NS, {"spec": {"containers": [{"name": "side", "image": "side:2"}]}}
    )
    assert [(c.name, c.image) for c in out.spec.containers] == [("main", "img:1"), ("side", "side:2")]


def test_adding_a_scheduling_gate_after_creation_is_invalid(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("step", gates=True))
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_pod("step", NS, {"spec": {"schedulingGates": [{"name": "other"}]}})
    body = status_of(exc.value)
    assert exc.value.status == 422 and body["reason"] == "Invalid"
    assert body["message"] == (
        'Pod "step" is invalid: spec.schedulingGates[1].name: Forbidden: '
        "only deletion is allowed, but found new scheduling gate 'other'"
    )
    assert body["details"]["causes"] == [
        {
            "reason": "FieldValueForbidden",
            "field": "spec.schedulingGates[1].name",
            "message": "Forbidden: only deletion is allowed, but found new scheduling gate 'other'",
        }
    ]


def test_node_selector_may_only_be_extended_while_gated(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("step", gates=True, nodeSelector={"pool": "gpu"}))
    core.patch_namespaced_pod("step", NS, {"spec": {"nodeSelector": {"zone": "a"}}})  # addition: fine
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_pod("step", NS, {"spec": {"nodeSelector": {"pool": "cpu"}}})
    assert exc.value.status == 422
    assert "spec.nodeSelector: Invalid value" in status_of(exc.value)["message"]
    assert (
        "only additions to spec.nodeSelector are allowed (no mutations or deletions)"
        in status_of(exc.value)["message"]
    )
    core.patch_namespaced_pod("step", NS, {"spec": {"schedulingGates": None}})
    with pytest.raises(ApiException) as exc:  # no longer gated: the spec is frozen
        core.patch_namespaced_pod("step", NS, {"spec": {"nodeSelector": {"late": "x"}}})
    assert exc.value.status == 422
    assert "pod updates may not change fields other than" in status_of(exc.value)["message"]


def test_other_pod_spec_fields_are_immutable_but_image_is_not(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("step"))
    out = core.patch_namespaced_pod(
        "step", NS, {"spec": {"containers": [{"name": "main", "image": "img:2"}]}}
    )
    assert out.spec.containers[0].image == "img:2"
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_pod("step", NS, {"spec": {"priorityClassName": "research"}})
    assert exc.value.status == 422 and "spec.priorityClassName" in status_of(exc.value)["message"]
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_pod("step", NS, {"spec": {"containers": [{"name": "extra", "image": "x"}]}})
    assert "pod updates may not add or remove containers" in status_of(exc.value)["message"]


def test_gated_pod_may_not_be_created_with_a_node_name(core: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod(NS, pod("step", gates=True, nodeName="gpu-1"))
    assert exc.value.status == 422
    assert (
        "spec.nodeName: Forbidden: cannot be set until all schedulingGates have been cleared"
        in (status_of(exc.value)["message"])
    )


def test_json_patch_and_merge_patch(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("step", gates=True))
    out = core.patch_namespaced_pod(
        "step",
        NS,
        [
            {"op": "test", "path": "/spec/schedulingGates/0/name", "value": GATE},
            {"op": "remove", "path": "/spec/schedulingGates"},
        ],
    )
    assert out.spec.scheduling_gates is None
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_pod("step", NS, [{"op": "test", "path": "/metadata/name", "value": "other"}])
    assert exc.value.status == 422
    merged = core.patch_namespaced_pod(
        "step", NS, {"metadata": {"annotations": {"k": "v"}}}, _content_type="application/merge-patch+json"
    )
    assert merged.metadata.annotations == {"k": "v"}


def test_patch_carrying_a_stale_resource_version_conflicts(core: client.CoreV1Api) -> None:
    p = core.create_namespaced_pod(NS, pod("step"))
    core.patch_namespaced_pod("step", NS, {"metadata": {"labels": {"x": "1"}}})
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_pod(
            "step", NS, {"metadata": {"resourceVersion": p.metadata.resource_version, "labels": {"x": "2"}}}
        )
    assert exc.value.status == 409 and status_of(exc.value)["reason"] == "Conflict"


def test_custom_objects_take_merge_patch_but_not_strategic(cluster: FakeCluster) -> None:
    custom = client.CustomObjectsApi(cluster.api_client())
    wf = custom.create_namespaced_custom_object(
        "argoproj.io",
        "v1alpha1",
        NS,
        "workflows",
        {
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": "Workflow",
            "metadata": {"generateName": "job-", "labels": {"lowtide.io/job": "j1"}},
            "spec": {"entrypoint": "main", "templates": []},
        },
    )
    name = wf["metadata"]["name"]
    out = custom.patch_namespaced_custom_object(
        "argoproj.io", "v1alpha1", NS, "workflows", name, {"spec": {"shutdown": "Stop"}}
    )
    assert (
        out["spec"]["shutdown"] == "Stop"
        and out["spec"]["templates"] == []
        and out["metadata"]["generation"] == 2
    )
    with pytest.raises(ApiException) as exc:
        custom.patch_namespaced_custom_object(
            "argoproj.io",
            "v1alpha1",
            NS,
            "workflows",
            name,
            {"spec": {}},
            _content_type="application/strategic-merge-patch+json",
        )
    assert exc.value.status == 415 and status_of(exc.value)["reason"] == "UnsupportedMediaType"
    listed = custom.list_namespaced_custom_object(
        "argoproj.io", "v1alpha1", NS, "workflows", label_selector="lowtide.io/job=j1"
    )
    assert [i["metadata"]["name"] for i in listed["items"]] == [name] and listed["kind"] == "WorkflowList"
    so = custom.create_namespaced_custom_object(
        "keda.sh",
        "v1alpha1",
        NS,
        "scaledobjects",
        {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": {"name": "vllm"},
            "spec": {"scaleTargetRef": {"name": "vllm"}, "minReplicaCount": 1},
        },
    )
    assert so["spec"]["scaleTargetRef"]["name"] == "vllm"


# ---------------------------------------------------------------- list selectors and paging


def test_label_selectors(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("a", labels={"tier": "gpu", "job": "1"}))
    core.create_namespaced_pod(NS, pod("b", labels={"tier": "cpu", "job": "2"}))
    core.create_namespaced_pod(NS, pod("c", labels={"tier": "gpu"}))

    def names(selector: str) -> list[str]:
        return [p.metadata.name for p in core.list_namespaced_pod(NS, label_selector=selector).items]

    assert names("tier=gpu") == ["a", "c"]
    assert names("tier==gpu,job") == ["a"]
    assert names("tier!=gpu") == ["b"]
    assert names("job in (1,2)") == ["a", "b"]
    assert names("job notin (1)") == ["b", "c"]
    assert names("!job") == ["c"]
    with pytest.raises(ApiException) as exc:
        names("tier in ()")
    assert exc.value.status == 400


def test_field_selectors(cluster: FakeCluster, core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("a"))
    core.create_namespaced_pod(NS, pod("b"))
    core.create_namespaced_pod("other", pod("a"))
    cluster.bind_pod(NS, "b", "gpu-1")
    cluster.modify("pods", NS, "b", lambda p: p["status"].update(phase="Running"))
    assert [
        p.metadata.name for p in core.list_namespaced_pod(NS, field_selector="spec.nodeName=gpu-1").items
    ] == ["b"]
    assert [
        p.metadata.name for p in core.list_namespaced_pod(NS, field_selector="status.phase!=Running").items
    ] == ["a"]
    everywhere = core.list_pod_for_all_namespaces(field_selector="metadata.name=a").items
    assert sorted(p.metadata.namespace for p in everywhere) == ["other", NS]
    with pytest.raises(ApiException) as exc:
        core.list_namespaced_pod(NS, field_selector="spec.image=x")
    assert (
        exc.value.status == 400 and status_of(exc.value)["message"] == "field label not supported: spec.image"
    )


def test_limit_and_continue_page_a_consistent_snapshot(core: client.CoreV1Api) -> None:
    for name in "abcde":
        core.create_namespaced_pod(NS, pod(name))
    first = core.list_namespaced_pod(NS, limit=2)
    assert [p.metadata.name for p in first.items] == ["a", "b"] and first.metadata.remaining_item_count == 3
    core.delete_namespaced_pod("c", NS)
    second = core.list_namespaced_pod(NS, limit=2, _continue=first.metadata._continue)
    assert [p.metadata.name for p in second.items] == ["c", "d"]  # the snapshot still has c
    assert second.metadata.resource_version == first.metadata.resource_version
    last = core.list_namespaced_pod(NS, limit=2, _continue=second.metadata._continue)
    assert [p.metadata.name for p in last.items] == ["e"] and not last.metadata._continue


def test_list_at_a_compacted_or_future_version(cluster: FakeCluster, core: client.CoreV1Api) -> None:
    old = core.create_namespaced_pod(NS, pod("a")).metadata.resource_version
    core.create_namespaced_pod(NS, pod("b"))
    exact = core.list_namespaced_pod(NS, resource_version=old, resource_version_match="Exact")
    assert [p.metadata.name for p in exact.items] == ["a"]
    cluster.compact()
    with pytest.raises(ApiException) as exc:
        core.list_namespaced_pod(NS, resource_version=old, resource_version_match="Exact")
    assert exc.value.status == 410 and status_of(exc.value)["reason"] == "Expired"
    with pytest.raises(ApiException) as exc:
        core.list_namespaced_pod(NS, resource_version="99999", resource_version_match="NotOlderThan")
    assert exc.value.status == 504


# ---------------------------------------------------------------- scale, other resources, logs


def test_scale_subresource(apps: client.AppsV1Api) -> None:
    apps.create_namespaced_deployment(NS, deployment("vllm", replicas=1))
    scale = apps.read_namespaced_deployment_scale("vllm", NS)
    assert (scale.kind, scale.api_version, scale.spec.replicas, scale.status.selector) == (
        "Scale",
        "autoscaling/v1",
        1,
        "app=vllm",
    )
    scale.spec.replicas = 3
    done = apps.replace_namespaced_deployment_scale("vllm", NS, scale)
    assert done.spec.replicas == 3 and int(done.metadata.resource_version) > int(
        scale.metadata.resource_version
    )
    scale.spec.replicas = 5  # stale resourceVersion
    with pytest.raises(ApiException) as exc:
        apps.replace_namespaced_deployment_scale("vllm", NS, scale)
    assert exc.value.status == 409 and 'deployments.apps "vllm"' in status_of(exc.value)["message"]
    patched = apps.patch_namespaced_deployment_scale("vllm", NS, {"spec": {"replicas": 0}})
    assert patched.spec.replicas == 0
    d = apps.read_namespaced_deployment("vllm", NS)
    assert d.spec.replicas == 0 and d.metadata.generation == 3
    with pytest.raises(ApiException) as exc:
        apps.patch_namespaced_deployment_scale("vllm", NS, {"spec": {"replicas": -1}})
    assert exc.value.status == 422 and status_of(exc.value)["message"].startswith(
        'Scale.autoscaling "vllm" is invalid'
    )


def test_hpa_endpointslices_events_and_nodes(cluster: FakeCluster, core: client.CoreV1Api) -> None:
    api = cluster.api_client()
    hpa = client.AutoscalingV2Api(api).create_namespaced_horizontal_pod_autoscaler(
        NS,
        {
            "metadata": {"name": "vllm"},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vllm"},
                "minReplicas": 1,
                "maxReplicas": 4,
            },
        },
    )
    assert hpa.spec.scale_target_ref.name == "vllm"
    slices = client.DiscoveryV1Api(api)
    slices.create_namespaced_endpoint_slice(
        NS,
        {
            "metadata": {"name": "vllm-x", "labels": {"kubernetes.io/service-name": "vllm"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}}],
        },
    )
    found = slices.list_namespaced_endpoint_slice(NS, label_selector="kubernetes.io/service-name=vllm").items
    assert found[0].endpoints[0].conditions.ready is True
    core.create_namespaced_event(
        NS,
        {
            "metadata": {"name": "e1"},
            "reason": "Preempted",
            "type": "Normal",
            "involvedObject": {"kind": "Pod", "name": "step", "namespace": NS},
        },
    )
    assert [
        e.reason for e in core.list_namespaced_event(NS, field_selector="involvedObject.name=step").items
    ] == ["Preempted"]
    core.create_node({"metadata": {"name": "gpu-1"}})
    node = core.patch_node(
        "gpu-1",
        {
            "metadata": {"labels": {"lowtide.io/lent": "true"}},
            "spec": {"taints": [{"key": "lowtide.io/lent", "effect": "NoSchedule"}]},
        },
    )
    assert node.metadata.labels == {"lowtide.io/lent": "true"} and node.spec.taints[0].effect == "NoSchedule"
    with pytest.raises(ApiException) as exc:
        core.patch_node("gpu-1", {"spec": {"taints": [{"key": "x", "effect": "Sometimes"}]}})
    assert exc.value.status == 422 and "spec.taints[0].effect" in status_of(exc.value)["message"]
    with pytest.raises(ApiException) as exc:
        core.patch_node("gpu-1", {"metadata": {"resourceVersion": "1", "labels": {"a": "b"}}})
    assert exc.value.status == 409


def test_lease_update_is_optimistic(cluster: FakeCluster) -> None:
    leases = client.CoordinationV1Api(cluster.api_client())
    leases.create_namespaced_lease(
        NS,
        {
            "metadata": {"name": "lowtide"},
            "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15, "leaseTransitions": 0},
        },
    )
    seen_by_a = leases.read_namespaced_lease("lowtide", NS)
    seen_by_b = leases.read_namespaced_lease("lowtide", NS)
    seen_by_b.spec.holder_identity = "b"
    seen_by_b.spec.lease_transitions = 1
    leases.replace_namespaced_lease("lowtide", NS, seen_by_b)
    seen_by_a.spec.renew_time = seen_by_a.metadata.creation_timestamp
    with pytest.raises(ApiException) as exc:
        leases.replace_namespaced_lease("lowtide", NS, seen_by_a)
    assert exc.value.status == 409
    current = leases.read_namespaced_lease("lowtide", NS)
    assert (current.spec.holder_identity, current.spec.lease_transitions) == ("b", 1)
    current.spec.renew_time = datetime(2026, 1, 1, 12, 0, 1, tzinfo=UTC)
    renewed = leases.replace_namespaced_lease("lowtide", NS, current)
    raw = cluster.get("leases", NS, "lowtide")["spec"]["renewTime"]
    assert raw == "2026-01-01T12:00:01.000000Z"  # MicroTime, normalised like the API does
    again = leases.replace_namespaced_lease("lowtide", NS, renewed)  # a round trip is a no-op
    assert again.metadata.resource_version == renewed.metadata.resource_version
    with pytest.raises(ApiException) as exc:
        again.spec.lease_duration_seconds = 0
        leases.replace_namespaced_lease("lowtide", NS, again)
    assert exc.value.status == 422


def test_pod_logs(cluster: FakeCluster, core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("step"))
    # On no node yet: 204, no body (strategy.go LogLocation gives no location).
    unbound = core.read_namespaced_pod_log("step", NS, _preload_content=False)
    assert unbound.status == 204 and unbound.data == b""
    cluster.bind_pod(NS, "step", "n1")
    with pytest.raises(ApiException) as exc:  # the kubelet has no status of the container yet
        core.read_namespaced_pod_log("step", NS)
    assert exc.value.status == 400
    assert status_of(exc.value)["message"] == 'container "main" in pod "step" is not available'

    def waiting(p: dict[str, Any]) -> None:
        waiting = {"waiting": {"reason": "ImagePullBackOff"}}
        main = {"name": "main", "image": "img:1", "imageID": "", "ready": False, "restartCount": 0}
        p["status"]["containerStatuses"] = [{**main, "state": waiting}]

    cluster.modify("pods", NS, "step", waiting)
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_pod_log("step", NS)
    assert exc.value.status == 400 and status_of(exc.value)["message"] == (
        'container "main" in pod "step" is waiting to start: trying and failing to pull image'
    )
    cluster.set_pod_log(NS, "step", "one\ntwo\nthree\n")
    limited = core.read_namespaced_pod_log("step", NS, limit_bytes=5, _preload_content=False)
    assert limited.data == b"one\nt"  # cut at the byte, not the line
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_pod_log("step", NS, limit_bytes=0)
    assert exc.value.status == 422 and "limitBytes: Invalid value: 0" in status_of(exc.value)["message"]
    raw = core.read_namespaced_pod_log("step", NS, _preload_content=False)
    assert raw.data.decode() == "one\ntwo\nthree\n"
    assert core.read_namespaced_pod_log("step", NS, tail_lines=1, _preload_content=False).data == b"three\n"
    # kubernetes-client/python#2596: client 36 returns the repr of the bytes for text bodies, so
    # log readers must use _preload_content=False. This fails once the pinned client is fixed.
    assert core.read_namespaced_pod_log("step", NS) == "b'one\\ntwo\\nthree\\n'"
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_pod_log("step", NS, container="nope")
    assert exc.value.status == 400
    assert status_of(exc.value)["message"] == "container nope is not valid for pod step"
    # The kubelet keeps a log under its pod's uid: a new pod of the same name has none of it.
    core.delete_namespaced_pod("step", NS, grace_period_seconds=0)
    core.create_namespaced_pod(NS, pod("step", nodeName="n1"))
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_pod_log("step", NS)
    assert exc.value.status == 400 and "is not available" in status_of(exc.value)["message"]
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_pod_log("gone", NS)
    assert exc.value.status == 404


def test_put_of_a_client_built_pod_is_defaulted_like_the_api(core: client.CoreV1Api) -> None:
    created = core.create_namespaced_pod(NS, pod("step"))
    rebuilt = pod("step", labels={"x": "1"})  # no server defaults in it, as a client builds it
    rebuilt["metadata"]["resourceVersion"] = created.metadata.resource_version
    out = core.replace_namespaced_pod("step", NS, rebuilt)
    assert out.metadata.labels == {"x": "1"} and out.spec.termination_grace_period_seconds == 30


def test_strategic_merge_directives(core: client.CoreV1Api) -> None:
    body = pod("step", nodeSelector={"a": "1"}, tolerations=[{"key": "t", "operator": "Exists"}])
    body["spec"]["schedulingGates"] = [{"name": "g1"}, {"name": "g2"}, {"name": GATE}]
    core.create_namespaced_pod(NS, body)
    out = core.patch_namespaced_pod(
        "step",
        NS,
        {
            "spec": {
                "schedulingGates": [{"name": "g1", "$patch": "delete"}, {"name": "g2", "$patch": "delete"}]
            }
        },
    )
    assert [g.name for g in out.spec.scheduling_gates] == [GATE]
    out = core.patch_namespaced_pod("step", NS, {"spec": {"schedulingGates": [{"$patch": "replace"}]}})
    assert out.spec.scheduling_gates is None  # replace with an empty list: every gate removed
    # tolerations have no patch merge key: the list is replaced, which drops "t" and is refused
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_pod("step", NS, {"spec": {"tolerations": [{"key": "u", "operator": "Exists"}]}})
    assert (
        "existing toleration can not be modified except its tolerationSeconds"
        in status_of(exc.value)["message"]
    )
    both = [{"key": "t", "operator": "Exists"}, {"key": "u", "operator": "Exists"}]
    assert len(core.patch_namespaced_pod("step", NS, {"spec": {"tolerations": both}}).spec.tolerations) == 2


def test_list_option_validation(core: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as exc:
        core.list_namespaced_pod(NS, resource_version_match="Exact")
    assert exc.value.status == 422
    assert (
        "resourceVersionMatch is forbidden unless resourceVersion is provided"
        in status_of(exc.value)["message"]
    )


# -- events.k8s.io/v1 (pkg/apis/core/validation/events.go) --------------------------------------------


def v1_event(**changes: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "metadata": {"name": "step.1"},
        "eventTime": "2026-01-01T00:00:00.5+00:00",
        "reportingController": "lowtide.io/control-plane",
        "reportingInstance": "lowtide-0",
        "action": "Admit",
        "reason": "Admitted",
        "type": "Normal",
        "regarding": {"kind": "Pod", "name": "step", "namespace": "ns"},
        "note": "onto n1",
    }
    event.update(changes)
    return {k: v for k, v in event.items() if v is not None}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"eventTime": None}, "eventTime"),
        ({"type": "Info"}, "type"),
        ({"reportingController": "not a qualified name!"}, "reportingController"),
        ({"reportingInstance": None}, "reportingInstance"),
        ({"action": None}, "action"),
        ({"reason": "r" * 129}, "reason"),
        ({"note": "é" * 513}, "message"),  # 1026 bytes: Go's len() counts bytes
        ({"series": {"count": 1, "lastObservedTime": "2026-01-01T00:00:01Z"}}, "series.count"),
        ({"regarding": {"kind": "Pod", "name": "step"}}, "involvedObject.namespace"),
    ],
)
def test_an_events_v1_event_is_validated_as_the_api_server_does(
    cluster: FakeCluster, changes: dict[str, Any], field: str
) -> None:
    events = client.EventsV1Api(cluster.api_client())
    with pytest.raises(ApiException) as exc:
        events.create_namespaced_event("ns", v1_event(**changes))
    assert exc.value.status == 422
    assert field in [c["field"] for c in status_of(exc.value)["details"]["causes"]]


def test_an_events_v1_event_changes_only_its_series(cluster: FakeCluster) -> None:
    events = client.EventsV1Api(cluster.api_client())
    made = events.create_namespaced_event("ns", v1_event(), _preload_content=False)
    assert json.loads(made.data)["eventTime"] == "2026-01-01T00:00:00.500000Z"  # MicroTime
    smp = "application/strategic-merge-patch+json"
    series = {"series": {"count": 2, "lastObservedTime": "2026-01-01T00:00:09+00:00"}}
    patched = events.patch_namespaced_event("step.1", "ns", series, _content_type=smp, _preload_content=False)
    assert json.loads(patched.data)["series"] == {
        "count": 2,
        "lastObservedTime": "2026-01-01T00:00:09.000000Z",
    }
    with pytest.raises(ApiException) as exc:
        events.patch_namespaced_event("step.1", "ns", {"note": "changed"}, _content_type=smp)
    assert exc.value.status == 422 and "message: Invalid value" in status_of(exc.value)["message"]
    assert "field is immutable" in status_of(exc.value)["message"]
