"""One error shape for every 4xx the API returns, and the handlers that produce it.

Body: ``{"error": <code>, "message": <one line>, "errors": [{"loc": <where>, "msg": <why>}]}``.
`loc` names the field (``steps[1].depends[0]``, ``query.limit``, ``header.Authorization``).
A store outage (`records.StoreUnavailable`, classified by the store; docs/architecture.md §4.4)
answers 503 ``store_unavailable`` with ``Retry-After``, never 500: the request may be retried;
so does a write refused because this control plane just lost its lease (`records.FencedOut`:
503 ``not_leader``).
Must not: hide 5xx causes in logs (unexpected errors are logged with their traceback).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lowtide.control.records import FencedOut, StoreUnavailable

log = logging.getLogger("lowtide.api")

#: Seconds a client is told to wait (``Retry-After``) when the store is unavailable.
STORE_RETRY_AFTER_S = 5


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        error: str,
        message: str,
        errors: Sequence[tuple[str, str]] = (),
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error = error
        self.message = message
        self.errors = list(errors)
        self.headers = headers


def error_body(error: str, message: str, errors: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    return {"error": error, "message": message, "errors": [{"loc": loc, "msg": msg} for loc, msg in errors]}


def _loc(parts: Sequence[Any]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.error, exc.message, exc.errors), status_code=exc.status, headers=exc.headers
        )

    @app.exception_handler(StoreUnavailable)
    async def _store_unavailable(_request: Request, exc: StoreUnavailable) -> JSONResponse:
        return JSONResponse(
            error_body(
                "store_unavailable",
                f"lowtide's store is unavailable ({exc.reason}); retry later (a submit with the same "
                "Idempotency-Key never makes a second job)",
                [("store", exc.reason)],
            ),
            status_code=503,
            headers={"Retry-After": str(STORE_RETRY_AFTER_S)},
        )

    @app.exception_handler(FencedOut)
    async def _fenced_out(_request: Request, exc: FencedOut) -> JSONResponse:
        # This control plane lost the lease mid-request (docs/architecture.md §4.4): the write
        # was refused; once it stands by, its writes go through unfenced.
        return JSONResponse(
            error_body("not_leader", f"lowtide is changing leaders ({exc}); retry", [("control", str(exc))]),
            status_code=503,
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [(_loc(e.get("loc", ())), str(e.get("msg", "invalid"))) for e in exc.errors()]
        return JSONResponse(
            error_body("invalid_request", "the request is not valid", errors), status_code=422
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(
            error_body(code, str(exc.detail)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )
