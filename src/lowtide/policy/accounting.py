"""Usage accounting over the GPU ledger (pure arithmetic): who held the GPUs in a period, and
what that was worth.

Role: the store reads the ledger intervals that meet a period and the attempts that ended in it;
`usage_report` clips the intervals to the period, sums GPU-seconds per holder kind (idle,
research = step attempts, inference = replicas) and per group (job, team, local day in a time
zone, or single holder), and derives GPU-seconds lost to preemption, equivalent GPUs and savings.
Neighbours: `store.reports_repo` (reads the rows, calls `usage_report`), `api.reports` (the
HTTP shape), `cli.report_cmd` (the table). Must not: read the clock, touch the store or do I/O.

Definitions (all GPU quantities in GPU-seconds; the period is [start, end)):

- An interval [s, e) (e = `end` while still open) counts for |[max(s, start), min(e, end))|.
  Its holder kind is idle, attempt or replica (`store.ledger`); any other would count as idle.
- capacity = idle + research + inference: every ledger GPU-second in the period. It equals
  GPUs × period length only where the ledger covers the whole period (GPUs managed throughout).
- lent = capacity − inference (idle or research: what inference did not hold); used = research.
- lost to preemption: `lost_gpu_seconds` of the attempts that *ended* in the period and were
  preempted (their `preempted` flag), counted whole at their end (not clipped), on the day they
  ended.
- equivalent GPUs = GPU-seconds ÷ seconds in the period (for a day row: ÷ the seconds of that
  local day inside the period, so a 23-hour DST day divides by 23 h).
- savings = research GPU-hours × price per GPU-hour.

Telling preemption from cancellation: both end an attempt INTERRUPTED (or LOST). The store
records the exit decision's `preempted` on the attempt (`policy.outcomes`; the same decisions add
one to the step's `preemptions`), and that flag is what counts. (The attempt's `stop_reason`,
"GPUs reclaimed" vs "job cancelled", is not used: a step preempted and then cancelled during its
grace keeps "GPUs reclaimed" yet ends cancelled, and a step lost before its notice has none.)

Local days: [midnight, next midnight) in the zone, via `zoneinfo` (a midnight inside a skipped
hour moves to after the jump, an ambiguous one is its first occurrence).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from lowtide.domain.states import AttemptState

GroupBy = Literal["job", "team", "day", "holder"]
GROUP_BY: tuple[GroupBy, ...] = ("job", "team", "day", "holder")

#: Ledger holder kinds (`store.ledger`) and what reports call them.
IDLE, ATTEMPT, REPLICA = "idle", "attempt", "replica"
KIND_NAMES = {IDLE: "idle", ATTEMPT: "research", REPLICA: "inference"}

_HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class AccountingPolicy:
    """What a GPU-hour is worth and where reports' days begin (configured: `accounting:`)."""

    price_per_gpu_hour: float = 0.0
    currency: str = "USD"
    timezone: str = "UTC"


@dataclass(frozen=True, slots=True)
class LedgerInterval:
    """One ledger row that meets the period; `ended_at` None while it is open."""

    holder_kind: str  # idle | attempt | replica
    holder_id: str | None
    job_id: str | None
    job_name: str | None
    team: str | None
    started_at: float
    ended_at: float | None


