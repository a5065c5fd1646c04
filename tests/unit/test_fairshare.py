"""Stories for policy.fairshare: decayed usage and the dominant share that orders teams."""

from __future__ import annotations

import math

import pytest
from builders import NOW, running, snapshot
from hypothesis import given
from hypothesis import strategies as st

from lowtide.policy.fairshare import (
    FairSharePolicy,
    TeamShares,
    decay,
    decayed_integral,
    dominant_share,
)

H = 3600.0


def riemann(gpus: float, start: float, end: float, now: float, h: float, steps: int = 20_000) -> float:
    width = (end - start) / steps
    return sum(gpus * 2 ** (-(now - (start + (k + 0.5) * width)) / h) * width for k in range(steps))


def test_the_integral_matches_a_numeric_sum() -> None:
    assert decayed_integral(4, NOW - 5000, NOW - 1000, NOW, H) == pytest.approx(
        riemann(4, NOW - 5000, NOW - 1000, NOW, H), rel=1e-6
    )


def test_one_gpu_for_the_last_half_life_counts_half_of_all_time() -> None:
    assert decayed_integral(1, NOW - H, NOW, NOW, H) == pytest.approx(H / math.log(2) / 2)
    assert decayed_integral(1, NOW - 1000 * H, NOW, NOW, H) == pytest.approx(H / math.log(2))


def test_an_empty_or_reversed_interval_counts_nothing() -> None:
    assert decayed_integral(8, NOW, NOW, NOW, H) == 0.0
    assert decayed_integral(8, NOW, NOW - 10, NOW, H) == 0.0


def test_decay_halves_a_value_every_half_life_and_never_inflates_it() -> None:
    assert decay(100.0, NOW - H, NOW, H) == pytest.approx(50.0)
    assert decay(100.0, NOW - 2 * H, NOW, H) == pytest.approx(25.0)
    assert decay(100.0, NOW, NOW, H) == 100.0
    assert decay(100.0, NOW + 60, NOW, H) == 100.0


@given(
    st.floats(0, 16),
    st.floats(0, 1e5),
    st.floats(0, 1e5),
    st.floats(0, 1e5),
    st.floats(60, 1e5),
)
def test_integrals_add_up_and_carry_forward(g: float, a: float, b: float, later: float, h: float) -> None:
    t0, t1, t2 = NOW - a - b, NOW - b, NOW
    whole = decayed_integral(g, t0, t2, t2, h)
    assert whole >= 0
    assert decayed_integral(g, t0, t1, t2, h) + decayed_integral(g, t1, t2, t2, h) == pytest.approx(
        whole, rel=1e-9, abs=1e-6
    )
    assert decay(whole, t2, t2 + later, h) == pytest.approx(
        decayed_integral(g, t0, t2, t2 + later, h), rel=1e-9, abs=1e-6
    )


def test_the_share_is_the_larger_of_now_and_the_recent_past_over_the_weight() -> None:
    capacity = 100 * H / math.log(2)
    holds_a_lot = dominant_share(held_gpus=40, decayed_usage=0.1 * capacity, pool_gpus=100, half_life_s=H)
    used_a_lot = dominant_share(held_gpus=10, decayed_usage=0.5 * capacity, pool_gpus=100, half_life_s=H)
    assert holds_a_lot == pytest.approx(0.4)
    assert used_a_lot == pytest.approx(0.5)
    assert dominant_share(
        held_gpus=40, decayed_usage=0, pool_gpus=100, half_life_s=H, weight=2.0
    ) == pytest.approx(0.2)


def test_an_empty_pool_gives_every_team_zero() -> None:
    assert dominant_share(held_gpus=0, decayed_usage=5.0, pool_gpus=0, half_life_s=H) == 0.0


def test_team_shares_count_history_running_steps_and_new_starts() -> None:
    snap = snapshot(
        nodes={"n1": 8},
        running=[running("n1", [0, 1], team="a", started_at=NOW - H)],
        team_usage={"b": 1000.0},
    )
    shares = TeamShares.from_snapshot(snap, FairSharePolicy(half_life_s=H))
    assert shares.held("a") == 2
    assert shares.usage("a") == pytest.approx(decayed_integral(2, NOW - H, NOW, NOW, H))
    assert shares.usage("b") == 1000.0
    assert shares.share("a") == pytest.approx(2 / 8)
    assert shares.share("fresh") == 0.0
    shares.add_held("fresh", 4)
    assert shares.share("fresh") == pytest.approx(4 / 8)
    assert shares.share("a") == pytest.approx(2 / 8)


def test_team_shares_agree_with_dominant_share() -> None:
    policy = FairSharePolicy(half_life_s=H, team_weights={"a": 3.0})
    snap = snapshot(nodes={"n1": 4, "n2": 4}, team_usage={"a": 20_000.0})
    shares = TeamShares.from_snapshot(snap, policy)
    shares.add_held("a", 1)
    expected = dominant_share(held_gpus=1, decayed_usage=20_000.0, pool_gpus=8, half_life_s=H, weight=3.0)
    assert shares.share("a") == pytest.approx(expected)


def test_a_running_step_that_claims_to_start_in_the_future_adds_no_usage() -> None:
    snap = snapshot(running=[running("n1", [0], team="a", started_at=NOW + 30)])
    assert TeamShares.from_snapshot(snap, FairSharePolicy()).usage("a") == 0.0


def test_unknown_teams_weigh_one_and_weights_must_be_positive() -> None:
    assert FairSharePolicy(team_weights={"a": 2.0}).weight("b") == 1.0
    with pytest.raises(ValueError, match="team 'a'"):
        FairSharePolicy(team_weights={"a": 0.0})
    with pytest.raises(ValueError, match="half_life_s"):
        FairSharePolicy(half_life_s=0)
