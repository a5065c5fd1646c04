"""Stories for policy.scheduler.decide: queue order, placement, reservations, reasons."""

from __future__ import annotations

import copy
import random

import pytest
from builders import (
    NOW,
    placements,
    policy,
    queued,
    running,
    snapshot,
    start_reasons,
    started,
    waiting_reasons,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtide.domain.gpus import GpuRef
from lowtide.policy.plan import Reservation
from lowtide.policy.scheduler import SchedulerPolicy, decide
from lowtide.policy.snapshot import QueuedStep, RunningStep, Snapshot

# --- queue order ----------------------------------------------------------------------------------


def test_higher_priority_goes_first_even_if_submitted_later() -> None:
    snap = snapshot(
        nodes={"n1": 1},
        queued=[
            queued("job-low", priority=0, submitted_at=0),
            queued("job-lower", priority=0, submitted_at=10),
            queued("job-high", priority=10, submitted_at=50),
        ],
    )
    plan = decide(snap, policy())
    assert started(plan) == ["job-high/train"]
    assert waiting_reasons(plan) == {
        "job-low/train": "head of the queue: waiting for 1 more GPU on n1 (GPUs held back from backfill)",
        "job-lower/train": "no free GPUs",
    }


def test_within_a_team_steps_go_first_in_first_out() -> None:
    snap = snapshot(
        nodes={"n1": 3},
        queued=[
            queued("job-c", submitted_at=30),
            queued("job-a", "eval", submitted_at=10, index=1),
            queued("job-b", submitted_at=20),
            queued("job-a", "prep", submitted_at=10, index=0),
        ],
    )
    plan = decide(snap, policy())
    assert started(plan) == ["job-a/prep", "job-a/eval", "job-b/train"]
    assert list(waiting_reasons(plan)) == ["job-c/train"]


def test_two_teams_interleave_as_each_start_raises_the_share() -> None:
    # Team a submitted everything first; without fair share it would take all four GPUs.
    snap = snapshot(
        nodes={"n1": 4},
        queued=[queued(f"a-{i}", team="a", submitted_at=i) for i in range(4)]
        + [queued(f"b-{i}", team="b", submitted_at=100 + i) for i in range(4)],
    )
    plan = decide(snap, policy())
    assert started(plan) == ["a-0/train", "b-0/train", "a-1/train", "b-1/train"]


def test_a_team_with_recent_history_goes_after_a_fresh_team() -> None:
    snap = snapshot(
        nodes={"n1": 1},
        team_usage={"heavy": 50_000.0},
        queued=[
            queued("job-heavy", team="heavy", submitted_at=0),
            queued("job-fresh", team="fresh", submitted_at=500),
        ],
    )
    plan = decide(snap, policy())
    assert started(plan) == ["job-fresh/train"]


def test_gpus_a_team_holds_now_count_against_it() -> None:
    snap = snapshot(
        nodes={"n1": 8},
        running=[running("n1", [0, 1, 2, 3], team="holder")],
        queued=[
            queued("job-holder", team="holder", submitted_at=0),
            queued("job-other", team="other", submitted_at=500),
        ],
    )
    plan = decide(snap, policy())
    assert started(plan) == ["job-other/train", "job-holder/train"]


def test_a_team_with_weight_three_gets_three_times_the_gpus() -> None:
    snap = snapshot(
        nodes={"n1": 8},
        queued=[queued(f"a-{i}", team="a", submitted_at=i) for i in range(8)]
        + [queued(f"b-{i}", team="b", submitted_at=i + 0.5) for i in range(8)],
    )
    plan = decide(snap, policy(weights={"a": 3.0}))
    teams = [s.job_id[0] for s in plan.starts]
    assert teams.count("a") == 6
    assert teams.count("b") == 2


def test_a_preempted_step_goes_to_the_head_of_its_class_but_not_above_higher_priority() -> None:
    snap = snapshot(
        nodes={"n1": 2},
        running=[running("n1", [0], team="busy")],
        queued=[
            queued("job-early", team="idle", submitted_at=0),
            queued("job-requeued", team="busy", submitted_at=900, preempted=True),
            queued("job-urgent", team="idle", priority=5, submitted_at=950),
        ],
    )
    plan = decide(snap, policy())
    # One GPU is free: urgent outranks the class; the preempted step outranks its class mates
    # even though its team holds GPUs and it was submitted last.
    assert started(plan) == ["job-urgent/train"]
    snap_two_free = snapshot(nodes={"n1": 2}, queued=snap.queued)
    assert started(decide(snap_two_free, policy())) == ["job-urgent/train", "job-requeued/train"]


def test_fair_share_carries_across_priority_classes() -> None:
    # a's high-priority step raises a's share before the normal class is ordered.
    snap = snapshot(
        nodes={"n1": 2},
        queued=[
            queued("a-high", team="a", priority=1, submitted_at=5),
            queued("a-normal", team="a", submitted_at=0),
            queued("b-normal", team="b", submitted_at=10),
        ],
    )
    assert started(decide(snap, policy())) == ["a-high/train", "b-normal/train"]


# --- placement ------------------------------------------------------------------------------------


def test_best_fit_takes_the_tightest_node_and_keeps_the_big_block_whole() -> None:
    snap = snapshot(
        nodes={"big": 8, "mid": 4, "small": 4},
        running=[running("mid", [0]), running("small", [0, 1])],
        queued=[queued("job-two", gpus=2), queued("job-three", gpus=3, submitted_at=1)],
    )
    plan = decide(snap, policy())
    assert placements(plan) == {
        "job-two/train": ("small", (2, 3)),
        "job-three/train": ("mid", (1, 2, 3)),
    }
    assert start_reasons(plan)["job-two/train"] == "placed on small GPUs 2,3 (best fit: 2 free)"


def test_within_a_node_the_lowest_free_indices_are_taken() -> None:
    snap = snapshot(nodes={"n1": 4}, running=[running("n1", [1])], queued=[queued(gpus=2)])
    assert placements(decide(snap, policy())) == {"job-1/train": ("n1", (0, 2))}


def test_equal_fits_go_to_the_first_node_by_name() -> None:
    snap = snapshot(nodes={"n2": 4, "n1": 4}, queued=[queued(gpus=1)])
    plan = decide(snap, policy())
    assert placements(plan) == {"job-1/train": ("n1", (0,))}
    assert start_reasons(plan) == {"job-1/train": "placed on n1 GPU 0 (best fit: 4 free)"}


def test_unavailable_gpus_are_never_lent() -> None:
    snap = snapshot(
        nodes={"n1": 4},
        unavailable=["n1:0", "n1:1"],
        queued=[queued("job-two", gpus=2), queued("job-three", gpus=3, submitted_at=1)],
    )
    plan = decide(snap, policy())
    assert placements(plan) == {"job-two/train": ("n1", (2, 3))}
    assert waiting_reasons(plan) == {
        "job-three/train": "needs 3 GPUs on one node; at most 2 on any node can be lent now"
    }
    assert plan.reservations == ()


def test_steps_without_gpus_always_start_on_the_first_node() -> None:
    snap = snapshot(
        nodes={"n2": 1, "n1": 1},
        running=[running("n1", [0]), running("n2", [0])],
        queued=[queued("job-prep", "prep", gpus=0)],
    )
    plan = decide(snap, policy())
    assert placements(plan) == {"job-prep/prep": ("n1", ())}
    assert start_reasons(plan) == {"job-prep/prep": "needs no GPUs: runs on n1"}


def test_a_step_without_gpus_waits_only_when_there_is_no_node_at_all() -> None:
    plan = decide(snapshot(nodes={}, queued=[queued(gpus=0)]), policy())
    assert waiting_reasons(plan) == {"job-1/train": "needs no GPUs, but the pool has no nodes"}


# --- reservations and backfill --------------------------------------------------------------------


def _blocked_head_story() -> Snapshot:
    """n1 has 1 free GPU, n2 has 3, n3 none; a 4-GPU head comes first, small steps after it."""
    return snapshot(
        nodes={"n1": 4, "n2": 4, "n3": 4},
        running=[running("n1", [0, 1, 2]), running("n2", [0]), running("n3", [0, 1, 2, 3])],
        queued=[
            queued("job-big", gpus=4, submitted_at=0),
            queued("job-s1", gpus=1, submitted_at=1),
            queued("job-s2", gpus=2, submitted_at=2),
            queued("job-s3", gpus=1, submitted_at=3),
        ],
    )


def test_a_blocked_head_reserves_the_node_closest_to_fitting_it() -> None:
    plan = decide(_blocked_head_story(), policy())
    assert plan.reservations == (Reservation("job-big", "train", "n2", 4),)
    assert waiting_reasons(plan)["job-big/train"] == (
        "head of the queue: waiting for 1 more GPU on n2 (GPUs held back from backfill)"
    )


def test_small_steps_backfill_elsewhere_but_never_on_the_reserved_node() -> None:
    plan = decide(_blocked_head_story(), policy())
    assert placements(plan) == {"job-s1/train": ("n1", (3,))}
    assert start_reasons(plan) == {
        "job-s1/train": "backfilled on n1 GPU 3 (best fit: 1 free) while job-big/train waits for n2"
    }
    assert waiting_reasons(plan) == {
        "job-big/train": "head of the queue: waiting for 1 more GPU on n2 (GPUs held back from backfill)",
        "job-s2/train": "no free GPUs (n2 is held for job-big/train, which is first in line)",
        "job-s3/train": "no free GPUs (n2 is held for job-big/train, which is first in line)",
    }


def test_the_reason_names_the_reservation_only_when_it_hides_a_bigger_block() -> None:
    snap = snapshot(
        nodes={"n1": 4, "n2": 4},
        running=[running("n1", [0, 1]), running("n2", [0])],
        queued=[queued("job-big", gpus=4), queued("job-mid", gpus=3, submitted_at=1)],
    )
    plan = decide(snap, policy())
    assert waiting_reasons(plan)["job-mid/train"] == (
        "needs 3 GPUs on one node; largest free block is 2 "
        "(n2 is held for job-big/train, which is first in line)"
    )
    snap = snapshot(
        nodes={"n1": 4, "n2": 4},
        running=[running("n1", [0, 1]), running("n2", [0, 1])],
        queued=[queued("job-big", gpus=4), queued("job-mid", gpus=3, submitted_at=1)],
    )
    plan = decide(snap, policy())
    assert waiting_reasons(plan)["job-mid/train"] == "needs 3 GPUs on one node; largest free block is 2"


def test_without_reservations_small_steps_fill_every_node() -> None:
    plan = decide(_blocked_head_story(), policy(max_reservations=0))
    assert placements(plan) == {
        "job-s1/train": ("n1", (3,)),
        "job-s2/train": ("n2", (1, 2)),
        "job-s3/train": ("n2", (3,)),
    }
    assert plan.reservations == ()
    assert waiting_reasons(plan) == {"job-big/train": "needs 4 GPUs on one node; largest free block is 3"}


def test_a_second_reservation_goes_to_the_next_blocked_step() -> None:
    snap = snapshot(
        nodes={"n1": 4, "n2": 4, "n3": 2},
        running=[running("n1", [0, 1]), running("n2", [0, 1, 2]), running("n3", [0])],
        queued=[
            queued("job-a", gpus=4),
            queued("job-b", gpus=4, submitted_at=1),
            queued("job-c", gpus=4, submitted_at=2),
            queued("job-d", gpus=1, submitted_at=3),
        ],
    )
    plan = decide(snap, policy(max_reservations=2))
    assert plan.reservations == (
        Reservation("job-a", "train", "n1", 4),
        Reservation("job-b", "train", "n2", 4),
    )
    assert waiting_reasons(plan) == {
        "job-a/train": "head of the queue: waiting for 2 more GPUs on n1 (GPUs held back from backfill)",
        "job-b/train": "next in line: waiting for 3 more GPUs on n2 (GPUs held back from backfill)",
        "job-c/train": "needs 4 GPUs on one node; largest free block is 1 (n1 is held for job-a/train, "
        "which is first in line)",
    }
    assert start_reasons(plan) == {
        "job-d/train": "backfilled on n3 GPU 1 (best fit: 1 free) "
        "while job-a/train waits for n1 and job-b/train waits for n2"
    }


def test_no_reservation_for_a_step_no_node_can_ever_hold() -> None:
    snap = snapshot(
        nodes={"n1": 8, "n2": 8},
        running=[running("n1", [0])],
        queued=[queued("job-huge", gpus=16), queued("job-small", gpus=2, submitted_at=1)],
    )
    plan = decide(snap, policy())
    assert plan.reservations == ()
    assert waiting_reasons(plan) == {"job-huge/train": "needs 16 GPUs on one node; no node has that many"}
    assert start_reasons(plan) == {"job-small/train": "placed on n1 GPUs 1,2 (best fit: 7 free)"}


def test_no_reservation_on_a_node_whose_lendable_gpus_are_too_few() -> None:
    # n1 is big enough on paper, but inference holds half of it.
    snap = snapshot(
        nodes={"n1": 8, "n2": 4},
        unavailable=["n1:4", "n1:5", "n1:6", "n1:7"],
        running=[running("n1", [0]), running("n2", [0])],
        queued=[queued("job-eight", gpus=8), queued("job-four", gpus=4, submitted_at=1)],
    )
    plan = decide(snap, policy())
    # The reservation slot is not spent on job-eight: it goes to the next blocked step.
    assert plan.reservations == (Reservation("job-four", "train", "n1", 4),)
    assert waiting_reasons(plan)["job-eight/train"] == (
        "needs 8 GPUs on one node; at most 4 on any node can be lent now"
    )


def test_a_smaller_step_still_reserves_after_bigger_ones_found_no_node_left() -> None:
    """Once no node outside the reservations can hold 4 GPUs, later 4-GPU steps are not
    reserved for; a 2-GPU step behind them still is (the n3 that could never hold 4)."""
    snap = snapshot(
        nodes={"n1": 8, "n2": 4, "n3": 2},
        unavailable=["n1:4", "n1:5", "n1:6", "n1:7"],
        running=[running("n1", [0]), running("n2", [0]), running("n3", [0])],
        queued=[
            queued("job-eight", gpus=8),
            queued("job-four-a", gpus=4, submitted_at=1),
            queued("job-four-b", gpus=4, submitted_at=2),
            queued("job-four-c", gpus=4, submitted_at=3),
            queued("job-two", gpus=2, submitted_at=4),
            queued("job-four-d", gpus=4, submitted_at=5),
        ],
    )
    plan = decide(snap, policy(max_reservations=3))
    assert plan.reservations == (
        Reservation("job-four-a", "train", "n1", 4),
        Reservation("job-four-b", "train", "n2", 4),
        Reservation("job-two", "train", "n3", 2),
    )
    reasons = waiting_reasons(plan)
    assert reasons["job-eight/train"] == "needs 8 GPUs on one node; at most 4 on any node can be lent now"
    assert reasons["job-four-c/train"].startswith("needs 4 GPUs on one node; largest free block is 1 (")
    assert reasons["job-four-d/train"].startswith("no free GPUs (")  # n3 is held now too
    assert "n3 is held for job-two/train" in reasons["job-four-d/train"]
    assert placements(plan) == {}


# --- retry backoff --------------------------------------------------------------------------------


def test_a_step_in_retry_backoff_waits_and_takes_nothing() -> None:
    snap = snapshot(
        nodes={"n1": 1},
        queued=[
            queued("job-retry", eligible_at=NOW + 12, retry_note="attempt 2 of 3"),
            queued("job-next", submitted_at=99),
        ],
    )
    plan = decide(snap, policy())
    assert started(plan) == ["job-next/train"]
    assert waiting_reasons(plan) == {"job-retry/train": "retry backoff: eligible in 12s (attempt 2 of 3)"}
    assert plan.reservations == ()


@pytest.mark.parametrize(
    ("delay", "note", "reason"),
    [
        (0.4, "", "retry backoff: eligible in 1s"),
        (125, "attempt 3 of 5", "retry backoff: eligible in 2m 5s (attempt 3 of 5)"),
        (7_260, "attempt 4 of 5", "retry backoff: eligible in 2h 1m (attempt 4 of 5)"),
    ],
)
def test_backoff_reasons_round_up_to_readable_durations(delay: float, note: str, reason: str) -> None:
    snap = snapshot(queued=[queued(eligible_at=NOW + delay, retry_note=note)])
    assert waiting_reasons(decide(snap, policy())) == {"job-1/train": reason}


def test_a_step_becomes_eligible_exactly_at_its_eligible_time() -> None:
    snap = snapshot(queued=[queued(eligible_at=NOW)])
    assert started(decide(snap, policy())) == ["job-1/train"]


# --- purity ---------------------------------------------------------------------------------------


def _busy_snapshot() -> Snapshot:
    return snapshot(
        nodes={"n1": 8, "n2": 8, "n3": 4},
        running=[running("n1", [0, 1, 2], team="a", started_at=NOW - 3600), running("n3", [0], team="b")],
        unavailable=["n2:7"],
        team_usage={"a": 10_000.0, "c": 500.0},
        queued=[
            queued(f"job-{i}", team="abc"[i % 3], gpus=[0, 1, 2, 4, 8][i % 5], submitted_at=i, priority=i % 2)
            for i in range(20)
        ],
    )


def test_the_same_snapshot_gives_the_same_plan_whatever_the_queue_order() -> None:
    snap = _busy_snapshot()
    plan = decide(snap, policy())
    assert decide(snap, policy()) == plan
    shuffled = list(snap.queued)
    random.Random(7).shuffle(shuffled)
    assert decide(snapshot_with_queue(snap, shuffled), policy()) == plan


def test_decide_does_not_mutate_the_snapshot() -> None:
    snap = _busy_snapshot()
    before = copy.deepcopy(snap)
    decide(snap, policy())
    assert snap == before
    assert dict(snap.team_usage) == {"a": 10_000.0, "c": 500.0}


def snapshot_with_queue(snap: Snapshot, queue: list[QueuedStep]) -> Snapshot:
    return Snapshot(snap.now, snap.nodes, snap.running, tuple(queue), snap.unavailable, snap.team_usage)


def test_policy_rejects_a_negative_reservation_count() -> None:
    with pytest.raises(ValueError, match="max_reservations"):
        SchedulerPolicy(max_reservations=-1)


# --- properties over random snapshots -------------------------------------------------------------


@st.composite
def random_snapshots(draw: st.DrawFn) -> tuple[Snapshot, SchedulerPolicy]:
    sizes = draw(st.lists(st.integers(1, 8), min_size=0, max_size=5))
    nodes = {f"n{i}": size for i, size in enumerate(sizes)}
    all_gpus = [GpuRef(name, i) for name, size in nodes.items() for i in range(size)]
    unavailable = set(draw(st.sets(st.sampled_from(all_gpus)))) if all_gpus else set()
    running_steps: list[RunningStep] = []
    for name, size in nodes.items():
        free = [i for i in range(size) if GpuRef(name, i) not in unavailable]
        while free:
            if not draw(st.booleans()):
                break
            take = draw(st.integers(1, len(free)))
            team = draw(st.sampled_from("abc"))
            running_steps.append(running(name, free[:take], job_id=f"run-{len(running_steps)}", team=team))
            free = free[take:]
    steps = [
        queued(
            f"job-{i}",
            team=draw(st.sampled_from("abc")),
            priority=draw(st.integers(0, 2)),
            gpus=draw(st.integers(0, 9)),
            submitted_at=draw(st.integers(0, 5)),
            eligible_at=NOW + draw(st.integers(-5, 5)),
            preempted=draw(st.booleans()),
        )
        for i in range(draw(st.integers(0, 12)))
    ]
    snap = snapshot(
        nodes=nodes,
        running=running_steps,
        queued=steps,
        unavailable=[str(ref) for ref in unavailable],
        team_usage={team: draw(st.floats(0, 1e6)) for team in draw(st.sets(st.sampled_from("abc")))},
    )
    return snap, policy(max_reservations=draw(st.integers(0, 2)), weights={"a": draw(st.floats(0.1, 5))})


@settings(max_examples=300, deadline=None)
@given(random_snapshots())
def test_every_plan_respects_the_pool(case: tuple[Snapshot, SchedulerPolicy]) -> None:
    snap, pol = case
    plan = decide(snap, pol)
    held = {GpuRef(r.node, i) for r in snap.running for i in r.gpus}
    node_gpus = {n.name: set(n.gpus) for n in snap.nodes}

    assigned = [GpuRef(s.node, i) for s in plan.starts for i in s.gpus]
    assert len(assigned) == len(set(assigned)), "a GPU is assigned twice"
    assert not set(assigned) & held, "a GPU held by a running step is assigned"
    assert not set(assigned) & snap.unavailable, "an unavailable GPU is assigned"
    assert all(ref.index in node_gpus[ref.node] for ref in assigned)

    for node, gpus in node_gpus.items():
        free_before = len(gpus - {r.index for r in held | snap.unavailable if r.node == node})
        taken = sum(len(s.gpus) for s in plan.starts if s.node == node)
        assert taken <= free_before

    by_key = {(q.job_id, q.step): q for q in snap.queued}
    decided = [(s.job_id, s.step) for s in plan.starts] + [(w.job_id, w.step) for w in plan.waiting]
    assert sorted(decided) == sorted(by_key), "every queued step appears exactly once"
    for s in plan.starts:
        assert len(s.gpus) == by_key[(s.job_id, s.step)].gpus
        assert by_key[(s.job_id, s.step)].eligible_at <= snap.now
        assert s.reason
    assert all(w.reason for w in plan.waiting)

    assert len(plan.reservations) <= pol.max_reservations
    reserved = [r.node for r in plan.reservations]
    assert len(reserved) == len(set(reserved))
