"""What the simulator's speed-ups remember must never differ from what they stand for.

`policy.placement._usable` remembers the usable GPUs per node by the identity of its arguments;
`sim.ports.SimExecutor` keeps the GPUs its steps hold, the earliest exit and the earliest time a
checkpoint can be due instead of recomputing them every tick. The inference decision keeps its
last GPUs research may not use (`_not_offered`, by value over frozen copies; `_all_offered`, the
shortcut when every idle GPU is offered), the running steps' GPUs (`_step_gpus`, by the identity
of the kept tuple), and `gpu_shares`, the autoscaler's sums and the research offer were rewritten
for speed. The simulator's metrics hand back the same replica-signals tuple while the load and
the replicas stay the same, and the autoscaler keeps its sums for a repeated tuple (`_sums`).
Each is checked here against the plain computation, over sequences where the remembered value
would go stale if it were kept too long.
"""

from __future__ import annotations

import gc
import math
from dataclasses import astuple, dataclass, field, fields, replace
from types import MappingProxyType

import pytest
from builders import running, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtide.control.executor_port import LaunchRequest
from lowtide.control.inference_ports import ReplicaLaunch
from lowtide.domain.gpus import GpuRef, Node
from lowtide.domain.metrics import ReplicaSignals, ServiceSignals
from lowtide.domain.services import AutoscaleTargets, ServiceSpec
from lowtide.domain.spec_parse import build_job_spec
from lowtide.domain.states import ReplicaState
from lowtide.policy import inference as decide
from lowtide.policy.autoscale import ReplicaSupply, _total, decide_scale, initial_state
from lowtide.policy.evolve import evolve
from lowtide.policy.inference_snapshot import InferenceMemory
from lowtide.policy.lending import GpuShare, gpu_shares
from lowtide.policy.placement import FreeGpus
from lowtide.policy.replicas import ReplicaView, research_offer
from lowtide.policy.snapshot import Snapshot
from lowtide.sim.capacity import derive_replica_capacity, service_signals
from lowtide.sim.fleet import FleetOptions, default_scenario
from lowtide.sim.jobs import ResearchJob
from lowtide.sim.load import LoadCurve
from lowtide.sim.ports import ReplicaTimes, SimExecutor, SimMetrics, SimServiceManager, StepBehaviour
from lowtide.sim.world import SimWorld, cyclic_gc_paused
from lowtide.store.memory.values import SortedIndex


def test_free_gpus_follow_a_new_unavailable_set_on_the_same_nodes() -> None:
    first = snapshot(nodes={"n1": 4, "n2": 2}, unavailable=["n1:3"])
    again = snapshot(nodes={"n1": 4, "n2": 2}, unavailable=["n1:0", "n2:1"])
    # the same nodes object, a different unavailable set: nothing remembered may leak across
    second = type(first)(now=again.now, nodes=first.nodes, unavailable=again.unavailable)
    assert FreeGpus.from_snapshot(first).free_indices("n1") == (0, 1, 2)
    assert FreeGpus.from_snapshot(second).free_indices("n1") == (1, 2, 3)
    assert FreeGpus.from_snapshot(second).free_indices("n2") == (0,)
    assert FreeGpus.from_snapshot(first).free_indices("n2") == (0, 1)
    busy = type(first)(
        now=first.now, nodes=first.nodes, unavailable=first.unavailable, running=(running("n1", [1]),)
    )
    assert FreeGpus.from_snapshot(busy).free_indices("n1") == (0, 2)
    assert FreeGpus.from_snapshot(busy).capacity("n1") == 3


def _request(attempt_id: int, gpus: int) -> LaunchRequest:
    return LaunchRequest(
        attempt_id=attempt_id,
        job_id=f"job-{attempt_id}",
        step="train",
        attempt=1,
        node="n1",
        gpus=tuple(range(gpus)),
        command=("simulated",),
        image=None,
        env={},
        work_dir="w",
        log_path="l",
        notice_path="n",
    )


def _plain_due(ex: SimExecutor, now: float) -> set[int]:
    """Attempts that can have a checkpoint to report at `now`, computed from scratch."""
    return {
        aid
        for aid, att in ex.running.items()
        if (att.notice_ckpt is not None and att.notice_ckpt[0] <= now) or att.next_checkpoint_at() <= now
    }


