"""The REST API through its real FastAPI app (in process), with auth on and a real SQLite store."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from lowtide.wiring import Embedded
from support import embedded, step_attempt_token

GOOD = {
    "name": "sft",
    "team": "nlp",
    "params": {"lr": 0.1},
    "steps": [
        {"name": "prep", "command": ["echo", "prep"], "gpus": 0},
        {"name": "train", "command": ["echo", "{{params.lr}}"], "gpus": 2, "depends": ["prep"]},
    ],
}


class Api:
    def __init__(self, lt: Embedded) -> None:
        self.lt = lt
        self.client = TestClient(lt.app)
        now = lt.clock.now()
        _, self.admin = lt.store.create_token(name="root", owner="root", role="admin", now=now)
        # Teammates in nlp: they see each other's jobs (docs/architecture.md §11).
        nlp = ["nlp"]
        _, self.alice = lt.store.create_token(name="alice", owner="alice", role="user", now=now, teams=nlp)
        _, self.bob = lt.store.create_token(name="bob", owner="bob", role="user", now=now, teams=nlp)

    def h(self, token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    def submit(
        self, token: str, doc: Any = None, *, content_type: str = "application/yaml", **kw: Any
    ) -> Any:
        body = yaml.safe_dump(doc if doc is not None else GOOD) if isinstance(doc, dict | None) else doc
        return self.client.post(
            "/v1/jobs", content=body, headers={**self.h(token), "Content-Type": content_type}, **kw
        )

    def job_count(self) -> int:
        return len(self.lt.store.list_jobs())


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    lt = embedded(tmp_path)
    yield Api(lt)
    lt.close()


def locs(response: Any) -> list[str]:
    return [e["loc"] for e in response.json()["errors"]]


def test_requests_without_a_valid_token_are_refused_with_a_located_error(api: Api) -> None:
    r = api.client.get("/v1/jobs")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"] == "unauthorized" and locs(r) == ["header.Authorization"]
    assert api.client.get("/v1/jobs", headers={"Authorization": "Basic abc"}).status_code == 401
    assert api.client.get("/v1/jobs", headers=api.h("lt_nope")).status_code == 401
    assert api.client.get("/v1/jobs", headers=api.h(api.alice)).status_code == 200


def test_submit_yaml_and_json_then_read_the_job_back(api: Api) -> None:
    r = api.submit(api.alice)
    assert r.status_code == 201, r.text
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert (job["name"], job["owner"], job["state"], job["steps"]) == (
        "sft",
        "alice",
        "QUEUED",
        {"READY": 1, "PENDING": 1},
    )
    r2 = api.submit(api.bob, json.dumps(GOOD), content_type="application/json")
    assert r2.status_code == 201
    d = api.client.get(f"/v1/jobs/{job['id']}", headers=api.h(api.bob)).json()
    assert [s["name"] for s in d["steps"]] == ["prep", "train"]
    assert d["steps"][1]["command"] == ["echo", "0.1"]
    assert d["steps"][1]["outputs"].endswith(f"/jobs/{job['id']}/train/outputs")
    assert yaml.safe_load(d["source_text"])["name"] == "sft"
    listed = api.client.get("/v1/jobs", params={"owner": "alice"}, headers=api.h(api.bob)).json()["jobs"]
    assert [j["id"] for j in listed] == [job["id"]]


def test_param_overrides_and_dry_run(api: Api) -> None:
    r = api.client.post(
        "/v1/jobs/validate",
        content=yaml.safe_dump(GOOD),
        params=[("param", "lr=0.5")],
        headers={**api.h(api.alice), "Content-Type": "application/yaml"},
    )
    assert r.status_code == 200 and r.json()["valid"] is True
    assert r.json()["spec"]["params"] == {"lr": 0.5}
    assert api.job_count() == 0  # a dry run stores nothing
    bad = api.submit(api.alice, params=[("param", "novalue")])
    assert bad.status_code == 422 and locs(bad) == ["query.param[0]"]


@pytest.mark.parametrize(
    ("body", "status", "where"),
    [
        ("name: [unclosed", 422, "(document)"),
        (b"name: caf\xe9\n", 422, "(document)"),
        ("- just\n- a list\n", 422, "(document)"),
        (yaml.safe_dump({**GOOD, "colour": "blue"}), 422, "colour"),
        (yaml.safe_dump({**GOOD, "grace_seconds": -1}), 422, "grace_seconds"),
        (
            yaml.safe_dump(
                {
                    **GOOD,
                    "steps": [
                        {"name": "a", "command": ["x"], "depends": ["b"]},
                        {"name": "b", "command": ["x"], "depends": ["a"]},
                    ],
                }
            ),
            422,
            "steps[0].depends",
        ),
        (
            yaml.safe_dump({**GOOD, "steps": [{"name": "a", "command": ["x"], "depends": ["prepp"]}]}),
            422,
            "steps[0].depends[0]",
        ),
        (
            yaml.safe_dump({**GOOD, "steps": [{"name": "a", "command": ["x"], "gpus": 5}]}),
            422,
            "steps[0].gpus",
        ),
    ],
)
def test_bad_specs_get_a_4xx_naming_the_field_and_nothing_is_stored(
    api: Api, body: str | bytes, status: int, where: str
) -> None:
    r = api.submit(api.alice, body)
    assert r.status_code == status, r.text
    assert r.json()["error"] == "invalid_spec"
    assert where in locs(r), r.json()
    assert api.job_count() == 0


def test_a_cycle_is_named(api: Api) -> None:
    doc = {
        **GOOD,
        "steps": [
            {"name": "a", "command": ["x"], "depends": ["b"]},
            {"name": "b", "command": ["x"], "depends": ["a"]},
        ],
    }
    r = api.submit(api.alice, doc)
    msgs = " ".join(e["msg"] for e in r.json()["errors"])
    assert "a -> b -> a" in msgs


def test_too_large_and_wrong_content_type(api: Api) -> None:
    big = "name: x\n# " + "y" * (1024 * 1024) + "\n"
    r = api.submit(api.alice, big)
    assert r.status_code == 413 and locs(r) == ["body"]
    r = api.submit(api.alice, "name: x", content_type="image/png")
    assert r.status_code == 415 and locs(r) == ["header.Content-Type"]
    assert api.job_count() == 0


def test_users_cancel_only_their_own_jobs_and_admins_any(api: Api) -> None:
    mine = api.submit(api.alice).json()["id"]
    theirs = api.submit(api.bob).json()["id"]
    r = api.client.post(f"/v1/jobs/{theirs}/cancel", headers=api.h(api.alice))
    assert r.status_code == 403 and "belongs to bob" in r.json()["message"]
    assert api.lt.store.job(theirs).state.value == "QUEUED"
    assert api.client.post(f"/v1/jobs/{mine}/cancel", headers=api.h(api.alice)).json()["state"] == "CANCELLED"
    assert (
        api.client.post(f"/v1/jobs/{theirs}/cancel", headers=api.h(api.admin)).json()["state"] == "CANCELLED"
    )
    assert api.client.post("/v1/jobs/job-000000000000/cancel", headers=api.h(api.admin)).status_code == 404


def test_rerun_repeats_the_recorded_spec_as_a_new_job(api: Api) -> None:
    first = api.submit(api.alice, params=[("param", "lr=0.7")]).json()["id"]
    r = api.client.post(f"/v1/jobs/{first}/rerun", headers=api.h(api.bob))
    assert r.status_code == 201
    again = r.json()
    assert again["rerun_of"] == first and again["owner"] == "bob" and again["id"] != first
    d1 = api.client.get(f"/v1/jobs/{first}", headers=api.h(api.bob)).json()
    d2 = api.client.get(f"/v1/jobs/{again['id']}", headers=api.h(api.bob)).json()
    assert d1["spec"] == d2["spec"] and d2["spec"]["params"] == {"lr": 0.7}
    assert d2["steps"][1]["command"] == ["echo", "0.7"]


def test_tokens_are_managed_by_admins_only(api: Api) -> None:
    r = api.client.post("/v1/tokens", json={"name": "carol"}, headers=api.h(api.alice))
    assert r.status_code == 403
    r = api.client.post("/v1/tokens", json={"name": "carol"}, headers=api.h(api.admin))
    assert r.status_code == 201
    carol = r.json()
    assert carol["role"] == "user" and carol["token"].startswith("lt_")
    assert api.client.get("/v1/whoami", headers=api.h(carol["token"])).json() == {
        "name": "carol",
        "role": "user",
        "teams": ["default"],
        "max_priority": 50,
    }
    listed = api.client.get("/v1/tokens", headers=api.h(api.admin)).json()
    assert all(t["token"] is None for t in listed)
    assert api.client.delete(f"/v1/tokens/{carol['id']}", headers=api.h(api.admin)).status_code == 204
    assert api.client.get("/v1/whoami", headers=api.h(carol["token"])).status_code == 401
    bad = api.client.post("/v1/tokens", json={"name": "a b", "role": "root"}, headers=api.h(api.admin))
    assert bad.status_code == 422 and set(locs(bad)) == {"body.name", "body.role"}


def test_a_step_token_may_only_report_checkpoints_for_its_own_attempt(api: Api) -> None:
    lt = api.lt
    job = api.submit(api.alice).json()["id"]
    attempt_id, step_token = step_attempt_token(lt, job, "prep")
    url = f"/v1/jobs/{job}/steps/prep/checkpoints"
    r = api.client.post(url, json={"label": "ckpt-1", "progress": "step 10"}, headers=api.h(step_token))
    assert r.status_code == 201 and r.json()["attempt_id"] == attempt_id
    assert lt.store.job_detail(job).steps[0].last_checkpoint == "ckpt-1"
    assert api.client.post(url, json={"label": "x"}, headers=api.h(api.alice)).status_code == 403
    assert api.client.get("/v1/jobs", headers=api.h(step_token)).status_code == 403
    other = api.submit(api.bob).json()["id"]
    r = api.client.post(
        f"/v1/jobs/{other}/steps/prep/checkpoints", json={"label": "x"}, headers=api.h(step_token)
    )
    assert r.status_code in (403, 409)
    r = api.client.post(url, json={"label": ""}, headers=api.h(step_token))
    assert r.status_code == 422 and locs(r) == ["body.label"]


def test_a_step_asks_for_its_notice_deadline_with_its_own_token(api: Api) -> None:
    """What cluster mode's shim asks on SIGTERM (docs/cluster.md "The step shim in the image")."""
    lt = api.lt
    job = api.submit(api.alice).json()["id"]
    attempt_id, step_token = step_attempt_token(lt, job, "prep")
    url = f"/v1/jobs/{job}/steps/prep/notice"
    r = api.client.get(url, headers=api.h(step_token))
    assert r.status_code == 200
    assert r.json() == {"attempt_id": attempt_id, "noticed": False, "seconds_left": None, "reason": None}
    lt.store.mark_stopping(
        attempt_id, deadline=lt.clock.now() + 30.0, reason="GPUs reclaimed", now=lt.clock.now()
    )
    answer = api.client.get(url, headers=api.h(step_token)).json()
    assert answer["noticed"] is True and answer["reason"] == "GPUs reclaimed"
    assert 25.0 < answer["seconds_left"] <= 30.0
    assert api.client.get(url, headers=api.h(api.admin)).json()["attempt_id"] == attempt_id
    refused = api.client.get(url, headers=api.h(api.alice))  # the job's owner is not its step
    assert refused.status_code == 403 and locs(refused) == ["header.Authorization"]
    other = api.submit(api.bob).json()["id"]
    _, other_token = step_attempt_token(lt, other, "prep")
    assert api.client.get(url, headers=api.h(other_token)).status_code == 403
    assert api.client.get(f"/v1/jobs/{job}/steps/nope/notice", headers=api.h(step_token)).status_code == 404


