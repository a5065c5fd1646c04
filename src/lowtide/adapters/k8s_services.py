"""The Kubernetes service manager: a service's replicas are the pods of one vLLM Deployment that
lowtide scales (docs/cluster.md "Serving on Kubernetes").

Implements `control.inference_ports.ServiceManager` for services configured with
``manager: kubernetes`` (`services[].kubernetes: {namespace, deployment, ...}`); the local
processes of `adapters.local_services` are the other implementation and `adapters.service_routing`
sends each service to its own. The control loop (`control.inference`) decides; this module only
carries out: it keeps the Deployment's ``spec.replicas`` equal to the number of lowtide replica
slots that want a pod, chooses which pod goes on a scale-down, and reports through `poll`.

**Slots and pods.** Pods of one Deployment are interchangeable; lowtide's slots (``<service>/<i>``)
are not. A slot that wants a pod (``start``) counts towards ``spec.replicas``; when a pod is Ready
(its ``Ready`` condition True, a pod IP, and, with ``endpoint_service``, listed ready in that
Service's EndpointSlices) and not claimed, the oldest waiting slot claims it by annotating it
``lowtide.io/replica: <slot id>`` → event ``healthy``. The annotation is how a restarted control
plane finds its replicas again (`adopt`), and how `reap_orphans` finds pods no record knows.
A slot's URL is ``http://<pod IP>:<port>`` of its pod (`url`).

**Scale-down chooses the pod.** `park` (only ``stop``: a sleeping vLLM keeps its GPU allocation in
Kubernetes, so ``park: sleep`` is refused by config validation) gives the slot's pod
``controller.kubernetes.io/pod-deletion-cost: "-2147483648"`` (the lowest int32) and then lowers
``spec.replicas``; the ReplicaSet controller removes it; once the pod object is gone (its
containers stopped, its GPUs free) → ``stopped``. The ReplicaSet's choice (kubernetes
pkg/controller/controller_utils.go `ActivePodsWithRanks.Less`, v1.22+) puts unscheduled,
Pending and not-Ready pods before any deletion cost, so while another slot's pod is still
starting that pod goes instead. Then the parked slot's pod is still there with the count already
met: it is released (annotations removed) into the pool, where the starting slot claims it, and the
parked slot is reported ``stopped`` with a detail saying so. The deletion cost is parsed as an
int32 with no leading ``+`` or zeros (`GetDeletionCostFromPodAnnotations`, same source); it is
best effort in Kubernetes (the controller reads its informer cache).

**The scale write** goes through the ``/scale`` subresource (`AppsV1Api.
read_namespaced_deployment_scale` / `replace_namespaced_deployment_scale`, autoscaling/v1 Scale)
carrying the ``resourceVersion`` just read; a 409 Conflict re-reads and recomputes, up to
`MAX_CONFLICTS` times in one go, then waits for the next poll: never a write without a version.
Before a write the manager looks for a HorizontalPodAutoscaler (autoscaling/v2) or a KEDA
ScaledObject (keda.sh/v1alpha1, `CustomObjectsApi`; a 404 on the list means KEDA is not
installed) whose ``spec.scaleTargetRef`` names the Deployment. With ``on_autoscaler: refuse``
(default) it does not write: waiting slots fail with a message naming the autoscaler, a park
waits (logged) until the autoscaler is gone. With ``steer`` it sets the autoscaler's bounds to the
count instead (HPA ``minReplicas = maxReplicas``, a PUT with its resourceVersion; ScaledObject
``minReplicaCount = maxReplicaCount``, a merge patch carrying its resourceVersion), refusing a
count of 0 (HPA ``minReplicas`` >= 1 unless the alpha HPAScaleToZero gate is on).

**Failures** come from pod status: a container waiting with ``CrashLoopBackOff``,
``ImagePullBackOff``, ``ErrImagePull``, ``InvalidImageName``, ``ErrImageNeverPull`` or
``CreateContainerConfigError`` (kubelet pkg/kubelet/images/types.go and
pkg/kubelet/container), or a ``PodScheduled`` condition False with reason ``Unschedulable``:
an unclaimed pod in such a state fails the oldest waiting slot (``failed``, the reason and the
message in the detail); a claimed pod that restarts, fails or is deleted by someone else fails its
slot. A waiting slot without a Ready pod within ``launch.health_timeout_s`` fails too. A
Deployment that is deleted (404) fails every live slot, and a start while it is missing fails at
once, with ``Deployment <ns>/<name> not found``; never an exception. API errors (5xx, 429, 403,
timeouts, connection refused) are classified (`describe_api_error`) and logged once per change;
nothing is lost: the next poll reads again and writes what is still needed. `kill` (a hung
replica) deletes its pod with a ``uid`` precondition and the pod's own grace period, so the
ReplicaSet makes a fresh one when the loop starts the slot again.

**Reading.** While a Deployment has slots that are not stopped or failed, `poll` re-reads its
scale (one GET of ``/scale``) at most every `refresh_s` (at once after a write of its own) and
takes its pods (the scale's ``status.selector``) and EndpointSlices (label
``kubernetes.io/service-name``) from watch caches (`adapters.k8s_watch.Informer`, one LIST then
one long WATCH each, started on the first read): a steady poll costs one request. A cache that is
not *current* (not synced yet, or its watch failing: RBAC, 5xx, the server away) is "don't know",
never "no pods": the poll then behaves as when a LIST failed (nothing moves, the problem is
logged and shown by `problem`). After its own pod write (claim, release, deletion cost, kill) the
next read waits until the pod cache shows that write's resourceVersion (read-your-writes). The
first read waits for the caches' first LIST and WATCH; both waits are bounded by the request
timeout. A scale write uses the version of that read and reads again only after a conflict.
Every request carries ``_request_timeout``: a slow API server delays a poll by at most that per
request. The generated client (kubernetes
36.0.3, `ApiClient.select_header_content_type`) sends a dict PATCH body as JSON patch (the first
type of the operation's list), so every patch names ``application/merge-patch+json`` explicitly.

**Kubernetes Events** (with `events`, an `adapters.k8s_events.EventRecorder`; docs/cluster.md
"Kubernetes Events"): ``Scaled`` on the Deployment after a scale write, ``AutoscalerConflict``
(Warning) on it while an autoscaler makes lowtide refuse, ``DeploymentMissing`` (Warning) regarding
the missing Deployment by name (no uid: there is no object; not the control plane's pod, whose
namespace the service's Role does not cover), ``Steered`` on each HPA/ScaledObject whose bounds
were changed, ``ReplicaFailed`` (Warning) on the pod whose status failed a slot. Repeats
aggregate into one Event's series (the recorder); emitting never blocks.

Not done here: lowtide's node/GPU choice in a `ReplicaLaunch` is bookkeeping only (the scheduler
places the Deployment's pods); the command, env and port of a launch are not applied (the
Deployment's template defines them).

Must not: decide anything (when to start, park or retry is the loop's), touch the store, read
configuration files, sleep (its only waits are the bounded cache waits above), or raise from
`poll`. Not thread-safe: the loop calls it from one thread (each cache has its own daemon thread,
read through snapshots; `close` stops them).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Literal

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from lowtide.adapters.k8s_events import EventSink, EventType, Regarding
from lowtide.adapters.k8s_watch import Informer, Snapshot
from lowtide.control.inference_ports import ReplicaEvent, ReplicaEventKind, ReplicaLaunch
from lowtide.domain.services import ParkMode

log = logging.getLogger(__name__)

#: The annotation naming the lowtide replica slot a pod serves.
REPLICA_ANNOTATION = "lowtide.io/replica"
#: The ReplicaSet controller removes the pod with the lowest cost first (among Ready pods).
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
#: The lowest int32: the chosen pod goes before any other Ready pod.
CHOSEN_COST = "-2147483648"
#: The label EndpointSlices carry with the name of their Service (discovery.k8s.io/v1).
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
#: 409 Conflicts on one scale write before waiting for the next poll.
MAX_CONFLICTS = 3
MERGE_PATCH = "application/merge-patch+json"

#: Container waiting reasons that mean the pod will not become Ready by itself soon.
FAILING_WAITING_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
    }
)

OnAutoscaler = Literal["refuse", "steer"]


@dataclass(frozen=True, slots=True)
class DeploymentTarget:
    """Where one service's replicas live (`services[].kubernetes`)."""

    service: str
    namespace: str
    deployment: str
    port: int = 8000  # vLLM's default port in the pod
    endpoint_service: str | None = None  # also require the pod ready in this Service's EndpointSlices
    on_autoscaler: OnAutoscaler = "refuse"


