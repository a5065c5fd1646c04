"""Usage reports over HTTP: `GET /v1/reports/usage` and `GET /v1/reports/monthly` — the period,
its reading and the JSON shapes.

`resolve_period` turns the query's `start`, `end` and `tz` into a period (epoch seconds, ISO-8601,
or a duration before now such as ``24h``/``7d``; defaults: the last 24 hours; a time without an
offset is local time in `tz`; an `end` after now is read as now: the ledger does not know the
future), refusing bad values with located 422s; `usage_out` shapes a `UsageReport`.
`monthly_report` reads a month and the month before it (`YYYY-MM`, local midnights in `tz`; a month
in progress ends now, a month not yet begun is refused) as four store usage reports, by team and
by job for each month, and hands them to `policy.monthly.monthly_report`; `monthly_out` shapes it.
Visibility (docs/architecture.md §11): a caller who does not see every team gets only the rows
of its teams (`visible_team`): job, team and attempt-holder rows of other teams are left out;
rows of no team (days, idle GPUs, replicas) are pool-wide figures and stay, and so do the
totals, which describe the whole pool (capacity, lent, used) and name no job or team.
The routes themselves are in `app.create_app` (they need the app's auth dependency), one call
into here each.

Simulator reports (`GET /v1/reports/simulations[/{name}]`, routed by `api.dashboard`): what
`lowtide simulate --out DIR` wrote (`cli.simulate_cmd`: `DIR/summary.json`, one policy's summary,
or `DIR/compare.json`, `{"policies": [...], "runs": {policy: summary}}`), found in the configured
directory (`api.simulation_reports_dir`) as `<dir>/<name>/summary.json`, `<dir>/<name>/compare.json`
or `<dir>/<name>.json`. `simulation_reports` lists them (newest first; an unreadable one is listed
with its error), `simulation_report` reads one by name: a name is one path segment of
`SIM_NAME_PATTERN` (no `/`, no `..`, no leading dot) and must resolve inside the directory, else
404 naming `path.name`. Only files up to `MAX_SIM_REPORT_BYTES` are read.
Neighbours: `store.reports_repo` (the figures), `policy.accounting` and
`policy.monthly` (their definitions), `cli.report_cmd` (prints these). Must not: compute figures
(policy does) or write anything.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from pydantic import BaseModel, Field

from lowtide.api.errors import ApiError
from lowtide.policy.accounting import (
    AccountingPolicy,
    GroupBy,
    UsageReport,
    UsageRow,
    time_zone,
)
from lowtide.policy.monthly import (
    MonthlyReport,
    MonthlyRow,
    jobs_by_team,
    month_bounds,
    month_label,
    parse_month,
    previous_month,
)
from lowtide.policy.monthly import monthly_report as build_monthly
from lowtide.store.repo import Store

DEFAULT_PERIOD_S = 86400.0
#: Longest period one report covers (a leap year); longer ones are refused (422).
MAX_PERIOD_S = 366 * 86400.0
#: Times must lie in 1970-01-01 .. 9999-12-31 (what dates can show).
MAX_TIME = 253402300799.0
_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
TIME_HELP = "epoch seconds, ISO-8601 (no offset: local time in tz) or a duration before now (24h, 7d)"
#: The highest price per GPU-hour a monthly report takes (any real price is far below; the cap
#: keeps savings finite, which JSON needs).
MAX_PRICE = 1e12
CURRENCY_PATTERN = "^[A-Z]{3}$"

#: Whether the caller sees a team's rows (None: a row of no team, always shown).
TeamFilter = Callable[[str | None], bool]


def _every_team(team: str | None) -> bool:
    return True


class UsageRowOut(BaseModel):
    key: str = Field(
        description="job id, team, local date (YYYY-MM-DD), or 'idle' / 'attempt:ID' / 'replica:ID'"
    )
    job_id: str | None
    job_name: str | None
    team: str | None
    day: str | None
    holder_kind: str | None
    holder_id: str | None
    period_seconds: float = Field(description="seconds of the period this row covers (a day row: its day)")
    idle_gpu_seconds: float
    research_gpu_seconds: float
    inference_gpu_seconds: float
    capacity_gpu_seconds: float
    lost_gpu_seconds: float = Field(description="work lost to preemption (since the last checkpoint)")
    preemptions: int
    equivalent_gpus: float = Field(description="research GPU-seconds ÷ period_seconds")
    savings: float = Field(description="research GPU-hours × price per GPU-hour")


class UsageTotalsOut(BaseModel):
    capacity_gpu_seconds: float = Field(description="every ledger GPU-second: idle + research + inference")
    idle_gpu_seconds: float
    research_gpu_seconds: float = Field(description="used: held by step attempts")
    inference_gpu_seconds: float
    lent_gpu_seconds: float = Field(description="capacity − inference: what inference did not hold")
    lost_gpu_seconds: float
    preemptions: int
    capacity_gpus: float = Field(description="equivalent GPUs: GPU-seconds ÷ seconds in the period")
    lent_gpus: float
    research_gpus: float
    inference_gpus: float
    savings: float


class UsageReportOut(BaseModel):
    start: float
    end: float
    start_local: str = Field(description="start, ISO-8601 in `timezone`")
    end_local: str
    hours: float
    timezone: str
    group_by: str
    price_per_gpu_hour: float
    currency: str
    totals: UsageTotalsOut
    rows: list[UsageRowOut]


def parse_time(text: str, *, now: float, zone: ZoneInfo) -> float:
    """Epoch seconds from epoch seconds, ISO-8601 (naive: local in `zone`) or a duration before
    `now` (``90m``, ``24h``, ``7d``, ``2w``). Raises ValueError with the reason."""
    if m := _RELATIVE.match(text):
        value = now - float(m.group(1)) * _UNIT_S[m.group(2)]
    else:
        try:
            value = float(text)
        except ValueError:
            try:
                when = datetime.fromisoformat(text.strip())
            except ValueError:
                raise ValueError(f"expected {TIME_HELP}; got {text!r}") from None
            if when.tzinfo is None:
                when = when.replace(tzinfo=zone)
            value = when.timestamp()
    if not (math.isfinite(value) and 0 <= value <= MAX_TIME):
        raise ValueError("outside 1970-01-01 .. 9999-12-31")
    return value


def resolve_period(
    start: str | None, end: str | None, tz: str | None, *, now: float, policy: AccountingPolicy
) -> tuple[float, float, str]:
    """(start, end, time zone) of a report request; ApiError 422 naming every bad field."""
    issues: list[tuple[str, str]] = []
    zone_name = policy.timezone if tz is None else tz
    try:
        zone = time_zone(zone_name)
    except ValueError as exc:
        issues.append(("query.tz", str(exc)))
        zone = ZoneInfo("UTC")
    t_end = now
    if end is not None:
        try:
            t_end = min(parse_time(end, now=now, zone=zone), now)
        except ValueError as exc:
            issues.append(("query.end", str(exc)))
    t_start = t_end - DEFAULT_PERIOD_S
    if start is not None:
        try:
            t_start = parse_time(start, now=now, zone=zone)
        except ValueError as exc:
            issues.append(("query.start", str(exc)))
    if not issues:
        if start is not None and t_start >= now:
            issues.append(("query.start", f"{start!r} is not in the past"))
        elif t_end <= t_start:
            issues.append(("query.end", f"{end!r} is not later than start {_iso(t_start, zone)}"))
        elif t_end - t_start > MAX_PERIOD_S:
            issues.append(("query.start", "the period is longer than 366 days"))
    if issues:
        raise ApiError(422, "invalid_request", "the report period is not valid", issues)
    return t_start, t_end, zone_name


def usage_report(
    store: Store,
    policy: AccountingPolicy,
    *,
    now: float,
    start: str | None,
    end: str | None,
    group_by: GroupBy,
    tz: str | None,
    visible_team: TeamFilter = _every_team,
) -> UsageReportOut:
    """The body of `GET /v1/reports/usage`: rows of teams `visible_team` refuses are left out."""
    t_start, t_end, zone_name = resolve_period(start, end, tz, now=now, policy=policy)
    report = store.usage_report(
        t_start,
        t_end,
        group_by=group_by,
        tz=zone_name,
        price_per_gpu_hour=policy.price_per_gpu_hour,
        currency=policy.currency,
    )
    rows = tuple(r for r in report.rows if r.team is None or visible_team(r.team))
    return usage_out(replace(report, rows=rows) if len(rows) != len(report.rows) else report)


def usage_out(r: UsageReport) -> UsageReportOut:
    zone = time_zone(r.timezone)
    t = r.totals
    return UsageReportOut(
        start=r.start,
        end=r.end,
        start_local=_iso(r.start, zone),
        end_local=_iso(r.end, zone),
        hours=r.hours,
        timezone=r.timezone,
        group_by=r.group_by,
        price_per_gpu_hour=r.price_per_gpu_hour,
        currency=r.currency,
        totals=UsageTotalsOut(
            capacity_gpu_seconds=t.capacity_gpu_seconds,
            idle_gpu_seconds=t.idle_gpu_seconds,
            research_gpu_seconds=t.research_gpu_seconds,
            inference_gpu_seconds=t.inference_gpu_seconds,
            lent_gpu_seconds=t.lent_gpu_seconds,
            lost_gpu_seconds=t.lost_gpu_seconds,
            preemptions=t.preemptions,
            capacity_gpus=t.capacity_gpus,
            lent_gpus=t.lent_gpus,
            research_gpus=t.research_gpus,
            inference_gpus=t.inference_gpus,
            savings=t.savings,
        ),
        rows=[_row_out(row) for row in r.rows],
    )


def _row_out(row: UsageRow) -> UsageRowOut:
    return UsageRowOut(
        key=row.key,
        job_id=row.job_id,
        job_name=row.job_name,
        team=row.team,
        day=row.day,
        holder_kind=row.holder_kind,
        holder_id=row.holder_id,
        period_seconds=row.period_seconds,
        idle_gpu_seconds=row.idle_gpu_seconds,
        research_gpu_seconds=row.research_gpu_seconds,
        inference_gpu_seconds=row.inference_gpu_seconds,
        capacity_gpu_seconds=row.capacity_gpu_seconds,
        lost_gpu_seconds=row.lost_gpu_seconds,
        preemptions=row.preemptions,
        equivalent_gpus=row.equivalent_gpus,
        savings=row.savings,
    )


def _iso(ts: float, zone: ZoneInfo) -> str:
    return datetime.fromtimestamp(ts, UTC).astimezone(zone).isoformat(timespec="seconds")


# -- the monthly report -------------------------------------------------------------------------


class MonthlyRowOut(BaseModel):
    key: str = Field(description="the team, '?' for work of no team, or 'total'")
    team: str | None
    jobs_run: int = Field(description="distinct jobs whose steps held GPUs in the month")
    previous_jobs_run: int
    research_gpu_hours: float = Field(description="GPU-hours held by step attempts in the month")
    previous_research_gpu_hours: float
    change_gpu_hours: float = Field(description="research GPU-hours − the previous month's")
    change_pct: float | None = Field(
        description="change ÷ the previous month's research GPU-hours × 100; null when that was 0"
    )
    equivalent_gpus: float = Field(description="research GPU-seconds ÷ seconds in the month")
    savings: float = Field(description="research GPU-hours × price per GPU-hour")
    preemptions: int
    lost_gpu_hours: float = Field(description="work lost to preemption (since the last checkpoint)")


class MonthlyReportOut(BaseModel):
    month: str = Field(description="YYYY-MM")
    previous_month: str
    timezone: str = Field(description="the IANA zone whose local midnights bound the months")
    start: float
    end: float = Field(description="the month's end, or now while the month is in progress")
    start_local: str
    end_local: str
    hours: float
    complete: bool = Field(description="false while the month is in progress (figures so far)")
    previous_start: float
    previous_end: float
    price_per_gpu_hour: float
    currency: str
    capacity_gpu_hours: float = Field(description="every ledger GPU-hour of the month")
    lent_gpu_hours: float = Field(description="capacity − inference: what inference did not hold")
    lent_gpus: float
    total: MonthlyRowOut
    teams: list[MonthlyRowOut]


def resolve_month(
    month: str, tz: str | None, *, now: float, policy: AccountingPolicy
) -> tuple[tuple[int, int], tuple[float, float], str]:
    """((year, month), (start, end) with the end cut at now, time zone) of a monthly request;
    ApiError 422 naming every bad field."""
    issues: list[tuple[str, str]] = []
    zone_name = policy.timezone if tz is None else tz
    zone: ZoneInfo | None = None
    try:
        zone = time_zone(zone_name)
    except ValueError as exc:
        issues.append(("query.tz", str(exc)))
    ym: tuple[int, int] | None = None
    try:
        ym = parse_month(month)
    except ValueError as exc:
        issues.append(("query.month", str(exc)))
    bounds: tuple[float, float] | None = None
    if zone is not None and ym is not None:
        bounds = month_bounds(*ym, zone)
        if bounds[0] >= now:
            issues.append(("query.month", f"{month_label(*ym)} has not begun yet in {zone_name}"))
    if issues:
        raise ApiError(422, "invalid_request", "the monthly report request is not valid", issues)
    assert ym is not None and bounds is not None
    return ym, (bounds[0], min(bounds[1], now)), zone_name


def monthly_report(
    store: Store,
    policy: AccountingPolicy,
    *,
    now: float,
    month: str,
    tz: str | None,
    price: float | None,
    currency: str | None,
    visible_team: TeamFilter = _every_team,
) -> MonthlyReportOut:
    """The body of `GET /v1/reports/monthly` (price and currency already checked by the route;
    defaults: the configured ones)."""
    (year, mon), (start, end), zone_name = resolve_month(month, tz, now=now, policy=policy)
    zone = time_zone(zone_name)
    prev = previous_month(year, mon)
    prev_start, prev_end = month_bounds(*prev, zone)
    month_end = month_bounds(year, mon, zone)[1]
    price_h = policy.price_per_gpu_hour if price is None else price
    cur = policy.currency if currency is None else currency

    def usage(a: float, b: float, group_by: GroupBy) -> UsageReport:
        return store.usage_report(
            a, b, group_by=group_by, tz=zone_name, price_per_gpu_hour=price_h, currency=cur
        )

    report = build_monthly(
        month=month_label(year, mon),
        previous_month=month_label(*prev),
        current=usage(start, end, "team"),
        previous=usage(prev_start, prev_end, "team"),
        current_jobs=jobs_by_team(usage(start, end, "job")),
        previous_jobs=jobs_by_team(usage(prev_start, prev_end, "job")),
        complete=month_end <= now,
    )
    teams = tuple(t for t in report.teams if t.team is None or visible_team(t.team))
    return monthly_out(replace(report, teams=teams) if len(teams) != len(report.teams) else report)


def monthly_out(r: MonthlyReport) -> MonthlyReportOut:
    zone = time_zone(r.timezone)
    return MonthlyReportOut(
        month=r.month,
        previous_month=r.previous_month,
        timezone=r.timezone,
        start=r.start,
        end=r.end,
        start_local=_iso(r.start, zone),
        end_local=_iso(r.end, zone),
        hours=r.hours,
        complete=r.complete,
        previous_start=r.previous_start,
        previous_end=r.previous_end,
        price_per_gpu_hour=r.price_per_gpu_hour,
        currency=r.currency,
        capacity_gpu_hours=r.capacity_gpu_hours,
        lent_gpu_hours=r.lent_gpu_hours,
        lent_gpus=r.lent_gpus,
        total=_monthly_row_out(r.total),
        teams=[_monthly_row_out(t) for t in r.teams],
    )


def _monthly_row_out(row: MonthlyRow) -> MonthlyRowOut:
    return MonthlyRowOut(
        key=row.key,
        team=row.team,
        jobs_run=row.jobs_run,
        previous_jobs_run=row.previous_jobs_run,
        research_gpu_hours=row.research_gpu_hours,
        previous_research_gpu_hours=row.previous_research_gpu_hours,
        change_gpu_hours=row.change_gpu_hours,
        change_pct=row.change_pct,
        equivalent_gpus=row.equivalent_gpus,
        savings=row.savings,
        preemptions=row.preemptions,
        lost_gpu_hours=row.lost_gpu_hours,
    )


# -- simulator reports ----------------------------------------------------------------------------

#: A report's name: one path segment (a directory or file stem in the reports directory).
SIM_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
#: Larger files are not read (a summary is a few kB).
MAX_SIM_REPORT_BYTES = 2 * 1024 * 1024
#: At most this many reports are listed.
MAX_SIM_REPORTS = 200
_SIM_FILES = ("summary.json", "compare.json")
#: The figures the list shows of each run (the detail gives the whole summary).
SIM_FIGURES = (
    "days",
    "gpus",
    "jobs_submitted",
    "jobs_succeeded",
    "gpu_hours_harvested",
    "harvest_efficiency",
    "preemptions",
    "gpu_hours_lost_to_preemption",
    "slo_violation_minutes",
    "reclaims",
    "reclaim_latency_p50_s",
    "reclaim_latency_p99_s",
    "savings",
)


class SimulationRunOut(BaseModel):
    policy: str
    figures: dict[str, float | None] = Field(
        description=f"of the summary: {', '.join(SIM_FIGURES)} (None: not in the report)"
    )
    currency: str | None = None


class SimulationReportOut(BaseModel):
    name: str
    file: str = Field(description="the report's file, relative to the reports directory")
    modified_at: float
    runs: list[SimulationRunOut] = Field(default_factory=list)
    error: str | None = Field(default=None, description="why the report could not be read, if it could not")


class SimulationListOut(BaseModel):
    reports: list[SimulationReportOut]


class SimulationDetailOut(BaseModel):
    name: str
    file: str
    modified_at: float
    policies: list[str]
    runs: dict[str, dict[str, Any]] = Field(
        description="each policy's whole summary, as the simulator wrote it"
    )


def _not_found(name: str, why: str) -> ApiError:
    return ApiError(404, "not_found", f"simulation report '{name}' not found", [("path.name", why)])


def _report_file(root: Path, name: str) -> Path | None:
    """The file of report `name` under `root`, or None. `name` must already be valid."""
    base = root.resolve()
    for candidate in (*(root / name / f for f in _SIM_FILES), root / f"{name}.json"):
        try:
            resolved = candidate.resolve()
        except OSError:
            continue
        if resolved.is_file() and resolved.is_relative_to(base):
            return resolved
    return None


def _read_runs(path: Path) -> dict[str, dict[str, Any]]:
    """{policy: summary} of a summary.json or compare.json; ValueError when it is neither."""
    if path.stat().st_size > MAX_SIM_REPORT_BYTES:
        raise ValueError(f"larger than {MAX_SIM_REPORT_BYTES} bytes")
    doc = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(doc, dict) and isinstance(doc.get("runs"), dict):
        runs = doc["runs"]
        if all(isinstance(k, str) and isinstance(v, dict) for k, v in runs.items()):
            return dict(runs)
    elif isinstance(doc, dict) and isinstance(doc.get("policy"), str):
        return {doc["policy"]: doc}
    raise ValueError("not a simulator summary (no 'policy') nor a comparison (no 'runs')")


def _number(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _run_out(policy: str, summary: dict[str, Any]) -> SimulationRunOut:
    currency = summary.get("currency")
    return SimulationRunOut(
        policy=policy,
        figures={k: _number(summary.get(k)) for k in SIM_FIGURES},
        currency=currency if isinstance(currency, str) else None,
    )


def simulation_reports(root: Path) -> SimulationListOut:
    """Every report in `root` (none when it does not exist), newest first."""
    if not root.is_dir():
        return SimulationListOut(reports=[])
    found: list[SimulationReportOut] = []
    for entry in root.iterdir():
        name = entry.name[:-5] if entry.is_file() and entry.name.endswith(".json") else entry.name
        if not re.fullmatch(SIM_NAME_PATTERN, name):
            continue
        path = _report_file(root, name)
        if path is None:
            continue
        rel = str(path.relative_to(root.resolve()))
        modified = path.stat().st_mtime
        try:
            runs = [_run_out(p, s) for p, s in _read_runs(path).items()]
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            found.append(SimulationReportOut(name=name, file=rel, modified_at=modified, error=str(exc)[:200]))
            continue
        found.append(SimulationReportOut(name=name, file=rel, modified_at=modified, runs=runs))
    found.sort(key=lambda r: (-r.modified_at, r.name))
    return SimulationListOut(reports=found[:MAX_SIM_REPORTS])


def simulation_report(root: Path, name: str) -> SimulationDetailOut:
    """Report `name` in `root`, whole; 404 naming `path.name` when the name is not a report's."""
    if not re.fullmatch(SIM_NAME_PATTERN, name) or ".." in name:
        raise _not_found(name[:100], "a report name is one path segment: letters, digits, '.', '_', '-'")
    path = _report_file(root, name) if root.is_dir() else None
    if path is None:
        raise _not_found(
            name, f"no {name}/summary.json, {name}/compare.json or {name}.json in the reports directory"
        )
    try:
        runs = _read_runs(path)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ApiError(
            422,
            "invalid_report",
            f"simulation report '{name}' cannot be read",
            [("path.name", str(exc)[:200])],
        ) from exc
    return SimulationDetailOut(
        name=name,
        file=str(path.relative_to(root.resolve())),
        modified_at=path.stat().st_mtime,
        policies=list(runs),
        runs=runs,
    )
