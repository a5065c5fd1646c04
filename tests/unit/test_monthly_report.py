"""policy.monthly: month arithmetic in a time zone, jobs counted from a by-job report, and the
monthly report of a hand-built two-month ledger, figure by figure.

The ledger (2 GPUs, UTC, 2.5 EUR per GPU-hour); times are whole or half hours, so every figure
is an exact float:

    GPU 0: idle; job A (nlp) Sep 10 00:00–10:00; idle; job B (nlp) Oct 3 00:00–12:00; idle;
           job C (vision) Oct 31 22:00 – Nov 1 02:00 (2 h in October); idle, still open.
    GPU 1: idle; job D (speech) Sep 15 00:00–10:00; idle; job C (vision) Oct 20 10:00–12:30,
           preempted, 0.5 h of work lost; idle; replica r1 Oct 25 00:00 – Oct 26 00:00; idle.

September: nlp 10 GPU-h (A), speech 10 (D): 20 GPU-h, 2 jobs.
October (744 h): nlp 12 (B), vision 2.5 + 2 = 4.5 (C): 16.5 GPU-h, 2 jobs; 24 h of inference;
capacity 2 × 744 = 1488, lent 1488 − 24 = 1464; change −3.5 GPU-h = −17.5 %.
"""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from lowtide.domain.states import AttemptState
from lowtide.policy.accounting import (
    AccountingPolicy,
    EndedAttempt,
    GroupBy,
    LedgerInterval,
    UsageReport,
    usage_report,
)
from lowtide.policy.monthly import (
    MonthlyReport,
    change_pct,
    jobs_by_team,
    month_bounds,
    month_label,
    monthly_report,
    next_month,
    parse_month,
    previous_month,
)

H = 3600.0
UTC_ZONE = ZoneInfo("UTC")
BERLIN = ZoneInfo("Europe/Berlin")


def t(mo: int, d: int, h: float = 0.0) -> float:
    return datetime(2026, mo, d, tzinfo=UTC).timestamp() + h * H


def att(holder: str, job: str, team: str, start: float, end: float | None) -> LedgerInterval:
    return LedgerInterval("attempt", holder, job, f"name-{job}", team, start, end)


def idle(start: float, end: float | None) -> LedgerInterval:
    return LedgerInterval("idle", None, None, None, None, start, end)


LEDGER = [
    # GPU 0
    idle(t(9, 1), t(9, 10)),
    att("1", "A", "nlp", t(9, 10), t(9, 10, 10)),
    idle(t(9, 10, 10), t(10, 3)),
    att("2", "B", "nlp", t(10, 3), t(10, 3, 12)),
    idle(t(10, 3, 12), t(10, 31, 22)),
    att("5", "C", "vision", t(10, 31, 22), t(11, 1, 2)),
    idle(t(11, 1, 2), None),
    # GPU 1
    idle(t(9, 1), t(9, 15)),
    att("3", "D", "speech", t(9, 15), t(9, 15, 10)),
    idle(t(9, 15, 10), t(10, 20, 10)),
    att("4", "C", "vision", t(10, 20, 10), t(10, 20, 12.5)),
    idle(t(10, 20, 12.5), t(10, 25)),
    LedgerInterval("replica", "chat/0", None, None, None, t(10, 25), t(10, 26)),
    idle(t(10, 26), None),
]
ENDED = [
    EndedAttempt(4, "C", "name-C", "vision", AttemptState.INTERRUPTED, True, t(10, 20, 12.5), 0.5 * H),
]
POLICY = AccountingPolicy(price_per_gpu_hour=2.5, currency="EUR", timezone="UTC")


def usage(start: float, end: float, group_by: GroupBy, policy: AccountingPolicy = POLICY) -> UsageReport:
    return usage_report(LEDGER, ENDED, start=start, end=end, group_by=group_by, policy=policy)


