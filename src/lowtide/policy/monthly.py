"""The monthly usage report (pure): a month of research on lent GPUs against the month before.

Role: from two `policy.accounting.UsageReport`s grouped by team (the month and the previous month)
and the number of distinct jobs that ran in each, per team (`jobs_by_team` of a by-job report of
the same period), work out the figures the monthly summary quotes: jobs run, GPU-hours used by
research and lent, the change against the previous month, equivalent GPUs, savings, preemptions
and GPU-hours lost, in total and per team. Also the month arithmetic (`parse_month`,
`month_bounds` in a time zone). Neighbours: `api.reports.monthly_report` (reads the four usage
reports from the store, calls `monthly_report`), `cli.report_cmd` (prints it as a table, CSV or
HTML). Must not: read the clock, touch the store or do I/O.

Definitions (figures of `UsageReport`, see `policy.accounting`; hours = GPU-seconds ÷ 3600):

- a month is [local midnight of its first day, local midnight of the next month's first day) in
  the report's time zone; a month still in progress ends at the time of the request (`complete`
  False), so its figures and equivalent GPUs cover the part so far;
- jobs run = jobs whose step attempts held GPUs in the period (research GPU-seconds > 0);
- research GPU-hours = what step attempts held; lent GPU-hours = capacity − inference (pool-wide,
  the total only);
- change = research GPU-hours − the previous month's; change % = change ÷ the previous month's ×
  100, None when the previous month had none (nothing to compare with);
- equivalent GPUs = research GPU-seconds ÷ seconds in the period ("as if N GPUs were added");
- savings = research GPU-hours × price per GPU-hour; preemptions and GPU-hours lost as in the
  usage report (attempts that ended in the period, preempted).

Teams: one row per team that used GPUs in either month (a team only in the previous month shows
its drop to 0), largest research first, then by team name. The key of work with no team is "?".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date
from zoneinfo import ZoneInfo

from lowtide.policy.accounting import UsageReport, UsageRow, equivalent_gpus, local_midnight

_HOUR = 3600.0
_MONTH = re.compile(r"([0-9]{4})-([0-9]{2})")
#: Months a report may name (the ledger starts after 1970; `date` ends in 9999).
MIN_YEAR, MAX_YEAR = 1970, 9998
NO_TEAM = "?"


def parse_month(text: str) -> tuple[int, int]:
    """(year, month) of ``YYYY-MM``; ValueError with the reason for anything else."""
    m = _MONTH.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"expected a month as YYYY-MM (such as 2026-11); got {text!r}")
    year, month = int(m.group(1)), int(m.group(2))
    if not 1 <= month <= 12:
        raise ValueError(f"{text.strip()!r} is not a month: the month must be 01..12")
    if not MIN_YEAR <= year <= MAX_YEAR:
        raise ValueError(f"{text.strip()!r} is outside the years {MIN_YEAR}..{MAX_YEAR}")
    return year, month


def month_label(year: int, month: int) -> str:
    return f"{year:04d}-{month:02d}"


def previous_month(year: int, month: int) -> tuple[int, int]:
    return (year - 1, 12) if month == 1 else (year, month - 1)


def next_month(year: int, month: int) -> tuple[int, int]:
    return (year + 1, 1) if month == 12 else (year, month + 1)


def month_bounds(year: int, month: int, zone: ZoneInfo) -> tuple[float, float]:
    """[start, end) of a month in epoch seconds: local midnight of its first day to local
    midnight of the next month's first day in `zone`."""
    ny, nm = next_month(year, month)
    return local_midnight(date(year, month, 1), zone), local_midnight(date(ny, nm, 1), zone)


def jobs_by_team(by_job: UsageReport) -> dict[str, int]:
    """How many distinct jobs ran in the period of a by-job report, per team key ("?": none)."""
    if by_job.group_by != "job":
        raise ValueError(f"jobs are counted from a report grouped by job, not by {by_job.group_by}")
    out: dict[str, int] = {}
    for row in by_job.rows:
        if row.research_gpu_seconds > 0:
            key = row.team or NO_TEAM
            out[key] = out.get(key, 0) + 1
    return out


@dataclass(frozen=True, slots=True)
class MonthlyRow:
    """The month's figures for one team (`team` its name, None for no team) or for everyone
    (`key` "total")."""

    key: str
    team: str | None
    jobs_run: int
    previous_jobs_run: int
    research_gpu_hours: float
    previous_research_gpu_hours: float
    change_gpu_hours: float
    change_pct: float | None  # None: the previous month had no research to compare with
    equivalent_gpus: float
    savings: float
    preemptions: int
    lost_gpu_hours: float


