"""The executor port over Kubernetes and Argo: a Workflow per job generation, a gated pod per attempt.

Role: `ArgoExecutor` carries out the loop's orders in a cluster (docs/cluster.md "Jobs as Argo
Workflows" and "The Argo executor at runtime"), with the real `kubernetes` client (36.x):
`CoreV1Api` for pods, and a `workflow_store.WorkflowsApi` for Workflows (the Kubernetes API's
`CustomObjectsApi`, or argo-server's REST API through Hera: `argo.submit_via`).
Neighbours: `workflow.compile_workflow` builds the Workflow (the executor is given a
`workflows(job_id)` callable by `wiring`), `node_status.classify_node` reads Argo's node, `pods`
reads pods, `k8s_errors` classifies API errors (`workflow_store` those of the Workflow calls);
the loop (`control.loop`) decides everything.
Must not: decide retries or step states, touch the store, or read the clock (`now` comes in).

Mechanism:
- **Submission**: each launch compiles the job's current Workflow (`workflows(job_id)`, which
  reads the store) and creates it the first time: generation 0 named after the job id, a retried
  job's generation `<job id>-r<N>` with only its unfinished steps (`workflow.job_generation`,
  docs/cluster.md "Retrying a job"). A 409 AlreadyExists means an earlier try (or process)
  created it: it is read and reused, never submitted twice. Workflows known to exist are
  remembered per process, by name; so is each job's current Workflow (`_current`). When a retried
  generation is first used, older generations of the job still running are stopped (`end_job`
  normally did it; a retry that came before the loop ended the job did not).
- **Generations**: an attempt belongs to the Workflow of its job's current generation
  (`_Attempt.workflow`). Its pod is the one that Workflow made: Argo labels each pod
  `workflows.argoproj.io/workflow: <workflow name>` and gives it a controller ownerReference to
  the Workflow (argo-workflows v4.1.2, commit f016ad89, workflow/controller/workflowpod.go
  `podBuilder.build`, `common.LabelKeyWorkflow`), so a pod an older, stopped generation left
  gated is never admitted for a new attempt, and exits are read from the node of the Workflow
  that owns the pod.
- **Admission**: Argo creates each ready step's pod with the gate `lowtide.io/admission`
  (the template's `podSpecPatch`). `launch` finds the step's gated pod by the labels
  `lowtide.io/job` and `lowtide.io/step`, among the pods of its generation's Workflow (a gated
  pod not being deleted is not admitted yet, so it belongs to no earlier attempt) and admits it
  with one strategic merge patch that sets
  `nodeSelector: {kubernetes.io/hostname: <node>}` and deletes the gate. Just before that patch
  the attempt's step token is written into its Workflow's Secret (`step_tokens`), which the kubelet
  mounts when it starts the admitted pod. Right after the
  Workflow is created, or before Argo has made the retry's pod, there is no pod yet: `launch`
  returns a PENDING handle and a later `poll` admits the pod when it appears. A CPU-only step's
  pod is not gated (it runs as soon as Argo makes it): `launch` only claims it.
- **Nodes** (`adapters.k8s_nodes.NodeLending`, when wiring passes the configured nodes): before
  the admission patch the Node is checked (Ready, not cordoned, no taint the pod does not
  tolerate, enough allocatable `nvidia.com/gpu` beside every pod on it, any namespace) and
  given lowtide's label `lowtide.io/lent-gpus` and PreferNoSchedule taint. A pod that does not
  fit is not admitted: at `launch` the `NodeBusy` error goes to the loop (a launch failure, no
  retry used, placed again after a backoff), at a `poll` the attempt ends UNSCHEDULABLE with the
  same words (requeued, no retry). Each poll then reconciles the labels from its pod list.
- **Handles**: `<namespace>/<pod name>/<pod uid>`; `<namespace>/@<job id>/<step label>` while no
  pod is claimed yet (the store keeps the handle of the launch until the pod runs: the start,
  `AttemptStarted.handle`, brings the pod's, which the log port `pod_logs` reads; a restart
  before that resolves it again by labels). An attempt whose pod ran and ended between two polls
  reports no start: its exit carries the pod's handle instead (`AttemptExit.handle`, set on any
  exit of a claimed pod whose start was not reported). The uid makes a re-created pod of the same
  name a different attempt.
- **Running and exits**: each `poll` reads this installation's pods (label `lowtide.io/job`)
  from a watch cache (below, "Pods from a watch"). A pod phase
  Running is the start (`PollReport.started`). A finished pod's exit is read from its Argo node
  (`workflows.argoproj.io/node-id`) once Argo has recorded it, because only the node has the
  shim's result marker: `classify_node` gives the outcome, `exits.attempt_exit` the exit.
  A pending pod whose image cannot be pulled past `image_pull_bound_s` (at once for
  `InvalidImageName`), or that no node takes past `unschedulable_bound_s`, is deleted and
  reported as IMAGE_PULL or UNSCHEDULABLE; Argo keeps the node Pending and makes the pod
  again for the next attempt (argo-workflows v4.1.2 operator.go `podReconciliation`: a pending
  node whose pod is missing is re-submitted).
- **Notice**: `notify_stop` deletes the running pod with a `preconditions.uid` and
  `gracePeriodSeconds` = deadline − now **plus `grace_margin_seconds`** (at least 1): the kubelet
  sends SIGTERM at once and SIGKILL after the delete's grace (a delete's grace overrides the
  pod's `terminationGracePeriodSeconds`, and an unscheduled pod is deleted at once whatever the
  grace: kubernetes pkg/registry/core/pod/strategy.go `CheckGracefulDelete`, commit 008b3652).
  The shim gives the step `LOWTIDE_GRACE_SECONDS` (until the deadline), SIGKILLs it and exits
  75 (docs/cluster.md "The step shim in the image"); with a grace of exactly deadline − now the
  kubelet would kill the shim at the same moment, the container would exit 137, and Argo's
  retry expression would not see the interrupted code. This is why
  the compiled pods carry grace + margin too. A pod not running yet is deleted at once
  (grace 0) and the attempt reported withdrawn (DELETED, no code). Past the deadline plus the
  margin plus `kill_margin_s` a pod still there is deleted with grace 0 (the kill). A failed
  delete is retried at the next poll (and after a restart, for an attempt that had notice).
- **Cancel** of a whole job (`end_job`): `stop_workflow(<current workflow>)` patches `spec.shutdown: Stop`
  (workflow_types.go `ShutdownStrategyStop`; exec_control.go `applyExecutionControl`: Argo
  deletes pending pods, sends running ones SIGTERM, fails their nodes with `workflow shutdown
  with strategy:  Stop` and starts nothing new). Without it a pod stopped by notice exits 75 and
  Argo's retry expression makes a new gated pod, which waits.

Exit mapping: `exits.attempt_exit` (its docstring has the table). A job's Workflow deleted under
it → DELETED; a Workflow over while an attempt waits for its pod → a failure of the step.

API errors (`k8s_errors.classify`): 409/410/429/5xx and no answer are temporary — a launch
raises `ExecutorError(temporary=True, infrastructure="kubernetes")`, a poll keeps what it knew
and tries again next time; 403 is permanent and names the missing RBAC rule; 422 is the step's
fault with the API's message.

Pods from a watch: the installation's pods (label `lowtide.io/job` in the Argo namespace) are
kept by one `adapters.k8s_watch.Informer` (LIST, then WATCH from its resourceVersion with
bookmarks; relist on 410; backoff on errors), started at the first read, closed by `close`. A
steady poll makes no pods request (a LIST per tick of thousands of pods was the cost); launch,
poll, `adopt` of a handle without a pod and `reap_orphans` filter the cache's pods by the labels
`lowtide.io/job`/`lowtide.io/step` here. The first read waits (bounded by `request_timeout_s`)
for the first LIST and WATCH. A cache that is not *current* (a failed LIST or WATCH, until a
watch is open again) is read as a failed LIST was: a temporary error (its 403 a permanent one
naming the RBAC rule, `k8s_errors`), so a poll keeps what it knew (no exit invented, no attempt
dropped) and a launch leaves its attempt PENDING for a later poll. lowtide's own pod writes (the
admission patch, deletes) answer with the pod's new resourceVersion; the next read waits,
bounded, until the cache has seen it (read-your-writes), else it is a temporary error too (once:
the read after it does not wait for that write again).
`pods_resource_version` is the cache's version at the last read. The node fit check
(`adapters.k8s_nodes`: every pod on a node, any namespace, by `spec.nodeName`) stays a LIST.
Known limit: a watch connection that dies silently is noticed only after the informer's idle
timeout (`k8s_watch`), during which the cache looks current but misses changes.

Kubernetes Events (with `events`, `adapters.k8s_events`; docs/cluster.md "Kubernetes Events"), on
the pod: Warning ``AdmissionDeferred`` (the NodeBusy words), Normal ``Admitted`` (node, GPUs),
a notice by the loop's reason (`notify_stop`'s `reason`, `NOTICE_REASONS`): Normal ``Preempting``
(GPUs reclaimed), ``Cancelling`` (job cancelled), ``WalltimeExceeded`` (walltime), else
``StopNotice``, the reason in the note; or Normal ``Withdrawn`` (a pod not running yet), Warning
``ImagePullGaveUp`` / ``UnschedulableGaveUp``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kubernetes import client

from lowtide.adapters.argo import k8s_errors, pods
from lowtide.adapters.argo.exits import attempt_exit
from lowtide.adapters.argo.node_status import NodeOutcome, classify_node
from lowtide.adapters.argo.step_tokens import StepTokens
from lowtide.adapters.argo.workflow import (
    LABEL_JOB,
    LABEL_STEP,
    ArgoSettings,
    CompiledWorkflow,
    NothingLeftToRun,
    dns_label,
)
from lowtide.adapters.argo.workflow_store import KubernetesWorkflows, WorkflowExists, WorkflowsApi
from lowtide.adapters.k8s_events import EventSink, EventType, Regarding
from lowtide.adapters.k8s_nodes import NodeBusy, NodeLending, pod_gpus
from lowtide.adapters.k8s_watch import Informer, compare_resource_versions
from lowtide.adapters.kube_client import response_object
from lowtide.control.executor_port import (
    NOTICE_CANCELLED,
    NOTICE_PREEMPTED,
    NOTICE_WALLTIME,
    AdoptOutcome,
    AdoptRequest,
    AdoptResult,
    AttemptExit,
    AttemptHandle,
    AttemptStarted,
    ExecutorError,
    ExitReason,
    LaunchRequest,
    PollReport,
)

__all__ = ["WORKFLOW_LABEL", "ArgoExecutor", "parse_ref", "pod_workflow"]

log = logging.getLogger(__name__)

_STRATEGIC = "application/strategic-merge-patch+json"
_TERMINAL_WF = frozenset({"Succeeded", "Failed", "Error"})
#: The Event reason of a notice, by the loop's reason for it (any other: ``StopNotice``).
NOTICE_REASONS = {
    NOTICE_PREEMPTED: "Preempting",
    NOTICE_CANCELLED: "Cancelling",
    NOTICE_WALLTIME: "WalltimeExceeded",
}
#: Argo's label naming the Workflow of a pod (argo-workflows workflow/common/common.go `LabelKeyWorkflow`).
WORKFLOW_LABEL = "workflows.argoproj.io/workflow"

Obj = dict[str, Any]


@dataclass
class _Attempt:
    """What the executor knows of one attempt it launched or adopted."""

    attempt_id: int
    job_id: str
    step_label: str
    node: str
    started_at: float
    #: The Workflow (job generation) whose pod the attempt takes (`workflow.workflow_name`).
    workflow: str = ""
    pod: str | None = None
    uid: str | None = None
    node_id: str | None = None
    #: Per-attempt values the Workflow cannot carry, set on the pod at admission.
    annotations: dict[str, str] = field(default_factory=dict)
    running: bool = False
    deadline: float | None = None
    deleted: bool = False  # lowtide deleted its pod (notice or withdrawal)
    delete_due: float | None = None  # a grace delete to (re)send: its deadline
    killed: bool = False
    pull_since: float | None = None
    unsched_since: float | None = None


def parse_ref(ref: str) -> tuple[str, str, str]:
    """(namespace, pod name or "@job", uid or step label) of a handle's ref; ValueError if not ours."""
    parts = ref.split("/")
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"not an Argo executor handle: {ref!r}")
    return parts[0], parts[1], parts[2]


