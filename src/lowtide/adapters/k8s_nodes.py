"""Lent GPUs on Kubernetes nodes: the fit check before a research pod is admitted, and lowtide's
label and taint on the nodes it lends GPUs on.

Role: `NodeLending` is what `adapters.argo.executor.ArgoExecutor` asks before it admits a gated
research pod to node N (docs/cluster.md "Lent GPUs on nodes"):
1. **Fit check.** GET Node N and require condition Ready=True, no `spec.unschedulable`, no
   NoSchedule/NoExecute taint the research pod does not tolerate (its own tolerations), and
   `status.allocatable["nvidia.com/gpu"]` ≥ the pod's GPUs + the GPUs of every other
   non-terminal pod on N: those bound to N in any namespace (one cluster-wide LIST with the
   field selector `spec.nodeName=N`; pods being deleted still hold their devices and count) and
   lowtide's own pods pinned to N that the scheduler has not bound yet. A pod that does not fit
   is refused with `NodeBusy` (a temporary `ExecutorError`) whose message names who holds what:
   "node gpu-3: 2 of 8 GPUs free (serving/chat-vllm-7f9c holds 4, lowtide/job-1-train-12 holds
   2); the step needs 4", logged once per change.
2. **Label and taint.** On every node of lowtide's config (never any other node) it keeps the
   label `lowtide.io/lent-gpus: "<n>"` = the GPUs of lowtide's admitted, unfinished research
   pods pinned there (removed at 0) and, while n > 0, the taint `lowtide.io/lent=true:
   PreferNoSchedule`. The label goes on **before** the admission patch of a pod that adds GPUs
   (`hold`), and comes off once the last such pod is gone or finished (`reconcile`, each poll,
   for the nodes whose value changed, plus a resync of every configured node every `resync_s` of
   `now` and at the first poll of a process: this repairs edits by others and adopts after a
   restart).

Why PreferNoSchedule, never NoSchedule or NoExecute: with PreferNoSchedule the scheduler prefers
other nodes for new inference pods (TaintToleration's score), so a scale-up does not land next
to research while room exists elsewhere, yet the node stays a candidate for the scheduler's
preemption: the documented safety net (the inference PriorityClass preempts research pods while
lowtide is down, deploy/helm/lowtide/README.md) needs that, and a NoSchedule taint would filter
the node out before preemption looks at it. NoExecute would evict running pods without lowtide's
notice: `lent_taint` refuses to build it (ValueError), and it is the only place a taint is built.

Writes are read-modify-write: GET the node, compute the change from what was read (only lowtide's
own label key and taint key are added or removed; every other label and taint is kept as read),
and send one JSON merge patch carrying `metadata.resourceVersion`, so the API server refuses it
with 409 Conflict when the node changed in between; then it is read and computed again (at most
`conflict_tries` times, then the next poll). Nothing to change → no write.

Kubernetes facts used (kubernetes commits noted per file):
- Effective request (component-helpers/resource/helpers.go `PodRequests`,
  `aggregateContainerResourcesByFn`, commit 0085214e; the scheduler's NodeResourcesFit filter
  uses it): the sum over containers plus restartable (sidecar) init containers, at least the
  largest of each init container's request plus the sidecars started before it; pod-level
  resources cover only cpu/memory/hugepages, so not GPUs. A container's requests default to its
  limits when only limits are given (pkg/apis/core/v1/defaults.go `SetDefaults_Pod`), and
  extended resources such as `nvidia.com/gpu` are whole numbers with requests = limits.
- Taints (api/core/v1/toleration.go `ToleratesTaint`, commit 19c6083b): an empty toleration
  effect matches all effects, an empty key matches all keys (operator Exists), operator ""/Equal
  compares values, Exists matches any value, Lt/Gt compare integers; the scheduler's
  TaintToleration filter considers only NoSchedule and NoExecute taints.
- A PATCH whose patched object carries a `metadata.resourceVersion` other than the stored one is
  a 409 Conflict (apiserver registry/generic/registry/store.go `Update`: a non-zero
  resourceVersion makes the update conditional).
- `fieldSelector=spec.nodeName=<node>` is served for pods (pkg/registry/core/pod/strategy.go
  `ToSelectableFields`, indexed by `spec.nodeName`).

Neighbours: `adapters.argo.executor` (calls `prepare_admission`, `release`, `reconcile`),
`adapters.argo.k8s_errors` (classifies API errors; a 403 here names the cluster-wide rule),
`adapters.argo.pods` (pod readings).
Must not: admit, delete or evict pods, touch a node outside lowtide's config, read the clock
(`now` comes in), or decide anything about steps.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, NoReturn

from kubernetes import client
from kubernetes.utils import parse_quantity

from lowtide.adapters.argo import k8s_errors, pods
from lowtide.adapters.kube_client import response_object
from lowtide.control.executor_port import ExecutorError

__all__ = [
    "GPU_RESOURCE",
    "LENT_LABEL",
    "LENT_TAINT_EFFECT",
    "LENT_TAINT_KEY",
    "NodeBusy",
    "NodeLending",
    "allocatable_gpus",
    "lent_by_node",
    "lent_taint",
    "node_refusal",
    "node_write",
    "pod_gpus",
    "tolerates",
]

log = logging.getLogger(__name__)

Obj = dict[str, Any]

GPU_RESOURCE = "nvidia.com/gpu"
LENT_LABEL = "lowtide.io/lent-gpus"
LENT_TAINT_KEY = "lowtide.io/lent"
LENT_TAINT_EFFECT = "PreferNoSchedule"
_MERGE_PATCH = "application/merge-patch+json"
_FILTER_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
_TERMINAL = frozenset({"Succeeded", "Failed"})
_MAX_HOLDERS_NAMED = 6


class NodeBusy(ExecutorError):
    """A research pod does not fit its node now: temporary, like resources exhausted (the loop
    tries again after a backoff, no retry used), and no infrastructure alert: a node busy with
    others' pods is the cluster's normal life, not lowtide's machinery failing."""

    def __init__(self, message: str) -> None:
        super().__init__(message, temporary=True)


