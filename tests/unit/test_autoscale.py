"""Stories for policy.autoscale.decide_scale: ramp, drop, stabilisation, band, clamps, guards.

Every story is a table of ticks with explicit (fake clock) times; the scale state is threaded
from one tick to the next exactly as `control.inference` does.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtide.config import ConfigError, load_settings, service_spec
from lowtide.domain.metrics import ReplicaSignals, ServiceSignals
from lowtide.domain.services import AutoscaleTargets, ServiceSpec
from lowtide.policy.autoscale import (
    ReplicaSupply,
    ScaleDecision,
    ScaleState,
    decide_scale,
    initial_state,
    next_decision_at,
)

# -- builders -----------------------------------------------------------------------------------


def spec(
    *,
    min_replicas: int = 1,
    max_replicas: int = 10,
    headroom: int = 0,
    concurrency: float | None = 32.0,
    kv: float | None = None,
    tokens: float | None = None,
    ttft_slo: float | None = None,
    up_window: float = 30.0,
    down_window: float = 300.0,
    tolerance: float = 0.1,
    up_rate: float | None = None,
    **more: Any,
) -> ServiceSpec:
    """A service; the stories before the step cap existed run without it (`up_rate=None`) so
    that they keep testing what they were written for; the cap's own stories set it."""
    return ServiceSpec(
        name="llama",
        model="llama-3-8b",
        gpus_per_replica=4,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        headroom_replicas=headroom,
        autoscale=AutoscaleTargets(
            concurrency_per_replica=concurrency,
            kv_usage=kv,
            generation_tokens_per_s_per_replica=tokens,
            ttft_p90_slo_s=ttft_slo,
            scale_up_window_s=up_window,
            scale_down_stabilization_s=down_window,
            tolerance=tolerance,
            max_scale_up_rate=up_rate,
            **more,
        ),
    )


def rep(
    name: str = "r0",
    *,
    running: float | None = 0.0,
    waiting: float | None = 0.0,
    kv: float | None = None,
    tokens: float | None = None,
    ttft: float | None = None,
    stale: bool = False,
) -> ReplicaSignals:
    return ReplicaSignals(
        replica=name,
        at=0.0,
        running=running,
        waiting=waiting,
        kv_usage=kv,
        generation_tokens_per_s=tokens,
        ttft_p90_s=ttft,
        stale=stale,
        stale_reason="scrape failed: timeout" if stale else "",
    )


def load(*replicas: ReplicaSignals, error: str | None = None) -> ServiceSignals:
    return ServiceSignals(service="llama", at=0.0, replicas=tuple(replicas), source_error=error)


def conc(*per_replica: float) -> ServiceSignals:
    """Replicas with this many requests running each (none waiting)."""
    return load(*(rep(f"r{i}", running=c) for i, c in enumerate(per_replica)))


def supply(serving: int, starting: int = 0, waking: int = 0) -> ReplicaSupply:
    return ReplicaSupply(serving=serving, starting=starting, waking=waking)


Tick = tuple[float, ServiceSignals, ReplicaSupply]


def run(s: ServiceSpec, ticks: Sequence[Tick], state: ScaleState | None = None) -> list[ScaleDecision]:
    state = state or initial_state(s)
    out = []
    for now, signals, sup in ticks:
        d = decide_scale(s, signals, sup, state, now)
        state = d.state
        out.append(d)
    return out


def desired(decisions: Sequence[ScaleDecision]) -> list[int]:
    return [d.desired for d in decisions]


# -- each signal's arithmetic -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("targets", "signals", "expected"),
    [
        # concurrency = ⌈Σ(running + waiting) / per replica⌉
        ({"concurrency": 32.0}, load(rep(running=150, waiting=60)), {"concurrency": 7}),
        ({"concurrency": 32.0}, conc(32, 32), {"concurrency": 2}),  # exactly 2, not 3
        ({"concurrency": 32.0}, conc(32, 33), {"concurrency": 3}),
        ({"concurrency": 32.0}, conc(0, 0), {"concurrency": 0}),
        # KV = ⌈Σ usage / target⌉ (Σ of 0..1 usage = replicas' worth)
        (
            {"concurrency": None, "kv": 0.8},
            load(rep("a", kv=0.8), rep("b", kv=0.8), rep("c", kv=0.8)),
            {"kv": 3},
        ),
        (
            {"concurrency": None, "kv": 0.8},
            load(rep("a", kv=0.9), rep("b", kv=0.9), rep("c", kv=0.68)),
            {"kv": 4},
        ),
        # tokens = ⌈Σ generation tokens/s / (capacity × utilization)⌉
        ({"concurrency": None, "tokens": 1000.0}, load(rep(tokens=5200)), {"tokens": 7}),
        (
            {"concurrency": None, "tokens": 1000.0},
            load(rep("a", tokens=800), rep("b", tokens=800)),
            {"tokens": 2},
        ),
        # all three: each reported
        (
            {"concurrency": 32.0, "kv": 0.8, "tokens": 1000.0},
            load(rep("a", running=40, kv=0.5, tokens=100), rep("b", running=40, kv=0.5, tokens=100)),
            {"concurrency": 3, "kv": 2, "tokens": 1},
        ),
    ],
)
def test_each_signal_asks_for_ceil_of_total_over_target(
    targets: dict[str, float | None], signals: ServiceSignals, expected: dict[str, int]
) -> None:
    s = spec(**targets, min_replicas=0)  # type: ignore[arg-type]
    d = decide_scale(s, signals, supply(0), initial_state(s), 0.0)
    assert dict(d.per_signal) == expected
    assert d.recommendation == max(expected.values())


