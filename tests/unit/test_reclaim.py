"""Stories for policy.reclaim: which running steps give their GPUs back, at the least cost, and why.

Defaults are boring on purpose: every step started 1,000 s before NOW with no checkpoint, priority 0,
no min_runtime, a 60 s restart; so a 1-GPU step costs 1,000 + 60 = 1,060 GPU-s to stop unless the
story says otherwise.
"""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Iterable

import pytest
from builders import gpu
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtide.domain.gpus import GpuRef, Node
from lowtide.policy.reclaim import (
    EXACT_SEARCH_MAX,
    Placement,
    ReclaimPlan,
    ReclaimRequest,
    ReplicaNeed,
    RunningVictim,
    plan_reclaim,
    victim_cost,
)

NOW = 10_000.0


def step(
    aid: int,
    where: str,
    *,
    started: float = NOW - 1000,
    ckpt: float | None = None,
    prio: int = 0,
    min_runtime: float = 0.0,
    restart: float = 60.0,
    stopping: bool = False,
) -> RunningVictim:
    """`where`: "n1:0,1" — the node and the GPU indices the step holds."""
    node, indices = where.split(":")
    gpus = tuple(int(i) for i in indices.split(","))
    return RunningVictim(
        aid, f"job-{aid}", "train", "nlp", prio, node, gpus, started, ckpt, min_runtime, restart, stopping
    )


def request(
    *,
    nodes: dict[str, int] | None = None,
    free: Iterable[str] = (),
    running: Iterable[RunningVictim] = (),
    needs: Iterable[ReplicaNeed] = (),
    excess: int = 0,
) -> ReclaimRequest:
    sizes = {"n1": 4} if nodes is None else nodes
    return ReclaimRequest(
        now=NOW,
        nodes=tuple(Node(name, tuple(range(n))) for name, n in sizes.items()),
        free=frozenset(gpu(ref) for ref in free),
        running=tuple(running),
        needs=tuple(needs),
        excess_lent_gpus=excess,
    )


def block(gpus: int, service: str = "chat", *, below_min: bool = False) -> ReplicaNeed:
    return ReplicaNeed(service, None, gpus, (), below_min)


def wake(replica_id: str, *refs: str, below_min: bool = False) -> ReplicaNeed:
    return ReplicaNeed(
        replica_id.partition("/")[0], replica_id, len(refs), tuple(gpu(r) for r in refs), below_min
    )


def chosen(plan: ReclaimPlan) -> list[tuple[int, str]]:
    return [(v.attempt_id, v.for_need) for v in plan.victims]


# --- cost ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("victim", "cost", "lost"),
    [
        (step(1, "n1:0"), 1060.0, 1000.0),  # no checkpoint: everything since the start is lost
        (step(1, "n1:0,1", ckpt=NOW - 100), 320.0, 200.0),  # 2 GPUs × (100 s + 60 s)
        (step(1, "n1:0", ckpt=NOW - 5000), 1060.0, 1000.0),  # a checkpoint from before the start
        (step(1, "n1:0", ckpt=NOW + 5), 60.0, 0.0),  # a clock ahead: never negative work
        (step(1, "n1:0,1,2,3", ckpt=NOW, restart=0.0), 0.0, 0.0),
    ],
)
def test_cost_is_work_since_the_last_checkpoint_plus_restart(
    victim: RunningVictim, cost: float, lost: float
) -> None:
    assert victim_cost(victim, NOW) == (cost, lost)


# --- choosing victims ------------------------------------------------------------------------------


def test_the_step_with_the_least_work_since_its_checkpoint_goes_and_says_why() -> None:
    req = request(
        running=[step(1, "n1:0,1", ckpt=NOW - 500), step(2, "n1:2,3", ckpt=NOW - 120)],
        needs=[ReplicaNeed("chat", "chat/1", 2)],
    )
    plan = plan_reclaim(req)
    assert chosen(plan) == [(2, "chat")]
    (victim,) = plan.victims
    assert (victim.node, victim.gpus, victim.cost_gpu_s, victim.lost_work_gpu_s) == (
        "n1",
        (2, 3),
        360.0,
        240.0,
    )
    assert victim.reason == (
        "frees n1 GPUs 2,3 for chat/1: 240 GPU-s of work since its last checkpoint + 120 GPU-s restart; "
        "cheapest of 1 node(s) that can hold 2 GPUs (n1: 360 GPU-s)"
    )
    assert plan.placements == (Placement(0, "n1", (2, 3)),)
    assert plan.unmet == ()


