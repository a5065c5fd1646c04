"""A fake argo-server: the REST endpoints lowtide's `ArgoServerWorkflows` uses, over a `FakeCluster`.

Role: serve, with uvicorn on a free 127.0.0.1 port, exactly `POST /api/v1/workflows/{ns}`,
`GET /api/v1/workflows/{ns}/{name}`, `GET /api/v1/workflows/{ns}` (listOptions.labelSelector) and
`PUT /api/v1/workflows/{ns}/{name}/stop`, reading and writing the Workflows of the same
`FakeCluster` store the simulated Argo controller (`argo_sim`) works on, so a Workflow created here
runs there. Hera's unmodified `WorkflowsService` is the client.
Neighbours: `k8sfake` (the store, its tokens and RBAC), `tests/integration/test_argo_server_submit.py`.
Must NOT: be imported by src/ (test infrastructure).

Faithful to argo-server (argo-workflows commit f016ad89, v4.1 line), client auth mode:
- Auth (server/auth/gatekeeper.go `getClients`, util/kubeconfig `GetRestConfig`): the header must be
  `Authorization: Bearer <Kubernetes token>`; no header or another scheme → 401 code 16 "token not
  valid. see https://argo-workflows.readthedocs.io/en/latest/faq/"; a Bearer token Kubernetes does
  not know → its 401 "Unauthorized" passed through as code 16; then the token's identity is checked
  against the cluster's RBAC like Kubernetes would (403 → code 7 with the Kubernetes message).
- Errors are grpc-gateway v1.16 `DefaultHTTPProtoErrorHandler` bodies `{"code", "message",
  "details": []}` with the HTTP status of the gRPC code (runtime/errors.go `HTTPStatusFromCode`);
  Kubernetes errors go through server/utils/errors.go `ToStatusError` (409 → AlreadyExists 6,
  404 → NotFound 5, 403 → PermissionDenied 7, 401 → Unauthenticated 16, 503 → Unavailable 14,
  504 → DeadlineExceeded 4, 429 → ResourceExhausted 8, other 5xx → Internal 13, other 4xx →
  InvalidArgument 3) and the message is the Kubernetes error's own.
- Create (server/workflow/workflow_server.go `CreateWorkflow`): no body workflow → 400 code 3;
  the namespace defaults to the path's; the creator label `workflows.argoproj.io/creator` is set
  from the identity (workflow/creator `LabelCreator`, `dnsFriendly`); the Kubernetes create's
  error is returned through `ToStatusError`; the answer is the created Workflow.
- Stop (`StopWorkflow` → workflow/util `StopWorkflow` → `patchShutdownStrategy`): reads the
  Workflow (404 code 5), refuses a completed one with `cannot shutdown a completed workflow:
  workflow: "<name>", namespace: "<ns>"` as Internal (HTTP 500), else merge-patches
  `spec.shutdown: Stop` plus the actor labels (`workflows.argoproj.io/actor`, `.../action: Stop`)
  and answers the Workflow read back.
- Workflows pass through Go types, so resource quantities come out as JSON strings
  (k8s.io/apimachinery/pkg/api/resource/quantity.go: `UnmarshalJSON` takes a number or a string,
  `MarshalJSON` always writes a string): a request's `nvidia.com/gpu: 2` is accepted and stored as
  "2", and a Workflow created through the Kubernetes API with a number (the CRD's int-or-string)
  is answered with a string.
- Request bodies are validated against the swagger's `WorkflowCreateRequest` /
  `WorkflowStopRequest` (shared data `reference/argo-workflows-swagger.json`) when that file is
  given, after quantities are read as Go reads them (above): a body it refuses is 400 code 3 (a
  body of the wrong shape fails to unmarshal in real argo-server too; unknown fields are not
  refused, as the swagger does not refuse them).

NOT reproduced: argo-server's `validate.Workflow` (templates, DAG, expressions: use the CRD schema
tests), `server` and `sso` auth modes (SSO `Bearer v2:` JWTs, SSO RBAC by ServiceAccount
annotations), TLS (this fake is plain http), instance-id labels, dry runs, the workflow archive,
watches/streams, and every other endpoint.

Faults: `inject(verb, status=, times=, latency=, after=)` — the next `times` requests of `verb`
("create", "get", "list", "stop") wait `latency` seconds, then answer `status` (e.g. 503 from a
proxy in front of argo-server); with `after=True` the operation is carried out first and only its
answer is lost (the create went through unseen).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import uvicorn
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from k8sfake import FakeCluster
from k8sfake import errors as apierr
from k8sfake.objects import kind_for

Obj = dict[str, Any]

# gRPC codes (google.golang.org/grpc/codes) and grpc-gateway v1.16 HTTPStatusFromCode.
OK, CANCELED, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND, ALREADY_EXISTS = 0, 1, 3, 4, 5, 6
PERMISSION_DENIED, RESOURCE_EXHAUSTED, INTERNAL, UNAVAILABLE, UNAUTHENTICATED = 7, 8, 13, 14, 16
HTTP_OF_CODE = {
    CANCELED: 408,
    INVALID_ARGUMENT: 400,
    DEADLINE_EXCEEDED: 504,
    NOT_FOUND: 404,
    ALREADY_EXISTS: 409,
    PERMISSION_DENIED: 403,
    RESOURCE_EXHAUSTED: 429,
    INTERNAL: 500,
    UNAVAILABLE: 503,
    UNAUTHENTICATED: 401,
}
# server/utils/errors.go errorMaps (Kubernetes HTTP status → gRPC code).
CODE_OF_HTTP = {
    408: CANCELED,
    504: DEADLINE_EXCEEDED,
    404: NOT_FOUND,
    409: ALREADY_EXISTS,
    403: PERMISSION_DENIED,
    401: UNAUTHENTICATED,
    429: RESOURCE_EXHAUSTED,
    400: INVALID_ARGUMENT,
    501: 12,
    500: INTERNAL,
    503: UNAVAILABLE,
}
TOKEN_NOT_VALID = "token not valid. see https://argo-workflows.readthedocs.io/en/latest/faq/"
CREATOR = "workflows.argoproj.io/creator"
ACTOR = "workflows.argoproj.io/actor"
ACTION = "workflows.argoproj.io/action"
_TERMINAL = ("Succeeded", "Failed", "Error")


class GrpcError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message

    def response(self) -> JSONResponse:
        body = {"code": self.code, "message": self.message, "details": []}
        return JSONResponse(body, status_code=HTTP_OF_CODE.get(self.code, 500))


def to_status_error(err: apierr.ApiError) -> GrpcError:
    """server/utils/errors.go `ToStatusError` for a Kubernetes StatusError."""
    code = CODE_OF_HTTP.get(err.code)
    if code is None:
        code = INTERNAL if err.code >= 500 or err.code < 400 else INVALID_ARGUMENT
    return GrpcError(code, err.message)


def dns_friendly(s: str) -> str:
    """workflow/creator `dnsFriendly`."""
    value = re.sub(r"[^-_.a-z0-9A-Z]", "-", s)[-63:]
    value = re.sub(r"^[^a-z0-9A-Z]*", "", value)
    return re.sub(r"[^a-z0-9A-Z]*$", "", value)


@dataclass
class ServerFault:
    verb: str
    status: int | None
    latency: float
    remaining: int
    after: bool


@dataclass(frozen=True)
class Call:
    verb: str
    namespace: str
    name: str
    status: int
    authorization: str


class _App:
    def __init__(self, cluster: FakeCluster, swagger: Path | None) -> None:
        self.cluster = cluster
        self.faults: list[ServerFault] = []
        self.calls: list[Call] = []
        self.lock = threading.Lock()
        self.validators: dict[str, jsonschema.protocols.Validator] = {}
        if swagger is not None:
            definitions = json.loads(swagger.read_text())["definitions"]
            for name in ("WorkflowCreateRequest", "WorkflowStopRequest"):
                schema = {
                    "$ref": f"#/definitions/io.argoproj.workflow.v1alpha1.{name}",
                    "definitions": definitions,
                }
                self.validators[name] = jsonschema.Draft4Validator(schema)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        response = await self.handle(request)
        await response(scope, receive, send)

    async def handle(self, request: Request) -> Response:
        verb, ns, name = "", "", ""
        authorization = request.headers.get("authorization", "")
        try:
            verb, ns, name = self._route(request)
            user = self._authenticate(authorization)
            fault = self._take_fault(verb)
            if fault is not None and not fault.after:
                await self._fail(fault)
            body = await request.body()
            result = self._dispatch(verb, ns, name, user, body, request)
            if fault is not None:
                await self._fail(fault)
            response: Response = JSONResponse(go_encoded(result))
        except GrpcError as exc:
            response = exc.response()
        except ClientDisconnect:
            response = Response(status_code=499)
        return self._record(verb, ns, name, response, authorization)

    async def _fail(self, fault: ServerFault) -> None:
        if fault.latency:
            await asyncio.sleep(fault.latency)
        if fault.status is not None:
            code = CODE_OF_HTTP.get(fault.status, INTERNAL)
            raise GrpcError(code, f"injected HTTP {fault.status}")

    def _record(self, verb: str, ns: str, name: str, response: Response, authorization: str) -> Response:
        with self.lock:
            self.calls.append(Call(verb, ns, name, response.status_code, authorization))
        return response

    def _take_fault(self, verb: str) -> ServerFault | None:
        with self.lock:
            for fault in self.faults:
                if fault.remaining > 0 and fault.verb in (verb, "*"):
                    fault.remaining -= 1
                    return fault
        return None

    @staticmethod
    def _route(request: Request) -> tuple[str, str, str]:
        parts = [p for p in request.url.path.split("/") if p]
        method = request.method
        if parts[:3] == ["api", "v1", "workflows"]:
            rest = parts[3:]
            if method == "POST" and len(rest) == 1:
                return "create", rest[0], ""
            if method == "GET" and len(rest) == 1:
                return "list", rest[0], ""
            if method == "GET" and len(rest) == 2:
                return "get", rest[0], rest[1]
            if method == "PUT" and len(rest) == 3 and rest[2] == "stop":
                return "stop", rest[0], rest[1]
        # grpc-gateway answers an unknown route 404 (its NotFound handler); the body's code is 5.
        raise GrpcError(NOT_FOUND, "Not Found")

    def _authenticate(self, authorization: str) -> str:
        scheme, _, token = authorization.partition(" ")
        if scheme != "Bearer" or not token.strip():  # util/kubeconfig IsBearerAuthScheme
            raise GrpcError(UNAUTHENTICATED, TOKEN_NOT_VALID)
        user = self.cluster.auth.authenticate(token.strip())
        if user is None:  # the Kubernetes API refuses the token: its 401 through ToStatusError
            raise GrpcError(UNAUTHENTICATED, "Unauthorized")
        return user

    def _authorize(self, user: str, verb: str, ns: str, name: str) -> None:
        if not self.cluster.auth.authorize(user, verb, "argoproj.io", "workflows", "", ns, name):
            message = (
                f'workflows.argoproj.io "{name}" is forbidden: User "{user}" cannot {verb} resource '
                f'"workflows" in API group "argoproj.io" in the namespace "{ns}"'
            )
            if not name:
                message = message.replace(' "" is forbidden', " is forbidden")
            raise GrpcError(PERMISSION_DENIED, message)

    def _validate(self, schema: str, doc: Any) -> None:
        validator = self.validators.get(schema)
        if validator is None:
            return
        error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path)
            raise GrpcError(INVALID_ARGUMENT, f"json: cannot unmarshal {schema} at {where}: {error.message}")

    def _dispatch(self, verb: str, ns: str, name: str, user: str, raw: bytes, request: Request) -> Any:
        store, kind = self.cluster.store, kind_for("workflows")
        try:
            if verb == "create":
                doc = go_encoded(_json(raw))
                self._validate("WorkflowCreateRequest", doc)
                wf = doc.get("workflow") if isinstance(doc, dict) else None
                if not isinstance(wf, dict):
                    raise GrpcError(INVALID_ARGUMENT, "workflow body not specified")
                meta = wf.setdefault("metadata", {})
                meta.setdefault("namespace", ns)
                meta.setdefault("labels", {})[CREATOR] = dns_friendly(user)
                self._authorize(user, "create", ns, "")
                return store.create(kind, ns, wf)
            if verb == "get":
                self._authorize(user, "get", ns, name)
                return store.get(kind, ns, name)
            if verb == "list":
                self._authorize(user, "list", ns, "")
                selector = request.query_params.get("listOptions.labelSelector", "")
                return {"metadata": {}, "items": self.cluster.list("workflows", ns, label_selector=selector)}
            if verb == "stop":
                self._validate("WorkflowStopRequest", _json(raw))
                self._authorize(user, "get", ns, name)
                wf = store.get(kind, ns, name)
                if (wf.get("status") or {}).get("phase") in _TERMINAL:
                    raise GrpcError(
                        INTERNAL,
                        f'cannot shutdown a completed workflow: workflow: "{name}", namespace: "{ns}"',
                    )
                self._authorize(user, "patch", ns, name)

                def stop(obj: Obj) -> None:
                    obj.setdefault("spec", {})["shutdown"] = "Stop"
                    labels = obj.setdefault("metadata", {}).setdefault("labels", {})
                    labels[ACTOR], labels[ACTION] = dns_friendly(user), "Stop"

                store.modify(kind, ns, name, stop)
                return store.get(kind, ns, name)
        except apierr.ApiError as exc:
            raise to_status_error(exc) from exc
        raise GrpcError(NOT_FOUND, "Not Found")


def go_encoded(obj: Any, key: str = "") -> Any:
    """`obj` with numeric `limits`/`requests` quantities as strings (module docstring)."""
    if isinstance(obj, dict):
        if key in ("limits", "requests"):
            return {
                k: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v
                for k, v in obj.items()
            }
        return {k: go_encoded(v, k) for k, v in obj.items()}
    if isinstance(obj, list):
        return [go_encoded(v) for v in obj]
    return obj


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"{}")
    except ValueError as exc:
        raise GrpcError(INVALID_ARGUMENT, f"invalid JSON body: {exc}") from exc


class FakeArgoServer:
    """`with FakeArgoServer(cluster) as server:` serves on `server.url` (module docstring)."""

    def __init__(self, cluster: FakeCluster, swagger: Path | None = None) -> None:
        self.app = _App(cluster, swagger)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeArgoServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", self.port))
        config = uvicorn.Config(
            self.app, log_level="error", lifespan="off", access_log=False, timeout_graceful_shutdown=1
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="argo-server"
        )
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"fake argo-server did not start on port {self.port}")
            time.sleep(0.01)
        self._server, self._thread = server, thread
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> FakeArgoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def inject(
        self,
        verb: str = "*",
        *,
        status: int | None = None,
        times: int = 1,
        latency: float = 0.0,
        after: bool = False,
    ) -> ServerFault:
        fault = ServerFault(verb, status, latency, times, after)
        with self.app.lock:
            self.app.faults.append(fault)
        return fault

    @property
    def calls(self) -> list[Call]:
        with self.app.lock:
            return list(self.app.calls)

    def serving(self) -> Iterator[FakeArgoServer]:
        with self:
            yield self
