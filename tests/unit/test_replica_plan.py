"""Replica planning and the GPUs offered to research: pure tables."""

from __future__ import annotations

from lowtide.domain.gpus import GpuRef, Node
from lowtide.domain.services import ServiceSpec
from lowtide.domain.states import ReplicaState
from lowtide.policy.replicas import ReplicaView, ServiceView, plan_replicas, research_gpus

R = ReplicaState
NODES = (Node("n1", (0, 1, 2, 3)), Node("n2", (0, 1, 2, 3, 4, 5, 6, 7)))
SPEC = ServiceSpec(name="llama", model="m", gpus_per_replica=4, min_replicas=1, max_replicas=3, park="sleep")


def slots(*states: tuple[ReplicaState | None, dict[str, object]]) -> tuple[ReplicaView, ...]:
    out = []
    for slot, (state, kw) in enumerate(states):
        out.append(ReplicaView(f"llama/{slot}", "llama", slot, state, **kw))  # type: ignore[arg-type]
    return tuple(out)


def kinds(plan: object) -> list[tuple[str, str, str | None, tuple[int, ...]]]:
    return [(a.kind, a.replica_id, a.node, a.gpus) for a in plan.actions]  # type: ignore[attr-defined]


def test_new_replicas_start_on_best_fit_blocks() -> None:
    svc = ServiceView(SPEC, 2, slots((None, {}), (None, {}), (None, {})))
    plan = plan_replicas([svc], NODES, frozenset(), now=0)
    assert kinds(plan) == [("start", "llama/0", "n1", (0, 1, 2, 3)), ("start", "llama/1", "n2", (0, 1, 2, 3))]
    assert plan.blocked == ()


def test_a_sleeping_replica_is_woken_on_its_own_gpus_before_anything_starts() -> None:
    svc = ServiceView(
        SPEC,
        2,
        slots(
            (R.SERVING, {"node": "n1", "gpus": (0, 1, 2, 3)}),
            (R.PARKED, {"node": "n2", "gpus": (4, 5, 6, 7), "parked_as": "sleep"}),
            (None, {}),
        ),
    )
    busy = frozenset(GpuRef("n1", i) for i in range(4))
    assert kinds(plan_replicas([svc], NODES, busy, now=0)) == [("wake", "llama/1", "n2", (4, 5, 6, 7))]


def test_a_sleeping_replica_whose_gpus_are_lent_is_reported_and_another_slot_starts() -> None:
    svc = ServiceView(
        SPEC,
        2,
        slots(
            (R.SERVING, {"node": "n1", "gpus": (0, 1, 2, 3)}),
            (R.PARKED, {"node": "n2", "gpus": (4, 5, 6, 7), "parked_as": "sleep"}),
            (None, {}),
        ),
    )
    busy = frozenset(GpuRef("n1", i) for i in range(4)) | {GpuRef("n2", 5)}
    plan = plan_replicas([svc], NODES, busy, now=0)
    assert kinds(plan) == [("start", "llama/2", "n2", (0, 1, 2, 3))]
    busy |= {GpuRef("n2", 0), GpuRef("n2", 1), GpuRef("n2", 2), GpuRef("n2", 6)}
    plan = plan_replicas([svc], NODES, busy, now=0)
    assert kinds(plan) == []
    assert len(plan.blocked) == 1 and plan.blocked[0].missing == 1
    assert "llama/1 sleeps on n2 GPUs 4,5,6,7, which are in use" in plan.blocked[0].reason
    assert "largest free block is 3" in plan.blocked[0].reason


def test_too_many_replicas_drain_the_least_busy_then_park_when_drained_or_timed_out() -> None:
    replicas = slots(
        (R.SERVING, {"node": "n1", "gpus": (0, 1, 2, 3), "in_flight": 5}),
        (R.SERVING, {"node": "n2", "gpus": (0, 1, 2, 3), "in_flight": 1}),
        (None, {}),
    )
    plan = plan_replicas([ServiceView(SPEC, 1, replicas)], NODES, frozenset(), now=0)
    assert kinds(plan) == [("drain", "llama/1", "n2", (0, 1, 2, 3))]
    draining = slots(
        (R.SERVING, {"node": "n1", "gpus": (0, 1, 2, 3)}),
        (R.DRAINING, {"node": "n2", "gpus": (0, 1, 2, 3), "in_flight": 2, "since": 100.0}),
        (None, {}),
    )
    view = ServiceView(SPEC, 1, draining, drain_timeout_s=30)
    assert kinds(plan_replicas([view], NODES, frozenset(), now=110)) == []  # still draining
    assert kinds(plan_replicas([view], NODES, frozenset(), now=131))[0][0] == "park"  # timeout
    done = slots(
        (R.SERVING, {}), (R.DRAINING, {"node": "n2", "gpus": (0, 1, 2, 3), "since": 100.0}), (None, {})
    )
    plan = plan_replicas([ServiceView(SPEC, 1, done)], NODES, frozenset(), now=101)
    assert [(a.kind, a.reason) for a in plan.actions] == [("park", "drained; park: sleep")]


def test_a_draining_replica_is_taken_back_when_needed_again() -> None:
    replicas = slots(
        (R.SERVING, {}), (R.DRAINING, {"node": "n2", "gpus": (0, 1, 2, 3), "in_flight": 3}), (None, {})
    )
    plan = plan_replicas([ServiceView(SPEC, 2, replicas)], NODES, frozenset(), now=0)
    assert kinds(plan) == [("undrain", "llama/1", "n2", (0, 1, 2, 3))]


def test_failed_replicas_restart_only_after_their_backoff() -> None:
    replicas = slots((R.FAILED, {"retry_at": 50.0}), (None, {}), (None, {}))
    plan = plan_replicas([ServiceView(SPEC, 1, replicas)], NODES, frozenset(), now=10)
    assert kinds(plan) == [("start", "llama/1", "n1", (0, 1, 2, 3))]  # another slot meanwhile
    only = ServiceView(SPEC, 1, slots((R.FAILED, {"retry_at": 50.0})))
    plan = plan_replicas([only], NODES, frozenset(), now=10)
    assert kinds(plan) == [] and "retry in 40s" in plan.blocked[0].reason
    plan = plan_replicas([only], NODES, frozenset(), now=50)
    assert kinds(plan)[0][:2] == ("start", "llama/0")


def test_research_gets_at_most_the_lendable_count_preferring_whole_nodes_and_no_sleeping_gpus() -> None:
    busy = frozenset({GpuRef("n1", 0)})
    affinity = frozenset(GpuRef("n2", i) for i in range(4))
    offered = research_gpus(NODES, busy=busy, reserved=frozenset(), affinity=affinity, new_lendable=6)
    assert offered == frozenset(GpuRef("n2", i) for i in range(4, 8)) | {GpuRef("n1", 1), GpuRef("n1", 2)}
    assert (
        research_gpus(NODES, busy=busy, reserved=frozenset(), affinity=affinity, new_lendable=0)
        == frozenset()
    )
    everything = research_gpus(NODES, busy=busy, reserved=frozenset(), affinity=frozenset(), new_lendable=99)
    assert len(everything) == 11 and GpuRef("n1", 0) not in everything
