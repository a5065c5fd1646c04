"""Browser sessions for the dashboard: a signed, expiring cookie, and CSRF checks (docs/architecture.md §12).

`POST /v1/session` takes an API token (JSON `{"token": ...}` or a form field `token`), checks it
against the token store and sets the cookie `lowtide_session`: HttpOnly, SameSite=Strict, Path=/,
Secure when the request came over https. The cookie holds no secret: only the token's id and an
expiry, signed with HMAC-SHA256 under a key kept in the state dir (`session.key`, mode 0600,
made on first use; an app without a state dir uses a key of its own process). Every request
that presents the cookie is checked against the token store again (`session_token`), so a
revoked token logs its browser sessions out at once. `DELETE /v1/session` clears the cookie.

CSRF (OWASP CSRF Prevention Cheat Sheet, "Signed Double-Submit Cookie"/HMAC token pattern): a
request authenticated by the cookie with an unsafe method (anything but GET, HEAD, OPTIONS) must
carry `X-CSRF-Token`, the HMAC of the session cookie (given by `GET /v1/session`), and its
`Origin` (else `Referer`) must be this server's own origin when the browser sends one: one of
`api.dashboard_origins` when configured, else the origin named by the request's Host header.
`api.public_url` is not used for this: it is the address steps reach the API at (the Helm chart
sets it to the in-cluster Service), not the one browsers use. Requests
with an `Authorization` header never read the cookie, so API clients are unaffected.
Must not: store raw tokens or sessions anywhere (the cookie carries an id, never the secret),
or decide what a principal may do (`api.auth` does).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import threading
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

from lowtide.api.errors import ApiError
from lowtide.api.schemas import ErrorOut
from lowtide.control.records import NotFound, TokenRecord
from lowtide.store.repo import Store

COOKIE = "lowtide_session"
CSRF_HEADER = "X-CSRF-Token"
#: How long a browser session lasts before the token must be given again (12 hours).
SESSION_TTL_S = 12 * 3600.0
KEY_FILE = "session.key"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_PEOPLE = ("admin", "user", "viewer")


class SessionIn(BaseModel):
    token: str = Field(min_length=1, max_length=512, description="an API token (lowtide token create)")


class SessionOut(BaseModel):
    name: str
    role: str
    teams: list[str]
    csrf_token: str = Field(description=f"send as the {CSRF_HEADER} header on unsafe requests")
    expires_at: float | None = Field(description="when the session ends (None: auth is off)")
    auth_enabled: bool


# -- the signing key ---------------------------------------------------------------------------


def load_key(path: Path | None) -> bytes:
    """The key in `path` (made, 0600, when missing); a fresh process-local key when None."""
    if path is None:
        return secrets.token_bytes(32)
    with contextlib.suppress(FileNotFoundError):
        data = path.read_bytes()
        if len(data) >= 32:
            return data
    key = secrets.token_bytes(32)
    try:  # O_EXCL: of two processes making it at once, one key wins and both read it
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        data = path.read_bytes()
        if len(data) >= 32:
            return data
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)  # a short, broken key
    with os.fdopen(fd, "wb") as fh:
        fh.write(key)
    path.chmod(0o600)
    return key


_KEY_LOCK = threading.Lock()


def _key(request: Request) -> bytes:
    state = request.app.state
    with _KEY_LOCK:
        key: bytes | None = getattr(state, "session_key", None)
        if key is None:
            where = state.ctx.extra.get("session_key_file")
            key = load_key(Path(where) if where else None)
            state.session_key = key
    return key


# -- cookie values -----------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(key: bytes, purpose: str, value: str) -> str:
    return _b64(hmac.new(key, f"{purpose}:{value}".encode(), hashlib.sha256).digest())


def sign(key: bytes, token_id: int, expires_at: float) -> str:
    body = _b64(json.dumps({"t": token_id, "e": expires_at, "n": secrets.token_hex(8)}).encode())
    return f"{body}.{_mac(key, 'session', body)}"


def verify(key: bytes, value: str, now: float) -> tuple[int, float] | None:
    """(token id, expiry) of a well-signed, unexpired cookie value; None otherwise."""
    body, _, mac = value.partition(".")
    expected = _mac(key, "session", body).encode()
    if not body or not mac or not hmac.compare_digest(mac.encode("utf-8", "replace"), expected):
        return None
    try:
        data: Any = json.loads(_unb64(body))
        token_id, expires_at = int(data["t"]), float(data["e"])
    except (ValueError, KeyError, TypeError, binascii.Error):
        return None
    return (token_id, expires_at) if expires_at > now else None


def csrf_for(key: bytes, cookie_value: str) -> str:
    return _mac(key, "csrf", cookie_value)


# -- checks ------------------------------------------------------------------------------------


def _origin_of(url: str) -> str:
    """`scheme://host[:port]` of a URL, lower case (RFC 6454 §4: an origin is scheme, host, port)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def _same_origin(request: Request) -> bool:
    """Origin (else Referer), when the browser sends one, names this server: one of the configured
    dashboard origins (`api.dashboard_origins`) when there are any, else the origin of the
    request's own scheme and Host header (a value the client chooses, hence the setting)."""
    claimed = request.headers.get("origin") or request.headers.get("referer")
    if not claimed or claimed == "null":
        return claimed is None
    configured = request.app.state.ctx.extra.get("dashboard_origins") or ()
    if configured:
        return _origin_of(claimed) in {o.rstrip("/").lower() for o in configured}
    parts = urlsplit(claimed)
    host = request.headers.get("host", "")
    return parts.netloc == host and parts.scheme == request.url.scheme