def test_pool_health_and_metrics(api: Api) -> None:
    api.lt.store.ensure_gpus(api.lt.nodes, api.lt.clock.now())
    pool = api.client.get("/v1/pool", headers=api.h(api.alice)).json()
    assert (pool["total"], pool["free"]) == (6, 6)
    assert [(n["name"], len(n["gpus"])) for n in pool["nodes"]] == [("node-a", 4), ("node-b", 2)]
    assert api.client.get("/healthz").json()["status"] == "ok"
    api.submit(api.alice)
    text = api.client.get("/metrics").text
    assert 'lowtide_jobs{state="QUEUED"} 1.0' in text
    assert 'lowtide_gpus{holder="idle"} 6.0' in text
    assert "lowtide_queue_steps 1.0" in text
    assert "lowtide_gpus_total 6.0" in text
    assert 'lowtide_reclaims{state="OPEN"} 0.0' in text
    assert "lowtide_preemptions 0.0" in text and "lowtide_lost_gpu_seconds 0.0" in text
    api.lt.store.open_reclaim(
        service="chat", replica_id=None, reason="test", gpus=2, victims=(), detected_at=1.0, decided_at=1.0
    )
    assert 'lowtide_reclaims{state="OPEN"} 1.0' in api.client.get("/metrics").text