@dataclass(frozen=True, slots=True)
class EndedAttempt:
    """An attempt that ended in the period, interrupted or lost (the candidates for preemption)."""

    attempt_id: int
    job_id: str
    job_name: str | None
    team: str | None
    state: AttemptState
    preempted: bool
    ended_at: float
    lost_gpu_seconds: float


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One group's share of the period. Job and team rows hold research only; day rows all kinds;
    holder rows one holder (all idle GPU time is a single holder row, key "idle")."""

    key: str
    job_id: str | None
    job_name: str | None
    team: str | None
    day: str | None  # ISO date, day rows only
    holder_kind: str | None  # holder rows only
    holder_id: str | None  # holder rows only
    period_seconds: float  # the seconds of the period this row speaks for
    idle_gpu_seconds: float
    research_gpu_seconds: float
    inference_gpu_seconds: float
    lost_gpu_seconds: float
    preemptions: int
    equivalent_gpus: float  # research GPU-seconds ÷ period_seconds
    savings: float

    @property
    def capacity_gpu_seconds(self) -> float:
        return self.idle_gpu_seconds + self.research_gpu_seconds + self.inference_gpu_seconds


@dataclass(frozen=True, slots=True)
class UsageTotals:
    capacity_gpu_seconds: float
    idle_gpu_seconds: float
    research_gpu_seconds: float
    inference_gpu_seconds: float
    lent_gpu_seconds: float
    lost_gpu_seconds: float
    preemptions: int
    capacity_gpus: float  # equivalent GPUs of capacity
    lent_gpus: float
    research_gpus: float
    inference_gpus: float
    savings: float


@dataclass(frozen=True, slots=True)
class UsageReport:
    start: float
    end: float
    timezone: str
    group_by: GroupBy
    price_per_gpu_hour: float
    currency: str
    totals: UsageTotals
    rows: tuple[UsageRow, ...]

    @property
    def hours(self) -> float:
        return (self.end - self.start) / _HOUR


# -- small pieces -------------------------------------------------------------------------------


def clip(started_at: float, ended_at: float | None, start: float, end: float) -> tuple[float, float] | None:
    """The part of [started_at, ended_at) inside [start, end) (open: up to `end`), or None."""
    lo = max(started_at, start)
    hi = min(end if ended_at is None else ended_at, end)
    return (lo, hi) if hi > lo else None


def equivalent_gpus(gpu_seconds: float, period_seconds: float) -> float:
    """GPU-seconds ÷ seconds in the period: how many GPUs held all the time that would be."""
    return gpu_seconds / period_seconds if period_seconds > 0 else 0.0


def savings(research_gpu_seconds: float, price_per_gpu_hour: float) -> float:
    return research_gpu_seconds / _HOUR * price_per_gpu_hour


def time_zone(name: str) -> ZoneInfo:
    """The IANA time zone `name`; ValueError if there is none by that name."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise ValueError(f"unknown time zone {name!r} (use an IANA name such as Europe/Berlin)") from exc


def local_midnight(day: date, zone: ZoneInfo) -> float:
    """Epoch seconds of the first instant of a local day."""
    return datetime(day.year, day.month, day.day, tzinfo=zone).timestamp()


def local_days(start: float, end: float, zone: ZoneInfo) -> list[tuple[date, float, float]]:
    """The local days meeting [start, end), each as (day, from, to) clipped to the period."""
    out: list[tuple[date, float, float]] = []
    t = start
    while t < end:
        day = datetime.fromtimestamp(t, zone).date()
        nxt = local_midnight(day + timedelta(days=1), zone)
        if nxt <= t:  # a midnight that repeats (clocks set back across it): never go backwards
            nxt = local_midnight(day + timedelta(days=2), zone)
        hi = min(nxt, end)
        out.append((day, t, hi))
        t = hi
    return out


# -- the report ---------------------------------------------------------------------------------


@dataclass
class _Acc:
    """A row being summed (math.fsum at the end keeps sums of many floats exact enough)."""

    period_seconds: float
    job_id: str | None = None
    job_name: str | None = None
    team: str | None = None
    day: str | None = None
    holder_kind: str | None = None
    holder_id: str | None = None
    parts: dict[str, list[float]] = field(default_factory=lambda: {IDLE: [], ATTEMPT: [], REPLICA: []})
    lost: list[float] = field(default_factory=list)
    preemptions: int = 0

    def row(self, key: str, price: float) -> UsageRow:
        research = math.fsum(self.parts[ATTEMPT])
        return UsageRow(
            key=key,
            job_id=self.job_id,
            job_name=self.job_name,
            team=self.team,
            day=self.day,
            holder_kind=self.holder_kind,
            holder_id=self.holder_id,
            period_seconds=self.period_seconds,
            idle_gpu_seconds=math.fsum(self.parts[IDLE]),
            research_gpu_seconds=research,
            inference_gpu_seconds=math.fsum(self.parts[REPLICA]),
            lost_gpu_seconds=math.fsum(self.lost),
            preemptions=self.preemptions,
            equivalent_gpus=equivalent_gpus(research, self.period_seconds),
            savings=savings(research, price),
        )


