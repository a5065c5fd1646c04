"""Map an Argo node (status.nodes[id]) to a lowtide outcome; a Retry node to its attempts.

Role: the pure reading of Argo's node tree the runtime Argo executor needs: `classify_node`
turns one Pod node into a `NodeOutcome` (what happened, whether it is over, the exit code, the
words Argo used), `attempts` lists a step's Retry node children in order with theirs.
Neighbours: `workflow` (the names, the result parameter and the interrupted exit code it
compiles in); the runtime executor maps outcomes onto `ExitReason`s for the loop.
Must not: decide retries or step states (that is `policy.outcomes`), talk to Kubernetes, or
read the clock.

Where the words come from (argo-workflows v4.1.2, commit f016ad89,
workflow/controller/operator.go, unless noted):

- `assessNodeStatus`: pod Pending → node Pending with `getPendingReason`: the first waiting
  container's `Reason: Message` (e.g. `ImagePullBackOff: Back-off pulling image "x"`,
  `ErrImagePull: ...`), else the `Unschedulable: <scheduler message>` of the PodScheduled
  condition (e.g. `Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.`), else
  empty (a pod held by a scheduling gate shows reason SchedulingGated, so its node is plain
  Pending). Pod Succeeded → Succeeded; Running → Running; Failed → `inferFailedReason`.
- `inferFailedReason`: the pod's own `status.message` when set, verbatim: the kubelet's
  `Pod was rejected: <why>` (kubernetes pkg/kubelet/kubelet.go `rejectPod`) or an eviction,
  `The node was low on resource: memory. ...` / `The node had condition: [DiskPressure]. ...`
  (pkg/kubelet/eviction/helpers.go, reason `Evicted`), or `Pod was terminated in response to
  imminent node shutdown.` (pkg/kubelet/nodeshutdown/nodeshutdown_manager_linux.go, since v1.22).
  Otherwise the failing container:
  `main: Error (exit code 1)` (v3.5 and later: `<container>: <Reason> (exit code N)`, optionally
  followed by `: <termination message>`), `main: OOMKilled (exit code 137)`; v3.0..v3.4 wrote the
  same without the container prefix (`Error (exit code 1)`), v2.x wrote `failed with exit code 1`
  (the shared testdata `argo-testdata-dag_retry_succeeded.yaml` has it). A container still
  waiting when the pod failed: `Pod failed before main container starts due to ErrImagePull: ...`
  (node phase Error). Init, wait and supervisor container failures are node Errors naming that
  container: the machinery, not the step.
- `podReconciliation`: a started, not pending Pod node whose pod is gone gets phase Error and
  message `pod deleted`.
- `processNodeRetries` and `executeTemplate`: a template with a retryStrategy gets a node of type
  Retry whose children are Pod nodes named `<retry node name>(N)`, N = 0, 1, ...; the exit code of
  a finished child is `outputs.exitCode` (a string) when the wait container recorded it.

**Succeeded after SIGTERM.** Kubernetes may report a pod Succeeded when the step, given notice
(SIGTERM on a graceful delete), exits 0: since 1.27 the kubelet gives a gracefully deleted pod a
terminal phase from its containers' exit codes (not rechecked here against the kubelet source;
the cluster tier must show it). Argo then
marks the node Succeeded and runs the downstream steps. The in-image shim (docs in `workflow`)
exits with the interrupted code after a notice unless the step completed, and writes
`completed` into the output parameter `lowtide-result` exactly when it exits 0. A Succeeded node
without that marker therefore did not go through the shim's success path: `classify_node` says
INTERRUPTED with `hazard=True`, and lowtide treats the step as interrupted (to be rerun from its
checkpoint), never as done.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from lowtide.adapters.argo.workflow import RESULT_COMPLETED, RESULT_PARAMETER

__all__ = ["Attempt", "NodeOutcome", "Outcome", "attempts", "classify_node", "step_node"]


class Outcome(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # the step's own failure (its exit code), or the machinery's (`container`)
    INTERRUPTED = "interrupted"  # exited with the interrupted code, or Succeeded without the marker
    OOM_KILLED = "oom_killed"
    EVICTED = "evicted"  # node pressure or node shutdown
    REJECTED = "rejected"  # the kubelet refused the pod at admission (`Pod was rejected: ...`)
    UNSCHEDULABLE = "unschedulable"
    IMAGE_PULL = "image_pull"
    POD_DELETED = "pod_deleted"
    PENDING = "pending"
    RUNNING = "running"
    SKIPPED = "skipped"  # Argo's Skipped/Omitted: never ran


@dataclass(frozen=True, slots=True)
class NodeOutcome:
    outcome: Outcome
    #: True once the node will not change: the attempt is over.
    terminal: bool
    exit_code: int | None = None
    #: Argo's message, verbatim (for the user).
    message: str = ""
    #: The container the message names (`main`, `wait`, `init`, ...), None when it names none.
    container: str | None = None
    #: Succeeded without the shim's completion marker (see the module docstring).
    hazard: bool = False


@dataclass(frozen=True, slots=True)
class Attempt:
    """One child of a Retry node: Argo's retry index (0-based), the node id and what happened."""

    index: int
    node_id: str
    outcome: NodeOutcome
    started_at: str | None = None
    finished_at: str | None = None
    host: str | None = None