def test_restart_cost_counts() -> None:
    # Step 1 lost less work (100 s) but restarts slowly (400 s): 500 > 300 + 60.
    req = request(
        running=[step(1, "n1:0", ckpt=NOW - 100, restart=400), step(2, "n1:1", ckpt=NOW - 300)],
        needs=[block(1)],
    )
    assert chosen(plan_reclaim(req)) == [(2, "chat")]


def test_the_cheapest_node_wins_over_a_node_with_a_single_expensive_victim() -> None:
    req = request(
        nodes={"n1": 2, "n2": 2},
        running=[
            step(1, "n1:0", ckpt=NOW - 10),  # 70
            step(2, "n1:1", ckpt=NOW - 20),  # 80: n1 costs 150 for both
            step(3, "n2:0,1", ckpt=NOW - 100),  # 2 × 160 = 320
        ],
        needs=[block(2, service="code")],
    )
    plan = plan_reclaim(req)
    assert chosen(plan) == [(1, "code"), (2, "code")]
    assert plan.placements == (Placement(0, "n1", (0, 1)),)
    assert (
        "cheapest of 2 node(s) that can hold 2 GPUs (n1: 150 GPU-s; next n2: 320 GPU-s)"
        in plan.victims[0].reason
    )


def test_within_a_node_the_cheapest_combination_is_found_not_the_cheapest_per_gpu_first() -> None:
    # Need 3. Cheapest per GPU first would take steps 1 and 2 (100 + 120 = 220); 1 and 3 cost 170.
    req = request(
        nodes={"n1": 5},
        running=[
            step(1, "n1:0,1", ckpt=NOW - 50, restart=0),  # 100 (50 / GPU)
            step(2, "n1:2,3", ckpt=NOW - 60, restart=0),  # 120 (60 / GPU)
            step(3, "n1:4", ckpt=NOW - 70, restart=0),  # 70
        ],
        needs=[block(3)],
    )
    plan = plan_reclaim(req)
    assert chosen(plan) == [(1, "chat"), (3, "chat")]
    assert sum(v.cost_gpu_s for v in plan.victims) == 170.0
    assert plan.placements == (Placement(0, "n1", (0, 1, 4)),)


@pytest.mark.parametrize(
    ("n1_victim", "n2_victim", "winner"),
    [
        # Same cost: the less important victim (lower priority number) goes.
        ({"prio": 5}, {"prio": 3}, "n2"),
        ({"prio": 3}, {"prio": 5}, "n1"),
        # Same cost and priority: the most recently started goes (same checkpoint time).
        ({"started": NOW - 5000, "ckpt": NOW - 100}, {"started": NOW - 1000, "ckpt": NOW - 100}, "n2"),
        ({"started": NOW - 1000, "ckpt": NOW - 100}, {"started": NOW - 5000, "ckpt": NOW - 100}, "n1"),
        # Everything equal: node name (n1 is listed last, so this is not input order).
        ({}, {}, "n1"),
    ],
)
def test_ties_between_nodes(n1_victim: dict[str, float], n2_victim: dict[str, float], winner: str) -> None:
    req = request(
        nodes={"n2": 1, "n1": 1},
        running=[step(1, "n1:0", **n1_victim), step(2, "n2:0", **n2_victim)],  # type: ignore[arg-type]
        needs=[block(1)],
    )
    plan = plan_reclaim(req)
    assert [v.node for v in plan.victims] == [winner]
    assert plan.placements == (Placement(0, winner, (0,)),)


def test_a_tie_names_what_decided_it() -> None:
    req = request(
        nodes={"n1": 1, "n2": 1},
        running=[step(1, "n1:0", prio=5), step(2, "n2:0", prio=3)],
        needs=[block(1)],
    )
    (victim,) = plan_reclaim(req).victims
    assert victim.reason.endswith(
        "(n2: 1060 GPU-s; next n1: 1060 GPU-s, same cost: chosen by victims' priority)"
    )


def test_within_a_node_equally_cheap_sets_are_decided_by_priority_then_recency() -> None:
    req = request(
        running=[
            step(1, "n1:0", prio=7),
            step(2, "n1:1", prio=2),
            step(3, "n1:2", prio=2, started=NOW - 3000, ckpt=NOW - 1000),
            step(4, "n1:3", prio=9),
        ],
        needs=[block(1)],
    )
    assert chosen(plan_reclaim(req)) == [(2, "chat")]


