"""The Kubernetes `Status` error bodies the fake API server answers with.

Role: build `ApiError`s whose JSON body, HTTP code, reason and message have the shape the real
apiserver gives (k8s.io/apimachinery/pkg/api/errors/errors.go at kubernetes commit 000f2605,
v1.35 development line: `NewNotFound`, `NewAlreadyExists`, `NewConflict`, `NewInvalid`,
`NewForbidden`, `NewResourceExpired`, `NewBadRequest`, `NewGenericServerResponse`), so the
unmodified `kubernetes` client raises the `ApiException` a real cluster would cause.
Neighbours: `objects` (storage) and `server` (HTTP) raise these; `validation` builds field errors.
Must NOT: know about HTTP routing or storage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

CONFLICT_MODIFIED = (
    "the object has been modified; please apply your changes to the latest version and try again"
)


@dataclass(frozen=True)
class FieldError:
    """One `field.Error` (apimachinery/pkg/util/validation/field/errors.go)."""

    path: str
    kind: str  # "Forbidden", "Invalid", "Required", "NotSupported"
    detail: str
    value: Any = None

    @property
    def reason(self) -> str:
        return {
            "Forbidden": "FieldValueForbidden",
            "Invalid": "FieldValueInvalid",
            "Required": "FieldValueRequired",
            "NotSupported": "FieldValueNotSupported",
        }[self.kind]

    def body(self) -> str:
        if self.kind == "Invalid":
            # field.Error: strings quoted (%q), numbers bare, anything else as JSON
            value = self.value if isinstance(self.value, int) else json.dumps(self.value)
            return f"Invalid value: {value}: {self.detail}"
        if self.kind == "Required":
            return f"Required value: {self.detail}" if self.detail else "Required value"
        return f"{self.kind}: {self.detail}"

    def __str__(self) -> str:
        return f"{self.path}: {self.body()}"


@dataclass
class ApiError(Exception):
    """An error the API answers as a `Status` object (kind Status, status Failure)."""

    code: int
    reason: str
    message: str
    details: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def qualified(resource: str, group: str) -> str:
    """`schema.GroupResource.String()`: "pods", "deployments.apps"."""
    return f"{resource}.{group}" if group else resource


def _details(name: str, resource: str, group: str) -> dict[str, Any]:
    details: dict[str, Any] = {"kind": resource}
    if name:
        details["name"] = name
    if group:
        details["group"] = group
    return details


def not_found(resource: str, group: str, name: str) -> ApiError:
    return ApiError(
        404, "NotFound", f'{qualified(resource, group)} "{name}" not found', _details(name, resource, group)
    )


def already_exists(resource: str, group: str, name: str) -> ApiError:
    msg = f'{qualified(resource, group)} "{name}" already exists'
    return ApiError(409, "AlreadyExists", msg, _details(name, resource, group))


def conflict(resource: str, group: str, name: str, why: str = CONFLICT_MODIFIED) -> ApiError:
    msg = f'Operation cannot be fulfilled on {qualified(resource, group)} "{name}": {why}'
    return ApiError(409, "Conflict", msg, _details(name, resource, group))


def invalid(kind: str, group: str, name: str, errors: list[FieldError]) -> ApiError:
    """`NewInvalid`: one error printed bare, several as "[a, b]" (utilerrors aggregate)."""
    qualified_kind = f"{kind}.{group}" if group else kind
    text = str(errors[0]) if len(errors) == 1 else "[" + ", ".join(str(e) for e in errors) + "]"
    details: dict[str, Any] = {
        "name": name,
        "kind": kind,
        "causes": [{"reason": e.reason, "message": e.body(), "field": e.path} for e in errors],
    }
    if group:
        details["group"] = group
    return ApiError(422, "Invalid", f'{qualified_kind} "{name}" is invalid: {text}', details)


def forbidden(resource: str, group: str, name: str, why: str) -> ApiError:
    target = f'{qualified(resource, group)} "{name}"' if name else qualified(resource, group)
    return ApiError(403, "Forbidden", f"{target} is forbidden: {why}", _details(name, resource, group))


def expired(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def unprocessable(message: str) -> ApiError:
    """`NewGenericServerResponse(422, ...)`: what a failed JSON patch operation answers."""
    return ApiError(422, "Invalid", message)


def unsupported_media_type(content_type: str, accepted: list[str]) -> ApiError:
    msg = (
        f"the body of the request was in an unknown format - accepted media types include: "
        f"{', '.join(accepted)}"
    )
    return ApiError(415, "UnsupportedMediaType", msg, {"causes": [{"reason": "", "message": content_type}]})


def method_not_allowed(verb: str, what: str) -> ApiError:
    return ApiError(405, "MethodNotAllowed", f"{verb} is not supported on {what}")


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")


def injected(code: int, resource: str, group: str, name: str) -> ApiError:
    """The body a real server gives for each status code a fault can inject."""
    if code == 409:
        return conflict(resource, group, name or "unknown")
    if code == 410:
        return expired("too old resource version: 1 (2)")
    if code == 429:
        return ApiError(
            429,
            "TooManyRequests",
            "Too many requests, please try again later.",
            {"retryAfterSeconds": 1},
            {"Retry-After": "1"},
        )
    if code == 503:
        return ApiError(503, "ServiceUnavailable", "the server is currently unable to handle the request")
    if code == 500:
        return ApiError(500, "InternalError", "Internal error occurred: injected fault")
    if code == 504:
        return ApiError(504, "Timeout", "Timeout: request did not complete within requested timeout")
    return ApiError(code, "Unknown", f"injected fault {code}")
