"""Where the Argo executor creates, reads, lists and stops Workflows: the Kubernetes API or argo-server.

Role: one small seam (`WorkflowsApi`) with two implementations, chosen by `argo.submit_via`
(docs/cluster.md "Submission paths"): `KubernetesWorkflows` (the `kubernetes` client's
`CustomObjectsApi` on `argoproj.io/v1alpha1` workflows) and `ArgoServerWorkflows` (argo-server's
REST API through Hera 7.1's `WorkflowsService`). Errors are classified here, at the edge, so that
the executor sees the same things from both: `WorkflowExists` for a 409 on create (the executor
reads the Workflow back and checks its `lowtide.io/job` label: idempotent create), None/False for
404, `ExecutorError(temporary=True)` for 5xx/429/timeouts/no answer, a permanent `ExecutorError`
naming the setting or RBAC rule for 401/403, the API's message for a refused Workflow.
Neighbours: `executor.ArgoExecutor` calls it; `k8s_errors` classifies the Kubernetes path;
`wiring.build_argo_executor` builds one. Pods are always read through the Kubernetes API
(argo-server has no pod API fit for admission), so only Workflows go through this seam.
Must not: decide anything about steps or retries, sleep, retry, or read the clock.

argo-server facts (argo-workflows commit f016ad89, v4.1 line, checked in its source):
- Endpoints (server/workflow/workflow.proto, pkg/apiclient/workflow swagger): `POST
  /api/v1/workflows/{namespace}` with a `WorkflowCreateRequest` (`{"workflow": {...}}`), `GET
  /api/v1/workflows/{namespace}/{name}`, `GET /api/v1/workflows/{namespace}?listOptions.labelSelector=`,
  `PUT /api/v1/workflows/{namespace}/{name}/stop` (a `WorkflowStopRequest`).
- Errors are gRPC statuses through grpc-gateway v1.16 (`DefaultHTTPProtoErrorHandler`): the body
  is `{"code": <grpc code>, "message": ...}` and the HTTP status follows the code. Kubernetes
  errors are mapped by server/utils/errors.go `ToStatusError` (409 → AlreadyExists → HTTP 409,
  404 → NotFound → 404, 403 → PermissionDenied → 403, 401 → Unauthenticated → 401, 503 →
  Unavailable → 503, other 5xx → Internal → 500).
- Auth (server/auth/gatekeeper.go `getClients`; util/kubeconfig `GetRestConfig`): in `client`
  mode the header is `Authorization: Bearer <Kubernetes token>` and argo-server acts with that
  token's RBAC; `Bearer v2:<jwt>` is an SSO session (server/auth/sso `Prefix`); a token no mode
  accepts is 401 "token not valid". Hera prefixes a bare token with "Bearer " itself
  (service.py `format_token`), so the token file holds the bare token.
- Stop: server/workflow/workflow_server.go `StopWorkflow` → workflow/util `StopWorkflow` patches
  `spec.shutdown: Stop`; a Workflow already completed answers `AlreadyShutdownError` ("cannot
  shutdown a completed workflow"), which `ToStatusError` turns into HTTP 500 (Internal). That is
  not temporary: the Workflow is over, there is nothing left to stop (`stop` returns True).

Hera 7.1 facts (site-packages/hera/workflows/service.py, hera/exceptions/__init__.py):
- `WorkflowsService` sends no request timeout (`session.request(method, **kwargs)`): this module
  passes a `requests.Session` whose requests carry `timeout_s`.
- It raises `exception_from_server_response`: a subclass per status for 400/401/403/404/409/500/501
  and a bare `HeraException` (no status) for any other (503, 504, 429); a JSON error body without
  `message` raises KeyError. So the status is taken from the session's last response.
- Its `Workflow` model types resource quantities as strings (Kubernetes' int-or-string): a
  manifest's numeric quantities (`nvidia.com/gpu: 2`) are sent as strings ("2").
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Protocol

import requests

from lowtide.adapters.argo import k8s_errors
from lowtide.control.executor_port import ExecutorError

__all__ = [
    "ARGO_SERVER",
    "ArgoServerWorkflows",
    "KubernetesWorkflows",
    "WorkflowExists",
    "WorkflowsApi",
]

GROUP, VERSION, PLURAL = "argoproj.io", "v1alpha1", "workflows"
ARGO_SERVER = "argo-server"
TOKEN_SETTING = "argo.server_token_file"  # noqa: S105 - the name of a setting, not a token
_TEMPORARY = frozenset({0, 408, 429, 500, 502, 503, 504})
_COMPLETED = "cannot shutdown a completed workflow"

Obj = dict[str, Any]


class WorkflowExists(Exception):
    """A create answered 409: a Workflow of that name exists (maybe from an earlier try)."""


class WorkflowsApi(Protocol):
    """The executor's view of the Workflow store (module docstring)."""

    @property
    def namespace(self) -> str: ...

    def create(self, manifest: Obj) -> None:
        """Create the Workflow. Raises WorkflowExists on 409, ExecutorError otherwise."""
        ...

    def get(self, name: str) -> Obj | None:
        """The Workflow as a plain mapping; None if there is none. Raises ExecutorError."""
        ...

    def list(self, label_selector: str) -> list[Obj]:
        """The namespace's Workflows matching the selector. Raises ExecutorError."""
        ...

    def stop(self, name: str) -> bool:
        """`spec.shutdown: Stop`; False when there is no such Workflow. Raises ExecutorError."""
        ...

    def close(self) -> None: ...