def test_best_fit_breaks_a_tie_between_free_nodes() -> None:
    # Nothing to stop anywhere: keep the bigger free block whole.
    req = request(
        nodes={"n1": 4, "n2": 2}, free=["n1:0", "n1:1", "n1:2", "n1:3", "n2:0", "n2:1"], needs=[block(2)]
    )
    plan = plan_reclaim(req)
    assert plan.victims == ()
    assert plan.placements == (Placement(0, "n2", (0, 1)),)
    assert plan.notes == ("chat#0: fits on n2 without stopping another step",)


def test_free_gpus_are_used_before_victims_and_placement_takes_free_now_first() -> None:
    req = request(
        free=["n1:3"],
        running=[step(1, "n1:0,1", ckpt=NOW - 10), step(2, "n1:2", ckpt=NOW - 5000)],
        needs=[block(2)],
    )
    plan = plan_reclaim(req)
    assert chosen(plan) == [(1, "chat")]
    assert plan.placements == (Placement(0, "n1", (0, 3)),)  # n1:3 (free now) + the lowest freed GPU


def test_gpus_placed_for_one_need_are_not_available_to_the_next_but_leftovers_are() -> None:
    req = request(
        nodes={"n1": 4, "n2": 4},
        free=["n1:0"],
        running=[step(1, "n1:1,2,3", ckpt=NOW - 10), step(2, "n2:0", ckpt=NOW - 20), step(3, "n2:1,2,3")],
        needs=[block(1, "a"), block(1, "b"), block(2, "c"), block(1, "d")],
    )
    plan = plan_reclaim(req)
    # a takes the free GPU; b stops the cheapest single GPU (n2:0, 80 < n1's 3 × 70);
    # c stops step 1 (210 < 3 × 1060); d uses step 1's leftover GPU at no cost.
    assert chosen(plan) == [(2, "b"), (1, "c")]
    assert plan.placements == (
        Placement(0, "n1", (0,)),
        Placement(1, "n2", (0,)),
        Placement(2, "n1", (1, 2)),
        Placement(3, "n1", (3,)),
    )


# --- sleeping replicas: their own GPUs -----------------------------------------------------------


def test_an_exact_need_stops_every_step_on_the_replicas_gpus_however_costly() -> None:
    req = request(
        nodes={"n1": 8},
        running=[
            step(1, "n1:0,1", ckpt=NOW - 10),  # cheap, but not on the replica's GPUs
            step(2, "n1:2", started=NOW - 9000),
            step(3, "n1:3,4"),
        ],
        needs=[wake("chat/1", "n1:2", "n1:3"), block(1, "code")],
    )
    plan = plan_reclaim(req)
    assert chosen(plan) == [(2, "chat"), (3, "chat")]
    assert plan.victims[0].reason == (
        "frees n1 GPUs 2 for chat/1 (wake on its own GPUs): 9000 GPU-s of work since it started "
        "(no checkpoint) + 60 GPU-s restart"
    )
    # n1:4 (step 3's other GPU) is freeing anyway: the next need takes it at no cost.
    assert plan.placements == (Placement(0, "n1", (2, 3)), Placement(1, "n1", (4,)))


@pytest.mark.parametrize(
    ("free", "running", "needs", "why"),
    [
        (
            [],
            [step(1, "n1:0")],
            [wake("chat/1", "n1:0", "n1:1")],  # n1:1 is neither free nor a step's: a replica holds it
            "wake chat/1 on n1 GPUs 0,1: n1:1 is neither free nor held by a research step "
            "(a replica holds it?)",
        ),
        (
            [],
            [step(1, "n1:0", min_runtime=3600)],
            [wake("chat/1", "n1:0")],
            "wake chat/1 on n1 GPUs 0: n1:0 is held by job-1/train (attempt 1), within its min_runtime "
            "for another 2600s",
        ),
        (
            ["n1:0"],
            [],
            [block(1, "a"), wake("chat/1", "n1:0")],
            "wake chat/1 on n1 GPUs 0: n1:0 is already placed for a#0",
        ),
        ([], [step(1, "n1:0")], [wake("chat/1", "n9:0")], "wake chat/1 on n9 GPUs 0: n9 is not a known node"),
        (
            [],
            [step(1, "n1:0")],
            [wake("chat/1", "n1:7")],
            "wake chat/1 on n1 GPUs 7: n1:7 is not a GPU lowtide manages",
        ),
    ],
)
def test_an_exact_need_that_cannot_be_met_stops_nothing(
    free: list[str], running: list[RunningVictim], needs: list[ReplicaNeed], why: str
) -> None:
    plan = plan_reclaim(request(free=free, running=running, needs=needs))
    assert plan.unmet == ((len(needs) - 1, why),)
    assert [v for v in plan.victims if v.for_need == "chat"] == []