def test_the_reason_names_every_signal_and_the_move() -> None:
    s = spec(kv=0.8, max_replicas=20)
    signals = load(
        rep("a", running=100, waiting=5, kv=0.8),
        rep("b", running=100, waiting=5, kv=0.9),
        rep("c", running=0, waiting=0, kv=0.78),
    )
    d = decide_scale(s, signals, supply(3), initial_state(s), 0.0)
    assert d.reason == (
        "concurrency 210 over target 32/replica → 7; "
        "KV 2.48 over target 0.8/replica = 3.1 replicas' worth → 4; "
        "panic: 7 over 3s ≥ 2 × 3 serving; → 7 (scale-up)"
    )
    assert (d.desired, d.needed, d.recommendation, d.unknown, d.guard) == (7, 7, 7, False, None)


# -- ramp and drop ------------------------------------------------------------------------------


def test_a_ramp_scales_up_once_the_panic_window_saw_it_tick_by_tick() -> None:
    decisions = run(
        spec(),
        [
            (0, conc(30, 30), supply(2)),  # 60 → 2
            (10, conc(100, 110), supply(2)),  # 210 → 7: one reading, the panic window (3 s) saw 2
            (20, conc(60, 60, 60, 60, 60, 60, 60), supply(2, starting=5)),  # 7 over 3 s: panic
            (30, conc(50, 50, 50, 50, 50, 50, 50), supply(7, starting=3)),  # 350 → 11 → max 10
        ],
    )
    assert desired(decisions) == [2, 2, 7, 10]
    assert decisions[1].reason == (
        "concurrency 210 over target 32/replica → 7; → 2 (scale-up waits: 30s sustained (lowest 2))"
    )
    assert decisions[2].reason == (
        "concurrency 420 over target 32/replica → 14; panic: 7 over 3s ≥ 2 × 2 serving; → 7 (scale-up)"
    )
    assert decisions[3].reason.endswith("panic for 20s more (no scale-down); → 10 (scale-up)")


def test_a_drop_waits_for_stabilisation_then_goes_to_the_window_max() -> None:
    ticks: list[Tick] = [
        (0, conc(105, 105), supply(2)),  # 210 → 7
        (10, conc(20, 20, 20, 20, 20, 20, 20), supply(7)),  # 140 → 5 (outside the ±10 % band)
        (100, conc(20, 20, 20, 20, 20, 20, 20), supply(7)),
        (300, conc(8, 8, 8, 8, 8, 8, 8), supply(7)),  # 56 → 2, but 7 (t=0) is still in the window
        (305, conc(8, 8, 8, 8, 8, 8, 8), supply(7)),  # t=0 has left [5, 305]: the max is 5 (t=10…100)
        (399, conc(8, 8, 8, 8, 8, 8, 8), supply(5)),  # 5 (t=100) still in [99, 399]
        (401, conc(8, 8, 8, 8, 8, 8, 8), supply(5)),  # only 2s left in [101, 401]
    ]
    decisions = run(spec(), ticks)
    assert desired(decisions) == [7, 7, 7, 7, 5, 5, 2]
    assert [d.recommendation for d in decisions] == [7, 5, 5, 2, 2, 2, 2]
    # t=0 was a panic (7 ≥ 2 × 2 serving): no scale-down for a stable window after it
    assert decisions[1].reason.endswith("panic for 20s more (no scale-down); → 7 (no scale-down: panic)")
    assert decisions[2].reason.endswith("→ 7 (scale-down waits: 7 within the last 300s)")
    assert decisions[4].reason.endswith("→ 5 (scale-down to the highest of the last 300s)")


def test_the_stabilisation_window_includes_its_start() -> None:
    decisions = run(spec(), [(0, conc(210), supply(1)), (1, conc(0), supply(7)), (300, conc(0), supply(7))])
    assert desired(decisions) == [7, 7, 7]  # the t=0 recommendation is exactly 300s old: still counts
    later = decide_scale(spec(), conc(0), supply(7), decisions[-1].state, 301.0)
    assert later.desired == 1


def test_a_spike_within_the_up_window_is_kept_until_the_down_window_lets_go() -> None:
    decisions = run(
        spec(up_window=30, down_window=60),
        [
            (0, conc(300), supply(1)),
            (5, conc(30), supply(10)),
            (40, conc(30), supply(10)),
            (61, conc(30), supply(10)),
        ],
    )
    assert desired(decisions) == [10, 10, 10, 1]


def test_history_keeps_only_the_longest_window() -> None:
    decisions = run(
        spec(up_window=30, down_window=100), [(t, conc(40), supply(2)) for t in range(0, 1000, 10)]
    )
    times = [at for at, _ in decisions[-1].state.history]
    assert min(times) >= 990 - 100
    assert times == sorted(times)


