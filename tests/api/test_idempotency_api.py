"""Idempotent submits through the real API and CLI (docs/architecture.md §4.4): `Idempotency-Key`
on POST /v1/jobs and /rerun returns the same job on a replay, refuses the key for another
request (422) and malformed keys (422, located); `lowtide submit` sends a fresh key and retries
with it while lowtide answers 503 or cannot be reached."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import yaml
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from lowtide.cli.client import ApiFailure, Client
from lowtide.cli.main import app as cli_app
from lowtide.store.schema import jobs
from lowtide.wiring import Embedded
from support import Served, embedded

DOC = {"name": "sft", "steps": [{"name": "s", "command": ["echo", "hi"]}]}


@pytest.fixture
def lt(tmp_path: Path) -> Iterator[Embedded]:
    system = embedded(tmp_path, auth={"enabled": False})
    yield system
    system.close()


def post(lt: Embedded, doc: Any = DOC, key: str | None = "key-1", path: str = "/v1/jobs", **kw: Any) -> Any:
    headers = {"Content-Type": "application/yaml"}
    if key is not None:
        headers["Idempotency-Key"] = key
    return TestClient(lt.app).post(path, content=yaml.safe_dump(doc), headers=headers, **kw)


def test_a_replay_returns_the_same_job(lt: Embedded) -> None:
    first = post(lt)
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    again = post(lt)
    assert again.status_code == 201, again.text
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Location"] == first.headers["Location"]
    assert len(lt.store.list_jobs()) == 1
    assert post(lt, key="key-2").json()["id"] != first.json()["id"]  # a new key: a new job
    assert post(lt, key=None).status_code == 201  # no key: as before
    assert len(lt.store.list_jobs()) == 3


def test_the_same_key_for_another_request_is_refused(lt: Embedded) -> None:
    job_id = post(lt).json()["id"]
    other = post(lt, doc={**DOC, "name": "other"})
    assert other.status_code == 422
    assert other.json()["error"] == "idempotency_conflict" and job_id in other.json()["message"]
    assert [e["loc"] for e in other.json()["errors"]] == ["header.Idempotency-Key"]
    assert post(lt, params={"param": "x=1"}).status_code == 422  # a different override is another request
    assert len(lt.store.list_jobs()) == 1


@pytest.mark.parametrize("key", [b"", b"x" * 129, "caf\u00e9".encode("latin-1"), b"tab\there"])
def test_malformed_keys_are_refused_with_the_header_named(lt: Embedded, key: bytes) -> None:
    headers: dict[str, str | bytes] = {"Content-Type": "application/yaml", "Idempotency-Key": key}
    r = TestClient(lt.app).post("/v1/jobs", content=yaml.safe_dump(DOC).encode(), headers=headers)
    assert r.status_code == 422, r.text
    assert [e["loc"] for e in r.json()["errors"]] == ["header.Idempotency-Key"]
    assert lt.store.list_jobs() == []


def test_a_rerun_with_a_key_is_idempotent_too(lt: Embedded) -> None:
    job_id = post(lt, key=None).json()["id"]
    path = f"/v1/jobs/{job_id}/rerun"
    first = TestClient(lt.app).post(path, headers={"Idempotency-Key": "r-1"})
    again = TestClient(lt.app).post(path, headers={"Idempotency-Key": "r-1"})
    assert first.status_code == again.status_code == 201
    assert again.json()["id"] == first.json()["id"] and again.headers["Idempotent-Replayed"] == "true"
    assert len(lt.store.list_jobs()) == 2


def test_lowtide_submit_sends_a_fresh_key_each_time(lt: Embedded, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(DOC))
    served = Served(lt.app)
    try:
        for _ in range(2):
            result = CliRunner().invoke(cli_app, ["--url", served.url, "--token", "x", "submit", str(spec)])
            assert result.exit_code == 0, result.output
    finally:
        served.close()
    with lt.store.engine.connect() as conn:
        keys = conn.execute(sa.select(jobs.c.idempotency_key)).scalars().all()
    assert len(keys) == 2 and all(keys) and len(set(keys)) == 2


def test_the_client_retries_503_and_lost_connections_with_the_same_key() -> None:
    seen: list[str | None] = []
    answers = iter(["connect", "503", "201"])

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Idempotency-Key"))
        answer = next(answers)
        if answer == "connect":
            raise httpx.ConnectError("refused", request=request)
        if answer == "503":
            body = {"error": "store_unavailable", "message": "store down", "errors": []}
            return httpx.Response(503, json=body, headers={"Retry-After": "2"})
        return httpx.Response(201, json={"id": "job-1"})

    client = Client("http://lowtide.test", None)
    client.http = httpx.Client(base_url=client.url, transport=httpx.MockTransport(handler))
    waits: list[float] = []
    told: list[int] = []
    result = client.submit(
        b"name: x\n",
        content_type="application/yaml",
        params=[],
        idempotency_key="k-9",
        retry_for_s=30,
        on_retry=lambda failure, wait: told.append(failure.status),
        sleep=waits.append,
    )
    assert result == {"id": "job-1"}
    assert seen == ["k-9", "k-9", "k-9"]
    assert told == [0, 503] and waits == [0.5, 2.0]  # backoff, then the server's Retry-After

    answers = iter(["503"] * 10)
    with pytest.raises(ApiFailure) as caught:  # bounded: gives up when the time is spent
        client.submit(
            b"x",
            content_type="application/yaml",
            params=[],
            idempotency_key="k",
            retry_for_s=3,
            sleep=waits.append,
        )
    assert caught.value.status == 503
