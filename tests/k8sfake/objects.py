"""Storage of the fake API server: objects, one global resourceVersion, an event log.

Semantics reproduced (kubernetes commit 000f2605; staging/src/k8s.io/apiserver/pkg/registry/
generic/registry/store.go, staging/.../pkg/registry/rest/{create,update,delete}.go,
pkg/registry/core/pod/strategy.go):
- One cluster-wide, monotonically increasing resourceVersion (etcd's revision), rendered as a
  string; every write bumps it, a no-op update does not write. `metadata.uid`,
  `creationTimestamp`, `generation` (1 on create, +1 when the kind's spec fields change, and
  when graceful deletion starts), `generateName` (+5 chars of apimachinery's rand alphabet).
- Create: 409 AlreadyExists; a body carrying metadata.resourceVersion is refused (etcd3
  store: "resourceVersion should not be set on objects to be created", answered 500).
- Update (PUT): a stale metadata.resourceVersion is 409 Conflict ("the object has been
  modified; ..."); no resourceVersion = unconditional update; a status subresource keeps spec
  and main-resource writes keep status; a missing object is 404 (no create-on-update).
- Update with a body uid that differs: 409 Conflict carrying the storage error text
  ("StorageError: invalid object, Code: 4, Key: /registry/..., AdditionalErrorMsg:
  Precondition failed: UID in precondition: ...", storage/interfaces.go `Preconditions.Check`).
- Delete: `preconditions.uid` / `preconditions.resourceVersion` mismatch is 409 Conflict from
  rest/delete.go `BeforeDelete` ("Operation cannot be fulfilled on Pod "x": the UID in the
  precondition (a) does not match the UID in record (b). ..."; note the Kind, not the
  resource). Pods delete gracefully (pod strategy `CheckGracefulDelete`: grace from the
  options, else spec.terminationGracePeriodSeconds; 0 when the pod is unscheduled or
  finished; negative → 1): phase one is an update setting deletionTimestamp (now + grace),
  deletionGracePeriodSeconds and generation+1; the pod stays until the kubelet (here the
  `finish_pod_deletion` hook, a grace-0 delete with a uid precondition) deletes it. A later
  delete may only shorten the period, and the new deadline counts from the first request
  (deadline - old + new). With period 0 the update is followed at once by the removal, so
  watchers see MODIFIED then DELETED (store.go `updateForGracefulDeletionAndFinalizers`).
  Finalizers keep any object (non-graceful kinds get deletionTimestamp now, grace 0,
  generation+1: `markAsDeleting`) until an update removes the last one
  (`shouldDeleteDuringUpdate`). Pods answer deletes with the object (ReturnDeletedObject);
  other kinds answer a Success Status whose details.kind is the resource, or the object while
  finalizers hold it.
- Writes to built-in kinds drop empty lists and empty label/annotation/nodeSelector maps (Go
  `omitempty`) and normalise metav1.Time / MicroTime fields, so round trips are no-ops.
- A bounded event log (the watch cache window) for watch; older resourceVersions are 410.
Neighbours: `validation` (rules), `patch` (formats), `watch` (subscribers), `server` (HTTP).
Must NOT: parse HTTP or authorize (that is `server` and `rbac`).
"""

from __future__ import annotations

import copy
import secrets
import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from . import validation
from .errors import ApiError, FieldError, already_exists, bad_request, conflict, expired, invalid, not_found
from .selectors import Selector

Obj = dict[str, Any]
Clock = Callable[[], datetime]
# apimachinery/pkg/util/rand: the alphabet generateName suffixes use (no vowels, no 0/1/3).
_ALPHANUMS = "bcdfghjklmnpqrstvwxz2456789"


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    resource: str
    kind: str
    namespaced: bool = True
    status_subresource: bool = False
    scale_subresource: bool = False
    log_subresource: bool = False
    builtin: bool = True
    generation_fields: tuple[str, ...] = ("spec",)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        return f"{self.resource}.{self.group}" if self.group else self.resource


