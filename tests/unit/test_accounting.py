"""policy.accounting: clipping, local days across DST, preemption vs cancellation, equivalent GPUs,
savings, and the add-up property over random ledgers.

Times in the hand-built ledgers are whole hours (H = 3600 s), so every GPU-second figure is an
exact float and the tests compare with `==`.
"""

from __future__ import annotations

import math
from datetime import date, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtide.config import ConfigError, Settings, load_settings
from lowtide.domain.states import AttemptState
from lowtide.policy.accounting import (
    AccountingPolicy,
    EndedAttempt,
    GroupBy,
    LedgerInterval,
    UsageReport,
    clip,
    equivalent_gpus,
    local_days,
    savings,
    usage_report,
)

H = 3600.0
BERLIN = ZoneInfo("Europe/Berlin")
INTERRUPTED, LOST, FAILED = AttemptState.INTERRUPTED, AttemptState.LOST, AttemptState.FAILED


def berlin(y: int, mo: int, d: int, h: int = 0, mi: int = 0) -> float:
    return datetime(y, mo, d, h, mi, tzinfo=BERLIN).timestamp()


def iv(
    kind: str,
    start: float,
    end: float | None,
    holder: str | None = None,
    job: str | None = None,
    team: str | None = None,
) -> LedgerInterval:
    return LedgerInterval(kind, holder, job, f"name-{job}" if job else None, team, start, end)


def ended(
    attempt_id: int,
    job: str,
    team: str,
    at: float,
    lost: float,
    preempted: bool = True,
    state: AttemptState = AttemptState.INTERRUPTED,
) -> EndedAttempt:
    return EndedAttempt(attempt_id, job, f"name-{job}", team, state, preempted, at, lost)


def report(
    intervals: list[LedgerInterval],
    ends: list[EndedAttempt] | None = None,
    *,
    start: float = 0.0,
    end: float = 10 * H,
    group_by: GroupBy = "job",
    price: float = 2.5,
    tz: str = "UTC",
) -> UsageReport:
    return usage_report(
        intervals,
        ends or [],
        start=start,
        end=end,
        group_by=group_by,
        policy=AccountingPolicy(price_per_gpu_hour=price, currency="EUR", timezone=tz),
    )


# -- pieces ------------------------------------------------------------------------------------


def test_clip_keeps_the_part_inside_the_period_and_counts_open_rows_to_its_end() -> None:
    assert clip(-5, 5, 0, 10) == (0, 5)
    assert clip(2, 4, 0, 10) == (2, 4)
    assert clip(8, None, 0, 10) == (8, 10)
    assert clip(-5, None, 0, 10) == (0, 10)
    assert clip(-5, 0, 0, 10) is None  # ends where the period starts
    assert clip(10, None, 0, 10) is None  # starts where it ends
    assert clip(3, 3, 0, 10) is None


def test_equivalent_gpus_and_savings() -> None:
    assert equivalent_gpus(48 * H, 24 * H) == 2.0
    assert equivalent_gpus(5.0, 0.0) == 0.0
    assert savings(10 * H, 2.5) == 25.0


def test_local_days_follow_the_zone_across_both_dst_changes() -> None:
    spring = local_days(berlin(2026, 3, 28, 12), berlin(2026, 3, 30, 6), BERLIN)
    assert [(d, hi - lo) for d, lo, hi in spring] == [
        (date(2026, 3, 28), 12 * H),
        (date(2026, 3, 29), 23 * H),  # 02:00 → 03:00
        (date(2026, 3, 30), 6 * H),
    ]
    autumn = local_days(berlin(2026, 10, 25), berlin(2026, 10, 26), BERLIN)
    assert [(d, hi - lo) for d, lo, hi in autumn] == [(date(2026, 10, 25), 25 * H)]
    # Where midnight itself is skipped (São Paulo, 2018-11-04: 00:00 → 01:00), the day starts at 01:00.
    sp = ZoneInfo("America/Sao_Paulo")
    days = local_days(
        datetime(2018, 11, 3, 12, tzinfo=sp).timestamp(), datetime(2018, 11, 5, tzinfo=sp).timestamp(), sp
    )
    assert [(d, hi - lo) for d, lo, hi in days] == [(date(2018, 11, 3), 12 * H), (date(2018, 11, 4), 23 * H)]
    assert datetime.fromtimestamp(days[1][1], sp).hour == 1
    assert local_days(5.0, 5.0, BERLIN) == []


