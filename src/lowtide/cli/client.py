"""A small HTTP client for the REST API, used by the CLI (and handy in scripts and tests).

Errors come back as `ApiFailure` with the API's located errors, so the CLI can print them and
exit 2 for a client-side problem (4xx) or 1 for a server-side one. `submit` sends an
``Idempotency-Key`` when given one and, with `retry_for_s`, retries with that same key while
lowtide is unreachable or answers 502/503/504 (honouring ``Retry-After``), so a retry never
makes a second job (docs/architecture.md §4.4). Must not: print anything (`on_retry` tells the
caller).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

#: Statuses after which a submit is retried (with the same idempotency key).
RETRY_STATUSES = frozenset({502, 503, 504})
#: The longest wait between two submit tries, whatever ``Retry-After`` says.
MAX_RETRY_WAIT_S = 10.0


class ApiFailure(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        errors: list[dict[str, str]] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.errors = errors or []
        self.retry_after = retry_after  # the server's Retry-After, in seconds

    @property
    def client_error(self) -> bool:
        return 400 <= self.status < 500


class Client:
    def __init__(self, url: str, token: str | None, *, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.ConnectError as exc:
            raise ApiFailure(
                0, f"cannot reach lowtide at {self.url} ({exc}); is `lowtide up` running?"
            ) from exc
        except httpx.TimeoutException as exc:
            raise ApiFailure(0, f"lowtide at {self.url} did not answer in time") from exc
        except httpx.TransportError as exc:  # the connection broke mid-request
            raise ApiFailure(0, f"lost the connection to lowtide at {self.url} ({exc})") from exc
        if response.status_code >= 400:
            raise _failure(response)
        return response

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._request(method, path, **kwargs)
        return response.json() if response.content else None

    def submit(
        self,
        text: bytes,
        *,
        content_type: str,
        params: list[str],
        dry_run: bool = False,
        idempotency_key: str | None = None,
        retry_for_s: float = 0.0,
        on_retry: Callable[[ApiFailure, float], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> dict[str, Any]:
        """POST the spec. With `retry_for_s` > 0 and an `idempotency_key`, an unreachable
        lowtide or a 502/503/504 is retried with the same key for up to `retry_for_s` seconds
        (waits double from 0.5 s, or follow ``Retry-After``, at most `MAX_RETRY_WAIT_S`);
        `on_retry(failure, wait)` is called before each wait."""
        query: list[tuple[str, str]] = [("param", p) for p in params]
        path = "/v1/jobs/validate" if dry_run else "/v1/jobs"
        headers = {"Content-Type": content_type}
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        budget = retry_for_s if idempotency_key is not None else 0.0
        began, slept, wait = time.monotonic(), 0.0, 0.5
        while True:
            try:
                result: dict[str, Any] = self.json("POST", path, content=text, headers=headers, params=query)
                return result
            except ApiFailure as failure:
                if failure.status != 0 and failure.status not in RETRY_STATUSES:
                    raise
                asked = failure.retry_after
                pause = min(MAX_RETRY_WAIT_S, asked if asked is not None else wait)
                if max(time.monotonic() - began, slept) + pause > budget:
                    raise
                if on_retry is not None:
                    on_retry(failure, pause)
                sleep(pause)
                slept += pause
                wait = min(MAX_RETRY_WAIT_S, wait * 2)

    def stream_logs(
        self, job: str, step: str, *, attempt: int | None, follow: bool, offset: int = 0
    ) -> Iterator[bytes]:
        params: dict[str, Any] = {"follow": follow}
        if offset:
            params["offset"] = offset
        if attempt is not None:
            params["attempt"] = attempt
        try:
            with self.http.stream(
                "GET", f"/v1/jobs/{job}/steps/{step}/logs", params=params, timeout=None
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _failure(response)
                yield from response.iter_bytes()
        except httpx.ConnectError as exc:
            raise ApiFailure(
                0, f"cannot reach lowtide at {self.url} ({exc}); is `lowtide up` running?"
            ) from exc


def _failure(response: httpx.Response) -> ApiFailure:
    retry_after = _retry_after(response.headers.get("Retry-After"))
    try:
        body = response.json()
        return ApiFailure(
            response.status_code, body.get("message", response.text), body.get("errors"), retry_after
        )
    except (ValueError, AttributeError):
        return ApiFailure(response.status_code, response.text or response.reason_phrase, None, retry_after)


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in delay-seconds form (RFC 9110 §10.2.3); None for a date or garbage."""
    if value is None or not value.strip().isdigit():
        return None
    return float(value.strip())
