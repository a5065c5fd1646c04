"""Bearer-token authentication and the permission rules (docs/architecture.md §11).

Tokens are stored hashed (SHA-256 of a 256-bit random secret). Roles:

- ``admin``: everything, every team.
- ``user``: submits jobs for the teams of its token, up to its `max_priority`; sees its own jobs
  and those of its teams; cancels only its own jobs; reruns any job it sees (the rerun is its
  own job, checked against its own token like a submit).
- ``viewer``: reads what a user of its teams reads (jobs, logs, services, pool, reports); never
  submits, validates, cancels or reruns.
- ``step``: minted per attempt; may only report that attempt's checkpoints.

A job the caller may not see answers exactly like a job that does not exist (404, same body), so
ids do not leak. With auth disabled every request acts as the local admin.
A request without an Authorization header may instead present the dashboard's session cookie
(`api.session`: signed, re-checked against the token store, CSRF-checked on unsafe methods).
Must not: store or log raw tokens; query anything but the token (the routes fetch the jobs).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from lowtide.api.errors import ApiError
from lowtide.api.session import session_token
from lowtide.control.records import JobRecord, JobScope, TokenRecord
from lowtide.domain.spec import JobSpec
from lowtide.store.repo import Store
from lowtide.store.token_codec import ALL_TEAMS


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    role: str
    attempt_id: int | None = None
    teams: tuple[str, ...] = (ALL_TEAMS,)
    max_priority: int = 100

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def scope(self) -> JobScope | None:
        """The jobs this caller sees; None: every job (admins, and tokens of every team)."""
        if self.is_admin or ALL_TEAMS in self.teams:
            return None
        return JobScope(self.name, self.teams)

    def sees_team(self, team: str | None) -> bool:
        return self.scope is None or (team is not None and team in self.teams)

    def sees(self, job: JobRecord) -> bool:
        scope = self.scope
        return scope is None or scope.allows(owner=job.owner, team=job.team)

    @property
    def default_team(self) -> str:
        """The team of a job whose spec names none: the token's first team ("default" for all)."""
        first = self.teams[0] if self.teams else ALL_TEAMS
        return "default" if first == ALL_TEAMS else first


LOCAL_ADMIN = Principal(name="local", role="admin")
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def authenticate(request: Request, store: Store, *, enabled: bool) -> Principal:
    if not enabled:
        return LOCAL_ADMIN
    header = request.headers.get("authorization")
    if not header:
        by_cookie = session_token(request, store, request.app.state.ctx.clock.wall())  # the dashboard
        if by_cookie is not None:
            return _principal_of(by_cookie)
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
    return _principal_of(token)


def _principal_of(token: TokenRecord) -> Principal:
    return Principal(
        name=token.owner,
        role=token.role,
        attempt_id=token.attempt_id,
        teams=token.teams,
        max_priority=token.max_priority,
    )


def _role_error(p: Principal, what: str) -> ApiError:
    return ApiError(403, "forbidden", f"a {p.role} token cannot {what}", [("header.Authorization", "role")])


def require_people(p: Principal) -> None:
    """Admins, users and viewers (reading); not step tokens."""
    if p.role not in ("admin", "user", "viewer"):
        raise _role_error(p, "do this")


def require_submitter(p: Principal) -> None:
    """Admins and users: submit, validate, cancel, rerun. Viewers only read."""
    if p.role not in ("admin", "user"):
        raise _role_error(p, "submit, cancel or rerun jobs" if p.role == "viewer" else "do this")


def require_admin(p: Principal) -> None:
    if not p.is_admin:
        raise ApiError(403, "forbidden", "only an admin may do this", [("header.Authorization", "role")])


def not_found(job_id: str) -> ApiError:
    """The answer for a job that does not exist, and for one the caller may not see."""
    return ApiError(404, "not_found", f"job '{job_id}' not found")


def require_visible(p: Principal, job: JobRecord) -> None:
    """A 404 (as if it did not exist) unless the caller may see the job."""
    require_people(p)
    if not p.sees(job):
        raise not_found(job.id)


def require_owner_or_admin(p: Principal, job: JobRecord, action: str) -> None:
    """Visible (else 404), and the caller's own job (else 403: the caller sees it already)."""
    require_visible(p, job)
    require_submitter(p)
    if not p.is_admin and job.owner != p.name:
        raise ApiError(
            403,
            "forbidden",
            f"job {job.id} belongs to {job.owner}; users may {action} only their own jobs",
            [("path.job_id", f"owned by {job.owner}")],
        )


def require_may_submit(p: Principal, spec: JobSpec) -> None:
    """The token's teams include the job's team, and its priority is at most the token's
    `max_priority`; else 403 located at `body.team` / `body.priority`, saying what is allowed."""
    require_submitter(p)
    if p.is_admin:
        return
    issues: list[tuple[str, str]] = []
    if ALL_TEAMS not in p.teams and spec.team not in p.teams:
        issues.append(("body.team", f"this token may submit for {', '.join(p.teams)}; not {spec.team!r}"))
    if spec.priority > p.max_priority:
        issues.append(
            ("body.priority", f"this token may submit up to priority {p.max_priority}; got {spec.priority}")
        )
    if issues:
        raise ApiError(403, "forbidden", "this token may not submit this job", issues)