KINDS: tuple[Kind, ...] = (
    Kind("", "v1", "pods", "Pod", status_subresource=True, log_subresource=True),
    Kind("", "v1", "nodes", "Node", namespaced=False, status_subresource=True, generation_fields=()),
    Kind("", "v1", "events", "Event", generation_fields=()),
    # events.k8s.io/v1 (what lowtide's recorder writes): stored apart from core/v1 events here,
    # although the real server serves both from one storage (see the package docstring).
    Kind("events.k8s.io", "v1", "events", "Event", generation_fields=()),
    Kind("", "v1", "secrets", "Secret", generation_fields=()),
    Kind("apps", "v1", "deployments", "Deployment", status_subresource=True, scale_subresource=True),
    Kind(
        "autoscaling",
        "v2",
        "horizontalpodautoscalers",
        "HorizontalPodAutoscaler",
        status_subresource=True,
        generation_fields=(),
    ),
    Kind(
        "discovery.k8s.io",
        "v1",
        "endpointslices",
        "EndpointSlice",
        generation_fields=("endpoints", "ports", "addressType"),
    ),
    Kind("coordination.k8s.io", "v1", "leases", "Lease", generation_fields=()),
    # CRDs: argoproj.io's Workflow CRD declares `subresources: {}` (no status subresource), so
    # every non-metadata change bumps generation; KEDA's ScaledObject has a status subresource.
    Kind(
        "argoproj.io",
        "v1alpha1",
        "workflows",
        "Workflow",
        builtin=False,
        generation_fields=("spec", "status"),
    ),
    Kind("keda.sh", "v1alpha1", "scaledobjects", "ScaledObject", status_subresource=True, builtin=False),
)
BY_KEY = {k.key: k for k in KINDS}


def kind_for(resource: str) -> Kind:
    """ "pods", "deployments.apps" or "deployments" (unique plural) → the Kind."""
    if resource in BY_KEY:
        return BY_KEY[resource]
    matches = [k for k in KINDS if k.resource == resource]
    if len(matches) != 1:
        raise KeyError(f"unknown resource {resource!r}; known: {sorted(BY_KEY)}")
    return matches[0]


@dataclass(frozen=True)
class Event:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    kind: Kind
    namespace: str
    obj: Obj
    prev: Obj | None


Listener = Callable[[Event], None]


@dataclass
class _Watcher:
    kind: Kind
    namespace: str
    listener: Listener


