"""The inference half of a tick, as decisions: replica events → replica moves, then snapshot →
plan (pure; docs/architecture.md §4.2).

Role: everything `control.inference` used to work out between its reads and writes.
- `settle_events`: what each service-manager event does to its replica (`event_move`, the table
  below), folded in order over the replicas; a failure's restart backoff (`failure_move`).
- `decide_inference(snapshot)`: per service, when its data was last fresh, the scale decision
  (`policy.autoscale`), the needed-replicas history and its slope, the forecast peak, the alert
  after `FAILURES_BEFORE_ALERT` failed starts in a row; the envelope (`policy.lending`); the
  replica plan (`policy.replicas`, services furthest below their target first); what the
  replicas become once the plan is carried out (`apply_actions`); the reclaim decision
  (`policy.reclaim_phases`); the GPUs the step scheduler must not use; when to decide again.
  `decide_services` and `complete` are its two halves: when an action of the replica plan could
  not be carried out, the caller completes the decision again on the replicas as they are.
Neighbours: `policy.inference_snapshot` (input), `control.inference` (builds the snapshot, books
the plan in the store, carries it out through the ports, keeps `InferenceMemory` between ticks).
Must not: read the clock (time is `snapshot.now` or the event's own time), do I/O, call a port,
or mutate its inputs; the same snapshot always gives the same plan. Speed (the simulator ticks
tens of thousands of times on mostly the same inputs): the running steps' GPUs (also for a new
tuple of steps holding the same GPUs with the same notice), the busy GPUs, the sleeping
replicas' GPUs, the GPUs research may not use (per node too), each service's replicas with their
supply, held GPUs and failure streak, the restart times and the growth slope are kept from the
last call (`policy.memo.Last`, identity of kept immutable inputs or equality with frozen copies),
which changes no answer (tests/unit/test_sim_speed_caches.py, benchmarks/simulate_digest.py).

Replica events (anything else, e.g. `healthy` for a SERVING replica, changes nothing):

    healthy             STARTING | WAKING → SERVING, failures = 0
    asleep              PARKING → PARKED, parked_as = sleep
    stopped             PARKING → PARKED, parked_as = stop
    failed | stopped    any other state but FAILED → FAILED, failures + 1, restart at
                        at + min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S × 2^(failures − 1))
                        and parked_as cleared; from PARKED (a sleeping replica whose process is
                        gone) the restart may happen at once (retry_at = at)

Hung replicas (`hung_replicas`): vLLM's `/health` stays 200 while its engine is stuck (and a
SIGSTOPped process answers nothing at all), so lowtide trusts its own signals instead. A SERVING or
DRAINING replica of a service with `hung_after_s` set is hung when
  - its own metrics have been stale for at least `hung_after_s`: scrapes failing or timing out, no
    successful scrape, or gauges frozen with requests in flight (`policy.signals`, rules 2–4;
    `stale_since` says since when; not when the whole metrics source failed, `source_error`:
    that is the source's problem, not the replica's; and not frozen gauges while the gateway has
    nothing in flight on the replica: that is vLLM's stuck-gauge bug on an idle replica), or
  - the gateway saw `UPSTREAM_FAILURES_BEFORE_HUNG` upstream failures in a row on it (timeouts,
    refused connections, broken answers; any answer resets the count).
A hung replica gets a `restart` action: it is moved to FAILED at once (out of the gateway, its
failures + 1, restart after the backoff; the same move as a failure event, `failure_move`) and its
process killed; this tick's plan already counts it as lost capacity, so a replacement starts on a
free slot. Its GPUs stay busy for the rest of this tick (the kill is still under way).

Scale from zero (`held_floor`): requests the gateway holds because a service has no live replica
(`InferenceSnapshot.held`) are demand its metrics cannot show (no replica serves them, so none
reports them, and with nothing to scrape the autoscaler holds what it had: 0). A service holding
requests gets needed ≥ 1 (desired = needed + headroom, at most `max_replicas`), applied after the
autoscaler, so that "no fresh data → hold 0" never blocks it; the replica plan then wakes a
sleeping replica or starts one. The floor also goes into the autoscaler's history, so the new
replica is not parked again before a stabilisation window without load has passed.

Open reclaims (`reclaim_floor`): while a reclaim for a service is OPEN, the replicas it was
opened for count in the service's target (desired ≥ its starting, waking and serving replicas +
the named replicas not among them + the unnamed reclaims no replica has started for since their
decision), applied after the autoscaler like the held floor. The GPUs the victims free are then
the service's, not research's, even when the control plane restarted during the grace and its
load or memory says less for a while (issue 12); a reclaim ends DONE or ABANDONED (900 s after
the GPUs were freed), and with it the floor.

Draining without a gateway (`ServiceRules.drain_from_metrics`): the requests still on a DRAINING
replica are its own metrics' running + waiting (rounded up) instead of the gateway's count; with
those unknown or stale it has not drained (1), so only the drain timeout parks it (vLLM aborts
what is left on SIGTERM, so a drain must not be cut short on a guess).

Freshness (`fresh_at` in the memory, the age lending sees): now when a serving replica's
metrics are fresh; a service with nothing to scrape keeps its last fresh time, and counts as
fresh from the first tick only when it is idle (parked or nothing wanted, `coming_up` false):
one still bringing replicas up has no fresh data until they serve, so nothing new is lent.

Alert: a service whose replicas, since one of them last became healthy, have failed to start
`FAILURES_BEFORE_ALERT` times in a row, all slots together (`failures_in_a_row`), raises an
alert (written once per new text) and counts as stale beyond `stale_after_s` for lending: no new
lending from it until a replica serves again.

Next due (`InferencePlan.next_due`, docs/architecture.md §4.3): the earliest of a waiting
scale-down's end, a FAILED replica's restart, a lending window edge, an open reclaim to abandon,
the time the oldest needed-history reading leaves the growth window, and in mode `forecast` the
time the lead-time horizon crosses the next quarter-hour.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Protocol

from lowtide.domain.gpus import GpuRef, Node
from lowtide.domain.metrics import ReplicaSignals, ServiceSignals
from lowtide.domain.services import LendingPolicy, ParkMode, ServiceSpec
from lowtide.domain.states import GPU_HOLDING_REPLICA_STATES, SUPPLY_REPLICA_STATES, ReplicaState
from lowtide.policy.autoscale import (
    ReplicaSupply,
    ScaleDecision,
    decide_scale,
    initial_state,
    next_decision_at,
)
from lowtide.policy.evolve import evolve
from lowtide.policy.forecast import WeeklyProfile
from lowtide.policy.inference_snapshot import InferenceMemory, InferenceSnapshot, ReclaimFact, ServiceRules
from lowtide.policy.lending import Envelope, ServiceLendingInput, envelope, next_lending_edge
from lowtide.policy.memo import Last
from lowtide.policy.reclaim_phases import ReclaimDecision, decide_reclaim
from lowtide.policy.replicas import (
    ReplicaAction,
    ReplicaPlan,
    ReplicaView,
    ServiceView,
    plan_replicas_on,
    research_offer,
    supply_and_draining,
)
from lowtide.policy.signals import FROZEN_REASON
from lowtide.policy.snapshot import RunningStep, pool_gpus

R = ReplicaState

#: Restart backoff of a failed replica: base × 2^(failures−1), capped.
RESTART_BACKOFF_S = 10.0
RESTART_BACKOFF_MAX_S = 600.0
#: After this many failed starts in a row a service raises an alert and lends nothing new.
FAILURES_BEFORE_ALERT = 3
#: The forecast profile's predictions change at quarter-hours (its hour bins, any time zone).
FORECAST_STEP_S = 900.0
#: The needed-replicas slope looks back max(this, the lending lead time) seconds.
GROWTH_WINDOW_MIN_S = 60.0
#: Upstream failures in a row at the gateway after which a replica counts as hung.
UPSTREAM_FAILURES_BEFORE_HUNG = 3

_UP = (R.SERVING, R.STARTING, R.WAKING)  # the supply a service's deficit is counted against
_SCRAPED = (R.SERVING, R.DRAINING)  # replicas whose metrics are read


# -- replica events -------------------------------------------------------------------------------


class ReplicaEventLike(Protocol):
    """What the service manager reports (`control.inference_ports.ReplicaEvent`)."""

    @property
    def replica_id(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def at(self) -> float: ...

    @property
    def detail(self) -> str: ...


MoveValue = int | float | str | None


@dataclass(frozen=True, slots=True)
class ReplicaMove:
    """A guarded replica state move to book: `expected` → `target` at `at`, setting `values`
    (columns such as failures, retry_at, parked_as) besides the state, `since` and the message."""

    replica_id: str
    expected: ReplicaState
    target: ReplicaState
    at: float
    message: str
    values: tuple[tuple[str, MoveValue], ...] = ()

    def columns(self) -> dict[str, MoveValue]:
        return dict(self.values)


@dataclass(frozen=True, slots=True)
class EventOutcome:
    moves: tuple[ReplicaMove, ...]  # in event order
    replicas: tuple[ReplicaView, ...]  # the replicas once every move is booked
    sources: tuple[int, ...] = ()  # the index of the event each move comes from


def restart_delay(failures: int) -> float:
    """Seconds before a replica that failed `failures` times in a row is started again."""
    return min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2.0 ** (failures - 1))


def failure_move(replica: ReplicaView, at: float, why: str) -> ReplicaMove:
    """The move of a replica that failed (or whose process is gone) at `at`."""
    state = _state(replica)
    failures = replica.failures + 1
    if state == R.PARKED:  # a sleeping replica whose process is gone: it must start anew
        return ReplicaMove(
            replica.id, R.PARKED, R.FAILED, at, f"failed: {why}", (("failures", failures), ("retry_at", at))
        )
    delay = restart_delay(failures)
    return ReplicaMove(
        replica.id,
        state,
        R.FAILED,
        at,
        f"failed: {why}; restart in {delay:g}s",
        (("failures", failures), ("retry_at", at + delay), ("parked_as", None)),
    )


def event_move(replica: ReplicaView, event: ReplicaEventLike) -> ReplicaMove | None:
    """What `event` does to `replica` (None: nothing); see the table in the module docstring."""
    state = _state(replica)
    kind = event.kind
    if kind == "healthy" and state in (R.STARTING, R.WAKING):
        return ReplicaMove(replica.id, state, R.SERVING, event.at, "healthy: serving", (("failures", 0),))
    if kind == "asleep" and state == R.PARKING:
        return ReplicaMove(replica.id, R.PARKING, R.PARKED, event.at, "asleep", (("parked_as", "sleep"),))
    if kind == "stopped" and state == R.PARKING:
        return ReplicaMove(replica.id, R.PARKING, R.PARKED, event.at, "stopped", (("parked_as", "stop"),))
    if kind in ("failed", "stopped") and state != R.FAILED:
        return failure_move(replica, event.at, event.detail or kind)
    return None


def moved(replica: ReplicaView, move: ReplicaMove) -> ReplicaView:
    """`replica` once `move` is booked (what the store's guarded writer records)."""
    values = move.columns()
    failures = values.get("failures", replica.failures)
    retry_at = values.get("retry_at", replica.retry_at)
    return evolve(
        replica,
        state=move.target,
        since=move.at,
        failures=failures if isinstance(failures, int) else replica.failures,
        retry_at=float(retry_at) if isinstance(retry_at, int | float) else replica.retry_at,
        parked_as=_park_mode(values["parked_as"]) if "parked_as" in values else replica.parked_as,
    )


def settle_events(replicas: Sequence[ReplicaView], events: Sequence[ReplicaEventLike]) -> EventOutcome:
    """The moves `events` make, in order (a later event sees what an earlier one did); events
    for replicas the store does not know are ignored."""
    by_id = {r.id: r for r in replicas}
    moves: list[ReplicaMove] = []
    sources: list[int] = []
    for index, ev in enumerate(events):
        replica = by_id.get(ev.replica_id)
        if replica is None:
            continue
        move = event_move(replica, ev)
        if move is not None:
            moves.append(move)
            sources.append(index)
            by_id[replica.id] = moved(replica, move)
    if not moves:
        return EventOutcome((), tuple(replicas))
    return EventOutcome(tuple(moves), tuple(by_id.values()), tuple(sources))


# -- hung replicas --------------------------------------------------------------------------------


def hung_reason(
    rules: ServiceRules,
    replica: ReplicaView,
    signals: ReplicaSignals | None,
    *,
    source_error: bool,
    upstream_failures: int,
    now: float,
    gateway_in_flight: int | None = None,
) -> str | None:
    """Why `replica` is hung (None: it is not); see the module docstring. `gateway_in_flight`:
    what the gateway has on the replica (None: no gateway)."""
    bound = rules.hung_after_s
    if bound is None or replica.state not in _SCRAPED:
        return None
    if upstream_failures >= UPSTREAM_FAILURES_BEFORE_HUNG:
        return f"{upstream_failures} requests in a row failed or timed out at the gateway"
    if signals is None or source_error or not signals.stale or signals.stale_since is None:
        return None
    if gateway_in_flight == 0 and signals.stale_reason.startswith(FROZEN_REASON):
        return None  # stuck gauges on an idle replica, not a stuck engine
    age = now - signals.stale_since
    if age < bound:
        return None
    return f"{signals.stale_reason} (stale for {age:.0f}s, hung_after {bound:g}s)"


def hung_replicas(snapshot: InferenceSnapshot) -> dict[str, str]:
    """The hung replicas of every service: replica id → why."""
    out: dict[str, str] = {}
    rules_of = {s.name: s for s in snapshot.services if s.hung_after_s is not None}
    if not rules_of:
        return out
    per_replica: dict[str, tuple[ReplicaSignals, bool]] = {}
    for name in rules_of:
        service_signals = snapshot.signals.get(name)
        if service_signals is not None:
            for rs in service_signals.replicas:
                per_replica[rs.replica] = (rs, bool(service_signals.source_error))
    for r in snapshot.replicas:
        rules = rules_of.get(r.service)
        if rules is None:
            continue
        signals, source_error = per_replica.get(r.id, (None, False))
        why = hung_reason(
            rules,
            r,
            signals,
            source_error=source_error,
            upstream_failures=snapshot.upstream_failures.get(r.id, 0),
            now=snapshot.now,
            gateway_in_flight=snapshot.in_flight.get(r.id),
        )
        if why is not None:
            out[r.id] = why
    return out


# -- scale from zero ------------------------------------------------------------------------------


def held_floor(spec: ServiceSpec, decision: ScaleDecision, held: int, now: float) -> ScaleDecision:
    """`decision` with at least one replica when the gateway holds `held` > 0 requests of the
    service (see the module docstring); unchanged when nothing is held, the decision already wants
    a replica, or the service may have none (`max_replicas` 0)."""
    if held <= 0 or decision.desired >= 1 or spec.max_replicas < 1:
        return decision
    needed = max(decision.needed, 1)
    desired = min(spec.max_replicas, needed + max(spec.headroom_replicas, 0))
    state = evolve(
        decision.state, history=(*decision.state.history, (now, needed)), desired=desired, needed=needed
    )
    reason = f"{decision.reason}; {held} request(s) held at the gateway with no replica serving → {desired}"
    return evolve(decision, desired=desired, needed=needed, reason=reason, state=state)


def reclaim_floor(
    spec: ServiceSpec,
    decision: ScaleDecision,
    replicas: Sequence[ReplicaView],
    reclaims: Sequence[ReclaimFact],
    now: float,
) -> ScaleDecision:
    """`decision` with room for the replicas the service's OPEN reclaims are bringing back (see
    the module docstring); unchanged when it already wants them or nothing is pending."""
    mine = [r for r in reclaims if r.service == spec.name]
    if not mine:
        return decision
    supply = [r for r in replicas if r.state in SUPPLY_REPLICA_STATES]
    supplied = {r.id for r in supply}
    named = {r.replica_id for r in mine if r.replica_id is not None and r.replica_id not in supplied}
    unnamed = [r.decided_at for r in mine if r.replica_id is None]
    pending = len(named)
    if unnamed:
        since = min(unnamed)
        fresh = sum(1 for r in supply if r.since >= since and r.id not in named)
        pending += max(0, len(unnamed) - fresh)
    floor = min(spec.max_replicas, len(supply) + pending)
    if pending <= 0 or decision.desired >= floor:
        return decision
    needed = max(decision.needed, floor - max(spec.headroom_replicas, 0), 0)
    state = evolve(
        decision.state, history=(*decision.state.history, (now, needed)), desired=floor, needed=needed
    )
    reason = f"{decision.reason}; {pending} replica(s) still coming from open reclaims → {floor}"
    return evolve(decision, desired=floor, needed=needed, reason=reason, state=state)


# -- the decision -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServiceEvent:
    """A service event to write (e.g. an alert)."""

    service: str
    replica_id: str | None
    at: float
    kind: str
    message: str


@dataclass(frozen=True, slots=True)
class ServiceOutcome:
    """One service after this tick's decision (what the API shows)."""

    name: str
    decision: ScaleDecision
    signals: ServiceSignals
    fresh_at: float | None  # when its data was last trustworthy
    target: int  # replicas to have: max(desired, what the envelope claims for it)
    blocked: str  # why replicas it wants cannot be brought up now ("" if none)
    alert: str  # what an operator must look at ("" if nothing)


@dataclass(frozen=True, slots=True)
class ScalePlan:
    """The first half of the decision: services, envelope and replica plan."""

    services: tuple[ServiceOutcome, ...]  # in configured order
    alerts: tuple[ServiceEvent, ...]
    envelope: Envelope
    views: tuple[ServiceView, ...]  # as planned: the service furthest below its target first
    replica_plan: ReplicaPlan
    step_gpus: Mapping[str, Set[int]]  # GPU indices per node the running steps hold
    lent_gpus: int  # how many GPUs the running steps hold
    active_lent_gpus: int  # how many of them steps without notice hold
    busy: Mapping[str, Set[int]]  # GPU indices per node steps or replicas hold, before the plan
    memory: InferenceMemory  # the next memory, but for `surge_at` (the reclaim decision's)
    follow_up: bool  # a drain or undrain: it settles at a later tick


@dataclass(frozen=True, slots=True)
class InferencePlan:
    scale: ScalePlan
    replicas: tuple[ReplicaView, ...]  # the replicas once the replica plan is carried out
    reclaim: ReclaimDecision
    unavailable: frozenset[GpuRef]  # GPUs the step scheduler must not use this tick
    next_due: float | None  # the earliest time a decision changes with nothing new observed
    follow_up: bool  # something this plan starts settles only at a later tick
    memory: InferenceMemory  # for the next tick

    @property
    def envelope(self) -> Envelope:
        return self.scale.envelope

    @property
    def replica_plan(self) -> ReplicaPlan:
        return self.scale.replica_plan


def decide_inference(snapshot: InferenceSnapshot) -> InferencePlan:
    """The whole decision of the inference half of a tick; see the module docstring."""
    scale = decide_services(snapshot)
    after = apply_actions(snapshot.replicas, scale.replica_plan.actions, snapshot.services, snapshot.now)
    return complete(snapshot, scale, after)


def decide_services(snapshot: InferenceSnapshot) -> ScalePlan:
    """Scale decisions, alerts, the envelope and the replica plan."""
    now, memory, lending = snapshot.now, snapshot.memory, snapshot.lending
    hung = hung_replicas(snapshot)
    restarts: list[ReplicaAction] = []
    current = snapshot.replicas
    if hung:
        # Out of routing and no longer supply from this tick on (make before break: the plan
        # below already looks for a replacement).
        current = tuple(
            moved(r, failure_move(r, now, f"hung: {hung[r.id]}")) if r.id in hung else r
            for r in snapshot.replicas
        )
        restarts = [
            ReplicaAction("restart", r.id, r.service, r.node, r.gpus, f"hung: {hung[r.id]}")
            for r in snapshot.replicas
            if r.id in hung
        ]
    mine = _replicas_of(snapshot.services, current)
    step_gpus, lent, active_lent = _step_gpus(snapshot.running)
    scale_states = dict(memory.scale_states)
    history_all = dict(memory.needed_history)
    profiles = dict(memory.profiles)
    alerts = dict(memory.alerts)
    fresh = dict(memory.fresh_at)
    window = max(GROWTH_WINDOW_MIN_S, lending.reclaim_lead_s)
    decisions: dict[str, ScaleDecision] = {}
    signals_of: dict[str, ServiceSignals] = {}
    inputs: list[ServiceLendingInput] = []
    events: list[ServiceEvent] = []
    for rules in snapshot.services:
        name, spec = rules.name, rules.spec
        facts = mine[name]
        replicas = facts.replicas
        signals = snapshot.signals.get(name)
        if signals is None:
            signals = ServiceSignals(service=name, at=now)
        signals_of[name] = signals
        fresh_at = fresh.get(name)
        if _any_fresh(signals.replicas) and not signals.source_error:
            fresh_at = now
        elif not facts.scraped and not coming_up(spec, replicas):
            fresh_at = now if fresh_at is None else fresh_at
        fresh[name] = fresh_at
        supply = facts.supply
        state = scale_states.get(name) or initial_state(spec)
        decision = decide_scale(spec, signals, supply, state, now)
        decision = held_floor(spec, decision, snapshot.held.get(name, 0), now)
        decision = reclaim_floor(spec, decision, replicas, snapshot.reclaims, now)
        scale_states[name] = decision.state
        decisions[name] = decision
        history = history_all.get(name, ())
        if not decision.unknown:
            history = _window((*history, (now, decision.needed)), now - window)
            history_all[name] = history
            if lending.mode == "forecast":
                profile = profiles.get(name) or WeeklyProfile.empty(lending.timezone)
                profiles[name] = profile.observe(now, float(decision.needed))
        held = facts.held_gpus
        age = None if fresh_at is None else now - fresh_at
        failing = facts.failing
        if failing >= FAILURES_BEFORE_ALERT:
            # A service that cannot bring replicas up is not safe to lend from.
            message = f"{failing} replica start failures in a row: no new lending from {name}"
            if alerts.get(name, "") != message:  # once per new situation, not every tick
                events.append(ServiceEvent(name, None, now, "alert", message))
            alerts[name] = message
            age = max(age or 0.0, lending.stale_after_s + 1.0)
        else:
            alerts[name] = ""
        peak = forecast_peak(profiles.get(name), now, lending)
        inputs.append(
            ServiceLendingInput(
                spec=spec,
                decision=decision,
                held_gpus=held,
                signals_age_s=age,
                growth_per_s=growth_per_s(history),
                forecast_needed=peak[0] if peak else None,
                forecast_at=peak[1] if peak else None,
            )
        )
    pool = pool_gpus(snapshot.nodes)
    env = envelope(now=now, pool_gpus=pool, services=inputs, policy=lending, currently_lent_gpus=lent)
    views = [
        _kept_service_view(
            rules, max(decisions[rules.name].desired, env.claims.get(rules.name, 0)), current, snapshot
        )
        for rules in snapshot.services
    ]
    targets = {v.spec.name: v.desired for v in views}
    # Services furthest below their target go first when GPUs are short.
    if len(views) > 1:
        views.sort(key=lambda v: -(v.desired - _count_in([r.state for r in v.replicas], _UP)))
    # A hung replica's GPUs stay busy this tick: its process is still being killed.
    busy = _busy(step_gpus, snapshot.replicas)
    plan = plan_replicas_on(views, snapshot.nodes, busy, now)
    if restarts:
        plan = ReplicaPlan((*restarts, *plan.actions), plan.blocked)
    outcomes = tuple(
        ServiceOutcome(
            name=rules.name,
            decision=decisions[rules.name],
            signals=signals_of[rules.name],
            fresh_at=fresh[rules.name],
            target=targets[rules.name],
            blocked="; ".join([b.reason for b in plan.blocked if b.service == rules.name])
            if plan.blocked
            else "",
            alert=alerts[rules.name],
        )
        for rules in snapshot.services
    )
    return ScalePlan(
        services=outcomes,
        alerts=tuple(events),
        envelope=env,
        views=tuple(views),
        replica_plan=plan,
        step_gpus=step_gpus,
        lent_gpus=lent,
        active_lent_gpus=active_lent,
        busy=busy,
        memory=InferenceMemory(  # every field: `replace` without its per-call field walk
            scale_states=scale_states,
            needed_history=history_all,
            profiles=profiles,
            surge_at=memory.surge_at,
            alerts=alerts,
            fresh_at=fresh,
        ),
        # A drain ends at a later tick; everything else this tick starts reports back through
        # the service manager's events (a restart's retry time is in `next_due`).
        follow_up=any(a.kind in ("drain", "undrain") for a in plan.actions),
    )


def apply_actions(
    replicas: Sequence[ReplicaView],
    actions: Sequence[ReplicaAction],
    services: Sequence[ServiceRules],
    now: float,
) -> tuple[ReplicaView, ...]:
    """The replicas once every action is booked: start/wake → STARTING/WAKING on the action's
    GPUs, drain → DRAINING, undrain → SERVING, park → PARKING, restart → FAILED as by
    `failure_move` (each since `now`)."""
    if not actions:
        return tuple(replicas)
    base_port = {s.name: s.base_port for s in services}
    by_id = {r.id: r for r in replicas}
    added = False
    for a in actions:
        current = by_id.get(a.replica_id)
        if a.kind in ("start", "wake"):
            slot = int(a.replica_id.rsplit("/", 1)[1])
            state = R.WAKING if a.kind == "wake" else R.STARTING
            port = base_port.get(a.service, 0) + slot
            if current is None:
                added = True
                by_id[a.replica_id] = ReplicaView(
                    a.replica_id, a.service, slot, state, a.node, a.gpus, None, now, 0.0, 0, 0, port
                )
            else:
                by_id[a.replica_id] = evolve(
                    current, state=state, node=a.node, gpus=a.gpus, port=port, parked_as=None, since=now
                )
        elif current is not None and a.kind == "restart":
            by_id[a.replica_id] = moved(current, failure_move(current, now, a.reason))
        elif current is not None:
            target = {"drain": R.DRAINING, "undrain": R.SERVING, "park": R.PARKING}[a.kind]
            by_id[a.replica_id] = evolve(current, state=target, since=now)
    out = by_id.values()
    return tuple(sorted(out, key=lambda r: (r.service, r.slot, r.id))) if added else tuple(out)


def complete(snapshot: InferenceSnapshot, scale: ScalePlan, replicas: Sequence[ReplicaView]) -> InferencePlan:
    """The second half of the decision, on the replicas as they are after the replica plan:
    the reclaim decision, the GPUs research may not take, and when to decide again."""
    now = snapshot.now
    replicas = tuple(replicas)
    deficits = {}
    if replicas is snapshot.replicas and not scale.replica_plan.actions:
        # No action (so no hung replica either): each view's slots are these very replicas (or
        # empty), in the same states, so its supply is counted on the view (kept per view).
        for v in scale.views:
            deficits[v.spec.name] = v.desired - supply_and_draining(v.replicas)[0]
    else:
        get = {r.id: r for r in replicas}.get
        for v in scale.views:
            states = [x.state for r in v.replicas if (x := get(r.id)) is not None]
            deficits[v.spec.name] = v.desired - _count_in(states, SUPPLY_REPLICA_STATES)
    env = scale.envelope
    reclaim = decide_reclaim(
        now=now,
        nodes=snapshot.nodes,
        specs=_specs_of(snapshot.services)[0],
        reclaim_grace=_specs_of(snapshot.services)[1],
        running=snapshot.running,
        replicas=replicas,
        replica_plan=scale.replica_plan,
        envelope=env,
        deficits=deficits,
        surge_at=snapshot.memory.surge_at,
        reclaims=snapshot.reclaims,
        step_gpus=scale.step_gpus,
        active_lent=scale.active_lent_gpus,
    )
    # Without an action the replicas are those the plan saw, and so are the busy GPUs.
    busy = scale.busy if replicas is snapshot.replicas else _union(scale.step_gpus, _replica_gpus(replicas))
    restarting = {a.replica_id for a in scale.replica_plan.actions if a.kind == "restart"}
    if restarting:  # a hung replica's GPUs are not offered while its process is being killed
        busy = _union(busy, _replica_gpus(r for r in snapshot.replicas if r.id in restarting))
    affinity = _affinity(replicas)
    unavailable = _not_offered(
        snapshot.nodes, busy, affinity, env.lendable_gpus - scale.lent_gpus, scale.step_gpus
    )
    memory = scale.memory
    if reclaim.surge_at != memory.surge_at:
        memory = evolve(memory, surge_at=reclaim.surge_at)
    return InferencePlan(
        scale=scale,
        replicas=replicas,
        reclaim=reclaim,
        unavailable=unavailable,
        next_due=next_due(snapshot, scale, replicas, reclaim, memory),
        follow_up=scale.follow_up,
        memory=memory,
    )


def next_due(
    snapshot: InferenceSnapshot,
    scale: ScalePlan,
    replicas: Sequence[ReplicaView],
    reclaim: ReclaimDecision,
    memory: InferenceMemory,
) -> float | None:
    """When this side must decide again although nothing was observed to change (None: not on
    its own); see the module docstring."""
    now, lending = snapshot.now, snapshot.lending
    specs = _specs_of(snapshot.services)[0]
    times = [t for o in scale.services if (t := next_decision_at(o.decision, specs[o.name])) is not None]
    times += [t for t in _restart_times(replicas) if t > now]
    edge = next_lending_edge(now, lending)
    if edge is not None:
        times.append(edge)
    if reclaim.abandon_at is not None and reclaim.abandon_at > now:
        times.append(reclaim.abandon_at)
    # A growth reserve lasts until the readings below today's count have left the slope's window
    # (a flat history has no reserve and nothing to wait for: no tick for it).
    window = max(GROWTH_WINDOW_MIN_S, lending.reclaim_lead_s)
    for h in memory.needed_history.values():
        if len(h) > 1 and (growth_per_s(h) or 0.0) > 0:
            lower = [t for t, v in h if v < h[-1][1]]
            if lower and max(lower) + window > now:
                times.append(max(lower) + window)
    if lending.mode == "forecast":
        horizon = now + lending.reclaim_lead_s
        times.append((math.floor(horizon / FORECAST_STEP_S) + 1) * FORECAST_STEP_S - lending.reclaim_lead_s)
    return min(times, default=None)


# -- the service's numbers ------------------------------------------------------------------------


#: Replica states whose `failures` are a start streak not yet ended by becoming healthy.
_FAILING_STATES = frozenset({R.FAILED, R.STARTING, R.WAKING})


def coming_up(spec: ServiceSpec, replicas: Sequence[ReplicaView]) -> bool:
    """A service with nothing to scrape that wants replicas it has not got (starting, waking,
    failed and to be restarted, or none at all while `min_replicas` > 0): with no fresh metrics
    since start it is not fresh (issue 12: a never-healthy service counted as fresh at start-up
    and lent before any load data). Only an idle one (parked, or none wanted) counts as fresh."""
    if not replicas:
        return spec.min_replicas > 0
    return any(r.state in (R.STARTING, R.WAKING, R.FAILED) for r in replicas)


def failures_in_a_row(replicas: Iterable[ReplicaView]) -> int:
    """Failed starts in a row of one service, counted per service, not per slot (issue 12: two
    slots failing in turn alerted only after 5): the failures of all its replicas that are
    FAILED or being restarted after failing, changed since a replica of the service last became
    healthy (0: none). A slot's streak that began before that moment counts whole (an alert a
    little early: the safe side)."""
    replicas = tuple(replicas)
    failing = [r for r in replicas if r.failures > 0 and r.state in _FAILING_STATES]
    if not failing:  # the common case, and nothing to count: no need to look for the healthy
        return 0
    healthy_since = max([r.since for r in replicas if r.state == R.SERVING], default=-math.inf)
    return sum(r.failures for r in failing if r.since > healthy_since)


#: The last `growth_per_s`, with the very tuple of readings it came from (immutable): the
#: decision and `next_due` both ask for the history the decision has just made.
_last_growth: Last[tuple[Sequence[tuple[float, int]], float | None]] = Last()


def growth_per_s(history: Sequence[tuple[float, int]]) -> float | None:
    """Replicas per second the needed count rose over `history` (None: too little data): the
    least-squares slope, so that one old low point does not read as a rising trend; 0 once the
    count has come down from its peak within the window (needed only falls after a whole
    stabilisation window of lower load: whatever rose before has passed, nothing grows now)."""
    last = _last_growth.entry
    if last is not None and last[0] is history:
        return last[1]
    slope = _slope(history)
    if isinstance(history, tuple):
        _last_growth.entry = (history, slope)
    return slope


def _slope(history: Sequence[tuple[float, int]]) -> float | None:
    n = len(history)
    if n < 2 or history[-1][0] - history[0][0] <= 0:
        return None
    if history[-1][1] < max(v for _, v in history):
        return 0.0
    mean_t = sum(t for t, _ in history) / n
    mean_v = sum(v for _, v in history) / n
    var = sum((t - mean_t) ** 2 for t, _ in history)
    if var <= 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in history) / var


