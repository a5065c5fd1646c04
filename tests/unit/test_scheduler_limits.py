"""Stories for the limits of policy.scheduler.decide: CPU-only steps per node and per user, and
team GPU quotas with borrowing of idle GPUs only."""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import placements, queued, running, snapshot, start_reasons, started, waiting_reasons
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtide.policy.scheduler import SchedulerPolicy, decide


def limits(**kw: object) -> SchedulerPolicy:
    return SchedulerPolicy(**kw)  # type: ignore[arg-type]


# --- CPU-only steps -------------------------------------------------------------------------------


def test_without_limits_cpu_only_steps_all_start_on_the_first_node() -> None:
    snap = snapshot(
        nodes={"n2": 2, "n1": 2}, queued=[queued(f"j{i}", gpus=0, submitted_at=i) for i in range(5)]
    )
    plan = decide(snap, limits())
    assert len(plan.starts) == 5
    assert {node for node, _ in placements(plan).values()} == {"n1"}
    assert start_reasons(plan)["j0/train"] == "needs no GPUs: runs on n1"


def test_a_node_runs_at_most_its_limit_of_cpu_only_steps_counting_those_running() -> None:
    snap = snapshot(
        nodes={"n1": 2},
        running=[running("n1", [], job_id="old", step=f"s{i}", owner="bob") for i in range(2)],
        queued=[queued(f"j{i}", gpus=0, submitted_at=i, owner="alice") for i in range(4)],
    )
    plan = decide(snap, limits(max_cpu_steps_per_node=3))
    assert started(plan) == ["j0/train"]
    assert waiting_reasons(plan) == {
        f"j{i}/train": "node limit of 3 CPU-only steps reached" for i in (1, 2, 3)
    }


def test_a_full_node_sends_cpu_only_steps_to_the_next_node_by_name() -> None:
    snap = snapshot(
        nodes={"b": 1, "a": 1, "c": 1},
        running=[running("a", [], job_id="old", step="s0")],
        queued=[queued(f"j{i}", gpus=0, submitted_at=i) for i in range(4)],
    )
    plan = decide(snap, limits(max_cpu_steps_per_node=1))
    assert placements(plan) == {"j0/train": ("b", ()), "j1/train": ("c", ())}
    assert set(waiting_reasons(plan).values()) == {"node limit of 1 CPU-only steps reached on all 3 nodes"}


def test_stopping_cpu_only_steps_still_count_and_gpu_steps_do_not() -> None:
    stopping = replace(running("n1", [], job_id="old", step="s0"), stopping=True)
    snap = snapshot(
        nodes={"n1": 4},
        running=[stopping, running("n1", [0, 1], job_id="gpu-job")],
        queued=[queued("j0", gpus=0), queued("j1", gpus=0, submitted_at=1)],
    )
    plan = decide(snap, limits(max_cpu_steps_per_node=2))
    assert started(plan) == ["j0/train"]
    assert waiting_reasons(plan) == {"j1/train": "node limit of 2 CPU-only steps reached"}


def test_a_user_runs_at_most_their_limit_and_others_still_start() -> None:
    snap = snapshot(
        nodes={"n1": 1},
        running=[running("n1", [], job_id="old", step="s0", owner="alice")],
        queued=[queued(f"a{i}", gpus=0, submitted_at=i, owner="alice") for i in range(3)]
        + [queued("b0", gpus=0, submitted_at=10, owner="bob")],
    )
    plan = decide(snap, limits(max_cpu_steps_per_user=2))
    assert started(plan) == ["a0/train", "b0/train"]
    assert waiting_reasons(plan) == {
        "a1/train": "user alice has 2 CPU-only steps running, the limit",
        "a2/train": "user alice has 2 CPU-only steps running, the limit",
    }


def test_gpu_steps_are_not_held_up_by_the_cpu_limits() -> None:
    snap = snapshot(
        nodes={"n1": 2},
        queued=[queued(f"c{i}", gpus=0, submitted_at=i, owner="alice") for i in range(3)]
        + [queued("g", gpus=2, submitted_at=10, owner="alice")],
    )
    plan = decide(snap, limits(max_cpu_steps_per_node=1, max_cpu_steps_per_user=1))
    assert started(plan) == ["c0/train", "g/train"]