class SlotPhase(StrEnum):
    STARTING = "starting"  # counted in spec.replicas; waiting for a Ready pod to claim
    HEALTHY = "healthy"  # has a claimed, Ready pod
    STOPPING = "stopping"  # not counted; its pod (if any) is to go
    STOPPED = "stopped"
    FAILED = "failed"


_WANTS_POD = frozenset({SlotPhase.STARTING, SlotPhase.HEALTHY})
_GONE = frozenset({SlotPhase.STOPPED, SlotPhase.FAILED})


@dataclass(slots=True)
class _Slot:
    launch: ReplicaLaunch
    phase: SlotPhase
    since: float
    pod: str | None = None
    pod_ip: str | None = None
    restarts: int = 0
    note: str = ""  # STOPPING: a note for the stopped event
    detail: str = ""  # STOPPED / FAILED: the detail of the event that said so


@dataclass(frozen=True, slots=True)
class _Pod:
    name: str
    uid: str
    ip: str | None
    node: str | None
    ready: bool
    terminating: bool
    claimed_by: str | None
    cost: str | None
    restarts: int
    failure: str | None  # why it will not become Ready by itself, or None


@dataclass(slots=True)
class _Deployment:
    target: DeploymentTarget
    slots: dict[str, _Slot] = field(default_factory=dict)
    pods: dict[str, _Pod] = field(default_factory=dict)
    replicas: int | None = None  # spec.replicas as last read
    version: str | None = None  # the scale's resourceVersion as last read (None: read again)
    read_at: float | None = None
    dirty: bool = False  # spec.replicas may differ from what the slots want
    missing: str = ""  # why the Deployment could not be found ("" when it was)
    last_error: str = ""
    pod_informer: Informer | None = None  # the pods of the scale's selector
    slice_informer: Informer | None = None  # the EndpointSlices of endpoint_service
    own_write: str = ""  # resourceVersion of our last pod write the pod cache must show
    uid: str = ""  # the Deployment's, from its scale (for its Kubernetes Events)


def describe_api_error(exc: BaseException) -> str:
    """A one-line account of a failed API request, classified by what it means for a retry."""
    if isinstance(exc, ApiException):
        status = exc.status or 0
        reason = exc.reason or ""
        message = _status_message(exc)
        if status == 0:
            return f"API server unreachable: {reason or exc}"
        kind = {
            401: "unauthorized (check the credentials)",
            403: "forbidden (RBAC: see the chart's rules)",
            404: "not found",
            409: "conflict (changed meanwhile)",
            410: "gone (expired)",
            429: "throttled (retry later)",
        }.get(status, "server error (retried at the next poll)" if status >= 500 else "refused")
        return f"HTTP {status} {reason}: {kind}" + (f": {message}" if message else "")
    if isinstance(exc, Urllib3Error | OSError):
        return f"API server unreachable: {type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc}"


