"""Stories for policy.forecast.WeeklyProfile: learning a synthetic week, predicting, peaks, DST,
persistence. Times are local wall times in Europe/Berlin turned into epoch seconds."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtide.policy.forecast import HOURS_PER_WEEK, WeeklyProfile

BERLIN = ZoneInfo("Europe/Berlin")
UTC = ZoneInfo("UTC")
WEEK = 7 * 86400.0


def berlin(y: int, mo: int, d: int, h: int, mi: int = 0) -> float:
    return datetime(y, mo, d, h, mi, tzinfo=BERLIN).timestamp()


def utc(y: int, mo: int, d: int, h: int, mi: int = 0) -> float:
    return datetime(y, mo, d, h, mi, tzinfo=UTC).timestamp()


def office_hours(t: float) -> float:
    """Needed replicas of a synthetic service: 8 on weekdays 08:00–18:00 local, 2 otherwise."""
    local = datetime.fromtimestamp(t, BERLIN)
    return 8.0 if local.weekday() < 5 and 8 <= local.hour < 18 else 2.0


def learn(
    start: float,
    end: float,
    demand: Callable[[float], float],
    every: float = 300.0,
    profile: WeeklyProfile | None = None,
) -> WeeklyProfile:
    """`profile` (default: an empty Berlin one) after observing `demand(t)` every `every` seconds."""
    profile = profile or WeeklyProfile.empty("Europe/Berlin", min_samples=6)
    t = start
    while t < end:
        profile = profile.observe(t, demand(t))
        t += every
    return profile


MONDAY = berlin(2026, 1, 5, 0)  # Monday 5 January 2026, 00:00 CET
NEXT_MONDAY = berlin(2026, 1, 12, 0)


@pytest.fixture(scope="module")
def week() -> WeeklyProfile:
    return learn(MONDAY, NEXT_MONDAY, office_hours)


# -- learning a week ----------------------------------------------------------------------------


def test_a_week_of_observations_predicts_the_next_week(week: WeeklyProfile) -> None:
    table = [
        (berlin(2026, 1, 12, 7, 59), 2.0),  # Monday, just before the peak
        (berlin(2026, 1, 12, 8, 0), 8.0),  # Monday morning peak
        (berlin(2026, 1, 14, 13, 30), 8.0),  # Wednesday afternoon
        (berlin(2026, 1, 16, 17, 59), 8.0),  # Friday evening, last busy minute
        (berlin(2026, 1, 16, 18, 0), 2.0),
        (berlin(2026, 1, 17, 10, 0), 2.0),  # Saturday
        (berlin(2026, 1, 19, 9, 0), 8.0),  # two weeks on: same hour of the week
    ]
    assert [week.predict(t) for t, _ in table] == [v for _, v in table]
    assert all(b.count == 12 for b in week.bins)  # every hour: 12 samples of 5 minutes


def test_peak_within_finds_the_morning_ramp_and_its_start(week: WeeklyProfile) -> None:
    monday = 12
    assert week.peak_within(berlin(2026, 1, monday, 7, 40), 600) == (2.0, berlin(2026, 1, monday, 7, 40))
    assert week.peak_within(berlin(2026, 1, monday, 7, 49), 600) == (2.0, berlin(2026, 1, monday, 7, 49))
    assert week.peak_within(berlin(2026, 1, monday, 7, 50), 600) == (8.0, berlin(2026, 1, monday, 8, 0))
    assert week.peak_within(berlin(2026, 1, monday, 7, 15), 3600) == (8.0, berlin(2026, 1, monday, 8, 0))
    # inside the peak the current hour holds it: the time is now
    assert week.peak_within(berlin(2026, 1, monday, 9, 10), 3600) == (8.0, berlin(2026, 1, monday, 9, 10))
    # Sunday evening looking 12 hours ahead sees Monday 08:00
    assert week.peak_within(berlin(2026, 1, 11, 21, 0), 12 * 3600) == (8.0, berlin(2026, 1, 12, 8, 0))
    # Friday 18:00 over the weekend: only 2s, the earliest is now
    friday = berlin(2026, 1, 16, 18, 0)
    assert week.peak_within(friday, 24 * 3600) == (2.0, friday)


def test_ramp_within_reserves_only_for_hours_that_climb(week: WeeklyProfile) -> None:
    """Mode `forecast` holds an hour's mean only for an hour that needs more than the one before:
    08:00 on a weekday (2 → 8), from `lead` before it to its end; a plateau (09:00–18:00) or a
    fall (18:00) reserves nothing beyond what the load needs now."""
    monday = 12
    eight = berlin(2026, 1, monday, 8, 0)
    assert week.ramp_within(berlin(2026, 1, monday, 7, 50), 600) == (8.0, eight)
    assert week.ramp_within(berlin(2026, 1, monday, 7, 40), 600) is None  # 07:00 is flat (2 after 2)
    assert week.ramp_within(berlin(2026, 1, monday, 8, 40), 600) == (8.0, berlin(2026, 1, monday, 8, 40))
    assert week.ramp_within(berlin(2026, 1, monday, 9, 10), 3600) is None  # on the plateau
    assert week.ramp_within(berlin(2026, 1, monday, 17, 55), 600) is None  # 18:00 falls
    assert week.ramp_within(berlin(2026, 1, 11, 21, 0), 12 * 3600) == (8.0, eight)
    # An hour whose previous hour is not known yet counts as a ramp (lend less when in doubt).
    young = learn(MONDAY + 8 * 3600, MONDAY + 10 * 3600, office_hours)
    assert young.ramp_within(MONDAY + 8 * 3600 + 60, 600) == (8.0, MONDAY + 8 * 3600 + 60)
    assert young.ramp_within(MONDAY + 9 * 3600 + 60, 600) is None  # 09:00 after a known 8


def test_a_repeated_bursty_hour_has_no_ramp() -> None:
    """A load that is about the same every hour (the Azure 2023 traces, one hour repeated; here a
    burst every 7 minutes, so the hours' means differ by a few per cent) has no hour that climbs
    by the ramp's 10 %: `forecast` lends as `continuous` does."""
    bursty = learn(MONDAY, NEXT_MONDAY, lambda t: 60.0 if int(t // 60) % 7 == 0 else 2.0, every=60.0)
    assert bursty.peak_within(MONDAY + 86400 + 30, 120) is not None  # the mean is there ...
    assert bursty.ramp_within(MONDAY + 86400 + 30, 120) is None  # ... but nothing climbs


def test_the_horizon_is_open_at_now_and_closed_at_the_end(week: WeeklyProfile) -> None:
    eight = berlin(2026, 1, 12, 8, 0)
    assert week.peak_within(eight - 600, 600) == (8.0, eight)  # (07:50, 08:00] holds 08:00
    assert week.peak_within(eight - 600, 599.999) == (2.0, eight - 600)
    assert week.peak_within(eight, 0) is None


def test_nothing_is_predicted_before_a_bin_has_enough_samples() -> None:
    t = berlin(2026, 1, 12, 9, 0)
    profile = WeeklyProfile.empty("Europe/Berlin", min_samples=3)
    assert profile.predict(t) is None
    assert profile.peak_within(t, 3600) is None
    profile = profile.observe(t, 4.0).observe(t + 60, 5.0)
    assert (profile.samples(t), profile.predict(t)) == (2, None)
    profile = profile.observe(t + 120, 6.0)
    assert profile.predict(t) == pytest.approx(5.0, abs=1e-3)  # minutes apart: (almost) equal weights
    assert profile.predict(t + 3600) is None  # the next hour is still unknown
    peak = profile.peak_within(t - 1800, 7200)
    assert peak is not None and peak[1] == t and peak[0] == pytest.approx(5.0, abs=1e-3)


# -- the weighted average -----------------------------------------------------------------------


def test_older_weeks_fade_with_the_half_life_in_time() -> None:
    half_life = 14 * 86400.0
    profile = WeeklyProfile.empty("Europe/Berlin", half_life_s=half_life, min_samples=1)
    t1 = berlin(2026, 1, 12, 9, 0)
    samples = [(t1 + i * 60, 2.0) for i in range(60)] + [(t1 + WEEK + i * 60, 6.0) for i in range(60)]
    for t, v in samples:
        profile = profile.observe(t, v)
    last = samples[-1][0]
    weights = [0.5 ** ((last - t) / half_life) for t, _ in samples]
    expected = math.fsum(w * v for w, (_, v) in zip(weights, samples, strict=True)) / math.fsum(weights)
    assert profile.predict(t1) == pytest.approx(expected, rel=1e-9)
    assert 4.3 < expected < 4.4  # a week-old hour weighs 2^(−1/2) ≈ 0.71 of this week's


def test_the_tick_rate_does_not_change_the_weekly_balance() -> None:
    def two_weeks(every: float) -> float | None:
        p = WeeklyProfile.empty("Europe/Berlin", min_samples=1)
        p = learn(berlin(2026, 1, 12, 9), berlin(2026, 1, 12, 10), lambda _: 2.0, every, p)
        p = learn(berlin(2026, 1, 19, 9), berlin(2026, 1, 19, 10), lambda _: 6.0, every, p)
        return p.predict(berlin(2026, 1, 26, 9, 30))

    slow, fast = two_weeks(600.0), two_weeks(2.0)
    assert slow is not None and fast is not None
    assert fast == pytest.approx(slow, abs=0.02)


def test_observe_returns_a_new_profile_and_leaves_the_old_one_alone() -> None:
    before = WeeklyProfile.empty("UTC", min_samples=1)
    after = before.observe(utc(2026, 1, 12, 9), 3.0)
    assert before.predict(utc(2026, 1, 12, 9)) is None
    assert after.predict(utc(2026, 1, 12, 9)) == 3.0
    assert before == WeeklyProfile.empty("UTC", min_samples=1)


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_nonsense_demand_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="demand must be"):
        WeeklyProfile.empty("UTC").observe(0.0, value)


def test_a_bad_time_zone_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown time zone"):
        WeeklyProfile.empty("Mars/Olympus")


# -- hours of the week and DST ------------------------------------------------------------------


def test_bins_are_local_weekday_and_hour() -> None:
    p = WeeklyProfile.empty("Europe/Berlin")
    assert p.hour_of_week(berlin(2026, 1, 12, 0, 0)) == 0  # Monday 00:00
    assert p.hour_of_week(berlin(2026, 1, 12, 8, 30)) == 8
    assert p.hour_of_week(berlin(2026, 1, 18, 23, 59)) == HOURS_PER_WEEK - 1  # Sunday 23:59
    assert p.hour_of_week(utc(2026, 1, 11, 23, 30)) == 0  # 00:30 CET on Monday


def test_dst_days_keep_the_wall_clock_hour() -> None:
    p = WeeklyProfile.empty("Europe/Berlin", min_samples=1)
    sunday = 6 * 24
    # Spring forward, 29 March 2026: 01:30 CET, then 03:30 CEST one hour later; no 02:xx at all.
    assert p.hour_of_week(utc(2026, 3, 29, 0, 30)) == sunday + 1
    assert p.hour_of_week(utc(2026, 3, 29, 1, 30)) == sunday + 3
    # Fall back, 25 October 2026: 02:30 CEST and 02:30 CET fall in the same bin.
    assert p.hour_of_week(utc(2026, 10, 25, 0, 30)) == sunday + 2
    assert p.hour_of_week(utc(2026, 10, 25, 1, 30)) == sunday + 2
    p = p.observe(utc(2026, 10, 25, 0, 30), 3.0).observe(utc(2026, 10, 25, 1, 30), 5.0)
    assert p.bins[sunday + 2].count == 2
    assert p.predict(utc(2026, 10, 25, 1, 45)) == pytest.approx(4.0, abs=1e-2)


def test_peak_within_across_the_spring_jump() -> None:
    # Sunday 03:00–04:00 local is busy. On 29 March the clock jumps from 02:00 CET to 03:00 CEST at
    # 01:00 UTC: the busy hour starts 10 minutes after 01:50 CET.
    p = WeeklyProfile.empty("Europe/Berlin", min_samples=1)
    p = p.observe(berlin(2026, 3, 22, 3, 30), 9.0).observe(berlin(2026, 3, 22, 1, 30), 1.0)
    assert p.peak_within(utc(2026, 3, 29, 0, 50), 600) == (9.0, utc(2026, 3, 29, 1, 0))
    assert p.peak_within(utc(2026, 3, 29, 0, 50), 599) == (1.0, utc(2026, 3, 29, 0, 50))


def test_peak_within_in_a_half_hour_offset_zone() -> None:
    p = WeeklyProfile.empty("Asia/Kolkata", min_samples=1)  # UTC+05:30
    monday_9 = datetime(2026, 1, 12, 9, 0, tzinfo=ZoneInfo("Asia/Kolkata")).timestamp()
    p = p.observe(monday_9 + 60, 7.0).observe(monday_9 - 60, 1.0)
    assert p.peak_within(monday_9 - 600, 900) == (7.0, monday_9)


def test_a_long_horizon_is_scanned_at_most_once_around_the_week(week: WeeklyProfile) -> None:
    t = berlin(2026, 1, 17, 12, 0)  # Saturday noon; the next busy hour is Monday 08:00
    assert week.peak_within(t, 365 * 86400) == (8.0, berlin(2026, 1, 19, 8, 0))


# -- persistence --------------------------------------------------------------------------------


def test_to_dict_and_back_through_json(week: WeeklyProfile) -> None:
    restored = WeeklyProfile.from_dict(json.loads(json.dumps(week.to_dict())))
    assert restored == week
    assert WeeklyProfile.from_dict(WeeklyProfile.empty("UTC").to_dict()) == WeeklyProfile.empty("UTC")


def _saved(**changes: Any) -> dict[str, Any]:
    data = WeeklyProfile.empty("UTC", min_samples=1).observe(0.0, 2.0).to_dict()
    data.update(changes)
    return data


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (_saved(version=2), "unsupported weekly profile version"),
        (_saved(bins=[]), "168 bins"),
        (_saved(bins="nope"), "168 bins"),
        (_saved(bins=[[0.0, 0.0, 0, None]] * 167 + [[1.0, 1.0, -1, 0.0]]), "count must be"),
        (_saved(bins=[[0.0, 0.0, 0, None]] * 167 + [[1.0, 0.0, 3, 0.0]]), "inconsistent bin"),
        (_saved(bins=[[0.0, 0.0, 0, None]] * 167 + [["x", 1.0, 1, 0.0]]), "finite number"),
        (_saved(bins=[[0.0, 0.0, 0, None]] * 167 + [[1.0, 1.0, 1]]), "a bin is"),
        (_saved(timezone="Mars/Olympus"), "unknown time zone"),
        (_saved(timezone=3), "timezone must be a string"),
        (_saved(half_life_s=-1.0), "half_life_s"),
        (_saved(half_life_s=math.nan), "finite number"),
        (_saved(min_samples=0), "min_samples"),
        (_saved(min_samples="3"), "min_samples must be an integer"),
        ({"version": 1}, "malformed weekly profile"),
        ([], "malformed weekly profile"),
    ],
)
def test_malformed_saved_profiles_raise_value_error(data: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WeeklyProfile.from_dict(data)


# -- properties ---------------------------------------------------------------------------------

_observation = st.tuples(st.floats(0, 4 * WEEK), st.floats(0, 50))


@settings(max_examples=150, deadline=None)
@given(observations=st.lists(_observation, min_size=1, max_size=40), probe=st.floats(0, 4 * WEEK))
def test_predictions_stay_within_what_the_bin_saw_and_survive_persistence(
    observations: list[tuple[float, float]], probe: float
) -> None:
    start = berlin(2026, 1, 5, 0)
    p = WeeklyProfile.empty("Europe/Berlin", min_samples=1)
    for offset, value in observations:
        p = p.observe(start + offset, value)
    assert sum(b.count for b in p.bins) == len(observations)
    t = start + probe
    seen = [v for offset, v in observations if p.hour_of_week(start + offset) == p.hour_of_week(t)]
    predicted = p.predict(t)
    if not seen:
        assert predicted is None
    else:
        assert predicted is not None
        assert min(seen) - 1e-9 <= predicted <= max(seen) + 1e-9
    assert WeeklyProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    peak = p.peak_within(t, 6 * 3600)
    if peak is not None:
        assert t <= peak[1] <= t + 6 * 3600
        assert p.predict(peak[1]) == peak[0]