class ArgoExecutor:
    """The executor port over Kubernetes pods of Argo Workflows (module docstring)."""

    def __init__(
        self,
        api_client: Any,
        settings: ArgoSettings,
        workflows: Callable[[str], CompiledWorkflow],
        *,
        image_pull_bound_s: float = 300.0,
        unschedulable_bound_s: float = 600.0,
        kill_margin_s: float = 15.0,
        request_timeout_s: float = 10.0,
        workflows_api: WorkflowsApi | None = None,
        nodes: Mapping[str, int] | None = None,
        node_resync_s: float = 60.0,
        watch_backoff_s: tuple[float, float] = (0.8, 30.0),
        events: EventSink | None = None,
    ) -> None:
        """`workflows(job_id)` compiles a job's current Workflow, of the generation the store gives
        (wiring reads the job from the store; called at each launch and `end_job`); it may raise
        ArgoCompileError (a permanent launch failure of the step). `workflows_api`
        is where Workflows are created and read (default: the Kubernetes API of `api_client`).
        `nodes`: lowtide's configured nodes and GPU counts; with them each GPU pod's node is
        checked and labelled/tainted before admission (`k8s_nodes.NodeLending`; wiring always
        passes them). None: pods are pinned without looking at the Node (tests of other parts).
        `watch_backoff_s`: the pod watch's backoff (initial, cap) after a failure (`k8s_watch`)."""
        self._client = api_client
        self._core = client.CoreV1Api(api_client)
        self._wf_api: WorkflowsApi = workflows_api or KubernetesWorkflows(
            api_client, settings.namespace, request_timeout_s
        )
        self._settings = settings
        self._ns = settings.namespace
        self._step_tokens = StepTokens(self._core, self._wf_api, settings.namespace, request_timeout_s)
        self._workflows = workflows
        self._image_bound = image_pull_bound_s
        self._unsched_bound = unschedulable_bound_s
        self._kill_margin = kill_margin_s
        self._timeout = request_timeout_s
        self._attempts: dict[int, _Attempt] = {}
        self._unacked: dict[int, AttemptExit] = {}
        #: Names of Workflows known to exist (created, or answered 409 and read back).
        self._submitted: set[str] = set()
        #: Job id -> the name of its current generation's Workflow, as last compiled.
        self._current: dict[str, str] = {}
        #: Retried generations whose older generations were stopped (`_stop_older`).
        self._swept: set[str] = set()
        self._lending = (
            None
            if nodes is None
            else NodeLending(api_client, nodes, request_timeout_s=request_timeout_s, resync_s=node_resync_s)
        )
        #: The pod cache (module docstring, "Pods from a watch"), started at the first read.
        self._pods = Informer(
            api_client,
            self._core.list_namespaced_pod,
            None,
            settings.namespace,
            label_selector=LABEL_JOB,
            what=f"pods {LABEL_JOB} in {settings.namespace}",
            request_timeout_s=request_timeout_s,
            backoff_s=watch_backoff_s,
        )
        self._reading = False  # the cache was read (so started) at least once
        #: The resourceVersion of lowtide's last pod write, which the next read waits for ("").
        self._own_write = ""
        #: The resourceVersion of the pod cache at the last read.
        self.pods_resource_version: str | None = None
        #: Kubernetes Events about the pods (`adapters.k8s_events`; docs/cluster.md "Kubernetes Events").
        self._events = events

    # -- API calls -------------------------------------------------------------------------------

    def _error(self, exc: BaseException, verb: str, resource: str) -> ExecutorError:
        return k8s_errors.classify(exc, verb=verb, resource=resource, namespace=self._ns)

    def _list_pods(self, job: str | None = None, step: str | None = None) -> list[Obj]:
        """The installation's pods (of `job`, of its `step` label, when given) from the watch
        cache. Raises ExecutorError when the cache cannot be trusted now (module docstring)."""
        self._reading = True
        inf = self._pods.start()
        snap = inf.snapshot()
        if not snap.current and snap.error is None:  # starting: the first LIST and WATCH
            inf.wait_current(self._timeout, or_failure=True)
            snap = inf.snapshot()
        if not snap.current:  # failing: no wait for a write it cannot show
            raise self._stale(snap.problem, snap.error, snap.error_verb)
        if self._own_write and not inf.wait_for(self._own_write, self._timeout):
            snap = inf.snapshot()
            if not snap.current:
                raise self._stale(snap.problem, snap.error, snap.error_verb)
            written, self._own_write = self._own_write, ""  # waited once: the next read does not
            raise ExecutorError(
                f"list pods in namespace {self._ns}: the pod cache has not shown lowtide's own write "
                f"(resourceVersion {written}) within {self._timeout:g}s; will try again",
                temporary=True,
                infrastructure=k8s_errors.INFRASTRUCTURE,
            )
        snap = inf.snapshot()
        if not snap.current:
            raise self._stale(snap.problem, snap.error, snap.error_verb)
        self._own_write = ""
        self.pods_resource_version = snap.resource_version or None
        out: list[Obj] = []
        for pod in snap.items.values():
            labels = (pod.get("metadata") or {}).get("labels") or {}
            if (job is None or labels.get(LABEL_JOB) == job) and (
                step is None or labels.get(LABEL_STEP) == step
            ):
                out.append(pod)
        return out

    def _stale(self, problem: str, error: BaseException | None, verb: str) -> ExecutorError:
        """The error of a read from a pod cache that is not current: its failure classified
        (a 403 names the RBAC rule), else temporary."""
        if error is not None and k8s_errors.status_of(error) is not None:
            err = self._error(error, verb or "list", "pods")
            if not err.temporary:
                return err
        return ExecutorError(
            f"list pods in namespace {self._ns}: the pod cache is not current ({problem}); will try again",
            temporary=True,
            infrastructure=k8s_errors.INFRASTRUCTURE,
        )

    def _wrote(self, response: Any) -> None:
        """Remember the resourceVersion of lowtide's own pod write (a pod in the answer), for the
        next read to wait for; an answer without one (a Status) leaves nothing to wait for."""
        try:
            rv = str((response_object(response).get("metadata") or {}).get("resourceVersion") or "")
        except ValueError:
            return
        if compare_resource_versions(rv, rv) is None:  # none, or not comparable: nothing to wait for
            return
        if not self._own_write or _newer(rv, self._own_write):
            self._own_write = rv

    @property
    def pod_cache_problem(self) -> str:
        """Why the pod cache cannot be read now ("" when it can, or before its first read)."""
        snap = self._pods.snapshot()
        return "" if snap.current or not (snap.synced or snap.error) else snap.problem

    def caught_up(self, resource_version: str | int, timeout_s: float) -> bool:
        """Wait at most `timeout_s` until the pod cache is current and has seen `resource_version`
        (for tests driving a simulated controller); True at once when no read has started it."""
        if not self._reading:
            return True
        if str(resource_version or "0") == "0":  # no pod written yet: current is enough
            return self._pods.wait_current(timeout_s)
        return self._pods.wait_for(resource_version, timeout_s)

    def _event(self, pod: str | None, uid: str | None, type_: EventType, reason: str, note: str) -> None:
        if self._events is not None and pod:
            self._events.emit(Regarding.pod(self._ns, pod, uid or ""), type_, reason, reason, note)

    def _get_workflow(self, name: str) -> Obj | None:
        """The Workflow, None if there is none. Raises ExecutorError."""
        return self._wf_api.get(name)

    def _grace(self, deadline: float, now: float) -> int:
        """The delete's grace: until the deadline plus the margin (at least 1 s; see the module
        docstring, "Notice")."""
        return max(1, math.ceil(deadline - now + self._settings.grace_margin_seconds))

    def _delete_pod(self, t: _Attempt, grace: int) -> bool:
        """Delete `t`'s pod (uid precondition). True when done or nothing is left to delete."""
        assert t.pod is not None and t.uid is not None
        body = client.V1DeleteOptions(
            grace_period_seconds=grace, preconditions=client.V1Preconditions(uid=t.uid)
        )
        try:
            answer = self._core.delete_namespaced_pod(
                t.pod, self._ns, body=body, _request_timeout=self._timeout, _preload_content=False
            )
        except Exception as exc:
            status = k8s_errors.status_of(exc)
            if status in (404, 409):  # gone, or the name is another pod's now (uid precondition)
                return True
            err = self._error(exc, "delete", "pods")
            log.warning("attempt %s: deleting pod %s failed: %s", t.attempt_id, t.pod, err)
            if not err.temporary:
                raise err from exc
            return False
        self._wrote(answer)
        return True

    # -- submission and admission -------------------------------------------------------------

    def _compile(self, job_id: str) -> CompiledWorkflow:
        """The job's current Workflow (the store decides its generation); remembered per job."""
        compiled = self._workflows(job_id)
        self._current[job_id] = compiled.name
        return compiled

    def _ensure_workflow(self, job_id: str) -> str:
        """The name of the job's current Workflow, created unless known to exist (module
        docstring, "Submission"). Raises ExecutorError, or ValueError when it cannot compile."""
        compiled = self._compile(job_id)
        if compiled.name not in self._submitted:
            self._create(job_id, compiled)
            self._submitted.add(compiled.name)
        if compiled.name != job_id and compiled.name not in self._swept:
            self._stop_older(job_id, compiled.name)
        return compiled.name

    def _stop_older(self, job_id: str, current: str) -> None:
        """Stop the job's Workflows of earlier generations that still run (failures are logged
        and tried again at the next launch: the new generation does not wait for them)."""
        try:
            for wf in self._wf_api.list(f"{LABEL_JOB}={job_id}"):
                name = str((wf.get("metadata") or {}).get("name", ""))
                done = (wf.get("status") or {}).get("phase") in _TERMINAL_WF
                if name and name != current and not done and not (wf.get("spec") or {}).get("shutdown"):
                    log.warning("job %s: stopping %s/%s, an earlier generation", job_id, self._ns, name)
                    self._wf_api.stop(name)
        except ExecutorError as exc:
            log.warning("job %s: earlier generations not stopped yet: %s", job_id, exc)
            return
        self._swept.add(current)

    def _create(self, job_id: str, compiled: CompiledWorkflow) -> None:
        try:
            self._wf_api.create(compiled.manifest)
        except WorkflowExists as exc:
            # 409: AlreadyExists (an earlier try or process) or a conflict: read it back
            found = self._get_workflow(compiled.name)
            if found is None:
                raise ExecutorError(
                    f"workflow {compiled.name}: create answered 409 but it cannot be read; will try again",
                    temporary=True,
                    infrastructure=k8s_errors.INFRASTRUCTURE,
                ) from exc
            labels = (found.get("metadata") or {}).get("labels") or {}
            if labels.get(LABEL_JOB) != job_id:
                raise ExecutorError(
                    f"workflow {self._ns}/{compiled.name} exists but is not lowtide's job {job_id} "
                    f"(label {LABEL_JOB}={labels.get(LABEL_JOB)!r})",
                    temporary=False,
                    infrastructure=k8s_errors.INFRASTRUCTURE,
                ) from exc

    def _claimed_uids(self) -> set[str]:
        return {t.uid for t in self._attempts.values() if t.uid is not None}

    def _claimable(self, t: _Attempt, candidates: list[Obj]) -> Obj | None:
        """The step's pod this attempt may take: made by the attempt's Workflow (never a pod an
        older generation left), gated (or, for a CPU-only step, not admitted by anyone and not
        finished), not being deleted, not another attempt's; the newest first."""
        claimed = self._claimed_uids()
        mine = [
            p
            for p in candidates
            if (p.get("metadata") or {}).get("labels", {}).get(LABEL_JOB) == t.job_id
            and (p.get("metadata") or {}).get("labels", {}).get(LABEL_STEP) == t.step_label
            and pod_workflow(p) == t.workflow
            and not pods.is_deleting(p)
            and p["metadata"].get("uid") not in claimed
        ]
        gated = [p for p in mine if pods.is_gated(p)]
        if gated:
            return max(gated, key=_created)
        ungated = [
            p
            for p in mine
            if pods.pod_phase(p) in ("Pending", "Running")
            and not (p.get("spec") or {}).get("nodeSelector", {}).get(pods.HOSTNAME_LABEL)
            and not (p.get("spec") or {}).get("schedulingGates")
        ]
        return max(ungated, key=_created) if ungated else None

    def _admit(self, t: _Attempt, pod: Obj, listed: list[Obj]) -> None:
        """Claim `pod` for `t`, admitting it (one patch) when it is gated: first its node is
        checked and lent (`NodeLending.prepare_admission`, with `listed`, the installation's pods,
        for lowtide's own not yet bound). Raises ExecutorError (`NodeBusy`: it does not fit)."""
        meta = pod["metadata"]
        if pods.is_gated(pod):
            # The token first (the kubelet mounts the job's Secret once the gate is gone:
            # step_tokens), before the node is lent, so a failed write leaves nothing to undo.
            self._step_tokens.deliver(t.attempt_id, t.job_id, t.step_label, pod, workflow=t.workflow)
            if self._lending is not None:
                try:
                    self._lending.prepare_admission(t.node, pod, listed)
                except NodeBusy as exc:
                    self._event(meta["name"], meta.get("uid"), "Warning", "AdmissionDeferred", str(exc))
                    raise
            try:
                answer = self._core.patch_namespaced_pod(
                    meta["name"],
                    self._ns,
                    pods.admission_patch(t.node, t.annotations),
                    _content_type=_STRATEGIC,
                    _request_timeout=self._timeout,
                    _preload_content=False,
                )
                self._wrote(answer)
            except Exception as exc:
                if self._lending is not None:
                    self._lending.release(str(meta.get("uid", "")))
                raise self._error(exc, "patch", "pods") from exc
            note = f"onto node {t.node} with {pod_gpus(pod)} GPUs (job {t.job_id}, attempt {t.attempt_id})"
            self._event(meta["name"], meta.get("uid"), "Normal", "Admitted", note)
        self._step_tokens.forget(t.attempt_id)
        t.pod, t.uid, t.node_id = meta["name"], meta["uid"], pods.pod_node_id(pod)
        log.info("attempt %s: admitted pod %s/%s on %s", t.attempt_id, self._ns, t.pod, t.node)

    def _try_admit(self, t: _Attempt, candidates: list[Obj], now: float) -> None:
        pod = self._claimable(t, candidates)
        if pod is None:
            return
        try:
            self._admit(t, pod, candidates)
        except NodeBusy as exc:
            # The node cannot take it now: requeued after a backoff (no retry used), as a pod no
            # node takes; the gated pod stays for the next attempt.
            self._exit(
                t,
                AttemptExit(t.attempt_id, None, None, now, reason=ExitReason.UNSCHEDULABLE, detail=str(exc)),
            )
        except ExecutorError as exc:
            if exc.temporary:
                log.info("attempt %s: admission deferred: %s", t.attempt_id, exc)
            elif exc.infrastructure is not None:
                infra = f"{exc.infrastructure}: {exc}"
                self._exit(
                    t, AttemptExit(t.attempt_id, None, None, now, infrastructure=infra, detail=str(exc))
                )
            else:  # the API refused the step's pod (422): the step's failure
                self._exit(
                    t, AttemptExit(t.attempt_id, None, None, now, reason=ExitReason.EXITED, detail=str(exc))
                )

    def _handle(self, t: _Attempt) -> AttemptHandle:
        if t.pod is not None and t.uid is not None:
            ref = f"{self._ns}/{t.pod}/{t.uid}"
        else:
            ref = f"{self._ns}/@{t.job_id}/{t.step_label}"
        return AttemptHandle(ref, t.started_at, None)

    def _drop(self, attempt_id: int) -> None:
        """Forget an attempt this process will not carry on with (and the token it held)."""
        self._attempts.pop(attempt_id, None)
        self._step_tokens.forget(attempt_id)

    # -- the port ------------------------------------------------------------------------------

    def launch(self, request: LaunchRequest, now: float) -> AttemptHandle:
        try:
            workflow = self._ensure_workflow(request.job_id)
        except ExecutorError:
            raise
        except ValueError as exc:  # ArgoCompileError: the job cannot become a Workflow
            raise ExecutorError(f"cannot compile job {request.job_id}: {exc}", temporary=False) from exc
        t = _Attempt(
            request.attempt_id, request.job_id, dns_label(request.step), request.node, now, workflow=workflow
        )
        resume_from = request.env.get("LOWTIDE_RESUME_FROM")
        if resume_from:
            t.annotations[pods.RESUME_ANNOTATION] = resume_from
        self._step_tokens.hold(request.attempt_id, request.env.get("LOWTIDE_STEP_TOKEN"))
        self._attempts[request.attempt_id] = t
        # With node lending the fit check needs all of the installation's pods (its own pinned, not
        # yet bound); `_claimable` picks the step's among them.
        try:
            candidates = (
                self._list_pods() if self._lending is not None else self._list_pods(t.job_id, t.step_label)
            )
        except Exception as exc:
            err = exc if isinstance(exc, ExecutorError) else self._error(exc, "list", "pods")
            if not err.temporary:
                self._drop(request.attempt_id)
                raise err from exc
            log.info("attempt %s: pods not listed (%s); admission at a later poll", t.attempt_id, err)
            return self._handle(t)
        pod = self._claimable(t, candidates)
        if pod is not None:
            try:
                self._admit(t, pod, candidates)
            except NodeBusy:
                self._drop(request.attempt_id)
                raise  # the loop's launch failure path: no retry used, a backoff, placed again
            except ExecutorError as exc:
                if not exc.temporary:
                    self._drop(request.attempt_id)
                    raise
                log.info("attempt %s: admission deferred: %s", t.attempt_id, exc)
        return self._handle(t)

    def notify_stop(self, attempt_id: int, deadline: float, now: float, *, reason: str | None = None) -> None:
        if attempt_id in self._unacked:
            return
        t = self._attempts.get(attempt_id)
        if t is None or t.deadline is not None:
            return
        t.deadline = deadline
        if not t.running:  # not running yet: withdrawn at once
            if t.uid is not None and not self._delete_pod(t, 0):
                t.delete_due = now  # retried at the next poll; the exit is reported now
            t.deleted = True
            self._event(t.pod, t.uid, "Normal", "Withdrawn", "stopped by lowtide before it ran: deleted")
            self._exit(
                t,
                AttemptExit(
                    attempt_id, None, None, now, reason=ExitReason.DELETED, detail="withdrawn while pending"
                ),
            )
            return
        t.deleted = True
        note = (
            f"notice: SIGTERM now, to stop within {deadline - now:.0f}s (grace {self._grace(deadline, now)}s)"
        )
        if reason:
            note = f"{reason}: {note}"
        self._event(t.pod, t.uid, "Normal", NOTICE_REASONS.get(reason or "", "StopNotice"), note)
        t.delete_due = deadline
        if self._delete_pod(t, self._grace(deadline, now)):
            t.delete_due = None

    def poll(self, now: float) -> PollReport:
        started: list[AttemptStarted] = []
        live = [t for t in self._attempts.values() if t.attempt_id not in self._unacked]
        if live or (self._lending is not None and self._lending.needs_pods(now)):
            try:
                self._observe(live, now, started)
            except Exception as exc:
                err = exc if isinstance(exc, ExecutorError) else self._error(exc, "list", "pods")
                if not err.temporary:
                    raise err from exc
                log.warning("Argo executor poll: %s", err)
        return PollReport(exits=tuple(self._unacked.values()), started=tuple(started))

    def _observe(self, live: list[_Attempt], now: float, started: list[AttemptStarted]) -> None:
        all_pods = self._list_pods()
        self._observe_attempts(live, all_pods, now, started)
        if self._lending is not None:  # after this poll's admissions (held until listed admitted)
            self._lending.reconcile(all_pods, now)

    def _observe_attempts(
        self, live: list[_Attempt], all_pods: list[Obj], now: float, started: list[AttemptStarted]
    ) -> None:
        by_uid = {p["metadata"]["uid"]: p for p in all_pods}
        workflows: dict[str, Obj | None] = {}

        def workflow(name: str) -> Obj | None:
            if name not in workflows:
                workflows[name] = self._get_workflow(name)
            return workflows[name]

        for t in live:
            if t.uid is None:
                self._try_admit(t, all_pods, now)
                if t.uid is None:
                    self._check_not_abandoned(t, workflow(t.workflow), now)
                    continue
            if t.delete_due is not None and self._delete_pod(t, self._grace(t.delete_due, now)):
                t.delete_due = None
            pod = by_uid.get(t.uid)
            if pod is not None:
                self._observe_pod(t, pod, now, started)
            if t.attempt_id in self._unacked:
                continue
            if pod is None or pods.pod_phase(pod) in ("Succeeded", "Failed"):
                self._observe_node(t, workflow(t.workflow), pod is None, now)

    def _observe_pod(self, t: _Attempt, pod: Obj, now: float, started: list[AttemptStarted]) -> None:
        phase = pods.pod_phase(pod)
        if t.node_id is None:
            t.node_id = pods.pod_node_id(pod)
        if phase == "Running" and not t.running:
            t.running = True
            started.append(AttemptStarted(t.attempt_id, now, self._handle(t)))  # the pod, for the store
        overdue = (
            t.deadline is not None
            and now >= t.deadline + self._settings.grace_margin_seconds + self._kill_margin
        )
        if overdue and not t.killed and phase in ("Pending", "Running"):
            self._kill(t)
        if phase != "Pending" or pods.is_deleting(pod):
            return
        image = pods.image_problem(pod)
        if image is not None:
            t.pull_since = now if t.pull_since is None else t.pull_since
            if image[0] in pods.IMAGE_FINAL or now - t.pull_since >= self._image_bound:
                self._give_up(t, now, ExitReason.IMAGE_PULL, image[1])
            return
        t.pull_since = None
        problem = pods.unschedulable(pod)
        if problem is not None:
            t.unsched_since = now if t.unsched_since is None else t.unsched_since
            if now - t.unsched_since >= self._unsched_bound:
                self._give_up(t, now, ExitReason.UNSCHEDULABLE, problem)
            return
        t.unsched_since = None

    def _give_up(self, t: _Attempt, now: float, reason: ExitReason, detail: str) -> None:
        """A pending pod that will not start: delete it (Argo makes it again) and report."""
        if self._delete_pod(t, 0):
            t.deleted = True
            why = "ImagePullGaveUp" if reason == ExitReason.IMAGE_PULL else "UnschedulableGaveUp"
            self._event(t.pod, t.uid, "Warning", why, f"deleted by lowtide, requeued: {detail}")
            self._exit(t, AttemptExit(t.attempt_id, None, None, now, reason=reason, detail=detail))

    def _kill(self, t: _Attempt) -> None:
        if self._delete_pod(t, 0):
            t.killed = True

    def _check_not_abandoned(self, t: _Attempt, wf: Obj | None, now: float) -> None:
        """An attempt waiting for its pod whose Workflow is gone or over will never get one."""
        if wf is None:
            if t.workflow in self._submitted:
                detail = f"workflow {self._ns}/{t.workflow} was deleted"
                self._exit(
                    t, AttemptExit(t.attempt_id, None, None, now, reason=ExitReason.DELETED, detail=detail)
                )
            return
        phase = (wf.get("status") or {}).get("phase")
        if phase in _TERMINAL_WF:
            # Argo's retry expression said no more (its `retries` counts preemptions too, docs/
            # cluster.md "Known limits"), or the Workflow was stopped: the step cannot run again
            # in it. A failure of the step (it uses a retry), so the job ends rather than waits.
            message = (wf.get("status") or {}).get("message") or ""
            detail = f"workflow {self._ns}/{t.workflow} is {phase} ({message}): Argo runs no more pods for it"
            self._exit(t, AttemptExit(t.attempt_id, None, None, now, reason=ExitReason.EXITED, detail=detail))

    def _observe_node(self, t: _Attempt, wf: Obj | None, pod_gone: bool, now: float) -> None:
        if wf is None:
            if pod_gone:
                detail = f"workflow {self._ns}/{t.workflow} and its pod were deleted"
                self._exit(
                    t, AttemptExit(t.attempt_id, None, None, now, reason=ExitReason.DELETED, detail=detail)
                )
            return
        nodes = (wf.get("status") or {}).get("nodes") or {}
        node = nodes.get(t.node_id) if t.node_id else None
        if not isinstance(node, Mapping):
            return  # Argo has not recorded it yet
        outcome = classify_node(node, interrupted_exit_code=self._settings.interrupted_exit_code)
        if outcome.terminal:
            self._exit(t, self._to_exit(t, outcome, now))

    def _to_exit(self, t: _Attempt, o: NodeOutcome, now: float) -> AttemptExit:
        return attempt_exit(
            t.attempt_id, o, noticed=t.deadline is not None, deleted=t.deleted, killed=t.killed, now=now
        )

    def _exit(self, t: _Attempt, ex: AttemptExit) -> None:
        if not t.running and t.pod is not None and t.uid is not None:
            ex = replace(ex, handle=self._handle(t))  # no start reported it: the exit brings the pod
        self._unacked[t.attempt_id] = ex

    def ack_exit(self, attempt_id: int) -> None:
        if self._unacked.pop(attempt_id, None) is not None:
            self._attempts.pop(attempt_id, None)
            self._step_tokens.forget(attempt_id)

    def end_job(self, job_id: str, now: float) -> None:
        """The job will start nothing more: stop its current generation's Workflow (`spec.shutdown:
        Stop`), so that Argo's retry strategy creates no new pod for it (a missing Workflow:
        nothing to stop). The name is compiled afresh (the store may have retried the job since
        this process last launched a step of it); when the job cannot compile (so no Workflow of
        it was made since), every Workflow of the job that still runs is stopped; when the store
        cannot be read, the Workflow this process last compiled for the job (else the error goes
        to the loop, which tries again at its next tick). Earlier generations stay as they are,
        but for one still running that no launch of the current one stopped (`_stop_older`)."""
        try:
            name = self._compile(job_id).name
        except ExecutorError:
            raise
        except NothingLeftToRun as done:  # a retried job that SUCCEEDED: the Workflow it ran in
            name = done.workflow
        except ValueError as exc:  # ArgoCompileError (settings changed since?): by label
            log.warning("job %s does not compile (%s); stopping its running workflows by label", job_id, exc)
            for wf in self._wf_api.list(f"{LABEL_JOB}={job_id}"):
                if (wf.get("status") or {}).get("phase") not in _TERMINAL_WF:
                    self.stop_workflow(str((wf.get("metadata") or {}).get("name", "")))
            return
        except Exception:  # the store cannot say now (an outage)
            if job_id not in self._current:
                raise
            name = self._current[job_id]
        self.stop_workflow(name)
        if name != job_id and name not in self._swept:
            self._stop_older(job_id, name)  # retried before the loop ended it, and never launched

    def adopt(self, request: AdoptRequest, now: float) -> AdoptResult:
        handle = request.handle
        if handle is None:
            return AdoptResult(AdoptOutcome.LOST)
        try:
            ns, name, key = parse_ref(handle.ref)
        except ValueError:
            return AdoptResult(AdoptOutcome.LOST)
        if ns != self._ns:
            return AdoptResult(AdoptOutcome.LOST)
        try:
            if name.startswith("@"):
                return self._adopt_unclaimed(request, handle, name[1:], key, now)
            return self._adopt_pod(request, handle, name, key, now)
        except ExecutorError:
            raise
        except Exception as exc:
            raise self._error(exc, "get", "pods") from exc

    def _adopt_pod(
        self, request: AdoptRequest, handle: AttemptHandle, name: str, uid: str, now: float
    ) -> AdoptResult:
        try:
            pod: Obj | None = response_object(
                self._core.read_namespaced_pod(
                    name, self._ns, _request_timeout=self._timeout, _preload_content=False
                )
            )
        except Exception as exc:
            if k8s_errors.status_of(exc) != 404:
                raise
            pod = None
        if pod is not None and pod["metadata"].get("uid") == uid:
            labels = pod["metadata"].get("labels") or {}
            t = _Attempt(
                request.attempt_id,
                str(labels.get(LABEL_JOB, "")),
                str(labels.get(LABEL_STEP, "")),
                "",
                handle.started_at,
                workflow=pod_workflow(pod) or str(labels.get(LABEL_JOB, "")),
                pod=name,
                uid=uid,
                node_id=pods.pod_node_id(pod),
                running=handle.running_at is not None,
                deadline=request.stop_deadline,
                deleted=request.stop_deadline is not None,
            )
            if request.stop_deadline is not None and not pods.is_deleting(pod):
                t.delete_due = request.stop_deadline  # notice given, its delete not seen: sent again
            self._attempts[t.attempt_id] = t
            self._submitted.add(t.workflow)
            return AdoptResult(AdoptOutcome.ADOPTED)
        # The pod is gone: its node in the job's Workflow may have recorded how it ended.
        found = self._node_of_pod(name)
        if found is None:
            return AdoptResult(AdoptOutcome.LOST)
        job_id, node = found
        outcome = classify_node(node, interrupted_exit_code=self._settings.interrupted_exit_code)
        if not outcome.terminal:
            return AdoptResult(AdoptOutcome.LOST)
        t = _Attempt(
            request.attempt_id,
            job_id,
            "",
            "",
            handle.started_at,
            pod=name,
            uid=uid,
            running=True,
            deadline=request.stop_deadline,
            deleted=request.stop_deadline is not None,
        )
        return AdoptResult(AdoptOutcome.EXITED, exit=self._to_exit(t, outcome, now))

    def _node_of_pod(self, pod_name: str) -> tuple[str, Mapping[str, Any]] | None:
        for wf in self._wf_api.list(LABEL_JOB):
            wf_name = str((wf.get("metadata") or {}).get("name", ""))
            for node_id, node in ((wf.get("status") or {}).get("nodes") or {}).items():
                if not isinstance(node, Mapping) or node.get("type") != "Pod":
                    continue
                names = {
                    node_id,
                    pods.argo_pod_name(wf_name, str(node.get("name", "")), str(node.get("templateName", ""))),
                }
                if pod_name in names:
                    return str((wf.get("metadata") or {}).get("labels", {}).get(LABEL_JOB, wf_name)), node
        return None

    def _adopt_unclaimed(
        self, request: AdoptRequest, handle: AttemptHandle, job_id: str, step_label: str, now: float
    ) -> AdoptResult:
        """A handle recorded before a pod was claimed: the step's pod of the job's current Workflow
        that this process or the last one admitted (not gated, not finished, not someone else's),
        or none yet."""
        try:
            workflow = self._compile(job_id).name
        except ValueError as exc:  # it compiled at launch; the settings changed since
            log.warning("attempt %s: job %s does not compile: %s", request.attempt_id, job_id, exc)
            return AdoptResult(AdoptOutcome.LOST)
        candidates = self._list_pods(job_id, step_label)
        claimed = self._claimed_uids()
        t = _Attempt(
            request.attempt_id,
            job_id,
            step_label,
            "",
            handle.started_at,
            workflow=workflow,
            deadline=request.stop_deadline,
            deleted=request.stop_deadline is not None,
        )
        admitted = [
            p
            for p in candidates
            if pod_workflow(p) == workflow
            and not pods.is_gated(p)
            and not pods.is_deleting(p)
            and pods.pod_phase(p) in ("Pending", "Running")
            and p["metadata"].get("uid") not in claimed
        ]
        if admitted:
            pod = max(admitted, key=_created)
            t.pod, t.uid, t.node_id = pod["metadata"]["name"], pod["metadata"]["uid"], pods.pod_node_id(pod)
            t.node = str(((pod.get("spec") or {}).get("nodeSelector") or {}).get(pods.HOSTNAME_LABEL, ""))
        self._attempts[t.attempt_id] = t
        self._submitted.add(workflow)
        if t.uid is None:
            # Nothing admitted: it may still be admitted (its node is in the store, not here).
            log.warning("attempt %s: no admitted pod found; it is withdrawn", request.attempt_id)
            self._drop(t.attempt_id)
            return AdoptResult(AdoptOutcome.LOST)
        return AdoptResult(AdoptOutcome.ADOPTED, handle=self._handle(t))

    def reap_orphans(self, known_attempt_ids: set[int]) -> list[int]:
        """Delete this installation's pods that lowtide admitted (pinned to a node), unfinished, that
        no known attempt holds; a gated pod waits for admission and is nobody's orphan, nor is a
        CPU-only pod (Argo runs it before lowtide launches its attempt). Pods carry no lowtide
        attempt id, so the list returned is always empty; the deleted pods are logged."""
        for attempt_id in [
            a for a in self._attempts if a not in known_attempt_ids and a not in self._unacked
        ]:
            self._drop(attempt_id)
        try:
            listed = self._list_pods()
        except Exception as exc:
            err = exc if isinstance(exc, ExecutorError) else self._error(exc, "list", "pods")
            log.warning("orphaned pods not reaped: %s", err)
            return []
        claimed = self._claimed_uids()
        for pod in listed:
            meta = pod["metadata"]
            admitted = ((pod.get("spec") or {}).get("nodeSelector") or {}).get(pods.HOSTNAME_LABEL)
            if (
                not admitted  # gated, or a CPU-only pod Argo runs before lowtide launches its attempt
                or pods.is_gated(pod)
                or pods.is_deleting(pod)
                or pods.pod_phase(pod) not in ("Pending", "Running")
                or meta.get("uid") in claimed
            ):
                continue
            body = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=meta["uid"]))
            try:
                self._wrote(
                    self._core.delete_namespaced_pod(
                        meta["name"],
                        self._ns,
                        body=body,
                        _request_timeout=self._timeout,
                        _preload_content=False,
                    )
                )
                log.warning(
                    "deleted orphaned pod %s/%s (no attempt of this lowtide holds it)", self._ns, meta["name"]
                )
            except Exception as exc:
                log.warning(
                    "orphaned pod %s not deleted: %s", meta["name"], self._error(exc, "delete", "pods")
                )
        return []

    def stop_workflow(self, workflow: str) -> bool:
        """Stop the Workflow named `workflow` (a job id is its generation 0): `spec.shutdown: Stop`
        (Argo deletes its pods and starts no more). False when there is no such Workflow. Raises
        ExecutorError."""
        return self._wf_api.stop(workflow)

    def close(self) -> None:
        """Stop watching (pods keep running; a later control plane adopts them)."""
        self._pods.close()
        self._wf_api.close()
        self._client.close()


def pod_workflow(pod: Mapping[str, Any]) -> str:
    """The name of the Workflow that made `pod`: Argo's label `workflows.argoproj.io/workflow`,
    else its controller ownerReference to a Workflow (module docstring, "Generations"); "" if
    neither is there (not a pod of Argo's)."""
    meta = pod.get("metadata") or {}
    name = (meta.get("labels") or {}).get(WORKFLOW_LABEL)
    if isinstance(name, str) and name:
        return name
    for ref in meta.get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("kind") == "Workflow" and ref.get("controller"):
            return str(ref.get("name", ""))
    return ""


def _created(pod: Mapping[str, Any]) -> tuple[str, str]:
    meta = pod.get("metadata") or {}
    return str(meta.get("creationTimestamp", "")), str(meta.get("name", ""))


def _newer(a: str, b: str) -> bool:
    """`a` is a later resourceVersion than `b` (KEP-5504 comparable versions; `k8s_watch`)."""
    order = compare_resource_versions(a, b)
    return order is not None and order > 0