@dataclass(frozen=True, slots=True)
class MonthlyReport:
    month: str  # YYYY-MM
    previous_month: str
    timezone: str
    start: float
    end: float  # the month's end, or the time of the request while the month is in progress
    complete: bool
    previous_start: float
    previous_end: float
    price_per_gpu_hour: float
    currency: str
    capacity_gpu_hours: float
    lent_gpu_hours: float  # capacity − inference: what inference did not hold
    lent_gpus: float
    total: MonthlyRow
    teams: tuple[MonthlyRow, ...]

    @property
    def hours(self) -> float:
        return (self.end - self.start) / _HOUR


def change_pct(current: float, previous: float) -> float | None:
    """(current − previous) ÷ previous × 100, or None when previous is not above 0."""
    return (current - previous) / previous * 100.0 if previous > 0 else None


def monthly_report(
    *,
    month: str,
    previous_month: str,
    current: UsageReport,
    previous: UsageReport,
    current_jobs: Mapping[str, int],
    previous_jobs: Mapping[str, int],
    complete: bool = True,
) -> MonthlyReport:
    """The monthly report from the month's and the previous month's usage by team, and the jobs
    that ran in each per team (`jobs_by_team`). Raises ValueError if a report is not by team."""
    for r in (current, previous):
        if r.group_by != "team":
            raise ValueError(f"a monthly report reads usage grouped by team, not by {r.group_by}")
    period = current.end - current.start
    price = current.price_per_gpu_hour
    now_rows = {r.key: r for r in current.rows}
    before_rows = {r.key: r for r in previous.rows}
    keys = set(now_rows) | set(before_rows) | set(current_jobs) | set(previous_jobs)
    teams = [
        _row(
            key,
            None if key == NO_TEAM else key,
            now_rows.get(key),
            before_rows.get(key),
            current_jobs.get(key, 0),
            previous_jobs.get(key, 0),
            period,
        )
        for key in keys
    ]
    teams.sort(key=lambda r: (-r.research_gpu_hours, -r.previous_research_gpu_hours, r.key))
    t, p = current.totals, previous.totals
    research, before = t.research_gpu_seconds / _HOUR, p.research_gpu_seconds / _HOUR
    total = MonthlyRow(
        key="total",
        team=None,
        jobs_run=sum(current_jobs.values()),
        previous_jobs_run=sum(previous_jobs.values()),
        research_gpu_hours=research,
        previous_research_gpu_hours=before,
        change_gpu_hours=research - before,
        change_pct=change_pct(research, before),
        equivalent_gpus=t.research_gpus,
        savings=t.savings,
        preemptions=t.preemptions,
        lost_gpu_hours=t.lost_gpu_seconds / _HOUR,
    )
    return MonthlyReport(
        month=month,
        previous_month=previous_month,
        timezone=current.timezone,
        start=current.start,
        end=current.end,
        complete=complete,
        previous_start=previous.start,
        previous_end=previous.end,
        price_per_gpu_hour=price,
        currency=current.currency,
        capacity_gpu_hours=t.capacity_gpu_seconds / _HOUR,
        lent_gpu_hours=t.lent_gpu_seconds / _HOUR,
        lent_gpus=t.lent_gpus,
        total=total,
        teams=tuple(teams),
    )


def _row(
    key: str,
    team: str | None,
    now: UsageRow | None,
    before: UsageRow | None,
    jobs: int,
    jobs_before: int,
    period: float,
) -> MonthlyRow:
    research_s = now.research_gpu_seconds if now else 0.0
    research, previous = research_s / _HOUR, (before.research_gpu_seconds / _HOUR if before else 0.0)
    return MonthlyRow(
        key=key,
        team=team,
        jobs_run=jobs,
        previous_jobs_run=jobs_before,
        research_gpu_hours=research,
        previous_research_gpu_hours=previous,
        change_gpu_hours=research - previous,
        change_pct=change_pct(research, previous),
        equivalent_gpus=equivalent_gpus(research_s, period),
        savings=now.savings if now else 0.0,
        preemptions=now.preemptions if now else 0,
        lost_gpu_hours=(now.lost_gpu_seconds if now else 0.0) / _HOUR,
    )
