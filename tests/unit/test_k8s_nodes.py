"""The pure readings of `adapters.k8s_nodes`: a pod's effective GPU request (Kubernetes' rule with
init and sidecar containers), taints and tolerations as the scheduler matches them, why a node
refuses a pod, and the one merge patch that gives a node lowtide's label and taint (every other
label and taint kept, the resourceVersion carried, never NoExecute)."""

from __future__ import annotations

from typing import Any

import pytest

from lowtide.adapters.k8s_nodes import (
    LENT_LABEL,
    LENT_TAINT_KEY,
    allocatable_gpus,
    lent_by_node,
    lent_taint,
    node_refusal,
    node_write,
    pod_gpus,
    tolerates,
)

Obj = dict[str, Any]


def c(gpus: int | str | None = None, *, requests: int | None = None, sidecar: bool = False) -> Obj:
    resources: Obj = {}
    if gpus is not None:
        resources["limits"] = {"nvidia.com/gpu": gpus, "cpu": "2"}
    if requests is not None:
        resources["requests"] = {"nvidia.com/gpu": requests}
    container: Obj = {"name": "x", "resources": resources}
    if sidecar:
        container["restartPolicy"] = "Always"
    return container


def pod(*containers: Obj, init: tuple[Obj, ...] = ()) -> Obj:
    return {"spec": {"containers": list(containers), "initContainers": list(init)}}


def ready_node(**spec: Any) -> Obj:
    return {
        "metadata": {"name": "gpu-1", "resourceVersion": "42", "labels": {"team": "a"}},
        "spec": spec,
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}],
            "allocatable": {"nvidia.com/gpu": "8", "cpu": "64"},
        },
    }


@pytest.mark.parametrize(
    ("spec", "gpus"),
    [
        (pod(c(2), c(1)), 3),  # containers add up
        (pod(c("4")), 4),  # a quantity string
        (pod(c(None, requests=2)), 2),  # requests alone
        (pod(c(None)), 0),  # no GPU
        (pod(c(1), init=(c(3),)), 3),  # an init container's need is a floor ...
        (pod(c(2), init=(c(1),)), 2),  # ... not added
        (pod(c(1), init=(c(1, sidecar=True), c(2))), 3),  # a sidecar runs beside both: 1+2 vs 1+1
        (pod(c(2), init=(c(1, sidecar=True),)), 3),  # a sidecar adds to the containers
    ],
)
def test_a_pods_gpus_follow_the_effective_request_rule(spec: Obj, gpus: int) -> None:
    assert pod_gpus(spec) == gpus


@pytest.mark.parametrize(
    ("toleration", "taint", "expected"),
    [
        (
            {"key": "k", "operator": "Equal", "value": "v"},
            {"key": "k", "value": "v", "effect": "NoSchedule"},
            True,
        ),
        ({"key": "k", "value": "v"}, {"key": "k", "value": "w", "effect": "NoSchedule"}, False),
        ({"key": "k", "operator": "Exists"}, {"key": "k", "value": "w", "effect": "NoExecute"}, True),
        ({"operator": "Exists"}, {"key": "any", "effect": "NoSchedule"}, True),
        (
            {"key": "k", "operator": "Exists", "effect": "NoExecute"},
            {"key": "k", "effect": "NoSchedule"},
            False,
        ),
        ({"key": "other", "operator": "Exists"}, {"key": "k", "effect": "NoSchedule"}, False),
        (
            {"key": "k", "operator": "Gt", "value": "3"},
            {"key": "k", "value": "5", "effect": "NoSchedule"},
            True,
        ),
        (
            {"key": "k", "operator": "Lt", "value": "3"},
            {"key": "k", "value": "5", "effect": "NoSchedule"},
            False,
        ),
    ],
)
def test_tolerations_match_taints_as_kubernetes_does(toleration: Obj, taint: Obj, expected: bool) -> None:
    assert tolerates(toleration, taint) is expected