# -- tolerance band -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("per_replica_load", "expected", "why"),
    [
        (32 * 10, 10, "exactly the supply"),
        (32 * 11, 10, "11 is within ±10 % of 10: keep 10"),
        (32 * 9, 10, "9 is within ±10 % of 10: keep 10 (not even a pending scale-down)"),
        (32 * 12, 12, "12 is outside the band: scale up"),
        (32 * 8, 10, "8 is outside the band, but a scale-down waits for stabilisation"),
    ],
)
def test_small_changes_within_the_tolerance_band_keep_the_current_supply(
    per_replica_load: float, expected: int, why: str
) -> None:
    s = spec(max_replicas=20)
    d = decide_scale(s, conc(per_replica_load), supply(10), initial_state(s), 0.0)
    assert d.desired == expected, why
    inside = per_replica_load in (32 * 11, 32 * 9)
    assert any(f"within {sign}10 % of 10: keep 10" in d.reason for sign in "+−") == inside


def test_the_band_is_around_the_supply_less_headroom() -> None:
    # 11 replicas are there, 1 of them headroom: the load sees 10; 11 recommended is within the band.
    s = spec(max_replicas=20, headroom=1)
    d = decide_scale(s, conc(32 * 11), supply(11), initial_state(s), 0.0)
    assert (d.needed, d.desired) == (10, 11)


def test_the_band_counts_starting_and_waking_replicas() -> None:
    s = spec(max_replicas=20)
    d = decide_scale(s, conc(32 * 10 + 10), supply(2, starting=6, waking=2), initial_state(s), 0.0)
    assert d.per_signal["concurrency"] == 11
    assert d.desired == 10


# -- clamps and headroom ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "total_load", "needed", "desired_"),
    [
        ({"min_replicas": 2}, 0, 2, 2),  # never below min
        ({"min_replicas": 0}, 0, 0, 0),  # scale to zero when allowed
        ({"max_replicas": 4}, 1000, 4, 4),  # never above max
        ({"headroom": 2}, 96, 3, 5),  # 3 needed + 2 headroom
        ({"headroom": 2, "max_replicas": 4}, 96, 3, 4),  # headroom never goes past max
        ({"headroom": 1, "min_replicas": 2}, 0, 2, 3),  # headroom on top of min
    ],
)
def test_min_max_and_headroom(kw: dict[str, int], total_load: float, needed: int, desired_: int) -> None:
    s = spec(**kw)
    d = decide_scale(s, conc(total_load), supply(0), initial_state(s), 0.0)
    assert (d.needed, d.desired) == (needed, desired_)


def test_min_above_max_keeps_the_larger_instead_of_crashing() -> None:
    s = spec(min_replicas=3, max_replicas=2)
    d = decide_scale(s, conc(0), supply(3), initial_state(s), 0.0)
    assert d.desired == 3
    assert d.reason.startswith("min_replicas 3 > max_replicas 2: using 3")


# -- supply in flight and the TTFT guard ---------------------------------------------------------


def test_starting_and_waking_replicas_count_as_supply_so_cold_starts_never_cascade() -> None:
    s = spec(ttft_slo=1.0)
    hot = [rep("a", running=40, ttft=3.0), rep("b", running=40, ttft=3.0), rep("c", running=40, ttft=3.0)]
    decisions = run(
        s,
        [
            (0, load(*hot), supply(3)),  # TTFT over SLO: one more than serve now
            (10, load(*hot), supply(3, starting=1)),  # it is starting: no second one
            (60, load(*hot), supply(3, starting=1)),
            (100, load(*hot), supply(3, waking=1)),
            (130, load(*hot, rep("d", running=0, ttft=3.0)), supply(4)),  # it serves, still slow: one more
            (160, load(*hot, rep("d", running=0, ttft=3.0)), supply(4)),  # ... once a stable window saw it
        ],
    )
    assert desired(decisions) == [4, 4, 4, 4, 4, 5]
    assert decisions[0].guard == "TTFT p90 3s over SLO 1s: at least 4 replicas, no scale-down"


def test_ttft_guard_blocks_scale_down_beyond_stabilisation() -> None:
    s = spec(ttft_slo=1.0)
    slow = load(rep("a", running=1, ttft=1.5), rep("b", running=1, ttft=0.2))
    quick = load(rep("a", running=1, ttft=0.3), rep("b", running=1, ttft=0.2))
    decisions = run(
        s,
        [
            (0, conc(100, 100, 100, 100), supply(4)),  # 400 → 13 → max 10
            (10, slow, supply(10)),  # 2 requests, but TTFT over SLO: 11 → max 10, no scale-down
            (400, slow, supply(10)),
            (410, quick, supply(10)),  # guard off; the guarded recommendations are in the window
            (711, quick, supply(10)),  # the guard's last tick (400) left the window
        ],
    )
    assert desired(decisions) == [10, 10, 10, 10, 1]
    assert decisions[2].guard is not None and decisions[2].reason.endswith(
        "(steady, capped at max_replicas 10)"
    )
    assert decisions[3].guard is None


def test_ttft_only_from_fresh_replicas_and_only_when_configured() -> None:
    stale_slow = load(rep("a", running=32), rep("b", running=32, ttft=9.0, stale=True))
    s = spec(ttft_slo=1.0)
    assert (
        decide_scale(s, stale_slow, supply(2), initial_state(s), 0).guard
        == "1 of 2 replicas stale: no scale-down"
    )
    no_slo = spec()
    slow = load(rep("a", running=32, ttft=9.0), rep("b", running=32, ttft=9.0))
    d = decide_scale(no_slo, slow, supply(2), initial_state(no_slo), 0)
    assert (d.desired, d.guard) == (2, None)