# -- the report ----------------------------------------------------------------------------------

# Two GPUs over [0, 10 h):
#   gpu 0: idle [-5h, 1h), attempt 1 (job j1, team nlp) [1h, 6h), idle [6h, open)
#   gpu 1: replica chat/0 [-1h, 4h), attempt 2 (job j2, team cv) [4h, 13h), idle after
LEDGER = [
    iv("idle", -5 * H, 1 * H),
    iv("attempt", 1 * H, 6 * H, "1", "j1", "nlp"),
    iv("idle", 6 * H, None),
    iv("replica", -1 * H, 4 * H, "chat/0"),
    iv("attempt", 4 * H, 13 * H, "2", "j2", "cv"),
    iv("idle", 13 * H, None),
    iv("attempt", -9 * H, -5 * H, "9", "j9", "nlp"),  # before the period: nothing
]
ENDS = [
    ended(1, "j1", "nlp", 6 * H, 2 * H),  # preempted: 2 GPU-h since its checkpoint
    ended(3, "j1", "nlp", 7 * H, 1 * H, True, AttemptState.LOST),  # lost during its preemption
    ended(4, "j2", "cv", 8 * H, 5 * H, False),  # cancelled: not a preemption
    ended(5, "j2", "cv", 9 * H, 4 * H, False, AttemptState.FAILED),
    ended(6, "j2", "cv", 10 * H, 7 * H),  # ends at the period's end: outside [start, end)
]


def test_totals_by_holder_kind_add_up_to_capacity_exactly() -> None:
    t = report(LEDGER, ENDS).totals
    assert (t.idle_gpu_seconds, t.research_gpu_seconds, t.inference_gpu_seconds) == (5 * H, 11 * H, 4 * H)
    assert (
        t.capacity_gpu_seconds
        == 20 * H
        == t.idle_gpu_seconds + t.research_gpu_seconds + t.inference_gpu_seconds
    )
    assert t.lent_gpu_seconds == 16 * H
    assert (t.capacity_gpus, t.lent_gpus, t.research_gpus, t.inference_gpus) == (2.0, 1.6, 1.1, 0.4)
    assert (t.lost_gpu_seconds, t.preemptions) == (3 * H, 2)
    assert t.savings == 27.5  # 11 GPU-h × 2.5


def test_rows_by_job_and_by_team_hold_research_and_preemptions() -> None:
    r = report(LEDGER, ENDS, group_by="job")
    assert r.currency == "EUR" and r.hours == 10.0 and r.price_per_gpu_hour == 2.5
    rows = {row.key: row for row in r.rows}
    assert list(rows) == ["j2", "j1"]  # most GPU time first
    j1, j2 = rows["j1"], rows["j2"]
    assert (j1.job_name, j1.team, j1.research_gpu_seconds, j1.lost_gpu_seconds, j1.preemptions) == (
        "name-j1",
        "nlp",
        5 * H,
        3 * H,
        2,
    )
    assert (j2.research_gpu_seconds, j2.lost_gpu_seconds, j2.preemptions) == (6 * H, 0.0, 0)
    assert (j1.idle_gpu_seconds, j1.inference_gpu_seconds) == (0.0, 0.0)
    assert (j1.equivalent_gpus, j1.savings, j1.period_seconds) == (0.5, 12.5, 10 * H)
    teams = {
        row.key: (row.team, row.research_gpu_seconds, row.preemptions)
        for row in report(LEDGER, ENDS, group_by="team").rows
    }
    assert teams == {"cv": ("cv", 6 * H, 0), "nlp": ("nlp", 5 * H, 2)}