def lent_taint(effect: str = LENT_TAINT_EFFECT) -> dict[str, str]:
    """lowtide's taint on a node it lends GPUs on: the only place one is built. Anything but
    PreferNoSchedule is refused; NoExecute above all (it evicts pods without lowtide's notice)."""
    if effect == "NoExecute":
        raise ValueError("lowtide never taints a node NoExecute: it would evict pods without notice")
    if effect != LENT_TAINT_EFFECT:
        raise ValueError(
            f"lowtide's taint is {LENT_TAINT_EFFECT} only (NoSchedule would take the node out of "
            f"the scheduler's preemption candidates), not {effect!r}"
        )
    return {"key": LENT_TAINT_KEY, "value": "true", "effect": effect}


# -- pure readings ------------------------------------------------------------------------------


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _quantity(value: Any) -> int:
    """A whole-device quantity ("2", 2); an unreadable one counts as 0 (the API validates them)."""
    try:
        amount = parse_quantity(value)
    except (ValueError, TypeError, InvalidOperation):
        return 0
    return int(amount.to_integral_value(rounding="ROUND_CEILING")) if isinstance(amount, Decimal) else 0


def _container_gpus(container: Mapping[str, Any]) -> int:
    resources = _map(container.get("resources"))
    requests, limits = _map(resources.get("requests")), _map(resources.get("limits"))
    if GPU_RESOURCE in requests:
        return _quantity(requests[GPU_RESOURCE])
    return _quantity(limits[GPU_RESOURCE]) if GPU_RESOURCE in limits else 0