# -- unknown and stale data ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("signals", "why"),
    [
        (load(), "no fresh data (no replica reports) → hold 6"),
        (
            load(rep("a", running=1000, stale=True)),
            "no fresh data (1 of 1 replicas stale: scrape failed: timeout) → hold 6",
        ),
        (
            load(rep("a", running=30), error="connection refused"),
            "no fresh data (source failed: connection refused) → hold 6",
        ),
        (
            load(rep("a", running=None, waiting=None)),
            "no fresh data (no signal known on every fresh replica) → hold 6",
        ),
    ],
)
def test_unknown_data_holds_the_previous_desired(signals: ServiceSignals, why: str) -> None:
    s = spec()
    before = run(s, [(0, conc(190), supply(1))])[-1]
    assert before.desired == 6
    d = decide_scale(s, signals, supply(6), before.state, 10.0)
    assert (d.unknown, d.recommendation, d.desired, d.needed, d.reason) == (True, None, 6, 6, why)


def test_unknown_data_never_scales_down_even_for_long_and_data_back_waits_a_full_window() -> None:
    s = spec()
    ticks: list[Tick] = [(0, conc(190), supply(1))]
    ticks += [(t, load(), supply(6)) for t in range(10, 3600, 10)]  # an hour with no data (last: 3590)
    ticks += [(3600, conc(10), supply(6)), (3890, conc(10), supply(6)), (3891, conc(10), supply(6))]
    decisions = run(s, ticks)
    assert all(d.desired == 6 for d in decisions[:-1])
    assert all(d.unknown for d in decisions[1:-3])
    assert decisions[-1].desired == 1  # the last unknown tick (3590) has left the 300s window


def test_unknown_data_never_goes_below_min() -> None:
    s = spec(min_replicas=3)
    d = decide_scale(s, load(), supply(0), initial_state(s), 0.0)
    assert (d.unknown, d.desired) == (True, 3)


def test_the_first_decision_starts_from_what_exists() -> None:
    # After a control-plane restart with 6 replicas up: unknown holds 6, low load waits a window.
    s = spec()
    assert decide_scale(s, load(), supply(6), initial_state(s), 0.0).desired == 6
    decisions = run(s, [(0, conc(10), supply(6)), (299, conc(10), supply(6)), (301, conc(10), supply(6))])
    assert desired(decisions) == [6, 6, 1]


def test_stale_replicas_do_not_count_as_load_and_block_scale_down() -> None:
    s = spec()
    signals = load(rep("a", running=64), rep("b", running=64), rep("c", running=5000, stale=True))
    decisions = run(s, [(0, signals, supply(3)), (600, signals, supply(3))])
    # 128 from the fresh two → 4 (the stale replica's 5000 would be 157), held at 4 while one is stale
    assert decisions[0].per_signal == {"concurrency": 4}
    assert desired(decisions) == [4, 4]
    assert decisions[1].guard == "1 of 3 replicas stale: no scale-down"
    low = load(rep("a", running=1), rep("b", running=1), rep("c", running=5000, stale=True))
    held = decide_scale(s, low, supply(4), decisions[-1].state, 1000.0)
    assert held.desired == 4


def test_a_signal_a_fresh_replica_does_not_know_is_unknown_and_the_others_decide() -> None:
    s = spec(kv=0.8)
    signals = load(rep("a", running=300, kv=0.5), rep("b", running=None, waiting=None, kv=0.5))
    d = decide_scale(s, signals, supply(2), initial_state(s), 0.0)
    assert d.per_signal == {"concurrency": None, "kv": 2}
    assert d.reason.startswith("concurrency unknown; KV 1 over target 0.8/replica = 1.25 replicas' worth → 2")
    assert (d.unknown, d.desired) == (False, 2)


# -- contract -----------------------------------------------------------------------------------


def test_inputs_are_not_mutated_and_the_decision_is_deterministic() -> None:
    s = spec(kv=0.8, ttft_slo=1.0, headroom=1)
    signals = load(rep("a", running=50, kv=0.7, ttft=2.0), rep("b", running=5, kv=0.1, stale=True))
    sup = supply(2, starting=1)
    state = run(s, [(0, conc(40, 40), supply(2)), (10, conc(40, 40), supply(3))])[-1].state
    copies = copy.deepcopy((s, signals, sup, state))
    first = decide_scale(s, signals, sup, state, 20.0)
    second = decide_scale(s, signals, sup, state, 20.0)
    assert (s, signals, sup, state) == copies
    assert first == second


def test_a_state_of_another_service_is_refused() -> None:
    s = spec()
    with pytest.raises(ValueError, match="scale state of 'other'"):
        decide_scale(s, conc(1), supply(1), ScaleState(service="other"), 0.0)


def test_negative_supply_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be negative"):
        ReplicaSupply(serving=-1)


# -- properties ---------------------------------------------------------------------------------

_replica = st.builds(
    rep,
    running=st.one_of(st.none(), st.floats(0, 500)),
    waiting=st.floats(0, 500),
    kv=st.one_of(st.none(), st.floats(0, 1)),
    tokens=st.one_of(st.none(), st.floats(0, 20000)),
    ttft=st.one_of(st.none(), st.floats(0, 10)),
    stale=st.booleans(),
)
_tick = st.tuples(
    st.floats(0, 400),  # time step
    st.lists(_replica, max_size=6),
    st.booleans(),  # source error
    st.integers(0, 12),
    st.integers(0, 3),
    st.integers(0, 3),
)