def _status_message(exc: ApiException) -> str:
    try:
        body = json.loads(exc.body) if exc.body else {}
    except (TypeError, ValueError):
        return ""
    return str(body.get("message", "")) if isinstance(body, dict) else ""


class KubernetesServiceManager:
    """Replicas as pods of one Deployment per service; see the module docstring."""

    def __init__(
        self,
        api_client: client.ApiClient,
        targets: Iterable[DeploymentTarget],
        *,
        request_timeout_s: float = 5.0,
        refresh_s: float = 1.0,
        watch_timeout_s: float = 300.0,
        watch_backoff_s: tuple[float, float] = (0.8, 30.0),
        events: EventSink | None = None,
    ) -> None:
        """`events`: where Kubernetes Events go (`adapters.k8s_events`; None: none)."""
        if request_timeout_s <= 0 or refresh_s < 0:
            raise ValueError("request_timeout_s must be > 0 and refresh_s >= 0")
        self.watch_timeout_s = watch_timeout_s
        self.watch_backoff_s = watch_backoff_s
        self._api = api_client
        self._apps = client.AppsV1Api(api_client)
        self._core = client.CoreV1Api(api_client)
        self._hpa = client.AutoscalingV2Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)
        self._discovery = client.DiscoveryV1Api(api_client)
        self.request_timeout_s = request_timeout_s
        self.refresh_s = refresh_s
        self._deps: dict[str, _Deployment] = {}
        for t in targets:
            if t.service in self._deps:
                raise ValueError(f"service {t.service!r} given twice")
            self._deps[t.service] = _Deployment(t)
        self._events: list[ReplicaEvent] = []
        self._k8s_events = events
        self._closed = False

    # -- the port -------------------------------------------------------------------------------

    def start(self, launch: ReplicaLaunch, now: float) -> None:
        """The slot wants a pod: counted in spec.replicas from now; `poll` reports `healthy`
        once it has claimed a Ready pod (a pod it already had, when it is still there)."""
        dep = self._dep(launch.service)
        old = dep.slots.get(launch.replica_id)
        if old is not None and old.phase in _WANTS_POD:
            return
        slot = _Slot(launch=launch, phase=SlotPhase.STARTING, since=now)
        if old is not None and old.pod is not None and old.phase == SlotPhase.STOPPING:
            slot.pod = old.pod  # parked and started again before its pod went: keep it
        dep.slots[launch.replica_id] = slot
        dep.dirty = True
        self._sync(dep, now)

    def park(self, replica_id: str, mode: ParkMode, now: float) -> None:
        """Stop the slot's pod (scale-down choosing it); `poll` reports `stopped` when it is gone.
        A `sleep` is carried out as a stop (a sleeping vLLM pod keeps its GPUs), said in the event."""
        dep, slot = self._slot(replica_id)
        if slot.phase in _GONE:  # parked again: say again how it ended
            self._emit(
                replica_id, "stopped" if slot.phase == SlotPhase.STOPPED else "failed", now, slot.detail
            )
            return
        if slot.phase == SlotPhase.STOPPING:
            return
        slot.phase = SlotPhase.STOPPING
        slot.since = now
        slot.note = (
            "park 'sleep' carried out as a stop: in Kubernetes a sleeping vLLM pod keeps its GPUs"
            if mode == "sleep"
            else ""
        )
        dep.dirty = True
        self._sync(dep, now)

    def unpark(self, replica_id: str, now: float) -> None:
        """Start a stopped slot again (there is no sleeping replica in Kubernetes)."""
        _, slot = self._slot(replica_id)
        self.start(slot.launch, now)

    def poll(self, now: float) -> list[ReplicaEvent]:
        for dep in self._deps.values():
            due = dep.read_at is None or now - dep.read_at >= self.refresh_s
            if due and (dep.dirty or any(s.phase not in _GONE for s in dep.slots.values())):
                try:
                    self._sync(dep, now)
                except Exception:  # a bug here must not stop the loop; say so loudly
                    log.exception(
                        "service %s: reconciling Deployment %s failed", dep.target.service, _where(dep)
                    )
            self._deadlines(dep, now)
        events, self._events = self._events, []
        return events

    def url(self, replica_id: str) -> str | None:
        dep = self._deps.get(replica_id.rsplit("/", 1)[0])
        slot = None if dep is None else dep.slots.get(replica_id)
        if dep is None or slot is None or slot.pod_ip is None:
            return None
        if slot.phase not in (SlotPhase.HEALTHY, SlotPhase.STOPPING):
            return None
        return f"http://{_host(slot.pod_ip)}:{dep.target.port}"

    def adopt(self, replica_id: str, launch: ReplicaLaunch, now: float) -> bool:
        """Find the pod annotated for this slot: True (`poll` reports `healthy` once it is
        Ready), or False when there is none (or the API server cannot say)."""
        if launch.replica_id != replica_id:
            raise ValueError(f"launch is for {launch.replica_id!r}, not {replica_id!r}")
        dep = self._dep(launch.service)
        known = dep.slots.get(replica_id)
        if known is not None and known.phase in _WANTS_POD:
            return True
        if not self._refresh(dep, now):
            log.warning("replica %s: cannot adopt: %s", replica_id, dep.missing or dep.last_error)
            return False
        pod = next(
            (p for p in dep.pods.values() if p.claimed_by == replica_id and not p.terminating),
            None,
        )
        if pod is None:
            log.info("replica %s: no pod of %s carries it; nothing to adopt", replica_id, _where(dep))
            return False
        dep.slots[replica_id] = _Slot(launch=launch, phase=SlotPhase.STARTING, since=now, pod=pod.name)
        dep.dirty = True
        log.info("replica %s: adopted pod %s", replica_id, pod.name)
        return True

    def reap_orphans(self, known_ids: set[str]) -> list[str]:
        """Release the pods claimed for slots no record knows (their annotation removed, the
        lowest deletion cost set), so the next scale write removes them first."""
        found: list[str] = []
        for dep in self._deps.values():
            if dep.read_at is None and not self._refresh(dep, 0.0):
                continue
            for pod in list(dep.pods.values()):
                rid = pod.claimed_by
                if rid is None or rid in known_ids or rid in dep.slots or pod.terminating:
                    continue
                if self._patch_pod(dep, pod.name, {REPLICA_ANNOTATION: None, DELETION_COST: CHOSEN_COST}):
                    found.append(rid)
                    dep.dirty = True
        return sorted(found)

    def kill(self, replica_id: str, now: float, reason: str) -> None:
        """A hung replica: delete its pod (uid precondition, the pod's own grace period) so the
        ReplicaSet makes a fresh one; `poll` reports `failed` with `reason`."""
        dep, slot = self._slot(replica_id)
        pod = dep.pods.get(slot.pod) if slot.pod is not None else None
        if pod is not None and not pod.terminating:
            t = dep.target
            try:
                deleted = self._core.delete_namespaced_pod(
                    pod.name,
                    t.namespace,
                    body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=pod.uid)),
                    _request_timeout=self.request_timeout_s,
                )
                _saw_own_write(dep, deleted)
                dep.pods[pod.name] = replace(pod, terminating=True)
            except Exception as exc:
                self._note_error(
                    dep, f"deleting hung pod {t.namespace}/{pod.name}: {describe_api_error(exc)}"
                )
        if slot.phase not in _GONE:
            self._fail(dep, replica_id, slot, now, f"{reason}; pod {slot.pod or '(none)'} deleted")

    def forget(self) -> None:
        """Stop tracking every replica (the pods keep serving; a control plane that lost its
        lease leaves them to the next leader, which adopts them by their annotation). The
        caches keep watching."""
        for dep in self._deps.values():
            dep.slots.clear()
            dep.pods.clear()
            dep.dirty = False
            dep.read_at = None
        self._events.clear()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for dep in self._deps.values():
                for inf in (dep.pod_informer, dep.slice_informer):
                    if inf is not None:
                        inf.close()
            self._api.close()

    def caught_up(
        self, service: str, pods: str | int, endpointslices: str | int | None, timeout_s: float
    ) -> bool:
        """Wait at most `timeout_s` until the service's caches are current and have seen these
        resourceVersions of pods and EndpointSlices (for tests driving simulated controllers);
        True at once for a cache not started yet."""
        dep = self._dep(service)
        deadline = time.monotonic() + timeout_s
        for inf, rv in ((dep.pod_informer, pods), (dep.slice_informer, endpointslices)):
            left = max(0.0, deadline - time.monotonic())
            if inf is not None and str(rv or "0") != "0" and not inf.wait_for(str(rv), left):
                return False
        return True

    # -- diagnostics ------------------------------------------------------------------------------

    def phase(self, replica_id: str) -> SlotPhase | None:
        dep = self._deps.get(replica_id.rsplit("/", 1)[0])
        slot = None if dep is None else dep.slots.get(replica_id)
        return None if slot is None else slot.phase

    def pod_of(self, replica_id: str) -> str | None:
        dep = self._deps.get(replica_id.rsplit("/", 1)[0])
        slot = None if dep is None else dep.slots.get(replica_id)
        return None if slot is None else slot.pod

    def problem(self, service: str) -> str:
        """What is wrong with the service's Deployment now ("" when nothing is known to be)."""
        dep = self._dep(service)
        return dep.missing or dep.last_error

    # -- reading ----------------------------------------------------------------------------------

    def _refresh(self, dep: _Deployment, now: float) -> bool:
        """Read the scale, the pods and the EndpointSlices; False when that failed."""
        t = dep.target
        timeout = self.request_timeout_s
        try:
            scale = self._apps.read_namespaced_deployment_scale(
                t.deployment, t.namespace, _request_timeout=timeout
            )
            selector = (scale.status.selector if scale.status is not None else None) or ""
            if not selector:
                raise _Trouble(f"Deployment {_where(dep)} has no selector in its scale status")
            pods = self._cached(dep, self._pod_informer(dep, selector), dep.own_write)
            ready_ips: set[str] | None = None
            if t.endpoint_service:
                slices = self._cached(dep, self._slice_informer(dep, t.endpoint_service), "")
                ready_ips = _ready_endpoints(slices.items.values())
        except ApiException as exc:
            if exc.status == 404:
                self._note_missing(dep, f"Deployment {_where(dep)} not found (deleted?)", now)
            else:
                self._note_error(dep, f"reading Deployment {_where(dep)}: {describe_api_error(exc)}")
            return False
        except _Trouble as exc:
            self._note_error(dep, str(exc))
            return False
        except Exception as exc:  # connection refused, timeouts
            self._note_error(dep, f"reading Deployment {_where(dep)}: {describe_api_error(exc)}")
            return False
        if dep.missing:
            log.warning("service %s: Deployment %s is there again", t.service, _where(dep))
        dep.missing = ""
        self._clear_error(dep)
        dep.replicas = int(scale.spec.replicas or 0) if scale.spec is not None else 0
        dep.version = scale.metadata.resource_version if scale.metadata is not None else None
        dep.uid = (scale.metadata.uid if scale.metadata is not None else None) or dep.uid
        dep.pods = {p.name: p for p in (_pod(item, ready_ips) for item in pods.items.values())}
        dep.own_write = ""
        dep.read_at = now
        return True

    def _cached(self, dep: _Deployment, inf: Informer, own_write: str) -> Snapshot:
        """The informer's snapshot, when it can be trusted now; else `_Trouble` saying why (the
        poll then behaves as when a LIST failed). Waits, bounded by the request timeout, for the
        first LIST and WATCH, and for our own last write to show."""
        bound = self.request_timeout_s
        if not inf.snapshot().synced:
            inf.wait_current(bound, or_failure=True)
        snap = inf.snapshot()
        if not snap.current:
            raise _Trouble(f"reading Deployment {_where(dep)}: {snap.problem}")
        if own_write and not inf.wait_for(own_write, bound):
            snap = inf.snapshot()
            raise _Trouble(
                f"reading Deployment {_where(dep)}: the cache of {inf.what} has not shown lowtide's own "
                f"write (resourceVersion {own_write}) within {bound:g}s"
                + (f": {snap.problem}" if snap.problem else "")
            )
        return inf.snapshot()

    def _pod_informer(self, dep: _Deployment, selector: str) -> Informer:
        inf = dep.pod_informer
        if inf is not None and inf.label_selector == selector:
            return inf
        if inf is not None:  # the Deployment was replaced by one with another selector
            inf.close()
        t = dep.target
        what = f"pods {selector} in {t.namespace}"
        dep.pod_informer = inf = self._informer(
            self._core.list_namespaced_pod, "V1Pod", t.namespace, selector, what
        )
        return inf

    def _slice_informer(self, dep: _Deployment, service: str) -> Informer:
        if dep.slice_informer is None:
            t = dep.target
            dep.slice_informer = self._informer(
                self._discovery.list_namespaced_endpoint_slice,
                "V1EndpointSlice",
                t.namespace,
                f"{SERVICE_NAME_LABEL}={service}",
                f"endpointslices of Service {t.namespace}/{service}",
            )
        return dep.slice_informer

    def _informer(
        self, call: Callable[..., Any], item_type: str, namespace: str, selector: str, what: str
    ) -> Informer:
        return Informer(
            self._api,
            call,
            item_type,
            namespace,
            label_selector=selector,
            what=what,
            request_timeout_s=self.request_timeout_s,
            watch_timeout_s=self.watch_timeout_s,
            backoff_s=self.watch_backoff_s,
            describe=describe_api_error,
        ).start()

    # -- reconciling ------------------------------------------------------------------------------

    def _sync(self, dep: _Deployment, now: float) -> None:
        """Read, move the slots on from what the pods say, then write spec.replicas if needed."""
        if not self._refresh(dep, now):
            return
        self._watch_slots(dep, now)
        if dep.dirty or dep.replicas != self._wanted(dep):
            self._scale(dep, now)
            self._watch_slots(dep, now)

    def _wanted(self, dep: _Deployment) -> int:
        return sum(1 for s in dep.slots.values() if s.phase in _WANTS_POD)

    def _watch_slots(self, dep: _Deployment, now: float) -> None:
        pods = dep.pods
        live = [p for p in pods.values() if not p.terminating]
        # Claimed pods first: healthy slots whose pod went, stopping slots whose pod went or stayed.
        for rid, slot in dep.slots.items():
            pod = pods.get(slot.pod) if slot.pod is not None else None
            if slot.phase == SlotPhase.HEALTHY:
                why = _lost(slot, pod)
                if why:
                    self._fail(dep, rid, slot, now, why)
            elif slot.phase == SlotPhase.STOPPING:
                if pod is None:
                    detail = f"pod {slot.pod} gone" if slot.pod else "no pod was running for it"
                    self._stopped(rid, slot, now, detail)
                elif (
                    not pod.terminating
                    and not dep.dirty
                    and dep.replicas == self._wanted(dep)
                    and len(live) <= dep.replicas
                    # The ReplicaSet removed another pod (a not-Ready one goes first): this one stays.
                    and self._patch_pod(dep, pod.name, {REPLICA_ANNOTATION: None, DELETION_COST: None})
                ):
                    self._stopped(
                        rid,
                        slot,
                        now,
                        f"pod {pod.name} was kept by the ReplicaSet (it removed a pod that was not "
                        "Ready yet) and returned to the pool",
                    )
        # Waiting slots, oldest first: claim Ready pods, or fail on a failing one.
        claimed = {s.pod for s in dep.slots.values() if s.pod is not None and s.phase in _WANTS_POD}
        waiting = sorted(
            ((rid, s) for rid, s in dep.slots.items() if s.phase == SlotPhase.STARTING),
            key=lambda x: x[1].since,
        )
        free = [p for p in sorted(live, key=lambda p: p.name) if p.name not in claimed and _free(dep, p)]
        free_ready = [p for p in free if p.ready]
        failing = [p for p in free if p.failure and not p.ready]
        for rid, slot in waiting:
            own = pods.get(slot.pod) if slot.pod is not None else None
            if own is not None and not own.terminating and own.ready:
                self._claim(dep, rid, slot, own, now)
                continue
            if own is not None and own.failure and not own.terminating:
                self._fail(dep, rid, slot, now, f"pod {own.name}: {own.failure}")
                continue
            if own is not None:
                slot.pod = None  # its old pod is going: take another
            if free_ready:
                self._claim(dep, rid, slot, free_ready.pop(0), now)
            elif failing:
                bad = failing.pop(0)
                self._fail(dep, rid, slot, now, f"pod {bad.name}: {bad.failure}", culprit=bad)

    def _claim(self, dep: _Deployment, rid: str, slot: _Slot, pod: _Pod, now: float) -> None:
        if (pod.claimed_by != rid or pod.cost is not None) and not self._patch_pod(
            dep, pod.name, {REPLICA_ANNOTATION: rid, DELETION_COST: None}
        ):
            return  # the next poll tries again
        slot.phase = SlotPhase.HEALTHY
        slot.since = now
        slot.pod = pod.name
        slot.pod_ip = pod.ip
        slot.restarts = pod.restarts
        dep.pods[pod.name] = replace(pod, claimed_by=rid, cost=None)
        detail = f"pod {pod.name} on node {pod.node or '?'} at {pod.ip}"
        log.info("replica %s: healthy: %s", rid, detail)
        self._emit(rid, "healthy", now, detail)

    def _fail(
        self, dep: _Deployment, rid: str, slot: _Slot, now: float, why: str, culprit: _Pod | None = None
    ) -> None:
        pod = dep.pods.get(slot.pod) if slot.pod is not None else None
        bad = culprit or pod
        if bad is not None:
            ref = Regarding.pod(dep.target.namespace, bad.name, bad.uid)
            self._k8s_event(ref, "Warning", "ReplicaFailed", f"lowtide replica {rid} failed: {why}")
        if pod is not None and not pod.terminating and pod.claimed_by == rid:
            self._patch_pod(dep, pod.name, {REPLICA_ANNOTATION: None})
        slot.phase = SlotPhase.FAILED
        slot.since = now
        slot.pod = None
        slot.pod_ip = None
        slot.detail = why
        dep.dirty = True
        log.warning("replica %s: failed: %s", rid, why)
        self._emit(rid, "failed", now, why)

    def _stopped(self, rid: str, slot: _Slot, now: float, detail: str) -> None:
        if slot.note:
            detail = f"{slot.note}; {detail}"
        slot.phase = SlotPhase.STOPPED
        slot.since = now
        slot.pod = None
        slot.pod_ip = None
        slot.detail = detail
        log.info("replica %s: stopped: %s", rid, detail)
        self._emit(rid, "stopped", now, detail)

    def _deadlines(self, dep: _Deployment, now: float) -> None:
        for rid, slot in dep.slots.items():
            if slot.phase == SlotPhase.STARTING and now - slot.since >= slot.launch.health_timeout_s:
                last = dep.missing or dep.last_error or _pending_story(dep)
                self._fail(
                    dep,
                    rid,
                    slot,
                    now,
                    f"no Ready pod within {slot.launch.health_timeout_s:g}s (last: {last})",
                )

    # -- writing ----------------------------------------------------------------------------------

    def _scale(self, dep: _Deployment, now: float) -> None:
        """Set spec.replicas to the slots that want a pod, through /scale with the version read."""
        t = dep.target
        wanted = self._wanted(dep)
        if dep.replicas is not None and wanted < dep.replicas:
            self._choose_victims(dep)
        refusal = self._autoscalers(dep, wanted)
        if refusal:
            self._refuse(dep, now, refusal)
            return
        for attempt in range(MAX_CONFLICTS + 1):
            try:
                if attempt > 0 or dep.version is None or dep.replicas is None:
                    scale = self._apps.read_namespaced_deployment_scale(
                        t.deployment, t.namespace, _request_timeout=self.request_timeout_s
                    )
                    dep.replicas = int(scale.spec.replicas or 0) if scale.spec is not None else 0
                    dep.version = scale.metadata.resource_version
                wanted = self._wanted(dep)  # recomputed on every try
                current = dep.replicas
                if current == wanted:
                    dep.dirty = False
                    return
                body = client.V1Scale(
                    metadata=client.V1ObjectMeta(
                        name=t.deployment,
                        namespace=t.namespace,
                        resource_version=dep.version,
                    ),
                    spec=client.V1ScaleSpec(replicas=wanted),
                )
                written = self._apps.replace_namespaced_deployment_scale(
                    t.deployment, t.namespace, body, _request_timeout=self.request_timeout_s
                )
            except ApiException as exc:
                dep.version = None  # whatever happened, read before the next write
                if exc.status == 409 and attempt < MAX_CONFLICTS:
                    log.info(
                        "service %s: scale of %s changed meanwhile (409); re-reading", t.service, _where(dep)
                    )
                    continue
                if exc.status == 404:
                    self._note_missing(dep, f"Deployment {_where(dep)} not found (deleted?)", now)
                else:
                    self._note_error(dep, f"scaling Deployment {_where(dep)}: {describe_api_error(exc)}")
                return
            except Exception as exc:
                dep.version = None
                self._note_error(dep, f"scaling Deployment {_where(dep)}: {describe_api_error(exc)}")
                return
            dep.replicas = int(written.spec.replicas or 0) if written.spec is not None else wanted
            dep.version = written.metadata.resource_version if written.metadata is not None else None
            dep.dirty = False
            log.info("service %s: Deployment %s scaled %s → %s", t.service, _where(dep), current, wanted)
            why = f"spec.replicas {current} → {wanted}: the replicas service {t.service} wants now"
            self._k8s_event(Regarding.deployment(t.namespace, t.deployment, dep.uid), "Normal", "Scaled", why)
            dep.read_at = None  # read again at the next poll
            return
        self._note_error(
            dep, f"scaling Deployment {_where(dep)}: {MAX_CONFLICTS} conflicts in a row; next poll"
        )

    def _choose_victims(self, dep: _Deployment) -> None:
        """The lowest deletion cost on the pods that should go: those of stopping slots, then
        Ready pods no waiting or healthy slot holds."""
        keep = {s.pod for s in dep.slots.values() if s.phase in _WANTS_POD and s.pod is not None}
        for slot in dep.slots.values():
            pod = dep.pods.get(slot.pod) if slot.pod is not None else None
            if (
                slot.phase == SlotPhase.STOPPING
                and pod is not None
                and not pod.terminating
                and pod.cost != CHOSEN_COST
                and self._patch_pod(dep, pod.name, {DELETION_COST: CHOSEN_COST})
            ):
                dep.pods[pod.name] = replace(pod, cost=CHOSEN_COST)
        for pod in list(dep.pods.values()):
            if pod.terminating or pod.name in keep or pod.cost == CHOSEN_COST:
                continue
            if _free(dep, pod) and self._patch_pod(dep, pod.name, {DELETION_COST: CHOSEN_COST}):
                dep.pods[pod.name] = replace(pod, cost=CHOSEN_COST)

    def _refuse(self, dep: _Deployment, now: float, why: str) -> None:
        self._note_error(dep, why)
        for rid, slot in dep.slots.items():
            if slot.phase == SlotPhase.STARTING and slot.pod is None:
                self._fail(dep, rid, slot, now, why)
        dep.dirty = True  # a park waits until the autoscaler is gone (or steered)

    def _autoscalers(self, dep: _Deployment, wanted: int) -> str:
        """ "" when lowtide may write spec.replicas (or has steered the autoscalers to `wanted`),
        else why not."""
        t = dep.target
        timeout = self.request_timeout_s
        try:
            hpas = [
                h
                for h in self._hpa.list_namespaced_horizontal_pod_autoscaler(
                    t.namespace, _request_timeout=timeout
                ).items
                or []
                if _targets(h.spec.scale_target_ref.kind, h.spec.scale_target_ref.name, t.deployment)
            ]
            try:
                listed = self._custom.list_namespaced_custom_object(
                    "keda.sh", "v1alpha1", t.namespace, "scaledobjects", _request_timeout=timeout
                )
                scaled = [
                    o
                    for o in listed.get("items", [])
                    if _targets(
                        ((o.get("spec") or {}).get("scaleTargetRef") or {}).get("kind") or "Deployment",
                        ((o.get("spec") or {}).get("scaleTargetRef") or {}).get("name"),
                        t.deployment,
                    )
                ]
            except ApiException as exc:
                if exc.status != 404:  # 404: the KEDA CRD is not installed
                    raise
                scaled = []
        except Exception as exc:
            return f"checking autoscalers of Deployment {_where(dep)}: {describe_api_error(exc)}; not scaling"
        if not hpas and not scaled:
            return ""
        names = [f"HorizontalPodAutoscaler {h.metadata.name}" for h in hpas] + [
            f"KEDA ScaledObject {o['metadata']['name']}" for o in scaled
        ]
        refusal = ""
        if t.on_autoscaler == "refuse":
            refusal = (
                f"Deployment {_where(dep)} is scaled by {', '.join(names)}: lowtide refuses to fight it over "
                "replicas (services[].kubernetes.on_autoscaler: refuse); remove the autoscaler or set "
                "on_autoscaler: steer"
            )
        elif wanted < 1:
            refusal = (
                f"Deployment {_where(dep)} is scaled by {', '.join(names)}: steering it to 0 replicas is "
                "not possible (an HPA's minReplicas is at least 1); not scaling"
            )
        if refusal:
            deployment = Regarding.deployment(t.namespace, t.deployment, dep.uid)
            self._k8s_event(deployment, "Warning", "AutoscalerConflict", refusal)
            return refusal
        try:
            for h in hpas:
                if h.spec.min_replicas != wanted or h.spec.max_replicas != wanted:
                    h.spec.min_replicas = wanted
                    h.spec.max_replicas = wanted
                    self._hpa.replace_namespaced_horizontal_pod_autoscaler(
                        h.metadata.name, t.namespace, h, _request_timeout=timeout
                    )
                    meta = h.metadata
                    ref = Regarding(
                        "HorizontalPodAutoscaler", meta.name, t.namespace, "autoscaling/v2", meta.uid
                    )
                    self._steered(ref, t, wanted)
            for o in scaled:
                spec = o.get("spec") or {}
                if spec.get("minReplicaCount") != wanted or spec.get("maxReplicaCount") != wanted:
                    self._custom.patch_namespaced_custom_object(
                        "keda.sh",
                        "v1alpha1",
                        t.namespace,
                        "scaledobjects",
                        o["metadata"]["name"],
                        {
                            "metadata": {"resourceVersion": o["metadata"]["resourceVersion"]},
                            "spec": {"minReplicaCount": wanted, "maxReplicaCount": wanted},
                        },
                        _content_type=MERGE_PATCH,
                        _request_timeout=timeout,
                    )
                    so_meta = o["metadata"]
                    ref = Regarding(
                        "ScaledObject",
                        so_meta["name"],
                        t.namespace,
                        "keda.sh/v1alpha1",
                        so_meta.get("uid", ""),
                    )
                    self._steered(ref, t, wanted)
        except Exception as exc:
            why = describe_api_error(exc)
            return f"steering {', '.join(names)} to {wanted}: {why}; retried at the next poll"
        log.info("service %s: steered %s to %s replicas", t.service, ", ".join(names), wanted)
        return ""

    def _steered(self, autoscaler: Regarding, t: DeploymentTarget, wanted: int) -> None:
        note = f"bounds set to {wanted}..{wanted} for service {t.service} (on_autoscaler: steer)"
        self._k8s_event(autoscaler, "Normal", "Steered", note)

    def _k8s_event(self, regarding: Regarding, type_: EventType, reason: str, note: str) -> None:
        if self._k8s_events is not None:
            self._k8s_events.emit(regarding, type_, reason, reason, note)

    def _patch_pod(self, dep: _Deployment, name: str, annotations: Mapping[str, str | None]) -> bool:
        """Merge-patch the pod's annotations (None removes one); False when that failed."""
        t = dep.target
        try:
            written = self._core.patch_namespaced_pod(
                name,
                t.namespace,
                {"metadata": {"annotations": dict(annotations)}},
                _content_type=MERGE_PATCH,
                _request_timeout=self.request_timeout_s,
            )
            _saw_own_write(dep, written)
        except Exception as exc:
            if isinstance(exc, ApiException) and exc.status == 404:
                dep.pods.pop(name, None)
            self._note_error(dep, f"annotating pod {t.namespace}/{name}: {describe_api_error(exc)}")
            return False
        return True

    # -- bookkeeping ------------------------------------------------------------------------------

    def _note_missing(self, dep: _Deployment, why: str, now: float) -> None:
        if dep.missing != why:
            log.error("service %s: %s", dep.target.service, why)
        t = dep.target  # regarding the Deployment that is gone (no uid: a new one is another object)
        self._k8s_event(Regarding.deployment(t.namespace, t.deployment), "Warning", "DeploymentMissing", why)
        dep.missing = why
        dep.replicas = None
        dep.pods = {}
        dep.read_at = now
        for rid, slot in dep.slots.items():
            if slot.phase in _WANTS_POD:
                self._fail(dep, rid, slot, now, why)
            elif slot.phase == SlotPhase.STOPPING:
                self._stopped(rid, slot, now, f"{why}: its pods go with it")

    def _note_error(self, dep: _Deployment, why: str) -> None:
        if dep.last_error != why:
            log.warning("service %s: %s", dep.target.service, why)
        dep.last_error = why

    def _clear_error(self, dep: _Deployment) -> None:
        if dep.last_error:
            log.info("service %s: Deployment %s answers again", dep.target.service, _where(dep))
        dep.last_error = ""

    def _dep(self, service: str) -> _Deployment:
        dep = self._deps.get(service)
        if dep is None:
            raise ValueError(f"service {service!r} is not served by a Kubernetes Deployment here")
        return dep

    def _slot(self, replica_id: str) -> tuple[_Deployment, _Slot]:
        dep = self._dep(replica_id.rsplit("/", 1)[0])
        slot = dep.slots.get(replica_id)
        if slot is None:
            raise ValueError(f"replica {replica_id} is not managed here (start or adopt it first)")
        return dep, slot

    def _emit(self, rid: str, kind: ReplicaEventKind, now: float, detail: str = "") -> None:
        self._events.append(ReplicaEvent(rid, kind, now, detail))