def _refuse(msg: str, loc: str) -> ApiError:
    return ApiError(403, "forbidden", msg, [(loc, msg)])


def session_token(request: Request, store: Store, now: float) -> TokenRecord | None:
    """The active token behind the request's session cookie; None when there is no cookie.

    Raises 401 for a bad, expired or revoked session, 403 for an unsafe request without the
    session's CSRF token or from another origin."""
    value = request.cookies.get(COOKIE)
    if not value:
        return None
    key = _key(request)
    found = verify(key, value, now)
    expired = ApiError(
        401, "unauthorized", "the session has ended; log in again", [(f"cookie.{COOKIE}", "expired")]
    )
    if found is None:
        raise expired
    try:
        token = store.token(found[0])
    except NotFound:
        raise expired from None
    if token.revoked_at is not None or token.role not in _PEOPLE:
        raise expired
    if request.method not in SAFE_METHODS:
        sent = request.headers.get(CSRF_HEADER, "")
        if not hmac.compare_digest(sent.encode(), csrf_for(key, value).encode()):
            raise _refuse(f"missing or wrong {CSRF_HEADER} header", f"header.{CSRF_HEADER}")
        if not _same_origin(request):
            raise _refuse("request from another origin", "header.Origin")
    return token


# -- routes ------------------------------------------------------------------------------------


def _out(token: TokenRecord, csrf: str, expires_at: float | None, auth: bool) -> SessionOut:
    return SessionOut(
        name=token.owner,
        role=token.role,
        teams=list(token.teams),
        csrf_token=csrf,
        expires_at=expires_at,
        auth_enabled=auth,
    )


async def _given_token(request: Request) -> str:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    raw = ""
    if ctype == "application/json":
        try:
            raw = SessionIn.model_validate_json(await request.body()).token
        except ValueError as exc:
            raise ApiError(
                422, "invalid_request", 'expected {"token": "..."}', [("body.token", "missing")]
            ) from exc
    elif ctype == "application/x-www-form-urlencoded":  # parsed here: no python-multipart needed
        body = await request.body()
        values = parse_qs(body[: 4 * 1024].decode("utf-8", errors="replace")).get("token", [""])
        raw = values[0]
    else:
        raise ApiError(
            415,
            "unsupported_media_type",
            "send the token as JSON or a form",
            [("header.Content-Type", "use application/json or application/x-www-form-urlencoded")],
        )
    if not raw.strip():
        raise ApiError(422, "invalid_request", "a token is required", [("body.token", "missing")])
    return raw.strip()


def router() -> APIRouter:
    r = APIRouter(prefix="/v1", tags=["session"])

    @r.post(
        "/session",
        response_model=SessionOut,
        summary="Log in: a token in, a session cookie out",
        responses={401: {"model": ErrorOut}, 403: {"model": ErrorOut}, 415: {"model": ErrorOut}},
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": SessionIn.model_json_schema()},
                    "application/x-www-form-urlencoded": {"schema": SessionIn.model_json_schema()},
                },
            }
        },
    )
    async def login(request: Request, response: Response) -> SessionOut:
        ctx = request.app.state.ctx
        raw = await _given_token(request)
        if not _same_origin(request):
            raise _refuse("request from another origin", "header.Origin")
        token = ctx.store.authenticate(raw)
        if token is None or token.role not in _PEOPLE:
            raise ApiError(
                401, "unauthorized", "unknown or revoked token", [("body.token", "unknown or revoked")]
            )
        key = _key(request)
        expires_at = ctx.clock.wall() + SESSION_TTL_S
        value = sign(key, token.id, expires_at)
        response.set_cookie(
            COOKIE,
            value,
            max_age=int(SESSION_TTL_S),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path="/",
        )
        return _out(token, csrf_for(key, value), expires_at, ctx.auth_enabled)

    @r.get("/session", response_model=SessionOut, summary="Who this browser session is, and its CSRF token")
    def current(request: Request) -> SessionOut:
        ctx = request.app.state.ctx
        if not ctx.auth_enabled:
            local = TokenRecord(0, "local", "local", "admin", None, 0.0, None, ("*",), 100)
            return _out(local, "", None, False)
        token = session_token(request, ctx.store, ctx.clock.wall())
        if token is None:
            raise ApiError(401, "unauthorized", "not logged in", [(f"cookie.{COOKIE}", "missing")])
        value = request.cookies[COOKIE]
        found = verify(_key(request), value, ctx.clock.wall())
        return _out(token, csrf_for(_key(request), value), found[1] if found else None, True)

    @r.delete("/session", status_code=204, summary="Log out (clears the session cookie)")
    def logout(request: Request) -> Response:
        ctx = request.app.state.ctx
        if request.cookies.get(COOKIE):
            try:
                session_token(request, ctx.store, ctx.clock.wall())  # CSRF-checked like any unsafe call
            except ApiError as exc:
                if exc.status != 401:  # an ended session may always be cleared
                    raise
        response = Response(status_code=204)
        response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
        return response

    return r
