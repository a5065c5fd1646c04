"""`GET /v1/reports/monthly` through the real app (auth on, SQLite, a fake clock), and
`lowtide report --month` in every format as a real command against it served over real HTTP.

The ledger (6 GPUs managed from 2026-09-01 00:00 UTC; now is 2026-11-05 12:00 UTC; 2.5 EUR per
GPU-hour configured), every run booked through the store as the loop books it:

    job sft (nlp)          2 GPUs  Sep 10 00:00–10:00           succeeded   20 GPU-h in September
    job pretrain (nlp)     2 GPUs  Oct 3 00:00–12:00            succeeded   24 GPU-h in October
    job vision (vision)    4 GPUs  Oct 20 10:00–12:30           preempted   10 GPU-h, 2 GPU-h lost
                                   (checkpoint at 12:00, stopped at 12:30: 4 GPUs × 30 min)
                           4 GPUs  Oct 31 22:00 – Nov 1 02:00   succeeded    8 GPU-h in October (UTC),
                                                                             8 in November

October (UTC, 744 h): 2 jobs, 42 GPU-h against September's 20 (+22, +110 %), 42/744 equivalent
GPUs, 105 EUR saved, 1 preemption, 2 GPU-h lost; nlp 24 (+20 %), vision 18 (new).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from lowtide.cli.main import app as cli_app
from lowtide.cli.report_cmd import monthly_csv, monthly_html
from lowtide.control.clock import FakeClock
from lowtide.control.records import NewJob
from lowtide.domain.ids import new_job_id
from lowtide.domain.spec_parse import build_job_spec
from lowtide.domain.spec_render import render_step
from lowtide.domain.states import AttemptState, StepState
from lowtide.policy.accounting import AccountingPolicy
from lowtide.policy.outcomes import RetryPolicy, classify_exit
from lowtide.wiring import Embedded, build
from support import Served, running, settings_for

H = 3600.0


def utc(mo: int, d: int, h: float = 0.0) -> float:
    return datetime(2026, mo, d, tzinfo=UTC).timestamp() + h * H


SEP1 = utc(9, 1)
NOW = utc(11, 5, 12)
XSS = "<script>alert(1)</script>"
MARKUP = "[/bold]x"


def spec(name: str, team: str, gpus: int) -> dict[str, Any]:
    return {"name": name, "team": team, "steps": [{"name": "train", "command": ["true"], "gpus": gpus}]}


class Fleet:
    """An embedded lowtide (loop not running) whose ledger holds the runs of the module docstring."""

    def __init__(self, tmp_path: Path) -> None:
        self.clock = FakeClock(SEP1)
        self.lt: Embedded = build(settings_for(tmp_path), clock=self.clock)
        self.store = self.lt.store
        self.lt.app.state.ctx.accounting = AccountingPolicy(
            price_per_gpu_hour=2.5, currency="EUR", timezone="UTC"
        )
        _, self.token = self.store.create_token(name="root", owner="root", role="admin", now=SEP1)
        self.client = TestClient(self.lt.app, headers={"Authorization": f"Bearer {self.token}"})
        self.store.ensure_gpus(self.lt.nodes, SEP1)
        sft = self.submit(spec("sft", "nlp", 2))
        pretrain = self.submit(spec("pretrain", "nlp", 2))
        vision = self.submit(spec("vision", "vision", 4))
        self.run(sft, "node-a", (0, 1), utc(9, 10), utc(9, 10, 10))
        self.run(pretrain, "node-a", (0, 1), utc(10, 3), utc(10, 3, 12))
        self.preempted(vision, "node-a", (0, 1, 2, 3), utc(10, 20, 10), utc(10, 20, 12), utc(10, 20, 12.5))
        self.run(vision, "node-a", (0, 1, 2, 3), utc(10, 31, 22), utc(11, 1, 2))
        self.clock.set(NOW)

    def submit(self, doc: dict[str, Any]) -> str:
        r = self.client.post(
            "/v1/jobs", content=yaml.safe_dump(doc), headers={"Content-Type": "application/yaml"}
        )
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def submit_unchecked(self, name: str, team: str, gpus: int) -> str:
        """A job whose team the spec rules would refuse (so the output's escaping is what stands
        between that name and the terminal or the browser)."""
        parsed = dataclasses.replace(build_job_spec(spec(name, "x", gpus)), team=team)
        job_id = new_job_id()
        layout = self.lt.loop.settings.layout
        resolved = tuple(render_step(parsed, s, job_id=job_id, layout=layout) for s in parsed.steps)
        self.store.create_job(
            NewJob(
                id=job_id,
                spec=parsed,
                resolved=resolved,
                source_text="",
                owner="root",
                submitted_at=SEP1,
            )
        )
        return job_id

    def begin(self, job_id: str, node: str, gpus: tuple[int, ...], at: float) -> int:
        launch = running(
            self.store,
            self.store.begin_attempt(
                job_id=job_id,
                step="train",
                node=node,
                gpus=gpus,
                layout=self.lt.loop.settings.layout,
                now=at,
                reason="test",
            ),
        )
        return launch.attempt_id

    def finish(self, attempt_id: int, at: float, exit_code: int) -> None:
        ctx = self.store.exit_context(attempt_id)
        decision = classify_exit(
            step_state=ctx.step_state,
            noticed=ctx.attempt_state == AttemptState.STOPPING,
            exit_code=exit_code,
            signal=None,
            killed_at_deadline=False,
            retries_used=ctx.retries_used,
            max_retries=ctx.max_retries,
            now=at,
            retry=RetryPolicy(),
        )
        self.store.finish_attempt(
            ctx,
            decision,
            ended_at=at,
            exit_code=exit_code,
            signal=None,
            killed_at_deadline=False,
            half_life_s=H,
        )

    def run(self, job_id: str, node: str, gpus: tuple[int, ...], start: float, end: float) -> None:
        self.finish(self.begin(job_id, node, gpus, start), end, 0)

    def preempted(
        self, job_id: str, node: str, gpus: tuple[int, ...], start: float, checkpoint: float, stop: float
    ) -> None:
        attempt_id = self.begin(job_id, node, gpus, start)
        self.store.record_checkpoint(attempt_id, label="ckpt-1", progress=None, source="api", now=checkpoint)
        self.store.request_preemption(attempt_id, grace_s=30, reason="GPUs reclaimed", now=stop)
        self.store.mark_stopping(attempt_id, deadline=stop + 30, reason="notice", now=stop)
        assert self.store.exit_context(attempt_id).step_state == StepState.PREEMPTING
        self.finish(attempt_id, stop, 143)

    def add_odd_teams(self) -> None:
        """Two October runs on node-b by teams named like markup: 1 and 2 GPU-hours."""
        self.run(self.submit_unchecked("xss", XSS, 1), "node-b", (0,), utc(10, 5), utc(10, 5, 1))
        self.run(self.submit_unchecked("markup", MARKUP, 1), "node-b", (1,), utc(10, 5), utc(10, 5, 2))

    def monthly(self, **params: Any) -> Any:
        return self.client.get("/v1/reports/monthly", params=params)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    env = Fleet(tmp_path)
    yield env
    env.client.close()
    env.lt.close()


def locs(response: Any) -> list[str]:
    return [e["loc"] for e in response.json()["errors"]]


# -- the API ----------------------------------------------------------------------------------------


def test_october_against_september_in_total_and_per_team(fleet: Fleet) -> None:
    r = fleet.monthly(month="2026-10")
    assert r.status_code == 200, r.text
    d = r.json()
    assert (d["month"], d["previous_month"], d["timezone"], d["complete"]) == (
        "2026-10",
        "2026-09",
        "UTC",
        True,
    )
    assert (d["start"], d["end"], d["hours"]) == (utc(10, 1), utc(11, 1), 744.0)
    assert (d["previous_start"], d["previous_end"]) == (utc(9, 1), utc(10, 1))
    assert (d["start_local"], d["end_local"]) == ("2026-10-01T00:00:00+00:00", "2026-11-01T00:00:00+00:00")
    assert (d["price_per_gpu_hour"], d["currency"]) == (2.5, "EUR")
    assert (d["capacity_gpu_hours"], d["lent_gpu_hours"], d["lent_gpus"]) == (6 * 744.0, 6 * 744.0, 6.0)
    t = d["total"]
    assert (t["key"], t["team"], t["jobs_run"], t["previous_jobs_run"]) == ("total", None, 2, 1)
    assert (t["research_gpu_hours"], t["previous_research_gpu_hours"], t["change_gpu_hours"]) == (
        42.0,
        20.0,
        22.0,
    )
    assert t["change_pct"] == pytest.approx(110.0)
    assert t["equivalent_gpus"] == pytest.approx(42 / 744)
    assert (t["savings"], t["preemptions"], t["lost_gpu_hours"]) == (105.0, 1, 2.0)
    nlp, vision = d["teams"]
    assert (nlp["team"], nlp["jobs_run"], nlp["previous_jobs_run"], nlp["research_gpu_hours"]) == (
        "nlp",
        1,
        1,
        24.0,
    )
    assert (nlp["previous_research_gpu_hours"], nlp["change_gpu_hours"], nlp["savings"]) == (20.0, 4.0, 60.0)
    assert nlp["change_pct"] == pytest.approx(20.0)
    assert (nlp["preemptions"], nlp["lost_gpu_hours"]) == (0, 0.0)
    assert (vision["team"], vision["jobs_run"], vision["research_gpu_hours"], vision["change_pct"]) == (
        "vision",
        1,
        18.0,
        None,
    )
    assert (vision["savings"], vision["preemptions"], vision["lost_gpu_hours"]) == (45.0, 1, 2.0)
    assert vision["equivalent_gpus"] == pytest.approx(18 / 744)


def test_months_follow_the_time_zone_and_price_and_currency_can_be_given(fleet: Fleet) -> None:
    d = fleet.monthly(month="2026-10", tz="Europe/Berlin", price="1300", currency="KRW").json()
    assert (d["start_local"], d["end_local"], d["hours"]) == (
        "2026-10-01T00:00:00+02:00",
        "2026-11-01T00:00:00+01:00",
        745.0,
    )
    # The last vision run has 1 h of Berlin's October (it ends at 23:00 UTC), not 2.
    assert d["total"]["research_gpu_hours"] == 24 + 10 + 4
    assert (d["price_per_gpu_hour"], d["currency"], d["total"]["savings"]) == (1300.0, "KRW", 38 * 1300.0)


def test_a_month_in_progress_ends_now(fleet: Fleet) -> None:
    d = fleet.monthly(month="2026-11").json()
    assert (d["start"], d["end"], d["hours"], d["complete"]) == (utc(11, 1), NOW, 108.0, False)
    t = d["total"]
    assert (t["jobs_run"], t["research_gpu_hours"], t["previous_research_gpu_hours"]) == (1, 8.0, 42.0)
    assert t["change_pct"] == pytest.approx((8 - 42) / 42 * 100)
    # A month with nothing before it: no percentage.
    d = fleet.monthly(month="2026-09").json()
    assert (d["total"]["research_gpu_hours"], d["total"]["change_pct"], d["total"]["previous_jobs_run"]) == (
        20.0,
        None,
        0,
    )


@pytest.mark.parametrize(
    ("params", "where", "words"),
    [
        ({}, ["query.month"], "Field required"),
        ({"month": "2026-13"}, ["query.month"], "01..12"),
        ({"month": "2026-00"}, ["query.month"], "01..12"),
        ({"month": "2026-1"}, ["query.month"], "YYYY-MM"),
        ({"month": "october"}, ["query.month"], "YYYY-MM"),
        ({"month": "2026-10-01"}, ["query.month"], "YYYY-MM"),
        ({"month": "1969-12"}, ["query.month"], "1970"),
        ({"month": "2026-12"}, ["query.month"], "has not begun"),
        ({"month": "9998-12"}, ["query.month"], "has not begun"),
        ({"month": "x" * 17}, ["query.month"], "at most 16"),
        ({"month": "2026-10\x00"}, ["query.month"], "NUL"),
        ({"month": "2026-10", "price": "-1"}, ["query.price"], "greater than or equal to 0"),
        ({"month": "2026-10", "price": "nan"}, ["query.price"], "finite"),
        ({"month": "2026-10", "price": "inf"}, ["query.price"], "finite"),
        ({"month": "2026-10", "price": "1e400"}, ["query.price"], "finite"),
        ({"month": "2026-10", "price": "1e13"}, ["query.price"], "less than or equal to"),
        ({"month": "2026-10", "price": "cheap"}, ["query.price"], "number"),
        ({"month": "2026-10", "currency": "krw"}, ["query.currency"], "[A-Z]{3}"),
        ({"month": "2026-10", "currency": "KRWX"}, ["query.currency"], "[A-Z]{3}"),
        ({"month": "2026-10", "currency": "K1W"}, ["query.currency"], "[A-Z]{3}"),
        ({"month": "2026-10", "tz": "Mars/Olympus"}, ["query.tz"], "unknown time zone"),
        ({"month": "2026-10", "tz": "../../etc/passwd"}, ["query.tz"], "unknown time zone"),
        ({"month": "2026-13", "tz": "Mars/Olympus"}, ["query.tz", "query.month"], "01..12"),
    ],
)
def test_bad_months_prices_currencies_and_zones_are_refused_naming_the_field(
    fleet: Fleet, params: dict[str, str], where: list[str], words: str
) -> None:
    r = fleet.monthly(**params)
    assert r.status_code == 422, r.text
    assert locs(r) == where
    assert words in json.dumps(r.json())


def test_the_monthly_report_needs_a_person_token(fleet: Fleet) -> None:
    r = fleet.client.get("/v1/reports/monthly", params={"month": "2026-10"}, headers={"Authorization": ""})
    assert r.status_code == 401


def test_the_defaults_are_the_configured_price_currency_and_zone(fleet: Fleet) -> None:
    fleet.lt.app.state.ctx.accounting = AccountingPolicy(
        price_per_gpu_hour=1300.0, currency="KRW", timezone="Asia/Seoul"
    )
    d = fleet.monthly(month="2026-10").json()
    assert (d["currency"], d["price_per_gpu_hour"], d["timezone"]) == ("KRW", 1300.0, "Asia/Seoul")
    assert d["start_local"] == "2026-10-01T00:00:00+09:00"


# -- the CLI against the app served over real HTTP ------------------------------------------------


@pytest.fixture
def cli(fleet: Fleet) -> Iterator[Any]:
    served = Served(fleet.lt.app)

    def run(*args: str) -> Any:
        return CliRunner().invoke(
            cli_app, ["--url", served.url, "--token", fleet.token, *args], env={"COLUMNS": "200"}
        )

    yield run
    served.close()


HEADLINE = "2026-10: 2 jobs, 42.0 GPU-h (+110 % vs 2026-09), as if 0.06 GPUs were added, saved 105.00 EUR"


def test_month_as_a_table_with_the_headline(cli: Any) -> None:
    result = cli("report", "--month", "2026-10")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert HEADLINE in out
    assert "period 2026-10-01T00:00:00+00:00 → 2026-11-01T00:00:00+00:00 (744.0 h, UTC, complete)" in out
    assert "lent 4,464.0 GPU-h (6.00 GPUs) of 4,464.0; 1 preemption(s), 2.00 GPU-h lost" in out
    lines = out.splitlines()
    nlp = next(line for line in lines if "│ nlp" in line)
    assert [c.strip() for c in nlp.split("│")[1:-1]] == [
        "nlp",
        "1",
        "24.00",
        "20.00",
        "+4.00",
        "+20 %",
        "0.03",
        "60.00",
        "0",
        "0.00",
    ]
    total = next(line for line in lines if "TOTAL" in line)
    assert [c.strip() for c in total.split("│")[2:-1]] == [
        "2",
        "42.00",
        "20.00",
        "+22.00",
        "+110 %",
        "0.06",
        "105.00",
        "1",
        "2.00",
    ]
    assert "vision" in out and "SAVINGS EUR" in out and "GPU-H 2026-09" in out


def test_month_with_price_currency_and_zone(cli: Any) -> None:
    result = cli(
        "report", "--month", "2026-10", "--price", "1300", "--currency", "KRW", "--tz", "Europe/Berlin"
    )
    assert result.exit_code == 0, result.output
    assert (
        "2026-10: 2 jobs, 38.0 GPU-h (+90 % vs 2026-09), as if 0.05 GPUs were added, saved 49,400.00 KRW"
        in result.stdout
    )
    assert "SAVINGS KRW" in result.stdout
    progress = cli("report", "--month", "2026-11")
    assert progress.exit_code == 0, progress.output
    assert "2026-11 so far: 1 job, 8.0 GPU-h (-81 % vs 2026-10)" in progress.stdout
    assert "in progress" in progress.stdout


def test_month_as_json_is_the_api_body(cli: Any, fleet: Fleet) -> None:
    api = fleet.monthly(month="2026-10").json()
    for args in (("--format", "json"), ("--json",), ("--format", "JSON", "--json")):
        result = cli("report", "--month", "2026-10", *args)
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout) == api


def test_month_as_csv_one_row_per_team_and_a_total(cli: Any) -> None:
    result = cli("report", "--month", "2026-10", "--format", "csv")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [(r["row"], r["team"]) for r in rows] == [("team", "nlp"), ("team", "vision"), ("total", "")]
    nlp, vision, total = rows
    assert nlp == {
        "month": "2026-10",
        "row": "team",
        "team": "nlp",
        "jobs_run": "1",
        "previous_jobs_run": "1",
        "research_gpu_hours": "24.0000",
        "previous_research_gpu_hours": "20.0000",
        "change_gpu_hours": "4.0000",
        "change_pct": "20.00",
        "equivalent_gpus": "0.0323",
        "savings": "60.00",
        "currency": "EUR",
        "preemptions": "0",
        "lost_gpu_hours": "0.0000",
    }
    assert (vision["change_pct"], vision["preemptions"], vision["lost_gpu_hours"]) == ("", "1", "2.0000")
    assert (total["jobs_run"], total["research_gpu_hours"], total["change_pct"], total["savings"]) == (
        "2",
        "42.0000",
        "110.00",
        "105.00",
    )


def test_month_as_a_self_contained_html_page(cli: Any) -> None:
    result = cli("report", "--month", "2026-10", "--format", "html")
    assert result.exit_code == 0, result.output
    page = result.stdout
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<style>" in page and HEADLINE in page
    for external in ("<script", "<link", "src=", "href=", "url(", "@import", "http://", "https://"):
        assert external not in page, external
    assert "<td>nlp</td>" in page and "<tr class=total><td>Total</td><td class=num>2</td>" in page


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--month", "2026-13"), "--month: '2026-13' is not a month: the month must be 01..12"),
        (("--month", "Nov"), "--month: expected a month as YYYY-MM (such as 2026-11); got 'Nov'"),
        (("--month", "2026-12"), "--month: 2026-12 has not begun yet in UTC"),
        (("--month", "2026-10", "--currency", "krw"), "--currency: String should match pattern"),
        (("--month", "2026-10", "--price", "-5"), "--price: Input should be greater than or equal to 0"),
        (("--month", "2026-10", "--price", "nan"), "--price: Input should be a finite number"),
        (("--month", "2026-10", "--tz", "Mars/Olympus"), "--tz: unknown time zone 'Mars/Olympus'"),
        (("--month", "2026-10", "--format", "xml"), "--format: unknown format 'xml'"),
        (("--month", "2026-10", "--since", "7d"), "--month sets the period itself; drop --since"),
        (("--month", "2026-10", "--by", "team"), "drop --by"),
        (("--month", "2026-10", "--format", "csv", "--json"), "--json and --format csv disagree"),
        (
            (
                "--format",
                "csv",
            ),
            "--format csv goes with --month",
        ),
        (
            (
                "--format",
                "html",
            ),
            "--format html goes with --month",
        ),
        (
            (
                "--price",
                "3",
            ),
            "--price and --currency go with --month",
        ),
        (
            (
                "--currency",
                "KRW",
            ),
            "--price and --currency go with --month",
        ),
    ],
)
def test_bad_report_options_say_why_and_exit_2(cli: Any, args: tuple[str, ...], words: str) -> None:
    result = cli("report", *args)
    assert result.exit_code == 2, result.output
    assert words in " ".join(result.stderr.split()), result.stderr
    assert result.stdout == ""


def test_without_month_the_usage_report_is_unchanged(cli: Any, fleet: Fleet) -> None:
    table = cli("report", "--since", "40d", "--by", "team")
    assert table.exit_code == 0, table.output
    assert "nlp" in table.stdout and "vision" in table.stdout and "SAVINGS EUR" in table.stdout
    as_json = cli("report", "--since", "40d", "--format", "json")
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout) == fleet.client.get("/v1/reports/usage", params={"start": "40d"}).json()


# -- user-controlled strings in every output --------------------------------------------------------


def test_team_names_are_escaped_in_the_table_the_html_and_the_csv(cli: Any, fleet: Fleet) -> None:
    fleet.add_odd_teams()
    api = fleet.monthly(month="2026-10").json()
    assert {t["team"] for t in api["teams"]} == {"nlp", "vision", XSS, MARKUP}  # raw in JSON

    table = cli("report", "--month", "2026-10")
    assert table.exit_code == 0, table.output
    assert XSS in table.stdout and MARKUP in table.stdout  # printed as text, not read as markup
    assert "2026-10: 4 jobs, 45.0 GPU-h" in table.stdout

    page = cli("report", "--month", "2026-10", "--format", "html")
    assert page.exit_code == 0, page.output
    assert "<script" not in page.stdout and "alert(1)</script>" not in page.stdout
    assert "<td>&lt;script&gt;alert(1)&lt;/script&gt;</td>" in page.stdout
    assert "<td>[/bold]x</td>" in page.stdout

    sheet = cli("report", "--month", "2026-10", "--format", "csv")
    assert sheet.exit_code == 0, sheet.output
    teams = [r["team"] for r in csv.DictReader(io.StringIO(sheet.stdout)) if r["row"] == "team"]
    assert sorted(teams) == sorted(["nlp", "vision", XSS, MARKUP])


def test_csv_cells_a_spreadsheet_would_run_get_a_quote_and_html_escapes_quotes() -> None:
    row = {
        "key": '=HYPERLINK("x")',
        "team": '=HYPERLINK("x")',
        "jobs_run": 1,
        "previous_jobs_run": 0,
        "research_gpu_hours": 1.0,
        "previous_research_gpu_hours": 0.0,
        "change_gpu_hours": 1.0,
        "change_pct": None,
        "equivalent_gpus": 0.5,
        "savings": 2.0,
        "preemptions": 0,
        "lost_gpu_hours": 0.0,
    }
    report = {
        "month": "2026-10",
        "previous_month": "2026-09",
        "timezone": "UTC",
        "start_local": "a",
        "end_local": "b",
        "hours": 2.0,
        "complete": True,
        "price_per_gpu_hour": 2.0,
        "currency": "EUR",
        "capacity_gpu_hours": 2.0,
        "lent_gpu_hours": 2.0,
        "lent_gpus": 1.0,
        "total": {**row, "key": "total", "team": None},
        "teams": [row, {**row, "key": "a\"b'c&d", "team": "a\"b'c&d"}],
    }
    teams = [r["team"] for r in csv.DictReader(io.StringIO(monthly_csv(report)))]
    assert teams == ['\'=HYPERLINK("x")', "a\"b'c&d", ""]
    page = monthly_html(report)
    assert "<td>a&quot;b&#x27;c&amp;d</td>" in page and "<td>=HYPERLINK(&quot;x&quot;)</td>" in page
