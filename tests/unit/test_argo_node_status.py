"""Argo node → lowtide outcome (`adapters.argo.node_status`), as a table of real messages.

Every message below is copied as a fact from its source (argo-workflows v4.1.2 = commit
f016ad89, workflow/controller/operator.go, unless a row says otherwise); the node trees at the
end are Argo's own testdata (`../shared/data/reference/argo-testdata-*.yaml`, the same commit,
workflow/controller/testdata/), skipped when the shared data folder is absent.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from lowtide.adapters.argo.node_status import Outcome, attempts, classify_node, step_node
from lowtide.adapters.argo.workflow import RESULT_COMPLETED, RESULT_PARAMETER

DATA = Path(os.environ.get("LOWTIDE_DATA_DIR") or Path(__file__).resolve().parents[3] / "shared" / "data")
CODE = 75  # the interrupted exit code compiled into the Workflow


def node(
    phase: str, message: str = "", exit_code: str | None = None, result: str | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "Pod", "phase": phase, "message": message}
    outputs: dict[str, Any] = {}
    if exit_code is not None:
        outputs["exitCode"] = exit_code
    if result is not None:
        outputs["parameters"] = [{"name": RESULT_PARAMETER, "value": result}]
    if outputs:
        out["outputs"] = outputs
    return out


CASES: list[tuple[str, dict[str, Any], Outcome, bool, int | None, str | None]] = [
    # (id, node, outcome, terminal, exit code, container)
    ("gated-or-created", node("Pending"), Outcome.PENDING, False, None, None),
    # getPendingReason's own example (operator.go, comment above the PodScheduled loop)
    (
        "unschedulable",
        node("Pending", "Unschedulable: 0/3 nodes are available: 2 Insufficient cpu, 3 MatchNodeSelector."),
        Outcome.UNSCHEDULABLE,
        False,
        None,
        None,
    ),
    # getPendingReason: "<waiting reason>: <waiting message>" (kubelet reasons ImagePullBackOff, ErrImagePull)
    (
        "image-backoff",
        node("Pending", 'ImagePullBackOff: Back-off pulling image "ghcr.io/example/nope:1"'),
        Outcome.IMAGE_PULL,
        False,
        None,
        None,
    ),
    ("image-pull-error", node("Pending", "ErrImagePull"), Outcome.IMAGE_PULL, False, None, None),
    ("running", node("Running"), Outcome.RUNNING, False, None, None),
    ("succeeded", node("Succeeded", "", "0", RESULT_COMPLETED), Outcome.SUCCEEDED, True, 0, None),
    # inferFailedReason v3.5+: "<container>: <Reason> (exit code N)"
    ("main-error", node("Failed", "main: Error (exit code 1)", "1"), Outcome.FAILED, True, 1, "main"),
    (
        "main-error-with-termination-message",
        node("Failed", "main: Error (exit code 3): boom"),
        Outcome.FAILED,
        True,
        3,
        "main",
    ),
    # v3.0 .. v3.4 wrote the same without the container prefix
    ("old-error", node("Failed", "Error (exit code 1)"), Outcome.FAILED, True, 1, None),
    # v2.x: "failed with exit code N" (as in argo-testdata-dag_retry_succeeded.yaml)
    ("v2-error", node("Failed", "failed with exit code 2"), Outcome.FAILED, True, 2, None),
    ("oom", node("Failed", "main: OOMKilled (exit code 137)", "137"), Outcome.OOM_KILLED, True, 137, "main"),
    ("old-oom", node("Failed", "OOMKilled (exit code 137)"), Outcome.OOM_KILLED, True, 137, None),
    (
        "interrupted",
        node("Failed", "main: Error (exit code 75)", "75"),
        Outcome.INTERRUPTED,
        True,
        75,
        "main",
    ),
    ("interrupted-old-form", node("Failed", "Error (exit code 75)"), Outcome.INTERRUPTED, True, 75, None),
    # 143 is not our code: a SIGTERM death the shim did not turn into an interruption
    (
        "sigterm-without-shim",
        node("Failed", "main: Error (exit code 143)"),
        Outcome.FAILED,
        True,
        143,
        "main",
    ),
    # outputs.exitCode wins over the message when the wait container recorded it
    (
        "exit-code-from-outputs",
        node("Failed", "main: Error (exit code 1)", "75"),
        Outcome.INTERRUPTED,
        True,
        75,
        "main",
    ),
    # podReconciliation: markNodeError(..., "pod deleted")
    ("pod-deleted", node("Error", "pod deleted"), Outcome.POD_DELETED, True, None, None),
    # kubernetes pkg/kubelet/kubelet.go rejectPod: "Pod was rejected: " + message
    (
        "rejected",
        node(
            "Failed",
            "Pod was rejected: Allocate failed due to requested number of devices unavailable for "
            "nvidia.com/gpu. Requested: 2, Available: 0, which is unexpected",
        ),
        Outcome.REJECTED,
        True,
        None,
        None,
    ),
    # kubernetes pkg/kubelet/eviction/helpers.go: nodeLowMessageFmt, nodeConditionMessageFmt
    (
        "evicted-low",
        node("Failed", "The node was low on resource: memory. Threshold quantity: 100Mi, available: 50Mi. "),
        Outcome.EVICTED,
        True,
        None,
        None,
    ),
    (
        "evicted-condition",
        node("Failed", "The node had condition: [DiskPressure]. "),
        Outcome.EVICTED,
        True,
        None,
        None,
    ),
    (
        "node-shutdown",
        node("Failed", "Pod was terminated in response to imminent node shutdown."),
        Outcome.EVICTED,
        True,
        None,
        None,
    ),
    # inferFailedReason: a container still waiting when the pod failed (node phase Error)
    (
        "failed-before-start-image",
        node(
            "Error", 'Pod failed before main container starts due to ErrImagePull: pull access denied for "x"'
        ),
        Outcome.IMAGE_PULL,
        True,
        None,
        "main",
    ),
    (
        "failed-before-start-other",
        node(
            "Error",
            "Pod failed before main container starts due to CreateContainerConfigError: secret not found",
        ),
        Outcome.FAILED,
        True,
        None,
        "main",
    ),
    # init / wait failures are node Errors naming the container: the machinery's, not the step's
    ("init-error", node("Error", "init: Error (exit code 1)"), Outcome.FAILED, True, None, "init"),
    ("wait-error", node("Error", "wait: Error (exit code 2)", "0"), Outcome.FAILED, True, 0, "wait"),
    ("omitted", node("Omitted", "omitted: depends condition not met"), Outcome.SKIPPED, True, None, None),
]


@pytest.mark.parametrize(
    ("case", "argo_node", "outcome", "terminal", "exit_code", "container"), CASES, ids=[c[0] for c in CASES]
)
def test_node_outcomes(
    case: str,
    argo_node: dict[str, Any],
    outcome: Outcome,
    terminal: bool,
    exit_code: int | None,
    container: str | None,
) -> None:
    got = classify_node(argo_node, interrupted_exit_code=CODE)
    assert (got.outcome, got.terminal, got.exit_code, got.container) == (
        outcome,
        terminal,
        exit_code,
        container,
    )
    assert got.message == argo_node["message"]
    assert got.hazard is False


@pytest.mark.parametrize(
    "argo_node",
    [node("Succeeded", "", "0"), node("Succeeded", "", "0", ""), node("Succeeded", "", None, "interrupted")],
    ids=["no-parameter", "empty-marker", "other-marker"],
)
def test_succeeded_without_the_shims_marker_is_an_interruption(argo_node: dict[str, Any]) -> None:
    got = classify_node(argo_node, interrupted_exit_code=CODE)
    assert got.outcome is Outcome.INTERRUPTED and got.terminal and got.hazard


def test_the_interrupted_code_is_the_one_compiled_in() -> None:
    argo_node = node("Failed", "main: Error (exit code 75)", "75")
    assert classify_node(argo_node, interrupted_exit_code=99).outcome is Outcome.FAILED


def test_a_node_without_phase_is_pending_and_an_unknown_phase_is_refused() -> None:
    assert classify_node({"type": "Pod"}, interrupted_exit_code=CODE).outcome is Outcome.PENDING
    with pytest.raises(ValueError, match="unknown node phase 'Exploded'"):
        classify_node(node("Exploded"), interrupted_exit_code=CODE)


def _testdata(name: str) -> dict[str, Any]:
    path = DATA / "reference" / name
    if not path.is_file():
        pytest.skip(f"reference data absent: {path} (set LOWTIDE_DATA_DIR to ../shared/data)")
    # BaseLoader keeps every scalar a string, as the API's JSON has them (timestamps included)
    doc: dict[str, Any] = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    return doc


def test_retry_children_become_attempts_in_order() -> None:
    wf = _testdata("argo-testdata-dag_retry_succeeded.yaml")
    nodes = wf["status"]["nodes"]
    retry = step_node(nodes, wf["metadata"]["name"], "step1")
    assert retry == "dag-with-retries-4wkh8-2805650605"
    nodes[retry]["children"] = list(reversed(nodes[retry]["children"]))  # order comes from the (N) suffix
    found = attempts(nodes, retry, interrupted_exit_code=CODE)
    assert [a.index for a in found] == [0, 1, 2]
    assert [a.outcome.outcome for a in found] == [Outcome.FAILED, Outcome.FAILED, Outcome.INTERRUPTED]
    assert [a.outcome.exit_code for a in found] == [1, 1, None]  # v2 message "failed with exit code 1"
    # the last child Succeeded, but this Workflow was not compiled by lowtide: no shim marker
    assert found[2].outcome.hazard
    assert found[0].started_at == "2018-08-01T10:22:43Z" and found[0].finished_at == "2018-08-01T10:22:50Z"


def test_exhausted_retries_give_every_failed_attempt() -> None:
    wf = _testdata("argo-testdata-dag-exhausted-retries-xfail.yaml")
    nodes = wf["status"]["nodes"]
    retry = "retry-with-dags-1890550676"
    assert nodes[retry]["message"] == "No more retries left"
    found = attempts(nodes, retry, interrupted_exit_code=CODE)
    assert [(a.index, a.outcome.outcome, a.outcome.exit_code) for a in found] == [
        (0, Outcome.FAILED, 1),
        (1, Outcome.FAILED, 1),
    ]
    assert {a.host for a in found} == {"minikube"}
    with pytest.raises(ValueError, match="is a 'DAG' node, not a Retry node"):
        attempts(nodes, "retry-with-dags-1757961662", interrupted_exit_code=CODE)
    with pytest.raises(KeyError):
        attempts(nodes, "no-such-node", interrupted_exit_code=CODE)


def test_a_retry_node_with_a_pending_last_child() -> None:
    nodes = {
        "wf-1": {"type": "Retry", "name": "wf.train", "children": ["wf-2", "wf-3", "wf-4"]},
        "wf-2": {**node("Error", "pod deleted"), "name": "wf.train(0)"},
        "wf-3": {**node("Failed", "main: Error (exit code 75)", "75"), "name": "wf.train(1)"},
        "wf-4": {**node("Pending"), "name": "wf.train(2)"},
    }
    found = attempts(nodes, "wf-1", interrupted_exit_code=CODE)
    assert [a.outcome.outcome for a in found] == [Outcome.POD_DELETED, Outcome.INTERRUPTED, Outcome.PENDING]
    assert [a.outcome.terminal for a in found] == [True, True, False]
    assert step_node(nodes, "wf", "train") == "wf-1" and step_node(nodes, "wf", "eval") is None