@settings(max_examples=200, deadline=None)
@given(
    lo=st.integers(0, 5),
    span=st.integers(0, 8),
    headroom=st.integers(0, 3),
    ticks=st.lists(_tick, min_size=1, max_size=25),
)
def test_desired_always_within_min_and_max(
    lo: int, span: int, headroom: int, ticks: list[tuple[float, list[ReplicaSignals], bool, int, int, int]]
) -> None:
    s = spec(min_replicas=lo, max_replicas=lo + span, headroom=headroom, kv=0.8, tokens=1000.0, ttft_slo=1.0)
    state, now = initial_state(s), 0.0
    for step, replicas, error, serving, starting, waking in ticks:
        now += step
        signals = load(*replicas, error="down" if error else None)
        d = decide_scale(s, signals, supply(serving, starting, waking), state, now)
        assert s.min_replicas <= d.needed <= d.desired <= s.max_replicas
        assert d.desired == min(s.max_replicas, d.needed + headroom)
        if d.unknown:
            assert d.recommendation is None
            if state.desired is not None:
                assert d.desired == state.desired
        keep = max(s.autoscale.scale_up_window_s, s.autoscale.scale_down_stabilization_s)
        assert all(at >= now - keep for at, _ in d.state.history)
        state = d.state


# -- flapping -----------------------------------------------------------------------------------


def test_a_scale_down_that_had_to_be_undone_is_not_repeated_until_the_load_falls_clearly() -> None:
    """Batching makes a replica's load grow faster than linearly when one is removed: 95 requests
    on 4 replicas ask for 3, but on 3 replicas the same traffic is 110 requests, which asks for
    4. Found by the simulator: without a guard this flapped (and preempted research) every window."""
    s = spec(down_window=300.0)
    four = conc(23.75, 23.75, 23.75, 23.75)  # 95 → 3 replicas' worth (2.97)
    three = conc(36.6, 36.6, 36.6)  # 110 → 4
    ticks: list[Tick] = [(0.0, four, supply(4)), (301.0, four, supply(4))]
    d = run(s, ticks)
    assert desired(d) == [4, 3]  # the first scale-down is allowed: nothing says it is wrong yet
    state = d[-1].state
    d = run(s, [(310.0, three, supply(3)), (341.0, three, supply(3))], state)
    assert desired(d) == [3, 4]  # undone once the stable window (30 s) saw it
    assert d[-1].state.flap_guard is not None and d[-1].state.flap_guard[0] == 4
    later = [(341.0 + 400.0 * k, four, supply(4)) for k in range(1, 4)]
    d2 = run(s, later, d[-1].state)
    assert desired(d2) == [4, 4, 4]
    assert d2[-1].guard is not None and "flap guard" in d2[-1].guard
    # The load falls below 95 × 0.9 = 85.5 requests: going down is allowed again.
    lower = conc(20.0, 20.0, 20.0, 20.0)  # 80 → 2.5 replicas' worth → 3
    d3 = run(s, [(2000.0, lower, supply(4)), (2400.0, lower, supply(4))], d2[-1].state)
    assert desired(d3)[-1] == 3 and d3[-1].state.flap_guard is None


# -- a steadier scale-up: stable and panic windows, the step cap (issue 9, defect 5) -------------


def steady(s: ServiceSpec, until: float, per_replica: float = 10.0, dt: float = 2.0) -> list[Tick]:
    """One serving replica under a light load, a tick every `dt` seconds up to `until`."""
    return [(t * dt, conc(per_replica), supply(1)) for t in range(int(until / dt) + 1)]


def production(**kw: Any) -> ServiceSpec:
    """The production defaults (step cap ×2 or +1, panic at 2×, 3 s panic window, 30 s stable)."""
    return spec(up_rate=AutoscaleTargets().max_scale_up_rate, **kw)


def test_a_single_2s_reading_does_not_move_a_steady_service() -> None:
    # The story: one 2 s reading of many requests on one replica (target 32). A tick
    # every 2 s: the reading is in force for less than the 3 s panic window and the stable window.
    s = production()
    ticks = [*steady(s, 60), (62.0, conc(256), supply(1)), *[(t, conc(10), supply(1)) for t in (64.0, 66.0)]]
    decisions = run(s, ticks)
    assert decisions[-3].recommendation == 8  # the reading asked for 8
    assert max(desired(decisions)) == 1


SPIKE = [(t, conc(256), supply(1)) for t in (62.0, 64.0, 66.0)]  # 4 s of readings of 256 → 8


def test_a_spike_that_fills_the_panic_window_goes_at_most_to_the_step_cap() -> None:
    # 256 requests (→ 8) in force for 4 s: the panic window (3 s) saw it whole, but one step up
    # from 1 replica goes to max(⌈1 × 2⌉, 1 + 1) = 2, and the spike is gone before the next step.
    s = production()
    ticks = [*steady(s, 60), *SPIKE, *[(float(t), conc(5, 5), supply(2)) for t in range(68, 200, 2)]]
    decisions = run(s, ticks)
    assert max(desired(decisions)) == 2
    up = decisions[len(steady(s, 60)) + 2]
    assert up.desired == 2 and up.reason.endswith("→ 2 (scale-up, step cap 2 (ask 8))"), up.reason


def test_without_a_cap_the_same_spike_takes_every_replica_it_asks_for() -> None:
    s = spec(up_rate=None)  # the step cap off: the old behaviour for this spike
    assert desired(run(s, [*steady(s, 60), *SPIKE]))[-1] == 8