def forecast_peak(
    profile: WeeklyProfile | None, now: float, lending: LendingPolicy
) -> tuple[int, float] | None:
    """The peak of needed replicas the weekly profile predicts within the lead time for an hour
    that climbs (`WeeklyProfile.ramp_within`), and when (None: not mode `forecast`, or no ramp
    predicted)."""
    if lending.mode != "forecast" or profile is None:
        return None
    peak = profile.ramp_within(now, lending.reclaim_lead_s)
    return None if peak is None else (math.ceil(peak[0]), peak[1])


# -- helpers ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _ServiceReplicas:
    """What the scale decision reads of one service's replicas, worked out once per tuple of
    replicas (`_replicas_of`)."""

    replicas: tuple[ReplicaView, ...]  # in the order of the snapshot's replicas
    supply: ReplicaSupply
    held_gpus: int  # GPUs its replicas hold (`GPU_HOLDING_REPLICA_STATES`)
    failing: int  # `failures_in_a_row`
    scraped: bool  # some replica is SERVING or DRAINING


#: The last `_replicas_of`, with the very services and replicas tuples it came from (immutable).
_last_grouped: Last[
    tuple[tuple[ServiceRules, ...], tuple[ReplicaView, ...], Mapping[str, _ServiceReplicas]]
] = Last()