class KubernetesWorkflows:
    """Workflows through the Kubernetes API (`CustomObjectsApi`, kubernetes client 36.x)."""

    def __init__(self, api_client: Any, namespace: str, timeout_s: float) -> None:
        from kubernetes import client  # noqa: PLC0415 - only this implementation needs it

        self._custom = client.CustomObjectsApi(api_client)
        self._ns = namespace
        self._timeout = timeout_s

    @property
    def namespace(self) -> str:
        return self._ns

    def _error(self, exc: BaseException, verb: str) -> ExecutorError:
        return k8s_errors.classify(exc, verb=verb, resource=PLURAL, namespace=self._ns)

    def create(self, manifest: Obj) -> None:
        try:
            self._custom.create_namespaced_custom_object(
                GROUP, VERSION, self._ns, PLURAL, manifest, _request_timeout=self._timeout
            )
        except Exception as exc:
            if k8s_errors.status_of(exc) == 409:
                raise WorkflowExists(k8s_errors.api_message(exc)) from exc
            raise self._error(exc, "create") from exc

    def get(self, name: str) -> Obj | None:
        try:
            wf = self._custom.get_namespaced_custom_object(
                GROUP, VERSION, self._ns, PLURAL, name, _request_timeout=self._timeout
            )
        except Exception as exc:
            if k8s_errors.status_of(exc) == 404:
                return None
            raise self._error(exc, "get") from exc
        return wf if isinstance(wf, dict) else None

    def list(self, label_selector: str) -> list[Obj]:
        try:
            listed = self._custom.list_namespaced_custom_object(
                GROUP,
                VERSION,
                self._ns,
                PLURAL,
                label_selector=label_selector,
                _request_timeout=self._timeout,
            )
        except Exception as exc:
            raise self._error(exc, "list") from exc
        return [wf for wf in (listed or {}).get("items") or [] if isinstance(wf, dict)]

    def stop(self, name: str) -> bool:
        # CustomObjectsApi sends a dict as a merge patch (kubernetes client rest.py).
        try:
            self._custom.patch_namespaced_custom_object(
                GROUP,
                VERSION,
                self._ns,
                PLURAL,
                name,
                {"spec": {"shutdown": "Stop"}},
                _request_timeout=self._timeout,
            )
        except Exception as exc:
            if k8s_errors.status_of(exc) == 404:
                return False
            raise self._error(exc, "patch") from exc
        return True

    def close(self) -> None:
        """The API client is the executor's (it also reads pods); nothing to close here."""


