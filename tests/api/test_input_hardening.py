"""Input that cannot break the API (issue 10, defects 5-7): bounded numbers with short excerpts,
checkpoint labels under one rule, the unknown-parameter check, warnings, media types a browser
cannot send cross-site, CORS closed by default, and auth off only on loopback.

Through the real FastAPI app (in process) over a real SQLite store, auth on unless a test says."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from lowtide.config import ConfigError, auth_exposure_problem
from lowtide.control.contract import parse_checkpoint_label
from lowtide.wiring import Embedded, serve
from support import embedded, settings_for, step_attempt_token

GOOD: dict[str, Any] = {
    "name": "sft",
    "team": "nlp",
    "params": {"lr": 0.1},
    "steps": [{"name": "prep", "command": ["echo", "{{params.lr}}"], "checkpoint": True}],
}
HUGE = "9" * 5000  # past Python's 4,300-digit limit for int <-> str


class Api:
    def __init__(self, lt: Embedded) -> None:
        self.lt = lt
        self.client = TestClient(lt.app, raise_server_exceptions=False)
        _, self.token = lt.store.create_token(name="root", owner="root", role="admin", now=lt.clock.now())

    def post(self, path: str, body: str | bytes, content_type: str | None, **kw: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        return self.client.post(path, content=body, headers=headers, **kw)

    def jobs(self) -> int:
        return len(self.lt.store.list_jobs())


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    lt = embedded(tmp_path)
    yield Api(lt)
    lt.close()


def _dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def locs(r: Any) -> list[str]:
    return [e["loc"] for e in r.json()["errors"]]


# --------------------------------------------------------------------------- numbers and excerpts


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/jobs/validate"])
def test_huge_integers_are_a_located_422_that_echoes_only_an_excerpt(api: Api, path: str) -> None:
    as_json = json.dumps(GOOD)
    as_json = as_json.replace('"checkpoint": true', f'"checkpoint": true, "gpus": {HUGE}')
    as_json = as_json.replace('"lr": 0.1', f'"lr": -{HUGE}')
    r = api.post(path, as_json, "application/json")
    assert r.status_code == 422, r.text
    assert locs(r) == ["params.lr", "steps[0].gpus"]
    assert len(r.content) < 2000 and HUGE[:200] not in r.text
    assert all("integer out of range" in e["msg"] and "5000 digits" in e["msg"] for e in r.json()["errors"])

    as_yaml = yaml.safe_dump({**GOOD, "max_retries": 1}).replace("max_retries: 1", f"max_retries: {HUGE}")
    r = api.post(path, as_yaml, "application/yaml")
    assert r.status_code == 422 and locs(r) == ["max_retries"], r.text
    assert len(r.content) < 2000 and "…" in r.text  # the YAML variant no longer echoes all digits

    r = api.post(path, yaml.safe_dump(GOOD), "application/yaml", params={"param": f"lr={HUGE}"})
    assert r.status_code == 422 and locs(r) == ["query.param[0]"] and len(r.content) < 2000, r.text
    assert api.jobs() == 0


def test_64_bit_integers_are_the_bound(api: Api) -> None:
    for value, status in ((2**63 - 1, 201), (-(2**63), 201), (2**63, 422), (-(2**63) - 1, 422)):
        r = api.post("/v1/jobs", json.dumps({**GOOD, "params": {"lr": value}}), "application/json")
        assert r.status_code == status, (value, r.text)
        if status == 422:
            assert locs(r) == ["params.lr"]


def test_non_finite_numbers_are_located(api: Api) -> None:
    text = json.dumps({**GOOD, "grace_seconds": 1.0, "params": {"lr": 1.0}})
    text = text.replace('"grace_seconds": 1.0', '"grace_seconds": Infinity').replace('"lr": 1.0', '"lr": NaN')
    r = api.post("/v1/jobs", text, "application/json")
    assert r.status_code == 422 and sorted(locs(r)) == ["grace_seconds", "params.lr"], r.text
    r = api.post("/v1/jobs", yaml.safe_dump(GOOD), "application/yaml", params={"param": "lr=.inf"})
    assert r.status_code == 422 and locs(r) == ["query.param[0]"], r.text


def test_long_values_are_echoed_as_an_excerpt(api: Api) -> None:
    long = "x" * 200_000
    doc = {**GOOD, "name": long, long: 1, "use": long}
    r = api.post("/v1/jobs/validate", json.dumps(doc), "application/json")
    assert r.status_code == 422 and len(r.content) < 4000, r.text[:500]
    assert "x" * 65 not in r.text


# --------------------------------------------------------------------------- parameters and warnings


def test_an_override_of_an_undeclared_parameter_is_refused_at_the_query(api: Api) -> None:
    r = api.post("/v1/jobs", yaml.safe_dump(GOOD), "application/yaml", params=[("param", "unknown=1")])
    assert r.status_code == 422 and locs(r) == ["query.param[0]"], r.text
    assert "'unknown' is not a parameter of this job (it has: lr)" in r.json()["errors"][0]["msg"]
    r = api.post(
        "/v1/jobs", yaml.safe_dump(GOOD), "application/yaml", params=[("param", "lr=0.5"), ("param", "x=1")]
    )
    assert r.status_code == 422 and locs(r) == ["query.param[1]"], r.text
    assert api.jobs() == 0
    r = api.post("/v1/jobs", yaml.safe_dump(GOOD), "application/yaml", params=[("param", "lr=0.5")])
    assert r.status_code == 201 and api.lt.store.job(r.json()["id"]).spec["params"] == {"lr": 0.5}


def test_an_image_with_the_process_runtime_is_accepted_with_a_warning(api: Api) -> None:
    with_image = {**GOOD, "steps": [{**GOOD["steps"][0], "image": "registry/x:1"}]}
    for path, status in (("/v1/jobs/validate", 200), ("/v1/jobs", 201)):
        r = api.post(path, yaml.safe_dump(with_image), "application/yaml")
        assert r.status_code == status, r.text
        [warning] = r.json()["warnings"]
        assert warning["loc"] == "steps[0].image" and "executor.runtime: process" in warning["msg"]
        r = api.post(path, yaml.safe_dump(GOOD), "application/yaml")
        assert r.status_code == status and r.json()["warnings"] == []


# --------------------------------------------------------------------------- media types and CORS


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain; charset=utf-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,
    ],
)
def test_types_a_browser_sends_cross_site_are_refused(api: Api, content_type: str | None) -> None:
    for path in ("/v1/jobs", "/v1/jobs/validate"):
        r = api.post(path, yaml.safe_dump(GOOD), content_type)
        assert r.status_code == 415 and locs(r) == ["header.Content-Type"], r.text
        assert "application/yaml or application/json" in r.json()["errors"][0]["msg"]
    assert api.jobs() == 0
    assert api.post("/v1/jobs", yaml.safe_dump(GOOD), "application/yaml").status_code == 201


def _preflight(client: TestClient, origin: str) -> Any:
    return client.options(
        "/v1/jobs",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )


def test_cors_is_closed_by_default(api: Api) -> None:
    r = _preflight(api.client, "https://evil.example")
    assert "access-control-allow-origin" not in r.headers and r.status_code >= 400
    r = api.client.get(
        "/v1/jobs", headers={"Origin": "https://evil.example", "Authorization": f"Bearer {api.token}"}
    )
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_opens_for_the_configured_origins_only(tmp_path: Path) -> None:
    lt = embedded(tmp_path, api={"cors_origins": ["https://dash.example.org"]})
    try:
        client = TestClient(lt.app)
        r = _preflight(client, "https://dash.example.org")
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://dash.example.org"
        r = _preflight(client, "https://evil.example")
        assert "access-control-allow-origin" not in r.headers
    finally:
        lt.close()
    with pytest.raises(ConfigError, match=r"api.cors_origins: \[0\]"):
        settings_for(_dir(tmp_path / "star"), api={"cors_origins": ["*"]})


# --------------------------------------------------------------------------- auth off


def test_auth_off_is_refused_off_loopback(tmp_path: Path) -> None:
    for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost"):
        settings_for(_dir(tmp_path / host.replace(":", "_")), auth={"enabled": False}, api={"host": host})
    for host in ("0.0.0.0", "192.168.1.10", "::", "lowtide.example.org"):
        with pytest.raises(ConfigError, match=r"auth\.enabled: false is allowed only with a loopback"):
            settings_for(_dir(tmp_path / "x"), auth={"enabled": False}, api={"host": host})
    # `lowtide up --host 0.0.0.0` copies the settings without validation: serve checks again
    # before it binds or locks anything.
    settings = settings_for(_dir(tmp_path / "up"), auth={"enabled": False})
    exposed = settings.model_copy(update={"api": settings.api.model_copy(update={"host": "0.0.0.0"})})
    assert auth_exposure_problem(settings) is None
    assert "auth.enabled" in (auth_exposure_problem(exposed) or "")
    with pytest.raises(ConfigError, match=r"auth\.enabled"):
        serve(exposed, announce=False)
    assert not (tmp_path / "up" / "state" / "lowtide.lock").exists()


# --------------------------------------------------------------------------- checkpoint labels


def test_checkpoint_labels_follow_one_rule() -> None:
    ck = "/art/jobs/j/train/checkpoints"
    for good in ("step-9", "  step-9\n", "[/bold]ckpt", "sub/dir/step-1", f"{ck}/step-1", f"file://{ck}/x"):
        assert parse_checkpoint_label(good, checkpoint_dir=ck) == good.strip()
    assert parse_checkpoint_label("s3://b/ck/x", checkpoint_dir="s3://b/ck") == "s3://b/ck/x"
    for bad, why in [
        ("", "empty"),
        ("a\nb", "single line"),
        ("x" * 1025, "longer"),
        ("a\x00b", "control"),
        ("\x1b[2Jwiped", "control"),
        ("a\x9bb", "control"),
        ("a\u202eb", "control"),
        ("../../../../etc/passwd", r"'\.\.'"),
        ("ok/../../x", r"'\.\.'"),
        (f"{ck}/../../other/checkpoints/x", r"'\.\.'"),
        ("/etc/passwd", "inside the step's checkpoint directory"),
        ("/art/jobs/other/train/checkpoints/x", "inside the step's checkpoint directory"),
        (f"{ck}-evil/x", "inside the step's checkpoint directory"),
        ("file://relative", "inside the step's checkpoint directory"),
        ("s3://b/other/x", "inside the step's checkpoint directory"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_checkpoint_label(bad, checkpoint_dir=ck)
    with pytest.raises(ValueError, match="has none"):
        parse_checkpoint_label("/abs/x", checkpoint_dir=None)


def test_the_api_refuses_the_labels_latest_would_refuse(api: Api) -> None:
    lt = api.lt
    job = api.post("/v1/jobs", yaml.safe_dump(GOOD), "application/yaml").json()["id"]
    _, step_token = step_attempt_token(lt, job, "prep")
    ck = lt.loop.settings.layout.checkpoints(job, "prep")
    url = f"/v1/jobs/{job}/steps/prep/checkpoints"
    headers = {"Authorization": f"Bearer {step_token}"}
    for bad in ("../../../../etc/passwd", "\x1b[2J", "a\u202eb", "/etc/passwd", "   "):
        r = api.client.post(url, json={"label": bad}, headers=headers)
        assert r.status_code == 422 and locs(r) == ["body.label"], (bad, r.text)
    assert not lt.store.job_detail(job).checkpoints
    for good in ("[/bold]ckpt", f"{ck}/step-2"):
        r = api.client.post(url, json={"label": f" {good} "}, headers=headers)
        assert r.status_code == 201 and r.json()["label"] == good, r.text
    assert [c.label for c in lt.store.job_detail(job).checkpoints] == ["[/bold]ckpt", f"{ck}/step-2"]
