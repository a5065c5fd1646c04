"""Stories for policy.lending.envelope: arithmetic, growth reserve, windows, forecast, fail safe.

Times are explicit: local wall times in Europe/Berlin turned into epoch seconds, so window edges
and DST days read as they would on a wall clock.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtide.domain.services import LendingMode, LendingPolicy, ServiceSpec, TimeWindow
from lowtide.policy.autoscale import ScaleDecision, ScaleState
from lowtide.policy.forecast import WeeklyProfile
from lowtide.policy.lending import Envelope, ServiceLendingInput, envelope

BERLIN = ZoneInfo("Europe/Berlin")
T0 = datetime(2026, 1, 14, 12, 0, tzinfo=BERLIN).timestamp()  # a Wednesday noon


def berlin(y: int, mo: int, d: int, h: int, mi: int = 0, s: int = 0) -> float:
    return datetime(y, mo, d, h, mi, s, tzinfo=BERLIN).timestamp()


def utc(y: int, mo: int, d: int, h: int, mi: int = 0) -> float:
    return datetime(y, mo, d, h, mi, tzinfo=ZoneInfo("UTC")).timestamp()


def decision(desired: int, needed: int | None = None) -> ScaleDecision:
    return ScaleDecision(
        desired=desired,
        needed=desired if needed is None else needed,
        recommendation=desired,
        per_signal={},
        guard=None,
        unknown=False,
        reason="",
        state=ScaleState(),
    )


def svc(
    name: str = "llama",
    *,
    gpus: int = 4,
    desired: int = 3,
    needed: int | None = None,
    age: float | None = 2.0,
    growth: float | None = None,
    forecast: int | None = None,
    forecast_at: float | None = None,
    held: int | None = None,
    min_safe: int = 1,
    max_replicas: int = 16,
    headroom: int = 0,
) -> ServiceLendingInput:
    spec = ServiceSpec(
        name=name,
        model="m",
        gpus_per_replica=gpus,
        min_replicas=0,
        max_replicas=max_replicas,
        headroom_replicas=headroom,
        min_safe_replicas=min_safe,
    )
    return ServiceLendingInput(
        spec=spec,
        decision=decision(desired, needed),
        held_gpus=desired * gpus if held is None else held,
        signals_age_s=age,
        growth_per_s=growth,
        forecast_needed=forecast,
        forecast_at=forecast_at,
    )


def lend(
    services: Sequence[ServiceLendingInput],
    *,
    pool: int = 32,
    lent: int = 0,
    now: float = T0,
    mode: LendingMode = "continuous",
    windows: Sequence[TimeWindow] = (),
    lead: float = 60.0,
    tz: str = "Europe/Berlin",
) -> Envelope:
    policy = LendingPolicy(
        mode=mode,
        windows=tuple(windows),
        timezone=tz,
        reclaim_lead_s=lead,
        stale_after_s=30.0,
        stale_reclaim_after_s=120.0,
    )
    return envelope(now=now, pool_gpus=pool, services=services, policy=policy, currently_lent_gpus=lent)


# -- continuous arithmetic ----------------------------------------------------------------------


def test_continuous_pool_minus_desired_replicas() -> None:
    env = lend([svc("llama", gpus=4, desired=3), svc("mistral", gpus=1, desired=2)], pool=32, lent=5)
    assert env.lendable_gpus == 18
    assert env.inference_claim_gpus == 14
    assert env.reserve_gpus == 0
    assert dict(env.claims) == {"llama": 3, "mistral": 2}
    assert (env.lending_open, env.return_by, env.fail_safe) == (True, None, None)
    assert env.reasons == ("pool 32 − llama 3×4 − mistral 2×1 = 18 lendable",)


def test_inference_needing_more_than_the_pool_lends_nothing_and_reclaims() -> None:
    env = lend([svc(desired=3)], pool=8, lent=4)
    assert env.lendable_gpus == 0
    assert env.inference_claim_gpus == 12
    assert env.reasons == ("pool 8 − llama 3×4 = -4 → 0 lendable", "4 of 4 lent GPUs must come back now")


def test_replicas_still_parking_do_not_shrink_the_envelope() -> None:
    # Scaled down to 2, but 4 replicas' GPUs are still held while 2 park: lendable counts the 2.
    env = lend([svc(desired=2, held=16)], pool=32)
    assert env.lendable_gpus == 24
    assert env.reasons[1] == "llama holds 16 GPUs, claims 8: the rest frees as replicas park"


# -- growth reserve -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "reserve", "lendable"),
    [
        ({"growth": 1 / 60}, 1, 16),  # needed 3 + 1/60 × 60 s = 4 → one more replica
        ({"growth": 2.5 / 60}, 3, 8),  # 3 + 2.5 = 5.5 → 6: three more
        ({"growth": 0.0}, 0, 20),
        ({"growth": -0.1}, 0, 20),  # shrinking: never a negative reserve
        ({"growth": None}, 0, 20),  # unknown growth: no reserve (the fail safe covers missing data)
        ({"growth": 1.0, "max_replicas": 5}, 2, 12),  # never beyond max_replicas
        ({"growth": 1 / 60, "headroom": 1, "desired": 4}, 1, 12),  # headroom stays on top of the growth
        ({"growth": 1 / 60, "desired": 5}, 0, 12),  # desired already covers it
    ],
)
def test_growth_reserves_the_replicas_expected_within_the_lead_time(
    kw: dict[str, float], reserve: int, lendable: int
) -> None:
    args: dict[str, object] = {"desired": 3, "needed": 3, **kw}
    env = lend([svc(**args)], pool=32, lead=60)  # type: ignore[arg-type]
    assert env.reserve_gpus == reserve * 4
    assert env.lendable_gpus == lendable


def test_growth_reserve_stops_at_what_the_autoscalers_step_cap_can_reach_within_the_lead() -> None:
    # A spike: needed 1, growing 1 replica/s. Within a 10 s lead a capped autoscaler (×2 or +1 per
    # 30 s window) reaches 2 replicas, not 11: reserving 10 would preempt research for nothing.
    env = lend([svc(desired=1, needed=1, growth=1.0)], pool=32, lead=10)
    assert env.reserve_gpus == 1 * 4
    assert "(step cap: at most 2)" in env.reasons[1]
    # Two windows of lead: 1 → 2 → 4.
    env = lend([svc(desired=1, needed=1, growth=1.0)], pool=32, lead=60)
    assert env.reserve_gpus == 3 * 4


def test_growth_reason_names_every_term() -> None:
    env = lend([svc(desired=3, growth=1 / 60)], pool=32, lead=60)
    assert env.reasons == (
        "pool 32 − llama 3×4 − reserve llama 1×4 (growth) = 16 lendable",
        "llama: needed 3 growing 0.0167 replicas/s → 4 in 60s: reserve 1",
    )


# -- windows ------------------------------------------------------------------------------------

NIGHT = (TimeWindow(20 * 60, 8 * 60),)  # 20:00–08:00 local


@pytest.mark.parametrize(
    ("now", "lendable", "open_", "return_by", "why"),
    [
        (berlin(2026, 1, 12, 19, 59, 59), 0, False, "now", "just before the window opens"),
        (berlin(2026, 1, 12, 20, 0), 20, True, berlin(2026, 1, 13, 7, 59), "it opens"),
        (berlin(2026, 1, 12, 23, 59, 59), 20, True, berlin(2026, 1, 13, 7, 59), "before midnight"),
        (berlin(2026, 1, 13, 0, 0), 20, True, berlin(2026, 1, 13, 7, 59), "across midnight"),
        (berlin(2026, 1, 13, 7, 58, 59), 20, True, berlin(2026, 1, 13, 7, 59), "last second of lending"),
        (berlin(2026, 1, 13, 7, 59), 0, False, berlin(2026, 1, 13, 7, 59), "close − lead: everything back"),
        (
            berlin(2026, 1, 13, 7, 59, 30),
            0,
            False,
            berlin(2026, 1, 13, 7, 59),
            "between close − lead and close",
        ),
        (berlin(2026, 1, 13, 8, 0), 0, False, "now", "the window has closed"),
        (berlin(2026, 1, 13, 12, 0), 0, False, "now", "midday"),
    ],
)
def test_window_edges(now: float, lendable: int, open_: bool, return_by: float | str, why: str) -> None:
    env = lend([svc(desired=3)], pool=32, now=now, mode="window", windows=NIGHT, lead=60)
    assert env.lendable_gpus == lendable, why
    assert env.lending_open is open_, why
    assert env.return_by == (now if return_by == "now" else return_by), why
    assert env.inference_claim_gpus == 12  # inference's claim does not depend on the window


def test_window_reasons_name_the_local_times() -> None:
    before = lend([svc()], now=berlin(2026, 1, 12, 19, 0), mode="window", windows=NIGHT)
    assert before.reasons[-1] == "outside the lending windows (next opens Mon 2026-01-12 20:00 CET)"
    inside = lend([svc()], now=berlin(2026, 1, 12, 22, 0), mode="window", windows=NIGHT)
    assert inside.reasons[-1] == (
        "inside a lending window until Tue 2026-01-13 08:00 CET: new lending stops and notice goes out "
        "at Tue 2026-01-13 07:59 CET (lead 60s)"
    )
    closing = lend([svc()], now=berlin(2026, 1, 13, 7, 59, 30), mode="window", windows=NIGHT)
    assert closing.reasons[-1] == (
        "lending window closes at Tue 2026-01-13 08:00 CET: everything comes back "
        "(notice from Tue 2026-01-13 07:59 CET, lead 60s)"
    )


@pytest.mark.parametrize(
    ("now", "open_", "return_by"),
    [
        # Spring forward, Sunday 29 March 2026: 02:00 CET → 03:00 CEST. Sat 20:00 CET = 19:00 UTC,
        # Sun 08:00 CEST = 06:00 UTC: an 11-hour night.
        (utc(2026, 3, 28, 18, 59), False, "now"),
        (utc(2026, 3, 28, 19, 0), True, utc(2026, 3, 29, 5, 59)),
        (utc(2026, 3, 29, 1, 0), True, utc(2026, 3, 29, 5, 59)),  # 03:00 CEST, the jump itself
        (utc(2026, 3, 29, 5, 58), True, utc(2026, 3, 29, 5, 59)),  # 07:58 CEST
        (utc(2026, 3, 29, 5, 59), False, utc(2026, 3, 29, 5, 59)),  # 07:59 CEST: notice
        (utc(2026, 3, 29, 6, 0), False, "now"),  # 08:00 CEST
        # Fall back, Sunday 25 October 2026: 03:00 CEST → 02:00 CET. Sat 20:00 CEST = 18:00 UTC,
        # Sun 08:00 CET = 07:00 UTC: a 13-hour night.
        (utc(2026, 10, 24, 18, 0), True, utc(2026, 10, 25, 6, 59)),
        (utc(2026, 10, 25, 0, 30), True, utc(2026, 10, 25, 6, 59)),  # 02:30 CEST, first pass
        (utc(2026, 10, 25, 1, 30), True, utc(2026, 10, 25, 6, 59)),  # 02:30 CET, second pass
        (utc(2026, 10, 25, 6, 0), True, utc(2026, 10, 25, 6, 59)),  # 07:00 CET (an hour later in UTC)
        (utc(2026, 10, 25, 6, 59), False, utc(2026, 10, 25, 6, 59)),
        (utc(2026, 10, 25, 7, 0), False, "now"),
    ],
)
def test_windows_follow_the_wall_clock_on_dst_days(now: float, open_: bool, return_by: float | str) -> None:
    env = lend([svc(desired=3)], pool=32, now=now, mode="window", windows=NIGHT, lead=60)
    assert env.lending_open is open_
    assert env.lendable_gpus == (20 if open_ else 0)
    assert env.return_by == (now if return_by == "now" else return_by)


def test_a_window_edge_in_the_skipped_hour_moves_after_the_jump() -> None:
    early = (TimeWindow(2 * 60 + 30, 5 * 60),)  # 02:30–05:00, and 02:30 does not exist on 29 March
    assert not lend([svc()], now=utc(2026, 3, 29, 1, 15), mode="window", windows=early).lending_open  # 03:15
    assert lend([svc()], now=utc(2026, 3, 29, 1, 30), mode="window", windows=early).lending_open  # 03:30


@pytest.mark.parametrize(
    ("windows", "now", "return_by", "why"),
    [
        (
            (TimeWindow(20 * 60, 0), TimeWindow(0, 8 * 60)),
            berlin(2026, 1, 12, 23, 0),
            berlin(2026, 1, 13, 7, 59),
            "adjacent at midnight: one window until 08:00, not a close at 00:00",
        ),
        (
            (TimeWindow(18 * 60, 22 * 60), TimeWindow(20 * 60, 23 * 60)),
            berlin(2026, 1, 12, 19, 0),
            berlin(2026, 1, 12, 22, 59),
            "overlapping: the union closes at 23:00",
        ),
        (
            (TimeWindow(1 * 60, 3 * 60), TimeWindow(22 * 60, 2 * 60)),
            berlin(2026, 1, 12, 23, 0),
            berlin(2026, 1, 13, 2, 59),
            "a window crossing midnight overlapping one after it",
        ),
    ],
)
def test_overlapping_and_adjacent_windows_merge(
    windows: tuple[TimeWindow, ...], now: float, return_by: float, why: str
) -> None:
    env = lend([svc()], now=now, mode="window", windows=windows)
    assert (env.lending_open, env.return_by) == (True, return_by), why


def test_windows_covering_the_whole_day_never_close() -> None:
    env = lend([svc()], mode="window", windows=(TimeWindow(0, 12 * 60), TimeWindow(12 * 60, 0)))
    assert (env.lending_open, env.return_by, env.lendable_gpus) == (True, None, 20)


def test_an_unknown_time_zone_lends_nothing_instead_of_crashing() -> None:
    env = lend([svc()], lent=4, mode="window", windows=NIGHT, tz="Mars/Olympus")
    assert (env.lendable_gpus, env.lending_open) == (0, False)
    assert env.fail_safe == "unknown time zone 'Mars/Olympus': no lending windows"


# -- forecast -----------------------------------------------------------------------------------


def _office_hours_week() -> WeeklyProfile:
    """A week of observations every 5 minutes: 8 replicas needed on weekdays 08:00–18:00, else 2."""
    profile = WeeklyProfile.empty("Europe/Berlin", min_samples=6)
    t, end = berlin(2026, 1, 5, 0, 0), berlin(2026, 1, 12, 0, 0)  # Monday to Monday
    while t < end:
        local = datetime.fromtimestamp(t, BERLIN)
        busy = local.weekday() < 5 and 8 <= local.hour < 18
        profile = profile.observe(t, 8.0 if busy else 2.0)
        t += 300
    return profile


def test_forecast_brings_gpus_back_before_the_morning_peak() -> None:
    profile = _office_hours_week()
    lead, pool = 600.0, 40
    lent = 0
    timeline: list[tuple[str, int, float | None]] = []
    for minute in range(7 * 60 + 30, 8 * 60 + 6):
        now = berlin(2026, 1, 12, minute // 60, minute % 60)
        desired = 8 if minute >= 8 * 60 else 2  # the load itself arrives at 08:00
        peak = profile.ramp_within(now, lead)  # what mode `forecast` reserves by (forecast_peak)
        assert (peak is None) == (minute < 7 * 60 + 50)  # 07:00 is flat; 08:00 climbs (2 → 8)
        forecast = (math.ceil(peak[0]), peak[1]) if peak is not None else (None, None)
        service = svc(desired=desired, forecast=forecast[0], forecast_at=forecast[1])
        env = lend([service], pool=pool, lent=lent, now=now, mode="forecast", lead=lead)
        continuous = lend([replace(service, forecast_needed=None)], pool=pool, lent=lent, now=now, lead=lead)
        timeline.append((f"{minute // 60:02d}:{minute % 60:02d}", env.lendable_gpus, env.return_by))
        if minute < 7 * 60 + 50:
            assert env.lendable_gpus == 32 and env.return_by is None
        else:  # from 08:00 − lead on, the 6 extra replicas' GPUs are held back
            assert env.lendable_gpus == 8, timeline
            assert continuous.lendable_gpus == (32 if minute < 8 * 60 else 8)
        lent = env.lendable_gpus  # research takes whatever it may
    by_time = {hhmm: (lendable, back) for hhmm, lendable, back in timeline}
    assert by_time["07:50"] == (8, berlin(2026, 1, 12, 7, 50))
    assert by_time["07:49"] == (32, None)


def test_forecast_reason_and_return_by() -> None:
    now = T0
    env = lend(
        [svc(desired=2, forecast=8, forecast_at=now + 300)], pool=40, now=now, mode="forecast", lead=600
    )
    assert env.lendable_gpus == 8
    assert env.return_by == now - 300
    assert env.reasons == (
        "pool 40 − llama 2×4 − reserve llama 6×4 (forecast) = 8 lendable",
        "llama: the forecast needs 8 replicas (+0 headroom) in 300s: reserve 6, return due now (lead 600s)",
    )


def test_forecast_takes_the_larger_of_growth_and_forecast_and_is_ignored_outside_forecast_mode() -> None:
    both = svc(desired=2, needed=2, growth=5 / 600, forecast=4, forecast_at=T0 + 60)
    assert lend([both], pool=40, mode="forecast", lead=600).reserve_gpus == 5 * 4  # growth: 2 + 5 = 7
    assert lend([both], pool=40, mode="continuous", lead=600).reserve_gpus == 5 * 4
    only_forecast = svc(desired=2, forecast=6, forecast_at=T0 + 60)
    assert lend([only_forecast], pool=40, mode="continuous", lead=600).reserve_gpus == 0
    below = svc(desired=5, forecast=3, forecast_at=T0 + 60)
    env = lend([below], pool=40, mode="forecast", lead=600)
    assert (env.reserve_gpus, env.return_by) == (0, None)


# -- fail safe ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("age", "lent", "lendable", "fail_safe"),
    [
        (30.0, 4, 20, None),  # exactly stale_after: still fresh
        (45.0, 4, 4, "llama: metrics 45s old (> 30s): no new lending"),  # keep what is lent, no more
        (45.0, 0, 0, "llama: metrics 45s old (> 30s): no new lending"),
        (45.0, 28, 20, "llama: metrics 45s old (> 30s): no new lending"),  # never above the envelope
        (120.0, 8, 8, "llama: metrics 120s old (> 30s): no new lending"),
    ],
)
def test_stale_metrics_lend_nothing_new(age: float, lent: int, lendable: int, fail_safe: str | None) -> None:
    env = lend([svc(desired=3, age=age)], pool=32, lent=lent)
    assert env.lendable_gpus == lendable
    assert env.fail_safe == fail_safe
    assert env.lending_open is (fail_safe is None)
    assert dict(env.claims) == {"llama": 3}


def test_stale_for_long_claims_min_safe_replicas_and_reclaims() -> None:
    # desired 1 (held on unknown data) but min_safe 3: the service claims 3 replicas.
    env = lend([svc(desired=1, age=200.0, min_safe=3)], pool=16, lent=12)
    assert dict(env.claims) == {"llama": 3}
    assert env.lendable_gpus == 4
    assert env.fail_safe == "llama: metrics 200s old (> 120s): no new lending, keeps at least 3 replicas"
    assert env.reasons == (
        "pool 16 − llama 3×4 = 4 lendable",
        "fail safe: llama: metrics 200s old (> 120s): no new lending, keeps at least 3 replicas",
        "8 of 12 lent GPUs must come back now",
    )


def test_never_had_data_counts_as_stale_for_long() -> None:
    env = lend([svc(desired=1, age=None, min_safe=2), svc("other", gpus=1, desired=1)], pool=16, lent=0)
    assert dict(env.claims) == {"llama": 2, "other": 1}
    assert env.lendable_gpus == 0
    assert (
        env.fail_safe
        == "llama: no trustworthy metrics yet (never fresh): no new lending, keeps at least 2 replicas"
    )


def test_min_safe_never_lowers_a_larger_desired() -> None:
    env = lend([svc(desired=5, age=500.0, min_safe=2)], pool=32, lent=0)
    assert dict(env.claims) == {"llama": 5}


# -- contract -----------------------------------------------------------------------------------


def test_inputs_are_not_mutated() -> None:
    services = [svc(desired=2, growth=0.1, forecast=5, forecast_at=T0 + 30), svc("b", gpus=1, age=500.0)]
    policy = LendingPolicy(mode="window", windows=NIGHT, timezone="Europe/Berlin")
    before = copy.deepcopy((services, policy))
    first = envelope(now=T0, pool_gpus=32, services=services, policy=policy, currently_lent_gpus=3)
    second = envelope(now=T0, pool_gpus=32, services=services, policy=policy, currently_lent_gpus=3)
    assert (services, policy) == before
    assert first == second


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        lend([svc()], pool=-1)
    with pytest.raises(ValueError, match="appears twice"):
        lend([svc("a"), svc("a")])


# -- properties ---------------------------------------------------------------------------------

_service = st.builds(
    lambda i, gpus, desired, extra, age, growth, forecast, min_safe: svc(
        f"s{i}",
        gpus=gpus,
        desired=desired,
        needed=max(desired - extra, 0),
        age=age,
        growth=growth,
        forecast=forecast,
        forecast_at=T0 + 100,
        min_safe=min_safe,
        max_replicas=max(desired, min_safe, 1) + 4,
    ),
    st.integers(0, 1000),
    st.integers(1, 8),
    st.integers(0, 8),
    st.integers(0, 2),
    st.one_of(st.none(), st.floats(0, 500)),
    st.one_of(st.none(), st.floats(-1, 1)),
    st.one_of(st.none(), st.integers(0, 12)),
    st.integers(0, 4),
)
_services = st.lists(_service, max_size=4, unique_by=lambda s: s.spec.name)
_modes = st.sampled_from(["continuous", "window", "forecast"])


@settings(max_examples=300, deadline=None)
@given(
    services=_services,
    pool=st.integers(0, 200),
    lent_fraction=st.floats(0, 1),
    mode=_modes,
    offset=st.floats(0, 7 * 86400),
    lead=st.floats(0, 3600),
)
def test_envelope_is_never_negative_never_above_the_pool_and_stale_never_lends_more(
    services: list[ServiceLendingInput],
    pool: int,
    lent_fraction: float,
    mode: LendingMode,
    offset: float,
    lead: float,
) -> None:
    lent = int(pool * lent_fraction)
    now = T0 + offset
    kw = {"pool": pool, "lent": lent, "now": now, "mode": mode, "windows": NIGHT, "lead": lead}
    env = lend(services, **kw)  # type: ignore[arg-type]
    assert 0 <= env.lendable_gpus <= pool
    claimed = sum(s.decision.desired * s.spec.gpus_per_replica for s in services)
    assert env.lendable_gpus <= max(0, pool - claimed)
    for i, service in enumerate(services):
        for age in (45.0, 500.0, None):
            if _age(age) < _age(service.signals_age_s):
                continue  # fresher than it was: not what this property is about
            staler = [*services[:i], replace(service, signals_age_s=age), *services[i + 1 :]]
            assert lend(staler, **kw).lendable_gpus <= env.lendable_gpus  # type: ignore[arg-type]


def _age(age: float | None) -> float:
    return math.inf if age is None else age