def _replicas_of(
    services: tuple[ServiceRules, ...], current: tuple[ReplicaView, ...]
) -> Mapping[str, _ServiceReplicas]:
    """Each service's replicas and what the scale decision reads of them (read-only); kept for the
    same tuples of (frozen) services and replicas, which the controller hands in unchanged while
    no replica moves (most ticks)."""
    last = _last_grouped.entry
    if last is not None and last[0] is services and last[1] is current:
        return last[2]
    mine: dict[str, list[ReplicaView]] = {s.name: [] for s in services}
    for r in current:
        if r.service in mine:
            mine[r.service].append(r)
    out: dict[str, _ServiceReplicas] = {}
    for name, replicas in mine.items():
        states = [r.state for r in replicas]
        out[name] = _ServiceReplicas(
            replicas=tuple(replicas),
            supply=ReplicaSupply(
                serving=states.count(R.SERVING),
                starting=states.count(R.STARTING),
                waking=states.count(R.WAKING),
            ),
            held_gpus=sum([len(r.gpus) for r in replicas if r.state in GPU_HOLDING_REPLICA_STATES]),
            failing=failures_in_a_row(replicas),
            scraped=any(r.state in _SCRAPED for r in replicas),
        )
    result = MappingProxyType(out)
    _last_grouped.entry = (services, current, result)
    return result


