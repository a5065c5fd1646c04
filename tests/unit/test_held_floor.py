"""Scale from zero as a pure decision (issue 9 item 7): requests the gateway holds for a service
with no live replica are demand, so a service at 0 replicas with no metrics at all ("no fresh
data → hold 0") still gets a replica: woken when one sleeps, started otherwise
(`policy.inference.held_floor` inside `decide_inference`). Snapshot in, plan out."""

from __future__ import annotations

from dataclasses import replace

from lowtide.domain.gpus import Node
from lowtide.domain.metrics import ReplicaSignals, ServiceSignals
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec
from lowtide.domain.states import ReplicaState
from lowtide.policy.autoscale import ReplicaSupply, ScaleState, decide_scale, initial_state
from lowtide.policy.inference import decide_inference, held_floor
from lowtide.policy.inference_snapshot import InferenceMemory, InferenceSnapshot, ServiceRules
from lowtide.policy.replicas import ReplicaView

R = ReplicaState
NOW = 1_000_000.0
NODES = (Node("n1", (0, 1, 2, 3)),)
SPEC = ServiceSpec(
    name="chat",
    model="m",
    gpus_per_replica=2,
    min_replicas=0,
    max_replicas=2,
    park="sleep",
    autoscale=AutoscaleTargets(
        concurrency_per_replica=4, kv_usage=None, scale_up_window_s=5, scale_down_stabilization_s=20
    ),
)
RULES = ServiceRules(SPEC, base_port=9000)
LENDING = LendingPolicy(reclaim_lead_s=30, stale_after_s=10, stale_reclaim_after_s=60)


def snapshot(
    replicas: tuple[ReplicaView, ...] = (), held: int = 0, spec: ServiceSpec = SPEC, now: float = NOW
) -> InferenceSnapshot:
    rules = replace(RULES, spec=spec)
    return InferenceSnapshot(
        now=now,
        nodes=NODES,
        services=(rules,),
        lending=LENDING,
        replicas=replicas,
        signals={"chat": ServiceSignals(service="chat", at=now)},  # nothing serves: nothing reported
        running=(),
        memory=InferenceMemory.start((rules,)),
        held={"chat": held} if held else {},
    )


def actions(snap: InferenceSnapshot) -> list[tuple[str, str]]:
    return [(a.kind, a.replica_id) for a in decide_inference(snap).replica_plan.actions]


def test_at_zero_with_nothing_held_the_service_stays_at_zero() -> None:
    plan = decide_inference(snapshot())
    assert plan.replica_plan.actions == ()
    outcome = plan.scale.services[0]
    assert outcome.decision.unknown and outcome.decision.desired == 0
    assert "hold 0" in outcome.decision.reason


def test_held_requests_at_zero_replicas_start_one() -> None:
    plan = decide_inference(snapshot(held=3))
    assert [(a.kind, a.replica_id) for a in plan.replica_plan.actions] == [("start", "chat/0")]
    decision = plan.scale.services[0].decision
    assert (decision.desired, decision.needed) == (1, 1)
    assert "3 request(s) held at the gateway" in decision.reason
    # the replica it starts is what the next tick sees starting: it is not started twice
    after = plan.replicas
    assert [(r.id, r.state) for r in after] == [("chat/0", R.STARTING)]
    again = snapshot(after, held=3, now=NOW + 1)
    again = replace(again, memory=plan.memory)
    assert actions(again) == []


def test_held_requests_wake_a_sleeping_replica_rather_than_start_one() -> None:
    asleep = ReplicaView("chat/1", "chat", 1, R.PARKED, "n1", (2, 3), "sleep", NOW - 600, port=9001)
    assert actions(snapshot((asleep,), held=1)) == [("wake", "chat/1")]


def test_the_floor_keeps_the_replica_for_a_stabilisation_window_after_the_requests_are_served() -> None:
    plan = decide_inference(snapshot(held=1))
    state = plan.memory.scale_states["chat"]
    assert state.needed == 1 and (NOW, 1) in state.history

    # Later the replica serves with no load: the scale-down waits out the window, then goes to 0.
    def idle(at: float) -> ServiceSignals:
        return ServiceSignals(
            service="chat", at=at, replicas=(ReplicaSignals(replica="chat/0", at=at, running=0, waiting=0),)
        )

    soon = decide_scale(SPEC, idle(NOW + 5), ReplicaSupply(serving=1), state, NOW + 5)
    assert soon.needed == 1
    later = decide_scale(SPEC, idle(NOW + 30), ReplicaSupply(serving=1), soon.state, NOW + 30)
    assert later.needed == 0


def test_held_floor_changes_nothing_when_a_replica_is_wanted_or_none_is_allowed() -> None:
    first = decide_scale(
        SPEC, ServiceSignals(service="chat", at=NOW), ReplicaSupply(0), initial_state(SPEC), NOW
    )
    assert held_floor(SPEC, first, 0, NOW) is first
    wanting = replace(first, desired=1, needed=1)
    assert held_floor(SPEC, wanting, 5, NOW) is wanting
    none_allowed = replace(SPEC, max_replicas=0)
    assert held_floor(none_allowed, first, 5, NOW) is first
    headroom = replace(SPEC, headroom_replicas=1)
    bumped = held_floor(headroom, first, 1, NOW)
    assert (bumped.needed, bumped.desired) == (1, 2)
    assert isinstance(bumped.state, ScaleState) and bumped.state.desired == 2
