"""Property-based fuzzing of the REST API from its own OpenAPI description (schemathesis 4).

Every documented operation is called with generated requests, valid and invalid, through the
real FastAPI app over a real store (SQLite, and the PostgreSQL server when it runs), with auth on
and an admin token on every request. The API must never answer 5xx, and its responses must match
what its OpenAPI document says. Path parameters name real data half of the time (a finished job,
its step, a token), and job specs are sometimes generated field by field rather than as opaque
text, so the fuzzer also reaches the code behind the 404s and behind spec validation. A plain
Hypothesis test submits many such specs (one odd field each), and an explicit test pins the
5xx the fuzzing found (huge offsets and ids, NUL in identifiers, retry counts past the store).
Bodies generated from the published job-spec JSON Schema alone (no hook) must create jobs.

The operations are collected from the OpenAPI document of an app that is never called (the
document does not depend on the app's state); every request goes to the module's embedded
lowtide. (schemathesis' lazy `from_fixture` loader does not run on pytest 9.)

Bounded and deterministic: a fixed seed, derandomized Hypothesis, a small `max_examples` per
operation, and no control loop running during fuzzing, so no attempt can be running and
``GET .../logs?follow=true`` answers at once instead of streaming.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import schemathesis
import sqlalchemy as sa
import yaml
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error, response_schema_conformance
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode

from lowtide.api.app import MAX_ID, ApiContext, create_app
from lowtide.control.clock import SystemClock
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.spec_issues import MAX_RETRIES
from lowtide.domain.spec_schema import job_spec_schema
from lowtide.domain.states import JobState
from lowtide.store.repo import Store
from lowtide.wiring import Embedded
from support import embedded, tick_until

SEED = 20260715
MAX_EXAMPLES = 25
SPEC_EXAMPLES = 150
SPEC_OPERATIONS = ("POST /v1/jobs", "POST /v1/jobs/validate")

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
    """Half of the time, each path parameter names real data instead of the generated value."""
    if not path_parameters or not REAL.values:
        return st.just(path_parameters)
    keys = sorted(k for k in path_parameters if k in REAL.values)
    return st.fixed_dictionaries({k: st.booleans() for k in keys}).map(
        lambda pick: {k: (REAL.values[k] if pick.get(k) else v) for k, v in path_parameters.items()}
    )


# Job specs built field by field: well formed, then (in most) one field set to a value from
# anywhere: a boundary or huge integer, another type, odd text, a bad placeholder. One odd field
# at a time gets past the other rules to that field's own rule, rendering and the store. (The
# OpenAPI document gives the JSON body the real job-spec schema, `domain.spec_schema`, so
# schemathesis' own bodies create jobs too, see the test below; YAML bodies are "a string".)
_BOUNDARY_INTS = st.sampled_from([-1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, MAX_RETRIES + 1])
_ODD = st.one_of(
    _BOUNDARY_INTS,
    st.integers(),
    st.floats(),
    st.none(),
    st.booleans(),
    st.text(max_size=70),
    st.lists(st.one_of(st.text(max_size=8), st.integers()), max_size=3),
    st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=2),
    st.sampled_from([["{{nope}}"], ["{{params.lr}}"], ["{{inputs.eval}}"], ["{{"], ["a\x00b"], "../x"]),
)
_WORDS = st.lists(
    st.sampled_from(["echo", "--out", "{{outputs}}", "{{job.id}}", "{{job.name}}", "{{step.name}}"]),
    min_size=1,
    max_size=3,
)
_STEP_NAMES = ("prep", "train", "eval")
_TOP_FIELDS = ("name", "team", "priority", "grace_seconds", "max_retries", "params", "steps", "use")
_STEP_FIELDS = ("name", "command", "gpus", "max_retries", "checkpoint", "image", "depends", "env")


@st.composite
def job_specs(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(_STEP_NAMES), min_size=1, max_size=3, unique=True))
    steps = []
    for i, name in enumerate(names):
        optional = {
            "gpus": st.integers(0, 2),
            "max_retries": st.integers(0, MAX_RETRIES),
            "checkpoint": st.booleans(),
            "image": st.just("registry/x:1"),
            "depends": st.lists(st.sampled_from(names[:i]), unique=True) if i else st.just([]),
            "env": st.dictionaries(st.sampled_from(["A", "B_2"]), st.text(max_size=8), max_size=2),
        }
        step = {"name": name, "command": draw(_WORDS)}
        for key in draw(st.lists(st.sampled_from(sorted(optional)), unique=True)):
            step[key] = draw(optional[key])
        steps.append(step)
    doc: dict[str, Any] = {"name": draw(st.sampled_from(["fuzz", "sft-8b"])), "steps": steps}
    optional = {
        "team": st.sampled_from(["nlp", "vision"]),
        "priority": st.one_of(st.sampled_from(["low", "normal", "high"]), st.integers(0, 100)),
        "grace_seconds": st.floats(0, 600),
        "max_retries": st.integers(0, MAX_RETRIES),
        "params": st.dictionaries(
            st.sampled_from(["lr", "base", "n"]),
            st.one_of(st.integers(-5, 5), st.floats(-1, 1), st.text(max_size=8), st.booleans()),
            max_size=3,
        ),
    }
    for key in draw(st.lists(st.sampled_from(sorted(optional)), unique=True)):
        doc[key] = draw(optional[key])
    if draw(st.integers(0, 3)):  # three specs in four: one field takes an odd value
        where = draw(st.sampled_from([doc, *steps]))
        where[draw(st.sampled_from(_TOP_FIELDS if where is doc else _STEP_FIELDS))] = draw(_ODD)
    return doc


@schema.hook
def flatmap_body(ctx: Any, body: Any) -> st.SearchStrategy[Any]:
    """The spec endpoints get a structured job spec half of the time (sent as JSON or YAML alike)."""
    if ctx.operation is None or ctx.operation.label not in SPEC_OPERATIONS:
        return st.just(body)
    return st.one_of(st.just(body), job_specs())


@schema.hook
def flatmap_query(ctx: Any, query: dict[str, Any] | None) -> st.SearchStrategy[dict[str, Any] | None]:
    """Spec parameter overrides (`?param=k=v`) are mostly well formed, so the spec itself is read."""
    if ctx.operation is None or ctx.operation.label not in SPEC_OPERATIONS:
        return st.just(query)
    overrides = st.lists(
        st.sampled_from(["lr=0.5", "n=3", "base=s3://b/m", "flag=true", "lr=.nan", "9x=1", "noequals"]),
        max_size=2,
    )
    return st.one_of(st.just(query), st.just({}), overrides.map(lambda p: {"param": p}))


def _empty_pg(url: str) -> None:
    """The session's PostgreSQL database, emptied (other modules' tests share it)."""
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text("DROP SCHEMA public CASCADE"))
        conn.execute(sa.text("CREATE SCHEMA public"))
    engine.dispose()


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

    def client(self) -> TestClient:
        return TestClient(self.lt.app, raise_server_exceptions=False)


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def seeded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    """An embedded lowtide (auth on) with one finished two-step job and a spare token."""
    overrides: dict[str, Any] = {}
    if request.param == "postgresql":
        url: str = request.getfixturevalue("pg_database_url")
        _empty_pg(url)
        overrides["store_url"] = url
    lt = embedded(tmp_path_factory.mktemp(f"schemathesis-{request.param}"), **overrides)
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
    lt.close()


def _sendable(body: Any) -> bool:
    """Whether a generated body can be sent: anything but JSON with a non-finite float."""
    if not isinstance(body, dict | list | float):
        return True
    try:
        json.dumps(body, allow_nan=False)
    except (ValueError, TypeError):
        return False
    return True


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
def test_no_request_makes_the_api_fail_or_contradict_its_description(case: Any, seeded: Seeded) -> None:
    # A JSON body with inf/NaN cannot be sent (JSON has no such numbers: the client refuses it).
    assume(_sendable(case.body))
    params = case.path_parameters
    if params and str(params.get("token_id")) == str(REAL.admin_token_id):  # never revoke the fuzzer's own
        params["token_id"] = seeded.token_id
    case.call_and_validate(
        app=seeded.lt.app,
        headers=seeded.headers,
        checks=[not_a_server_error, response_schema_conformance],
    )
    assert not seeded.lt.store.active_attempts()  # nothing runs: a follow=true stream ends at once


@settings(max_examples=SPEC_EXAMPLES, derandomize=True, database=None, deadline=None)
@given(spec=job_specs(), as_yaml=st.booleans())
def test_any_job_spec_is_stored_or_refused_with_located_errors(
    seeded: Seeded, spec: dict[str, Any], as_yaml: bool
) -> None:
    body = yaml.safe_dump(spec) if as_yaml else json.dumps(spec)
    content_type = "application/yaml" if as_yaml else "application/json"
    client = seeded.client()
    r = client.post("/v1/jobs", content=body, headers={**seeded.headers, "Content-Type": content_type})
    assert r.status_code in (201, 422), r.text
    if r.status_code == 422:
        errors = r.json()["errors"]
        assert errors and all(e["loc"] and e["msg"] for e in errors), r.text
        return
    job = r.json()
    d = client.get(f"/v1/jobs/{job['id']}", headers=seeded.headers)
    assert d.status_code == 200
    assert [s["name"] for s in d.json()["steps"]] == [s["name"] for s in spec["steps"]]
    assert d.json()["job"]["state"] == "QUEUED"


# The job-spec schema the API publishes (domain.spec_schema), read by schemathesis with no hook:
# its generated documents alone must reach the parser and the store, i.e. create jobs.
SCHEMA_EXAMPLES = 100
plain_schema = schemathesis.openapi.from_asgi(
    "/openapi.json",
    _document_app(),
    config=SchemathesisConfig.from_dict(
        {
            "seed": SEED,
            "generation": {"mode": "positive", "allow-x00": False, "deterministic": True, "database": "none"},
        }
    ),
)


def test_the_published_job_schema_lets_the_fuzzer_create_jobs(seeded: Seeded) -> None:
    """Bodies generated from the published JSON Schema of a job spec (no hand-written strategy)
    are stored (201) or refused with located errors (422; what a schema cannot say: placeholders,
    node sizes, integral floats), never a 5xx; and some of them do create jobs."""
    statuses: list[int] = []
    operation = plain_schema["/v1/jobs"]["POST"]

    @settings(
        max_examples=SCHEMA_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    def submit(case: Any) -> None:
        case.query = None  # overrides are fuzzed by the main test; here the body is what counts
        r = case.call(app=seeded.lt.app, headers=seeded.headers)
        assert r.status_code in (201, 422), r.text
        if r.status_code == 422:
            assert all(e["loc"] and e["msg"] for e in r.json()["errors"]), r.text
        statuses.append(r.status_code)

    submit()
    created = statuses.count(201)
    assert created >= 1, f"no generated spec was stored: {statuses}"


def test_the_real_path_parameters_name_existing_data(seeded: Seeded) -> None:
    client = seeded.client()
    assert client.get(f"/v1/jobs/{seeded.job_id}", headers=seeded.headers).status_code == 200
    r = client.get(f"/v1/jobs/{seeded.job_id}/steps/{seeded.step}/logs?follow=true", headers=seeded.headers)
    assert r.status_code == 200 and "hello" in r.text.splitlines()
    assert seeded.token_id in {t.id for t in seeded.lt.store.list_tokens()}


def test_values_past_what_the_store_or_a_file_can_hold_are_refused_not_5xx(seeded: Seeded) -> None:
    """Regressions for the 5xx the fuzzing found (huge offsets and ids, NUL, huge retry counts)."""
    client, h = seeded.client(), seeded.headers
    logs = f"/v1/jobs/{seeded.job_id}/steps/{seeded.step}/logs"
    whole = client.get(logs, headers=h)
    assert whole.status_code == 200 and whole.text
    size = len(whole.content)
    for offset in (size, 2**50, 2**63 - 1, 2**63, 2**70):  # past the end: nothing, not a failed seek
        for follow in ("false", "true"):
            r = client.get(logs, params={"offset": offset, "follow": follow}, headers=h)
            assert (r.status_code, r.text) == (200, ""), (offset, follow, r.text)
    assert client.get(logs, params={"offset": size - 1}, headers=h).content == whole.content[-1:]

    for token_id in (0, -1, -(2**31) - 1, MAX_ID + 1, 2**63, 2**70):
        r = client.delete(f"/v1/tokens/{token_id}", headers=h)
        assert r.status_code == 422 and _locs(r) == ["path.token_id"], r.text
    assert client.delete(f"/v1/tokens/{MAX_ID}", headers=h).status_code == 404

    nul = [
        ("/v1/jobs/a%00b", {}, "path.job_id"),
        (f"/v1/jobs/{seeded.job_id}/steps/a%00b/logs", {}, "path.step"),
        ("/v1/jobs", {"team": "a\x00"}, "query.team"),
        ("/v1/jobs", {"owner": "\x00"}, "query.owner"),
        ("/v1/jobs", {"name": "x\x00y"}, "query.name"),
    ]
    for url, params, loc in nul:
        r = client.get(url, params=params, headers=h)
        assert r.status_code == 422 and _locs(r) == [loc], (url, r.text)
    for action in ("cancel", "rerun"):
        r = client.post(f"/v1/jobs/a%00b/{action}", headers=h)
        assert r.status_code == 422 and _locs(r) == ["path.job_id"], r.text
    r = client.post(
        f"/v1/jobs/{seeded.job_id}/steps/{seeded.step}/checkpoints", json={"label": "a\x00"}, headers=h
    )
    assert r.status_code == 422 and _locs(r) == ["body.label"], r.text

    def submit(doc: dict[str, Any]) -> Any:
        return client.post("/v1/jobs", json=doc, headers=h)

    step = {"name": "a", "command": ["true"]}
    for retries in (MAX_RETRIES + 1, 2**31, 2**63):
        r = submit({"name": "x", "max_retries": retries, "steps": [{**step, "max_retries": retries}]})
        assert r.status_code == 422 and _locs(r) == ["max_retries", "steps[0].max_retries"], r.text
    r = submit({"name": "x", "max_retries": MAX_RETRIES, "steps": [{**step, "max_retries": MAX_RETRIES}]})
    assert r.status_code == 201, r.text
    assert seeded.lt.store.job(r.json()["id"]).state == JobState.QUEUED


def test_openapi_document_is_valid_openapi_3_and_submit_takes_yaml_and_json(tmp_path: Path) -> None:
    lt = embedded(tmp_path)
    try:
        r = TestClient(lt.app).get("/openapi.json")  # served without a token
        assert r.status_code == 200
        doc = r.json()
        assert doc["openapi"].startswith("3.")
        loaded = schemathesis.openapi.from_asgi("/openapi.json", lt.app)
        loaded.validate()  # against the OpenAPI 3 meta-schema
        for path in ("/v1/jobs", "/v1/jobs/validate"):
            body = doc["paths"][path]["post"]["requestBody"]
            assert body["required"] is True
            assert set(body["content"]) == {"application/yaml", "application/json"}
            assert body["content"]["application/yaml"]["schema"] == {"type": "string"}
            assert body["content"]["application/json"]["schema"] == job_spec_schema()
        labels = {result.ok().label for result in loaded.get_all_operations()}
        assert {
            *SPEC_OPERATIONS,
            "GET /v1/jobs/{job_id}/steps/{step}/logs",
            "DELETE /v1/tokens/{token_id}",
        } <= labels
        # The fuzzed operations are exactly the served app's.
        assert labels == {result.ok().label for result in schema.get_all_operations()}
    finally:
        lt.close()


def _locs(response: Any) -> list[str]:
    return [e["loc"] for e in response.json()["errors"]]