_last_fresh: Last[tuple[tuple[ReplicaSignals, ...], bool]] = Last()


def _any_fresh(signals: tuple[ReplicaSignals, ...]) -> bool:
    """Some replica's signals are not stale; kept for the same tuple of (frozen) signals, which a
    metrics source may hand back while its figures stay the same (the simulator's)."""
    last = _last_fresh.entry
    if last is not None and last[0] is signals:
        return last[1]
    fresh = any(not s.stale for s in signals)
    _last_fresh.entry = (signals, fresh)
    return fresh


def _count_in(states: list[ReplicaState | None], wanted: Iterable[ReplicaState]) -> int:
    """How many of `states` are among `wanted` (distinct states): counted in C, once per state."""
    return sum(states.count(s) for s in wanted)


def _state(replica: ReplicaView) -> ReplicaState:
    if replica.state is None:
        raise ValueError(f"replica {replica.id} has no record")
    return replica.state


def _park_mode(value: object) -> ParkMode | None:
    if value == "sleep":
        return "sleep"
    return "stop" if value else None


def _window(history: tuple[tuple[float, int], ...], since: float) -> tuple[tuple[float, int], ...]:
    start = 0
    while start < len(history) and history[start][0] < since:
        start += 1
    return history[start:] if start else history


#: The last `_specs_of`, with the very tuple of services it came from.
_last_specs: Last[tuple[tuple[ServiceRules, ...], tuple[Mapping[str, ServiceSpec], Mapping[str, float]]]] = (
    Last()
)