def test_rows_by_holder_cover_all_capacity_with_idle_as_one_holder() -> None:
    rows = {row.key: row for row in report(LEDGER, ENDS, group_by="holder").rows}
    assert {k: v.capacity_gpu_seconds for k, v in rows.items()} == {
        "attempt:2": 6 * H,
        "idle": 5 * H,
        "attempt:1": 5 * H,
        "replica:chat/0": 4 * H,
        "attempt:3": 0.0,  # no ledger time in the period, but its lost work ended in it
    }
    assert (rows["attempt:1"].job_id, rows["attempt:1"].holder_id, rows["attempt:1"].preemptions) == (
        "j1",
        "1",
        1,
    )
    assert (
        rows["replica:chat/0"].holder_kind,
        rows["replica:chat/0"].team,
        rows["replica:chat/0"].job_id,
    ) == (
        "replica",
        None,
        None,
    )
    assert rows["idle"].holder_id is None and rows["idle"].research_gpu_seconds == 0.0


def test_rows_by_local_day_split_intervals_at_midnight_across_dst() -> None:
    start, end = berlin(2026, 3, 28), berlin(2026, 3, 30)
    ledger = [
        iv("attempt", start - 5 * H, berlin(2026, 3, 28, 22), "1", "j1", "nlp"),
        iv("attempt", berlin(2026, 3, 28, 22), berlin(2026, 3, 29, 4), "2", "j1", "nlp"),  # 5 real hours
        iv("idle", berlin(2026, 3, 29, 4), None),
    ]
    # Ends at 00:30 local on the 29th, which is still the 28th in UTC: counted on the local day.
    ends = [ended(2, "j1", "nlp", berlin(2026, 3, 29, 0, 30), 0.5 * H)]
    r = report(ledger, ends, start=start, end=end, group_by="day", tz="Europe/Berlin", price=1.0)
    assert [(d.key, d.period_seconds, d.research_gpu_seconds, d.idle_gpu_seconds) for d in r.rows] == [
        ("2026-03-28", 24 * H, 24 * H, 0.0),
        ("2026-03-29", 23 * H, 3 * H, 20 * H),
    ]
    assert [(d.preemptions, d.lost_gpu_seconds) for d in r.rows] == [(0, 0.0), (1, 0.5 * H)]
    assert r.rows[0].equivalent_gpus == 1.0 and r.rows[1].equivalent_gpus == 3 / 23
    assert r.totals.capacity_gpu_seconds == 47 * H and r.hours == 47.0
    # Days with nothing in the ledger still appear, so a daily report has no holes.
    empty = report([], start=start, end=end, group_by="day", tz="Europe/Berlin")
    assert [(d.key, d.capacity_gpu_seconds) for d in empty.rows] == [("2026-03-28", 0.0), ("2026-03-29", 0.0)]


def test_bad_periods_groupings_and_zones_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        report(LEDGER, start=5.0, end=5.0)
    with pytest.raises(ValueError, match="grouping"):
        report(LEDGER, group_by="week")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="time zone"):
        report(LEDGER, tz="Mars/Olympus")


# -- the add-up property -------------------------------------------------------------------------

KINDS = ["idle", "attempt", "replica"]
ZONES = ["UTC", "Europe/Berlin", "America/Sao_Paulo", "Australia/Lord_Howe", "Asia/Kolkata"]
BASE = int(berlin(2026, 3, 27))  # days before a DST change


@st.composite
def ledgers(draw: st.DrawFn) -> tuple[list[LedgerInterval], list[tuple[int, int | None]]]:
    """Per GPU, contiguous intervals with random holders (whole seconds), the last one open or
    closed; also each GPU's covered span, to compute capacity independently."""
    out: list[LedgerInterval] = []
    spans: list[tuple[int, int | None]] = []
    for _ in range(draw(st.integers(1, 4))):
        t = BASE + draw(st.integers(-2 * 86400, 3 * 86400))
        first = t
        for _ in range(draw(st.integers(1, 8))):
            kind = draw(st.sampled_from(KINDS))
            length = draw(st.integers(1, 2 * 86400))
            holder = str(draw(st.integers(1, 5))) if kind != "idle" else None
            job = f"j{holder}" if kind == "attempt" else None
            team = draw(st.sampled_from(["nlp", "cv"])) if kind == "attempt" else None
            out.append(LedgerInterval(kind, holder, job, job, team, float(t), float(t + length)))
            t += length
        if draw(st.booleans()):
            last = out[-1]
            out[-1] = LedgerInterval(
                last.holder_kind, last.holder_id, last.job_id, last.job_name, last.team, last.started_at, None
            )
            spans.append((first, None))
        else:
            spans.append((first, t))
    return out, spans


