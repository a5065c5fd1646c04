"""When the inference controller records the lending envelope (`policy.lending_history`): on
every change of the lendable count or the mode, and every `RECORD_EVERY_S` while it stays the
same; points that cannot be stored are refused when made."""

from __future__ import annotations

import math

import pytest

from lowtide.policy.lending_history import KEEP_S, RECORD_EVERY_S, LendingPoint, keep_after, record_due

T0 = 1_790_000_000.0


def test_the_first_point_and_every_change_are_recorded_at_once() -> None:
    assert record_due(None, 0, "continuous", now=T0)
    last = LendingPoint(T0, 6, "continuous")
    assert record_due(last, 5, "continuous", now=T0 + 1)  # the count changed
    assert record_due(last, 6, "window", now=T0 + 1)  # the mode changed
    assert not record_due(last, 6, "continuous", now=T0 + 1)


def test_a_steady_envelope_is_recorded_every_period_and_not_before() -> None:
    last = LendingPoint(T0, 6, "continuous")
    assert not record_due(last, 6, "continuous", now=T0 + RECORD_EVERY_S - 0.5)
    assert record_due(last, 6, "continuous", now=T0 + RECORD_EVERY_S)
    assert record_due(last, 6, "continuous", now=T0 + 60.0, every_s=60.0)
    # A clock that went back records nothing new until it is past the last point again.
    assert not record_due(last, 6, "continuous", now=T0 - 3600.0)


def test_retention_is_48_hours() -> None:
    assert KEEP_S == 48 * 3600.0
    assert keep_after(T0) == T0 - 48 * 3600.0
    assert keep_after(T0, keep_s=60.0) == T0 - 60.0


@pytest.mark.parametrize(
    ("at", "lendable", "mode", "message"),
    [
        (math.nan, 1, "continuous", "finite time"),
        (math.inf, 1, "continuous", "finite time"),
        (T0, -1, "continuous", "cannot be negative"),
        (T0, 1.5, "continuous", "must be an integer"),
        (T0, True, "continuous", "must be an integer"),
        (T0, 1, "", "mode must be 1..16"),
        (T0, 1, "x" * 17, "mode must be 1..16"),
    ],
)
def test_points_the_store_cannot_hold_are_refused(at: float, lendable: int, mode: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LendingPoint(at, lendable, mode)