def _specs_of(services: tuple[ServiceRules, ...]) -> tuple[Mapping[str, ServiceSpec], Mapping[str, float]]:
    """Each service's spec and reclaim grace by name (read-only), once per tuple of (frozen)
    services: the controller hands every snapshot the same one."""
    last = _last_specs.entry
    if last is not None and last[0] is services:
        return last[1]
    result = (
        MappingProxyType({s.name: s.spec for s in services}),
        MappingProxyType({s.name: s.reclaim_grace_s for s in services}),
    )
    _last_specs.entry = (services, result)
    return result


@lru_cache(maxsize=64)
def _slots(service: str, slots: int) -> tuple[tuple[str, ...], tuple[ReplicaView, ...]]:
    """The replica ids of a service's slots (`<service>/<slot>`) and their empty views, made
    once, not every tick."""
    ids = tuple(f"{service}/{slot}" for slot in range(slots))
    return ids, tuple(_empty_slot(rid, service, slot) for slot, rid in enumerate(ids))


#: Per service: the rules, target, replicas (the very tuple) and in-flight counts (a copy) the last
#: `_service_view` was built from, and the view (all immutable; at most one entry per service).
_LAST_VIEWS: dict[str, tuple[ServiceRules, int, tuple[ReplicaView, ...], dict[str, int], ServiceView]] = {}


