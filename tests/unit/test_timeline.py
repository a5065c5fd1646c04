"""The dashboard timeline's split of idle (`policy.timeline`): replica state events become parked
intervals; the lending envelope's points become lendable GPU-equivalents; a bucket's idle ledger
time splits into parked (at most idle), lent and idle (the envelope research left unused), and free."""

from __future__ import annotations

import pytest

from lowtide.domain.states import ReplicaState
from lowtide.policy.lending_history import LendingPoint
from lowtide.policy.timeline import (
    IdleSplit,
    ParkedNow,
    ParkedSpan,
    ReplicaMove,
    lendable_gpus,
    parked_gpus,
    parked_spans,
    split_bucket,
    split_idle,
)

R = ReplicaState


def test_a_replica_is_parked_from_its_parked_event_to_its_next_state_move() -> None:
    moves = [
        ReplicaMove("chat/0", 100.0, "starting"),
        ReplicaMove("chat/0", 110.0, "serving"),
        ReplicaMove("chat/0", 200.0, "parking"),
        ReplicaMove("chat/0", 205.0, "parked"),
        ReplicaMove("chat/0", 260.0, "scale_blocked"),  # an alert: not a state move
        ReplicaMove("chat/0", 300.0, "waking"),
        ReplicaMove("chat/0", 310.0, "serving"),
        ReplicaMove("chat/0", 400.0, "parked"),  # parked again, still now
    ]
    current = [ParkedNow("chat/0", R.PARKED, 400.0)]
    spans = parked_spans(moves, current, {"chat/0": 2}, now=500.0)
    assert spans == [ParkedSpan("chat/0", 205.0, 300.0, 2), ParkedSpan("chat/0", 400.0, 500.0, 2)]


def test_a_replica_parked_before_every_event_read_is_parked_since_its_record_says() -> None:
    current = [ParkedNow("chat/1", R.PARKED, 50.0), ParkedNow("chat/0", R.SERVING, 10.0)]
    spans = parked_spans([], current, {"chat/1": 4, "chat/0": 4}, now=150.0)
    assert spans == [ParkedSpan("chat/1", 50.0, 150.0, 4)]
    # A replica without GPUs (unknown service) counts for nothing.
    assert parked_spans([], current, {}, now=150.0) == []


def test_parked_gpu_equivalents_per_bucket_and_the_split_of_idle() -> None:
    spans = [ParkedSpan("a", 0.0, 50.0, 2), ParkedSpan("b", 25.0, 100.0, 4)]
    assert parked_gpus(spans, 0.0, 50.0) == pytest.approx((2 * 50 + 4 * 25) / 50)
    assert parked_gpus(spans, 50.0, 100.0) == pytest.approx(4.0)
    assert parked_gpus(spans, 100.0, 200.0) == 0.0
    with pytest.raises(ValueError, match="empty bucket"):
        parked_gpus(spans, 5.0, 5.0)
    assert split_idle(6.0, 2.0) == (2.0, 4.0)
    # Parked GPUs lent to research meanwhile are research in the ledger: parked is at most idle.
    assert split_idle(1.5, 4.0) == (1.5, 0.0)
    assert split_idle(3.0, 0.0) == (0.0, 3.0)


def test_lendable_gpus_are_weighted_by_the_time_each_point_held_in_the_bucket() -> None:
    points = [
        LendingPoint(50.0, 4, "continuous"),  # in force when the bucket [100, 200) starts
        LendingPoint(150.0, 6, "continuous"),
        LendingPoint(175.0, 0, "window"),
    ]
    assert lendable_gpus(points, 100.0, 200.0) == pytest.approx((4 * 50 + 6 * 25 + 0 * 25) / 100)
    # The last point holds until the bucket's end; the order given does not matter.
    assert lendable_gpus(list(reversed(points)), 200.0, 300.0) == 0.0
    assert lendable_gpus(points[:2], 200.0, 300.0) == 6.0
    # Before the first point nothing is known, and unknown is not lendable.
    assert lendable_gpus([LendingPoint(150.0, 8, "forecast")], 100.0, 200.0) == pytest.approx(4.0)
    assert lendable_gpus([], 100.0, 200.0) == 0.0
    with pytest.raises(ValueError, match="empty bucket"):
        lendable_gpus(points, 5.0, 5.0)


def test_idle_splits_into_parked_then_lent_and_idle_then_free() -> None:
    # 8 idle, 2 parked; 5 lendable of which research used 1: 4 lent and idle, 2 free.
    assert split_bucket(8.0, 2.0, 5.0, 1.0) == IdleSplit(2.0, 4.0, 2.0)
    # The envelope is wider than what is left idle: all of the rest is lent and idle.
    assert split_bucket(3.0, 1.0, 7.0, 0.0) == IdleSplit(1.0, 2.0, 0.0)
    # Research used the whole envelope (or more, lent before it shrank): nothing lent is idle.
    assert split_bucket(4.0, 0.0, 2.0, 2.0) == IdleSplit(0.0, 0.0, 4.0)
    assert split_bucket(4.0, 0.0, 2.0, 3.5) == IdleSplit(0.0, 0.0, 4.0)
    # No idle time at all: nothing to split, whatever the envelope says.
    assert split_bucket(0.0, 2.0, 6.0, 0.0) == IdleSplit(0.0, 0.0, 0.0)
    for idle, parked, lendable, research in [(6.0, 2.5, 3.25, 0.5), (1.0, 0.0, 0.25, 0.0)]:
        s = split_bucket(idle, parked, lendable, research)
        assert s.parked + s.lent_idle + s.free == pytest.approx(idle)
