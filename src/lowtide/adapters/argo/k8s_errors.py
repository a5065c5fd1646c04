"""Kubernetes API errors classified at the Argo executor's edge.

Role: turn what the `kubernetes` client raises into the executor port's `ExecutorError`, so the
loop sees "try again later" (temporary, the machinery's), "the permissions are wrong"
(permanent, naming the RBAC rule the control plane lacks) or "the step's own fault" (the API's
422 message, e.g. a pod spec the API refuses).
Neighbours: `executor` calls `classify`; `control.executor_port.ExecutorError` is the result.
Must not: retry, sleep, log or read the clock.

Status codes (kubernetes commit 000f2605, staging/src/k8s.io/apimachinery/pkg/api/errors/
errors.go): 409 `AlreadyExists`/`Conflict`, 410 `Expired`/`Gone`, 429 `TooManyRequests`,
500/503/504 server errors, 403 `Forbidden` (RBAC; its message says `cannot <verb> resource
"<resource>" in API group "<group>" in the namespace "<ns>"`), 422 `Invalid`. The client
raises `kubernetes.client.exceptions.ApiException` (status 0 when no response came) and lets
urllib3's `HTTPError` (connection refused, timeouts after its retries) through.
"""

from __future__ import annotations

import json
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from lowtide.control.executor_port import ExecutorError

__all__ = ["INFRASTRUCTURE", "api_message", "classify", "status_of"]

INFRASTRUCTURE = "kubernetes"
_TEMPORARY = frozenset({0, 408, 409, 410, 429, 500, 502, 503, 504})


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of an API error (0: no answer); None for anything else."""
    if isinstance(exc, ApiException):
        return int(exc.status or 0)
    if isinstance(exc, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError):
        return 0
    return None


def api_message(exc: BaseException) -> str:
    """The `message` of the API's Status body, else the exception's own words."""
    if isinstance(exc, ApiException):
        body: Any = exc.body
        if isinstance(body, bytes):
            body = body.decode("utf-8", "replace")
        if isinstance(body, str) and body:
            try:
                doc = json.loads(body)
            except ValueError:
                return body.strip()[:500]
            if isinstance(doc, dict) and isinstance(doc.get("message"), str):
                return str(doc["message"])
        return f"{exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


def classify(exc: BaseException, *, verb: str, resource: str, namespace: str) -> ExecutorError:
    """`exc` as the port's error; `verb`/`resource`/`namespace` name what was attempted (and,
    for a 403, the RBAC rule that is missing)."""
    status = status_of(exc)
    what = f"{verb} {resource} in namespace {namespace}"
    if status is None:
        return ExecutorError(f"{what}: {type(exc).__name__}: {exc}", temporary=False)
    message = api_message(exc)
    if status in _TEMPORARY:
        answer = "no answer" if status == 0 else f"HTTP {status}"
        return ExecutorError(
            f"{what}: the Kubernetes API failed ({answer}: {message}); will try again",
            temporary=True,
            infrastructure=INFRASTRUCTURE,
        )
    if status == 403:
        return ExecutorError(
            f"{what}: forbidden ({message}); the control plane's Role needs the rule "
            f"verbs [{verb}] on {resource} in namespace {namespace} (deploy/helm/lowtide RBAC)",
            temporary=False,
            infrastructure=INFRASTRUCTURE,
        )
    if status == 422:
        return ExecutorError(f"{what}: the API refused it: {message}", temporary=False)
    return ExecutorError(f"{what}: HTTP {status}: {message}", temporary=False, infrastructure=INFRASTRUCTURE)