def _kept_service_view(
    rules: ServiceRules,
    target: int,
    current: tuple[ReplicaView, ...],
    snapshot: InferenceSnapshot,
) -> ServiceView:
    """`_service_view`, kept for the same rules, target, tuple of replicas and in-flight counts:
    the view of every slot is otherwise rebuilt each tick although the replicas rarely change.
    Not with `drain_from_metrics`, where a draining replica's count comes from this tick's
    signals."""
    if rules.drain_from_metrics:
        return _service_view(rules, target, {r.id: r for r in current}, snapshot)
    last = _LAST_VIEWS.get(rules.name)
    if (
        last is not None
        and last[0] is rules
        and last[1] == target
        and last[2] is current
        and last[3] == snapshot.in_flight
    ):
        return last[4]
    view = _service_view(rules, target, {r.id: r for r in current}, snapshot)
    if last is not None and last[4].replicas == view.replicas:
        # The same slots (a new target only): the last tuple, which what is kept per tuple of
        # slots (`policy.replicas.supply_and_draining`) recognises.
        view = ServiceView(view.spec, view.desired, last[4].replicas, view.drain_timeout_s)
    if len(_LAST_VIEWS) >= 256:
        _LAST_VIEWS.clear()
    _LAST_VIEWS[rules.name] = (rules, target, current, dict(snapshot.in_flight), view)
    return view


def _service_view(
    rules: ServiceRules, target: int, by_id: Mapping[str, ReplicaView], snapshot: InferenceSnapshot
) -> ServiceView:
    spec = rules.spec
    slots = []
    get, in_flight_of, from_metrics = by_id.get, snapshot.in_flight, rules.drain_from_metrics
    for rid, empty in zip(*_slots(spec.name, spec.max_replicas), strict=True):
        r = get(rid)
        if r is None:
            slots.append(empty)
            continue
        if from_metrics and r.state == R.DRAINING:
            in_flight = _metrics_in_flight(snapshot.signals.get(spec.name), rid)
        else:
            in_flight = in_flight_of.get(rid, 0)
        slots.append(r if r.in_flight == in_flight else evolve(r, in_flight=in_flight))
    return ServiceView(spec, target, tuple(slots), rules.drain_timeout_s)


