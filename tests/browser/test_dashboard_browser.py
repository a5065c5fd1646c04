"""The web dashboard in a real browser (issue 11): Playwright for Python driving Debian's Chromium
against one embedded lowtide (SQLite, auth on, its control loop running in a thread, real step
processes) served by uvicorn on a loopback port.

A person logs in with a token; submits a job from a template through the editor and sees a
located error for a broken spec; watches a job run to the end through live updates and reads
its log; sees a preemption (asked of the store, as a reclaim would) on the job's page; cancels a
job; retries a failed job from its failed step with the keyboard; and never sees another team's
job. Every page is saved as a screenshot under ``test-output/screenshots/`` (printed at the end).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from conftest import REPO, require_service
from lowtide.api import services as services_api
from lowtide.api.dashboard import WEB_DIST
from lowtide.wiring import Embedded
from support import Served, embedded, kill_steps_and_close, wait_until

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SHOTS = REPO / "test-output" / "screenshots"
TIMEOUT_MS = 30_000
PY = sys.executable

try:
    from playwright.sync_api import Browser, Dialog, Page, expect, sync_playwright
except ImportError:  # pragma: no cover - dev extras pin it
    sync_playwright = None  # type: ignore[assignment]


@dataclass
class Site:
    lt: Embedded
    url: str
    browser: Browser
    tokens: dict[str, str]

    def page(self) -> Page:
        page = self.browser.new_page(viewport={"width": 1366, "height": 768})
        page.set_default_timeout(TIMEOUT_MS)
        return page

    def login(self, page: Page, who: str) -> None:
        page.goto(self.url + "/")
        page.get_by_label("API token").fill(self.tokens[who])
        page.get_by_role("button", name="Log in").click()
        expect(page.get_by_role("heading", level=1, name="Overview")).to_be_visible()

    def submit(self, who: str, doc: dict[str, Any]) -> str:
        r = TestClient(self.lt.app).post(
            "/v1/jobs",
            content=yaml.safe_dump(doc),
            headers={"Content-Type": "application/yaml", "Authorization": f"Bearer {self.tokens[who]}"},
        )
        assert r.status_code == 201, r.text
        return str(r.json()["id"])


def shot(page: Page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    if sync_playwright is None:
        require_service("playwright", "the playwright package is not installed (pip install -e '.[dev]')")
    if not os.access(CHROMIUM, os.X_OK):
        require_service("chromium", f"{CHROMIUM} is missing (apt-get install chromium)")
    if not (WEB_DIST / "index.html").is_file():
        require_service("dashboard build", f"{WEB_DIST} is not built (make web)")
    lt = embedded(tmp_path_factory.mktemp("dash"), auth={"enabled": True})
    now = lt.clock.now()
    tokens = {}
    for name, role, teams in (("root", "admin", None), ("alice", "user", ["nlp"]), ("bob", "user", ["cv"])):
        _, tokens[name] = lt.store.create_token(name=name, owner=name, role=role, now=now, teams=teams)
    lt.loop.recover()
    stop = threading.Event()
    loop = threading.Thread(target=lt.loop.run, args=(stop, 0.1), daemon=True)
    loop.start()
    served = Served(lt.app)
    assert sync_playwright is not None
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield Site(lt, served.url, browser, tokens)
        finally:
            browser.close()
            stop.set()
            loop.join(timeout=15)
            served.close()
            kill_steps_and_close(lt)
            print(f"\ndashboard screenshots: {SHOTS}")


def test_login_overview_and_a_user_never_sees_another_teams_job(site: Site) -> None:
    secret = site.submit(
        "bob", {"name": "bob-secret", "team": "cv", "steps": [{"name": "s", "command": ["true"]}]}
    )
    mine = site.submit(
        "alice", {"name": "alice-visible", "team": "nlp", "steps": [{"name": "s", "command": ["true"]}]}
    )
    page = site.page()
    page.goto(site.url + "/")
    expect(page.get_by_label("API token")).to_be_focused()
    shot(page, "01-login")
    page.get_by_label("API token").fill("not-a-token")
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("alert")).to_contain_text("unknown or revoked token")
    site.login(page, "alice")
    expect(page.get_by_role("heading", name="GPUs now")).to_be_visible()
    expect(page.locator(".live.ok")).to_be_visible()  # the event stream is connected
    expect(page.get_by_role("heading", name="Last 24 hours")).to_be_visible()
    page.wait_for_selector(".uplot")
    timeline = page.locator(".chart").first
    expect(timeline.locator(".u-legend")).to_contain_text("parked / sleeping")
    expect(timeline.locator(".u-legend")).to_contain_text("lent, idle")
    expect(timeline).to_have_attribute("aria-label", re.compile(r"lent, idle, free$"))
    expect(timeline).to_contain_text("parked or sleeping")  # the text summary of the last bucket
    expect(timeline).to_contain_text("lent and idle")
    shot(page, "02-overview")
    # a job holding node-a's four GPUs, and one that waits for them: the queue says why
    hog = site.submit(
        "alice",
        {"name": "hog", "team": "nlp", "steps": [{"name": "s", "command": ["sleep", "60"], "gpus": 4}]},
    )
    wait_until(lambda: any(a.job_id == hog for a in site.lt.store.active_attempts()), timeout=30, what="hog")
    waiter = site.submit(
        "alice", {"name": "waiter", "team": "nlp", "steps": [{"name": "s", "command": ["true"], "gpus": 4}]}
    )
    page.get_by_role("link", name="Jobs").click()
    expect(page.get_by_role("heading", level=1, name="Jobs")).to_be_visible()
    expect(page.get_by_role("link", name=f"alice-visible {mine}")).to_be_visible()
    queue = page.get_by_role("region", name="Queue (1)")
    expect(queue.get_by_role("link", name=f"waiter {waiter}")).to_be_visible()
    expect(queue.locator("tbody td").nth(6)).not_to_have_text("—")  # the reason it waits
    expect(
        page.get_by_role("region", name="Running (1)").get_by_role("link", name=f"hog {hog}")
    ).to_be_visible()
    assert "bob-secret" not in page.content() and secret not in page.content()
    shot(page, "03-jobs")
    page.get_by_label("State").select_option("SUCCEEDED")
    page.get_by_role("button", name="Filter").click()
    expect(page.get_by_role("region", name="Queue (0)")).to_be_visible()
    page.get_by_label("State").select_option("")
    page.get_by_role("button", name="Filter").click()
    for job in (hog, waiter):
        r = TestClient(site.lt.app).post(
            f"/v1/jobs/{job}/cancel", headers={"Authorization": f"Bearer {site.tokens['root']}"}
        )
        assert r.status_code == 200, r.text
    wait_until(
        lambda: not any(a.job_id == hog for a in site.lt.store.active_attempts()),
        timeout=30,
        what="hog to stop",
    )
    page.goto(f"{site.url}/ui/#/job/{secret}")
    expect(page.get_by_role("alert")).to_contain_text("not found")
    assert "bob-secret" not in page.content()
    sims = Path(site.lt.settings.simulation_reports_path) / "night-1"
    sims.mkdir(parents=True, exist_ok=True)
    summary = {"policy": "<b>continuous</b>", "days": 1.0, "gpu_hours_harvested": 123.4, "preemptions": 7,
               "slo_violation_minutes": 0.0, "reclaim_latency_p50_s": 12.0, "reclaim_latency_p99_s": None,
               "harvest_efficiency": 0.5, "savings": 10.0, "currency": "USD"}  # fmt: skip
    (sims / "summary.json").write_text(json.dumps(summary))
    for name in ("Services", "Reports"):
        page.get_by_role("link", name=name).click()
        expect(page.get_by_role("heading", level=1, name=name)).to_be_visible()
        if name == "Reports":
            region = page.get_by_role("region", name="Simulator reports")
            expect(region).to_contain_text("123.4")
            expect(region).to_contain_text("50.0 %")
            expect(region).to_contain_text("<b>continuous</b>")  # user text shown as text, not markup
            expect(region.locator("b")).to_have_count(0)
        shot(page, f"04-{name.lower()}")
    page.get_by_role("button", name="Log out").click()
    expect(page.get_by_label("API token")).to_be_visible()
    page.goto(site.url + "/ui/#/jobs")  # the cookie is gone: back to the login form
    expect(page.get_by_label("API token")).to_be_visible()
    page.close()


def test_submit_from_a_template_see_a_located_error_then_watch_a_job_run_and_read_its_log(site: Site) -> None:
    page = site.page()
    site.login(page, "alice")
    page.get_by_role("link", name="Submit").click()
    page.get_by_role("button", name="prep").click()
    editor = page.get_by_label("Job spec (YAML)")
    expect(editor).to_have_value(re.compile(r"use: prep"))
    assert "use: prep" in editor.input_value() and "team: nlp" in editor.input_value()
    expect(page.locator("#spec-status")).to_have_text("Valid.")
    shot(page, "05-submit-template")
    broken = "name: broken\nteam: nlp\nsteps:\n  - name: main\n    command: [echo, hi]\n    gpus: 99\n"
    editor.fill(broken)
    error = page.locator("#spec-errors li").first
    expect(error).to_contain_text("line 6")
    expect(error).to_contain_text("steps[0].gpus")
    expect(page.locator(".gutter .bad")).to_have_text("6\n")
    shot(page, "06-submit-located-error")
    good = {
        "name": "dash-hello",
        "team": "nlp",
        "params": {"greeting": "hello"},
        "steps": [
            {"name": "prep", "command": [PY, "-c", "print('prepared')"], "gpus": 0},
            {
                "name": "main",
                "command": [PY, "-c", "print('{{params.greeting}} from the dashboard')"],
                "gpus": 1,
                "depends": ["prep"],
            },
        ],
    }
    editor.fill(yaml.safe_dump(good, sort_keys=False))
    expect(page.locator("#spec-status")).to_have_text("Valid.")
    page.get_by_role("button", name="Submit", exact=True).click()
    page.wait_for_url("**/ui/#/job/*")
    heading = page.get_by_role("heading", level=1)
    expect(heading).to_contain_text("dash-hello")
    expect(heading).to_contain_text("SUCCEEDED")  # live: no reload
    expect(page.locator("svg.dag .dag-node[data-step=main]")).to_have_attribute("data-state", "SUCCEEDED")
    page.get_by_label("Log of step").select_option("main")
    expect(page.locator("#log")).to_contain_text("hello from the dashboard")
    shot(page, "07-job-succeeded")
    # rerun with a changed parameter: a new job, whose log says so
    first = page.url
    page.get_by_label("greeting").fill("bonjour")
    page.get_by_role("button", name="Submit with these parameters").click()
    page.wait_for_url(lambda url: url != first and "#/job/" in url)
    expect(page.get_by_role("heading", level=1)).to_contain_text("SUCCEEDED")
    page.get_by_label("Log of step").select_option("main")
    expect(page.locator("#log")).to_contain_text("bonjour from the dashboard")
    page.close()


def test_a_preemption_shows_on_the_job_page_and_a_job_is_cancelled(site: Site) -> None:
    code = (
        "import os, time\n"
        "if os.environ['LOWTIDE_ATTEMPT'] == '1':\n"
        "    print('training, attempt 1', flush=True)\n"
        "    time.sleep(120)\n"
        "print('resumed after preemption', flush=True)\n"
    )
    job = site.submit(
        "alice",
        {
            "name": "preempt-me",
            "team": "nlp",
            "steps": [{"name": "train", "command": [PY, "-c", code], "gpus": 2}],
        },
    )
    lt = site.lt
    attempt = wait_until(
        lambda: next((a for a in lt.store.active_attempts() if a.job_id == job), None),
        timeout=30,
        what="the step to start",
    )
    page = site.page()
    site.login(page, "alice")
    page.goto(f"{site.url}/ui/#/job/{job}")
    expect(page.get_by_role("heading", level=1)).to_contain_text("RUNNING")
    expect(page.locator("#log")).to_contain_text("training, attempt 1")
    lt.store.request_preemption(attempt.id, grace_s=1, reason="GPUs reclaimed (test)", now=lt.clock.now())
    expect(page.get_by_role("heading", level=1)).to_contain_text("SUCCEEDED")
    expect(page.locator(".stats").first).to_contain_text("1 preemptions")
    expect(page.locator("strong.preempted")).to_have_count(1)
    page.get_by_label("Log of step").select_option("train")
    expect(page.locator("#log")).to_contain_text("resumed after preemption")
    page.wait_for_timeout(1500)  # a few more tail polls: the log must not repeat itself
    assert page.locator("#log").inner_text().count("=== lowtide: step exited with code 0") == 1
    shot(page, "08-job-preempted")

    sleeper = site.submit(
        "alice",
        {"name": "cancel-me", "team": "nlp", "steps": [{"name": "wait", "command": ["sleep", "120"]}]},
    )
    page.goto(f"{site.url}/ui/#/job/{sleeper}")
    expect(page.get_by_role("heading", level=1)).to_contain_text("RUNNING")

    def accept(dialog: Dialog) -> None:
        dialog.accept()

    page.once("dialog", accept)
    page.get_by_role("button", name="Cancel job").click()
    expect(page.get_by_role("heading", level=1)).to_contain_text("CANCELLED")
    shot(page, "09-job-cancelled")
    page.close()


def test_a_failed_job_is_retried_from_its_failed_step_with_the_keyboard(site: Site, tmp_path: Any) -> None:
    flag = tmp_path / "fixed"
    needs_flag = f"import os, sys; sys.exit(0 if os.path.exists({str(flag)!r}) else 3)"
    job = site.submit(
        "alice",
        {
            "name": "retry-me",
            "team": "nlp",
            "steps": [
                {"name": "prep", "command": [PY, "-c", "print('prep ran')"]},
                {"name": "train", "command": [PY, "-c", needs_flag], "depends": ["prep"]},
            ],
        },
    )
    page = site.page()
    site.login(page, "alice")
    page.goto(f"{site.url}/ui/#/job/{job}")
    expect(page.get_by_role("heading", level=1)).to_contain_text("FAILED")
    button = page.get_by_role("button", name="Retry from failed steps")
    expect(button).to_be_visible()
    shot(page, "10-job-failed-retry")
    flag.touch()  # the cause is fixed
    button.focus()
    page.keyboard.press("Enter")
    expect(page.get_by_role("heading", level=1)).to_contain_text("SUCCEEDED")
    expect(page.get_by_role("button", name="Retry from failed steps")).to_have_count(0)
    numbers = [(a.step_name, a.number) for a in site.lt.store.job_detail(job).attempts]
    assert numbers == [("prep", 1), ("train", 1), ("train", 2)]  # prep was not run again
    shot(page, "11-job-retried")
    page.close()


def _fleet(now: float) -> tuple[str, str]:
    """A fleet as `/v1/services` and `/v1/reclaims?state=OPEN` describe one mid-reclaim, built
    from the API's own response models (so the shapes are the API's): two services, one growing."""
    replica = services_api.ReplicaOut
    sig = services_api.SignalsOut

    def signals(name: str, running: float, waiting: float) -> services_api.SignalsOut:
        return sig(
            replica=name,
            running=running,
            waiting=waiting,
            kv_usage=0.4,
            generation_tokens_per_s=900.0,
            prompt_tokens_per_s=2000.0,
            ttft_p90_s=0.3,
            e2e_p90_s=4.0,
            stale=False,
            stale_reason="",
        )

    def service(
        name: str, serving: int, starting: int, parked: int, target: int, reason: str
    ) -> services_api.ServiceOut:
        states = ["SERVING"] * serving + ["STARTING"] * starting + ["PARKED"] * parked
        reps = [
            replica(
                id=f"{name}-{i}",
                slot=i,
                state=st,
                node=None if st == "PARKED" else "node-a",
                gpus=[] if st == "PARKED" else [i],
                port=8100 + i,
                parked_as="sleep" if st == "PARKED" else None,
                since=now - 600,
                failures=0,
                retry_at=0.0,
                message="",
            )
            for i, st in enumerate(states)
        ]
        return services_api.ServiceOut(
            name=name,
            model=f"meta-llama/{name}",
            gpus_per_replica=1,
            min_replicas=1,
            max_replicas=4,
            park="sleep",
            desired=target,
            needed=target,
            target=target,
            recommendation=target,
            per_signal={"running": target, "waiting": target - 1},
            reason=reason,
            guard=None,
            unknown=False,
            blocked="",
            alert="",
            fresh_at=now,
            source_error=None,
            signals=[signals(r.id, 12.0, 3.0) for r in reps if r.state == "SERVING"],
            replicas=reps,
            # The last ten minutes of load as the control plane kept it (a sample a minute).
            load_history=[
                services_api.LoadSampleOut(
                    at=now - 60 * (10 - i), running=2.0 * i, waiting=max(0.0, i - 6.0), desired=1 + i // 5
                )
                for i in range(11)
            ],
        )

    body = services_api.ServicesOut(
        services=[
            service("chat", 2, 1, 1, 3, "running 36 > 2 replicas × 16: scale up to 3"),
            service("code", 1, 0, 3, 1, "idle: holding the minimum"),
        ],
        lending=services_api.LendingOut(
            mode="reclaiming",
            lendable_gpus=2,
            inference_claim_gpus=4,
            reserve_gpus=0,
            lending_open=False,
            return_by=now + 60,
            fail_safe=None,
            reasons=["chat needs 1 more GPU"],
        ),
    )
    reclaim = services_api.ReclaimOut(
        id=7,
        service="chat",
        replica_id="chat-2",
        reason="chat surge",
        gpus=1,
        victims=[41],
        state="OPEN",
        detected_at=now - 20,
        decided_at=now - 19,
        notice_at=now - 19,
        freed_at=None,
        healthy_at=None,
        total_s=None,
    )
    return body.model_dump_json(), "[" + reclaim.model_dump_json() + "]"


def test_services_and_a_reclaim_in_progress_are_drawn_from_the_api_shapes(site: Site) -> None:
    # This lowtide runs no inference services; the browser is handed the answers of one that does.
    services, reclaims = _fleet(site.lt.clock.now())
    page = site.page()
    page.route(
        "**/v1/services",
        lambda route: route.fulfill(status=200, content_type="application/json", body=services),
    )
    page.route(
        "**/v1/reclaims?state=OPEN",
        lambda route: route.fulfill(status=200, content_type="application/json", body=reclaims),
    )
    site.login(page, "alice")
    expect(page.get_by_role("region", name="Services").get_by_role("link", name="chat")).to_be_visible()
    expect(page.get_by_role("region", name="Lending")).to_contain_text("reclaiming")
    expect(page.get_by_role("region", name="Reclaims in progress")).to_contain_text("#7")
    shot(page, "10-overview-with-services")
    page.get_by_role("link", name="Services").click()
    chat = page.get_by_role("region", name="chat")
    expect(chat).to_contain_text("2 serving, 1 starting, 1 parked")
    expect(chat).to_contain_text("scale up to 3")
    expect(page.locator(".uplot").first).to_be_visible(timeout=15_000)  # the last hour's load chart
    expect(chat).to_contain_text("chat: load over the last hour")
    shot(page, "11-services")
    page.close()