def _ts(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_ts(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def _meta(obj: Obj) -> Obj:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        meta = {}
        obj["metadata"] = meta
    return meta


# metav1.Time fields serialize as RFC 3339 seconds, metav1.MicroTime with 6 fraction digits
# (apimachinery/pkg/apis/meta/v1/time.go, micro_time.go): what the client sends ("+00:00",
# any precision) comes back normalised, so a read-modify-write round trip is a no-op.
_TIME_FIELDS = frozenset(
    {
        "creationTimestamp",
        "deletionTimestamp",
        "lastTransitionTime",
        "lastProbeTime",
        "lastUpdateTime",
        "lastHeartbeatTime",
        "startTime",
        "startedAt",
        "finishedAt",
        "lastScaleTime",
        "firstTimestamp",
        "lastTimestamp",
    }
)
_MICRO_TIME_FIELDS = frozenset({"acquireTime", "renewTime", "eventTime", "lastObservedTime"})


def _normalize_times(value: Any, where: str = "") -> Any:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            path = f"{where}.{key}" if where else key
            if isinstance(item, str) and (key in _TIME_FIELDS or key in _MICRO_TIME_FIELDS):
                try:
                    moment = datetime.fromisoformat(item)
                except ValueError as exc:
                    raise bad_request(
                        f'{path}: parsing time "{item}" as "2006-01-02T15:04:05Z07:00": cannot parse'
                    ) from exc
                if moment.tzinfo is None:
                    moment = moment.replace(tzinfo=UTC)
                moment = moment.astimezone(UTC)
                fmt = "%Y-%m-%dT%H:%M:%S.%fZ" if key in _MICRO_TIME_FIELDS else "%Y-%m-%dT%H:%M:%SZ"
                out[key] = moment.strftime(fmt)
            else:
                out[key] = _normalize_times(item, path)
        return out
    if isinstance(value, list):
        return [_normalize_times(v, where) for v in value]
    return value


_OMITEMPTY_MAPS = frozenset({"labels", "annotations", "nodeSelector"})


def _omit_empty(value: Any) -> Any:
    """Go's `omitempty` on typed objects: empty slices and the empty string maps vanish when
    a built-in object is encoded (custom resources are unstructured and keep them)."""
    if isinstance(value, dict):
        out = {}
        for k, item in value.items():
            cleaned = _omit_empty(item)
            if isinstance(cleaned, list) and not cleaned:
                continue
            if k in _OMITEMPTY_MAPS and isinstance(cleaned, dict) and not cleaned:
                continue
            out[k] = cleaned
        return out
    if isinstance(value, list):
        return [_omit_empty(v) for v in value]
    return value


def _system_meta_keys() -> tuple[str, ...]:
    return ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation")


class Store:
    """All objects of the fake cluster. Thread-safe; every method deep-copies in and out."""

    def __init__(self, clock: Clock | None = None, window: int = 1000) -> None:
        self._clock: Clock = clock or (lambda: datetime.now(UTC))
        self._lock = threading.RLock()
        self._rv = 100  # a fresh cluster has history; "0" means "any version" to the API
        self._objects: dict[tuple[str, str, str], Obj] = {}
        self._events: deque[Event] = deque()
        self._window = window
        self._horizon = 0  # highest resourceVersion no longer in the event log
        self._watchers: list[_Watcher] = []
        #: (namespace, pod uid, container) -> its log (`FakeCluster.set_pod_log`).
        self.logs: dict[tuple[str, str, str], str] = {}

    # ---------------------------------------------------------------- basics

    @property
    def resource_version(self) -> int:
        with self._lock:
            return self._rv

    def now(self) -> datetime:
        return self._clock()

    def _get(self, kind: Kind, ns: str, name: str) -> Obj:
        obj = self._objects.get((kind.key, ns if kind.namespaced else "", name))
        if obj is None:
            raise not_found(kind.resource, kind.group, name)
        return obj

    def get(self, kind: Kind, ns: str, name: str) -> Obj:
        with self._lock:
            return copy.deepcopy(self._get(kind, ns, name))

    def _emit(self, type_: str, kind: Kind, ns: str, obj: Obj, prev: Obj | None) -> None:
        event = Event(self._rv, type_, kind, ns, copy.deepcopy(obj), prev)
        self._events.append(event)
        while len(self._events) > self._window:
            self._horizon = self._events.popleft().rv
        for w in list(self._watchers):
            if w.kind == kind and (not w.namespace or w.namespace == ns):
                w.listener(event)

    def _write(self, kind: Kind, ns: str, obj: Obj, type_: str, prev: Obj | None) -> Obj:
        if kind.builtin:
            for part in ("metadata", "spec"):
                if isinstance(obj.get(part), dict):
                    obj[part] = _omit_empty(obj[part])
        self._rv += 1
        _meta(obj)["resourceVersion"] = str(self._rv)
        key = (kind.key, ns if kind.namespaced else "", _meta(obj)["name"])
        if type_ == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = obj
        self._emit(type_, kind, ns if kind.namespaced else "", obj, prev)
        return copy.deepcopy(obj)

    def compact(self) -> None:
        """Drop the whole event log (etcd compaction): every older resourceVersion is now 410."""
        with self._lock:
            if self._events:
                self._horizon = self._events[-1].rv
            self._horizon = max(self._horizon, self._rv)
            self._events.clear()

    # ---------------------------------------------------------------- create

    def create(self, kind: Kind, ns: str, body: Obj) -> Obj:
        obj = copy.deepcopy(body)
        meta = _meta(obj)
        if kind.namespaced:
            if meta.get("namespace") not in (None, "", ns):
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        if meta.get("resourceVersion"):
            raise ApiError(
                500,
                "InternalError",
                "Internal error occurred: resourceVersion should not be set on objects to be created",
            )
        for field_name, expected in (("apiVersion", kind.api_version), ("kind", kind.kind)):
            if obj.get(field_name) not in (None, "", expected):
                # the request decoder refuses an object of another type (message not verified)
                raise bad_request(
                    f"{field_name} {obj.get(field_name)!r} does not match the request's {expected!r}"
                )
        obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
        with self._lock:
            if not meta.get("name"):
                prefix = meta.get("generateName")
                if not prefix:
                    raise invalid(
                        kind.kind,
                        kind.group,
                        "",
                        [FieldError("metadata.name", "Required", "name or generateName is required")],
                    )
                while True:
                    candidate = prefix + "".join(secrets.choice(_ALPHANUMS) for _ in range(5))
                    if (kind.key, ns if kind.namespaced else "", candidate) not in self._objects:
                        break
                meta["name"] = candidate
            name = meta["name"]
            if (kind.key, ns if kind.namespaced else "", name) in self._objects:
                raise already_exists(kind.resource, kind.group, name)
            self._default(kind, obj)
            if kind.builtin:
                obj = _normalize_times(obj)
                meta = obj["metadata"]
            errors = validation.validate_object_meta(obj, check_name=True) + self._validate_create(kind, obj)
            if errors:
                raise invalid(kind.kind, kind.group, name, errors)
            for key in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                meta.pop(key, None)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _ts(self._clock())
            if kind.generation_fields:
                meta["generation"] = 1
            else:
                meta.pop("generation", None)
            return self._write(kind, ns, obj, "ADDED", None)

    @staticmethod
    def _default_spec(kind: Kind, obj: Obj) -> None:
        """The defaults the API applies on every write (decoding a versioned object defaults it)."""
        if kind.key == "pods":
            spec = obj.setdefault("spec", {})
            spec.setdefault("terminationGracePeriodSeconds", 30)
            spec.setdefault("restartPolicy", "Always")
            spec.setdefault("schedulerName", "default-scheduler")
            spec.setdefault("dnsPolicy", "ClusterFirst")
        elif kind.key == "deployments.apps":
            spec = obj.setdefault("spec", {})
            spec.setdefault("replicas", 1)
            spec.setdefault("revisionHistoryLimit", 10)
            spec.setdefault("progressDeadlineSeconds", 600)

    @classmethod
    def _default(cls, kind: Kind, obj: Obj) -> None:
        """Create-time defaults: the spec's, plus a new pod's status (pod strategy PrepareForCreate
        sets phase Pending and, for a gated pod, PodScheduled=False/SchedulingGated)."""
        cls._default_spec(kind, obj)
        if kind.key == "pods":
            status = obj.setdefault("status", {})
            status.setdefault("phase", "Pending")
            if obj["spec"].get("schedulingGates"):
                status.setdefault(
                    "conditions",
                    [
                        {
                            "type": "PodScheduled",
                            "status": "False",
                            "reason": "SchedulingGated",
                            "message": "Scheduling is blocked due to non-empty scheduling gates",
                        }
                    ],
                )
        elif kind.key == "deployments.apps":
            obj.setdefault("status", {})

    @staticmethod
    @staticmethod
    def _validate_create(kind: Kind, obj: Obj) -> list[FieldError]:
        if kind.key == "pods":
            return validation.validate_pod_create(obj)
        if kind.key == "nodes":
            return validation.validate_node(obj)
        if kind.key == "deployments.apps":
            return validation.validate_deployment(obj)
        if kind.key == "leases.coordination.k8s.io":
            return validation.validate_lease(obj)
        if kind.key == "events.events.k8s.io":
            return validation.validate_event_v1_create(obj)
        return []

    # ---------------------------------------------------------------- list

    def _state_at(self, rv: int) -> dict[tuple[str, str, str], Obj]:
        """The objects as they were at `rv`, by undoing the logged events after it."""
        state = dict(self._objects)
        for event in reversed(self._events):
            if event.rv <= rv:
                break
            key = (event.kind.key, event.namespace, event.obj["metadata"]["name"])
            if event.prev is None:
                state.pop(key, None)
            else:
                state[key] = event.prev
        return state

    def list_objects(
        self, kind: Kind, ns: str, selector: Selector, at: int | None = None
    ) -> tuple[list[Obj], int]:
        """Objects of `kind` in `ns` ("" = all) matching `selector`, sorted by namespace/name.

        `at` (resourceVersionMatch=Exact): the state at that revision; 410 when compacted
        away, 504 when in the future (the real server waits, then times out).
        """
        with self._lock:
            if at is None or at == self._rv:
                objects, rv = self._objects, self._rv
            elif at > self._rv:
                raise ApiError(
                    504,
                    "Timeout",
                    f"Too large resource version: {at}, current: {self._rv}",
                    {
                        "causes": [
                            {"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}
                        ],
                        "retryAfterSeconds": 1,
                    },
                )
            elif at < self._horizon:
                raise expired(
                    f"The resourceVersion for the provided list is too old. "
                    f"(requested {at}, oldest {self._horizon})"
                )
            else:
                objects, rv = self._state_at(at), at
            items = [
                copy.deepcopy(obj)
                for (key, obj_ns, _), obj in sorted(objects.items())
                if key == kind.key and (not ns or obj_ns == ns) and selector.matches(obj)
            ]
            return items, rv

    # ---------------------------------------------------------------- update

    def _generation_changed(self, kind: Kind, new: Obj, old: Obj) -> bool:
        return any(new.get(f) != old.get(f) for f in kind.generation_fields)

    def update(
        self, kind: Kind, ns: str, name: str, body: Obj, subresource: str = "", check_rv: bool = True
    ) -> Obj:
        """PUT semantics (and the tail of PATCH, which has checked the version itself)."""
        with self._lock:
            old = self._get(kind, ns, name)
            new = copy.deepcopy(body)
            meta = _meta(new)
            if meta.get("name") not in (None, name):
                raise bad_request(
                    f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})"
                )
            if kind.namespaced and meta.get("namespace") not in (None, "", ns):
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            rv = meta.get("resourceVersion")
            if check_rv and rv not in (None, "") and rv != old["metadata"]["resourceVersion"]:
                raise conflict(kind.resource, kind.group, name)
            uid = meta.get("uid")
            if uid not in (None, "") and uid != old["metadata"]["uid"]:
                raise conflict(
                    kind.resource,
                    kind.group,
                    name,
                    self._precondition_text(
                        kind,
                        ns,
                        name,
                        f"Precondition failed: UID in precondition: {uid}, "
                        f"UID in object meta: {old['metadata']['uid']}",
                    ),
                )
            return self._commit_update(kind, ns, name, old, new, subresource)

    def _commit_update(self, kind: Kind, ns: str, name: str, old: Obj, new: Obj, subresource: str) -> Obj:
        meta = _meta(new)
        new["apiVersion"], new["kind"] = kind.api_version, kind.kind
        meta["name"] = name
        if kind.namespaced:
            meta["namespace"] = ns
        for key in _system_meta_keys():
            if key in old["metadata"]:
                meta[key] = old["metadata"][key]
            else:
                meta.pop(key, None)
        if subresource == "status":
            merged = copy.deepcopy(old)
            merged["status"] = new.get("status")
            for key in ("labels", "annotations"):
                if key in meta:
                    merged["metadata"][key] = meta[key]
                else:
                    merged["metadata"].pop(key, None)
            new = merged
            meta = new["metadata"]
        elif kind.status_subresource:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        if subresource != "status":
            self._default_spec(kind, new)
        if kind.builtin:
            new = _normalize_times(new)
            for part in ("metadata", "spec"):
                if isinstance(new.get(part), dict):
                    new[part] = _omit_empty(new[part])
            meta = new["metadata"]
        errors = (
            validation.validate_object_meta(new, check_name=False)
            + validation.validate_finalizers(new, old)
            + self._validate_update(kind, new, old, subresource)
        )
        if errors:
            raise invalid(kind.kind, kind.group, name, errors)
        if kind.generation_fields and self._generation_changed(kind, new, old):
            meta["generation"] = int(old["metadata"].get("generation", 0)) + 1
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        if new == old:
            return copy.deepcopy(old)
        grace = old["metadata"].get("deletionGracePeriodSeconds")
        if old["metadata"].get("deletionTimestamp") and not meta.get("finalizers") and grace == 0:
            return self._write(kind, ns, new, "DELETED", copy.deepcopy(old))
        return self._write(kind, ns, new, "MODIFIED", copy.deepcopy(old))

    @staticmethod
    def _validate_update(kind: Kind, new: Obj, old: Obj, subresource: str) -> list[FieldError]:
        if kind.key == "pods":
            if subresource == "status":
                return validation.validate_pod_status_update(new, old)
            return validation.validate_pod_update(new, old)
        if kind.key == "nodes":
            return validation.validate_node(new)
        if kind.key == "deployments.apps":
            return validation.validate_deployment(new)
        if kind.key == "leases.coordination.k8s.io":
            return validation.validate_lease(new)
        if kind.key == "events.events.k8s.io":
            return validation.validate_event_v1_update(new, old)
        return []

    def update_checked(
        self, kind: Kind, ns: str, name: str, rv: str | None, change: Callable[[Obj], None]
    ) -> Obj:
        """Read-modify-write under the lock, 409 when `rv` is given and stale (the /scale PUT)."""
        with self._lock:
            old = self._get(kind, ns, name)
            if rv not in (None, "") and rv != old["metadata"]["resourceVersion"]:
                raise conflict(kind.resource, kind.group, name)
            new = copy.deepcopy(old)
            change(new)
            return self._commit_update(kind, ns, name, old, new, "")

    def modify(self, kind: Kind, ns: str, name: str, change: Callable[[Obj], None]) -> Obj:
        """Hook for simulated controllers: change the stored object in place, no validation.

        Bumps resourceVersion and emits MODIFIED like any write (a kubelet writing
        pods/status, Argo's controller writing a Workflow's status).
        """
        with self._lock:
            old = self._get(kind, ns, name)
            new = copy.deepcopy(old)
            change(new)
            if new == old:
                return copy.deepcopy(old)
            if kind.generation_fields and self._generation_changed(kind, new, old):
                new["metadata"]["generation"] = int(old["metadata"].get("generation", 0)) + 1
            return self._write(kind, ns, new, "MODIFIED", copy.deepcopy(old))

    # ---------------------------------------------------------------- delete

    @staticmethod
    def _precondition_text(kind: Kind, ns: str, name: str, text: str) -> str:
        key = f"/registry/{kind.key if kind.group else kind.resource}/" + (
            f"{ns}/{name}" if kind.namespaced else name
        )
        prefix = f"StorageError: invalid object, Code: 4, Key: {key}, ResourceVersion: 0"
        return f"{prefix}, AdditionalErrorMsg: {text}"

    def delete(self, kind: Kind, ns: str, name: str, options: Obj) -> tuple[Obj, bool]:
        """DELETE; returns (the object, whether it is gone now)."""
        with self._lock:
            old = self._get(kind, ns, name)
            meta = old["metadata"]
            pre = options.get("preconditions") or {}
            # rest.BeforeDelete checks preconditions first, naming the Kind (not the resource)
            if pre.get("uid") not in (None, "") and pre["uid"] != meta["uid"]:
                raise conflict(
                    kind.kind,
                    kind.group,
                    name,
                    (
                        f"the UID in the precondition ({pre['uid']}) does not match the UID in record "
                        f"({meta['uid']}). The object might have been deleted and then recreated"
                    ),
                )
            if (
                pre.get("resourceVersion") not in (None, "")
                and pre["resourceVersion"] != meta["resourceVersion"]
            ):
                raise conflict(
                    kind.kind,
                    kind.group,
                    name,
                    (
                        f"the ResourceVersion in the precondition ({pre['resourceVersion']}) does not match "
                        f"the ResourceVersion in record ({meta['resourceVersion']}). "
                        "The object might have been modified"
                    ),
                )
            grace = options.get("gracePeriodSeconds")
            if grace is not None and int(grace) < 0:
                grace = 1  # rest.BeforeDelete: negative means 1s
            now = self._clock()
            new = copy.deepcopy(old)
            nmeta = new["metadata"]
            if meta.get("deletionTimestamp") and kind.key == "pods":
                current = meta.get("deletionGracePeriodSeconds")
                if current:
                    if grace is None or int(grace) >= current:
                        return copy.deepcopy(old), False  # pending: only a shorter period counts
                    started = _parse_ts(meta["deletionTimestamp"]) - timedelta(seconds=current)
                    nmeta["deletionTimestamp"] = _ts(started + timedelta(seconds=int(grace)))
                    nmeta["deletionGracePeriodSeconds"] = int(grace)
                    return self._graceful_write(kind, ns, old, new)
            elif kind.key == "pods":
                # pod strategy CheckGracefulDelete: always graceful, maybe with period 0
                period = (
                    int(grace)
                    if grace is not None
                    else int(old["spec"].get("terminationGracePeriodSeconds") or 0)
                )
                if not old["spec"].get("nodeName") or (old.get("status") or {}).get("phase") in (
                    "Succeeded",
                    "Failed",
                ):
                    period = 0
                nmeta["deletionTimestamp"] = _ts(now + timedelta(seconds=period))
                nmeta["deletionGracePeriodSeconds"] = period
                if int(meta.get("generation", 0)) > 0:
                    nmeta["generation"] = int(meta["generation"]) + 1
                return self._graceful_write(kind, ns, old, new)
            if meta.get("finalizers"):
                if not meta.get("deletionTimestamp"):  # store.go markAsDeleting
                    nmeta["deletionTimestamp"] = _ts(now)
                    nmeta["deletionGracePeriodSeconds"] = 0
                    if int(meta.get("generation", 0)) > 0:
                        nmeta["generation"] = int(meta["generation"]) + 1
                    return self._write(kind, ns, new, "MODIFIED", copy.deepcopy(old)), False
                return copy.deepcopy(old), False
            return self._write(kind, ns, new, "DELETED", copy.deepcopy(old)), True

    def _graceful_write(self, kind: Kind, ns: str, old: Obj, new: Obj) -> tuple[Obj, bool]:
        """Phase one of a graceful delete is an update; with period 0 and no finalizers, phase
        two deletes at once (store.go `updateForGracefulDeletionAndFinalizers`): watchers see
        MODIFIED then DELETED."""
        written = self._write(kind, ns, new, "MODIFIED", copy.deepcopy(old))
        if new["metadata"]["deletionGracePeriodSeconds"] > 0 or new["metadata"].get("finalizers"):
            return written, False
        stored = self._get(kind, ns, new["metadata"]["name"])
        return self._write(kind, ns, copy.deepcopy(stored), "DELETED", copy.deepcopy(stored)), True

    def finish_pod_deletion(self, ns: str, name: str) -> Obj:
        """What the kubelet does once a gracefully deleted pod's containers are gone."""
        kind = BY_KEY["pods"]
        with self._lock:
            old = self._get(kind, ns, name)
            if not old["metadata"].get("deletionTimestamp"):
                raise ValueError(f"pod {ns}/{name} is not being deleted")
            obj, _ = self.delete(
                kind, ns, name, {"gracePeriodSeconds": 0, "preconditions": {"uid": old["metadata"]["uid"]}}
            )
            return obj

    # ---------------------------------------------------------------- watch

    def subscribe(
        self, kind: Kind, ns: str, since: int | None, listener: Listener
    ) -> tuple[list[Event], list[Obj], int]:
        """Register `listener`; returns (logged events after `since`, current objects when
        `since` is None, the current resourceVersion). 410 when `since` is compacted away."""
        with self._lock:
            backlog: list[Event] = []
            current: list[Obj] = []
            if since is None:
                current = [
                    copy.deepcopy(o)
                    for (k, o_ns, _), o in sorted(self._objects.items())
                    if k == kind.key and (not ns or o_ns == ns)
                ]
            else:
                if since < self._horizon:
                    raise expired(f"too old resource version: {since} ({self._horizon + 1})")
                backlog = [
                    e
                    for e in self._events
                    if e.rv > since and e.kind == kind and (not ns or e.namespace == ns)
                ]
            self._watchers.append(_Watcher(kind, ns, listener))
            return backlog, current, self._rv

    def last_write(self, kind: Kind, ns: str) -> int:
        """The resourceVersion of the last logged write to `kind` in `ns` ("" = all), else the
        newest of its objects' (0: none): what a caught-up watcher of that collection has seen."""
        with self._lock:
            for e in reversed(self._events):
                if e.kind == kind and (not ns or e.namespace == ns):
                    return e.rv
            return max(
                (
                    int(o["metadata"]["resourceVersion"])
                    for (k, o_ns, _), o in self._objects.items()
                    if k == kind.key and (not ns or o_ns == ns)
                ),
                default=0,
            )

    def unsubscribe(self, listener: Listener) -> None:
        with self._lock:
            self._watchers = [w for w in self._watchers if w.listener is not listener]

    def watcher_count(self) -> int:
        with self._lock:
            return len(self._watchers)