def pod_gpus(pod: Mapping[str, Any]) -> int:
    """The pod's effective `nvidia.com/gpu` request, as the scheduler counts it (module docstring)."""
    spec = _map(pod.get("spec"))
    total = sum(_container_gpus(_map(c)) for c in spec.get("containers") or ())
    sidecars = 0
    init_peak = 0
    for raw in spec.get("initContainers") or ():
        c = _map(raw)
        own = _container_gpus(c)
        if c.get("restartPolicy") == "Always":  # a sidecar: runs beside the containers
            total += own
            sidecars += own
            init_peak = max(init_peak, sidecars)
        else:
            init_peak = max(init_peak, own + sidecars)
    return max(total, init_peak)


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """Kubernetes' `Toleration.ToleratesTaint` (module docstring)."""
    effect, key = toleration.get("effect") or "", toleration.get("key") or ""
    if effect and effect != taint.get("effect"):
        return False
    if key and key != taint.get("key"):
        return False
    op = toleration.get("operator") or "Equal"
    if op == "Equal":
        return (toleration.get("value") or "") == (taint.get("value") or "")
    if op == "Exists":
        return True
    if op in ("Lt", "Gt"):
        try:
            mine, theirs = int(str(toleration.get("value"))), int(str(taint.get("value")))
        except ValueError:
            return False
        return theirs < mine if op == "Lt" else theirs > mine
    return False