def test_a_node_refuses_what_the_scheduler_would_refuse() -> None:
    assert node_refusal(ready_node(), []) is None
    not_ready = ready_node()
    not_ready["status"]["conditions"] = [{"type": "Ready", "status": "False", "reason": "KubeletNotReady"}]
    assert node_refusal(not_ready, []) == "is not Ready (Ready=False: KubeletNotReady)"
    assert node_refusal({"status": {}}, []) == "is not Ready (Ready=unknown)"
    assert node_refusal(ready_node(unschedulable=True), []) == "is cordoned (spec.unschedulable)"
    tainted = ready_node(taints=[{"key": "dedicated", "value": "infer", "effect": "NoSchedule"}])
    assert node_refusal(tainted, []) == (
        "has the taint dedicated=infer:NoSchedule, which the step's pod does not tolerate"
    )
    assert node_refusal(tainted, [{"key": "dedicated", "operator": "Exists"}]) is None
    # PreferNoSchedule (lowtide's own, or anyone's) only steers the scheduler: no refusal.
    assert (
        node_refusal(ready_node(taints=[lent_taint(), {"key": "x", "effect": "PreferNoSchedule"}]), [])
        is None
    )
    assert allocatable_gpus(ready_node()) == 8 and allocatable_gpus({"status": {"allocatable": {}}}) == 0


def test_lowtides_taint_is_prefer_no_schedule_and_never_no_execute() -> None:
    assert lent_taint() == {"key": LENT_TAINT_KEY, "value": "true", "effect": "PreferNoSchedule"}
    with pytest.raises(ValueError, match="never taints a node NoExecute"):
        lent_taint("NoExecute")
    with pytest.raises(ValueError, match="preemption candidates"):
        lent_taint("NoSchedule")


def test_the_node_write_changes_only_lowtides_label_and_taint() -> None:
    foreign = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    node = ready_node(taints=[foreign])
    on = node_write(node, 3)
    assert on == {
        "metadata": {"labels": {LENT_LABEL: "3"}, "resourceVersion": "42"},
        "spec": {"taints": [foreign, lent_taint()]},
    }
    # As the node then reads: nothing to write for the same count; only the label for another.
    node["metadata"]["labels"][LENT_LABEL] = "3"
    node["spec"]["taints"] = [foreign, lent_taint()]
    assert node_write(node, 3) is None
    assert node_write(node, 1) == {"metadata": {"labels": {LENT_LABEL: "1"}, "resourceVersion": "42"}}
    # At 0 both go; the foreign taint and the other label stay (a merge patch keeps unnamed labels).
    assert node_write(node, 0) == {
        "metadata": {"labels": {LENT_LABEL: None}, "resourceVersion": "42"},
        "spec": {"taints": [foreign]},
    }
    bare = ready_node(taints=[lent_taint()])
    assert node_write(bare, 0) == {"metadata": {"resourceVersion": "42"}, "spec": {"taints": None}}
    assert node_write(ready_node(), 0) is None


def test_lent_gpus_count_admitted_unfinished_pods_per_configured_node() -> None:
    def research(node: str | None, gpus: int, phase: str = "Running", deleting: bool = False) -> Obj:
        p = pod(c(gpus))
        p["metadata"] = {"uid": f"{node}-{gpus}-{phase}", **({"deletionTimestamp": "t"} if deleting else {})}
        p["status"] = {"phase": phase}
        if node is None:
            p["spec"]["schedulingGates"] = [{"name": "lowtide.io/admission"}]
        else:
            p["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
        return p

    listed = [
        research("n1", 2),
        research("n1", 1, deleting=True),  # still holds its device until gone
        research("n1", 4, phase="Succeeded"),
        research(None, 8),  # gated: not admitted
        research("n2", 1, phase="Pending"),
        research("elsewhere", 5),  # not a configured node
    ]
    assert lent_by_node(listed, ["n1", "n2", "n3"]) == {"n1": 3, "n2": 1, "n3": 0}