def test_an_exact_need_on_free_and_stopping_gpus_stops_nothing_new() -> None:
    req = request(
        free=["n1:0"], running=[step(1, "n1:1", stopping=True)], needs=[wake("chat/1", "n1:0", "n1:1")]
    )
    plan = plan_reclaim(req)
    assert plan.victims == ()
    assert plan.placements == (Placement(0, "n1", (0, 1)),)
    assert plan.notes == (
        "chat/1: uses GPUs of job-1/train (attempt 1), which already has notice (no new cost)",
        "chat/1: its own GPUs on n1 are free or freeing; nothing to stop",
    )


# --- min_runtime ------------------------------------------------------------------------------------


def test_a_step_within_its_min_runtime_is_spared_for_a_costlier_one() -> None:
    req = request(
        running=[step(1, "n1:0", started=NOW - 100, min_runtime=600), step(2, "n1:1", started=NOW - 5000)],
        needs=[block(1)],
    )
    assert chosen(plan_reclaim(req)) == [(2, "chat")]


def test_below_min_overrides_min_runtime_and_the_reason_says_so() -> None:
    req = request(
        running=[step(1, "n1:0", started=NOW - 100, min_runtime=600), step(2, "n1:1", started=NOW - 5000)],
        needs=[block(1, below_min=True)],
    )
    plan = plan_reclaim(req)
    assert chosen(plan) == [(1, "chat")]
    assert plan.victims[0].reason.endswith("; within its min_runtime, but chat is below min_replicas")


def test_min_runtime_ends_exactly_at_started_plus_min_runtime() -> None:
    ok = step(1, "n1:0", started=NOW - 600, min_runtime=600)
    assert not ok.protected(NOW)
    assert step(1, "n1:0", started=NOW - 599.5, min_runtime=600).protected(NOW)
    assert chosen(plan_reclaim(request(running=[ok], needs=[block(1)]))) == [(1, "chat")]


def test_everything_protected_means_unmet_with_the_reason_and_no_victims() -> None:
    req = request(
        free=["n1:0"],
        running=[step(1, "n1:1,2", started=NOW - 10, min_runtime=600), step(2, "n1:3")],
        needs=[block(4)],
    )
    plan = plan_reclaim(req)
    assert plan.victims == ()
    assert plan.placements == ()
    assert plan.unmet == (
        (
            0,
            "needs 4 GPUs on one node; no node can free that many even if every candidate step stopped: "
            "the best, n1, has 1 free or freeing and 1 held by steps that may stop; "
            "2 more are held by steps within their min_runtime",
        ),
    )


# --- steps that already have notice ----------------------------------------------------------------


def test_steps_already_stopping_are_reused_at_no_cost_and_never_chosen_again() -> None:
    req = request(
        nodes={"n1": 4, "n2": 4},
        running=[
            step(1, "n1:0,1", stopping=True, ckpt=NOW),
            step(2, "n1:2,3", ckpt=NOW - 30),
            step(3, "n2:0,1,2,3", ckpt=NOW - 1),
        ],
        needs=[block(4), block(2, "code")],
    )
    plan = plan_reclaim(req)
    # chat: n1 = stopping 2 + step 2 (2 × 90 = 180) beats n2 (4 × 61 = 244).
    assert chosen(plan) == [(2, "chat"), (3, "code")]
    assert plan.placements == (Placement(0, "n1", (0, 1, 2, 3)), Placement(1, "n2", (0, 1)))
    assert (
        "chat#0: uses GPUs of job-1/train (attempt 1), which already has notice (no new cost)" in plan.notes
    )


# --- lending shrank -----------------------------------------------------------------------------


