"""Stories for policy.signals: rates with restarts, window quantiles, staleness and frozen gauges.

Every expected number is computed by hand in the test (or its comment) from the readings it
builds; quantiles follow Prometheus's `histogram_quantile` (linear inside the bucket, the first
bucket starting at 0, a rank in +Inf answering the largest finite bound).
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lowtide.adapters.vllm_metrics import failed_scrape, parse_vllm_metrics
from lowtide.domain.metrics import Histogram, ReplicaScrape, ReplicaSignals, ServiceSignals
from lowtide.policy.signals import (
    counter_increase,
    counter_rate,
    histogram_increase,
    histogram_quantile,
    replica_signals,
    service_totals,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "metrics"))
from vllm_exposition import Request, VllmExposition

T0 = 1_790_000_000.0
INF = math.inf
BOUNDS = (0.1, 0.5, 1.0, INF)


def hist(*cumulative: float, total: float | None = None) -> Histogram:
    """A histogram over BOUNDS with these cumulative counts (+Inf last)."""
    assert len(cumulative) == len(BOUNDS)
    return Histogram(
        buckets=tuple(zip(BOUNDS, cumulative, strict=True)), count=cumulative[-1], sum=total or 0.0
    )


def reading(t: float, **fields: object) -> ReplicaScrape:
    base: dict[str, object] = {"running": 2.0, "waiting": 0.0, "kv_usage": 0.5, "kv_capacity_tokens": 1000.0}
    base.update(fields)
    return ReplicaScrape(at=T0 + t, **base)  # type: ignore[arg-type]


def signals(window: list[ReplicaScrape], now: float, **kw: float) -> ReplicaSignals:
    params = {"window_s": 60.0, "stale_after_s": 30.0, "frozen_after_s": 120.0} | kw
    return replica_signals("svc/0", window, now=T0 + now, **params)


# -- histogram_quantile: Prometheus's semantics --------------------------------------------------


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        # rank 10 of 20 lands at the top of the first bucket: 0 + 1 × 10/10
        (0.5, [(1.0, 10), (2.0, 20), (INF, 20)], 1.0),
        # rank 15: second bucket holds 10 (10..20), 5 of them: 1 + 1 × 5/10
        (0.75, [(1.0, 10), (2.0, 20), (INF, 20)], 1.5),
        # rank 9 of 10 falls in +Inf: the largest finite bound
        (0.9, [(1.0, 0), (2.0, 5), (INF, 10)], 2.0),
        # rank 0.99: first bucket from 0 to 0.1 holding 1: 0.1 × 0.99
        (0.99, [(0.1, 1), (0.5, 1), (INF, 1)], pytest.approx(0.099)),
        # order does not matter; equal bounds are merged (5 + 5 at 1.0), rank 5 of 10: 0.5
        (0.5, [(INF, 10), (1.0, 5), (1.0, 5)], 0.5),
        # equal bounds merge before counts are made monotonic: (0.5: 8), (1: 5 + 5 = 10), rank 9 of 10
        (0.9, [(0.5, 8), (1.0, 5), (1.0, 5), (INF, 10)], 0.75),
        # non-monotonic counts are raised to the running maximum: (1: 4), (2: 4 not 3), +Inf 8; rank 6 -> +Inf
        (0.75, [(1.0, 4), (2.0, 3), (INF, 8)], 2.0),
        # a first bucket with a non-positive bound answers that bound
        (0.1, [(-1.0, 5), (INF, 10)], -1.0),
        # no observations, no +Inf, a lone +Inf bucket, no buckets: Prometheus's NaN -> None
        (0.5, [(1.0, 0), (INF, 0)], None),
        (0.5, [(1.0, 3), (2.0, 5)], None),
        (0.5, [(INF, 5)], None),
        (0.5, [], None),
        (-0.1, [(1.0, 1), (INF, 1)], -INF),
        (1.1, [(1.0, 1), (INF, 1)], INF),
    ],
)
def test_histogram_quantile(q: float, buckets: list[tuple[float, float]], expected: object) -> None:
    assert histogram_quantile(q, buckets) == expected


# -- counters ----------------------------------------------------------------------------------


def test_counter_rate_counts_a_drop_as_a_restart_from_zero() -> None:
    # 100 -> 200 (+100), restart -> 50 (+50 since 0), -> 150 (+100): 250 over 30 s
    points = [(0.0, 100.0), (10.0, 200.0), (20.0, 50.0), (30.0, 150.0)]
    assert counter_increase(points) == 250.0
    assert counter_rate(points) == pytest.approx(250 / 30)


def test_counter_rate_needs_two_points_and_time_between_them() -> None:
    assert counter_rate([(0.0, 5.0)]) is None
    assert counter_rate([]) is None
    assert counter_rate([(3.0, 5.0), (3.0, 9.0)]) is None
    assert counter_rate([(0.0, 5.0), (10.0, 5.0)]) == 0.0


# -- histograms over a window --------------------------------------------------------------------


def test_histogram_increase_is_newest_minus_oldest() -> None:
    inc = histogram_increase(
        [hist(1, 2, 3, 4, total=1.0), hist(2, 3, 4, 5, total=2.0), hist(5, 10, 12, 14, total=9.0)]
    )
    assert inc == Histogram(buckets=tuple(zip(BOUNDS, (4, 8, 9, 10), strict=True)), count=10, sum=8.0)


def test_histogram_increase_counts_from_zero_after_a_restart() -> None:
    # before: 10 -> 16 observations (+6); restart; the new process has seen 3
    old1, old2 = hist(2, 5, 8, 10, total=5.0), hist(3, 7, 12, 16, total=8.0)
    new = hist(1, 2, 3, 3, total=0.5)
    inc = histogram_increase([old1, old2, new])
    assert inc is not None
    assert [c for _, c in inc.buckets] == [1 + 1, 2 + 2, 4 + 3, 6 + 3]
    assert (inc.count, inc.sum) == (9, 3.5)


def test_histogram_increase_leaves_out_readings_with_another_layout() -> None:
    other = Histogram(buckets=((1.0, 50.0), (INF, 60.0)), count=60.0, sum=10.0)
    inc = histogram_increase([other, hist(0, 0, 0, 0), hist(1, 1, 2, 2)])
    assert inc is not None and inc.count == 2  # the restart after `other` counts the new 2 only


# -- replica_signals -------------------------------------------------------------------------------


def test_fresh_window_gives_gauges_rates_and_quantiles() -> None:
    window = [
        reading(
            0,
            prompt_tokens_total=1000.0,
            generation_tokens_total=5000.0,
            requests_total=10.0,
            ttft=hist(1, 2, 3, 4),
            e2e=hist(0, 0, 1, 1),
        ),
        reading(
            10,
            prompt_tokens_total=1600.0,
            generation_tokens_total=5800.0,
            requests_total=14.0,
            ttft=hist(5, 8, 9, 10),
            e2e=hist(0, 2, 3, 5),
        ),
        reading(
            20,
            running=6.0,
            waiting=3.0,
            kv_usage=0.25,
            prompt_tokens_total=2000.0,
            generation_tokens_total=7000.0,
            requests_total=20.0,
            ttft=hist(11, 14, 15, 16),
            e2e=hist(0, 4, 6, 9),
        ),
    ]
    s = signals(window, now=21)
    assert not s.stale and s.stale_reason == "" and s.stale_since is None
    assert (s.running, s.waiting, s.kv_usage, s.concurrency) == (6.0, 3.0, 0.25, 9.0)
    assert s.kv_tokens_used == 250.0
    assert s.prompt_tokens_per_s == pytest.approx(1000 / 20)
    assert s.generation_tokens_per_s == pytest.approx(2000 / 20)
    assert s.requests_per_s == pytest.approx(10 / 20)
    # TTFT observed in the window: newest - oldest = (11-1, 14-2, 15-3, 16-4) = (10, 12, 12, 12)
    # p50: rank 6 in the first bucket (0..0.1, 10): 0.1 × 6/10
    assert s.ttft_p50_s == pytest.approx(0.06)
    # p90: rank 10.8: second bucket (0.1..0.5) holds 2, 0.8 of them: 0.1 + 0.4 × 0.4
    assert s.ttft_p90_s == pytest.approx(0.26)
    # p99: rank 11.88 -> 0.1 + 0.4 × 1.88/2
    assert s.ttft_p99_s == pytest.approx(0.476)
    # e2e increase (0, 4, 5, 8): p50 rank 4 -> top of (0.1..0.5]: 0.5; p90 rank 7.2 -> +Inf: 1.0
    assert (s.e2e_p50_s, s.e2e_p90_s, s.e2e_p99_s) == (pytest.approx(0.5), 1.0, 1.0)


def test_rates_use_only_readings_inside_the_window() -> None:
    window = [
        reading(0, generation_tokens_total=0.0),
        reading(99, generation_tokens_total=10_000.0),  # outside the 60 s window [100, 160]
        reading(130, generation_tokens_total=10_300.0),
        reading(160, generation_tokens_total=10_900.0),
    ]
    assert signals(window, now=160).generation_tokens_per_s == pytest.approx(600 / 30)


def test_rates_handle_a_restart_inside_the_window() -> None:
    window = [
        reading(0, generation_tokens_total=9000.0, ttft=hist(5, 5, 5, 5)),
        reading(10, generation_tokens_total=9500.0, ttft=hist(6, 7, 7, 7)),
        reading(20, generation_tokens_total=300.0, ttft=hist(0, 1, 1, 1)),  # restarted
        reading(30, generation_tokens_total=800.0, ttft=hist(0, 2, 3, 3)),
    ]
    s = signals(window, now=30)
    assert s.generation_tokens_per_s == pytest.approx((500 + 300 + 500) / 30)
    # TTFT: (1, 2, 2, 2) before the restart + (0, 2, 3, 3) after = (1, 4, 5, 5)
    # p50: rank 2.5 -> 0.1 + 0.4 × 1.5/3
    assert s.ttft_p50_s == pytest.approx(0.3)


def test_unknown_stays_unknown() -> None:
    window = [
        reading(0, kv_capacity_tokens=None, ttft=hist(1, 1, 1, 1)),
        reading(10, kv_capacity_tokens=None, running=None, ttft=hist(1, 1, 1, 1)),
    ]
    s = signals(window, now=10)
    assert s.running is None and s.concurrency is None
    assert s.kv_usage == 0.5 and s.kv_tokens_used is None
    assert s.prompt_tokens_per_s is None and s.generation_tokens_per_s is None and s.requests_per_s is None
    assert s.ttft_p50_s is None  # no observation in the window
    assert s.e2e_p90_s is None  # no histogram at all
    assert not s.stale


def test_a_single_reading_gives_gauges_but_no_rates() -> None:
    s = signals([reading(0, generation_tokens_total=100.0, ttft=hist(1, 1, 1, 1))], now=1)
    assert s.running == 2.0
    assert s.generation_tokens_per_s is None and s.ttft_p50_s is None


def test_failed_readings_are_skipped_for_rates() -> None:
    window = [
        reading(0, generation_tokens_total=0.0),
        failed_scrape(T0 + 10, "timeout after 2s"),
        reading(20, generation_tokens_total=400.0),
    ]
    s = signals(window, now=20)
    assert not s.stale and s.generation_tokens_per_s == pytest.approx(20.0)


def test_an_unsorted_window_is_read_in_time_order() -> None:
    window = [reading(t, generation_tokens_total=10.0 * t, ttft=hist(t, t, t, t)) for t in (0, 10, 20, 30)]
    assert signals(window[::-1], now=30) == signals(window, now=30)


# -- staleness ---------------------------------------------------------------------------------


def test_no_readings_is_stale_with_nothing_known() -> None:
    s = signals([], now=0)
    assert s.stale and s.stale_reason == "no readings yet" and s.stale_since is None
    assert s.running is None and s.generation_tokens_per_s is None


def test_a_failed_newest_reading_makes_it_stale_since_the_first_failure_in_a_row() -> None:
    window = [
        reading(0, running=4.0),
        failed_scrape(T0 + 5, "connection refused"),
        reading(10, running=5.0),
        failed_scrape(T0 + 15, "timeout after 2s"),
        failed_scrape(T0 + 20, "HTTP 500 Internal Server Error"),
    ]
    s = signals(window, now=20)
    assert s.stale
    assert s.stale_reason == "scrape failed: HTTP 500 Internal Server Error (2 failures in a row)"
    assert s.stale_since == T0 + 15
    assert s.running == 5.0  # the last known value, flagged stale


def test_only_failures_is_stale_with_no_values() -> None:
    s = signals([failed_scrape(T0, "connection refused")], now=1)
    assert (s.stale, s.stale_reason, s.stale_since, s.running) == (
        True,
        "scrape failed: connection refused",
        T0,
        None,
    )


def test_an_old_newest_reading_makes_it_stale() -> None:
    s = signals([reading(0), reading(10)], now=45, stale_after_s=30)
    assert s.stale
    assert s.stale_reason == "no successful scrape for 35s (limit 30s)"
    assert s.stale_since == T0 + 10 + 30
    assert not signals([reading(0), reading(10)], now=40, stale_after_s=30).stale


def frozen_window(seconds: int, step: int = 10, **fields: object) -> list[ReplicaScrape]:
    base = {
        "running": 3.0,
        "waiting": 1.0,
        "prompt_tokens_total": 500.0,
        "generation_tokens_total": 900.0,
        "requests_total": 7.0,
        "ttft": hist(1, 2, 3, 4),
    } | fields
    return [reading(t, **base) for t in range(0, seconds + 1, step)]


def test_gauges_frozen_with_requests_in_flight_make_it_stale() -> None:
    window = [reading(-10, running=1.0, generation_tokens_total=800.0), *frozen_window(130)]
    s = signals(window, now=130, window_s=60)
    assert s.stale
    assert s.stale_reason == (
        "gauges frozen: 3 running, 1 waiting, and no counter moved for 130s"
        " (vLLM gauges can stick after aborts)"
    )
    assert s.stale_since == T0 + 0 + 120
    assert s.running == 3.0


@pytest.mark.parametrize(
    ("window", "why"),
    [
        (frozen_window(110), "not yet frozen for 120 s"),
        (frozen_window(130, running=0.0, waiting=0.0), "idle: nothing in flight"),
        (
            frozen_window(130, prompt_tokens_total=None, generation_tokens_total=None, requests_total=None),
            "no counter to prove it",
        ),
        (
            [
                *frozen_window(120)[:-1],
                reading(
                    120,
                    running=3.0,
                    waiting=1.0,
                    prompt_tokens_total=500.0,
                    generation_tokens_total=901.0,
                    requests_total=7.0,
                    ttft=hist(1, 2, 3, 4),
                ),
            ],
            "a counter moved",
        ),
    ],
)
def test_not_frozen(window: list[ReplicaScrape], why: str) -> None:
    assert not signals(window, now=window[-1].at - T0).stale, why


def test_waiting_only_still_counts_as_in_flight() -> None:
    s = signals(frozen_window(130, running=0.0, waiting=4.0), now=130)
    assert s.stale and s.stale_reason.startswith("gauges frozen: 0 running, 4 waiting")


# -- from real texts ---------------------------------------------------------------------------------


def test_signals_from_texts_across_a_server_restart() -> None:
    """Readings parsed from vLLM-like texts: 2 engines, a restart between the 2nd and 3rd."""

    def req(ttft: float) -> Request:
        return Request(ttft=ttft, e2e=1.0, itl=[0.02] * 9, prompt_tokens=100, generation_tokens=10)

    server = VllmExposition(runtime_collectors=False)
    server.set_load(1, 0, 0.5, engine=0)
    texts = [server.render()]
    server.finish([req(0.03)] * 4, engine=0)
    server.finish([req(0.03)] * 2, engine=1)
    texts.append(server.render())
    restarted = VllmExposition(runtime_collectors=False)
    restarted.set_load(2, 0, 0.5, engine=1)
    restarted.finish([req(0.7)] * 3, engine=1)
    texts.append(restarted.render())
    window = [parse_vllm_metrics(text, at=T0 + 10 * i) for i, text in enumerate(texts)]
    assert all(r.ok for r in window)
    s = signals(window, now=20)
    # 6 requests before the restart, 3 after: 9 requests, 90 generation tokens, 900 prompt tokens in 20 s
    assert s.requests_per_s == pytest.approx(9 / 20)
    assert s.generation_tokens_per_s == pytest.approx(90 / 20)
    assert s.prompt_tokens_per_s == pytest.approx(900 / 20)
    # TTFT: six at 0.03 (bucket 0.02..0.04), three at 0.7 (0.5..0.75). p50 rank 4.5 -> 0.02 + 0.02 × 4.5/6
    assert s.ttft_p50_s == pytest.approx(0.035)
    # p90 rank 8.1 -> 0.5 + 0.25 × 2.1/3
    assert s.ttft_p90_s == pytest.approx(0.675)
    # KV: engine 0 idle (0.0), engine 1 at 0.5: mean 0.25 of 2 × 2048 blocks × 16 tokens
    assert s.running == 2.0 and s.kv_usage == 0.25 and s.kv_tokens_used == pytest.approx(0.25 * 2 * 2048 * 16)


# -- service_totals ---------------------------------------------------------------------------------


def rs(name: str, **fields: object) -> ReplicaSignals:
    return replace(ReplicaSignals(replica=name, at=T0), **fields)  # type: ignore[arg-type]


def test_service_totals_sum_known_values_and_max_ttft() -> None:
    service = ServiceSignals(
        service="svc",
        at=T0,
        replicas=(
            rs("a", running=3.0, waiting=1.0, generation_tokens_per_s=100.0, ttft_p90_s=0.2),
            rs("b", running=5.0, waiting=0.0, generation_tokens_per_s=50.5, ttft_p90_s=None),
            rs("c", running=0.0, waiting=2.0, generation_tokens_per_s=0.0, ttft_p90_s=0.9, stale=True),
        ),
    )
    totals = service_totals(service)
    assert (totals.replicas, totals.stale) == (3, 1)
    assert (totals.running, totals.waiting, totals.concurrency) == (8.0, 3.0, 11.0)
    assert totals.generation_tokens_per_s == 150.5
    assert totals.ttft_p90_s_max == 0.9


def test_service_totals_are_unknown_when_any_replica_is() -> None:
    service = ServiceSignals(
        service="svc", at=T0, replicas=(rs("a", running=3.0, waiting=1.0), rs("b", running=None, waiting=0.0))
    )
    totals = service_totals(service)
    assert totals.running is None and totals.concurrency is None
    assert totals.waiting == 1.0
    assert totals.generation_tokens_per_s is None and totals.ttft_p90_s_max is None


def test_service_totals_of_no_replicas_are_unknown() -> None:
    totals = service_totals(ServiceSignals(service="svc", at=T0, source_error="Prometheus down"))
    assert (totals.replicas, totals.stale, totals.running, totals.ttft_p90_s_max) == (0, 0, None, None)