def test_a_sustained_surge_reaches_the_needed_count_one_doubling_per_stable_window() -> None:
    s = production(max_replicas=10)
    ticks = steady(s, 20)
    serving = 1
    out: list[int] = []
    state = initial_state(s)
    for t, sig, sup in ticks:
        d = decide_scale(s, sig, sup, state, t)
        state = d.state
    # From t=22: 256 requests, served by as many replicas as were decided (they start at once).
    for k in range(1, 60):
        t = 20.0 + 2 * k
        d = decide_scale(s, conc(*([256 / serving] * serving)), supply(serving), state, t)
        state, serving = d.state, d.desired
        out.append(d.desired)
    first = {n: 22 + 2 * out.index(n) for n in sorted(set(out))}
    assert sorted(first) == [1, 2, 4, 8]  # ×2 per step: 1 → 2 → 4 → 8, never a jump
    assert first[2] == 26 and first[4] - first[2] <= 32 and first[8] - first[4] <= 32
    assert out[-1] == 8  # within a few stable windows (30 s) the needed count is reached


def test_panic_needs_twice_the_serving_replicas_else_the_stable_window_decides() -> None:
    s = production(max_replicas=10)
    # 4 serving; 7 asked (< 2 × 4): no panic, the stable window (30 s) must see it whole.
    ticks = [(float(t), conc(32, 32, 32, 32), supply(4)) for t in range(0, 40, 2)]
    ticks += [(float(t), conc(56, 56, 56, 56), supply(4)) for t in range(40, 80, 2)]
    decisions = run(s, ticks)
    by_time = {t: d.desired for (t, _, _), d in zip(ticks, decisions, strict=True)}
    assert by_time[68.0] == 4 and by_time[70.0] == 7  # 40 + 30 s sustained
    assert all(d.state.panic_at is None for d in decisions)
    # 8 asked (= 2 × 4): panic, up at the second reading (the panic window saw it whole).
    ticks = [(float(t), conc(32, 32, 32, 32), supply(4)) for t in range(0, 40, 2)]
    ticks += [(float(t), conc(64, 64, 64, 64), supply(4)) for t in range(40, 50, 2)]
    decisions = run(s, ticks)
    assert [d.desired for d in decisions[20:24]] == [4, 4, 8, 8]  # in force for 4 s ≥ 3 s
    assert "panic: 8 over 3s ≥ 2 × 4 serving" in decisions[22].reason


def test_no_scale_down_while_panicking_and_the_panic_lasts_a_stable_window() -> None:
    s = production(down_window=10.0)  # a short stabilisation so only the panic holds the count
    ticks = [*steady(s, 20), *[(t, conc(64), supply(1)) for t in (22.0, 24.0, 26.0)]]  # 64 → 2
    ticks += [(t, conc(5, 5), supply(2)) for t in (28.0, 40.0, 55.0, 56.0, 58.0)]
    decisions = run(s, ticks)
    assert desired(decisions)[-8:] == [1, 1, 2, 2, 2, 2, 1, 1]
    assert decisions[-3].reason.endswith("→ 2 (no scale-down: panic)"), decisions[-3].reason
    assert decisions[-3].state.panic_at == 26.0
    assert decisions[-2].state.panic_at is None  # 26 + 30 s: the stable window decides again


def test_next_decision_at_names_the_end_of_the_panic_and_of_the_waiting_scale_up() -> None:
    s = production(down_window=10.0)
    ticks = [*steady(s, 20), *[(t, conc(64), supply(1)) for t in (22.0, 24.0, 26.0)]]
    ticks += [(28.0, conc(5, 5), supply(2))]
    d = run(s, ticks)[-1]
    assert d.desired == 2 and next_decision_at(d, s) == 26.0 + 30.0  # the panic's end
    # A moderate surge on 4 replicas waits for the stable window: the decision says when.
    s = production(max_replicas=10)
    ticks = [(float(t), conc(32, 32, 32, 32), supply(4)) for t in range(0, 40, 2)]
    ticks += [(40.0, conc(56, 56, 56, 56), supply(4))]
    d = run(s, ticks)[-1]
    assert d.desired == 4 and next_decision_at(d, s) == 40.0 + 3.0  # the panic window's end first
    later = decide_scale(s, conc(56, 56, 56, 56), supply(4), d.state, 43.0)
    assert later.desired == 4 and next_decision_at(later, s) == 70.0  # then the stable window's
    assert decide_scale(s, conc(56, 56, 56, 56), supply(4), later.state, 70.0).desired == 7


def test_separate_up_and_down_tolerances() -> None:
    s = spec(max_replicas=20, down_window=0.0, scale_up_tolerance=0.0, scale_down_tolerance=0.25)
    # 11 on 10: outside a 0 % up band — but it waits for the stable window (30 s); 8 on 10 is
    # within a 25 % down band: kept.
    up = run(s, [(0.0, conc(*[32] * 10), supply(10)), (1.0, conc(*[35.2] * 10), supply(10))])
    assert up[-1].recommendation == 11 and "within" not in up[-1].reason
    down = decide_scale(s, conc(*[25.6] * 10), supply(10), initial_state(s), 0.0)
    assert down.recommendation == 10 and "8 within −25 % of 10: keep 10" in down.reason
    # The plain `tolerance` is the default of both.
    plain = spec(max_replicas=20, tolerance=0.1)
    assert plain.autoscale.up_tolerance == plain.autoscale.down_tolerance == 0.1


