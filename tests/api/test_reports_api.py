"""`GET /v1/reports/usage` through the real app (auth on, SQLite, a fake clock), and the CLI
(`lowtide report`, `lowtide show`) as real commands against it served over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from lowtide.cli.main import app as cli_app
from lowtide.cli.report_cmd import gpu_time, lost_work_line
from lowtide.control.clock import FakeClock
from lowtide.domain.states import StepState
from lowtide.policy.accounting import AccountingPolicy
from lowtide.policy.outcomes import RetryPolicy, classify_exit
from lowtide.wiring import Embedded, build
from support import Served, running, settings_for

H = 3600.0
NOW = 1_790_000_000.0  # 2026-09-21 14:13:20 UTC
GOOD_JOB = b"""
name: sft
team: nlp
steps:
  - {name: train, command: ["true"], gpus: 2, checkpoint: true}
"""


class Lt:
    """An embedded lowtide (loop not running) with an admin token and a preempted job."""

    def __init__(self, tmp_path: Path) -> None:
        self.clock = FakeClock(NOW - 30 * H)
        self.lt: Embedded = build(settings_for(tmp_path), clock=self.clock)
        self.store = self.lt.store
        self.ctx = self.lt.app.state.ctx
        self.ctx.accounting = AccountingPolicy(price_per_gpu_hour=2.5, currency="EUR", timezone="UTC")
        _, self.token = self.store.create_token(name="root", owner="root", role="admin", now=self.clock.now())
        self.client = TestClient(self.lt.app, headers={"Authorization": f"Bearer {self.token}"})
        self.store.ensure_gpus(self.lt.nodes, self.clock.now())  # 6 GPUs from NOW - 30 h
        self.job_id = self._preempted_job()
        self.clock.set(NOW)

    def _preempted_job(self) -> str:
        """A job whose 2-GPU step ran 2 h, checkpointed, ran 5 min more and was preempted (10 s
        to exit): 2 × 310 s of work lost. Ends at NOW - 2 h + 310 s; it runs again from NOW - 1 h."""
        r = self.client.post("/v1/jobs", content=GOOD_JOB, headers={"Content-Type": "application/yaml"})
        assert r.status_code == 201, r.text
        job_id: str = r.json()["id"]
        self.clock.set(NOW - 4 * H)
        s = self.store
        launch = running(
            s,
            s.begin_attempt(
                job_id=job_id,
                step="train",
                node="node-a",
                gpus=(0, 1),
                layout=self.lt.loop.settings.layout,
                now=self.clock.now(),
                reason="test",
            ),
        )
        self.clock.advance(2 * H)
        s.record_checkpoint(
            launch.attempt_id, label="step-100", progress=None, source="api", now=self.clock.now()
        )
        self.clock.advance(300)
        s.request_preemption(launch.attempt_id, grace_s=30, reason="GPUs reclaimed", now=self.clock.now())
        s.mark_stopping(
            launch.attempt_id, deadline=self.clock.now() + 30, reason="notice", now=self.clock.now()
        )
        self.clock.advance(10)
        ctx = s.exit_context(launch.attempt_id)
        assert ctx.step_state == StepState.PREEMPTING
        decision = classify_exit(
            step_state=ctx.step_state,
            noticed=True,
            exit_code=143,
            signal=None,
            killed_at_deadline=False,
            retries_used=0,
            max_retries=0,
            now=self.clock.now(),
            retry=RetryPolicy(),
        )
        s.finish_attempt(
            ctx,
            decision,
            ended_at=self.clock.now(),
            exit_code=143,
            signal=None,
            killed_at_deadline=False,
            half_life_s=H,
        )
        self.clock.set(NOW - 1 * H)
        running(
            s,
            s.begin_attempt(
                job_id=job_id,
                step="train",
                node="node-a",
                gpus=(0, 1),
                layout=self.lt.loop.settings.layout,
                now=self.clock.now(),
                reason="test",
            ),
        )
        return job_id

    def usage(self, **params: Any) -> Any:
        return self.client.get("/v1/reports/usage", params=params)


@pytest.fixture
def lt(tmp_path: Path) -> Iterator[Lt]:
    env = Lt(tmp_path)
    yield env
    env.client.close()
    env.lt.close()


def locs(response: Any) -> list[str]:
    return [e["loc"] for e in response.json()["errors"]]


RESEARCH_S = 2 * (2 * H + 310) + 2 * H  # the preempted attempt, then 1 h of the running one on 2 GPUs


def test_the_default_report_covers_the_last_24_hours(lt: Lt) -> None:
    r = lt.usage()
    assert r.status_code == 200, r.text
    d = r.json()
    assert (d["start"], d["end"], d["hours"], d["group_by"], d["timezone"]) == (
        NOW - 24 * H,
        NOW,
        24.0,
        "job",
        "UTC",
    )
    assert d["end_local"] == "2026-09-21T14:13:20+00:00"
    t = d["totals"]
    assert t["capacity_gpu_seconds"] == 6 * 24 * H and t["capacity_gpus"] == 6.0
    assert t["research_gpu_seconds"] == RESEARCH_S
    assert t["idle_gpu_seconds"] == 6 * 24 * H - RESEARCH_S and t["inference_gpu_seconds"] == 0.0
    assert (t["lost_gpu_seconds"], t["preemptions"]) == (620.0, 1)
    assert t["savings"] == pytest.approx(RESEARCH_S / H * 2.5)
    assert (d["currency"], d["price_per_gpu_hour"]) == ("EUR", 2.5)
    [row] = d["rows"]
    assert (row["job_id"], row["job_name"], row["team"], row["research_gpu_seconds"], row["preemptions"]) == (
        lt.job_id,
        "sft",
        "nlp",
        RESEARCH_S,
        1,
    )


def test_times_are_epoch_iso_or_durations_and_the_future_is_cut_at_now(lt: Lt) -> None:
    iso = datetime.fromtimestamp(NOW - 3 * H, ZoneInfo("UTC")).isoformat()
    berlin_wall = (
        datetime.fromtimestamp(NOW - 3 * H, ZoneInfo("Europe/Berlin")).replace(tzinfo=None).isoformat()
    )
    for params in (
        {"start": str(NOW - 3 * H)},
        {"start": iso},
        {"start": iso.replace("+00:00", "Z")},
        {"start": "3h"},
        {"start": "180m", "end": "0s"},
        {"start": berlin_wall, "tz": "Europe/Berlin"},  # no offset: local time in tz
        {"start": "3h", "end": str(NOW + 10 * H)},  # end after now: read as now
    ):
        d = lt.usage(**params).json()
        assert (d["start"], d["end"]) == (NOW - 3 * H, NOW), params
    d = lt.usage(start="1d", end="12h").json()
    assert (d["start"], d["end"]) == (NOW - 24 * H, NOW - 12 * H)
    d = lt.usage(end=str(NOW - 10 * H)).json()  # start defaults to 24 h before end
    assert (d["start"], d["end"]) == (NOW - 34 * H, NOW - 10 * H)


@pytest.mark.parametrize(
    ("params", "where", "words"),
    [
        ({"start": "yesterday"}, ["query.start"], "ISO-8601"),
        ({"start": "nan"}, ["query.start"], "1970"),
        ({"start": "-5"}, ["query.start"], "1970"),
        ({"start": "1e300"}, ["query.start"], "9999"),
        ({"end": "2026-13-01"}, ["query.end"], "ISO-8601"),
        ({"start": "1h", "end": "2h"}, ["query.end"], "not later than start"),
        ({"start": str(NOW + 60)}, ["query.start"], "not in the past"),
        ({"start": "400d"}, ["query.start"], "366 days"),
        ({"tz": "Mars/Olympus"}, ["query.tz"], "unknown time zone"),
        ({"tz": "../../etc/passwd"}, ["query.tz"], "unknown time zone"),
        ({"tz": "Mars/Olympus", "start": "soon"}, ["query.tz", "query.start"], "time zone"),
        ({"group_by": "week"}, ["query.group_by"], "'job'"),
        ({"start": "x" * 65}, ["query.start"], "at most 64"),
    ],
)
def test_bad_periods_groupings_and_zones_are_refused_with_located_errors(
    lt: Lt, params: dict[str, str], where: list[str], words: str
) -> None:
    r = lt.usage(**params)
    assert r.status_code == 422, r.text
    assert locs(r) == where
    assert words in json.dumps(r.json())


def test_reports_need_a_person_token(lt: Lt) -> None:
    assert lt.client.get("/v1/reports/usage", headers={"Authorization": ""}).status_code == 401


def test_a_job_shows_its_attempts_work_lost_and_whether_each_was_preempted(lt: Lt) -> None:
    attempts = lt.client.get(f"/v1/jobs/{lt.job_id}").json()["attempts"]
    assert [(a["number"], a["state"], a["lost_gpu_seconds"], a["preempted"]) for a in attempts] == [
        (1, "INTERRUPTED", 620.0, True),
        (2, "RUNNING", None, False),
    ]


def test_gpu_time_and_the_lost_work_line() -> None:
    assert [gpu_time(x) for x in (None, 0.0, 90.0, 7200.0)] == ["-", "0", "1.5 GPU-min", "2.00 GPU-h"]
    steps = [{"preemptions": 2}, {"preemptions": 0}]
    attempts = [
        {"lost_gpu_seconds": 1800.0, "preempted": True},
        {"lost_gpu_seconds": 5400.0, "preempted": True},
        {"lost_gpu_seconds": 36.0, "preempted": False},
        {"lost_gpu_seconds": None, "preempted": False},
    ]
    assert lost_work_line(steps, attempts) == (
        "preempted 2 times, 2.00 GPU-h of work lost; 0.01 GPU-h more lost to failures and cancellations"
    )
    assert lost_work_line([{"preemptions": 1}], []) == "preempted 1 time, 0.00 GPU-h of work lost"


# -- the CLI against the app served over real HTTP ------------------------------------------------


@pytest.fixture
def cli(lt: Lt) -> Iterator[Any]:
    served = Served(lt.lt.app)

    def run(*args: str) -> Any:
        return CliRunner().invoke(
            cli_app, ["--url", served.url, "--token", lt.token, *args], env={"COLUMNS": "200"}
        )

    yield run
    served.close()


def test_report_prints_a_table_and_the_totals(cli: Any, lt: Lt) -> None:
    result = cli("report", "--since", "24h")
    assert result.exit_code == 0, result.output
    out = result.output
    assert lt.job_id in out and "sft" in out and "nlp" in out
    assert "period 2026-09-20T14:13:20+00:00 → 2026-09-21T14:13:20+00:00 (24.0 h, UTC)" in out
    assert "capacity  144.00 GPU-h (6.00 GPUs): inference 0.00, research 6.17, idle 137.83" in out
    assert "lent      144.00 GPU-h (6.00 GPUs)" in out
    assert "used      6.17 GPU-h (0.26 GPUs) by research" in out
    assert "lost      0.17 GPU-h to 1 preemption(s)" in out
    assert "savings   15.43 EUR at 2.5 EUR per GPU-hour" in out


def test_report_json_team_and_day_views(cli: Any, lt: Lt) -> None:
    result = cli("report", "--since", "3h", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == lt.usage(start="3h").json()
    teams = cli("report", "--by", "team")
    assert teams.exit_code == 0 and "nlp" in teams.output and "SAVINGS EUR" in teams.output
    days = cli("report", "--since", "2d", "--by", "day", "--tz", "Europe/Berlin")
    assert days.exit_code == 0, days.output
    assert "2026-09-19" in days.output and "2026-09-21" in days.output and "Europe/Berlin" in days.output
    holders = cli("report", "--by", "holder")
    assert holders.exit_code == 0 and "attempt:1" in holders.output and "idle" in holders.output


def test_report_refusals_name_the_option_and_exit_2(cli: Any) -> None:
    result = cli("report", "--since", "yesterday", "--by", "week")
    assert result.exit_code == 2
    assert "--by: Input should be 'job', 'team', 'day' or 'holder'" in result.stderr
    result = cli("report", "--since", "yesterday")
    assert result.exit_code == 2 and "--since: expected epoch seconds" in result.stderr


def test_show_lists_work_lost_per_attempt_and_in_total(cli: Any, lt: Lt) -> None:
    result = cli("show", lt.job_id)
    assert result.exit_code == 0, result.output
    assert "WORK LOST" in result.output and "10.3 GPU-min" in result.output
    assert "preempted 1 time, 0.17 GPU-h of work lost" in result.output