def _metrics_in_flight(signals: ServiceSignals | None, replica_id: str) -> int:
    """Requests on a replica by its own metrics (running + waiting, rounded up); 1 when unknown."""
    mine = next((s for s in signals.replicas if s.replica == replica_id), None) if signals else None
    if mine is None or mine.stale or mine.running is None:
        return 1
    return math.ceil(mine.running + (mine.waiting or 0.0))


@lru_cache(maxsize=1024)
def _empty_slot(rid: str, service: str, slot: int) -> ReplicaView:
    return ReplicaView(rid, service, slot, None)


_StepGpus = tuple[Mapping[str, frozenset[int]], int, int]
#: The last `_step_gpus` and `_busy`, with the very inputs they were computed from (kept, so that
#: their identities cannot be reused by other objects); replaced whole, never mutated.
_last_steps: Last[tuple[tuple[RunningStep, ...], _StepGpus]] = Last()
_last_busy: Last[tuple[Mapping[str, frozenset[int]], tuple[ReplicaView, ...], Mapping[str, Set[int]]]] = (
    Last()
)


def _step_gpus(running: tuple[RunningStep, ...]) -> _StepGpus:
    """The running steps' GPU indices per node (read-only), how many GPUs that is, and how many
    of them steps without notice hold. The store hands back the same tuple of (frozen) running
    steps while none starts or ends, so the last answer is kept for that very tuple; a new tuple
    whose steps hold the same GPUs with the same notice (a checkpoint only moved a step's
    `last_checkpoint_at`) gets the same answer, as the same object (so `_busy` and
    `_not_offered`, kept by its identity, are not worked out again)."""
    last = _last_steps.entry
    if last is not None:
        if last[0] is running:
            return last[1]
        if _same_holdings(last[0], running):
            _last_steps.entry = (running, last[1])
            return last[1]
    held, lent, active = _count_step_gpus(running)
    result = (MappingProxyType({node: frozenset(v) for node, v in held.items()}), lent, active)
    _last_steps.entry = (running, result)
    return result


