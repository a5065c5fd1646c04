"""Hung replicas and make-before-break, as pure decisions (`policy.inference.hung_replicas`,
`policy.replicas`): snapshot in, plan out.

A hung vLLM keeps answering `/health` 200 (or, SIGSTOPped, answers nothing at all), so lowtide
trusts its own signals: the replica's metrics failing or frozen for `hung_after_s`, or requests
failing in a row at the gateway. Scale-down never takes the last serving replicas out of routing
while their replacements are still starting.
"""

from __future__ import annotations

from dataclasses import replace

from lowtide.domain.gpus import GpuRef, Node
from lowtide.domain.metrics import ReplicaSignals, ServiceSignals
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec
from lowtide.domain.states import ReplicaState
from lowtide.policy.inference import (
    RESTART_BACKOFF_S,
    UPSTREAM_FAILURES_BEFORE_HUNG,
    decide_inference,
    hung_reason,
    hung_replicas,
)
from lowtide.policy.inference_snapshot import InferenceMemory, InferenceSnapshot, ServiceRules
from lowtide.policy.replicas import ReplicaView, ServiceView, plan_replicas
from lowtide.policy.signals import FROZEN_REASON

R = ReplicaState
NOW = 1_000_000.0
NODES = (Node("n1", (0, 1, 2, 3)),)
SPEC = ServiceSpec(
    name="chat",
    model="m",
    gpus_per_replica=2,
    min_replicas=1,
    max_replicas=2,
    park="sleep",
    autoscale=AutoscaleTargets(
        concurrency_per_replica=4, kv_usage=None, scale_up_window_s=5, scale_down_stabilization_s=20
    ),
)
HUNG_AFTER = 30.0
RULES = ServiceRules(
    SPEC, drain_timeout_s=30.0, reclaim_grace_s=45.0, base_port=9000, hung_after_s=HUNG_AFTER
)
LENDING = LendingPolicy(reclaim_lead_s=30, stale_after_s=10, stale_reclaim_after_s=60)


def replica(
    slot: int, state: ReplicaState | None, gpus: tuple[int, ...] = (0, 1), **kw: object
) -> ReplicaView:
    return ReplicaView(
        f"chat/{slot}",
        "chat",
        slot,
        state,
        "n1" if state is not None else None,
        gpus if state is not None else (),
        since=NOW - 300,
        port=9000 + slot,
        **kw,  # type: ignore[arg-type]
    )


def fresh(rid: str, running: float = 1.0) -> ReplicaSignals:
    return ReplicaSignals(rid, NOW, running=running, waiting=0.0)


def stale(
    rid: str, since: float, reason: str = "scrape failed: ReadTimeout (8 failures in a row)"
) -> ReplicaSignals:
    return ReplicaSignals(rid, NOW, stale=True, stale_reason=reason, stale_since=since)


def snap(
    replicas: tuple[ReplicaView, ...],
    signals: tuple[ReplicaSignals, ...] = (),
    *,
    source_error: str | None = None,
    upstream: dict[str, int] | None = None,
    rules: ServiceRules = RULES,
) -> InferenceSnapshot:
    return InferenceSnapshot(
        now=NOW,
        nodes=NODES,
        services=(rules,),
        lending=LENDING,
        replicas=replicas,
        signals={"chat": ServiceSignals("chat", NOW, signals, source_error=source_error)},
        running=(),
        memory=InferenceMemory.start((rules,)),
        upstream_failures=upstream or {},
    )


# -- hung replicas --------------------------------------------------------------------------------


