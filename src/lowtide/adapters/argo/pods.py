"""Pure readings of Kubernetes pods and Argo names for the runtime Argo executor.

Role: what `executor.ArgoExecutor` needs to know about a pod or a node without talking to the
API: whether a pod still waits at lowtide's admission gate, whether it is being deleted, why a
pending pod does not start (an image that cannot be pulled, no node for it), the admission patch,
the Argo node a pod belongs to, and the pod name Argo gives a node.
Neighbours: `workflow` (the gate and label names it compiles in), `node_status` (the node's
outcome), `executor` (the effects).
Must not: talk to Kubernetes, read the clock or decide anything about a step.

Facts used (kubernetes commit 000f2605; argo-workflows v4.1.2, commit f016ad89):
- A pod created with `spec.schedulingGates` stays Pending with the PodScheduled condition
  `False`/`SchedulingGated`; gates may only be removed, and while the pod is gated
  `spec.nodeSelector` may gain keys (pkg/apis/core/validation/validation.go
  `validateOnlyDeletedSchedulingGates`, `validateNodeSelectorMutation`). One strategic merge
  patch can do both: `schedulingGates` merges by `name`, so `{"name": ..., "$patch": "delete"}`
  removes exactly our gate (PodSpec's `patchMergeKey:"name"` in staging/src/k8s.io/api/core/v1/
  types.go). The `kubernetes` Python client sends a dict body as JSON Patch unless told the
  content type (api_client.py `select_header_content_type`), so the executor names it.
- A pod the scheduler cannot place gets PodScheduled `False` with reason `Unschedulable` and the
  scheduler's message; a container that cannot get its image waits with reason `ErrImagePull`,
  `ImagePullBackOff` or `InvalidImageName` (pkg/kubelet/images/types.go).
- Argo annotates each pod with `workflows.argoproj.io/node-id` (workflow/common/common.go
  `AnnotationKeyNodeID`, set in workflow/controller/workflowpod.go) and names it, in the default
  v2 format, `<workflow>-<template>-<fnv32a(node name)>` (workflow/util/pod_name.go
  `GeneratePodName`); v1 names are the node id. Node ids are `<workflow>-<fnv32a(node name)>`
  (pkg/apis/workflow/v1alpha1/workflow_types.go `Workflow.NodeID`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lowtide.adapters.argo.workflow import ADMISSION_GATE

__all__ = [
    "HOSTNAME_LABEL",
    "NODE_ID_ANNOTATION",
    "admission_patch",
    "argo_node_id",
    "argo_pod_name",
    "fnv32a",
    "image_problem",
    "is_deleting",
    "is_gated",
    "pod_node_id",
    "pod_phase",
    "unschedulable",
]

HOSTNAME_LABEL = "kubernetes.io/hostname"
NODE_ID_ANNOTATION = "workflows.argoproj.io/node-id"
_IMAGE_WAITING = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
#: Reasons that will not go away by waiting: no bound needed.
IMAGE_FINAL = frozenset({"InvalidImageName", "ErrImageNeverPull"})
_MAX_POD_NAME_PREFIX = 253 - 10 - 1


def _spec(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = pod.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def _status(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    status = pod.get("status")
    return status if isinstance(status, Mapping) else {}


def _meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = pod.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def pod_phase(pod: Mapping[str, Any]) -> str:
    phase = _status(pod).get("phase")
    return phase if isinstance(phase, str) and phase else "Pending"


def is_gated(pod: Mapping[str, Any]) -> bool:
    """The pod still carries lowtide's admission gate."""
    gates = _spec(pod).get("schedulingGates") or ()
    return any(isinstance(g, Mapping) and g.get("name") == ADMISSION_GATE for g in gates)


def is_deleting(pod: Mapping[str, Any]) -> bool:
    return bool(_meta(pod).get("deletionTimestamp"))


def pod_node_id(pod: Mapping[str, Any]) -> str | None:
    annotations = _meta(pod).get("annotations")
    value = annotations.get(NODE_ID_ANNOTATION) if isinstance(annotations, Mapping) else None
    return value if isinstance(value, str) and value else None


#: The annotation carrying where a resumed attempt starts from (`LOWTIDE_RESUME_FROM`): set by the
#: admission patch, read by the step shim through a downward-API file (`adapters.argo.workflow`).
RESUME_ANNOTATION = "lowtide.io/resume-from"


def admission_patch(node: str, annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The one strategic merge patch that admits a gated pod on `node` (module docstring), with
    the attempt's own values as annotations (a pod's env cannot change after creation; its
    annotations can, and the kubelet writes them to the downward-API file before the container
    starts, since a gated pod has not started yet)."""
    patch: dict[str, Any] = {
        "spec": {
            "nodeSelector": {HOSTNAME_LABEL: node},
            "schedulingGates": [{"name": ADMISSION_GATE, "$patch": "delete"}],
        }
    }
    if annotations:
        patch["metadata"] = {"annotations": dict(annotations)}
    return patch


def image_problem(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, "reason: message") of a container waiting for its image, None when none is."""
    statuses = _status(pod).get("containerStatuses") or ()
    for cs in statuses:
        if not isinstance(cs, Mapping):
            continue
        state = cs.get("state")
        waiting = state.get("waiting") if isinstance(state, Mapping) else None
        if isinstance(waiting, Mapping) and waiting.get("reason") in _IMAGE_WAITING:
            reason = str(waiting["reason"])
            message = waiting.get("message")
            return reason, f"{reason}: {message}" if isinstance(message, str) and message else reason
    return None


def unschedulable(pod: Mapping[str, Any]) -> str | None:
    """`Unschedulable: <scheduler message>` when the scheduler found no node for the pod."""
    for cond in _status(pod).get("conditions") or ():
        if (
            isinstance(cond, Mapping)
            and cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            message = cond.get("message")
            return f"Unschedulable: {message}" if isinstance(message, str) and message else "Unschedulable"
    return None


def fnv32a(text: str) -> int:
    """FNV-1a, 32 bits (Go's hash/fnv New32a), over the UTF-8 bytes of `text`."""
    h = 0x811C9DC5
    for byte in text.encode("utf-8"):
        h ^= byte
        h = (h * 0x01000193) & 0xFFFFFFFF
    return h


def argo_node_id(workflow_name: str, node_name: str) -> str:
    """Argo's deterministic node id (`Workflow.NodeID`)."""
    if node_name == workflow_name:
        return workflow_name
    return f"{workflow_name}-{fnv32a(node_name)}"


def argo_pod_name(workflow_name: str, node_name: str, template_name: str) -> str:
    """The pod name Argo gives a node in its default (v2) naming (`GeneratePodName`)."""
    if workflow_name == node_name:
        return workflow_name
    prefix = f"{workflow_name}-{template_name}" if template_name else workflow_name
    return f"{prefix[:_MAX_POD_NAME_PREFIX]}-{fnv32a(node_name)}"