def _same_holdings(a: tuple[RunningStep, ...], b: tuple[RunningStep, ...]) -> bool:
    """The same steps' GPUs in the same order: each pair the same step object, or holding the same
    GPUs of the same node with the same notice (all `_count_step_gpus` reads)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x is not y and (x.gpus != y.gpus or x.node != y.node or x.stopping != y.stopping):
            return False
    return True


def _busy(
    step_gpus: Mapping[str, frozenset[int]], replicas: tuple[ReplicaView, ...]
) -> Mapping[str, Set[int]]:
    """GPU indices per node steps or replicas hold (read-only); kept for the same step GPUs and
    the same tuple of (frozen) replicas, which `_step_gpus` and the controller's read of the
    replicas hand back unchanged tick after tick."""
    last = _last_busy.entry
    if last is not None and last[0] is step_gpus and last[1] is replicas:
        return last[2]
    busy = MappingProxyType(_union(step_gpus, _kept_replica_gpus(replicas)))
    _last_busy.entry = (step_gpus, replicas, busy)
    return busy


_last_replica_gpus: Last[tuple[tuple[ReplicaView, ...], Mapping[str, frozenset[int]]]] = Last()


def _kept_replica_gpus(replicas: tuple[ReplicaView, ...]) -> Mapping[str, frozenset[int]]:
    """`_replica_gpus` as read-only frozen sets, kept for the same tuple of (frozen) replicas: the
    running steps change far more often than the replicas do."""
    last = _last_replica_gpus.entry
    if last is not None and last[0] is replicas:
        return last[1]
    held = MappingProxyType({node: frozenset(v) for node, v in _replica_gpus(replicas).items()})
    _last_replica_gpus.entry = (replicas, held)
    return held


_last_affinity: Last[tuple[tuple[ReplicaView, ...], Mapping[str, frozenset[int]]]] = Last()


def _affinity(replicas: tuple[ReplicaView, ...]) -> Mapping[str, frozenset[int]]:
    """The GPU indices per node sleeping replicas will want back (read-only); kept for the same
    tuple of (frozen) replicas, as `_busy` is."""
    last = _last_affinity.entry
    if last is not None and last[0] is replicas:
        return last[1]
    found: dict[str, set[int]] = {}
    for r in replicas:
        if r.state == R.PARKED and r.parked_as == "sleep" and r.node:
            found.setdefault(r.node, set()).update(r.gpus)
    affinity = MappingProxyType({node: frozenset(v) for node, v in found.items()})
    _last_affinity.entry = (replicas, affinity)
    return affinity


_last_restarts: Last[tuple[Sequence[ReplicaView], tuple[float, ...]]] = Last()


def _restart_times(replicas: Sequence[ReplicaView]) -> tuple[float, ...]:
    """The restart times (`retry_at`, when set) of the FAILED replicas; kept for the same tuple
    of (frozen) replicas, as `_busy` is."""
    last = _last_restarts.entry
    if last is not None and last[0] is replicas:
        return last[1]
    times = tuple([r.retry_at for r in replicas if r.state == R.FAILED and r.retry_at])
    if isinstance(replicas, tuple):
        _last_restarts.entry = (replicas, times)
    return times


def _count_step_gpus(running: Iterable[RunningStep]) -> tuple[dict[str, set[int]], int, int]:
    held: dict[str, set[int]] = {}
    active = 0
    for s in running:
        if not s.gpus:
            continue
        mine = held.get(s.node)
        if mine is None:
            held[s.node] = set(s.gpus)
        else:
            mine.update(s.gpus)
        if not s.stopping:
            active += len(s.gpus)
    return held, sum(len(v) for v in held.values()), active


def _replica_gpus(replicas: Iterable[ReplicaView]) -> dict[str, set[int]]:
    held: dict[str, set[int]] = {}
    for r in replicas:
        if r.node and r.state in GPU_HOLDING_REPLICA_STATES:
            held.setdefault(r.node, set()).update(r.gpus)
    return held


def _union(a: Mapping[str, Set[int]], b: Mapping[str, Set[int]]) -> dict[str, Set[int]]:
    out: dict[str, Set[int]] = dict(a)
    for node, indices in b.items():
        mine = out.get(node)
        out[node] = indices if mine is None else mine | indices
    return out


_Frozen = dict[str, frozenset[int]]
_Index = Mapping[str, Set[int]]
#: The inputs and result of the last `_not_offered` (see there), and the very mappings it was
#: given; replaced whole, never mutated.
_last_offer: Last[
    tuple[
        tuple[Node, ...],
        int,
        _Index,
        _Index,
        _Index,
        frozenset[GpuRef],
        _Index | None,
        _Index | None,
        _Index | None,
    ]
] = Last()


def _not_offered(
    nodes: tuple[Node, ...],
    busy: Mapping[str, Set[int]],
    affinity: Mapping[str, Set[int]],
    new_lendable: int,
    steps: Mapping[str, Set[int]],
) -> frozenset[GpuRef]:
    """`_unavailable` of the `research_offer`: the GPUs the step scheduler must not use.

    A pure function of its arguments, which are mostly equal tick after tick (the pool changes
    hands far less often than the loop ticks): the last inputs are kept as frozen copies with
    the result, and equal inputs (compared by value, in C) give that result again instead of a
    pass over every node and GPU. The mappings are first compared by identity with those of the
    last call (kept in the entry): `_busy`, `_affinity` and `_step_gpus` hand back the same
    read-only mappings while their inputs stay the same, and nothing changes them."""
    last = _last_offer.entry
    if (
        last is not None
        and (last[0] is nodes or last[0] == nodes)
        and last[1] == new_lendable
        and (last[6] is busy or last[2] == busy)
        and (last[7] is affinity or last[3] == affinity)
        and (last[8] is steps or last[4] == steps)
    ):
        if last[6] is not busy or last[7] is not affinity or last[8] is not steps:
            _last_offer.entry = (*last[:6], _read_only(busy), _read_only(affinity), _read_only(steps))
        return last[5]
    result = _all_offered(nodes, busy, new_lendable, steps)
    if result is None:
        offer = research_offer(nodes, busy=busy, affinity=affinity, new_lendable=new_lendable)
        result = _unavailable(nodes, steps, offer)
    _last_offer.entry = (
        nodes,
        new_lendable,
        _frozen(busy),
        _frozen(affinity),
        _frozen(steps),
        result,
        _read_only(busy),
        _read_only(affinity),
        _read_only(steps),
    )
    return result


def _read_only(index: _Index) -> _Index | None:
    """`index` when it is one of this module's read-only mappings (built here over a dict nobody
    else holds), which may then be recognised by identity; None for anything else."""
    return index if type(index) is MappingProxyType else None


def _all_offered(
    nodes: tuple[Node, ...], busy: Mapping[str, Set[int]], new_lendable: int, steps: Mapping[str, Set[int]]
) -> frozenset[GpuRef] | None:
    """`_unavailable` of the `research_offer` in the common case where research is offered every
    idle GPU (`new_lendable` at least the idle count, so order and affinity choose nothing): then
    the GPUs research may not use are those busy but not held by a step. None otherwise."""
    if new_lendable <= 0:
        return None
    # The GPUs and the idle count depend on the nodes and the GPUs only, not on `new_lendable`:
    # kept for the very same read-only mappings (the envelope moves more often than the GPUs).
    last = _last_idle.entry
    if last is not None and last[0] is nodes and last[1] is busy and last[2] is steps:
        idle, result = last[3], last[4]
    else:
        idle, result = _idle_and_taken(nodes, busy, steps)
        if _read_only(busy) is not None and _read_only(steps) is not None:
            _last_idle.entry = (nodes, busy, steps, idle, result)
    return None if idle > new_lendable else result


#: The last `_idle_and_taken`, with the very nodes and read-only mappings it came from.
_last_idle: Last[tuple[tuple[Node, ...], _Index, _Index, int, frozenset[GpuRef]]] = Last()


def _idle_and_taken(
    nodes: tuple[Node, ...], busy: Mapping[str, Set[int]], steps: Mapping[str, Set[int]]
) -> tuple[int, frozenset[GpuRef]]:
    """How many GPUs are idle, and the busy GPUs no step holds."""
    key: list[tuple[str, tuple[int, ...]]] = []
    idle = 0
    for n in nodes:
        held = busy.get(n.name)
        if not held:
            idle += len(n.gpus)
            key.append((n.name, ()))
            continue
        mine = steps.get(n.name)
        if type(held) is frozenset and (mine is None or type(mine) is frozenset):
            # Most nodes hold the same GPUs as at the last call: their part is looked up.
            memo = (id(n), held, mine)
            hit = _NODE_TAKEN.get(memo)
            if hit is None or hit[0] is not n:
                hit = (n, *_node_taken(n, held, mine))
                if len(_NODE_TAKEN) >= _NODE_TAKEN_MAX:
                    _NODE_TAKEN.clear()
                _NODE_TAKEN[memo] = hit
            _, taken, rest = hit
        else:
            taken, rest = _node_taken(n, held, mine)
        idle += len(n.gpus) - taken
        key.append((n.name, rest))
    return idle, _gpu_set(tuple(key))


#: `_node_taken` by (id of the node, its busy indices, its steps' indices), with the node kept (so
#: its id cannot be reused while the entry lives, and a hit is checked by identity).
_NODE_TAKEN: dict[tuple[int, frozenset[int], frozenset[int] | None], tuple[Node, int, tuple[int, ...]]] = {}
_NODE_TAKEN_MAX = 8192


def _node_taken(n: Node, held: Set[int], mine: Set[int] | None) -> tuple[int, tuple[int, ...]]:
    """How many of the node's GPUs are busy, and those of them no step holds, in node order."""
    taken = [i for i in n.gpus if i in held]
    return len(taken), tuple([i for i in taken if i not in mine]) if mine else tuple(taken)


def _frozen(index: Mapping[str, Set[int]]) -> _Index:
    """A frozen copy of `index`; one of this module's read-only mappings (`_read_only`: made here,
    over frozen sets) is one already."""
    if type(index) is MappingProxyType:
        return index
    return {node: frozenset(indices) for node, indices in index.items()}


def _unavailable(
    nodes: tuple[Node, ...], steps: Mapping[str, Set[int]], offer: Mapping[str, list[int]]
) -> frozenset[GpuRef]:
    """Every GPU of the pool that no step holds and research is not offered."""
    key = []
    for n in nodes:
        name = n.name
        held = steps.get(name)
        offered = offer.get(name)
        if held:
            out: Set[int] | list[int] = {*held, *offered} if offered else held
        elif offered:
            out = offered
        else:
            key.append((name, n.gpus))
            continue
        key.append((name, tuple([i for i in n.gpus if i not in out])))
    return _gpu_set(tuple(key))


@lru_cache(maxsize=64)
def _gpu_set(key: tuple[tuple[str, tuple[int, ...]], ...]) -> frozenset[GpuRef]:
    """The GPUs named by (node, indices) pairs; the same set is often asked for tick after tick
    (the pool changes hands far less often than the loop ticks), so it is built once. A new
    set is the union of each node's (`_node_gpu_set`): a set union reuses the hashes the parts
    already hold, where building from `GpuRef`s would hash each of them again."""
    return frozenset().union(*[_node_gpu_set(node, indices) for node, indices in key])


@lru_cache(maxsize=8192)
def _node_gpu_set(node: str, indices: tuple[int, ...]) -> frozenset[GpuRef]:
    return frozenset(GpuRef(node, i) for i in indices)
