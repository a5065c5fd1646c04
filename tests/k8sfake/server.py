"""The fake Kubernetes API server: an ASGI app on uvicorn in a thread, and its `FakeCluster`.

Role: answer the real `kubernetes` client over HTTP the way kube-apiserver does for the
resources in `objects.KINDS` — paths /api/v1/..., /apis/<group>/<version>/..., namespaced and
cluster-scoped, subresources status, scale (autoscaling/v1 Scale over a Deployment, as
pkg/registry/apps/deployment/storage/storage.go `ScaleREST`: a Scale PUT with a stale
metadata.resourceVersion is 409 Conflict on deployments.apps) and log; verbs get, list, watch,
create, update, patch, delete; bearer tokens, RBAC 403s, discovery (/version, /api, /apis) —
kubernetes commit 000f2605, staging/src/k8s.io/apiserver/pkg/endpoints/handlers/*.go.
DeleteOptions come from the request body when it has one, else from the query string
(handlers/delete.go): the client's `grace_period_seconds=` keyword is ignored by a real
server when a `body=V1DeleteOptions(...)` is also sent, and so it is here.
`FakeCluster` also injects faults (status codes, latency, going away and coming back on the
same port with the same state) and offers hooks for simulated controllers (no HTTP).
Neighbours: `objects` (state), `patch`, `watch`, `rbac`, `selectors`.
Must NOT: be imported by src/ (it is test infrastructure).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import uvicorn
from kubernetes import client
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from . import errors as apierr
from .objects import BY_KEY, KINDS, Kind, Store, kind_for
from .patch import APPLY, JSON_PATCH, MERGE, STRATEGIC, json_patch, merge_patch, strategic_merge_patch
from .rbac import MASTERS, Authorizer, forbidden_message
from .selectors import Selector
from .validation import validate_scale
from .watch import WatchStreams

Obj = dict[str, Any]
ADMIN_TOKEN = "fake-admin-token"


#: What the request log records for a request whose client went away before it was handled.
CLIENT_CLOSED_REQUEST = 499


@dataclass
class Fault:
    verb: str  # "get", "list", "watch", "create", "update", "patch", "delete" or "*"
    resource: str  # "pods", "deployments/scale", "workflows" or "*"
    code: int | None
    latency: float
    remaining: int

    def matches(self, verb: str, resource: str, subresource: str) -> bool:
        combined = f"{resource}/{subresource}" if subresource else resource
        return self.verb in ("*", verb) and self.resource in ("*", combined)


@dataclass(frozen=True)
class RequestRecord:
    user: str
    verb: str
    resource: str
    namespace: str
    name: str
    code: int
    #: The API group ("" for core): "events" is served by core/v1 and events.k8s.io/v1.
    group: str = ""


@dataclass
class _Target:
    kind: Kind
    namespace: str
    name: str
    subresource: str


def _not_found_path() -> apierr.ApiError:
    return apierr.ApiError(
        404,
        "NotFound",
        "the server could not find the requested resource",
        {"causes": [{"reason": "UnexpectedServerResponse", "message": "404 page not found"}]},
    )


def _json(request_body: bytes) -> Any:
    try:
        return json.loads(request_body)
    except ValueError as exc:
        raise apierr.bad_request(f"error decoding request body: {exc}") from exc


def _strip_list_item(kind: Kind, obj: Obj) -> Obj:
    if kind.builtin:
        obj = {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
    return obj


def _bool(value: str | None) -> bool:
    return value is not None and value.lower() in ("true", "1")


def _int(value: str | None, name: str) -> int | None:
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise apierr.bad_request(f'invalid value for "{name}": {value!r}') from exc


class FakeApiServer:
    """The ASGI application: routing, auth, faults, and the verbs."""

    def __init__(self, store: Store, auth: Authorizer, bookmark_interval: float) -> None:
        self.store = store
        self.auth = auth
        self.bookmark_interval = bookmark_interval
        self.streams = WatchStreams()
        self.faults: list[Fault] = []
        self.records: list[RequestRecord] = []
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- ASGI entry

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        response = await self.handle(request)
        await response(scope, receive, send)

    async def handle(self, request: Request) -> Response:
        user, verb, target = "", "", None
        try:
            user = self._authenticate(request)
            parts = [p for p in request.url.path.split("/") if p]
            if not parts or parts[0] not in ("api", "apis") or self._is_discovery(parts):
                if parts and parts[0] == "version" and len(parts) == 1:
                    return JSONResponse(self._version())
                return JSONResponse(self._discovery(parts, request))
            target = self._target(parts)
            verb = self._verb(request, target)
            if not self.auth.authorize(
                user,
                verb,
                target.kind.group,
                target.kind.resource,
                target.subresource,
                target.namespace,
                target.name,
            ):
                raise apierr.forbidden(
                    target.kind.resource,
                    target.kind.group,
                    target.name,
                    forbidden_message(
                        user,
                        verb,
                        target.kind.group,
                        target.kind.resource,
                        target.subresource,
                        target.namespace,
                    ),
                )
            fault = self._take_fault(verb, target)
            if fault is not None:
                if fault.latency:
                    await asyncio.sleep(fault.latency)
                if fault.code is not None:
                    if verb == "watch" and fault.code == 410:
                        err = apierr.expired("too old resource version: 1 (2)")
                        return self._record(
                            user,
                            verb,
                            target,
                            Response(
                                json.dumps({"type": "ERROR", "object": err.status()}) + "\n",
                                media_type="application/json",
                            ),
                        )
                    raise apierr.injected(fault.code, target.kind.resource, target.kind.group, target.name)
            response = await self._dispatch(request, verb, target)
        except apierr.ApiError as exc:
            response = JSONResponse(exc.status(), status_code=exc.code, headers=exc.headers)
        except ClientDisconnect:
            # The client gave up (its timeout, during an injected latency) before its body was
            # read: nothing was done. Recorded as 499, "client closed request" (nginx's code).
            response = Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:  # a bug in the fake: answer like an apiserver panic, visibly
            err = apierr.ApiError(
                500, "InternalError", f"Internal error occurred: fake API server bug: {exc!r}"
            )
            response = JSONResponse(err.status(), status_code=500)
        return self._record(user, verb, target, response)

    def _record(self, user: str, verb: str, target: _Target | None, response: Response) -> Response:
        if target is not None:
            with self._lock:
                self.records.append(
                    RequestRecord(
                        user,
                        verb,
                        target.kind.resource + (f"/{target.subresource}" if target.subresource else ""),
                        target.namespace,
                        target.name,
                        response.status_code,
                        target.kind.group,
                    )
                )
        return response

    def _take_fault(self, verb: str, target: _Target) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.remaining > 0 and fault.matches(verb, target.kind.resource, target.subresource):
                    fault.remaining -= 1
                    return fault
        return None

    # ---------------------------------------------------------------- auth, routing

    def _authenticate(self, request: Request) -> str:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        user = self.auth.authenticate(token.strip()) if scheme.lower() == "bearer" else None
        if user is None:
            raise apierr.unauthorized()
        return user

    @staticmethod
    def _is_discovery(parts: list[str]) -> bool:
        return (parts[0] == "api" and len(parts) <= 2) or (parts[0] == "apis" and len(parts) <= 3)

    @staticmethod
    def _target(parts: list[str]) -> _Target:
        if parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        else:
            group, version, rest = parts[1], parts[2], parts[3:]
        namespace = ""
        if rest and rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise _not_found_path()
        matches = [k for k in KINDS if k.group == group and k.version == version and k.resource == rest[0]]
        if not matches:
            raise _not_found_path()
        kind = matches[0]
        if namespace and not kind.namespaced:
            raise _not_found_path()
        name = rest[1] if len(rest) > 1 else ""
        sub = rest[2] if len(rest) > 2 else ""
        if kind.namespaced and name and not namespace:
            raise _not_found_path()
        allowed = {
            "status": kind.status_subresource,
            "scale": kind.scale_subresource,
            "log": kind.log_subresource,
        }
        if sub and not allowed.get(sub):
            raise _not_found_path()
        return _Target(kind, namespace, name, sub)

    @staticmethod
    def _verb(request: Request, target: _Target) -> str:
        method = request.method
        if method == "GET":
            if target.name:
                return "get"
            return "watch" if _bool(request.query_params.get("watch")) else "list"
        if (
            target.subresource == "log"
            or (not target.name and method != "POST")
            or (target.name and method == "POST")
        ):
            raise apierr.method_not_allowed(method, request.url.path)
        return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(
            method
        ) or "unknown"

    # ---------------------------------------------------------------- discovery

    @staticmethod
    def _version() -> Obj:
        return {
            "major": "1",
            "minor": "35",
            "gitVersion": "v1.35.0-lowtide-fake",
            "gitCommit": "000f26050b9be6fb3d79fae95e06b47fc96128cd",
            "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z",
            "goVersion": "go1.25",
            "compiler": "gc",
            "platform": "linux/amd64",
        }

    @staticmethod
    def _discovery(parts: list[str], request: Request) -> Obj:
        if parts == ["api"]:
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": request.url.netloc}
                ],
            }
        if parts == ["apis"]:
            groups: dict[str, list[str]] = {}
            for k in KINDS:
                if k.group and k.version not in groups.setdefault(k.group, []):
                    groups[k.group].append(k.version)
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": g,
                        "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                        "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]},
                    }
                    for g, vs in groups.items()
                ],
            }
        group, version = (
            ("", parts[1]) if parts[0] == "api" else (parts[1], parts[2] if len(parts) > 2 else "")
        )
        kinds = [k for k in KINDS if k.group == group and k.version == version]
        if not kinds:
            raise _not_found_path()
        resources: list[Obj] = []
        verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
        for k in kinds:
            resources.append(
                {
                    "name": k.resource,
                    "singularName": k.kind.lower(),
                    "namespaced": k.namespaced,
                    "kind": k.kind,
                    "verbs": verbs,
                }
            )
            for sub, on, sub_kind, sub_verbs in (
                ("status", k.status_subresource, k.kind, ["get", "patch", "update"]),
                ("scale", k.scale_subresource, "Scale", ["get", "patch", "update"]),
                ("log", k.log_subresource, k.kind, ["get"]),
            ):
                if on:
                    resources.append(
                        {
                            "name": f"{k.resource}/{sub}",
                            "singularName": "",
                            "namespaced": k.namespaced,
                            "kind": sub_kind,
                            "verbs": sub_verbs,
                        }
                    )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources,
        }

    # ---------------------------------------------------------------- verbs

    async def _dispatch(self, request: Request, verb: str, t: _Target) -> Response:
        q = request.query_params
        if verb == "get":
            if t.subresource == "log":
                return self._log(t, q)
            obj = self.store.get(t.kind, t.namespace, t.name)
            return JSONResponse(self._scale(t.kind, obj) if t.subresource == "scale" else obj)
        if verb == "list":
            return JSONResponse(self._list(t, q))
        if verb == "watch":
            return self._watch(t, q)
        if q.get("dryRun"):
            # a real server validates without persisting; the fake would persist, so it refuses
            raise apierr.bad_request("dryRun is not supported by the fake API server (k8sfake)")
        body = await request.body()
        if verb == "create":
            obj = _json(body)
            if not isinstance(obj, dict):
                raise apierr.bad_request("the request body must be a JSON object")
            if not t.kind.builtin and not obj.get("kind"):
                # the CRD handler decodes unstructured JSON, which needs its kind (apiextensions)
                raise apierr.bad_request(f"Object 'Kind' is missing in '{body.decode()}'")
            return JSONResponse(self.store.create(t.kind, t.namespace, obj), status_code=201)
        if verb == "update":
            obj = _json(body)
            if not isinstance(obj, dict):
                raise apierr.bad_request("the request body must be a JSON object")
            if t.subresource == "scale":
                return JSONResponse(self._update_scale(t, obj))
            return JSONResponse(self.store.update(t.kind, t.namespace, t.name, obj, t.subresource))
        if verb == "patch":
            content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
            return JSONResponse(self._patch(t, content_type, body))
        if verb == "delete":
            return self._delete(t, q, body)
        raise apierr.method_not_allowed(request.method, request.url.path)

    def _list(self, t: _Target, q: Any) -> Obj:
        selector = Selector.parse(t.kind.resource, q.get("labelSelector"), q.get("fieldSelector"))
        limit = _int(q.get("limit"), "limit")
        token = q.get("continue")
        at: int | None = None
        start = ""
        if token:
            try:
                decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
                at, start = int(decoded["rv"]), str(decoded["start"])
            except (ValueError, KeyError, TypeError) as exc:
                raise apierr.bad_request(f"continue key is not valid: {exc}") from exc
            try:
                items, rv = self.store.list_objects(t.kind, t.namespace, selector, at)
            except apierr.ApiError as exc:
                if exc.code == 410:
                    raise apierr.expired(
                        "The provided continue parameter is too old to display a consistent list result. "
                        "You can start a new list without the continue parameter, or use the continue "
                        "token in this response to retrieve the remainder of the results."
                    ) from exc
                raise
        else:
            rv_param, match = q.get("resourceVersion"), q.get("resourceVersionMatch")
            if match and not rv_param:
                raise apierr.invalid(
                    "ListOptions",
                    "meta.k8s.io",
                    "",
                    [
                        apierr.FieldError(
                            "resourceVersionMatch",
                            "Forbidden",
                            "resourceVersionMatch is forbidden unless resourceVersion is provided",
                        )
                    ],
                )
            if match == "Exact":
                at = _int(rv_param, "resourceVersion")
            elif rv_param not in (None, "", "0"):
                wanted = _int(rv_param, "resourceVersion") or 0
                if wanted > self.store.resource_version:
                    raise apierr.ApiError(
                        504,
                        "Timeout",
                        f"Too large resource version: {wanted}, current: {self.store.resource_version}",
                        {"retryAfterSeconds": 1},
                    )
            items, rv = self.store.list_objects(t.kind, t.namespace, selector, at)
        if start:
            items = [i for i in items if self._sort_key(i) > start]
        meta: Obj = {"resourceVersion": str(rv)}
        if limit and len(items) > limit:
            rest = len(items) - limit
            items = items[:limit]
            meta["continue"] = base64.urlsafe_b64encode(
                json.dumps({"rv": rv, "start": self._sort_key(items[-1])}).encode()
            ).decode()
            meta["remainingItemCount"] = rest
        return {
            "kind": f"{t.kind.kind}List",
            "apiVersion": t.kind.api_version,
            "metadata": meta,
            "items": [_strip_list_item(t.kind, i) for i in items],
        }

    @staticmethod
    def _sort_key(obj: Obj) -> str:
        meta = obj.get("metadata") or {}
        return f"{meta.get('namespace', '')}/{meta.get('name', '')}"

    def _watch(self, t: _Target, q: Any) -> Response:
        selector = Selector.parse(t.kind.resource, q.get("labelSelector"), q.get("fieldSelector"))
        rv_param = q.get("resourceVersion")
        since = None if rv_param in (None, "", "0") else _int(rv_param, "resourceVersion")
        timeout = _int(q.get("timeoutSeconds"), "timeoutSeconds")
        stream = self.streams.stream(
            self.store,
            t.kind,
            t.namespace,
            selector,
            since,
            _bool(q.get("allowWatchBookmarks")),
            timeout,
            self.bookmark_interval,
        )
        return StreamingResponse(stream, media_type="application/json")

    def _log(self, t: _Target, q: Any) -> Response:
        """pods/log as kubernetes commit 000f2605 answers it: options validated first
        (pkg/apis/core/validation `ValidatePodLogOptions`: limitBytes and tailLines must be > 0
        and >= 0, else 422), a missing pod 404, the container named or the only one, else 400
        (pkg/registry/core/pod/strategy.go `LogLocation`), a pod on no node yet 204 with no body
        (`LogLocation` gives no location; handlers/responsewriters `StreamObject`), then the
        kubelet's `validateContainerLogStatus` (pkg/kubelet/kubelet_pods.go): no status of the
        container 400 "is not available", a waiting one 400 "is waiting to start: <reason>"
        (ErrImagePull "image can't be pulled", ImagePullBackOff "trying and failing to pull
        image"). The log is the pod's own (the kubelet keeps it under the pod's uid, so a new
        pod of the same name starts empty); limitBytes cuts it at that many bytes.
        sinceSeconds, sinceTime, timestamps and previous are refused (not modelled)."""
        container = q.get("container")
        tail = _int(q.get("tailLines"), "tailLines")
        limit = _int(q.get("limitBytes"), "limitBytes")
        for unsupported in ("sinceSeconds", "sinceTime", "previous", "timestamps"):
            if q.get(unsupported) not in (None, "", "false"):
                raise apierr.bad_request(f"{unsupported} is not supported by the fake API server (k8sfake)")
        bad = []
        if limit is not None and limit < 1:
            bad.append(apierr.FieldError("limitBytes", "Invalid", "must be greater than 0", limit))
        if tail is not None and tail < 0:
            bad.append(apierr.FieldError("tailLines", "Invalid", "must be greater than or equal to 0", tail))
        if bad:
            raise apierr.invalid("PodLogOptions", "", t.name, bad)
        pod = self.store.get(t.kind, t.namespace, t.name)
        names = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
        if container is None:
            if len(names) != 1:
                raise apierr.bad_request(
                    f"a container name must be specified for pod {t.name}, choose one of: "
                    f"[{' '.join(str(n) for n in names)}]"
                )
            container = str(names[0])
        elif container not in names:
            raise apierr.bad_request(f"container {container} is not valid for pod {t.name}")
        if not (pod.get("spec") or {}).get("nodeName"):
            return Response(status_code=204)
        text = self.store.logs.get((t.namespace, pod["metadata"]["uid"], container))
        if text is None:
            statuses = (pod.get("status") or {}).get("containerStatuses") or []
            status = next((c for c in statuses if c.get("name") == container), None)
            where = f'container "{container}" in pod "{t.name}"'
            if status is None:
                raise apierr.bad_request(f"{where} is not available")
            waiting = (status.get("state") or {}).get("waiting")
            if waiting is not None:
                reason = {
                    "ErrImagePull": "image can't be pulled",
                    "ImagePullBackOff": "trying and failing to pull image",
                }.get(waiting.get("reason", ""), waiting.get("reason", ""))
                raise apierr.bad_request(f"{where} is waiting to start: {reason}")
            text = ""
        if tail is not None:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-tail:]) if tail > 0 else ""
        data = text.encode()
        return Response(data if limit is None else data[:limit], media_type="text/plain")

    @staticmethod
    def _scale(kind: Kind, obj: Obj) -> Obj:
        meta = obj["metadata"]
        match_labels = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in meta
            },
            "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 0)},
            "status": {
                "replicas": (obj.get("status") or {}).get("replicas", 0),
                "selector": ",".join(f"{k}={v}" for k, v in sorted(match_labels.items())),
            },
        }

    def _update_scale(self, t: _Target, scale: Obj) -> Obj:
        errs = validate_scale(scale)
        if errs:
            raise apierr.invalid("Scale", "autoscaling", t.name, errs)
        rv = (scale.get("metadata") or {}).get("resourceVersion")
        name = (scale.get("metadata") or {}).get("name")
        if name not in (None, t.name):
            raise apierr.bad_request(
                f"the name of the object ({name}) does not match the name on the URL ({t.name})"
            )
        replicas = int((scale.get("spec") or {}).get("replicas", 0))

        def change(obj: Obj) -> None:
            obj.setdefault("spec", {})["replicas"] = replicas

        return self._scale(t.kind, self.store.update_checked(t.kind, t.namespace, t.name, rv, change))

    def _patch(self, t: _Target, content_type: str, raw: bytes) -> Obj:
        accepted = [JSON_PATCH, MERGE, APPLY] if not t.kind.builtin else [JSON_PATCH, MERGE, STRATEGIC, APPLY]
        if content_type not in (JSON_PATCH, MERGE, STRATEGIC) or (
            content_type == STRATEGIC and not t.kind.builtin
        ):
            raise apierr.unsupported_media_type(content_type, accepted)
        body = _json(raw)
        current = self.store.get(t.kind, t.namespace, t.name)
        base = self._scale(t.kind, current) if t.subresource == "scale" else current
        if content_type == MERGE:
            if not isinstance(body, dict):
                raise apierr.bad_request(
                    "json: cannot unmarshal array into Go value of type map[string]interface {}"
                )
            patched = merge_patch(base, body)
        elif content_type == STRATEGIC:
            resource = "scale" if t.subresource == "scale" else t.kind.resource
            patched = strategic_merge_patch(resource, base, body)
        else:
            patched = json_patch(base, body)
        if not isinstance(patched, dict):
            raise apierr.unprocessable("the patched document is not an object")
        base_rv = base["metadata"]["resourceVersion"]
        patched_rv = (patched.get("metadata") or {}).get("resourceVersion")
        if patched_rv not in (None, "") and patched_rv != base_rv:
            raise apierr.conflict(t.kind.resource, t.kind.group, t.name)
        if t.subresource == "scale":
            return self._update_scale(
                t, {**patched, "metadata": {**patched.get("metadata", {}), "resourceVersion": base_rv}}
            )
        patched.setdefault("metadata", {})["resourceVersion"] = base_rv
        return self.store.update(t.kind, t.namespace, t.name, patched, t.subresource)

    def _delete(self, t: _Target, q: Any, raw: bytes) -> Response:
        if raw.strip():
            options = _json(raw)
            if not isinstance(options, dict):
                raise apierr.bad_request("the request body must be a DeleteOptions object")
        else:
            options = {}
            grace = _int(q.get("gracePeriodSeconds"), "gracePeriodSeconds")
            if grace is not None:
                options["gracePeriodSeconds"] = grace
            if q.get("propagationPolicy"):
                options["propagationPolicy"] = q.get("propagationPolicy")
        obj, gone = self.store.delete(t.kind, t.namespace, t.name, options)
        if t.kind.key == "pods" or not gone:
            return JSONResponse(obj)
        details: Obj = {"name": t.name, "kind": t.kind.resource, "uid": obj["metadata"]["uid"]}
        if t.kind.group:
            details["group"] = t.kind.group
        return JSONResponse(
            {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}
        )


class FakeCluster:
    """Start/stop the fake API server, make clients for it, inject faults, drive it directly.

    `with FakeCluster() as cluster:` serves on a free 127.0.0.1 port; `cluster.api_client()`
    is an unmodified `kubernetes.client.ApiClient` (bearer token of a system:masters admin
    unless `token=` names another user added with `add_user`). RBAC applies to every
    non-admin token: load rendered Role/ClusterRole/bindings with `load_rbac`.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], datetime] | None = None,
        window: int = 1000,
        bookmark_interval: float = 1.0,
    ) -> None:
        self.store = Store(clock=clock, window=window)
        self.auth = Authorizer()
        self.auth.add_token(ADMIN_TOKEN, "admin", [MASTERS])
        self.app = FakeApiServer(self.store, self.auth, bookmark_interval)
        self.port = self._free_port()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._resume_timer: threading.Timer | None = None
        self._served = False

    @staticmethod
    def _free_port() -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def _bind(self) -> socket.socket:
        for attempt in range(5):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Accepted sockets inherit this on Linux; without it a response split into header
            # and body writes waits ~40 ms on the client's delayed ACK (Nagle), per request.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                sock.bind(("127.0.0.1", self.port))
                return sock
            except OSError:
                sock.close()
                if self._served or attempt == 4:
                    raise  # coming back must keep the port clients know
                self.port = self._free_port()  # lost the race for a fresh port: take another
        raise AssertionError("unreachable")

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> FakeCluster:
        if self._server is not None:
            return self
        sock = self._bind()
        config = uvicorn.Config(
            self.app,
            log_level="error",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=1,
            loop="asyncio",
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"k8sfake-{self.port}"
        )
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"fake API server did not start on port {self.port}")
            time.sleep(0.01)
        self._server, self._thread = server, thread
        self._served = True
        return self

    def stop(self) -> None:
        if self._resume_timer is not None:
            self._resume_timer.cancel()
            self._resume_timer = None
        self.stop_listening()

    def stop_listening(self) -> None:
        """The server goes away (connections refused); state is kept for `resume_listening`."""
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        self.app.streams.close_all()
        server.should_exit = True
        thread.join(timeout=10)
        self._server, self._thread = None, None

    def resume_listening(self) -> None:
        self.start()

    def go_away(self, seconds: float) -> None:
        """Stop listening now and come back on the same port after `seconds`."""
        self.stop_listening()
        self._resume_timer = threading.Timer(seconds, self.resume_listening)
        self._resume_timer.daemon = True
        self._resume_timer.start()

    @property
    def listening(self) -> bool:
        return self._server is not None

    def __enter__(self) -> FakeCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- clients and users

    def configuration(self, token: str = ADMIN_TOKEN) -> Any:
        config = client.Configuration()
        config.host = self.host
        # kubernetes client >= 36 reads the token and its prefix under "BearerToken"; a prefix
        # stored under the older "authorization" key is ignored (configuration.py).
        config.api_key = {"BearerToken": token}
        config.api_key_prefix = {"BearerToken": "Bearer"}
        return config

    def api_client(self, token: str = ADMIN_TOKEN) -> Any:
        return client.ApiClient(self.configuration(token))

    def write_kubeconfig(
        self, directory: Path, token: str = ADMIN_TOKEN, namespace: str | None = None
    ) -> Path:
        """A kubeconfig file (`directory/kubeconfig`) whose one context talks to this server with
        `token` (and `namespace` as its default): what `KUBECONFIG` or `lowtide up` is given."""
        context: dict[str, str] = {"cluster": "fake", "user": "me"}
        if namespace is not None:
            context["namespace"] = namespace
        path = directory / "kubeconfig"
        document = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.host}}],
            "users": [{"name": "me", "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": context}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(document))  # JSON is YAML
        return path

    def add_user(self, token: str, user: str, groups: Iterable[str] = ()) -> None:
        self.auth.add_token(token, user, groups)

    def load_rbac(self, manifests: Iterable[Obj]) -> None:
        self.auth.load(manifests)

    def grant(self, user: str, rules: Iterable[Obj], namespace: str = "") -> None:
        self.auth.grant(user, rules, namespace)

    # ---------------------------------------------------------------- faults

    def inject(
        self,
        verb: str = "*",
        resource: str = "*",
        *,
        status: int | None = None,
        times: int = 1,
        latency: float = 0.0,
    ) -> Fault:
        """The next `times` requests matching (verb, resource[/subresource]) wait `latency`
        seconds, then answer `status` (409, 410, 429, 500, 503, 504) if given."""
        fault = Fault(verb, resource, status, latency, times)
        with self.app._lock:
            self.app.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self.app._lock:
            self.app.faults.clear()

    @property
    def requests(self) -> list[RequestRecord]:
        with self.app._lock:
            return list(self.app.records)

    # ---------------------------------------------------------------- hooks (no HTTP, no RBAC)

    @property
    def resource_version(self) -> int:
        return self.store.resource_version

    def get(self, resource: str, namespace: str, name: str) -> Obj:
        return self.store.get(kind_for(resource), namespace, name)

    def list(
        self, resource: str, namespace: str = "", label_selector: str = "", field_selector: str = ""
    ) -> list[Obj]:
        kind = kind_for(resource)
        items, _ = self.store.list_objects(
            kind, namespace, Selector.parse(kind.resource, label_selector, field_selector)
        )
        return items

    def create(self, resource: str, namespace: str, obj: Obj) -> Obj:
        return self.store.create(kind_for(resource), namespace, obj)

    def modify(self, resource: str, namespace: str, name: str, change: Callable[[Obj], None]) -> Obj:
        return self.store.modify(kind_for(resource), namespace, name, change)

    def delete(self, resource: str, namespace: str, name: str, **options: Any) -> Obj:
        obj, _ = self.store.delete(kind_for(resource), namespace, name, options)
        return obj

    def finish_pod_deletion(self, namespace: str, name: str) -> Obj:
        return self.store.finish_pod_deletion(namespace, name)

    def bind_pod(self, namespace: str, name: str, node: str) -> Obj:
        """The scheduler's Binding: refused while the pod still has scheduling gates."""
        pod = self.get("pods", namespace, name)
        if (pod.get("spec") or {}).get("schedulingGates"):
            raise ValueError(f"pod {namespace}/{name} still has scheduling gates")
        if (pod.get("spec") or {}).get("nodeName"):
            raise ValueError(f"pod {namespace}/{name} is already bound")

        def bind(p: Obj) -> None:
            p["spec"]["nodeName"] = node
            conditions = [
                c for c in p.setdefault("status", {}).get("conditions", []) if c.get("type") != "PodScheduled"
            ]
            p["status"]["conditions"] = [*conditions, {"type": "PodScheduled", "status": "True"}]

        return self.modify("pods", namespace, name, bind)

    def set_pod_log(self, namespace: str, name: str, text: str, container: str | None = None) -> None:
        """The log of the pod now named `name` (kept under its uid: a new pod of that name has none)."""
        pod = self.get("pods", namespace, name)
        if container is None:
            container = str(pod["spec"]["containers"][0]["name"])
        self.store.logs[(namespace, pod["metadata"]["uid"], container)] = text

    def compact(self) -> None:
        self.store.compact()

    def last_write(self, resource: str, namespace: str = "") -> int:
        """The resourceVersion of the last write to `resource` in `namespace` (see `Store.last_write`)."""
        return self.store.last_write(kind_for(resource), namespace)

    @contextlib.contextmanager
    def serving(self) -> Iterator[FakeCluster]:
        self.start()
        try:
            yield self
        finally:
            self.stop()


__all__ = ["ADMIN_TOKEN", "BY_KEY", "FakeApiServer", "FakeCluster", "Fault"]