class _Trouble(Exception):
    """A Deployment in a shape lowtide cannot work with."""


def _free(dep: _Deployment, pod: _Pod) -> bool:
    """No slot holds the pod: unclaimed, or claimed for a slot that has let it go."""
    slot = dep.slots.get(pod.claimed_by) if pod.claimed_by is not None else None
    return slot is None or (slot.phase in _GONE and slot.pod != pod.name)


def _saw_own_write(dep: _Deployment, written: Any) -> None:
    """Remember the version of our own pod write, for the next read to wait for."""
    meta = getattr(written, "metadata", None)
    rv = getattr(meta, "resource_version", None) if meta is not None else None
    if isinstance(rv, str) and rv:
        dep.own_write = rv


def _where(dep: _Deployment) -> str:
    return f"{dep.target.namespace}/{dep.target.deployment}"


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _targets(kind: str | None, name: str | None, deployment: str) -> bool:
    return kind == "Deployment" and name == deployment


def _ready_endpoints(slices: Iterable[Any]) -> set[str]:
    """Addresses listed ready in the slices (`conditions.ready` nil counts as ready, as the
    EndpointSlice API documents for consumers)."""
    out: set[str] = set()
    for s in slices:
        for ep in s.endpoints or []:
            ready = ep.conditions.ready if ep.conditions is not None else None
            if ready is None or ready:
                out.update(ep.addresses or [])
    return out


