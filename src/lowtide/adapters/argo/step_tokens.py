"""The step token reaches a gated pod through one Secret per job, written before its admission.

Role: `StepTokens` keeps the token of each launched attempt (`LOWTIDE_STEP_TOKEN` of its
`LaunchRequest`, README "What a step sees") until its pod is admitted, and `deliver` writes it
into the Secret `<workflow>-step-tokens` of the pod's Workflow (the job's generation: the job id,
or `<job id>-r<N>` after a retry, `workflow.workflow_name`) in the Argo namespace under the key of
the step's label, just BEFORE the executor's admission patch removes the gate (docs/cluster.md "Jobs as
Argo Workflows", "The step token"). Each GPU template mounts that key as a file
(`workflow.TOKEN_VOLUME`, `LOWTIDE_STEP_TOKEN_FILE`); `lowtide-step-shim` exports its content
as `LOWTIDE_STEP_TOKEN` to the step.
Neighbours: `executor.ArgoExecutor` calls `hold` at launch, `deliver` in `_admit` before the
admission patch and `forget` after it; `workflow` compiles the volume; `k8s_errors` classifies
API errors; `workflow_store` reads the Workflow when the pod names no owner.
Must not: log or print a token, decide admission, retry, sleep or read the clock.

Why a Secret, and why this order (Kubernetes v1.33 docs, "Secrets" → "Using Secrets as files
from a Pod" and "Mounted Secrets are updated automatically"; kubernetes commit 000f2605
pkg/volume/secret/secret.go `SetUpAt`):
- An annotation would be readable by anyone who may `get pods`; a Secret only by identities with
  `secrets get` in the namespace (the steps' own ServiceAccount has none: the chart's
  `RELEASE-step` Role grants only Argo's `workflowtaskresults`).
- A pod held by a scheduling gate is not bound to a node, so no kubelet has seen it: the kubelet
  that gets it after admission sets up the secret volume (reading the Secret's current data)
  before it starts the container. Writing the token before the patch that removes the gate
  therefore means the container starts with this attempt's token. Later changes reach a running
  container only after the kubelet's periodic sync (plus its cache TTL), which is why CPU-only
  steps (not gated: their pod may start before lowtide launches the attempt) get no token volume.
- The volume is `optional: true`: a pod whose key is missing (no API URL, or a Secret not yet
  written) starts without the file instead of failing, and the shim then sets no token.
- The Secret is owned by its Workflow (an ownerReference with its uid, no
  `blockOwnerDeletion`, which would need `workflows/finalizers update` under the
  OwnerReferencesPermissionEnforcement admission plugin), so Kubernetes' garbage collector
  deletes it with the Workflow. The uid comes from the pod's own ownerReference (Argo makes each
  pod with a controller reference to its Workflow: argo-workflows v4.1.2 workflow/controller/
  workflowpod.go `createWorkflowPod`), else from a read of the Workflow.
- Create, and on 409 AlreadyExists a merge patch of the one key (a later step or attempt of the
  same job): the value is always the CURRENT attempt's token, and an attempt's token is valid
  only for that attempt (`control.contract`), so an older value left in the Secret is useless.
- Secret keys must match `[-._a-zA-Z0-9]+`; a step label (a DNS-1123 label) always does.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from lowtide.adapters.argo import k8s_errors
from lowtide.adapters.argo.workflow import API_VERSION, LABEL_JOB, token_secret_name
from lowtide.adapters.argo.workflow_store import WorkflowsApi
from lowtide.control.executor_port import ExecutorError

__all__ = ["StepTokens", "secret_manifest", "workflow_owner"]

_MERGE = "application/merge-patch+json"
Obj = dict[str, Any]


def _b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


def workflow_owner(pod: Mapping[str, Any], workflow: str) -> Obj | None:
    """The ownerReference to the Workflow `workflow` that Argo put on its pod, if it is there."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if (
            isinstance(ref, Mapping)
            and ref.get("kind") == "Workflow"
            and ref.get("apiVersion") == API_VERSION
            and ref.get("name") == workflow
            and ref.get("uid")
        ):
            return {"apiVersion": API_VERSION, "kind": "Workflow", "name": workflow, "uid": str(ref["uid"])}
    return None


def secret_manifest(
    workflow: str, job_id: str, namespace: str, owner: Mapping[str, Any], step_label: str, token: str
) -> Obj:
    """The token Secret of the job's Workflow `workflow`, holding one step's token."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": token_secret_name(workflow),
            "namespace": namespace,
            "labels": {LABEL_JOB: job_id},
            "ownerReferences": [dict(owner)],
        },
        "type": "Opaque",
        "data": {step_label: _b64(token)},
    }


class StepTokens:
    """Tokens of launched attempts, written into their job's Secret at admission (module docstring)."""

    def __init__(self, core: Any, workflows: WorkflowsApi, namespace: str, timeout_s: float) -> None:
        self._core = core
        self._workflows = workflows
        self._ns = namespace
        self._timeout = timeout_s
        self._tokens: dict[int, str] = {}

    def hold(self, attempt_id: int, token: str | None) -> None:
        """Keep `token` for the attempt until its pod is admitted (None or "": nothing to deliver)."""
        if token:
            self._tokens[attempt_id] = token

    def forget(self, attempt_id: int) -> None:
        self._tokens.pop(attempt_id, None)

    def _owner(self, pod: Mapping[str, Any], workflow: str) -> Obj:
        owner = workflow_owner(pod, workflow)
        if owner is not None:
            return owner
        wf = self._workflows.get(workflow)  # raises ExecutorError, classified
        uid = ((wf or {}).get("metadata") or {}).get("uid")
        if not uid:
            raise ExecutorError(
                f"workflow {self._ns}/{workflow} is not there (or has no uid): the step token's Secret "
                "needs it as its owner; will try again",
                temporary=True,
                infrastructure=k8s_errors.INFRASTRUCTURE,
            )
        return {"apiVersion": API_VERSION, "kind": "Workflow", "name": workflow, "uid": str(uid)}

    def deliver(
        self, attempt_id: int, job_id: str, step_label: str, pod: Mapping[str, Any], *, workflow: str
    ) -> None:
        """Write the attempt's token into the Secret of `workflow`, the Workflow of `pod` (create,
        or patch its key on 409). Nothing to do for an attempt without a token. Raises
        ExecutorError (k8s_errors)."""
        token = self._tokens.get(attempt_id)
        if token is None:
            return
        name = token_secret_name(workflow)
        body = secret_manifest(workflow, job_id, self._ns, self._owner(pod, workflow), step_label, token)
        try:
            self._core.create_namespaced_secret(
                self._ns, body, _request_timeout=self._timeout, _preload_content=False
            )
            return
        except Exception as exc:
            if k8s_errors.status_of(exc) != 409:
                raise self._error(exc, "create") from None  # never chain: the body holds the token
        try:
            self._core.patch_namespaced_secret(
                name,
                self._ns,
                {"data": {step_label: _b64(token)}},
                _content_type=_MERGE,
                _request_timeout=self._timeout,
                _preload_content=False,
            )
        except Exception as exc:
            raise self._error(exc, "patch") from None

    def _error(self, exc: BaseException, verb: str) -> ExecutorError:
        return k8s_errors.classify(exc, verb=verb, resource="secrets", namespace=self._ns)
