"""What of the inference memory survives a restart (`policy.inference_memory`) and the open-reclaim
floor (`policy.inference.reclaim_floor`), as pure functions: values in, values out."""

from __future__ import annotations

import json

from lowtide.domain.services import AutoscaleTargets, ServiceSpec
from lowtide.domain.states import ReplicaState
from lowtide.policy.autoscale import ScaleDecision, ScaleState
from lowtide.policy.inference import reclaim_floor
from lowtide.policy.inference_memory import MAX_READINGS, decode_memory, encode_memory
from lowtide.policy.inference_snapshot import InferenceMemory, ReclaimFact, ServiceRules
from lowtide.policy.replicas import ReplicaView

R = ReplicaState
NOW = 1_800_000_000.0
SPEC = ServiceSpec(
    name="chat",
    model="m",
    gpus_per_replica=2,
    min_replicas=1,
    max_replicas=3,
    autoscale=AutoscaleTargets(concurrency_per_replica=4, kv_usage=None),
)
START = InferenceMemory.start((ServiceRules(SPEC),))


def memory() -> InferenceMemory:
    state = ScaleState(
        service="chat",
        history=((NOW - 30, 1), (NOW - 10, 2)),
        desired=2,
        needed=2,
        down_from=(3, 2.5, NOW - 40),
        flap_guard=(2, 7.5),
        recent=((NOW - 10, 2),),
        steps=((NOW - 50, 3), (NOW - 40, 2)),
        panic_at=NOW - 5,
        unknown_since=None,
        window_s=1200.0,
        window_at=NOW - 600,
        burst_from=(3, NOW - 40),
    )
    return InferenceMemory(
        scale_states={"chat": state},
        needed_history={"chat": ((NOW - 20, 1), (NOW - 10, 2))},
        surge_at={"chat": NOW - 12},
        alerts={"chat": "3 replica start failures in a row"},
        fresh_at={"chat": NOW},
    )


def test_the_memory_round_trips_through_json() -> None:
    saved = json.loads(json.dumps(encode_memory(memory(), NOW)))
    back = decode_memory(saved, START, ["chat"], NOW + 60)
    assert back.scale_states["chat"] == memory().scale_states["chat"]
    assert back.needed_history == memory().needed_history
    assert back.surge_at == memory().surge_at and back.alerts == memory().alerts
    assert back.fresh_at == {}  # a restarted control plane trusts no data it has not seen


def test_a_document_from_before_the_burst_guard_reads_as_no_lengthened_window() -> None:
    saved = json.loads(json.dumps(encode_memory(memory(), NOW)))
    for key in ("window_s", "window_at", "burst_from"):
        del saved["services"]["chat"]["scale"][key]
    back = decode_memory(saved, START, ["chat"], NOW + 60).scale_states["chat"]
    assert (back.window_s, back.window_at, back.burst_from) == (None, None, None)
    assert back.history == memory().scale_states["chat"].history


def test_times_after_now_are_clamped_and_services_no_longer_configured_are_dropped() -> None:
    saved = encode_memory(memory(), NOW)
    saved["services"]["gone"] = saved["services"]["chat"]
    back = decode_memory(saved, START, ["chat"], NOW - 100)  # the clock went back while down
    state = back.scale_states["chat"]
    assert all(t <= NOW - 100 for t, _ in state.history) and state.panic_at == NOW - 100
    assert back.surge_at["chat"] == NOW - 100
    assert "gone" not in back.scale_states


def test_malformed_documents_start_afresh_without_raising() -> None:
    for bad in (None, [], {"version": 99}, {"version": 1, "services": []}):
        assert decode_memory(bad, START, ["chat"], NOW) == START
    saved = encode_memory(memory(), NOW)
    saved["services"]["chat"]["scale"]["desired"] = "two"
    assert decode_memory(saved, START, ["chat"], NOW) == START


def test_the_document_stays_bounded() -> None:
    long = ScaleState(service="chat", history=tuple((NOW - i, 1) for i in range(10 * MAX_READINGS, 0, -1)))
    saved = encode_memory(InferenceMemory(scale_states={"chat": long}), NOW)
    assert len(saved["services"]["chat"]["scale"]["history"]) == MAX_READINGS


# -- the open-reclaim floor ------------------------------------------------------------------


def replica(slot: int, state: R, since: float = NOW - 100) -> ReplicaView:
    return ReplicaView(
        f"chat/{slot}",
        "chat",
        slot,
        state,
        "n1",
        (2 * slot, 2 * slot + 1),
        parked_as=None,
        since=since,
        port=9000,
    )


def decision(desired: int) -> ScaleDecision:
    state = ScaleState(service="chat", desired=desired, needed=desired)
    return ScaleDecision(desired, desired, desired, {}, None, False, "load", state)


def reclaim(replica_id: str | None, decided_at: float = NOW - 20) -> ReclaimFact:
    return ReclaimFact(1, "chat", replica_id, decided_at, NOW - 20, None)


def test_an_open_reclaim_keeps_its_replica_in_the_target_until_it_is_supplied() -> None:
    replicas = [replica(0, R.SERVING), replica(1, R.PARKED)]
    floored = reclaim_floor(SPEC, decision(1), replicas, [reclaim("chat/1")], NOW)
    assert floored.desired == 2 and floored.state.desired == 2
    assert "open reclaims" in floored.reason
    waking = [replica(0, R.SERVING), replica(1, R.WAKING)]
    assert reclaim_floor(SPEC, decision(1), waking, [reclaim("chat/1")], NOW).desired == 1


def test_an_unnamed_reclaim_is_served_by_any_replica_started_since_its_decision() -> None:
    before = [replica(0, R.SERVING)]
    assert reclaim_floor(SPEC, decision(1), before, [reclaim(None)], NOW).desired == 2
    started = [replica(0, R.SERVING), replica(1, R.STARTING, since=NOW - 5)]
    d = decision(1)  # the replica started for it: the autoscaler decides again from here
    assert reclaim_floor(SPEC, d, started, [reclaim(None)], NOW) is d
    older = [replica(0, R.SERVING), replica(1, R.STARTING, since=NOW - 30)]  # started before it
    assert reclaim_floor(SPEC, decision(2), older, [reclaim(None)], NOW).desired == 3


def test_no_open_reclaim_or_a_reclaim_for_lending_changes_nothing() -> None:
    replicas = [replica(0, R.SERVING)]
    d = decision(1)
    assert reclaim_floor(SPEC, d, replicas, [], NOW) is d
    lending = ReclaimFact(1, None, None, NOW - 20, NOW - 20, None)
    assert reclaim_floor(SPEC, d, replicas, [lending], NOW) is d
