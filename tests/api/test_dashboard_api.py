"""The dashboard's API (issue 11): browser sessions and CSRF, the live event stream, the GPU
timeline, the templates, and /ui/ itself — over a real embedded lowtide (SQLite, auth on).

- `POST /v1/session` turns a token into an HttpOnly, SameSite=Strict cookie that carries only a
  signed token id; the cookie then authenticates like the token, is re-checked on every request
  (revoking the token logs it out at once), and a tampered or expired one is refused.
- Unsafe requests by cookie need the session's `X-CSRF-Token` and a same-origin Origin; bearer
  clients need neither.
- `GET /v1/events/stream` sends the ids of visible jobs that changed (another team's never).
- `/ui/` answers 503 naming `make web` until the front-end is built, then serves it with a CSP.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from lowtide.api import dashboard, session
from lowtide.api.app import create_app
from lowtide.control.clock import FakeClock
from lowtide.domain.states import ReplicaState as R
from lowtide.policy.lending_history import LendingPoint
from lowtide.wiring import Embedded, build
from support import embedded, kill_steps_and_close, settings_for

SPEC = "name: hello\nteam: nlp\nsteps:\n  - name: main\n    command: [echo, hi]\n    gpus: 0\n"
YAML = {"Content-Type": "application/yaml"}


@pytest.fixture
def lt(tmp_path: Path) -> Iterator[Embedded]:
    system = embedded(tmp_path, auth={"enabled": True})
    yield system
    kill_steps_and_close(system)


def token(lt: Embedded, name: str, role: str = "user", teams: list[str] | None = None) -> tuple[int, str]:
    record, raw = lt.store.create_token(name=name, owner=name, role=role, now=lt.clock.now(), teams=teams)
    return record.id, raw


def login(lt: Embedded, raw: str) -> tuple[TestClient, str]:
    client = TestClient(lt.app, base_url="http://lowtide.test")
    r = client.post("/v1/session", json={"token": raw})
    assert r.status_code == 200, r.text
    return client, str(r.json()["csrf_token"])


def test_login_sets_a_strict_httponly_cookie_that_authenticates_like_the_token(lt: Embedded) -> None:
    _, raw = token(lt, "alice", teams=["nlp"])
    client = TestClient(lt.app, base_url="http://lowtide.test")
    r = client.post("/v1/session", json={"token": raw})
    assert r.status_code == 200, r.text
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    assert "Secure" not in cookie  # plain http here; https sets it
    assert raw not in cookie  # the cookie carries a signed id, never the secret
    body = r.json()
    assert (body["name"], body["role"], body["teams"]) == ("alice", "user", ["nlp"])
    assert client.get("/v1/session").json()["csrf_token"] == body["csrf_token"]
    assert client.get("/v1/whoami").json()["name"] == "alice"
    # a form works too (the login page without scripts)
    form = TestClient(lt.app, base_url="http://lowtide.test").post("/v1/session", data={"token": raw})
    assert form.status_code == 200
    # over https the cookie is Secure
    secure = TestClient(lt.app, base_url="https://lowtide.test").post("/v1/session", json={"token": raw})
    assert "Secure" in secure.headers["set-cookie"]


def test_bad_tokens_and_step_tokens_do_not_log_in(lt: Embedded) -> None:
    client = TestClient(lt.app, base_url="http://lowtide.test")
    assert client.post("/v1/session", json={"token": "nope"}).status_code == 401
    assert client.post("/v1/session", json={"token": ""}).status_code == 422
    assert client.post("/v1/session", content=b"x", headers={"Content-Type": "text/plain"}).status_code == 415
    assert client.get("/v1/session").status_code == 401
    _, step_raw = lt.store.create_token(name="s", owner="s", role="step", now=lt.clock.now(), attempt_id=None)
    assert client.post("/v1/session", json={"token": step_raw}).status_code == 401


def test_unsafe_requests_by_cookie_need_the_csrf_token_and_the_same_origin(lt: Embedded) -> None:
    _, raw = token(lt, "alice", teams=["nlp"])
    client, csrf = login(lt, raw)
    refused = client.post("/v1/jobs", content=SPEC, headers=YAML)
    assert refused.status_code == 403 and refused.json()["errors"][0]["loc"] == "header.X-CSRF-Token"
    wrong = client.post("/v1/jobs", content=SPEC, headers={**YAML, "X-CSRF-Token": "x" + csrf})
    assert wrong.status_code == 403
    other_site = client.post(
        "/v1/jobs", content=SPEC, headers={**YAML, "X-CSRF-Token": csrf, "Origin": "http://evil.test"}
    )
    assert other_site.status_code == 403 and other_site.json()["errors"][0]["loc"] == "header.Origin"
    ok = client.post(
        "/v1/jobs", content=SPEC, headers={**YAML, "X-CSRF-Token": csrf, "Origin": "http://lowtide.test"}
    )
    assert ok.status_code == 201, ok.text
    job = ok.json()["id"]
    assert client.post(f"/v1/jobs/{job}/cancel").status_code == 403
    assert client.post(f"/v1/jobs/{job}/cancel", headers={"X-CSRF-Token": csrf}).status_code == 200
    # a bearer client needs no CSRF token, and sends no cookie
    bearer = TestClient(lt.app).post(
        "/v1/jobs", content=SPEC, headers={**YAML, "Authorization": f"Bearer {raw}"}
    )
    assert bearer.status_code == 201
    # logging in from another origin is refused (login CSRF)
    foreign = TestClient(lt.app, base_url="http://lowtide.test").post(
        "/v1/session", json={"token": raw}, headers={"Origin": "http://evil.test"}
    )
    assert foreign.status_code == 403


def test_configured_dashboard_origins_decide_same_origin_not_the_host_header(tmp_path: Path) -> None:
    lt = embedded(tmp_path, auth={"enabled": True}, api={"dashboard_origins": ["https://dash.example.org"]})
    try:
        token(lt, "root", role="admin")
        token_id, raw = token(lt, "alice", teams=["nlp"])
        # The Host header is the client's to choose: an Origin that merely matches it is refused.
        client = TestClient(lt.app, base_url="http://evil.test")
        spoofed = client.post("/v1/session", json={"token": raw}, headers={"Origin": "http://evil.test"})
        assert spoofed.status_code == 403 and spoofed.json()["errors"][0]["loc"] == "header.Origin"
        own = {"Origin": "https://dash.example.org"}
        r = client.post("/v1/session", json={"token": raw}, headers=own)
        assert r.status_code == 200, r.text
        csrf = r.json()["csrf_token"]
        foreign = {"X-CSRF-Token": csrf, "Host": "evil.test", "Origin": "http://evil.test"}
        refused = client.post("/v1/jobs", content=SPEC, headers={**YAML, **foreign})
        assert refused.status_code == 403 and refused.json()["errors"][0]["loc"] == "header.Origin"
        referer = {"Referer": "https://DASH.example.org/ui/#/submit"}  # scheme and host are case-blind
        ok = client.post("/v1/jobs", content=SPEC, headers={**YAML, "X-CSRF-Token": csrf, **referer})
        assert ok.status_code == 201, ok.text
        assert (
            client.post("/v1/jobs", content=SPEC, headers={**YAML, "X-CSRF-Token": csrf, **own}).status_code
            == 201
        )
        # The session re-reads its token by id on every request: revoked, it is refused at once.
        lt.store.revoke_token(token_id, lt.clock.now())
        assert client.get("/v1/jobs").status_code == 401
    finally:
        kill_steps_and_close(lt)


def test_a_revoked_token_logs_its_sessions_out_at_once_and_forged_cookies_fail(lt: Embedded) -> None:
    token(lt, "root", role="admin")  # so the user token is not the last admin
    token_id, raw = token(lt, "alice", teams=["nlp"])
    client, _ = login(lt, raw)
    assert client.get("/v1/jobs").status_code == 200
    lt.store.revoke_token(token_id, lt.clock.now())
    assert client.get("/v1/jobs").status_code == 401
    # a cookie signed with another key, or naming another token id, is refused
    other_id, _ = token(lt, "bob", teams=["cv"])
    forged = session.sign(b"k" * 32, other_id, lt.clock.wall() + 60)
    stranger = TestClient(lt.app, base_url="http://lowtide.test", cookies={session.COOKIE: forged})
    assert stranger.get("/v1/jobs").status_code == 401
    good_value = client.cookies.get(session.COOKIE)
    assert good_value is not None
    body, _, mac = good_value.partition(".")
    tampered = TestClient(lt.app, base_url="http://lowtide.test", cookies={session.COOKIE: f"{body}x.{mac}"})
    assert tampered.get("/v1/jobs").status_code == 401
    assert session.verify(b"k" * 32, "é.é", now=0.0) is None  # not ASCII: refused, no error


def test_sessions_expire_and_logout_clears_the_cookie(lt: Embedded, tmp_path: Path) -> None:
    key = session.load_key(tmp_path / "k")
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o600
    assert session.load_key(tmp_path / "k") == key  # kept across restarts
    value = session.sign(key, 7, expires_at=100.0)
    assert session.verify(key, value, now=99.0) == (7, 100.0)
    assert session.verify(key, value, now=100.0) is None
    _, raw = token(lt, "alice", teams=["nlp"])
    client, csrf = login(lt, raw)
    state_key = Path(lt.settings.state_dir) / "session.key"
    assert state_key.stat().st_mode & 0o777 == 0o600
    r = client.delete("/v1/session", headers={"X-CSRF-Token": csrf})
    assert r.status_code == 204 and 'lowtide_session=""' in r.headers["set-cookie"]
    assert client.get("/v1/jobs").status_code == 401


def _events(lines: Iterator[str], count: int) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    kind = ""
    for line in lines:
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            out.append((kind, json.loads(line[6:])))
            if len(out) == count:
                break
    return out


def test_the_event_stream_names_changed_jobs_the_caller_may_see(lt: Embedded) -> None:
    _, alice = token(lt, "alice", teams=["nlp"])
    _, bob = token(lt, "bob", teams=["cv"])
    client, _ = login(lt, alice)
    bearer = {"Authorization": f"Bearer {bob}"}
    submitted: list[str] = []

    def submit_later() -> None:
        other = TestClient(lt.app)
        cv = other.post("/v1/jobs", content=SPEC.replace("nlp", "cv"), headers={**YAML, **bearer})
        mine = other.post("/v1/jobs", content=SPEC, headers={**YAML, "Authorization": f"Bearer {alice}"})
        submitted.extend([cv.json()["id"], mine.json()["id"]])

    with client.stream("GET", "/v1/events/stream", params={"max_events": 2}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        hello = _events(lines, 1)
        threading.Thread(target=submit_later).start()
        rest = _events(lines, 1)
    assert hello[0][0] == "hello"
    assert rest[0][0] == "jobs"
    cv_job, nlp_job = submitted
    assert rest[0][1]["changed"] == [nlp_job]  # bob's cv job is not alice's to see
    assert cv_job not in rest[0][1]["changed"]


def test_live_streams_per_person_are_bounded() -> None:
    streams = dashboard._Streams()
    assert all(streams.enter("alice") for _ in range(dashboard.MAX_STREAMS_PER_USER))
    assert not streams.enter("alice")
    assert streams.enter("bob")
    streams.leave("alice")
    assert streams.enter("alice")


def test_timeline_buckets_the_ledger_and_templates_give_valid_starters(tmp_path: Path) -> None:
    clock = FakeClock()
    lt = build(settings_for(tmp_path, auth={"enabled": True}), clock=clock)
    try:
        _check_timeline_and_templates(lt, clock)
    finally:
        kill_steps_and_close(lt)


def _check_timeline_and_templates(lt: Embedded, clock: FakeClock) -> None:
    _, raw = token(lt, "alice", teams=["nlp"])
    lt.loop.recover()
    lt.loop.tick()  # books every GPU in the ledger (idle)
    clock.advance(1800)  # half an hour later: the last two 15-minute buckets are all idle
    client, csrf = login(lt, raw)
    t = client.get("/v1/pool/timeline", params={"hours": 1, "buckets": 4}).json()
    assert t["capacity"] == 6.0 and len(t["buckets"]) == 4
    assert [b["idle"] for b in t["buckets"]][2:] == [6.0, 6.0]
    assert [b["idle"] for b in t["buckets"]][:2] == [0.0, 0.0]  # before lowtide started
    assert all(b["research"] == 0 and b["serving"] == 0 for b in t["buckets"])
    assert client.get("/v1/pool/timeline", params={"buckets": 0}).status_code == 422
    templates = client.get("/v1/templates").json()
    assert [x["name"] for x in templates] == ["eval", "prep", "sft"]
    prep = next(x for x in templates if x["name"] == "prep")
    assert "use: prep" in prep["starter"] and "team: nlp" in prep["starter"]
    r = client.post("/v1/jobs/validate", content=prep["starter"], headers={**YAML, "X-CSRF-Token": csrf})
    assert r.status_code == 200, r.text


def test_timeline_splits_a_parked_replicas_gpus_from_free(tmp_path: Path) -> None:
    clock = FakeClock()
    lt = build(settings_for(tmp_path, auth={"enabled": True}), clock=clock)
    try:
        _, raw = token(lt, "alice", teams=["nlp"])
        lt.loop.recover()
        lt.loop.tick()  # every GPU idle in the ledger
        t0 = clock.now()
        lt.store.begin_replica(
            replica_id="chat/0", service="chat", slot=0, port=9000, node="node-b", gpus=(0, 1),
            wake=False, now=t0, reason="start",
        )  # fmt: skip
        moves = [(R.STARTING, R.SERVING), (R.SERVING, R.DRAINING), (R.DRAINING, R.PARKING)]
        for i, (a, b) in enumerate(moves):
            lt.store.move_replica("chat/0", a, b, now=t0 + 900 * (i > 0), message=b.value)
        lt.store.move_replica(
            "chat/0", R.PARKING, R.PARKED, now=t0 + 900, message="asleep", parked_as="sleep"
        )
        clock.advance(1800)
        client, _ = login(lt, raw)
        t = client.get("/v1/pool/timeline", params={"hours": 0.5, "buckets": 2}).json()
        first, second = t["buckets"]
        assert (first["serving"], first["idle"], first["parked"], first["free"]) == (2.0, 4.0, 0.0, 4.0)
        assert (second["serving"], second["idle"], second["parked"], second["free"]) == (0.0, 6.0, 2.0, 4.0)
    finally:
        kill_steps_and_close(lt)


def test_timeline_splits_idle_into_parked_lent_and_idle_and_free(tmp_path: Path) -> None:
    clock = FakeClock()
    lt = build(settings_for(tmp_path, auth={"enabled": True}), clock=clock)
    try:
        _, raw = token(lt, "alice", teams=["nlp"])
        lt.loop.recover()
        lt.loop.tick()  # every GPU idle in the ledger
        t0 = clock.now()
        lt.store.begin_replica(
            replica_id="chat/0", service="chat", slot=0, port=9000, node="node-b", gpus=(0, 1),
            wake=False, now=t0, reason="start",
        )  # fmt: skip
        for a, b in [(R.STARTING, R.SERVING), (R.SERVING, R.DRAINING), (R.DRAINING, R.PARKING)]:
            lt.store.move_replica("chat/0", a, b, now=t0 + 900 * (b != R.SERVING), message=b.value)
        lt.store.move_replica(
            "chat/0", R.PARKING, R.PARKED, now=t0 + 900, message="asleep", parked_as="sleep"
        )
        # The envelope as the inference controller recorded it: 3 lendable from t0 (a point
        # before the span, in force at its start), 6 from t0 + 900, none from t0 + 1350.
        lt.store.record_lending(LendingPoint(t0 - 60, 3, "continuous"))
        lt.store.record_lending(LendingPoint(t0 + 900, 6, "window"))
        lt.store.record_lending(LendingPoint(t0 + 1350, 0, "window"))
        clock.advance(1800)
        client, _ = login(lt, raw)
        t = client.get("/v1/pool/timeline", params={"hours": 0.5, "buckets": 2}).json()
        keys = ("serving", "research", "idle", "parked", "lent_idle", "free")
        first, second = ([b[k] for k in keys] for b in t["buckets"])
        # Serving 2 of 6; of the 4 idle, the 3 lendable are lent and idle, 1 is free.
        assert first == [2.0, 0.0, 4.0, 0.0, 3.0, 1.0]
        # All 6 idle, 2 of them parked; lendable (6 × 450 s + 0 × 450 s) / 900 s = 3 of the other 4.
        assert second == [0.0, 0.0, 6.0, 2.0, 3.0, 1.0]
        assert all(b["idle"] == b["parked"] + b["lent_idle"] + b["free"] for b in t["buckets"])
    finally:
        kill_steps_and_close(lt)


def test_simulation_reports_are_listed_and_read_by_name_and_nothing_outside_is(lt: Embedded) -> None:
    _, raw = token(lt, "alice", teams=["nlp"])
    client, _ = login(lt, raw)
    assert client.get("/v1/reports/simulations").json() == {"reports": []}  # no directory yet
    root = Path(lt.settings.simulation_reports_path)
    assert root == Path(lt.settings.state_dir) / "simulations"  # the default
    (root / "night").mkdir(parents=True)
    summary = {"policy": "continuous", "days": 1.0, "gpu_hours_harvested": 12.5, "preemptions": 3,
               "slo_violation_minutes": 0.0, "reclaim_latency_p50_s": None, "currency": "USD",
               "savings": "<b>not a number</b>"}  # fmt: skip
    (root / "night" / "summary.json").write_text(json.dumps(summary))
    (root / "week.json").write_text(
        json.dumps(
            {
                "policies": ["none", "window"],
                "runs": {
                    "none": {"policy": "none", "preemptions": 0},
                    "window": {"policy": "window", "preemptions": 7},
                },
            }
        )
    )
    (root / "broken.json").write_text("{not json")
    (root.parent / "secret.json").write_text(json.dumps({"policy": "outside"}))
    (root / "escape.json").symlink_to(root.parent / "secret.json")  # points outside: not a report
    listed = client.get("/v1/reports/simulations").json()["reports"]
    by_name = {r["name"]: r for r in listed}
    assert set(by_name) == {"night", "week", "broken"}
    night = by_name["night"]
    assert night["file"] == "night/summary.json" and night["error"] is None
    (run,) = night["runs"]
    assert run["policy"] == "continuous" and run["currency"] == "USD"
    assert run["figures"]["gpu_hours_harvested"] == 12.5 and run["figures"]["preemptions"] == 3
    assert run["figures"]["reclaim_latency_p50_s"] is None and run["figures"]["savings"] is None
    assert [r["policy"] for r in by_name["week"]["runs"]] == ["none", "window"]
    assert by_name["broken"]["runs"] == [] and by_name["broken"]["error"]
    detail = client.get("/v1/reports/simulations/week").json()
    assert detail["policies"] == ["none", "window"] and detail["runs"]["window"]["preemptions"] == 7
    assert client.get("/v1/reports/simulations/night").json()["runs"]["continuous"]["days"] == 1.0
    for away in ("..", "a%2F..%2Fsecret", "..%2Fsecret"):  # resolved or split into segments: no route
        assert client.get(f"/v1/reports/simulations/{away}").status_code == 404
    for bad in ("escape", "nothing", "...", ".hidden", "x..y", "%2E%2E"):
        r = client.get(f"/v1/reports/simulations/{bad}")
        assert r.status_code == 404, (bad, r.text)
        assert r.json()["errors"][0]["loc"] == "path.name"
    unreadable = client.get("/v1/reports/simulations/broken")
    assert unreadable.status_code == 422 and unreadable.json()["errors"][0]["loc"] == "path.name"
    assert TestClient(lt.app).get("/v1/reports/simulations").status_code == 401  # not logged in


def test_ui_is_503_until_built_then_served_with_a_csp(lt: Embedded, tmp_path: Path, monkeypatch: Any) -> None:
    dist = tmp_path / "dist"
    monkeypatch.setattr(dashboard, "WEB_DIST", dist)
    app = create_app(lt.app.state.ctx)
    client = TestClient(app)
    missing = client.get("/ui/")
    assert missing.status_code == 503 and "make web" in missing.text
    redirect = client.get("/", follow_redirects=False)
    assert redirect.status_code == 307 and redirect.headers["location"] == "/ui/"
    (dist / "assets").mkdir(parents=True)
    (dist / "index.html").write_text("<!doctype html><title>lowtide</title>")
    (dist / "assets" / "app.js").write_text("console.log(1)")
    page = client.get("/ui/")
    assert page.status_code == 200 and "<title>lowtide</title>" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/ui/assets/app.js").status_code == 200
    assert client.get("/ui/../pyproject.toml").status_code == 404