_EXIT = re.compile(r"^(?:(?P<ctr>[a-z0-9][-a-z0-9]*): )?(?P<reason>[A-Za-z]+) \(exit code (?P<code>-?\d+)\)")
_OLD_EXIT = re.compile(r"^failed with exit code (?P<code>-?\d+)")
_BEFORE_START = re.compile(r"^Pod failed before (?P<ctr>\S+) container starts due to (?P<reason>[A-Za-z]+)")
_IMAGE_REASONS = frozenset(
    {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull", "ImageInspectError"}
)
_EVICTION_PREFIXES = (
    "The node was low on resource:",
    "The node had condition:",
    "Pod ephemeral local storage usage exceeds",
    "Pod was terminated in response to imminent node shutdown",
)
_TERMINAL = {"Succeeded", "Failed", "Error", "Skipped", "Omitted"}


def _exit_code(node: Mapping[str, Any]) -> int | None:
    outputs = node.get("outputs")
    raw = outputs.get("exitCode") if isinstance(outputs, Mapping) else None
    if isinstance(raw, str | int) and not isinstance(raw, bool):
        try:
            return int(raw)
        except ValueError:
            return None
    return None


def _result_marker(node: Mapping[str, Any]) -> str | None:
    outputs = node.get("outputs")
    params = outputs.get("parameters") if isinstance(outputs, Mapping) else None
    for param in params if isinstance(params, list) else ():
        if isinstance(param, Mapping) and param.get("name") == RESULT_PARAMETER:
            value = param.get("value")
            return value.strip() if isinstance(value, str) else None
    return None


def _pending(message: str) -> NodeOutcome:
    reason = message.split(":", 1)[0].strip()
    if reason == "Unschedulable":
        return NodeOutcome(Outcome.UNSCHEDULABLE, False, message=message)
    if reason in _IMAGE_REASONS:
        return NodeOutcome(Outcome.IMAGE_PULL, False, message=message)
    return NodeOutcome(Outcome.PENDING, False, message=message)


def _ended(message: str, exit_code: int | None, interrupted_exit_code: int) -> NodeOutcome:
    if message == "pod deleted" or message.startswith("pod deleted"):
        return NodeOutcome(Outcome.POD_DELETED, True, exit_code, message)
    if message.startswith("Pod was rejected:"):
        return NodeOutcome(Outcome.REJECTED, True, exit_code, message)
    if message.startswith(_EVICTION_PREFIXES):
        return NodeOutcome(Outcome.EVICTED, True, exit_code, message)
    if message.startswith("Unschedulable"):
        return NodeOutcome(Outcome.UNSCHEDULABLE, True, exit_code, message)
    if m := _BEFORE_START.match(message):
        ctr, reason = m.group("ctr"), m.group("reason")
        if reason in _IMAGE_REASONS:
            return NodeOutcome(Outcome.IMAGE_PULL, True, exit_code, message, ctr)
        return NodeOutcome(Outcome.FAILED, True, exit_code, message, ctr)
    container: str | None = None
    reason = ""
    if m := _EXIT.match(message):
        container, reason = m.group("ctr"), m.group("reason")
        if exit_code is None and container in (None, "main"):  # outputs.exitCode first when recorded
            exit_code = int(m.group("code"))
    elif m := _OLD_EXIT.match(message):
        exit_code = int(m.group("code")) if exit_code is None else exit_code
    if container not in (None, "main"):  # init, wait, supervisor, a sidecar: not the step's exit
        return NodeOutcome(Outcome.FAILED, True, exit_code, message, container)
    if reason == "OOMKilled":
        return NodeOutcome(Outcome.OOM_KILLED, True, exit_code, message, container)
    if exit_code == interrupted_exit_code:
        return NodeOutcome(Outcome.INTERRUPTED, True, exit_code, message, container)
    return NodeOutcome(Outcome.FAILED, True, exit_code, message, container)


def classify_node(node: Mapping[str, Any], *, interrupted_exit_code: int) -> NodeOutcome:
    """What one Argo Pod node (a value of `status.nodes`) says happened (module docstring).
    Raises ValueError for a node without a phase Argo writes."""
    phase = node.get("phase") or "Pending"  # Argo leaves phase out until it has one
    message = node.get("message") or ""
    if not isinstance(phase, str) or not isinstance(message, str):
        raise ValueError("node phase and message must be strings")
    exit_code = _exit_code(node)
    if phase == "Pending":
        return _pending(message)
    if phase == "Running":
        return NodeOutcome(Outcome.RUNNING, False, message=message)
    if phase == "Succeeded":
        if _result_marker(node) == RESULT_COMPLETED:
            return NodeOutcome(Outcome.SUCCEEDED, True, 0 if exit_code is None else exit_code, message)
        return NodeOutcome(Outcome.INTERRUPTED, True, exit_code, message, hazard=True)
    if phase in ("Skipped", "Omitted"):
        return NodeOutcome(Outcome.SKIPPED, True, message=message)
    if phase in ("Failed", "Error"):
        return _ended(message, exit_code, interrupted_exit_code)
    raise ValueError(f"unknown node phase {phase!r}")


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _index(node: Mapping[str, Any]) -> int | None:
    for key in ("name", "displayName"):
        text = node.get(key)
        if isinstance(text, str) and (m := re.search(r"\((\d+)\)$", text)):
            return int(m.group(1))
    return None


def attempts(
    nodes: Mapping[str, Mapping[str, Any]], retry_node_id: str, *, interrupted_exit_code: int
) -> tuple[Attempt, ...]:
    """The Pod children of Retry node `retry_node_id`, by retry index, each classified.
    Raises KeyError for an unknown node and ValueError for one that is not a Retry node."""
    parent = nodes[retry_node_id]
    if parent.get("type") != "Retry":
        raise ValueError(f"node {retry_node_id!r} is a {parent.get('type')!r} node, not a Retry node")
    found: list[Attempt] = []
    for child_id in parent.get("children") or ():
        child = nodes.get(child_id)
        if child is None or child.get("type") != "Pod":
            continue  # hooks and (while the controller writes) nodes not yet recorded
        index = _index(child)
        if index is None:
            continue
        found.append(
            Attempt(
                index=index,
                node_id=child_id,
                outcome=classify_node(child, interrupted_exit_code=interrupted_exit_code),
                started_at=_text(child.get("startedAt")),
                finished_at=_text(child.get("finishedAt")),
                host=_text(child.get("hostNodeName")),
            )
        )
    return tuple(sorted(found, key=lambda a: a.index))


def step_node(nodes: Mapping[str, Mapping[str, Any]], workflow_name: str, task: str) -> str | None:
    """The id of the node of DAG task `task` (named `<workflow>.<task>`), None when not yet there."""
    want = f"{workflow_name}.{task}"
    for node_id, node in nodes.items():
        if node.get("name") == want:
            return node_id
    return None
