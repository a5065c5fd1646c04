"""Who sees and may do what (docs/architecture.md §11), through the real app over real HTTP:
two users of different teams, a teammate, a viewer and an admin; team and priority governance
on tokens; secrets by reference; the last admin token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from lowtide.cli.main import app as cli_app
from lowtide.control.clock import FakeClock
from lowtide.wiring import Embedded, build
from support import Served, running, settings_for

NOW = 1_790_000_000.0  # 2026-09-21 UTC
SECRET_VALUE = "wandb-s3cr3t-7f3a9c"


def job(team: str | None = "nlp", **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "sft",
        "steps": [{"name": "train", "command": ["python", "train.py"], "gpus": 2}],
        **extra,
    }
    if team is not None:
        doc["team"] = team
    return doc


class Site:
    """An embedded lowtide (loop not running) served over HTTP, with one token per person."""

    def __init__(self, tmp_path: Path) -> None:
        secret_file = tmp_path / "wandb.secret"
        secret_file.write_text(SECRET_VALUE + "\n")
        self.clock = FakeClock(NOW)
        self.lt: Embedded = build(
            settings_for(
                tmp_path,
                secrets={
                    "wandb": {"env": "WANDB_API_KEY", "teams": ["nlp"], "source": {"file": str(secret_file)}},
                    "hf": {"env": "HF_TOKEN", "teams": ["vision"], "source": {"env": "LT_TEST_HF_TOKEN"}},
                },
            ),
            clock=self.clock,
        )
        store, now = self.lt.store, self.clock.now()
        self.root_id, self.root = self._token(name="root", role="admin")
        _, self.alice = self._token(name="alice", role="user", teams=["nlp"])
        _, self.carol = self._token(name="carol", role="user", teams=["nlp"])
        _, self.bob = self._token(name="bob", role="user", teams=["vision", "speech"], max_priority=70)
        _, self.vera = self._token(name="vera", role="viewer", teams=["nlp"])
        assert store.authenticate(self.root) is not None and now == NOW
        self.served = Served(self.lt.app)
        self.http = httpx.Client(base_url=self.served.url, timeout=30)

    def _token(self, **kw: Any) -> tuple[int, str]:
        record, raw = self.lt.store.create_token(owner=kw["name"], now=self.clock.now(), **kw)
        return record.id, raw

    def call(self, method: str, url: str, token: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}", **kw.pop("headers", {})}
        return self.http.request(method, url, headers=headers, **kw)

    def submit(self, token: str, doc: dict[str, Any], path: str = "/v1/jobs") -> httpx.Response:
        return self.call(
            "POST", path, token, content=yaml.safe_dump(doc), headers={"Content-Type": "application/yaml"}
        )

    def submitted(self, token: str, doc: dict[str, Any]) -> str:
        r = self.submit(token, doc)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def close(self) -> None:
        self.http.close()
        self.served.close()
        self.lt.close()


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path)
    yield s
    s.close()


def locs(r: httpx.Response) -> list[str]:
    return [e["loc"] for e in r.json()["errors"]]


def test_another_teams_job_answers_exactly_like_a_job_that_does_not_exist(site: Site) -> None:
    theirs = site.submitted(site.alice, job())
    missing = "job-0123456789ab"
    for method, path in [
        ("GET", "/v1/jobs/{}"),
        ("GET", "/v1/jobs/{}/steps/train/logs"),
        ("POST", "/v1/jobs/{}/cancel"),
        ("POST", "/v1/jobs/{}/rerun"),
    ]:
        hidden = site.call(method, path.format(theirs), site.bob)
        absent = site.call(method, path.format(missing), site.bob)
        assert hidden.status_code == absent.status_code == 404, (path, hidden.text)
        assert hidden.json() == {
            **absent.json(),
            "message": absent.json()["message"].replace(missing, theirs),
        }
    assert site.lt.store.list_jobs() and len(site.lt.store.list_jobs()) == 1  # Bob's rerun made nothing
    # A teammate sees it (its step has not started: that 404 names the step), but may not cancel it.
    assert site.call("GET", f"/v1/jobs/{theirs}", site.carol).status_code == 200
    logs = site.call("GET", f"/v1/jobs/{theirs}/steps/train/logs", site.carol)
    assert logs.status_code == 404 and locs(logs) == ["path.step"]
    cancel = site.call("POST", f"/v1/jobs/{theirs}/cancel", site.carol)
    assert cancel.status_code == 403 and "belongs to alice" in cancel.json()["message"]
    rerun = site.call("POST", f"/v1/jobs/{theirs}/rerun", site.carol)
    assert rerun.status_code == 201 and rerun.json()["owner"] == "carol" and rerun.json()["team"] == "nlp"
    assert site.call("POST", f"/v1/jobs/{theirs}/cancel", site.alice).status_code == 200
    assert site.call("GET", f"/v1/jobs/{theirs}", site.root).status_code == 200


def test_listings_filter_in_the_query_so_pages_stay_full(site: Site) -> None:
    mine = site.submitted(site.bob, job("vision"))
    site.clock.advance(1)
    alices = []
    for _ in range(3):
        alices.append(site.submitted(site.alice, job()))
        site.clock.advance(1)
    page = site.call("GET", "/v1/jobs", site.bob, params={"limit": 1}).json()
    assert [j["id"] for j in page["jobs"]] == [mine]  # not an empty page of Alice's newest
    assert [j["id"] for j in site.call("GET", "/v1/jobs", site.bob).json()["jobs"]] == [mine]
    assert site.call("GET", "/v1/jobs", site.bob, params={"owner": "alice"}).json()["jobs"] == []
    carol = site.call("GET", "/v1/jobs", site.carol, params={"limit": 2}).json()
    assert [j["id"] for j in carol["jobs"]] == alices[::-1][:2] and carol["next_before"] is not None
    rest = site.call("GET", "/v1/jobs", site.carol, params={"limit": 2, "before": carol["next_before"]})
    assert [j["id"] for j in rest.json()["jobs"]] == [alices[0]]
    assert len(site.call("GET", "/v1/jobs", site.root).json()["jobs"]) == 4


def test_pool_and_reports_show_other_teams_only_as_pool_figures(site: Site) -> None:
    lt = site.lt
    theirs = site.submitted(site.alice, job())
    lt.store.ensure_gpus(lt.nodes, site.clock.now())
    running(
        lt.store,
        lt.store.begin_attempt(
            job_id=theirs,
            step="train",
            node="node-a",
            gpus=(0, 1),
            layout=lt.loop.settings.layout,
            now=site.clock.now(),
            reason="test",
        ),
    )
    site.clock.advance(3600)
    held = [g for n in site.call("GET", "/v1/pool", site.bob).json()["nodes"] for g in n["gpus"]]
    hidden = {"holder": "attempt", "job_id": None, "step": None, "attempt_id": None, "since": NOW}
    assert [g for g in held if g["holder"] == "attempt"] == [
        {"index": i, **hidden, "team": "(another team)"} for i in (0, 1)
    ]
    seen = [g for n in site.call("GET", "/v1/pool", site.carol).json()["nodes"] for g in n["gpus"]]
    assert {g["job_id"] for g in seen if g["holder"] == "attempt"} == {theirs}

    def rows(token: str, group_by: str) -> dict[str, Any]:
        r = site.call("GET", "/v1/reports/usage", token, params={"group_by": group_by, "start": "2h"})
        assert r.status_code == 200, r.text
        return dict(r.json())

    bob_jobs, carol_jobs = rows(site.bob, "job"), rows(site.carol, "job")
    assert bob_jobs["rows"] == [] and [r["key"] for r in carol_jobs["rows"]] == [theirs]
    # Totals are the whole pool's, the same for everyone: they name no job and no team.
    assert bob_jobs["totals"] == carol_jobs["totals"] and bob_jobs["totals"]["research_gpu_seconds"] > 0
    assert [r["team"] for r in rows(site.bob, "team")["rows"]] == []
    assert [r["team"] for r in rows(site.vera, "team")["rows"]] == ["nlp"]
    bob_holders = {r["key"] for r in rows(site.bob, "holder")["rows"]}
    assert "idle" in bob_holders and not any(k.startswith("attempt:") for k in bob_holders)
    assert len(rows(site.bob, "day")["rows"]) >= 1  # days are pool-wide figures

    def monthly(token: str) -> dict[str, Any]:
        r = site.call("GET", "/v1/reports/monthly", token, params={"month": "2026-09", "tz": "UTC"})
        assert r.status_code == 200, r.text
        return dict(r.json())

    assert monthly(site.bob)["teams"] == [] and monthly(site.bob)["total"] == monthly(site.root)["total"]
    assert [t["team"] for t in monthly(site.carol)["teams"]] == ["nlp"]


def test_a_viewer_reads_its_teams_jobs_but_cannot_submit_cancel_or_rerun(site: Site) -> None:
    theirs = site.submitted(site.alice, job())
    assert site.call("GET", f"/v1/jobs/{theirs}", site.vera).status_code == 200
    assert [j["id"] for j in site.call("GET", "/v1/jobs", site.vera).json()["jobs"]] == [theirs]
    for r in (
        site.submit(site.vera, job()),
        site.submit(site.vera, job(), "/v1/jobs/validate"),
        site.call("POST", f"/v1/jobs/{theirs}/cancel", site.vera),
        site.call("POST", f"/v1/jobs/{theirs}/rerun", site.vera),
    ):
        assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
        assert "viewer" in r.json()["message"]
    assert site.call("GET", "/v1/pool", site.vera).status_code == 200
    assert site.call("GET", "/v1/services", site.vera).status_code == 200
    whoami = site.call("GET", "/v1/whoami", site.vera).json()
    assert whoami == {"name": "vera", "role": "viewer", "teams": ["nlp"], "max_priority": 0}


def test_submits_outside_the_tokens_teams_or_priority_are_refused_where_they_are_wrong(site: Site) -> None:
    for path in ("/v1/jobs", "/v1/jobs/validate"):
        r = site.submit(site.alice, job("vision"), path)
        assert r.status_code == 403 and r.json()["error"] == "forbidden"
        assert r.json()["errors"] == [
            {"loc": "body.team", "msg": "this token may submit for nlp; not 'vision'"}
        ]
        r = site.submit(site.bob, job("speech", priority=90), path)
        assert r.status_code == 403 and locs(r) == ["body.priority"]
        assert "up to priority 70" in r.json()["errors"][0]["msg"]
        r = site.submit(site.alice, job("speech", priority="high"), path)
        assert r.status_code == 403 and locs(r) == ["body.team", "body.priority"]
    assert site.lt.store.list_jobs() == []
    # Within the token: accepted; a spec without a team gets the token's first team.
    assert site.submit(site.bob, job("speech", priority=70)).status_code == 201
    untagged = site.submit(site.bob, job(None)).json()
    assert untagged["team"] == "vision" and untagged["priority"] == 50
    assert site.submit(site.root, job(None)).json()["team"] == "default"
    # A rerun is the rerunner's job: Alice sees the admin's urgent nlp job but may not rerun it.
    urgent = site.submitted(site.root, job(priority="high"))
    r = site.call("POST", f"/v1/jobs/{urgent}/rerun", site.alice)
    assert r.status_code == 403 and locs(r) == ["body.priority"]


def test_tokens_carry_their_scope_and_the_last_admin_token_cannot_be_revoked(site: Site) -> None:
    r = site.call(
        "POST", "/v1/tokens", site.root, json={"name": "dan", "teams": ["nlp", "vision"], "max_priority": 70}
    )
    assert r.status_code == 201, r.text
    assert (r.json()["teams"], r.json()["max_priority"], r.json()["role"]) == (["nlp", "vision"], 70, "user")
    dan = r.json()["token"]
    assert site.call("GET", "/v1/whoami", dan).json()["teams"] == ["nlp", "vision"]
    bad = site.call(
        "POST", "/v1/tokens", site.root, json={"name": "eve", "teams": ["Not A Team"], "max_priority": 101}
    )
    assert bad.status_code == 422 and set(locs(bad)) == {"body.teams[0]", "body.max_priority"}
    assert site.call("POST", "/v1/tokens", dan, json={"name": "eve"}).status_code == 403

    r = site.call("DELETE", f"/v1/tokens/{site.root_id}", site.root)
    assert r.status_code == 409 and r.json()["error"] == "conflict"
    assert "last active admin token" in r.json()["message"] and locs(r) == ["path.token_id"]
    assert site.call("GET", "/v1/whoami", site.root).status_code == 200
    second = site.call("POST", "/v1/tokens", site.root, json={"name": "ops", "role": "admin"}).json()
    assert second["teams"] == ["*"] and second["max_priority"] == 100
    assert site.call("DELETE", f"/v1/tokens/{site.root_id}", second["token"]).status_code == 204
    assert site.call("GET", "/v1/whoami", site.root).status_code == 401
    assert site.call("DELETE", f"/v1/tokens/{second['id']}", second["token"]).status_code == 409


def test_secrets_are_stored_and_shown_by_name_and_checked_against_the_operators_rules(site: Site) -> None:
    doc = job(steps=[{"name": "train", "command": ["python", "t.py"], "gpus": 1, "secrets": ["wandb"]}])
    r = site.submit(site.alice, doc)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    detail = site.call("GET", f"/v1/jobs/{job_id}", site.alice)
    assert detail.json()["spec"]["steps"][0]["secrets"] == ["wandb"]
    assert SECRET_VALUE not in detail.text and SECRET_VALUE not in str(site.lt.store.job_detail(job_id))
    mapped = job(secrets={"MY_KEY": "wandb"})
    assert site.submit(site.alice, mapped, "/v1/jobs/validate").json()["spec"]["secrets"] == [
        {"MY_KEY": "wandb"}
    ]

    unknown = job(steps=[{"name": "t", "command": ["x"], "secrets": ["wandb", "nope"]}])
    r = site.submit(site.alice, unknown, "/v1/jobs/validate")
    assert r.status_code == 422 and locs(r) == ["steps[0].secrets[1]"]
    assert "unknown secret 'nope'" in r.json()["errors"][0]["msg"]
    assert "hf, wandb" in r.json()["errors"][0]["msg"]
    r = site.submit(site.bob, job("vision", secrets=["wandb"]))
    assert r.status_code == 403 and locs(r) == ["secrets[0]"] and "team 'vision'" in r.text
    clash = job(steps=[{"name": "t", "command": ["x"], "env": {"WANDB_API_KEY": "x"}, "secrets": ["wandb"]}])
    r = site.submit(site.alice, clash)
    assert r.status_code == 422 and locs(r) == ["steps[0].secrets[0]"]
    bad = job(steps=[{"name": "t", "command": ["x"], "secrets": {"LOWTIDE_X": "wandb", "OK": "Bad Name"}}])
    r = site.submit(site.alice, bad, "/v1/jobs/validate")
    assert r.status_code == 422 and locs(r) == ["steps[0].secrets.LOWTIDE_X", "steps[0].secrets.OK"]
    # Bob cannot rerun it (he does not see it); Carol can, and her token allows the secret's team.
    assert site.call("POST", f"/v1/jobs/{job_id}/rerun", site.bob).status_code == 404
    assert site.call("POST", f"/v1/jobs/{job_id}/rerun", site.carol).status_code == 201


def test_lowtide_token_create_sets_teams_and_max_priority(site: Site) -> None:
    def cli(*args: str) -> Any:
        return CliRunner().invoke(
            cli_app, ["--url", site.served.url, "--token", site.root, *args], env={"COLUMNS": "200"}
        )

    r = cli("token", "create", "dan", "--team", "nlp", "--team", "vision", "--max-priority", "70", "--json")
    assert r.exit_code == 0, r.output
    created = json.loads(r.stdout)
    assert (created["teams"], created["max_priority"]) == (["nlp", "vision"], 70)
    assert site.call("GET", "/v1/whoami", created["token"]).json()["max_priority"] == 70
    r = cli("token", "create", "eve", "--max-priority", "101")
    assert r.exit_code == 2
    r = cli("token", "revoke", str(site.root_id))
    assert r.exit_code == 2 and "last active admin token" in r.output