_ops = st.lists(
    st.tuples(st.sampled_from(["launch", "notice", "advance"]), st.integers(1, 4), st.floats(1.0, 900.0)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(_ops)
def test_sim_executor_bookkeeping_matches_a_recount(ops: list[tuple[str, int, float]]) -> None:
    ex = SimExecutor()
    now = 0.0
    next_id = 1
    for kind, n, dt in ops:
        if kind == "launch":
            ex.behaviours[f"job-{next_id}"] = StepBehaviour(
                work_s=600.0 * n, restart_s=30.0, checkpoint_every_s=120.0, checkpoint_write_s=10.0
            )
            ex.launch(_request(next_id, n), now)
            next_id += 1
        elif kind == "notice" and ex.running:
            aid = sorted(ex.running)[n % len(ex.running)]
            ex.notify_stop(aid, now + dt / 10, now)
        else:
            now += dt
        due_before = _plain_due(ex, now)
        reported = {aid for aid, _, _ in ex.checkpoints_due(now)}
        assert reported <= due_before  # nothing reported that could not be due
        earliest = min((a.first_report_at() for a in ex.running.values()), default=math.inf)
        assert ex._quiet_until <= earliest  # the remembered "nothing due before" hides nothing
        for exit_ in ex.poll(now).exits:
            ex.ack_exit(exit_.attempt_id)
        assert ex.held_gpus == sum(len(a.request.gpus) for a in ex.running.values())
        expected_next = min((a.exit_at for a in ex.running.values()), default=None)
        assert ex.next_event() == expected_next
        # the remembered "nothing due before" never hides a due checkpoint
        earliest = min((a.first_report_at() for a in ex.running.values()), default=math.inf)
        assert ex._quiet_until <= earliest


# -- the inference decision's GPU sets ----------------------------------------------------------

_NODES = (Node("a", (0, 1, 2, 3)), Node("b", (3, 1, 0, 2)), Node("c", (0, 1)))  # b: not ascending
_indices = st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sets(st.integers(0, 3), max_size=4))


def _plain_unavailable(
    busy: dict[str, set[int]], affinity: dict[str, set[int]], new_lendable: int, steps: dict[str, set[int]]
) -> frozenset[GpuRef]:
    """Every GPU no step holds and research is not offered, from scratch."""
    offer = research_offer(_NODES, busy=busy, affinity=affinity, new_lendable=new_lendable)
    return frozenset(
        GpuRef(n.name, i)
        for n in _NODES
        for i in n.gpus
        if i not in steps.get(n.name, set()) and i not in offer.get(n.name, [])
    )


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(_indices, _indices, st.integers(-2, 12), _indices), min_size=1, max_size=8))
def test_not_offered_is_the_offer_computed_afresh_even_when_an_input_dict_is_changed_in_place(
    calls: list[tuple[dict[str, set[int]], dict[str, set[int]], int, dict[str, set[int]]]],
) -> None:
    busy: dict[str, set[int]] = {}
    for extra, affinity, new_lendable, held in calls:
        steps = {node: {i for i in held[node] if i < 4} for node in held}
        # the same dict object, changed in place: what was remembered must not be handed back
        busy.clear()
        for node, indices in extra.items():
            busy[node] = set(indices)
        for node, indices in steps.items():
            busy.setdefault(node, set()).update(indices)
        expected = _plain_unavailable(busy, affinity, new_lendable, steps)
        assert decide._not_offered(_NODES, busy, affinity, new_lendable, steps) == expected
        assert decide._not_offered(_NODES, busy, affinity, new_lendable, steps) == expected  # remembered


def test_research_offer_lists_each_node_lowest_index_first_whatever_the_node_order() -> None:
    offer = research_offer(_NODES, busy={"b": {1}}, affinity={"a": {0}}, new_lendable=7)
    # a has 4 idle, b 3, c 2: plain GPUs in that node order, each node lowest index first; a's 0
    # is wanted back by a sleeping replica: it would come after every plain one
    assert offer == {"a": [1, 2, 3], "b": [0, 2, 3], "c": [0]}
    offer = research_offer(_NODES, busy={"b": {1}}, affinity={"a": {0}}, new_lendable=9)
    assert offer == {"a": [1, 2, 3, 0], "b": [0, 2, 3], "c": [0, 1]}