def test_excess_lending_is_covered_cheapest_per_gpu_first() -> None:
    req = request(
        nodes={"n1": 4, "n2": 4},
        running=[
            step(1, "n1:0,1", ckpt=NOW - 40),  # 100 / GPU
            step(2, "n1:2", ckpt=NOW - 10),  # 70 / GPU
            step(3, "n1:3", ckpt=NOW - 10, started=NOW - 20, min_runtime=600),  # protected
            step(4, "n2:0,1,2,3", ckpt=NOW - 500),  # 560 / GPU
        ],
        excess=3,
    )
    plan = plan_reclaim(req)
    assert chosen(plan) == [(2, "lending"), (1, "lending")]
    assert plan.victims[0].reason == (
        "returns n1 GPUs 2: research holds 3 GPU(s) more than the lending envelope allows; cheapest per GPU "
        "of 3 candidate step(s) (70 GPU-s/GPU): 10 GPU-s of work since its last checkpoint + 60 GPU-s restart"
    )
    assert plan.notes == ()


def test_victims_for_needs_count_toward_the_excess() -> None:
    req = request(
        nodes={"n1": 4},
        running=[step(1, "n1:0,1", ckpt=NOW - 10), step(2, "n1:2,3", ckpt=NOW - 50)],
        needs=[block(2)],
        excess=2,
    )
    plan = plan_reclaim(req)
    assert chosen(plan) == [(1, "chat")]
    assert plan.notes == ("lending: 2 GPU(s) over the envelope are covered by the victims above",)


def test_excess_that_cannot_be_covered_is_reported() -> None:
    req = request(
        running=[
            step(1, "n1:0"),
            step(2, "n1:1", stopping=True),  # already on its way back: not counted again
            step(3, "n1:2,3", started=NOW - 1, min_runtime=60),
        ],
        excess=4,
    )
    plan = plan_reclaim(req)
    assert chosen(plan) == [(1, "lending")]
    assert plan.notes == (
        "lending: 3 GPU(s) over the envelope stay with research: every other step has notice already "
        "or is within its min_runtime",
    )


# --- unmet ------------------------------------------------------------------------------------------


def test_a_need_bigger_than_any_node_is_unmet_and_later_needs_are_still_served() -> None:
    req = request(nodes={"n1": 4, "n2": 8}, running=[step(1, "n1:0")], needs=[block(16), block(1, "code")])
    plan = plan_reclaim(req)
    assert plan.unmet == ((0, "needs 16 GPUs on one node; the largest node has 8"),)
    assert chosen(plan) == [(1, "code")]
    assert plan.placements == (Placement(1, "n1", (0,)),)


def test_gpus_held_by_replicas_make_a_need_unmet_without_victims() -> None:
    # n1: 2 GPUs held by replicas (neither free nor steps), 2 by a step: a 4-GPU replica cannot fit.
    req = request(running=[step(1, "n1:0,1")], needs=[block(4)])
    plan = plan_reclaim(req)
    assert plan.victims == ()
    assert plan.unmet == (
        (
            0,
            "needs 4 GPUs on one node; no node can free that many even if every candidate step stopped: "
            "the best, n1, has 0 free or freeing and 2 held by steps that may stop; "
            "2 are held by replicas, unavailable or placed for earlier needs",
        ),
    )


# --- above EXACT_SEARCH_MAX candidates: greedy ----------------------------------------------------


def test_a_node_with_many_candidates_is_searched_greedily_by_cost_per_gpu() -> None:
    assert EXACT_SEARCH_MAX == 12
    # 13 one-GPU steps at 100+/GPU and one 4-GPU step at 70/GPU; need 2. Greedy takes the 4-GPU step
    # (cheapest per GPU: 280); the exact optimum would be two 1-GPU steps (100 + 101 = 201).
    many = [step(i, f"n1:{i}", ckpt=NOW - 40 - i) for i in range(13)]
    big = step(99, "n1:13,14,15,16", ckpt=NOW - 10)
    plan = plan_reclaim(request(nodes={"n1": 17}, running=[*many, big], needs=[block(2)]))
    assert chosen(plan) == [(99, "chat")]
    # One fewer small step: exact search finds the optimum.
    plan = plan_reclaim(request(nodes={"n1": 17}, running=[*many[:11], big], needs=[block(2)]))
    assert chosen(plan) == [(0, "chat"), (1, "chat")]


