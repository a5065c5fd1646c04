"""Stories for the pure inference decisions: replica events → moves, restart backoff and the alert,
snapshot → plan (`policy.inference`), and the reclaim needs, victims and phases
(`policy.reclaim_phases`). Snapshot in, plan out: no store, no ports, no clock.

Defaults are boring on purpose: one service "chat" of 2-GPU replicas (1..3, sleeps when parked)
on two 4-GPU nodes, concurrency 4 per replica, lending lead 30 s and stale after 10 s.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from lowtide.control.inference_ports import ReplicaEvent
from lowtide.domain.gpus import GpuRef, Node
from lowtide.domain.metrics import ReplicaSignals, ServiceSignals
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec
from lowtide.domain.states import ReclaimState, ReplicaState
from lowtide.policy.inference import (
    FAILURES_BEFORE_ALERT,
    MoveValue,
    ReplicaMove,
    decide_inference,
    event_move,
    failure_move,
    failures_in_a_row,
    growth_per_s,
    restart_delay,
    settle_events,
)
from lowtide.policy.inference_snapshot import (
    InferenceMemory,
    InferenceSnapshot,
    ReclaimFact,
    ServiceRules,
)
from lowtide.policy.lending import Envelope
from lowtide.policy.reclaim_phases import (
    ABANDON_AFTER_S,
    PhaseUpdate,
    decide_reclaim,
    replica_needs,
    track_reclaims,
)
from lowtide.policy.replicas import Blocked, ReplicaPlan, ReplicaView
from lowtide.policy.snapshot import RunningStep

R = ReplicaState
NOW = 1_000_000.0
NODES = (Node("n1", (0, 1, 2, 3)), Node("n2", (0, 1, 2, 3)))
SPEC = ServiceSpec(
    name="chat",
    model="m",
    gpus_per_replica=2,
    min_replicas=1,
    max_replicas=3,
    park="sleep",
    autoscale=AutoscaleTargets(
        concurrency_per_replica=4,
        kv_usage=None,
        scale_up_window_s=5,
        scale_down_stabilization_s=20,
        tolerance=0,
    ),
)
RULES = ServiceRules(SPEC, drain_timeout_s=30.0, reclaim_grace_s=45.0, base_port=9000)
LENDING = LendingPolicy(reclaim_lead_s=30, stale_after_s=10, stale_reclaim_after_s=60)


def replica(
    slot: int,
    state: ReplicaState,
    *,
    node: str | None = "n1",
    gpus: tuple[int, ...] = (0, 1),
    parked_as: str | None = None,
    since: float = NOW - 100,
    failures: int = 0,
    retry_at: float = 0.0,
    service: str = "chat",
) -> ReplicaView:
    return ReplicaView(
        f"{service}/{slot}",
        service,
        slot,
        state,
        node,
        gpus,
        parked_as=parked_as,  # type: ignore[arg-type]
        since=since,
        retry_at=retry_at,
        failures=failures,
        port=9000 + slot,
    )


def step(
    aid: int, node: str, gpus: tuple[int, ...], *, started: float = NOW - 1000, stopping: bool = False
) -> RunningStep:
    return RunningStep(aid, f"job-{aid}", "train", "nlp", 0, node, gpus, started, stopping=stopping)


def load(concurrency: float, *replica_ids: str, at: float = NOW) -> ServiceSignals:
    """`concurrency` requests on each of the replicas."""
    return ServiceSignals(
        "chat",
        at,
        tuple(ReplicaSignals(rid, at, running=concurrency, waiting=0.0) for rid in replica_ids),
    )


def snap(
    replicas: tuple[ReplicaView, ...],
    *,
    now: float = NOW,
    running: tuple[RunningStep, ...] = (),
    signals: ServiceSignals | None = None,
    memory: InferenceMemory | None = None,
    reclaims: tuple[ReclaimFact, ...] = (),
    rules: ServiceRules = RULES,
) -> InferenceSnapshot:
    return InferenceSnapshot(
        now=now,
        nodes=NODES,
        services=(rules,),
        lending=LENDING,
        replicas=replicas,
        signals={"chat": signals or ServiceSignals("chat", now)},
        running=running,
        reclaims=reclaims,
        memory=memory or InferenceMemory.start((rules,)),
    )


def envelope_of(lendable: int) -> Envelope:
    return Envelope(
        lendable_gpus=lendable,
        inference_claim_gpus=0,
        claims={},
        lending_open=True,
        return_by=None,
        reasons=(),
        fail_safe=None,
    )


# -- replica events -------------------------------------------------------------------------------

EVENTS = [
    # (state, parked_as, event, detail) → (target, message, values) or None
    (R.STARTING, None, "healthy", "", (R.SERVING, "healthy: serving", {"failures": 0})),
    (R.WAKING, None, "healthy", "", (R.SERVING, "healthy: serving", {"failures": 0})),
    (R.SERVING, None, "healthy", "", None),
    (R.PARKING, None, "asleep", "", (R.PARKED, "asleep", {"parked_as": "sleep"})),
    (R.PARKING, None, "stopped", "", (R.PARKED, "stopped", {"parked_as": "stop"})),
    (R.SERVING, None, "asleep", "", None),
    (
        R.STARTING,
        None,
        "failed",
        "never became healthy",
        (
            R.FAILED,
            "failed: never became healthy; restart in 40s",
            {"failures": 3, "retry_at": NOW + 40, "parked_as": None},
        ),
    ),
    (
        R.SERVING,
        None,
        "stopped",
        "",
        (
            R.FAILED,
            "failed: stopped; restart in 40s",
            {"failures": 3, "retry_at": NOW + 40, "parked_as": None},
        ),
    ),
    (
        R.PARKED,
        "sleep",
        "failed",
        "process gone",
        (R.FAILED, "failed: process gone", {"failures": 3, "retry_at": NOW}),
    ),
    (R.FAILED, None, "failed", "again", None),
    (R.FAILED, None, "stopped", "", None),
]


@pytest.mark.parametrize(("state", "parked_as", "kind", "detail", "expected"), EVENTS)
def test_which_event_moves_which_replica_where(
    state: ReplicaState,
    parked_as: str | None,
    kind: str,
    detail: str,
    expected: tuple[ReplicaState, str, dict[str, MoveValue]] | None,
) -> None:
    # Two failures before the event: a third backs off 40 s; becoming healthy resets the count.
    r = replica(0, state, parked_as=parked_as, failures=2)
    move = event_move(r, ReplicaEvent("chat/0", kind, NOW, detail))  # type: ignore[arg-type]
    if expected is None:
        assert move is None
        return
    target, message, values = expected
    assert move == ReplicaMove("chat/0", state, target, NOW, message, tuple(values.items()))


@pytest.mark.parametrize(
    ("failures", "delay"), [(1, 10.0), (2, 20.0), (3, 40.0), (6, 320.0), (7, 600.0), (12, 600.0)]
)
def test_restart_backoff_doubles_from_10s_up_to_10_minutes(failures: int, delay: float) -> None:
    assert restart_delay(failures) == delay
    move = failure_move(replica(0, R.STARTING, failures=failures - 1), NOW, "boom")
    assert move.columns() == {"failures": failures, "retry_at": NOW + delay, "parked_as": None}
    assert move.message == f"failed: boom; restart in {delay:g}s"


def test_events_settle_in_order_and_unknown_replicas_are_ignored() -> None:
    replicas = (replica(0, R.STARTING, failures=2), replica(1, R.PARKING, node="n2"))
    before = copy.deepcopy(replicas)
    out = settle_events(
        replicas,
        [
            ReplicaEvent("chat/0", "healthy", NOW),
            ReplicaEvent("other/0", "failed", NOW),
            ReplicaEvent("chat/0", "failed", NOW + 1, "crashed"),  # sees SERVING with 0 failures
            ReplicaEvent("chat/1", "asleep", NOW + 2),
        ],
    )
    assert [(m.replica_id, m.expected, m.target) for m in out.moves] == [
        ("chat/0", R.STARTING, R.SERVING),
        ("chat/0", R.SERVING, R.FAILED),
        ("chat/1", R.PARKING, R.PARKED),
    ]
    assert out.sources == (0, 2, 3)
    zero, one = out.replicas
    assert (zero.state, zero.failures, zero.retry_at, zero.since) == (R.FAILED, 1, NOW + 11, NOW + 1)
    assert (one.state, one.parked_as, one.since) == (R.PARKED, "sleep", NOW + 2)
    assert replicas == before


# -- failed starts and the alert ------------------------------------------------------------------


def test_three_failed_starts_in_a_row_raise_one_alert_and_stop_new_lending() -> None:
    rules = replace(RULES, spec=replace(SPEC, max_replicas=1))
    replicas: tuple[ReplicaView, ...] = (replica(0, R.STARTING),)
    memory = InferenceMemory.start((rules,))
    now = NOW
    for attempt in range(1, FAILURES_BEFORE_ALERT + 1):
        failed = settle_events(replicas, [ReplicaEvent("chat/0", "failed", now, "never became healthy")])
        (r,) = failed.replicas
        assert (r.state, r.failures, r.retry_at) == (R.FAILED, attempt, now + restart_delay(attempt))
        plan = decide_inference(snap(failed.replicas, now=now, memory=memory, rules=rules))
        (outcome,) = plan.scale.services
        if attempt < FAILURES_BEFORE_ALERT:
            assert plan.scale.alerts == () and outcome.alert == ""
            # Never healthy, so never fresh (issue 12): nothing new is lent before the alert either.
            assert plan.envelope.fail_safe is not None and "never fresh" in plan.envelope.fail_safe
            assert outcome.blocked == f"1 failed replica(s) retry in {restart_delay(attempt):.0f}s"
            assert plan.next_due == r.retry_at
            # At its retry time the replica is started again.
            now = r.retry_at
            plan = decide_inference(snap(failed.replicas, now=now, memory=plan.memory, rules=rules))
            assert [(a.kind, a.replica_id) for a in plan.replica_plan.actions] == [("start", "chat/0")]
            (restarted,) = plan.replicas
            assert (restarted.state, restarted.failures, restarted.since) == (R.STARTING, attempt, now)
            replicas, memory = plan.replicas, plan.memory
    message = "3 replica start failures in a row: no new lending from chat"
    assert [(e.service, e.kind, e.message) for e in plan.scale.alerts] == [("chat", "alert", message)]
    assert outcome.alert == message and plan.memory.alerts["chat"] == message
    assert plan.envelope.fail_safe is not None and "no new lending" in plan.envelope.fail_safe
    assert plan.unavailable == frozenset(g for n in NODES for g in n.refs())  # nothing new is lent

    # The same situation a tick later: the alert stands, but is not written again.
    again = decide_inference(snap(failed.replicas, now=now + 1, memory=plan.memory, rules=rules))
    assert again.scale.alerts == () and again.scale.services[0].alert == message

    # The replica finally serves: the alert clears and the failures are forgotten.
    restarted = replace(failed.replicas[0], state=R.STARTING, since=now + 2)
    healthy = settle_events((restarted,), [ReplicaEvent("chat/0", "healthy", now + 3)])
    assert healthy.replicas[0].failures == 0
    cleared = decide_inference(
        snap(
            healthy.replicas,
            now=now + 3,
            memory=again.memory,
            rules=rules,
            signals=load(1.0, "chat/0", at=now + 3),
        )
    )
    assert cleared.scale.services[0].alert == "" and cleared.memory.alerts["chat"] == ""
    assert cleared.envelope.fail_safe is None and cleared.envelope.lendable_gpus == 6


def test_failures_count_only_since_a_replica_last_became_healthy() -> None:
    old = replica(0, R.FAILED, failures=5, since=NOW - 50)
    assert failures_in_a_row([old]) == 5
    assert failures_in_a_row([old, replica(1, R.SERVING, since=NOW - 40)]) == 0
    assert failures_in_a_row([old, replica(1, R.SERVING, since=NOW - 60)]) == 5


# -- snapshot → plan ---------------------------------------------------------------------------------


def test_the_plan_starts_what_the_load_needs_and_lends_the_rest() -> None:
    serving = replica(0, R.SERVING, node="n1", gpus=(0, 1))
    research = (step(7, "n2", (0, 1)),)
    s = snap((serving,), running=research, signals=load(6.0, "chat/0"))  # 6 per replica → 2 replicas
    before = copy.deepcopy(s)
    plan = decide_inference(s)
    assert s == before  # nothing mutated
    assert plan == decide_inference(s)  # the same snapshot, the same plan
    assert [(a.kind, a.replica_id, a.node, a.gpus) for a in plan.replica_plan.actions] == [
        ("start", "chat/1", "n1", (2, 3))  # best fit: n1 has exactly 2 free
    ]
    assert plan.scale.services[0].target == 2
    assert [(r.id, r.state, r.port) for r in plan.replicas] == [
        ("chat/0", R.SERVING, 9000),
        ("chat/1", R.STARTING, 9001),
    ]
    # 8 GPUs − 2 replicas × 2 = 4 lendable; research holds 2, so 2 more are offered: n2's 2 and 3.
    assert plan.envelope.lendable_gpus == 4
    assert plan.unavailable == frozenset({GpuRef("n1", i) for i in range(4)})
    assert plan.reclaim.plan.victims == () and plan.reclaim.surge_at == {}
    assert plan.memory.needed_history["chat"] == ((NOW, 2),)
    assert plan.follow_up is False


def test_a_drain_asks_for_a_follow_up_tick() -> None:
    replicas = (replica(0, R.SERVING), replica(1, R.SERVING, node="n2", gpus=(0, 1)))
    memory = InferenceMemory.start((RULES,))
    # 1 request on each of 2 replicas needs 1; the scale-down waits out the 20 s stabilisation window.
    for t in (NOW - 30, NOW - 25):
        memory = decide_inference(
            snap(replicas, now=t, signals=load(1.0, "chat/0", "chat/1"), memory=memory)
        ).memory
    plan = decide_inference(snap(replicas, signals=load(1.0, "chat/0", "chat/1"), memory=memory))
    assert [a.kind for a in plan.replica_plan.actions] == ["drain"]
    assert plan.follow_up is True
    assert [r.state for r in plan.replicas] == [R.SERVING, R.DRAINING]


# -- reclaim needs ------------------------------------------------------------------------------------


def blocked(missing: int, service: str = "chat") -> ReplicaPlan:
    return ReplicaPlan(blocked=(Blocked(service, missing, "no free block"),))


def test_a_sleeping_replica_needs_its_own_gpus_back_and_the_rest_any_block() -> None:
    asleep = replica(1, R.PARKED, node="n2", gpus=(2, 3), parked_as="sleep")
    serving = replica(0, R.SERVING)
    needs = replica_needs({"chat": SPEC}, [serving, asleep], blocked(2))
    assert [(n.replica_id, n.exact, n.below_min, why) for n, why in needs] == [
        ("chat/1", (GpuRef("n2", 2), GpuRef("n2", 3)), False, "wake chat/1 on its own GPUs"),
        (None, (), False, "start a replica of chat"),
    ]


def test_a_sleeping_replica_of_the_wrong_size_needs_a_new_block() -> None:
    asleep = replica(1, R.PARKED, node="n2", gpus=(2,), parked_as="sleep")  # the spec now wants 2
    stopped = replica(2, R.PARKED, node="n2", gpus=(0, 1), parked_as="stop")
    needs = replica_needs({"chat": SPEC}, [asleep, stopped], blocked(1))
    assert [(n.replica_id, n.exact, n.gpus, n.below_min) for n, _ in needs] == [(None, (), 2, True)]


def test_services_below_min_replicas_are_served_first() -> None:
    big = replace(SPEC, name="big", min_replicas=0)
    specs = {"chat": SPEC, "big": big}
    plan = ReplicaPlan(blocked=(Blocked("big", 1, "x"), Blocked("chat", 1, "x")))
    needs = replica_needs(specs, [], plan)
    assert [(n.service, n.below_min) for n, _ in needs] == [("chat", True), ("big", False)]


def test_nothing_missing_and_nothing_over_the_envelope_converts_no_running_step() -> None:
    # Duplicate GPUs would make the step an invalid victim: converting it would raise.
    odd = RunningStep(1, "job-1", "train", "nlp", 0, "n2", (0, 0), NOW - 10)
    decision = decide_reclaim(
        now=NOW,
        nodes=NODES,
        specs={"chat": SPEC},
        reclaim_grace={"chat": 45.0},
        running=(odd,),
        replicas=[replica(0, R.SERVING)],
        replica_plan=ReplicaPlan(),
        envelope=envelope_of(6),
        deficits={"chat": 0},
        surge_at={"chat": NOW - 50},
    )
    assert decision.plan.victims == () and decision.preemptions == () and decision.openings() == ()
    assert decision.surge_at == {}  # no deficit: the surge is over


def test_a_surge_preempts_the_cheapest_step_with_the_service_grace_and_opens_one_reclaim() -> None:
    cheap = step(1, "n2", (0, 1), started=NOW - 100)
    dear = step(2, "n2", (2, 3), started=NOW - 5000)
    serving = replica(0, R.SERVING, node="n1", gpus=(0, 1))
    other = step(3, "n1", (2, 3), started=NOW - 9000)
    decision = decide_reclaim(
        now=NOW,
        nodes=NODES,
        specs={"chat": SPEC},
        reclaim_grace={"chat": 45.0},
        running=(cheap, dear, other),
        replicas=[serving],
        replica_plan=blocked(1),
        envelope=envelope_of(6),
        deficits={"chat": 1},
        surge_at={"chat": NOW - 3},
    )
    assert [(p.attempt_id, p.grace_s, p.service) for p in decision.preemptions] == [(1, 45.0, "chat")]
    (opening,) = decision.openings()
    assert (opening.service, opening.replica_id, opening.victims) == ("chat", None, ((1, 2),))
    assert opening.reason == "start a replica of chat: preempting 1 step(s), 2 GPU(s)"
    assert (opening.detected_at, opening.decided_at) == (NOW - 3, NOW)
    assert decision.openings(preempted=set()) == ()  # its step moved meanwhile: nothing to open


def test_lending_shrinking_while_a_service_grows_is_that_service_reclaim() -> None:
    research = (step(1, "n2", (0, 1)), step(2, "n2", (2, 3), stopping=True))
    decision = decide_reclaim(
        now=NOW,
        nodes=NODES,
        specs={"chat": SPEC},
        reclaim_grace={"chat": 45.0},
        running=research,
        replicas=[replica(0, R.SERVING)],
        replica_plan=ReplicaPlan(),
        envelope=envelope_of(0),  # 2 GPUs held without notice, none allowed
        deficits={"chat": 1},  # wanted, but waiting for the reserve, not blocked
        surge_at={},
    )
    assert [(p.attempt_id, p.for_need, p.service, p.grace_s) for p in decision.preemptions] == [
        (1, "lending", None, 45.0)
    ]
    (opening,) = decision.openings()
    assert (opening.service, opening.what, opening.detected_at) == (
        "chat",
        "lending shrank while chat grows",
        NOW,
    )


# -- reclaim phases ------------------------------------------------------------------------------------

T = NOW - 2000.0


def reclaim(
    times: tuple[tuple[float | None, float | None], ...],
    *,
    service: str | None = "chat",
    replica_id: str | None = None,
    notice_at: float | None = None,
    freed_at: float | None = None,
) -> ReclaimFact:
    return ReclaimFact(1, service, replica_id, T, notice_at, freed_at, times)


@pytest.mark.parametrize(
    ("fact", "now", "phases", "abandon_at"),
    [
        # Notice went to both victims; one has not ended: the GPUs are not free yet.
        (reclaim(((T + 1, T + 20), (T + 2, None))), T + 30, {"notice_at": T + 2}, None),
        # Both ended: freed at the last end; no replica serves yet: abandoned 900 s after that.
        (
            reclaim(((T + 1, T + 20), (T + 2, T + 25))),
            T + 30,
            {"notice_at": T + 2, "freed_at": T + 25},
            T + 25 + ABANDON_AFTER_S + 1,
        ),
        # Exactly 900 s after the GPUs were freed: not yet.
        (reclaim((), notice_at=T + 2, freed_at=T + 25), T + 25 + ABANDON_AFTER_S, {}, T + 926.0),
        # Past 900 s: abandoned.
        (
            reclaim((), notice_at=T + 2, freed_at=T + 25),
            T + 25 + ABANDON_AFTER_S + 0.5,
            {"state": ReclaimState.ABANDONED},
            None,
        ),
        # A reclaim for lending is done once the GPUs are back.
        (
            reclaim(((T + 1, T + 9),), service=None),
            T + 10,
            {"notice_at": T + 1, "freed_at": T + 9, "state": ReclaimState.DONE},
            None,
        ),
    ],
)
def test_reclaim_phases_and_the_abandon_rule(
    fact: ReclaimFact, now: float, phases: dict[str, float | ReclaimState], abandon_at: float | None
) -> None:
    updates, due = track_reclaims(now, [fact], [replica(0, R.SERVING, since=T - 10)])  # serving before
    assert updates == ((PhaseUpdate(1, tuple(phases.items())),) if phases else ())
    assert due == abandon_at


def test_a_reclaim_is_done_when_a_replica_serves_since_its_decision() -> None:
    fact = reclaim((), notice_at=T + 2, freed_at=T + 25, replica_id="chat/1")
    replicas = [
        replica(0, R.SERVING, since=T + 30),  # not the replica the reclaim is for
        replica(1, R.SERVING, node="n2", since=T + 40),
    ]
    updates, due = track_reclaims(T + 5000, [fact], replicas)  # late, but healthy wins
    assert updates == (PhaseUpdate(1, (("healthy_at", T + 40), ("state", ReclaimState.DONE))),)
    assert due is None


def test_a_count_that_came_back_down_is_not_growing() -> None:
    """Needed rose 1 → 2 and fell back to 1 within the window: the least-squares slope of that bump
    is positive when the bump sits late in the window (it held research back after a surge had
    passed; found replaying the real reclaim story), but nothing is growing."""
    bump = [(0.0, 1), (4.7, 2), (5.0, 2), (5.5, 2), (6.0, 2), (15.3, 1), (15.8, 1)]
    assert growth_per_s(bump) == 0.0
    ramp = [(float(t), 1 + t // 4) for t in range(0, 17)]
    slope = growth_per_s(ramp)
    assert slope is not None and 0.2 < slope < 0.3
    assert growth_per_s([(0.0, 1), (10.0, 3)]) == 0.2  # two readings: the plain slope
    assert growth_per_s([(5.0, 1)]) is None


def test_failed_starts_are_counted_per_service_not_per_slot() -> None:
    """Issue 12: two slots failing in turn alerted only after 5 failed starts (3 on one slot)."""
    two = (replica(0, R.FAILED, failures=2, since=NOW - 5), replica(1, R.FAILED, failures=1, since=NOW - 3))
    assert failures_in_a_row(two) == FAILURES_BEFORE_ALERT
    restarting = (
        replica(0, R.STARTING, failures=1, since=NOW - 5),
        replica(1, R.FAILED, failures=1, since=NOW - 3),
    )
    assert failures_in_a_row(restarting) == 2
    rules = replace(RULES, spec=replace(SPEC, min_replicas=2, max_replicas=2))
    plan = decide_inference(snap(two, now=NOW, memory=InferenceMemory.start((rules,)), rules=rules))
    assert plan.scale.services[0].alert == "3 replica start failures in a row: no new lending from chat"


def test_a_service_never_healthy_since_start_is_not_fresh_and_lends_nothing_new() -> None:
    """Issue 12: at start-up a service still bringing replicas up counted as fresh and lent
    before any load data."""
    for replicas in ((), (replica(0, R.STARTING, since=NOW),), (replica(0, R.FAILED, failures=1),)):
        plan = decide_inference(snap(replicas))
        assert plan.memory.fresh_at["chat"] is None
        assert plan.envelope.fail_safe is not None and "never fresh" in plan.envelope.fail_safe
        assert plan.envelope.lendable_gpus == 0
    # Its first fresh metrics make it fresh.
    serving = (replica(0, R.SERVING),)
    plan = decide_inference(snap(serving, signals=load(1.0, "chat/0")))
    assert plan.memory.fresh_at["chat"] == NOW and plan.envelope.fail_safe is None
    # An idle service (every replica parked, none wanted) has nothing to measure: fresh.
    idle_rules = replace(RULES, spec=replace(SPEC, min_replicas=0))
    parked = (replica(0, R.PARKED, parked_as="sleep"),)
    plan = decide_inference(snap(parked, rules=idle_rules))
    assert plan.memory.fresh_at["chat"] == NOW and plan.envelope.fail_safe is None
