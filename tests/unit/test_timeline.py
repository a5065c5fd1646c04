"""The dashboard timeline's parked share (`policy.timeline`): replica state events become parked
intervals; a bucket's idle ledger time splits into parked (at most idle) and free."""

from __future__ import annotations

import pytest

from lowtide.domain.states import ReplicaState
from lowtide.policy.timeline import (
    ParkedNow,
    ParkedSpan,
    ReplicaMove,
    parked_gpus,
    parked_spans,
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
