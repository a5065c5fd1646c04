"""Property-based fuzzing of the REST API from its own OpenAPI description (schemathesis 4).

Every documented operation is called with generated requests, valid and invalid, through the
real FastAPI app over a real SQLite store, with auth on and an admin token on every request.
The API must never answer 5xx, and its responses must match what its OpenAPI document says.
Path parameters name real data half of the time (a finished job, its step, a token), so the
fuzzer also reaches the code behind the 404s.

The operations are collected from the OpenAPI document of an app that is never called (the
document does not depend on the app's state); every request goes to the module's embedded
lowtide. (schemathesis' lazy `from_fixture` loader does not run on pytest 9.)

Bounded and deterministic: a fixed seed, derandomized Hypothesis, a small `max_examples` per
operation, and no loop running during fuzzing, so no attempt can be running and
``GET .../logs?follow=true`` answers at once instead of streaming.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import schemathesis
import yaml
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error, response_schema_conformance
from schemathesis.config import SchemathesisConfig

from lowtide.api.app import ApiContext, create_app
from lowtide.control.clock import SystemClock
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.states import JobState
from lowtide.store.repo import Store
from lowtide.wiring import Embedded
from support import embedded, tick_until

SEED = 20260715
MAX_EXAMPLES = 25

SEED_JOB = {
    "name": "seed",
    "team": "nlp",
    "params": {"lr": 0.1},
    "steps": [
        {"name": "hello", "command": ["echo", "hello"], "gpus": 0},
        {"name": "after", "command": ["echo", "{{params.lr}}"], "gpus": 1, "depends": ["hello"]},
    ],
}


def _document_app() -> FastAPI:
    """An app whose only use is its OpenAPI document (same routes; its store is never opened)."""
    store = Store.open("sqlite://", migrate_schema=False)  # no connection until a query: none is made
    return create_app(
        ApiContext(store=store, clock=SystemClock(), nodes=(), layout=ArtifactLayout("/unused", "/unused"))
    )


@dataclass
class Real:
    """Values of path parameters that name real data; filled by the `seeded` fixture."""

    values: dict[str, Any] = field(default_factory=dict)
    admin_token_id: int | None = None


REAL = Real()

schema = schemathesis.openapi.from_asgi(
    "/openapi.json",
    _document_app(),
    config=SchemathesisConfig.from_dict(
        {
            "seed": SEED,
            "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
        }
    ),
)


@schema.hook
def flatmap_path_parameters(
    _ctx: Any, path_parameters: dict[str, Any] | None
) -> st.SearchStrategy[dict[str, Any] | None]:
    """Half of the time, each path parameter names real data instead of the generated value.

    The fuzzer never revokes its own token: a generated token id that happens to be the admin's
    becomes the spare token's.
    """
    if not path_parameters or not REAL.values:
        return st.just(path_parameters)
    generated = dict(path_parameters)
    if generated.get("token_id") == REAL.admin_token_id:
        generated["token_id"] = REAL.values["token_id"]
    keys = sorted(k for k in generated if k in REAL.values)
    return st.fixed_dictionaries({k: st.booleans() for k in keys}).map(
        lambda pick: {k: (REAL.values[k] if pick.get(k) else v) for k, v in generated.items()}
    )


@dataclass
class Seeded:
    lt: Embedded
    admin: str
    job_id: str
    step: str
    token_id: int

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin}"}


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    lt = embedded(tmp_path_factory.mktemp("schemathesis"))
    now = lt.clock.now()
    admin_record, admin = lt.store.create_token(name="fuzzer", owner="fuzzer", role="admin", now=now)
    # A token the fuzzer may revoke (DELETE /v1/tokens/{id}) without losing its own.
    spare, _ = lt.store.create_token(name="spare", owner="spare", role="user", now=now)
    r = TestClient(lt.app).post(
        "/v1/jobs",
        content=yaml.safe_dump(SEED_JOB),
        headers={"Authorization": f"Bearer {admin}", "Content-Type": "application/yaml"},
    )
    assert r.status_code == 201, r.text
    job_id = str(r.json()["id"])
    lt.loop.recover()
    tick_until(lt, lambda: lt.store.job(job_id).state == JobState.SUCCEEDED, what="the seed job")
    assert not lt.store.active_attempts()  # so ?follow=true can never wait on a running attempt
    REAL.values = {"job_id": job_id, "step": "hello", "token_id": spare.id}
    REAL.admin_token_id = admin_record.id
    yield Seeded(lt, admin, job_id, "hello", spare.id)
    REAL.values, REAL.admin_token_id = {}, None
    lt.executor.close()
    lt.store.close()


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
def test_no_request_makes_the_api_fail_or_contradict_its_description(case: Any, seeded: Seeded) -> None:
    case.call_and_validate(
        app=seeded.lt.app,
        headers=seeded.headers,
        checks=[not_a_server_error, response_schema_conformance],
    )
    assert not seeded.lt.store.active_attempts()


def test_openapi_document_is_valid_openapi_3_and_submit_takes_yaml_and_json(seeded: Seeded) -> None:
    r = TestClient(seeded.lt.app).get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.")
    loaded = schemathesis.openapi.from_asgi("/openapi.json", seeded.lt.app)
    loaded.validate()
    for path in ("/v1/jobs", "/v1/jobs/validate"):
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert set(body["content"]) == {"application/yaml", "application/json"}
    labels = {result.ok().label for result in loaded.get_all_operations()}
    assert {"POST /v1/jobs", "POST /v1/jobs/validate", "GET /v1/jobs/{job_id}/steps/{step}/logs"} <= labels
    # The fuzzed operations are the real app's operations.
    assert labels == {result.ok().label for result in schema.get_all_operations()}


def test_the_real_path_parameters_name_existing_data(seeded: Seeded) -> None:
    client = TestClient(seeded.lt.app)
    assert client.get(f"/v1/jobs/{seeded.job_id}", headers=seeded.headers).status_code == 200
    r = client.get(f"/v1/jobs/{seeded.job_id}/steps/{seeded.step}/logs?follow=true", headers=seeded.headers)
    assert r.status_code == 200 and "hello" in r.text.splitlines()
    assert seeded.token_id in {t.id for t in seeded.lt.store.list_tokens()}


import collections, atexit
_SEEN: collections.Counter[tuple[str, int]] = collections.Counter()


@schema.hook
def after_call(ctx: Any, case: Any, response: Any) -> None:
    _SEEN[(case.operation.label, case.meta.phase.name.value if case.meta else "?", response.status_code)] += 1


atexit.register(lambda: print("\n".join(f"{k} {v}" for k, v in sorted(_SEEN.items()))))