def test_greedy_drops_victims_that_turn_out_unnecessary() -> None:
    # Need 4: greedy takes 1 GPU (50/GPU), then 4 GPUs (60/GPU); the first is then not needed.
    small = [step(i, f"n1:{i}", ckpt=NOW - 200) for i in range(12)]  # 260 / GPU
    req = request(
        nodes={"n1": 20},
        running=[
            *small,
            step(50, "n1:12", ckpt=NOW + 10, restart=50),
            step(51, "n1:13,14,15,16", restart=0, ckpt=NOW - 60),
        ],
        needs=[block(4)],
    )
    assert chosen(plan_reclaim(req)) == [(51, "chat")]


# --- bad input -------------------------------------------------------------------------------------


def test_inconsistent_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="held by attempts 1 and 2"):
        plan_reclaim(request(running=[step(1, "n1:0"), step(2, "n1:0,1")]))
    with pytest.raises(ValueError, match="both free and held by attempt 1"):
        plan_reclaim(request(free=["n1:0"], running=[step(1, "n1:0")]))
    with pytest.raises(ValueError, match="duplicate attempt id 1"):
        plan_reclaim(request(running=[step(1, "n1:0"), step(1, "n1:1")]))
    with pytest.raises(ValueError, match="duplicate node"):
        plan_reclaim(ReclaimRequest(NOW, (Node("n1", (0,)), Node("n1", (1,))), frozenset(), (), ()))
    with pytest.raises(ValueError, match="must be on one node"):
        ReplicaNeed("chat", "chat/0", 2, (GpuRef("n1", 0), GpuRef("n2", 0)))
    with pytest.raises(ValueError, match="must be 2 distinct GPUs"):
        ReplicaNeed("chat", "chat/0", 2, (GpuRef("n1", 0),))
    with pytest.raises(ValueError, match="at least 1 GPU"):
        ReplicaNeed("chat", None, 0)
    with pytest.raises(ValueError, match="duplicate GPUs"):
        step(1, "n1:0,0")


# --- properties ------------------------------------------------------------------------------------


@st.composite
def requests(draw: st.DrawFn) -> ReclaimRequest:
    """Small pools where every GPU is free, a replica's, a step's or a stopping step's; each need has
    its own service so that a victim's `for_need` names exactly one need."""
    nodes = tuple(
        Node(f"n{i}", tuple(range(draw(st.integers(1, 8))))) for i in range(draw(st.integers(1, 4)))
    )
    free: set[GpuRef] = set()
    running: list[RunningVictim] = []
    for node in nodes:
        order = draw(st.permutations(node.gpus))
        pos = 0
        while pos < len(order):
            size = draw(st.integers(1, min(4, len(order) - pos)))
            held = tuple(sorted(order[pos : pos + size]))
            pos += size
            kind = draw(st.sampled_from(["free", "replica", "step", "step", "step", "stopping"]))
            if kind == "free":
                free.update(GpuRef(node.name, i) for i in held)
            elif kind != "replica":
                started = NOW - draw(st.sampled_from([0.0, 100.0, 500.0, 2000.0]))
                ckpt = draw(st.sampled_from([None, 0.0, 50.0, 300.0]))
                running.append(
                    RunningVictim(
                        attempt_id=len(running) + 1,
                        job_id=f"job-{len(running) + 1}",
                        step="s",
                        team="t",
                        priority=draw(st.integers(0, 3)),
                        node=node.name,
                        gpus=held,
                        started_at=started,
                        last_checkpoint_at=None if ckpt is None else NOW - ckpt,
                        min_runtime_s=draw(st.sampled_from([0.0, 300.0, 1000.0])),
                        restart_s=draw(st.sampled_from([0.0, 30.0, 60.0])),
                        stopping=kind == "stopping",
                    )
                )
    needs = []
    for i in range(draw(st.integers(0, 4))):
        below = draw(st.booleans())
        if draw(st.booleans()):
            node = draw(st.sampled_from(nodes))
            own = draw(st.lists(st.sampled_from(node.gpus), min_size=1, max_size=4, unique=True))
            needs.append(
                ReplicaNeed(f"s{i}", f"s{i}/0", len(own), tuple(GpuRef(node.name, j) for j in own), below)
            )
        else:
            needs.append(ReplicaNeed(f"s{i}", None, draw(st.integers(1, 8)), (), below))
    return ReclaimRequest(NOW, nodes, frozenset(free), tuple(running), tuple(needs), draw(st.integers(0, 10)))


