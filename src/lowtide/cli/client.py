"""A small HTTP client for the REST API, used by the CLI (and handy in scripts and tests).

Errors come back as `ApiFailure` with the API's located errors, so the CLI can print them and
exit 2 for a client-side problem (4xx) or 1 for a server-side one. Must not: print anything.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx


class ApiFailure(Exception):
    def __init__(self, status: int, message: str, errors: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.errors = errors or []

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
        if response.status_code >= 400:
            raise _failure(response)
        return response

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._request(method, path, **kwargs)
        return response.json() if response.content else None

    def submit(
        self, text: bytes, *, content_type: str, params: list[str], dry_run: bool = False
    ) -> dict[str, Any]:
        query: list[tuple[str, str]] = [("param", p) for p in params]
        path = "/v1/jobs/validate" if dry_run else "/v1/jobs"
        result: dict[str, Any] = self.json(
            "POST", path, content=text, headers={"Content-Type": content_type}, params=query
        )
        return result

    def stream_logs(self, job: str, step: str, *, attempt: int | None, follow: bool) -> Iterator[bytes]:
        params: dict[str, Any] = {"follow": follow}
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
    try:
        body = response.json()
        return ApiFailure(response.status_code, body.get("message", response.text), body.get("errors"))
    except ValueError:
        return ApiFailure(response.status_code, response.text or response.reason_phrase)