def test_step_gpus_are_read_only_and_follow_a_new_tuple_of_running_steps() -> None:
    first = (running("a", [0, 1], attempt_id=1), running("b", [2], attempt_id=2))
    held, lent, active = decide._step_gpus(first)
    assert (dict(held), lent, active) == ({"a": frozenset({0, 1}), "b": frozenset({2})}, 3, 3)
    assert decide._step_gpus(first)[0] is held  # the same tuple: kept
    with pytest.raises(TypeError):
        held["c"] = frozenset()  # type: ignore[index]
    second = (running("a", [3], attempt_id=3),)
    assert dict(decide._step_gpus(second)[0]) == {"a": frozenset({3})}
    assert dict(decide._step_gpus(first)[0]) == {"a": frozenset({0, 1}), "b": frozenset({2})}


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c", "x"]),
            st.sets(st.integers(0, 4)),
            st.sampled_from([0.0, 1.5, 2.5]),
        ),
        max_size=6,
    )
)
def test_gpu_shares_are_what_each_sleeping_replica_reserves_summed_per_gpu(
    sleeping: list[tuple[str, set[int], float]],
) -> None:
    nodes = (Node("a", (0, 1, 2, 3), gpu_memory_gib=80.0), Node("b", (3, 1, 0, 2)), Node("c", (0, 1), 2.0))
    memory = {n.name: n.gpu_memory_gib for n in nodes}
    reserved: dict[GpuRef, float] = {}
    for node, indices, residual in sleeping:
        for i in sorted(indices):
            if residual > 0:
                reserved[GpuRef(node, i)] = reserved.get(GpuRef(node, i), 0.0) + residual
    expected = {
        ref: GpuShare(held, None if memory.get(ref.node) is None else max(0.0, memory[ref.node] - held))  # type: ignore[operator]
        for ref, held in reserved.items()
    }
    assert gpu_shares(nodes, [(n, tuple(sorted(i)), r) for n, i, r in sleeping]) == expected


def test_the_autoscaler_sum_clips_negatives_as_before_and_knows_nothing_from_a_gap() -> None:
    def sig(running: float | None) -> ReplicaSignals:
        return ReplicaSignals(replica="s/0", at=0.0, running=running)

    def get(r: ReplicaSignals) -> float | None:
        return r.running

    assert _total([sig(2.0), sig(-1.0), sig(0.5)], get) == 2.5
    for values in ([-0.0], [-0.0, -0.0], [0.0, -3.0], [0.1] * 10):
        plain = math.fsum(max(v, 0.0) for v in values)  # the formula before the rewrite
        assert repr(_total([sig(v) for v in values], get)) == repr(plain)
    assert _total([sig(1.0), sig(None)], get) is None
    assert _total([sig(1.0), sig(math.inf)], get) is None
    assert _total([sig(math.nan)], get) is None
    assert _total([], get) is None