def usage_report(
    intervals: Iterable[LedgerInterval],
    ended: Iterable[EndedAttempt],
    *,
    start: float,
    end: float,
    group_by: GroupBy,
    policy: AccountingPolicy,
) -> UsageReport:
    """The usage of [start, end) from the ledger intervals meeting it and the attempts that ended
    in it (see the module docstring for every definition). Raises ValueError if end ≤ start,
    group_by is unknown or the time zone is not an IANA name."""
    if not end > start:
        raise ValueError(f"the period must not be empty: end {end} ≤ start {start}")
    if group_by not in GROUP_BY:
        raise ValueError(f"unknown grouping {group_by!r}: use one of {', '.join(GROUP_BY)}")
    zone = time_zone(policy.timezone)
    period = end - start
    price = policy.price_per_gpu_hour
    total = _Acc(period)
    groups: dict[str, _Acc] = {}
    days = local_days(start, end, zone) if group_by == "day" else []
    day_starts = [lo for _, lo, _ in days]
    if group_by == "day":
        for day, lo, hi in days:
            groups[day.isoformat()] = _Acc(hi - lo, day=day.isoformat())

    for iv in intervals:
        seg = clip(iv.started_at, iv.ended_at, start, end)
        if seg is None:
            continue
        lo, hi = seg
        kind = iv.holder_kind if iv.holder_kind in total.parts else IDLE
        total.parts[kind].append(hi - lo)
        if group_by == "day":
            for i in range(bisect.bisect_right(day_starts, lo) - 1, len(days)):
                _, dlo, dhi = days[i]
                if dlo >= hi:
                    break
                a, b = max(lo, dlo), min(hi, dhi)
                if b > a:
                    groups[days[i][0].isoformat()].parts[kind].append(b - a)
            continue
        acc = _group(groups, group_by, kind, iv.holder_id, iv.job_id, iv.job_name, iv.team, period)
        if acc is not None:
            acc.parts[kind].append(hi - lo)

    for att in ended:
        if not (start <= att.ended_at < end) or not att.preempted:
            continue
        total.lost.append(att.lost_gpu_seconds)
        total.preemptions += 1
        if group_by == "day":
            acc = groups[days[bisect.bisect_right(day_starts, att.ended_at) - 1][0].isoformat()]
        else:
            found = _group(
                groups, group_by, ATTEMPT, str(att.attempt_id), att.job_id, att.job_name, att.team, period
            )
            assert found is not None  # job, team and holder groups take every attempt
            acc = found
        acc.lost.append(att.lost_gpu_seconds)
        acc.preemptions += 1

    t = total.row("total", price)
    lent = t.idle_gpu_seconds + t.research_gpu_seconds
    totals = UsageTotals(
        capacity_gpu_seconds=t.capacity_gpu_seconds,
        idle_gpu_seconds=t.idle_gpu_seconds,
        research_gpu_seconds=t.research_gpu_seconds,
        inference_gpu_seconds=t.inference_gpu_seconds,
        lent_gpu_seconds=lent,
        lost_gpu_seconds=t.lost_gpu_seconds,
        preemptions=t.preemptions,
        capacity_gpus=equivalent_gpus(t.capacity_gpu_seconds, period),
        lent_gpus=equivalent_gpus(lent, period),
        research_gpus=t.equivalent_gpus,
        inference_gpus=equivalent_gpus(t.inference_gpu_seconds, period),
        savings=t.savings,
    )
    rows = [acc.row(key, price) for key, acc in groups.items()]
    return UsageReport(
        start=start,
        end=end,
        timezone=policy.timezone,
        group_by=group_by,
        price_per_gpu_hour=price,
        currency=policy.currency,
        totals=totals,
        rows=tuple(_ordered(rows, group_by)),
    )


def _group(
    groups: dict[str, _Acc],
    group_by: GroupBy,
    kind: str,
    holder_id: str | None,
    job_id: str | None,
    job_name: str | None,
    team: str | None,
    period: float,
) -> _Acc | None:
    """The accumulator of a job, team or holder group (created on first use); None when the
    interval belongs to no such group (idle and inference time has no job or team)."""
    if group_by == "holder":
        key = IDLE if kind == IDLE else f"{kind}:{holder_id}"
        if key not in groups:
            research = kind == ATTEMPT
            groups[key] = _Acc(
                period,
                job_id=job_id if research else None,
                job_name=job_name if research else None,
                team=team if research else None,
                holder_kind=kind,
                holder_id=None if kind == IDLE else holder_id,
            )
        return groups[key]
    if kind != ATTEMPT:
        return None
    if group_by == "job":
        key = job_id or "?"
        if key not in groups:
            groups[key] = _Acc(period, job_id=job_id, job_name=job_name, team=team)
        return groups[key]
    key = team or "?"
    if key not in groups:
        groups[key] = _Acc(period, team=team)
    return groups[key]


def _ordered(rows: Sequence[UsageRow], group_by: GroupBy) -> list[UsageRow]:
    """Days in order; other groups by GPU-seconds, then lost work, largest first, then key."""
    if group_by == "day":
        return sorted(rows, key=lambda r: r.key)
    return sorted(rows, key=lambda r: (-r.capacity_gpu_seconds, -r.lost_gpu_seconds, r.key))