@settings(max_examples=300, deadline=None)
@given(
    ledger=ledgers(),
    start_off=st.integers(-86400, 4 * 86400),
    length=st.integers(1, 6 * 86400),
    tz=st.sampled_from(ZONES),
    group_by=st.sampled_from(["job", "team", "day", "holder"]),
)
def test_every_gpu_second_is_counted_once_whatever_the_grouping(
    ledger: tuple[list[LedgerInterval], list[tuple[int, int | None]]],
    start_off: int,
    length: int,
    tz: str,
    group_by: GroupBy,
) -> None:
    intervals, spans = ledger
    start, end = float(BASE + start_off), float(BASE + start_off + length)
    r = report(intervals, start=start, end=end, group_by=group_by, tz=tz)
    t = r.totals
    covered = sum(max(0.0, min(end, e if e is not None else end) - max(start, s)) for s, e in spans)
    # Whole seconds everywhere (midnights too): every sum is exact.
    assert t.idle_gpu_seconds + t.research_gpu_seconds + t.inference_gpu_seconds == t.capacity_gpu_seconds
    assert t.capacity_gpu_seconds == covered
    if all(s <= start and (e is None or e >= end) for s, e in spans):
        assert t.capacity_gpu_seconds == len(spans) * (end - start)  # capacity × time
    if group_by in ("job", "team"):
        assert sum(row.research_gpu_seconds for row in r.rows) == t.research_gpu_seconds
        assert all(row.idle_gpu_seconds == row.inference_gpu_seconds == 0.0 for row in r.rows)
    else:
        for kind in ("idle_gpu_seconds", "research_gpu_seconds", "inference_gpu_seconds"):
            assert sum(getattr(row, kind) for row in r.rows) == getattr(t, kind)
    if group_by == "day":
        assert sum(row.period_seconds for row in r.rows) == end - start
        assert all(row.period_seconds <= 25 * H for row in r.rows)
    assert math.isclose(t.research_gpus * (end - start), t.research_gpu_seconds)


# -- configuration -------------------------------------------------------------------------------


def test_accounting_config_defaults_to_free_usd_and_the_lending_time_zone(tmp_path: Path) -> None:
    def load(doc: dict[str, Any]) -> Settings:
        path = tmp_path / "lowtide.yaml"
        path.write_text(yaml.safe_dump(doc))
        return load_settings(path)

    plain = load({})
    assert (plain.accounting.price_per_gpu_hour, plain.accounting.currency, plain.accounting_timezone) == (
        0.0,
        "USD",
        "UTC",
    )
    assert load({"lending": {"timezone": "Europe/Berlin"}}).accounting_timezone == "Europe/Berlin"
    own = load(
        {
            "lending": {"timezone": "Europe/Berlin"},
            "accounting": {"price_per_gpu_hour": 2.5, "currency": "EUR", "timezone": "Asia/Tokyo"},
        }
    )
    assert (own.accounting.price_per_gpu_hour, own.accounting.currency, own.accounting_timezone) == (
        2.5,
        "EUR",
        "Asia/Tokyo",
    )
    for bad, words in (
        ({"price_per_gpu_hour": -1}, "price_per_gpu_hour"),
        ({"price_per_gpu_hour": ".inf"}, "price_per_gpu_hour"),
        ({"currency": "euro"}, "currency"),
        ({"timezone": "Mars/Olympus"}, "unknown time zone 'Mars/Olympus'"),
        ({"price": 1}, "price"),
    ):
        with pytest.raises(ConfigError, match=words):
            load({"accounting": bad})
