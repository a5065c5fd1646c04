"""`POST /v1/jobs/{id}/retry` through the real app and the real loop (ticked by hand): who may
retry, the 409s, and a failed job that runs again from its failed step, its first step kept."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from lowtide.wiring import Embedded
from support import embedded, tick_until


class Api:
    def __init__(self, lt: Embedded) -> None:
        self.lt = lt
        self.client = TestClient(lt.app)
        now = lt.clock.now()
        _, self.admin = lt.store.create_token(name="root", owner="root", role="admin", now=now)
        nlp = ["nlp"]
        _, self.alice = lt.store.create_token(name="alice", owner="alice", role="user", now=now, teams=nlp)
        _, self.bob = lt.store.create_token(name="bob", owner="bob", role="user", now=now, teams=nlp)
        _, self.vic = lt.store.create_token(name="vic", owner="vic", role="user", now=now, teams=["vision"])
        _, self.vera = lt.store.create_token(name="vera", owner="vera", role="viewer", now=now, teams=nlp)

    def h(self, token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    def submit(self, token: str, doc: dict[str, Any]) -> str:
        r = self.client.post(
            "/v1/jobs",
            content=yaml.safe_dump(doc),
            headers={**self.h(token), "Content-Type": "application/yaml"},
        )
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def retry(self, token: str, job_id: str) -> Any:
        return self.client.post(f"/v1/jobs/{job_id}/retry", headers=self.h(token))

    def detail(self, job_id: str) -> dict[str, Any]:
        return dict(self.client.get(f"/v1/jobs/{job_id}", headers=self.h(self.admin)).json())


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    lt = embedded(tmp_path)
    yield Api(lt)
    lt.close()


def _queued_job() -> dict[str, Any]:
    return {"name": "sft", "team": "nlp", "steps": [{"name": "train", "command": ["true"], "gpus": 2}]}


def test_only_the_owner_or_an_admin_may_retry_and_only_a_finished_job(api: Api) -> None:
    job_id = api.submit(api.alice, _queued_job())
    r = api.retry(api.alice, job_id)  # QUEUED: nothing to retry yet
    assert r.status_code == 409
    body = r.json()
    assert body["error"] == "conflict" and "QUEUED: already running" in body["message"]
    assert body["errors"] == [{"loc": "path.job_id", "msg": "already running"}]
    assert api.client.post(f"/v1/jobs/{job_id}/cancel", headers=api.h(api.alice)).status_code == 200
    # A teammate sees the job but may not retry it; another team does not see it; nor may a viewer.
    r = api.retry(api.bob, job_id)
    assert r.status_code == 403 and "belongs to alice" in r.json()["message"]
    assert api.retry(api.vic, job_id).status_code == 404
    assert api.retry(api.vera, job_id).status_code == 403
    assert api.detail(job_id)["job"]["state"] == "CANCELLED"  # none of them changed anything
    assert api.retry(api.alice, "job-00000000ffff").status_code == 404
    # The owner may: a job cancelled before it started goes back to the queue.
    r = api.retry(api.alice, job_id)
    assert r.status_code == 200, r.text
    assert r.json() == {**r.json(), "queued": ["train"], "waiting": [], "kept": []}
    assert r.json()["job"]["state"] == "QUEUED"
    events = [(e["kind"], e["message"]) for e in api.detail(job_id)["events"]]
    assert events[-1] == ("retried", "retried by alice: train back to work")
    # Twice in a row: the second is refused, the job is already running again.
    r = api.retry(api.alice, job_id)
    assert r.status_code == 409 and "already running" in r.json()["message"]
    # An admin may retry anyone's job.
    assert api.client.post(f"/v1/jobs/{job_id}/cancel", headers=api.h(api.admin)).status_code == 200
    assert api.retry(api.admin, job_id).json()["job"]["state"] == "QUEUED"


def test_a_failed_job_runs_again_from_its_failed_step(api: Api, tmp_path: Path) -> None:
    flag = tmp_path / "fixed"
    needs_flag = f"import os, sys; sys.exit(0 if os.path.exists({str(flag)!r}) else 3)"
    doc = {
        "name": "pipeline",
        "team": "nlp",
        "steps": [
            {"name": "prep", "command": [sys.executable, "-c", "pass"], "gpus": 0},
            {"name": "train", "command": [sys.executable, "-c", needs_flag], "gpus": 0, "depends": ["prep"]},
            {"name": "eval", "command": [sys.executable, "-c", "pass"], "gpus": 0, "depends": ["train"]},
        ],
    }
    job_id = api.submit(api.alice, doc)
    lt = api.lt
    tick_until(lt, lambda: lt.store.job(job_id).state.value == "FAILED", what="the job fails")
    steps = {s["name"]: s["state"] for s in api.detail(job_id)["steps"]}
    assert steps == {"prep": "SUCCEEDED", "train": "FAILED", "eval": "SKIPPED"}
    flag.write_text("ok\n")  # the cause is fixed
    r = api.retry(api.alice, job_id)
    assert r.status_code == 200, r.text
    assert (r.json()["job"]["state"], r.json()["queued"], r.json()["waiting"], r.json()["kept"]) == (
        "RUNNING",
        ["train"],
        ["eval"],
        ["prep"],
    )
    tick_until(lt, lambda: lt.store.job(job_id).state.value == "SUCCEEDED", what="the retried job succeeds")
    d = api.detail(job_id)
    numbers = {s["name"]: [a["number"] for a in d["attempts"] if a["step"] == s["name"]] for s in d["steps"]}
    assert numbers == {"prep": [1], "train": [1, 2], "eval": [1]}
