"""Bearer-token authentication and the permission rules.

Tokens are stored hashed (SHA-256 of a 256-bit random secret). Roles: ``admin`` (everything),
``user`` (submit, read, and cancel their own jobs), ``step`` (minted per attempt; may only report
that attempt's checkpoints). With auth disabled every request acts as the local admin.
Must not: store or log raw tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from lowtide.api.errors import ApiError
from lowtide.control.records import JobRecord
from lowtide.store.repo import Store


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    role: str
    attempt_id: int | None = None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


LOCAL_ADMIN = Principal(name="local", role="admin")
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def authenticate(request: Request, store: Store, *, enabled: bool) -> Principal:
    if not enabled:
        return LOCAL_ADMIN
    header = request.headers.get("authorization")
    if not header:
        raise ApiError(
            401,
            "unauthorized",
            "a bearer token is required",
            [("header.Authorization", "missing; send 'Authorization: Bearer <token>'")],
            _CHALLENGE,
        )
    scheme, _, raw = header.partition(" ")
    if scheme.lower() != "bearer" or not raw.strip():
        raise ApiError(
            401,
            "unauthorized",
            "malformed Authorization header",
            [("header.Authorization", "expected 'Bearer <token>'")],
            _CHALLENGE,
        )
    token = store.authenticate(raw.strip())
    if token is None:
        raise ApiError(
            401,
            "unauthorized",
            "unknown or revoked token",
            [("header.Authorization", "unknown or revoked token")],
            _CHALLENGE,
        )
    return Principal(name=token.owner, role=token.role, attempt_id=token.attempt_id)


def require_people(p: Principal) -> None:
    """Admins and users; not step tokens."""
    if p.role not in ("admin", "user"):
        raise ApiError(
            403, "forbidden", f"a {p.role} token cannot do this", [("header.Authorization", "role")]
        )


def require_admin(p: Principal) -> None:
    if not p.is_admin:
        raise ApiError(403, "forbidden", "only an admin may do this", [("header.Authorization", "role")])


def require_owner_or_admin(p: Principal, job: JobRecord, action: str) -> None:
    require_people(p)
    if not p.is_admin and job.owner != p.name:
        raise ApiError(
            403,
            "forbidden",
            f"job {job.id} belongs to {job.owner}; users may {action} only their own jobs",
            [("path.job_id", f"owned by {job.owner}")],
        )
