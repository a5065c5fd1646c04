"""The lending envelope's history (`record_lending`, `lending_points`): the same on every backend.

A span's points come with the one in force at its start; equal times keep the order written;
points older than the retention are deleted when a point is written; a fenced-out leader's write
is refused and changes nothing.
"""

from __future__ import annotations

import pytest

from lowtide.control.lease import Fence
from lowtide.control.records import FencedOut
from lowtide.policy.lending_history import KEEP_S, LendingPoint
from lowtide.store.repo import Store

T0 = 1_790_000_000.0


def P(dt: float, lendable: int, mode: str = "continuous") -> LendingPoint:
    return LendingPoint(T0 + dt, lendable, mode)


def test_a_span_reads_its_points_after_the_one_in_force_at_its_start(store: Store) -> None:
    assert store.lending_points(T0, T0 + 3600) == []
    for p in [P(0, 4), P(600, 4), P(700, 2, "window"), P(1200, 6)]:
        store.record_lending(p)
    assert store.lending_points(T0 + 650, T0 + 1200) == [P(600, 4), P(700, 2, "window")]
    assert store.lending_points(T0 + 600, T0 + 1201) == [P(0, 4), P(600, 4), P(700, 2, "window"), P(1200, 6)]
    assert store.lending_points(T0 - 10, T0 + 1) == [P(0, 4)]  # nothing before the first
    assert store.lending_points(T0 + 5000, T0 + 6000) == [P(1200, 6)]  # still in force
    # Points written out of order come back by time; equal times in the order written.
    store.record_lending(P(650, 3))
    store.record_lending(P(650, 5))
    assert store.lending_points(T0 + 640, T0 + 700) == [P(600, 4), P(650, 3), P(650, 5)]


def test_writing_a_point_deletes_those_older_than_the_retention(store: Store) -> None:
    store.record_lending(P(0, 1))
    store.record_lending(P(100, 2))
    store.record_lending(P(KEEP_S + 50, 3))  # T0 + 50 is the cutoff: the point at T0 goes
    assert store.lending_points(T0 - 1, T0 + 2 * KEEP_S) == [P(100, 2), P(KEEP_S + 50, 3)]
    store.record_lending(P(KEEP_S + 200, 4), keep_s=60.0)
    assert store.lending_points(T0 - 1, T0 + 2 * KEEP_S) == [P(KEEP_S + 200, 4)]


def test_a_fenced_out_leaders_point_is_refused_and_not_kept(store: Store) -> None:
    store.record_lending(P(0, 1))
    heard: list[FencedOut] = []
    store.fence_writes(Fence("control", 7), heard.append)  # no lease row holds token 7
    with pytest.raises(FencedOut):
        store.record_lending(P(60, 2))
    assert len(heard) == 1
    store.fence_writes(None)
    assert store.lending_points(T0, T0 + 3600) == [P(0, 1)]