def test_fallback_replicas_after_metrics_are_unknown_for_the_bound() -> None:
    s = spec(max_replicas=10, fallback_replicas=3, fallback_after_s=60.0)
    ticks: list[Tick] = [(0.0, conc(32, 32, 32, 32, 32, 32), supply(6))]  # 192 → 6
    ticks += [(t, load(error="connection refused"), supply(6)) for t in (10.0, 69.0, 70.0, 200.0)]
    decisions = run(s, ticks)
    assert desired(decisions) == [6, 6, 6, 3, 3]
    assert all(d.unknown for d in decisions[1:])
    assert decisions[3].reason == (
        "no fresh data (source failed: connection refused) → fallback 3 "
        "(unknown for 60s ≥ fallback_after 60s: fallback_replicas 3)"
    )
    assert next_decision_at(decisions[2], s) == 70.0  # the simulator jumps to the fallback
    # Never "0 because no data": without fallback_replicas the last decision holds.
    held = run(spec(max_replicas=10), ticks)
    assert desired(held) == [6, 6, 6, 6, 6]
    # Data back: the fallback was a decision like any other; going up again follows the windows.
    back = decide_scale(s, conc(40, 40, 40), supply(3), decisions[-1].state, 201.0)
    assert back.unknown is False and back.state.unknown_since is None


def test_a_fallback_counts_headroom_and_stays_within_min_and_max() -> None:
    s = spec(min_replicas=2, max_replicas=4, headroom=1, fallback_replicas=9, fallback_after_s=0.0)
    d = decide_scale(s, load(), supply(2), initial_state(s), 0.0)
    assert (d.needed, d.desired) == (4, 4)
    s = spec(min_replicas=2, max_replicas=4, headroom=1, fallback_replicas=0, fallback_after_s=0.0)
    d = decide_scale(s, load(), supply(2), initial_state(s), 0.0)
    assert (d.needed, d.desired) == (2, 3)


def test_a_scale_down_at_no_load_undone_by_a_new_surge_does_not_pin_the_replicas() -> None:
    """benchmarks/reclaim.py, second surge: a surge ends, the service goes 2 → 1 at zero load,
    the next surge takes it back to 2 within two stabilisation windows. That is new load, not
    batching: no flap guard (armed at 0 replicas' worth it could never be released, "below 0",
    and the service stayed at 2 for good, the research step it preempted never resumed)."""
    s = spec(max_replicas=2, concurrency=4.0, up_window=2.0, down_window=5.0, tolerance=0.0)
    idle2, idle1, busy1 = conc(0, 0), conc(0), conc(12)
    d = run(s, [(0.0, idle2, supply(2)), (6.0, idle2, supply(2))])
    assert desired(d) == [2, 1]  # surge 1 over: scale-down at no load
    d = run(s, [(7.0, idle1, supply(1)), (8.0, busy1, supply(1)), (10.5, busy1, supply(1))], d[-1].state)
    assert desired(d)[-1] == 2  # surge 2: undone within 2 × 5 s
    assert d[-1].state.flap_guard is None
    assert d[-1].state.window_s == 10.0  # the burst guard: the window doubled
    quiet = [(11.0 + k, idle2, supply(2)) for k in range(13)]
    d = run(s, quiet, d[-1].state)
    assert desired(d)[-1] == 1, d[-1].reason  # surge 2 over: down again after the (longer) window
    assert desired(d)[:9] == [2] * 9  # not before 10.5 + 10 s


# -- the burst guard ------------------------------------------------------------------------------


def _bursts(s: ServiceSpec, start: float, count: int, every: float, state: ScaleState) -> list[ScaleDecision]:
    """`count` bursts `every` seconds apart from `start`: 10 s at 3 replicas' worth, quiet between,
    a tick a second, the supply following the decisions."""
    out: list[ScaleDecision] = []
    for k in range(int(count * every)):
        now = start + k
        busy = (k % every) < 10
        have = out[-1].desired if out else (state.desired or 1)
        d = decide_scale(s, conc(*([32.0] * 3 if busy else [0.0])), supply(have), state, now)
        state = d.state
        out.append(d)
    return out


def test_the_burst_guard_lengthens_the_window_until_the_bursts_no_longer_undo_a_scale_down() -> None:
    """Bursts every 80 s with a 30 s window: a quiet spell parks the replicas and the next burst
    undoes it within two windows; the window doubles (30 → 60 → 120 s) until it spans the bursts'
    spacing, then the replicas stay up through the quiet spells."""
    s = spec(max_replicas=4, down_window=30.0, up_window=2.0, max_scale_down_stabilization_s=600.0)
    d = _bursts(s, 0.0, 8, 80.0, initial_state(s))
    windows = sorted({x.state.window_s for x in d if x.state.window_s is not None})
    assert windows == [60.0, 120.0], windows
    undone = [x.reason for x in d if "burst guard" in x.reason]
    assert len(undone) == 2 and "stabilisation 30s → 60s" in undone[0], undone
    last = d[-300:]  # the last three bursts: no scale-down between them any more
    assert min(x.desired for x in last) == 3, [x.desired for x in last]