def _pod(item: Any, ready_ips: set[str] | None) -> _Pod:
    meta = item.metadata
    status = item.status
    annotations = meta.annotations or {}
    conditions = (status.conditions or []) if status is not None else []
    ip = status.pod_ip if status is not None else None
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions) and bool(ip)
    if ready and ready_ips is not None:
        ready = ip in ready_ips
    restarts = 0
    failure: str | None = None
    for cs in (status.container_statuses or []) if status is not None else []:
        restarts += int(cs.restart_count or 0)
        waiting = cs.state.waiting if cs.state is not None else None
        if failure is None and waiting is not None and waiting.reason in FAILING_WAITING_REASONS:
            failure = f"container {cs.name} {waiting.reason}" + (
                f": {waiting.message}" if waiting.message else ""
            )
    if failure is None:
        for c in conditions:
            if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
                failure = "Unschedulable" + (f": {c.message}" if c.message else "")
    if failure is None and status is not None and status.phase == "Failed":
        failure = f"pod Failed: {status.reason or ''} {status.message or ''}".rstrip()
    return _Pod(
        name=meta.name,
        uid=meta.uid or "",
        ip=ip,
        node=item.spec.node_name if item.spec is not None else None,
        ready=ready,
        terminating=meta.deletion_timestamp is not None,
        claimed_by=annotations.get(REPLICA_ANNOTATION),
        cost=annotations.get(DELETION_COST),
        restarts=restarts,
        failure=failure,
    )


def _lost(slot: _Slot, pod: _Pod | None) -> str:
    """Why a healthy slot's pod no longer serves it ("" when it still does)."""
    if pod is None:
        return f"pod {slot.pod} is gone (deleted, evicted or its node lost)"
    if pod.terminating:
        return f"pod {pod.name} is being deleted"
    if pod.failure:
        return f"pod {pod.name}: {pod.failure}"
    if pod.restarts > slot.restarts:
        return f"pod {pod.name}: its container restarted ({pod.restarts} restarts)"
    return ""


def _pending_story(dep: _Deployment) -> str:
    pending = [p for p in dep.pods.values() if not p.terminating and not p.ready]
    if not pending:
        return "no pod of the Deployment was waiting"
    return "; ".join(
        f"pod {p.name} not Ready" + (f" ({p.failure})" if p.failure else "") for p in pending[:3]
    )