def test_a_replica_whose_scrapes_fail_for_the_hung_bound_is_hung_but_not_before() -> None:
    serving = replica(0, R.SERVING)
    just_under = stale("chat/0", since=NOW - HUNG_AFTER + 1)
    assert hung_reason(RULES, serving, just_under, source_error=False, upstream_failures=0, now=NOW) is None
    at_bound = stale("chat/0", since=NOW - HUNG_AFTER)
    why = hung_reason(RULES, serving, at_bound, source_error=False, upstream_failures=0, now=NOW)
    assert why == "scrape failed: ReadTimeout (8 failures in a row) (stale for 30s, hung_after 30s)"
    # Frozen gauges with requests in flight are the same signal (policy.signals rule 4).
    frozen = stale("chat/0", since=NOW - 40, reason=f"{FROZEN_REASON}: 3 running, 0 waiting, and no …")
    assert hung_reason(RULES, serving, frozen, source_error=False, upstream_failures=0, now=NOW)
    assert hung_reason(
        RULES, serving, frozen, source_error=False, upstream_failures=0, now=NOW, gateway_in_flight=2
    )
    # ...unless the gateway has nothing in flight there: vLLM's gauges stuck on an idle replica.
    assert (
        hung_reason(
            RULES, serving, frozen, source_error=False, upstream_failures=0, now=NOW, gateway_in_flight=0
        )
        is None
    )


def test_what_does_not_make_a_replica_hung() -> None:
    long_ago = stale("chat/0", since=NOW - 1000)
    serving = replica(0, R.SERVING)
    # The metrics source itself failing (Prometheus down) says nothing about the replica.
    assert hung_reason(RULES, serving, long_ago, source_error=True, upstream_failures=0, now=NOW) is None
    # No reading yet: no stale_since, nothing to measure from.
    no_reading = ReplicaSignals("chat/0", NOW, stale=True, stale_reason="no readings yet")
    assert hung_reason(RULES, serving, no_reading, source_error=False, upstream_failures=0, now=NOW) is None
    # Only serving and draining replicas are judged; and a service without the bound never.
    for state in (R.STARTING, R.WAKING, R.PARKING, R.PARKED, R.FAILED):
        assert (
            hung_reason(RULES, replica(0, state), long_ago, source_error=False, upstream_failures=9, now=NOW)
            is None
        )
    off = replace(RULES, hung_after_s=None)
    assert hung_reason(off, serving, long_ago, source_error=False, upstream_failures=9, now=NOW) is None


def test_upstream_failures_in_a_row_at_the_gateway_make_a_replica_hung() -> None:
    serving = replica(0, R.SERVING)
    ok = fresh("chat/0")
    below = UPSTREAM_FAILURES_BEFORE_HUNG - 1
    assert hung_reason(RULES, serving, ok, source_error=False, upstream_failures=below, now=NOW) is None
    why = hung_reason(
        RULES, serving, ok, source_error=False, upstream_failures=UPSTREAM_FAILURES_BEFORE_HUNG, now=NOW
    )
    assert why == f"{UPSTREAM_FAILURES_BEFORE_HUNG} requests in a row failed or timed out at the gateway"
    draining = replica(1, R.DRAINING, gpus=(2, 3))
    snapshot = snap((serving, draining), (ok, fresh("chat/1")), upstream={"chat/1": 5})
    assert set(hung_replicas(snapshot)) == {"chat/1"}


def test_a_hung_replica_is_restarted_and_replaced_at_once_and_its_gpus_are_not_lent_this_tick() -> None:
    hung = replica(0, R.SERVING, failures=0)
    empty = replica(1, None)
    plan = decide_inference(snap((hung, empty), (stale("chat/0", since=NOW - 45),)))
    actions = [(a.kind, a.replica_id, a.gpus) for a in plan.replica_plan.actions]
    # Out of routing (FAILED, restart after the backoff) and a replacement on the free GPUs.
    assert actions == [("restart", "chat/0", (0, 1)), ("start", "chat/1", (2, 3))]
    assert plan.replica_plan.actions[0].reason.startswith("hung: scrape failed")
    after = {r.id: r for r in plan.replicas}
    assert after["chat/0"].state == R.FAILED
    assert (after["chat/0"].failures, after["chat/0"].retry_at) == (1, NOW + RESTART_BACKOFF_S)
    assert after["chat/1"].state == R.STARTING
    # The hung process's GPUs are still being freed: research is not offered them this tick.
    assert {GpuRef("n1", 0), GpuRef("n1", 1)} <= plan.unavailable
    assert plan.next_due is not None and plan.next_due <= NOW + RESTART_BACKOFF_S