def test_the_burst_guard_is_capped_and_forgets_after_burst_memory() -> None:
    s = spec(
        max_replicas=4,
        down_window=30.0,
        up_window=2.0,
        max_scale_down_stabilization_s=60.0,
        burst_memory_s=1000.0,
    )
    d = _bursts(s, 0.0, 8, 80.0, initial_state(s))
    assert {x.state.window_s for x in d} == {None, 60.0}  # 30 → 60, never 120
    set_at = max(x.state.window_at or 0.0 for x in d)
    # A quiet hour: the window halves back to 30 s burst_memory after it was last set, and the
    # decision says so; the replicas go down on the 60 s window before that.
    state = d[-1].state
    quiet = []
    for k in range(1200):
        x = decide_scale(s, conc(0.0), supply(state.desired or 1), state, 800.0 + k)
        state = x.state
        quiet.append(x)
    assert quiet[-1].state.window_s is None and quiet[-1].state.window_at is None
    halved = [x for x in quiet if "no undone scale-down for 1000s" in x.reason]
    assert len(halved) == 1 and halved[0].state.history[-1][0] == set_at + 1000.0


def test_a_smooth_ramp_down_and_up_is_not_a_burst() -> None:
    """Load that comes back only after two windows (a day/night swing) leaves the window alone."""
    s = spec(max_replicas=4, down_window=30.0, up_window=2.0)
    state = initial_state(s)
    decisions = []
    for k in range(400):
        worth = 3 if k < 100 or k >= 300 else 1
        d = decide_scale(s, conc(*([32.0] * worth)), supply(state.desired or 3), state, float(k))
        state = d.state
        decisions.append(d)
    assert [x.desired for x in decisions][130:140] == [1] * 10  # down after the 30 s window
    assert max(x.desired for x in decisions[300:]) == 3  # and back up
    assert all(x.state.window_s is None for x in decisions)


def test_a_small_swing_undone_within_two_windows_is_not_a_burst() -> None:
    """8 → 6 → 8 replicas within a minute: undone, but a climb of one step, not a burst."""
    s = spec(max_replicas=10, down_window=30.0, up_window=2.0)
    state = initial_state(s)
    decisions = []
    for k in range(300):
        worth = 6 if 20 <= k % 100 < 70 else 8
        d = decide_scale(s, conc(*([32.0] * worth)), supply(state.desired or 8), state, float(k))
        state = d.state
        decisions.append(d)
    assert 6 in [x.desired for x in decisions]  # it did go down ...
    assert all(x.state.window_s is None for x in decisions)  # ... and the window stayed


def test_next_decision_at_uses_the_lengthened_window_and_its_halving() -> None:
    s = spec(max_replicas=4, down_window=30.0, up_window=2.0, burst_memory_s=1000.0)
    d = _bursts(s, 0.0, 2, 80.0, initial_state(s))[:120]  # up to 119 s: quiet since 89 s
    last = d[-1]
    assert last.state.window_s == 60.0 and last.desired == 3
    assert "within the last 60s" in last.reason
    assert next_decision_at(last, s) == 89.0 + 60.0  # the last burst reading leaves the window
    assert next_decision_at(d[20], s) == 9.0 + 30.0  # before the burst guard: the 30 s window
    later = decide_scale(s, conc(32.0, 32.0, 32.0), supply(3), last.state, 1100.0)
    assert later.state.window_s is None  # halved back to 30 s at 81 + 1000 s
    # When the window halves before the highest reading leaves it, the halving is the next time.
    quick = spec(max_replicas=4, down_window=30.0, up_window=2.0, burst_memory_s=50.0)
    d = _bursts(quick, 0.0, 2, 80.0, initial_state(quick))[:120]
    assert d[-1].state.window_at == 81.0 and d[-1].desired == 3  # set by the scale-up at 81 s
    assert next_decision_at(d[-1], quick) == 81.0 + 50.0


def test_history_keeps_only_the_window_maxima() -> None:
    """An hour-long window keeps the readings that can still be a window's highest, not one per tick."""
    s = spec(max_replicas=10, down_window=3600.0, up_window=2.0)
    state = initial_state(s)
    for k in range(3600):
        worth = 8 - (k // 600)  # 8, 7, ... falling every 10 minutes
        d = decide_scale(s, conc(*([32.0] * worth)), supply(8), state, float(k))
        state = d.state
    assert len(state.history) <= 8, state.history
    assert d.desired == 8  # the highest of the hour still holds


def test_the_burst_guard_settings_come_from_lowtide_yaml_and_bad_ones_name_the_field(tmp_path: Path) -> None:
    def spec_of(autoscale: str) -> ServiceSpec:
        path = tmp_path / "lowtide.yaml"
        path.write_text(f"services: [{{name: c, model: m, autoscale: {autoscale}}}]", encoding="utf-8")
        return service_spec(load_settings(path).services[0])

    default = spec_of("{}").autoscale
    assert (default.max_scale_down_stabilization_s, default.burst_memory_s) == (3600.0, 86400.0)
    set_ = spec_of("{scale_down_stabilization: 2m, max_scale_down_stabilization: 30m, burst_memory: 6h}")
    assert (set_.autoscale.max_scale_down_stabilization_s, set_.autoscale.burst_memory_s) == (1800.0, 21600.0)
    # A longest window below the window itself means no burst guard: it is never lengthened.
    off = spec_of("{scale_down_stabilization: 2h}").autoscale
    assert off.max_scale_down_stabilization_s == off.scale_down_stabilization_s == 7200.0
    for bad in ("{max_scale_down_stabilization: -5}", "{burst_memory: soon}"):
        with pytest.raises(ConfigError) as caught:
            spec_of(bad)
        assert ("max_scale_down_stabilization" if "max" in bad else "burst_memory") in str(caught.value)
