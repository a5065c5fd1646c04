"""The Argo executor's pure pieces: Argo's node ids and pod names, pod readings, the admission
patch, the classification of Kubernetes API errors and a node's outcome as an exit
(`adapters.argo.pods`, `k8s_errors`, `exits`).

Node ids are checked against Argo's own testdata (`../shared/data/reference/`, argo-workflows
v4.1.2), whose ids Argo's controller computed; skipped with the reason when the data is absent.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml
from kubernetes.client.exceptions import ApiException

from lowtide.adapters.argo import k8s_errors, pods
from lowtide.adapters.argo.exits import HAZARD_DETAIL, attempt_exit
from lowtide.adapters.argo.node_status import classify_node
from lowtide.control.executor_port import ExitReason

DATA = Path(os.environ.get("LOWTIDE_DATA_DIR") or Path(__file__).resolve().parents[3] / "shared" / "data")


def test_node_ids_are_the_ones_argo_computed() -> None:
    path = DATA / "reference" / "argo-testdata-dag_retry_succeeded.yaml"
    if not path.is_file():
        pytest.skip(f"reference data absent: {path} (set LOWTIDE_DATA_DIR to ../shared/data)")
    wf = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    name = wf["metadata"]["name"]
    nodes = wf["status"]["nodes"]
    assert len(nodes) >= 4
    for node_id, node in nodes.items():
        assert pods.argo_node_id(name, node["name"]) == node_id


def test_fnv32a_and_v2_pod_names() -> None:
    assert pods.fnv32a("") == 0x811C9DC5  # FNV-1a's offset basis
    assert pods.fnv32a("a") == 0xE40C292C  # the published FNV-1a 32-bit test vector
    assert (
        pods.argo_pod_name("job-1", "job-1.train(0)", "train")
        == f"job-1-train-{pods.fnv32a('job-1.train(0)')}"
    )
    assert pods.argo_pod_name("job-1", "job-1", "x") == "job-1"
    long = pods.argo_pod_name("w", "w.t(0)", "t" * 300)
    assert len(long) <= 253 and long.startswith("w-ttt")


def pod(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "uid": "u"}, "spec": {}, "status": status}


def test_pod_readings() -> None:
    gated = {"metadata": {}, "spec": {"schedulingGates": [{"name": "lowtide.io/admission"}]}}
    assert pods.is_gated(gated) and not pods.is_gated(pod()) and pods.pod_phase(pod()) == "Pending"
    waiting = pod(
        containerStatuses=[
            {
                "name": "main",
                "state": {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling "x"'}},
            }
        ]
    )
    assert pods.image_problem(waiting) == ("ImagePullBackOff", 'ImagePullBackOff: Back-off pulling "x"')
    assert pods.image_problem(pod(containerStatuses=[{"state": {"running": {}}}])) is None
    stuck = pod(
        conditions=[
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"},
        ]
    )
    assert pods.unschedulable(stuck) == "Unschedulable: 0/3 nodes"
    held = pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}])
    assert pods.unschedulable(held) is None


def test_the_admission_patch_pins_the_node_and_deletes_only_our_gate() -> None:
    assert pods.admission_patch("n7") == {
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "n7"},
            "schedulingGates": [{"name": "lowtide.io/admission", "$patch": "delete"}],
        }
    }


def api_error(status: int, message: str = "boom") -> ApiException:
    exc = ApiException(status=status, reason="R")
    exc.body = f'{{"kind": "Status", "message": "{message}"}}'
    return exc


@pytest.mark.parametrize("status", [409, 410, 429, 500, 503, 504])
def test_conflicts_throttling_and_server_errors_are_temporary(status: int) -> None:
    err = k8s_errors.classify(api_error(status), verb="create", resource="workflows", namespace="ns")
    assert err.temporary and err.infrastructure == "kubernetes" and f"HTTP {status}: boom" in str(err)


def test_no_answer_is_temporary() -> None:
    refused = urllib3.exceptions.MaxRetryError(None, "/api", reason="Connection refused")  # type: ignore[arg-type]
    err = k8s_errors.classify(refused, verb="list", resource="pods", namespace="ns")
    assert err.temporary and "no answer" in str(err)


def test_forbidden_names_the_missing_rule_and_invalid_is_the_steps_fault() -> None:
    forbidden = k8s_errors.classify(
        api_error(403, 'pods \\"p\\" is forbidden'), verb="patch", resource="pods", namespace="lowtide"
    )
    assert not forbidden.temporary and forbidden.infrastructure == "kubernetes"
    assert "verbs [patch] on pods in namespace lowtide" in str(forbidden)
    invalid = k8s_errors.classify(
        api_error(422, "spec.schedulingGates: Forbidden"), verb="patch", resource="pods", namespace="ns"
    )
    assert not invalid.temporary and invalid.infrastructure is None
    assert "spec.schedulingGates: Forbidden" in str(invalid)
    other = k8s_errors.classify(ValueError("x"), verb="get", resource="pods", namespace="ns")
    assert not other.temporary


def ended(phase: str, message: str = "", code: str | None = None, marker: str | None = None) -> Any:
    node: dict[str, Any] = {"type": "Pod", "phase": phase, "message": message, "outputs": {}}
    if code is not None:
        node["outputs"]["exitCode"] = code
    if marker is not None:
        node["outputs"]["parameters"] = [{"name": "lowtide-result", "value": marker}]
    return classify_node(node, interrupted_exit_code=75)


@pytest.mark.parametrize(
    ("outcome", "noticed", "deleted", "expected"),
    [
        (ended("Succeeded", code="0", marker="completed"), False, False, (0, None, ExitReason.EXITED)),
        (ended("Failed", "main: Error (exit code 3)", "3"), False, False, (3, None, ExitReason.EXITED)),
        (ended("Failed", "main: Error (exit code 75)", "75"), True, True, (75, None, ExitReason.EXITED)),
        (ended("Failed", "main: Error (exit code 75)", "75"), False, False, (75, None, ExitReason.DELETED)),
        (
            ended("Failed", "main: OOMKilled (exit code 137)"),
            False,
            False,
            (137, None, ExitReason.OOM_KILLED),
        ),
        (ended("Error", "pod deleted"), True, True, (None, 15, ExitReason.SIGNALLED)),
        (ended("Error", "pod deleted"), False, False, (None, None, ExitReason.DELETED)),
        (
            ended("Failed", "The node was low on resource: memory."),
            False,
            False,
            (None, None, ExitReason.EVICTED),
        ),
        (ended("Error", "wait: Error (exit code 2)"), False, False, (None, None, ExitReason.INFRASTRUCTURE)),
        (ended("Skipped"), False, False, (None, None, ExitReason.INFRASTRUCTURE)),
    ],
)
def test_node_outcomes_become_exits(
    outcome: Any, noticed: bool, deleted: bool, expected: tuple[Any, ...]
) -> None:
    ex = attempt_exit(7, outcome, noticed=noticed, deleted=deleted, killed=False, now=5.0)
    assert (ex.exit_code, ex.signal, ex.reason) == expected and (ex.attempt_id, ex.ended_at) == (7, 5.0)
    if outcome.message:
        assert ex.detail is not None and outcome.message in ex.detail


def test_succeeded_without_the_marker_is_no_success_and_a_running_node_is_no_end() -> None:
    ex = attempt_exit(1, ended("Succeeded", code="0"), noticed=True, deleted=True, killed=False, now=0.0)
    assert (ex.exit_code, ex.signal, ex.reason, ex.detail) == (None, None, None, HAZARD_DETAIL)
    with pytest.raises(ValueError, match="not an end"):
        attempt_exit(1, ended("Running"), noticed=False, deleted=False, killed=False, now=0.0)
