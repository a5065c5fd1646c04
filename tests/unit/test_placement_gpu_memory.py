"""Stories for placement by GPU memory: a step that declares `gpu_memory_gib` goes only on GPUs
with that much left, a sleeping replica's residual counted (policy.placement, policy.scheduler)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from builders import placements, queued, running, waiting_reasons
from builders import policy as scheduler_policy
from builders import snapshot as base_snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtide.domain.gpus import GpuRef, Node
from lowtide.policy.lending import gpu_shares
from lowtide.policy.placement import FreeGpus
from lowtide.policy.plan import SchedulePlan
from lowtide.policy.scheduler import decide
from lowtide.policy.snapshot import QueuedStep, RunningStep, Snapshot


def world(
    nodes: dict[str, tuple[int, float | None]],
    *,
    sleeping: Sequence[tuple[str, tuple[int, ...], float]] = (),
    queued_steps: Sequence[QueuedStep] = (),
    running_steps: Sequence[RunningStep] = (),
) -> Snapshot:
    """Nodes as name -> (GPU count, GiB per GPU or None); sleeping replicas as (node, GPUs, residual)."""
    pool = tuple(Node(name, tuple(range(count)), memory) for name, (count, memory) in nodes.items())
    snap = base_snapshot(nodes={}, queued=queued_steps, running=running_steps)
    return replace(snap, nodes=pool, gpu_shares=gpu_shares(pool, sleeping))


def decided(snap: Snapshot, reservations: int = 0) -> SchedulePlan:
    return decide(snap, scheduler_policy(max_reservations=reservations))


# --- placement: the memory a step needs ---------------------------------------------------------


def test_a_need_is_met_only_on_gpus_with_enough_memory_left() -> None:
    # a: 4 free GPUs under a sleeping replica holding 8 of 76 GiB -> 68 left; b: 2 of 4 free, whole.
    snap = world(
        {"a": (4, 76.0), "b": (4, 76.0)},
        sleeping=[("a", (0, 1, 2, 3), 8.0)],
        running_steps=[running("b", [0, 1])],
        queued_steps=[
            queued("big", gpus=2, gpu_memory_gib=70.0),
            queued("fits", gpus=2, gpu_memory_gib=60.0, submitted_at=1.0),
        ],
    )
    got = placements(decided(snap))
    assert got["big/train"] == ("b", (2, 3))  # 70 > 68: not on a, although a is the larger block
    assert got["fits/train"] == ("a", (0, 1))  # 60 <= 68


def test_the_waiting_reason_says_memory_holds_the_step_back() -> None:
    snap = world(
        {"a": (4, 76.0)},
        sleeping=[("a", (0, 1, 2, 3), 8.0)],
        queued_steps=[queued("big", gpus=4, gpu_memory_gib=70.0)],
    )
    plan = decided(snap)
    assert plan.starts == ()
    assert waiting_reasons(plan)["big/train"] == (
        "needs 70 GiB per GPU (4 GPUs on one node): 4 GPUs under sleeping replicas have "
        "76 − 8 = 68 GiB free; no node has 4 GPUs with that much that can be lent now"
    )


def test_a_step_that_needs_memory_reserves_only_a_node_whose_gpus_can_hold_it() -> None:
    # a: the most free GPUs, but all of them under the sleeping replica (68 GiB left);
    # b: 1 of 4 free: the step (4 GPUs, 70 GiB) can only ever run on b, so b is what it reserves.
    snap = world(
        {"a": (4, 76.0), "b": (4, 76.0)},
        sleeping=[("a", (0, 1, 2, 3), 8.0)],
        running_steps=[running("b", [0, 1, 2])],
        queued_steps=[queued("big", gpus=4, gpu_memory_gib=70.0)],
    )
    plan = decided(snap, reservations=1)
    assert [(r.job_id, r.node) for r in plan.reservations] == [("big", "b")]
    assert waiting_reasons(plan)["big/train"].startswith(
        "head of the queue: waiting for 3 more GPUs with 70 GiB free on b"
    )


def test_unknown_memory_under_a_sleeping_replica_is_refused_to_a_need_and_lent_to_whole_gpu_steps() -> None:
    snap = world(
        {"a": (2, None)},
        sleeping=[("a", (0, 1), 8.0)],
        queued_steps=[
            queued("needs", gpus=1, gpu_memory_gib=10.0),
            queued("plain", gpus=1, submitted_at=1.0),
        ],
    )
    plan = decided(snap)
    assert placements(plan) == {"plain/train": ("a", (0,))}
    reason = waiting_reasons(plan)["needs/train"]
    assert reason.startswith(
        "needs 10 GiB per GPU (1 GPU on one node): 2 GPUs under sleeping replicas hold 8 GiB of an "
        "unknown GPU memory (not lent to a step that declares a need"
    )


def test_a_gpu_under_no_sleeping_replica_is_whole_even_when_its_memory_is_unknown() -> None:
    snap = world({"a": (2, None)}, queued_steps=[queued("needs", gpus=2, gpu_memory_gib=500.0)])
    assert placements(decided(snap)) == {"needs/train": ("a", (0, 1))}


def test_a_node_whose_gpus_are_too_small_is_skipped() -> None:
    snap = world(
        {"a": (2, 40.0), "b": (4, 80.0)},
        queued_steps=[
            queued("needs", gpus=2, gpu_memory_gib=48.0),
            queued("small", gpus=2, submitted_at=1.0),
        ],
    )
    got = placements(decided(snap))
    assert got["needs/train"] == ("b", (0, 1))  # best fit would be a (2 free), but 40 < 48
    assert got["small/train"] == ("a", (0, 1))


# --- placement: the tie-break for steps without a need --------------------------------------------


def test_among_equal_fits_a_step_without_a_need_prefers_gpus_under_no_sleeping_replica() -> None:
    snap = world(
        {"a": (2, 76.0), "b": (2, 76.0)},
        sleeping=[("a", (0,), 8.0)],
        queued_steps=[queued("plain", gpus=2)],
    )
    assert placements(decided(snap)) == {"plain/train": ("b", (0, 1))}  # a comes first by name


def test_within_a_node_gpus_under_a_sleeping_replica_are_taken_last() -> None:
    snap = world({"a": (4, 76.0)}, sleeping=[("a", (0, 1), 8.0)], queued_steps=[queued("plain", gpus=2)])
    assert placements(decided(snap)) == {"plain/train": ("a", (2, 3))}


def test_the_tie_break_does_not_override_best_fit() -> None:
    # a has 2 free, both under the sleeping replica; b has 4 free: best fit still takes a.
    snap = world(
        {"a": (2, 76.0), "b": (4, 76.0)},
        sleeping=[("a", (0, 1), 8.0)],
        queued_steps=[queued("plain", gpus=2)],
    )
    assert placements(decided(snap)) == {"plain/train": ("a", (0, 1))}


def test_without_sleeping_replicas_free_gpus_answer_as_before() -> None:
    snap = world({"a": (4, 76.0), "b": (2, None)}, running_steps=[running("a", [1])])
    free = FreeGpus.from_snapshot(snap)
    assert not free.has_shares()
    assert free.best_fit(2) == "b"
    assert free.capacity_for("a", 80.0) == 0
    assert free.capacity_for("a", 76.0) == 4
    assert free.capacity_for("b", 1000.0) == 2
    assert free.take("a", 2) == (0, 2)


def test_capacity_for_a_need_counts_only_gpus_with_that_much_left() -> None:
    snap = world({"a": (4, 76.0)}, sleeping=[("a", (0, 1), 8.0)], running_steps=[running("a", [2])])
    free = FreeGpus.from_snapshot(snap)
    assert free.capacity_for("a", 60.0) == 4
    assert free.capacity_for("a", 70.0) == 2  # GPUs 2 (held by a step now) and 3
    assert free.free_for("a", 70.0) == 1
    assert free.largest_free_block(need_gib=70.0) == 1
    assert free.take("a", 1, 70.0) == (3,)
    assert free.free_indices("a") == (0, 1)


# --- properties -------------------------------------------------------------------------------------

_MEMORY = st.sampled_from([None, 40.0, 80.0])
_NODE = st.tuples(st.integers(1, 4), _MEMORY, st.sets(st.integers(0, 3)), st.sets(st.integers(0, 3)))


@settings(max_examples=300, deadline=None)
@given(
    nodes=st.lists(_NODE, min_size=1, max_size=4),
    gpus=st.integers(1, 4),
    need=st.sampled_from([None, 10.0, 39.0, 70.0, 79.0]),
    residual=st.sampled_from([2.5, 8.0, 45.0]),
)
def test_best_fit_with_a_need_is_sound_complete_and_still_best_fit(
    nodes: list[tuple[int, float | None, set[int], set[int]]],
    gpus: int,
    need: float | None,
    residual: float,
) -> None:
    """Whatever the pool: the GPUs taken all have the need left, a node is found whenever one has
    enough such GPUs free, and it has the fewest free GPUs among those that do."""
    spec = {f"n{k}": (count, memory) for k, (count, memory, _, _) in enumerate(nodes)}
    sleeping = [
        (f"n{k}", tuple(sorted(i for i in asleep if i < count)), residual)
        for k, (count, _, asleep, _) in enumerate(nodes)
        if any(i < count for i in asleep)
    ]
    busy = [
        running(f"n{k}", sorted(i for i in held if i < count)) for k, (count, _, _, held) in enumerate(nodes)
    ]
    snap = world(spec, sleeping=sleeping, running_steps=[r for r in busy if r.gpus])
    free = FreeGpus.from_snapshot(snap)
    memory = {f"n{k}": m for k, (_, m, _, _) in enumerate(nodes)}

    def allowed(node: str, i: int) -> bool:
        if need is None:
            return True
        share = snap.gpu_shares.get(GpuRef(node, i))
        if share is not None:
            return share.limit_gib is not None and share.limit_gib >= need
        return memory[node] is None or memory[node] >= need  # type: ignore[operator]

    eligible = {n: [i for i in free.free_indices(n) if allowed(n, i)] for n in free.nodes()}
    fitting = [n for n, idx in eligible.items() if len(idx) >= gpus]
    chosen = free.best_fit(gpus, need_gib=need)
    if not fitting:
        assert chosen is None
        return
    assert chosen is not None
    assert free.free_count(chosen) == min(free.free_count(n) for n in fitting)
    taken = free.take(chosen, gpus, need)
    assert len(taken) == gpus and all(allowed(chosen, i) for i in taken)