@settings(max_examples=400, deadline=None)
@given(requests())
def test_every_plan_keeps_the_invariants(req: ReclaimRequest) -> None:
    frozen = copy.deepcopy(req)
    plan = plan_reclaim(req)
    assert req == frozen  # a what-if leaves the request untouched, deeply
    assert plan_reclaim(req) == plan  # deterministic

    steps = {s.attempt_id: s for s in req.running}
    holder = {GpuRef(s.node, i): s for s in req.running for i in s.gpus}
    victims = {v.attempt_id: v for v in plan.victims}
    assert len(victims) == len(plan.victims)  # nobody is chosen twice
    met = {p.need_index for p in plan.placements}
    unmet = {i for i, _ in plan.unmet}
    assert met.isdisjoint(unmet) and met | unmet == set(range(len(req.needs)))
    assert len(met) == len(plan.placements)

    used: set[GpuRef] = set()
    for p in plan.placements:
        need = req.needs[p.need_index]
        refs = {GpuRef(p.node, i) for i in p.gpus}
        assert len(refs) == need.gpus == len(p.gpus)
        if need.exact:
            assert refs == set(need.exact)
        for ref in refs:  # each GPU is free now, or freed by a victim or a step already stopping
            s = holder.get(ref)
            assert ref in req.free or (s is not None and (s.stopping or s.attempt_id in victims))
        assert used.isdisjoint(refs)
        used |= refs

    by_service = {n.service: n for n in req.needs}
    unmet_services = {req.needs[i].service for i in unmet}
    for v in plan.victims:
        s = steps[v.attempt_id]
        assert not s.stopping and s.gpus
        assert (v.node, v.gpus) == (s.node, s.gpus)
        assert (v.cost_gpu_s, v.lost_work_gpu_s) == victim_cost(s, NOW)
        assert v.for_need not in unmet_services  # never preempt for nothing
        if s.protected(NOW):
            assert v.for_need != "lending" and by_service[v.for_need].below_min
        assert v.reason

    if req.excess_lent_gpus and not any("stay with research" in n for n in plan.notes):
        assert sum(len(v.gpus) for v in plan.victims) >= req.excess_lent_gpus


@settings(max_examples=200, deadline=None)
@given(requests(), st.randoms(use_true_random=False))
def test_the_plan_does_not_depend_on_input_order(req: ReclaimRequest, rnd: random.Random) -> None:
    nodes, running = list(req.nodes), list(req.running)
    rnd.shuffle(nodes)
    rnd.shuffle(running)
    shuffled = ReclaimRequest(
        req.now, tuple(nodes), req.free, tuple(running), req.needs, req.excess_lent_gpus
    )
    assert plan_reclaim(shuffled) == plan_reclaim(req)


def _brute_force_cost(req: ReclaimRequest, need: ReplicaNeed) -> int | None:
    """The least cost (1e-6 GPU-s) to fit `need` on one node, trying every subset of every node."""
    best: int | None = None
    for node in req.nodes:
        if len(node.gpus) < need.gpus:
            continue
        mine = [s for s in req.running if s.node == node.name]
        have = sum(GpuRef(node.name, i) in req.free for i in node.gpus)
        have += sum(len(s.gpus) for s in mine if s.stopping)
        cands = [s for s in mine if not s.stopping and (need.below_min or not s.protected(NOW))]
        for r in range(len(cands) + 1):
            for combo in itertools.combinations(cands, r):
                if have + sum(len(s.gpus) for s in combo) >= need.gpus:
                    cost = sum(round(victim_cost(s, NOW)[0] * 1_000_000) for s in combo)
                    best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=300, deadline=None)
@given(requests(), st.integers(1, 8), st.booleans())
def test_a_single_need_costs_what_the_best_subset_anywhere_costs(
    req: ReclaimRequest, gpus: int, below: bool
) -> None:
    need = ReplicaNeed("chat", None, gpus, (), below)
    req = ReclaimRequest(req.now, req.nodes, req.free, req.running, (need,))
    plan = plan_reclaim(req)
    best = _brute_force_cost(req, need)
    if best is None:
        assert plan.unmet and plan.victims == () and plan.placements == ()
    else:
        assert plan.unmet == ()
        assert sum(round(v.cost_gpu_s * 1_000_000) for v in plan.victims) == best