def test_a_healthy_service_plans_no_restart() -> None:
    plan = decide_inference(snap((replica(0, R.SERVING), replica(1, None)), (fresh("chat/0"),)))
    assert [a.kind for a in plan.replica_plan.actions] == []


# -- make before break ----------------------------------------------------------------------------


def kinds(plan: object) -> list[tuple[str, str]]:
    return [(a.kind, a.replica_id) for a in plan.actions]  # type: ignore[attr-defined]


def test_scale_down_keeps_the_only_serving_replica_while_its_replacement_starts() -> None:
    old = replica(0, R.SERVING)
    starting = replica(1, R.STARTING, gpus=(2, 3))
    # Two in supply, one desired: before, the serving one was drained (503s until the other served).
    assert kinds(plan_replicas([ServiceView(SPEC, 1, (old, starting))], NODES, frozenset(), NOW)) == []
    waking = replace(starting, state=R.WAKING)
    assert kinds(plan_replicas([ServiceView(SPEC, 1, (old, waking))], NODES, frozenset(), NOW)) == []
    # Once the replacement serves, one of the two leaves routing.
    both = (old, replace(starting, state=R.SERVING, in_flight=2))
    assert kinds(plan_replicas([ServiceView(SPEC, 1, both)], NODES, frozenset(), NOW)) == [
        ("drain", "chat/0")
    ]


def test_scale_down_to_zero_and_surplus_serving_replicas_still_drain() -> None:
    spec = replace(SPEC, min_replicas=0, max_replicas=3)
    three = (
        replica(0, R.SERVING, in_flight=3),
        replica(1, R.SERVING, gpus=(2, 3), in_flight=1),
        replica(2, R.STARTING, gpus=(4, 5)),
    )
    # Desired 1 of 2 serving + 1 starting: one serving replica may go (the other stays and serves).
    assert kinds(plan_replicas([ServiceView(spec, 1, three)], NODES, frozenset(), NOW)) == [
        ("drain", "chat/1")
    ]
    # Desired 0: nothing must stay in routing.
    assert kinds(plan_replicas([ServiceView(spec, 0, three)], NODES, frozenset(), NOW)) == [
        ("drain", "chat/1"),
        ("drain", "chat/0"),
    ]


# -- draining without a gateway -------------------------------------------------------------------


def test_without_a_gateway_a_drain_ends_when_the_replicas_own_metrics_say_nothing_runs() -> None:
    rules = replace(RULES, drain_from_metrics=True, hung_after_s=None)
    serving = replica(0, R.SERVING)
    draining = replace(replica(1, R.DRAINING, gpus=(2, 3)), since=NOW - 5)  # drain timeout 30 s

    def actions(signals: tuple[ReplicaSignals, ...], now: float = NOW) -> list[tuple[str, str]]:
        plan = decide_inference(replace(snap((serving, draining), signals, rules=rules), now=now))
        return [(a.kind, a.replica_id) for a in plan.replica_plan.actions]

    busy = (fresh("chat/0", 0.0), ReplicaSignals("chat/1", NOW, running=2.0, waiting=1.0))
    assert actions(busy) == []  # 3 requests still on it by its own count
    idle = (fresh("chat/0", 0.0), ReplicaSignals("chat/1", NOW, running=0.0, waiting=0.0))
    assert actions(idle) == [("park", "chat/1")]
    # Unknown (stale) is not drained: only the drain timeout parks it.
    unknown = (fresh("chat/0", 0.0), stale("chat/1", since=NOW - 1))
    assert actions(unknown) == []
    assert actions(unknown, now=NOW + 30) == [("park", "chat/1")]
    # With a gateway (the default) the gateway's count decides: nothing in flight there → parked.
    assert [
        a.kind for a in decide_inference(snap((serving, draining), busy, rules=RULES)).replica_plan.actions
    ] == ["park"]