_replica_ops = st.lists(
    st.tuples(
        st.sampled_from(["start", "park-sleep", "park-stop", "unpark", "advance"]),
        st.integers(0, 3),
        st.floats(0.5, 200.0),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=80, deadline=None)
@given(_replica_ops)
def test_sim_service_manager_earliest_event_matches_a_recount(ops: list[tuple[str, int, float]]) -> None:
    manager = SimServiceManager({"s": ReplicaTimes()})
    now = 0.0
    for kind, slot, dt in ops:
        rid = f"s/{slot}"
        if kind == "start":
            manager.start(
                ReplicaLaunch(rid, "s", "m", "n1", (slot,), 8000 + slot, ("serve",), {}, "w", "l", 60.0), now
            )
        elif kind.startswith("park") and rid in manager.replicas:
            manager.park(rid, "sleep" if kind == "park-sleep" else "stop", now)
        elif kind == "unpark" and rid in manager.replicas:
            manager.unpark(rid, now)
        else:
            now += dt
            due = sorted(r for r, rep in manager.replicas.items() if rep.due is not None and rep.due <= now)
            assert [e.replica_id for e in manager.poll(now)] == due  # every event due, in id order
        plain = min((r.due for r in manager.replicas.values() if r.due is not None), default=None)
        assert manager.next_event() == plain


def _figures(signals: ServiceSignals) -> list[tuple[object, ...]]:
    """Each replica's signals but their `at` (the kept tuple carries the tick that built it)."""
    return [astuple(replace(r, at=0.0)) for r in signals.replicas]


def test_sim_metrics_hand_back_the_figures_a_fresh_build_gives_through_load_and_replica_changes() -> None:
    capacity = derive_replica_capacity(100.0, 1000, 250, replicas_at_peak=9, target_concurrency=32.0)
    curve = LoadCurve(
        starts=(0.0, 600.0, 1200.0), rates=(40.0, 40.0, 90.0), prompt_tokens=1000, output_tokens=250
    )
    metrics = SimMetrics(curve, capacity, start=0.0)
    steps = [
        (10.0, ["a", "b"]),
        (20.0, ["a", "b"]),  # the same load and replicas: kept
        (30.0, ["b", "c"]),  # the same count, other replicas: the ids must follow
        (700.0, ["b", "c"]),  # the same rate in the next segment
        (1300.0, ["b", "c"]),  # a new rate: new figures
        (1310.0, ["b", "c", "d"]),  # a new replica count: new figures
    ]
    kept = []
    for now, ids in steps:
        got = metrics.collect("llm", {i: "serving" for i in ids}, now)
        load = metrics._last[4] if metrics._last is not None else None
        assert load is not None
        fresh = service_signals("llm", load, sorted(ids), now)
        assert got.at == now and got.service == "llm"
        assert [r.replica for r in got.replicas] == sorted(ids)
        assert _figures(got) == _figures(fresh)
        kept.append(got.replicas)
    assert kept[1] is kept[0]  # nothing changed: the same tuple
    assert kept[2] is not kept[1]
    assert _figures(metrics.collect("llm", {"b": "", "c": "", "d": ""}, 1320.0)) == _figures(
        service_signals("llm", metrics._last[4], ["b", "c", "d"], 1320.0)  # type: ignore[index]
    )


def test_the_autoscaler_answers_the_same_on_a_kept_signals_tuple_and_follows_a_new_one() -> None:
    spec = ServiceSpec(
        name="llm",
        model="m",
        gpus_per_replica=4,
        min_replicas=1,
        max_replicas=20,
        autoscale=AutoscaleTargets(concurrency_per_replica=10.0, ttft_p90_slo_s=2.0),
    )
    busy = tuple(ReplicaSignals(replica=f"r{i}", at=0.0, running=30.0, waiting=5.0) for i in range(2))
    quiet = tuple(replace(r, running=1.0, waiting=0.0) for r in busy)
    supply = ReplicaSupply(serving=2)
    state = initial_state(spec)
    first = decide_scale(spec, ServiceSignals("llm", 0.0, busy), supply, state, 0.0)
    again = decide_scale(spec, ServiceSignals("llm", 0.0, busy), supply, state, 0.0)
    assert again == first  # the caller's appended phrases did not leak into what is kept
    other = decide_scale(spec, ServiceSignals("llm", 0.0, quiet), supply, state, 0.0)
    assert other.needed != first.needed
    failed = decide_scale(spec, ServiceSignals("llm", 0.0, busy, source_error="down"), supply, state, 0.0)
    assert failed.unknown and not first.unknown
    stale = tuple(replace(r, stale=True) for r in busy)
    assert decide_scale(spec, ServiceSignals("llm", 0.0, stale), supply, state, 0.0).unknown


# -- round 5: copies without a field walk, kept answers by holdings, the world's job specs ------


def test_evolve_is_dataclasses_replace_and_falls_back_where_it_cannot_be() -> None:
    view = ReplicaView("s/0", "s", 0, ReplicaState.SERVING, "n1", (0, 1), None, 5.0, 0.0, 2, 0, 8000)
    moved = evolve(view, state=ReplicaState.DRAINING, since=7.0)
    assert moved == replace(view, state=ReplicaState.DRAINING, since=7.0)
    assert evolve(view) == view and view.state == ReplicaState.SERVING  # the original is untouched
    with pytest.raises(TypeError):
        evolve(view, no_such_field=1)  # as `replace` refuses it

    @dataclass(frozen=True)
    class Hidden:
        a: int
        b: int = field(default=0, init=False)

    @dataclass(frozen=True)
    class Keywords:
        a: int
        b: int = field(default=0, kw_only=True)

    assert evolve(Hidden(1), a=2) == replace(Hidden(1), a=2)
    assert evolve(Keywords(1, b=3), a=2) == Keywords(2, b=3)


def test_with_inference_passes_every_other_field_of_the_snapshot_on() -> None:
    base = snapshot(
        nodes={"n1": 4}, unavailable=["n1:3"], running=[running("n1", [0])], team_usage={"t": 5.0}
    )
    unavailable = frozenset({GpuRef("n1", 1)})
    shares = MappingProxyType({GpuRef("n1", 2): GpuShare(8.0, 72.0)})
    made = base.with_inference(unavailable, shares)
    assert made == replace(base, unavailable=unavailable, gpu_shares=shares)
    # a new field of Snapshot must be passed on by `with_inference` too
    assert [f.name for f in fields(Snapshot)] == [
        "now", "nodes", "running", "queued", "unavailable", "team_usage", "gpu_shares"
    ]  # fmt: skip


def test_the_decision_builds_its_next_memory_from_every_field() -> None:
    # `decide_services` builds the next memory field by field: a new field must be added there
    assert [f.name for f in fields(InferenceMemory)] == [
        "scale_states", "needed_history", "profiles", "surge_at", "alerts", "fresh_at"
    ]  # fmt: skip


def test_step_gpus_are_kept_for_a_new_tuple_holding_the_same_gpus_and_follow_a_notice() -> None:
    first = (running("a", [0, 1], attempt_id=1), running("b", [2], attempt_id=2))
    answer = decide._step_gpus(first)
    # a checkpoint: new objects, the same GPUs and notice: the very same answer
    again = (replace(first[0], last_checkpoint_at=50.0), first[1])
    assert decide._step_gpus(again) is answer
    noticed = (replace(first[0], stopping=True), first[1])
    held, lent, active = decide._step_gpus(noticed)
    assert (dict(held), lent, active) == ({"a": frozenset({0, 1}), "b": frozenset({2})}, 3, 1)
    moved = (replace(first[0], gpus=(0,)), first[1])
    assert dict(decide._step_gpus(moved)[0]) == {"a": frozenset({0}), "b": frozenset({2})}


def test_free_gpus_follow_the_running_steps_and_shares_with_kept_parts() -> None:
    nodes = snapshot(nodes={"n1": 4, "n2": 4}).nodes
    shares = MappingProxyType({GpuRef("n2", 3): GpuShare(8.0, 72.0)})
    first = type(snapshot(nodes={"n1": 1}))(
        now=0.0, nodes=nodes, running=(running("n1", [0, 1]),), gpu_shares=shares
    )
    a = FreeGpus.from_snapshot(first)
    assert (a.free_indices("n1"), a.free_indices("n2")) == ((2, 3), (0, 1, 2, 3))
    a.take("n1", 2)  # a decision's working copy: what is kept for the next one is not touched
    checkpointed = replace(first, running=(replace(first.running[0], last_checkpoint_at=9.0),))
    b = FreeGpus.from_snapshot(checkpointed)
    assert (b.free_indices("n1"), b.free_indices("n2")) == ((2, 3), (0, 1, 2, 3))
    assert b.has_shares()
    other = replace(first, running=(running("n2", [0]),), gpu_shares={})
    c = FreeGpus.from_snapshot(other)
    assert (c.free_indices("n1"), c.free_indices("n2")) == ((0, 1, 2, 3), (1, 2, 3))
    assert not c.has_shares()


def test_a_sorted_index_keeps_its_tuple_when_a_key_gets_the_very_value_it_holds() -> None:
    index: SortedIndex[int, object] = SortedIndex()
    one, two = object(), object()
    index.put(2, two)
    index.put(1, one)
    values = index.values()
    assert values == (one, two)
    index.put(1, one)
    assert index.values() is values
    other = object()
    index.put(1, other)
    assert index.values() == (other, two)


def test_cyclic_gc_is_paused_inside_and_put_back_as_it_was() -> None:
    assert gc.isenabled()
    with cyclic_gc_paused():
        assert not gc.isenabled()
        with cyclic_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with cyclic_gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_worlds_job_specs_are_what_build_job_spec_makes() -> None:

    curve = LoadCurve((0.0,), (5.0,), 86400.0, prompt_tokens=500.0, output_tokens=200.0)
    jobs = tuple(
        ResearchJob(f"job-{i}", f"team-{i % 2}", 10.0 * i, 1 + i % 3, 600.0, "low" if i % 4 else "normal")
        for i in range(12)
    )
    scenario = default_scenario(curve, jobs, days=0.1, seed=1, options=FleetOptions(nodes=2))
    world = SimWorld(scenario)
    for job in jobs:
        expected = build_job_spec(
            {
                "name": job.name,
                "team": job.team,
                "priority": job.priority,
                "grace_seconds": scenario.steps.grace_s,
                "steps": [
                    {
                        "name": "train",
                        "command": ["simulated"],
                        "gpus": job.gpus,
                        "checkpoint": True,
                        "restart_seconds": scenario.steps.restart_s,
                    }
                ],
            }
        )
        assert world._job_spec(job) == expected