def test_logs_of_a_step_that_has_not_started_are_a_404(api: Api) -> None:
    job = api.submit(api.alice).json()["id"]
    r = api.client.get(f"/v1/jobs/{job}/steps/prep/logs", headers=api.h(api.alice))
    assert r.status_code == 404 and locs(r) == ["path.step"]
    r = api.client.get(f"/v1/jobs/{job}/steps/nope/logs", headers=api.h(api.alice))
    assert r.status_code == 404


def test_unknown_routes_and_bad_query_values_are_shaped_errors(api: Api) -> None:
    r = api.client.get("/v1/jobs", params={"limit": "many"}, headers=api.h(api.alice))
    assert r.status_code == 422 and locs(r) == ["query.limit"]
    r = api.client.get("/v1/jobs", params={"state": "DONE"}, headers=api.h(api.alice))
    assert r.status_code == 422 and locs(r) == ["query.state[0]"]
    r = api.client.get("/v1/nothing", headers=api.h(api.alice))
    assert r.status_code == 404 and r.json()["error"] == "not_found"


def test_with_a_container_runtime_every_step_needs_an_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    docker = bindir / "docker"
    docker.write_text("#!/bin/sh\nexit 0\n")
    docker.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    lt = embedded(tmp_path, executor={"runtime": "docker"}, auth={"enabled": False})
    client = TestClient(lt.app)
    doc = {
        "name": "c",
        "steps": [{"name": "a", "command": ["x"]}, {"name": "b", "command": ["x"], "image": "i:1"}],
    }
    r = client.post("/v1/jobs", content=yaml.safe_dump(doc), headers={"Content-Type": "application/yaml"})
    assert r.status_code == 422 and locs(r) == ["steps[0].image"]
    assert "executor.runtime: docker" in r.json()["errors"][0]["msg"]
    doc["steps"][0]["image"] = "i:1"
    r = client.post("/v1/jobs", content=yaml.safe_dump(doc), headers={"Content-Type": "application/yaml"})
    assert r.status_code == 201
    lt.close()