def node_refusal(node: Mapping[str, Any], tolerations: Iterable[Mapping[str, Any]]) -> str | None:
    """Why the scheduler would not put a pod with `tolerations` on `node` whatever its GPUs (not
    Ready, cordoned, a NoSchedule/NoExecute taint it does not tolerate); None when nothing does."""
    status, spec = _map(node.get("status")), _map(node.get("spec"))
    ready = next((_map(c) for c in status.get("conditions") or () if _map(c).get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        why = f": {ready.get('reason')}" if ready and ready.get("reason") else ""
        state = ready.get("status") if ready else "unknown"
        return f"is not Ready (Ready={state}{why})"
    if spec.get("unschedulable"):
        return "is cordoned (spec.unschedulable)"
    tols = [_map(t) for t in tolerations]
    for raw in spec.get("taints") or ():
        taint = _map(raw)
        if taint.get("effect") in _FILTER_EFFECTS and not any(tolerates(t, taint) for t in tols):
            value = f"={taint.get('value')}" if taint.get("value") else ""
            name = f"{taint.get('key')}{value}:{taint.get('effect')}"
            return f"has the taint {name}, which the step's pod does not tolerate"
    return None


def allocatable_gpus(node: Mapping[str, Any]) -> int:
    """`status.allocatable["nvidia.com/gpu"]` (0 when the node advertises none)."""
    allocatable = _map(_map(node.get("status")).get("allocatable"))
    return _quantity(allocatable[GPU_RESOURCE]) if GPU_RESOURCE in allocatable else 0


def _pinned_node(pod: Mapping[str, Any]) -> str | None:
    """The node lowtide admitted the pod to (its hostname nodeSelector), None when not admitted."""
    if pods.is_gated(pod):
        return None
    node = _map(_map(pod.get("spec")).get("nodeSelector")).get(pods.HOSTNAME_LABEL)
    return node if isinstance(node, str) and node else None


def _unfinished(pod: Mapping[str, Any]) -> bool:
    return pods.pod_phase(pod) not in _TERMINAL


def lent_by_node(own_pods: Iterable[Mapping[str, Any]], nodes: Iterable[str]) -> dict[str, int]:
    """GPUs of lowtide's admitted, unfinished research pods per configured node (pods being
    deleted still count: they hold their devices until they are gone)."""
    lent = dict.fromkeys(nodes, 0)
    for pod in own_pods:
        node = _pinned_node(pod)
        if node in lent and _unfinished(pod):
            lent[node] += pod_gpus(pod)
    return lent


def node_write(node: Mapping[str, Any], lent: int) -> Obj | None:
    """The merge patch that gives `node` lowtide's label and taint for `lent` GPUs, carrying the
    resourceVersion it was computed from; None when the node already says so. Only lowtide's own
    label key and taint key change; every other label and taint is kept as read."""
    meta, spec = _map(node.get("metadata")), _map(node.get("spec"))
    labels = _map(meta.get("labels"))
    taints = [dict(_map(t)) for t in spec.get("taints") or ()]
    want_label = str(lent) if lent > 0 else None
    others = [t for t in taints if t.get("key") != LENT_TAINT_KEY]
    want_taints = [*others, lent_taint()] if lent > 0 else others
    patch: Obj = {}
    if labels.get(LENT_LABEL) != want_label:
        patch["metadata"] = {"labels": {LENT_LABEL: want_label}}
    if taints != want_taints:
        patch["spec"] = {"taints": want_taints or None}
    if not patch:
        return None
    patch.setdefault("metadata", {})["resourceVersion"] = meta.get("resourceVersion")
    return patch


@dataclass(frozen=True)
class _Holder:
    name: str  # namespace/pod
    gpus: int


def _fit_message(node: str, allocatable: int, holders: Sequence[_Holder], need: int) -> str:
    used = sum(h.gpus for h in holders)
    free = max(allocatable - used, 0)
    ranked = sorted(holders, key=lambda h: (-h.gpus, h.name))
    named = [f"{h.name} holds {h.gpus}" for h in ranked[:_MAX_HOLDERS_NAMED]]
    if len(ranked) > _MAX_HOLDERS_NAMED:
        rest = ranked[_MAX_HOLDERS_NAMED:]
        named.append(f"{len(rest)} more pods hold {sum(h.gpus for h in rest)}")
    who = f" ({', '.join(named)})" if named else ""
    return f"node {node}: {free} of {allocatable} GPUs free{who}; the step needs {need}"


# -- the effects ---------------------------------------------------------------------------------


class NodeLending:
    """The fit check and lowtide's label/taint on its configured nodes (module docstring)."""

    def __init__(
        self,
        api_client: Any,
        nodes: Mapping[str, int],
        *,
        request_timeout_s: float = 10.0,
        resync_s: float = 60.0,
        conflict_tries: int = 3,
    ) -> None:
        """`nodes`: lowtide's configured node names and their GPU counts (lowtide.yaml `nodes:`);
        no other node is ever written."""
        self._core = client.CoreV1Api(api_client)
        self._configured = dict(nodes)
        self._timeout = request_timeout_s
        self._resync_s = resync_s
        self._tries = max(1, conflict_tries)
        #: What each configured node's label says, as last written or read (None: unknown).
        self._known: dict[str, int | None] = dict.fromkeys(self._configured)
        self._last_resync: float | None = None
        #: Pods this process admitted (uid -> node, GPUs, ns/name) not yet seen admitted in a list.
        self._held: dict[str, tuple[str, int, str]] = {}
        self._said: dict[str, str] = {}  # node -> the last refusal logged
        self._write_said: dict[str, str] = {}  # node -> the last write failure logged
        self._warned: set[tuple[str, int, int]] = set()

    # -- API calls -------------------------------------------------------------------------------

    @staticmethod
    def _error(exc: BaseException, verb: str, resource: str, where: str) -> ExecutorError:
        if k8s_errors.status_of(exc) == 403:
            return ExecutorError(
                f"{verb} {resource} {where}: forbidden ({k8s_errors.api_message(exc)}); the control "
                f"plane's ClusterRole needs the rule verbs [{verb}] on {resource} cluster-wide "
                "(deploy/helm/lowtide RBAC, the -nodes ClusterRole)",
                temporary=False,
                infrastructure=k8s_errors.INFRASTRUCTURE,
            )
        err = k8s_errors.classify(exc, verb=verb, resource=resource, namespace="-")
        # classify names a namespace; these requests are cluster-scoped or span all namespaces
        text = str(err).replace(f"{verb} {resource} in namespace -", f"{verb} {resource} {where}", 1)
        return ExecutorError(text, temporary=err.temporary, infrastructure=err.infrastructure)

    def _get_node(self, name: str) -> Obj | None:
        """The Node, None when there is none. Raises ExecutorError."""
        try:
            response = self._core.read_node(name, _request_timeout=self._timeout, _preload_content=False)
        except Exception as exc:
            if k8s_errors.status_of(exc) == 404:
                return None
            raise self._error(exc, "get", "nodes", f"(node {name})") from exc
        return response_object(response)

    def _pods_on(self, node: str) -> list[Obj]:
        try:
            response = self._core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={node}", _request_timeout=self._timeout, _preload_content=False
            )
        except Exception as exc:
            raise self._error(exc, "list", "pods", "in all namespaces") from exc
        return [p for p in response_object(response).get("items") or [] if isinstance(p, dict)]

    # -- the fit check and the hold before an admission ----------------------------------------

    def prepare_admission(
        self, node: str, pod: Mapping[str, Any], own_pods: Sequence[Mapping[str, Any]]
    ) -> None:
        """Before the admission patch of gated `pod` to `node`: check it fits (else `NodeBusy`),
        then put lowtide's label and taint on the node counting it. Raises ExecutorError; on
        success the executor must call `release(uid)` if its admission patch then fails."""
        need = pod_gpus(pod)
        if need <= 0:
            return  # holds no device: nothing to check or lend
        uid = str(_map(pod.get("metadata")).get("uid", ""))
        self._check_fit(node, uid, pod, need, own_pods)
        if node not in self._configured:
            return  # never written (placement only uses configured nodes; a guard)
        meta = _map(pod.get("metadata"))
        self._held[uid] = (node, need, f"{meta.get('namespace', '')}/{meta.get('name', '')}")
        try:
            self._write(node, self._lent(own_pods)[node])
        except ExecutorError:
            self._held.pop(uid, None)
            raise

    def release(self, uid: str) -> None:
        """The admission of a pod `prepare_admission` held for did not happen: stop counting it
        (the next reconcile takes the label back down)."""
        self._held.pop(uid, None)

    def _check_fit(
        self, node: str, uid: str, pod: Mapping[str, Any], need: int, own_pods: Sequence[Mapping[str, Any]]
    ) -> None:
        found = self._get_node(node)
        if found is None:
            self._refuse(node, f"node {node}: there is no such Node in the cluster (deleted?)")
        tolerations = [_map(t) for t in _map(pod.get("spec")).get("tolerations") or ()]
        refusal = node_refusal(found, tolerations)
        if refusal is not None:
            self._refuse(node, f"node {node} {refusal}")
        allocatable = allocatable_gpus(found)
        self._warn_config(node, allocatable)
        holders: dict[str, _Holder] = {}
        for other in self._pods_on(node):  # bound to it, any namespace
            self._count(holders, other, uid)
        for mine in own_pods:  # lowtide's own, pinned to it, not bound yet
            if _pinned_node(mine) == node and not _map(mine.get("spec")).get("nodeName"):
                self._count(holders, mine, uid)
        for held_uid, (held_node, gpus, name) in self._held.items():
            if held_node == node and held_uid != uid and held_uid not in holders:
                holders[held_uid] = _Holder(name, gpus)
        if allocatable - sum(h.gpus for h in holders.values()) < need:
            self._refuse(node, _fit_message(node, allocatable, list(holders.values()), need))
        self._said.pop(node, None)

    @staticmethod
    def _count(holders: dict[str, _Holder], pod: Mapping[str, Any], admitting_uid: str) -> None:
        meta = _map(pod.get("metadata"))
        uid = str(meta.get("uid", ""))
        if uid == admitting_uid or uid in holders or not _unfinished(pod):
            return
        gpus = pod_gpus(pod)
        if gpus > 0:
            holders[uid] = _Holder(f"{meta.get('namespace', '')}/{meta.get('name', '')}", gpus)

    def _refuse(self, node: str, message: str) -> NoReturn:
        if self._said.get(node) != message:
            self._said[node] = message
            log.info("admission deferred: %s", message)
        raise NodeBusy(message)

    def _warn_config(self, node: str, allocatable: int) -> None:
        configured = self._configured.get(node)
        if (
            configured is not None
            and configured > allocatable
            and (node, configured, allocatable) not in self._warned
        ):
            self._warned.add((node, configured, allocatable))
            log.warning(
                "node %s: lowtide.yaml declares %s GPUs but the Node's allocatable nvidia.com/gpu is %s; "
                "steps placed beyond it wait for the node",
                node,
                configured,
                allocatable,
            )

    # -- label and taint -------------------------------------------------------------------------

    def _lent(self, own_pods: Iterable[Mapping[str, Any]]) -> dict[str, int]:
        """`lent_by_node` plus the pods this process admitted that `own_pods` shows still gated
        (listed before their admission patch); a held pod seen admitted or gone is dropped."""
        listed = list(own_pods)
        lent = lent_by_node(listed, self._configured)
        by_uid = {str(_map(p.get("metadata")).get("uid", "")): p for p in listed}
        for uid, (node, gpus, _name) in list(self._held.items()):
            seen = by_uid.get(uid)
            if seen is None or not pods.is_gated(seen):
                del self._held[uid]  # admitted (the list counts it while unfinished) or gone
            else:
                lent[node] = lent.get(node, 0) + gpus  # listed before its admission patch
        return lent

    def _write(self, node: str, lent: int) -> None:
        """Make `node` say `lent` (read-modify-write, module docstring). Raises ExecutorError."""
        for _ in range(self._tries):
            found = self._get_node(node)
            if found is None:
                self._known[node] = lent  # nothing to label; the next resync looks again
                raise NodeBusy(f"node {node}: there is no such Node in the cluster (deleted?)")
            self._warn_config(node, allocatable_gpus(found))
            body = node_write(found, lent)
            if body is None:
                self._known[node] = lent
                return
            try:
                self._core.patch_node(
                    node,
                    body,
                    _content_type=_MERGE_PATCH,
                    _request_timeout=self._timeout,
                    _preload_content=False,
                )
            except Exception as exc:
                if k8s_errors.status_of(exc) == 409:
                    continue  # changed since it was read: read again, compute again
                raise self._error(exc, "patch", "nodes", f"(node {node})") from exc
            self._known[node] = lent
            log.info("node %s: %s=%s (lowtide's taint %s)", node, LENT_LABEL, lent, "on" if lent else "off")
            return
        raise ExecutorError(
            f"patch nodes (node {node}): {self._tries} writes answered 409 Conflict (the node keeps "
            "changing); will try again",
            temporary=True,
            infrastructure=k8s_errors.INFRASTRUCTURE,
        )

    def needs_pods(self, now: float) -> bool:
        """Whether a poll with no attempt of its own must still list pods for `reconcile`: a label
        may have to come off, or a resync is due."""
        return self._resync_due(now) or any(v != 0 for v in self._known.values())

    def _resync_due(self, now: float) -> bool:
        return self._last_resync is None or now - self._last_resync >= self._resync_s

    def reconcile(self, own_pods: Iterable[Mapping[str, Any]], now: float) -> None:
        """Each poll, from the installation's pod list: write the nodes whose value changed, or
        every configured node when a resync is due. Failures are logged once per change and tried
        again at the next poll; nothing is raised."""
        lent = self._lent(own_pods)
        resync = self._resync_due(now)
        if resync:
            self._last_resync = now
        for node in sorted(self._configured):
            if not resync and self._known.get(node) == lent[node]:
                continue
            try:
                self._write(node, lent[node])
            except ExecutorError as exc:
                if self._write_said.get(node) != str(exc):
                    self._write_said[node] = str(exc)
                    log.warning("node %s: lowtide's label and taint not written: %s", node, exc)
                if not isinstance(exc, NodeBusy):  # (no such node: nothing to write until a resync)
                    self._known[node] = None  # unknown: written again at the next poll
            else:
                self._write_said.pop(node, None)