def october(policy: AccountingPolicy = POLICY, zone: ZoneInfo = UTC_ZONE) -> MonthlyReport:
    start, end = month_bounds(2026, 10, zone)
    p_start, p_end = month_bounds(2026, 9, zone)
    return monthly_report(
        month="2026-10",
        previous_month="2026-09",
        current=usage(start, end, "team", policy),
        previous=usage(p_start, p_end, "team", policy),
        current_jobs=jobs_by_team(usage(start, end, "job", policy)),
        previous_jobs=jobs_by_team(usage(p_start, p_end, "job", policy)),
    )


def test_the_month_and_each_team_against_the_month_before() -> None:
    r = october()
    assert (r.month, r.previous_month, r.timezone, r.currency, r.price_per_gpu_hour) == (
        "2026-10",
        "2026-09",
        "UTC",
        "EUR",
        2.5,
    )
    assert (r.start, r.end, r.hours, r.complete) == (t(10, 1), t(11, 1), 744.0, True)
    assert (r.previous_start, r.previous_end) == (t(9, 1), t(10, 1))
    assert (r.capacity_gpu_hours, r.lent_gpu_hours, r.lent_gpus) == (1488.0, 1464.0, 1464.0 / 744)
    total = r.total
    assert (total.key, total.team, total.jobs_run, total.previous_jobs_run) == ("total", None, 2, 2)
    assert (total.research_gpu_hours, total.previous_research_gpu_hours, total.change_gpu_hours) == (
        16.5,
        20.0,
        -3.5,
    )
    assert total.change_pct == pytest.approx(-17.5)
    assert total.equivalent_gpus == 16.5 / 744
    assert (total.savings, total.preemptions, total.lost_gpu_hours) == (41.25, 1, 0.5)

    rows = {row.key: row for row in r.teams}
    assert [row.key for row in r.teams] == ["nlp", "vision", "speech"]
    nlp, vision, speech = rows["nlp"], rows["vision"], rows["speech"]
    assert (nlp.team, nlp.jobs_run, nlp.previous_jobs_run, nlp.research_gpu_hours) == ("nlp", 1, 1, 12.0)
    assert (nlp.previous_research_gpu_hours, nlp.change_gpu_hours) == (10.0, 2.0)
    assert nlp.change_pct == pytest.approx(20.0)
    assert (nlp.equivalent_gpus, nlp.savings, nlp.preemptions, nlp.lost_gpu_hours) == (12 / 744, 30.0, 0, 0.0)
    assert (vision.jobs_run, vision.previous_jobs_run, vision.research_gpu_hours) == (1, 0, 4.5)
    assert (vision.previous_research_gpu_hours, vision.change_gpu_hours, vision.change_pct) == (
        0.0,
        4.5,
        None,
    )
    assert (vision.savings, vision.preemptions, vision.lost_gpu_hours) == (11.25, 1, 0.5)
    # A team that ran only the month before shows its drop to zero.
    assert (speech.jobs_run, speech.previous_jobs_run, speech.research_gpu_hours) == (0, 1, 0.0)
    assert (speech.change_gpu_hours, speech.change_pct, speech.savings) == (-10.0, -100.0, 0.0)
    # The teams add up to the total.
    assert sum(row.research_gpu_hours for row in r.teams) == total.research_gpu_hours
    assert sum(row.savings for row in r.teams) == total.savings


def test_months_end_at_local_midnight_in_the_time_zone() -> None:
    berlin = AccountingPolicy(price_per_gpu_hour=2.5, currency="EUR", timezone="Europe/Berlin")
    r = october(berlin, BERLIN)
    # October in Berlin: Sep 30 22:00 UTC (CEST) to Oct 31 23:00 UTC (CET): 745 hours.
    assert (r.start, r.end, r.hours) == (t(9, 30, 22), t(10, 31, 23), 745.0)
    # Job C's last attempt has 1 h (not 2) of Berlin's October.
    assert r.total.research_gpu_hours == 12 + 2.5 + 1
    assert r.total.equivalent_gpus == 15.5 / 745