@settings(max_examples=60, deadline=None)
@given(
    per_node=st.integers(1, 5),
    per_user=st.one_of(st.none(), st.integers(1, 5)),
    nodes=st.integers(1, 3),
    running_owners=st.lists(st.sampled_from(["alice", "bob", "carol"]), max_size=8),
    queued_owners=st.lists(st.sampled_from(["alice", "bob", "carol"]), max_size=30),
)
def test_cpu_limits_hold_whatever_the_queue(
    per_node: int, per_user: int | None, nodes: int, running_owners: list[str], queued_owners: list[str]
) -> None:
    names = [f"n{i}" for i in range(nodes)]
    runs = [
        running(names[i % nodes], [], job_id="r", step=f"s{i}", owner=o) for i, o in enumerate(running_owners)
    ]
    snap = snapshot(
        nodes=dict.fromkeys(names, 1),
        running=runs,
        queued=[queued(f"q{i}", gpus=0, submitted_at=i, owner=o) for i, o in enumerate(queued_owners)],
    )
    plan = decide(snap, limits(max_cpu_steps_per_node=per_node, max_cpu_steps_per_user=per_user))
    owner_of = {f"q{i}/train": o for i, o in enumerate(queued_owners)}
    for name in names:
        before = sum(r.node == name for r in runs)
        added = sum(s.node == name for s in plan.starts)
        assert added == 0 or before + added <= per_node
    for user in ("alice", "bob", "carol"):
        before = running_owners.count(user)
        added = sum(owner_of[f"{s.job_id}/{s.step}"] == user for s in plan.starts)
        assert per_user is None or added == 0 or before + added <= per_user
    # Every queued step is either started or waiting, with a reason.
    assert len(plan.starts) + len(plan.waiting) == len(queued_owners)
    # Nothing waits while its node and its user both have room.
    if plan.waiting:
        used = {n: sum(r.node == n for r in runs) + sum(s.node == n for s in plan.starts) for n in names}
        for w in plan.waiting:
            user = owner_of[f"{w.job_id}/{w.step}"]
            user_count = running_owners.count(user) + sum(
                owner_of[f"{s.job_id}/{s.step}"] == user for s in plan.starts
            )
            assert (per_user is not None and user_count >= per_user) or all(
                used[n] >= per_node for n in names
            )


def test_the_policy_refuses_a_limit_below_one() -> None:
    with pytest.raises(ValueError, match="max_cpu_steps_per_node"):
        limits(max_cpu_steps_per_node=0)
    with pytest.raises(ValueError, match="quota of team 'nlp'"):
        limits(team_quotas={"nlp": -1})


# --- team quotas ----------------------------------------------------------------------------------


def test_teams_without_a_quota_are_not_limited() -> None:
    snap = snapshot(
        nodes={"n1": 8}, queued=[queued(f"j{i}", team="cv", gpus=2, submitted_at=i) for i in range(4)]
    )
    plan = decide(snap, limits(team_quotas={"nlp": 1}))
    assert len(plan.starts) == 4


def test_a_team_at_its_quota_borrows_idle_gpus_nobody_within_quota_wants() -> None:
    snap = snapshot(
        nodes={"n1": 8},
        running=[running("n1", [0, 1, 2, 3], job_id="nlp-run", team="nlp")],
        queued=[queued("nlp-more", team="nlp", gpus=2)],
    )
    plan = decide(snap, limits(team_quotas={"nlp": 4}))
    assert started(plan) == ["nlp-more/train"]
    assert start_reasons(plan)["nlp-more/train"].endswith("; borrowed: team nlp is beyond its quota of 4")