class _TimedSession(requests.Session):
    """A session whose requests time out and which keeps the last response (Hera raises a bare
    HeraException, or KeyError, without the status for some answers: module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self.timeout_s = timeout_s
        self.last_status: int | None = None

    def request(self, method: str | bytes, url: str | bytes, *args: Any, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", self.timeout_s)
        self.last_status = None
        response = super().request(method, url, *args, **kwargs)  # type: ignore[arg-type]
        self.last_status = response.status_code
        return response


def _quantities_as_strings(obj: Any, key: str = "") -> Any:
    """A copy of `obj` with numeric `limits`/`requests` values as strings (Hera's Quantity is str)."""
    if isinstance(obj, dict):
        if key in ("limits", "requests"):
            return {
                k: str(v)
                if isinstance(v, int | float) and not isinstance(v, bool)
                else _quantities_as_strings(v, k)
                for k, v in obj.items()
            }
        return {k: _quantities_as_strings(v, k) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_quantities_as_strings(v) for v in obj]
    return obj


class ArgoServerWorkflows:
    """Workflows through argo-server's REST API with Hera's `WorkflowsService` (module docstring)."""

    def __init__(
        self,
        host: str,
        token: str | None,
        namespace: str,
        *,
        verify_tls: bool = True,
        timeout_s: float = 10.0,
    ) -> None:
        from hera.workflows import WorkflowsService  # noqa: PLC0415 - only this implementation needs it

        self._session = _TimedSession(timeout_s)
        self._service = WorkflowsService(
            host=host, token=token or None, namespace=namespace, verify_ssl=verify_tls, session=self._session
        )
        self._host = host
        self._ns = namespace

    @property
    def namespace(self) -> str:
        return self._ns

    def _status(self, exc: BaseException) -> int | None:
        """The HTTP status behind what Hera or requests raised (0: no answer); None: not an API error."""
        if isinstance(exc, requests.RequestException):
            return 0
        from hera.exceptions import HeraException  # noqa: PLC0415

        if isinstance(exc, HeraException | KeyError | ValueError) and self._session.last_status is not None:
            return self._session.last_status
        return None

    def _error(self, exc: BaseException, verb: str, status: int | None) -> ExecutorError:
        what = f"{verb} workflows in namespace {self._ns} through argo-server {self._host}"
        if status is None:
            return ExecutorError(f"{what}: {type(exc).__name__}: {exc}", temporary=False)
        if status in _TEMPORARY:
            answer = "no answer" if status == 0 else f"HTTP {status}"
            return ExecutorError(
                f"{what}: argo-server failed ({answer}: {exc}); will try again",
                temporary=True,
                infrastructure=ARGO_SERVER,
            )
        if status == 401:
            return ExecutorError(
                f"{what}: argo-server refused the token (HTTP 401: {exc}); check {TOKEN_SETTING} "
                "(a Kubernetes ServiceAccount token for argo-server's client auth mode)",
                temporary=False,
                infrastructure=ARGO_SERVER,
            )
        if status == 403:
            return ExecutorError(
                f"{what}: forbidden (HTTP 403: {exc}); the identity of the token in {TOKEN_SETTING} needs "
                f"the rule verbs [{verb}] on workflows.argoproj.io in namespace {self._ns}",
                temporary=False,
                infrastructure=ARGO_SERVER,
            )
        if status == 200:  # Hera could not read the answer into its model
            return ExecutorError(
                f"{what}: argo-server's answer does not fit Hera's model: {exc}", temporary=False
            )
        if status == 400:  # InvalidArgument: argo-server's validation refused the Workflow
            return ExecutorError(f"{what}: argo-server refused it: {exc}", temporary=False)
        return ExecutorError(f"{what}: HTTP {status}: {exc}", temporary=False, infrastructure=ARGO_SERVER)

    def create(self, manifest: Obj) -> None:
        from hera.workflows.models import Workflow, WorkflowCreateRequest  # noqa: PLC0415

        body = _quantities_as_strings(manifest)
        try:
            request = WorkflowCreateRequest(workflow=Workflow(**body), namespace=self._ns)
        except ValueError as exc:  # pydantic: the manifest does not fit Argo's Workflow model
            raise ExecutorError(
                f"the Workflow does not fit argo-server's model: {exc}", temporary=False
            ) from exc
        try:
            with warnings.catch_warnings():  # Hera 7.1 calls pydantic's deprecated `.json()`
                warnings.simplefilter("ignore", DeprecationWarning)
                self._service.create_workflow(request, namespace=self._ns)
        except Exception as exc:
            status = self._status(exc)
            if status == 409:
                raise WorkflowExists(str(exc)) from exc
            raise self._error(exc, "create", status) from exc

    def get(self, name: str) -> Obj | None:
        try:
            wf = self._service.get_workflow(name, namespace=self._ns)
        except Exception as exc:
            status = self._status(exc)
            if status == 404:
                return None
            raise self._error(exc, "get", status) from exc
        return _plain(wf)

    def list(self, label_selector: str) -> list[Obj]:
        try:
            listed = self._service.list_workflows(namespace=self._ns, label_selector=label_selector)
        except Exception as exc:
            raise self._error(exc, "list", self._status(exc)) from exc
        return [_plain(wf) for wf in listed.items or []]

    def stop(self, name: str) -> bool:
        from hera.workflows.models import WorkflowStopRequest  # noqa: PLC0415

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                self._service.stop_workflow(
                    name, WorkflowStopRequest(name=name, namespace=self._ns), self._ns
                )
        except Exception as exc:
            status = self._status(exc)
            if status == 404:
                return False
            if status == 500 and _COMPLETED in str(exc):
                return True  # already over: nothing runs or will run (module docstring, "Stop")
            raise self._error(exc, "stop", status) from exc
        return True

    def close(self) -> None:
        self._session.close()  # what Hera's (untyped) `close` does


def _plain(model: Any) -> Obj:
    """A Hera model as the JSON mapping argo-server sent (aliases, no unset fields, times as text)."""
    doc = json.loads(model.model_dump_json(by_alias=True, exclude_none=True))
    if not isinstance(doc, dict):
        raise ExecutorError("argo-server answered something that is not an object", temporary=True)
    return doc