def test_nothing_the_month_before_means_no_percentage() -> None:
    start, end = month_bounds(2026, 9, UTC_ZONE)
    p_start, p_end = month_bounds(2026, 8, UTC_ZONE)
    r = monthly_report(
        month="2026-09",
        previous_month="2026-08",
        current=usage(start, end, "team"),
        previous=usage(p_start, p_end, "team"),
        current_jobs=jobs_by_team(usage(start, end, "job")),
        previous_jobs=jobs_by_team(usage(p_start, p_end, "job")),
        complete=False,
    )
    assert (r.total.research_gpu_hours, r.total.change_gpu_hours, r.total.change_pct) == (20.0, 20.0, None)
    assert (r.total.jobs_run, r.total.previous_jobs_run, r.complete) == (2, 0, False)
    assert r.lent_gpu_hours == 2 * 720.0 and r.capacity_gpu_hours == 2 * 720.0


def test_jobs_are_those_whose_attempts_held_gpus() -> None:
    # Only C's preempted attempt ends in [Oct 20 12:30, Oct 21): it has a row but no research.
    by_job = usage_report(LEDGER, ENDED, start=t(10, 20, 12.5), end=t(10, 21), group_by="job", policy=POLICY)
    assert [(r.key, r.research_gpu_seconds, r.preemptions) for r in by_job.rows] == [("C", 0.0, 1)]
    assert jobs_by_team(by_job) == {}
    assert jobs_by_team(usage(t(9, 1), t(11, 1), "job")) == {"nlp": 2, "speech": 1, "vision": 1}
    no_team = usage_report(
        [LedgerInterval("attempt", "9", "X", None, None, 0.0, H)],
        [],
        start=0.0,
        end=H,
        group_by="job",
        policy=POLICY,
    )
    assert jobs_by_team(no_team) == {"?": 1}
    with pytest.raises(ValueError, match="grouped by job"):
        jobs_by_team(usage(t(9, 1), t(10, 1), "team"))
    with pytest.raises(ValueError, match="grouped by team"):
        monthly_report(
            month="2026-10",
            previous_month="2026-09",
            current=usage(t(10, 1), t(11, 1), "job"),
            previous=usage(t(9, 1), t(10, 1), "team"),
            current_jobs={},
            previous_jobs={},
        )


def test_work_of_no_team_has_its_own_row() -> None:
    ledger = [LedgerInterval("attempt", "9", "X", None, None, t(10, 2), t(10, 2, 3))]
    cur = usage_report(ledger, [], start=t(10, 1), end=t(11, 1), group_by="team", policy=POLICY)
    prev = usage_report(ledger, [], start=t(9, 1), end=t(10, 1), group_by="team", policy=POLICY)
    r = monthly_report(
        month="2026-10",
        previous_month="2026-09",
        current=cur,
        previous=prev,
        current_jobs={"?": 1},
        previous_jobs={},
    )
    [row] = r.teams
    assert (row.key, row.team, row.jobs_run, row.research_gpu_hours, row.change_pct) == (
        "?",
        None,
        1,
        3.0,
        None,
    )


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("2026-13", "01..12"),
        ("2026-00", "01..12"),
        ("2026-1", "YYYY-MM"),
        ("26-01", "YYYY-MM"),
        ("2026-01-01", "YYYY-MM"),
        ("november", "YYYY-MM"),
        ("", "YYYY-MM"),
        ("２０２６-１１", "YYYY-MM"),  # other digits than 0-9
        ("1969-12", "1970..9998"),
        ("9999-01", "1970..9998"),
    ],
)
def test_bad_months_are_refused_with_the_reason(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        parse_month(text)


def test_month_arithmetic() -> None:
    assert parse_month("2026-11") == (2026, 11) and parse_month(" 1970-01 ") == (1970, 1)
    assert month_label(2026, 1) == "2026-01"
    assert previous_month(2026, 1) == (2025, 12) and previous_month(2026, 11) == (2026, 10)
    assert next_month(2026, 12) == (2027, 1) and next_month(2026, 2) == (2026, 3)
    assert month_bounds(2026, 2, UTC_ZONE) == (t(2, 1), t(3, 1))
    # March in Berlin loses an hour (DST starts Mar 29, 2026).
    start, end = month_bounds(2026, 3, BERLIN)
    assert (end - start) / H == 31 * 24 - 1
    assert change_pct(3.0, 2.0) == 50.0 and change_pct(1.0, 0.0) is None and change_pct(0.0, 0.0) is None