def test_steps_within_quota_go_before_borrowing_ones_whatever_the_priority() -> None:
    snap = snapshot(
        nodes={"n1": 8},
        running=[running("n1", [0, 1, 2, 3], job_id="nlp-run", team="nlp")],
        queued=[
            queued("nlp-urgent", team="nlp", gpus=2, priority=90, submitted_at=0),
            queued("cv-low", team="cv", gpus=4, priority=10, submitted_at=50),
        ],
    )
    plan = decide(snap, limits(team_quotas={"nlp": 4, "cv": 4}))
    assert started(plan) == ["cv-low/train"]
    assert waiting_reasons(plan) == {
        "nlp-urgent/train": "team nlp is at its quota of 4 GPUs (borrowing only idle GPUs); no free GPUs"
    }


def test_a_borrowing_step_never_takes_the_node_held_for_a_step_within_quota() -> None:
    # cv (within quota) needs 4 on one node: n1 has 3 free and is held for it; nlp borrows on n2.
    snap = snapshot(
        nodes={"n1": 4, "n2": 4},
        running=[
            running("n1", [0], job_id="cv-run", team="cv"),
            running("n2", [0, 1, 2], job_id="nlp-run", team="nlp"),
        ],
        queued=[
            queued("cv-big", team="cv", gpus=4, submitted_at=0),
            queued("nlp-a", team="nlp", gpus=1, submitted_at=1),
            queued("nlp-b", team="nlp", gpus=1, submitted_at=2),
        ],
    )
    plan = decide(snap, limits(team_quotas={"nlp": 3, "cv": 8}))
    assert placements(plan) == {"nlp-a/train": ("n2", (3,))}
    reasons = waiting_reasons(plan)
    assert reasons["cv-big/train"].startswith("head of the queue: waiting for 1 more GPU on n1")
    assert reasons["nlp-b/train"].startswith(
        "team nlp is at its quota of 3 GPUs (borrowing only idle GPUs); "
    )


def test_a_step_that_would_cross_the_quota_borrows_and_says_how_far() -> None:
    snap = snapshot(
        nodes={"n1": 8},
        running=[
            running("n1", [0, 1, 2], job_id="nlp-run", team="nlp"),
            running("n1", [3, 4, 5, 6, 7], job_id="cv-run", team="cv"),
        ],
        queued=[queued("nlp-wide", team="nlp", gpus=2)],
    )
    plan = decide(snap, limits(team_quotas={"nlp": 4}))
    assert waiting_reasons(plan) == {
        "nlp-wide/train": "team nlp would exceed its quota of 4 GPUs "
        "(holds 3, needs 2; borrowing only idle GPUs); no free GPUs"
    }


def test_gpus_started_in_this_decision_count_against_the_quota() -> None:
    snap = snapshot(
        nodes={"n1": 4}, queued=[queued(f"j{i}", team="nlp", gpus=1, submitted_at=i) for i in range(4)]
    )
    plan = decide(snap, limits(team_quotas={"nlp": 2}))
    # Two within quota, then two borrowing the idle rest.
    assert started(plan) == ["j0/train", "j1/train", "j2/train", "j3/train"]
    reasons = start_reasons(plan)
    assert "borrowed" not in reasons["j1/train"] and "borrowed" in reasons["j2/train"]


def test_borrowing_teams_share_the_idle_gpus_by_fair_share() -> None:
    snap = snapshot(
        nodes={"n1": 4},
        queued=[queued(f"a{i}", team="a", gpus=1, submitted_at=i) for i in range(4)]
        + [queued(f"b{i}", team="b", gpus=1, submitted_at=10 + i) for i in range(4)],
    )
    plan = decide(snap, limits(team_quotas={"a": 0, "b": 0}))
    assert started(plan) == ["a0/train", "b0/train", "a1/train", "b1/train"]


def test_cpu_only_steps_are_not_counted_against_gpu_quotas() -> None:
    snap = snapshot(
        nodes={"n1": 2}, queued=[queued("c", team="nlp", gpus=0), queued("g", team="nlp", gpus=1)]
    )
    plan = decide(snap, limits(team_quotas={"nlp": 1}))
    assert started(plan) == ["c/train", "g/train"]
    assert "borrowed" not in start_reasons(plan)["g/train"]
