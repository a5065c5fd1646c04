"""The inference half of a tick: observe replicas and their load, scale each service, park and
unpark replicas, and work out which GPUs research may use (docs/architecture.md §4.2).

Per tick: (1) service-manager events move replicas (healthy → SERVING and into the gateway;
asleep/stopped → PARKED, GPUs back to the pool; failed → FAILED with a retry backoff); (2) each
service's metrics source gives `ServiceSignals`; (3) `policy.autoscale` gives desired replicas;
(4) `policy.lending` gives the envelope (how many GPUs may be lent, and what each service must
keep); (5) `policy.replicas` plans starts, wakes, drains and parks, which are booked in the store
first (GPUs in the ledger) and then carried out; (6) `control.reclaimer` preempts research steps
that hold GPUs inference is missing or that lending no longer allows; (7)
`policy.replicas.research_gpus` picks the free GPUs research may take, and the step scheduler sees
every other GPU as unavailable.
Must not: read the wall clock (`now` comes in), sleep, or do I/O except through its ports.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from lowtide.control.inference_ports import (
    Gateway,
    MetricsSource,
    ReplicaEvent,
    ReplicaLaunch,
    ServiceManager,
)
from lowtide.control.reclaimer import Reclaimer, ReclaimStore
from lowtide.control.records import GpuBusy, ReplicaRecord, StaleState
from lowtide.domain.gpus import GpuRef, Node, cuda_visible_devices
from lowtide.domain.metrics import ServiceSignals
from lowtide.domain.services import LendingPolicy, ServiceSpec
from lowtide.domain.states import GPU_HOLDING_REPLICA_STATES, SUPPLY_REPLICA_STATES, ReplicaState
from lowtide.policy.autoscale import (
    ReplicaSupply,
    ScaleDecision,
    ScaleState,
    decide_scale,
    initial_state,
    next_decision_at,
)
from lowtide.policy.forecast import WeeklyProfile
from lowtide.policy.lending import Envelope, ServiceLendingInput, envelope, next_lending_edge
from lowtide.policy.reclaim import ReclaimPlan
from lowtide.policy.replicas import (
    ReplicaAction,
    ReplicaPlan,
    ReplicaView,
    ServiceView,
    plan_replicas,
    research_gpus,
)
from lowtide.policy.snapshot import RunningStep

log = logging.getLogger("lowtide.inference")
R = ReplicaState

#: Restart backoff of a failed replica: base × 2^(failures−1), capped.
RESTART_BACKOFF_S = 10.0
RESTART_BACKOFF_MAX_S = 600.0
#: After this many failed starts in a row a service raises an alert and lends nothing new.
FAILURES_BEFORE_ALERT = 3
#: How often the learned weekly profile is saved (seconds).
FORECAST_SAVE_EVERY_S = 600.0
#: The forecast profile's predictions change at quarter-hours (its hour bins, any time zone).
FORECAST_STEP_S = 900.0


class InferenceStore(ReclaimStore, Protocol):
    def replicas(self, service: str | None = None) -> list[ReplicaRecord]: ...

    def begin_replica(
        self,
        *,
        replica_id: str,
        service: str,
        slot: int,
        port: int,
        node: str,
        gpus: tuple[int, ...],
        wake: bool,
        now: float,
        reason: str,
    ) -> ReplicaRecord: ...

    def move_replica(
        self,
        replica_id: str,
        expected: ReplicaState,
        target: ReplicaState,
        *,
        now: float,
        message: str,
        **values: Any,
    ) -> None: ...

    def add_service_event(
        self, service: str, replica_id: str | None, *, at: float, kind: str, message: str
    ) -> None: ...

    def get_value(self, key: str) -> str | None: ...

    def set_value(self, key: str, value: str) -> None: ...


@dataclass(frozen=True)
class ServiceSetup:
    """A service as the controller runs it: the policy view plus how to launch a replica."""

    spec: ServiceSpec
    command: tuple[str, ...]  # template: {model} {port} {gpus} {python}
    base_port: int
    env: Mapping[str, str] = field(default_factory=dict)
    python: str = "python"
    health_timeout_s: float = 600.0
    drain_timeout_s: float = 30.0
    reclaim_grace_s: float = 60.0  # the longest notice a research step gets when this service reclaims
    work_root: str = ".lowtide/services"

    def port(self, slot: int) -> int:
        return self.base_port + slot

    def render(self, slot: int, gpus: tuple[int, ...]) -> tuple[str, ...]:
        values = {
            "model": self.spec.model,
            "port": str(self.port(slot)),
            "gpus": str(len(gpus)),
            "python": self.python,
        }
        return tuple(arg.format(**values) for arg in self.command)


@dataclass
class ServiceStatus:
    """What the API shows about a service after a tick."""

    decision: ScaleDecision | None = None
    signals: ServiceSignals | None = None
    fresh_at: float | None = None  # when its data was last trustworthy
    blocked: str = ""
    target: int = 0
    alert: str = ""  # something an operator must look at (e.g. replicas that never become healthy)


@dataclass(frozen=True)
class InferenceTick:
    unavailable: frozenset[GpuRef]  # GPUs the step scheduler must not use this tick
    envelope: Envelope
    plan: ReplicaPlan
    reclaim: ReclaimPlan | None = None
    #: Something this tick did finishes only at a later tick (a drain, a retried action).
    changed: bool = False
    #: The earliest time a decision changes with no new event or load (None: none pending).
    next_due: float | None = None


class InferenceController:
    def __init__(
        self,
        *,
        store: InferenceStore,
        manager: ServiceManager,
        sources: Mapping[str, MetricsSource],
        gateway: Gateway | None,
        services: tuple[ServiceSetup, ...],
        lending: LendingPolicy,
        nodes: tuple[Node, ...],
    ) -> None:
        self.store = store
        self.manager = manager
        self.sources = sources
        self.gateway = gateway
        self.services = {s.spec.name: s for s in services}
        self.lending = lending
        self.nodes = nodes
        self.scale_states: dict[str, ScaleState] = {s.spec.name: initial_state(s.spec) for s in services}
        self.status: dict[str, ServiceStatus] = {s.spec.name: ServiceStatus() for s in services}
        self.profiles: dict[str, WeeklyProfile] = {}
        self._saved_profiles_at = -math.inf
        self._needed_history: dict[str, list[tuple[float, int]]] = {s.spec.name: [] for s in services}
        self.last: InferenceTick | None = None
        self.reclaimer = Reclaimer(
            store=store,
            nodes=nodes,
            specs={s.spec.name: s.spec for s in services},
            reclaim_grace={s.spec.name: s.reclaim_grace_s for s in services},
        )

    # -- start-up ------------------------------------------------------------------------------

    def recover(self, now: float) -> None:
        """Re-attach to replicas an earlier control plane started; the rest fail and restart.
        Replica processes of this installation that no record knows are killed."""
        known: set[str] = set()
        for rec in self.store.replicas():
            setup = self.services.get(rec.service)
            if setup is None or rec.state not in GPU_HOLDING_REPLICA_STATES | {R.PARKED}:
                continue
            if rec.state == R.PARKED and rec.parked_as != "sleep":
                continue
            known.add(rec.id)
            if not self.manager.adopt(rec.id, self._launch(setup, rec.slot, rec.node or "", rec.gpus), now):
                self._fail(rec, now, "process gone after a control-plane restart")
            elif rec.state == R.PARKING:  # the park was cut short by the restart: finish it
                self.manager.park(rec.id, setup.spec.park, now)
        killed = self.manager.reap_orphans(known)
        if killed:
            log.warning("killed replica processes nobody knows: %s", killed)
        self._load_profiles()

    # -- the tick ------------------------------------------------------------------------------

    def tick(self, now: float, *, running: tuple[RunningStep, ...]) -> InferenceTick:
        step_gpus = frozenset(GpuRef(r.node, g) for r in running for g in r.gpus)
        events = self.manager.poll(now)
        self._apply_events(events, now)
        records = {r.id: r for r in self.store.replicas()}
        decisions: dict[str, ScaleDecision] = {}
        inputs: list[ServiceLendingInput] = []
        for name, setup in self.services.items():
            mine = [r for r in records.values() if r.service == name]
            signals = self._collect(setup, mine, now)
            status = self.status[name]
            status.signals = signals
            if any(not s.stale for s in signals.replicas) and not signals.source_error:
                status.fresh_at = now
            elif not [r for r in mine if r.state in (R.SERVING, R.DRAINING)]:
                status.fresh_at = now if status.fresh_at is None else status.fresh_at
            supply = ReplicaSupply(
                serving=sum(r.state == R.SERVING for r in mine),
                starting=sum(r.state == R.STARTING for r in mine),
                waking=sum(r.state == R.WAKING for r in mine),
            )
            decision = decide_scale(setup.spec, signals, supply, self.scale_states[name], now)
            self.scale_states[name] = decision.state
            decisions[name] = decision
            status.decision = decision
            self._observe(name, decision, now)
            held = sum(len(r.gpus) for r in mine if r.state in GPU_HOLDING_REPLICA_STATES)
            age = None if status.fresh_at is None else now - status.fresh_at
            # Failures in a row: those since a replica of this service last became healthy.
            healthy_since = max((r.since for r in mine if r.state == R.SERVING), default=-math.inf)
            failing = max(
                (r.failures for r in mine if r.state == R.FAILED and r.since > healthy_since), default=0
            )
            if failing >= FAILURES_BEFORE_ALERT:
                # A service that cannot bring replicas up is not safe to lend from.
                self._alert(
                    name, f"{failing} replica start failures in a row: no new lending from {name}", now
                )
                age = max(age or 0.0, self.lending.stale_after_s + 1.0)
            else:
                status.alert = ""
            inputs.append(
                ServiceLendingInput(
                    spec=setup.spec,
                    decision=decision,
                    held_gpus=held,
                    signals_age_s=age,
                    growth_per_s=self._growth(name, now),
                    forecast_needed=peak[0] if (peak := self._forecast(name, now)) else None,
                    forecast_at=peak[1] if peak else None,
                )
            )
        pool = sum(n.gpu_count for n in self.nodes)
        env = envelope(
            now=now, pool_gpus=pool, services=inputs, policy=self.lending, currently_lent_gpus=len(step_gpus)
        )
        views = []
        for name, setup in self.services.items():
            target = max(decisions[name].desired, env.claims.get(name, 0))
            self.status[name].target = target
            views.append(self._view(setup, records, target))
        # Services furthest below their target go first when GPUs are short.
        views.sort(
            key=lambda v: -(v.desired - sum(r.state in (R.SERVING, R.STARTING, R.WAKING) for r in v.replicas))
        )
        busy = step_gpus | self._replica_gpus(records.values())
        plan = plan_replicas(views, self.nodes, busy, now)
        for name in self.services:
            self.status[name].blocked = "; ".join(b.reason for b in plan.blocked if b.service == name)
        # A drain ends (or an action is retried) at a later tick; everything else this tick starts
        # reports back through the service manager's events.
        follow_up = any(a.kind in ("drain", "undrain") for a in plan.actions)
        for action in plan.actions:
            try:
                self._act(action, records, now)
            except (StaleState, GpuBusy) as exc:
                follow_up = True
                log.info("%s %s skipped: %s", action.kind, action.replica_id, exc)
            except Exception:
                follow_up = True
                log.exception("%s of %s failed", action.kind, action.replica_id)
        records = {r.id: r for r in self.store.replicas()}
        self._sync_gateway(records)
        # GPUs research holds that inference needs (or that lending no longer allows) come back.
        deficits = {
            v.spec.name: v.desired
            - sum(records[r.id].state in SUPPLY_REPLICA_STATES for r in v.replicas if r.id in records)
            for v in views
        }
        reclaim = self.reclaimer.tick(
            now, running=running, replicas=records, replica_plan=plan, envelope=env, deficits=deficits
        )
        busy = step_gpus | self._replica_gpus(records.values())
        affinity = frozenset(
            g for r in records.values() if r.state == R.PARKED and r.parked_as == "sleep" for g in _refs(r)
        )
        offered = research_gpus(
            self.nodes,
            busy=busy,
            reserved=frozenset(),
            affinity=affinity,
            new_lendable=env.lendable_gpus - len(step_gpus),
        )
        everything = frozenset(g for n in self.nodes for g in n.refs())
        result = InferenceTick(
            unavailable=everything - offered - step_gpus,
            envelope=env,
            plan=plan,
            reclaim=reclaim,
            changed=follow_up,
            next_due=self._next_due(now, decisions, records.values()),
        )
        self.last = result
        self._save_profiles(now)
        return result

    def _next_due(self, now: float, decisions: Mapping[str, ScaleDecision], records: Any) -> float | None:
        """When this side must decide again although nothing was observed to change: a waiting
        scale-down, a lending window edge, a failed replica's restart, a reclaim to abandon, the
        forecast horizon reaching the next quarter-hour (docs/architecture.md §4, "event time")."""
        times = [
            t
            for name, d in decisions.items()
            if (t := next_decision_at(d, self.services[name].spec)) is not None
        ]
        times += [r.retry_at for r in records if r.state == R.FAILED and r.retry_at and r.retry_at > now]
        edge = next_lending_edge(now, self.lending)
        if edge is not None:
            times.append(edge)
        due = self.reclaimer.next_due(now)
        if due is not None:
            times.append(due)
        # The growth reserve changes as readings leave the slope's window.
        horizon = max(60.0, self.lending.reclaim_lead_s)
        times += [
            h[0][0] + horizon for h in self._needed_history.values() if len(h) > 1 and h[0][0] + horizon > now
        ]
        if self.lending.mode == "forecast":
            horizon = now + self.lending.reclaim_lead_s
            times.append(
                (math.floor(horizon / FORECAST_STEP_S) + 1) * FORECAST_STEP_S - self.lending.reclaim_lead_s
            )
        return min(times, default=None)

    # -- observe -------------------------------------------------------------------------------

    def _apply_events(self, events: list[ReplicaEvent], now: float) -> None:
        for ev in events:
            try:
                rec = next((r for r in self.store.replicas() if r.id == ev.replica_id), None)
                if rec is None:
                    continue
                if ev.kind == "healthy" and rec.state in (R.STARTING, R.WAKING):
                    self.store.move_replica(
                        rec.id, rec.state, R.SERVING, now=ev.at, message="healthy: serving", failures=0
                    )
                elif ev.kind == "asleep" and rec.state == R.PARKING:
                    self.store.move_replica(
                        rec.id, R.PARKING, R.PARKED, now=ev.at, message="asleep", parked_as="sleep"
                    )
                elif ev.kind == "stopped" and rec.state == R.PARKING:
                    self.store.move_replica(
                        rec.id, R.PARKING, R.PARKED, now=ev.at, message="stopped", parked_as="stop"
                    )
                elif ev.kind in ("failed", "stopped") and rec.state != R.FAILED:
                    self._fail(rec, ev.at, ev.detail or ev.kind)
            except StaleState as exc:
                log.info("replica event %s for %s ignored: %s", ev.kind, ev.replica_id, exc)

    def _alert(self, service: str, message: str, now: float) -> None:
        status = self.status[service]
        if status.alert != message:  # once per new situation, not every tick
            status.alert = message
            log.warning("service %s: %s", service, message)
            self.store.add_service_event(service, None, at=now, kind="alert", message=message)

    def _fail(self, rec: ReplicaRecord, now: float, why: str) -> None:
        failures = rec.failures + 1
        delay = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (failures - 1))
        if rec.state == R.PARKED:  # a sleeping replica whose process is gone: it must start anew
            self.store.move_replica(
                rec.id, R.PARKED, R.FAILED, now=now, message=f"failed: {why}", failures=failures, retry_at=now
            )
            return
        self.store.move_replica(
            rec.id,
            rec.state,
            R.FAILED,
            now=now,
            message=f"failed: {why}; restart in {delay:g}s",
            failures=failures,
            retry_at=now + delay,
            parked_as=None,
        )

    def _collect(self, setup: ServiceSetup, mine: list[ReplicaRecord], now: float) -> ServiceSignals:
        urls = {
            r.id: url
            for r in mine
            if r.state in (R.SERVING, R.DRAINING) and (url := self.manager.url(r.id) or _url(r)) is not None
        }
        source = self.sources.get(setup.spec.name)
        if source is None or not urls:
            return ServiceSignals(service=setup.spec.name, at=now)
        return source.collect(setup.spec.name, urls, now)

    def _observe(self, name: str, decision: ScaleDecision, now: float) -> None:
        if decision.unknown:
            return
        history = self._needed_history[name]
        history.append((now, decision.needed))
        horizon = now - max(60.0, self.lending.reclaim_lead_s)
        while history and history[0][0] < horizon:
            history.pop(0)
        if self.lending.mode == "forecast":
            profile = self.profiles.get(name) or WeeklyProfile.empty(self.lending.timezone)
            self.profiles[name] = profile.observe(now, float(decision.needed))

    def _growth(self, name: str, now: float) -> float | None:
        """Replicas per second the needed count rose over the recent past (None: too little data)."""
        history = self._needed_history[name]
        if len(history) < 2 or history[-1][0] - history[0][0] <= 0:
            return None
        # Least-squares slope over the window: one old low point does not read as a rising trend.
        n = len(history)
        mean_t = sum(t for t, _ in history) / n
        mean_v = sum(v for _, v in history) / n
        var = sum((t - mean_t) ** 2 for t, _ in history)
        if var <= 0:
            return None
        return sum((t - mean_t) * (v - mean_v) for t, v in history) / var

    def _forecast(self, name: str, now: float) -> tuple[int, float] | None:
        """The peak of needed replicas the weekly profile predicts within the lead time, and when."""
        if self.lending.mode != "forecast":
            return None
        profile = self.profiles.get(name)
        if profile is None:
            return None
        peak = profile.peak_within(now, self.lending.reclaim_lead_s)
        return None if peak is None else (math.ceil(peak[0]), peak[1])

    # -- act -----------------------------------------------------------------------------------

    def _view(self, setup: ServiceSetup, records: Mapping[str, ReplicaRecord], target: int) -> ServiceView:
        spec = setup.spec
        views = []
        for slot in range(spec.max_replicas):
            rid = f"{spec.name}/{slot}"
            rec = records.get(rid)
            in_flight = self.gateway.in_flight(spec.name, rid) if self.gateway is not None and rec else 0
            if rec is None:
                views.append(ReplicaView(rid, spec.name, slot, None))
            else:
                views.append(
                    ReplicaView(
                        rid,
                        spec.name,
                        slot,
                        rec.state,
                        rec.node,
                        rec.gpus,
                        parked_as="sleep"
                        if rec.parked_as == "sleep"
                        else ("stop" if rec.parked_as else None),
                        since=rec.since,
                        retry_at=rec.retry_at,
                        in_flight=in_flight,
                    )
                )
        return ServiceView(spec, target, tuple(views), setup.drain_timeout_s)

    def _act(self, action: ReplicaAction, records: Mapping[str, ReplicaRecord], now: float) -> None:
        setup = self.services[action.service]
        slot = int(action.replica_id.rsplit("/", 1)[1])
        rec = records.get(action.replica_id)
        if action.kind in ("start", "wake"):
            assert action.node is not None
            self.store.begin_replica(
                replica_id=action.replica_id,
                service=action.service,
                slot=slot,
                port=setup.port(slot),
                node=action.node,
                gpus=action.gpus,
                wake=action.kind == "wake",
                now=now,
                reason=action.reason,
            )
            if action.kind == "wake":
                self.manager.unpark(action.replica_id, now)
            else:
                self.manager.start(self._launch(setup, slot, action.node, action.gpus), now)
            return
        assert rec is not None
        if action.kind == "drain":
            self.store.move_replica(rec.id, R.SERVING, R.DRAINING, now=now, message=action.reason)
        elif action.kind == "undrain":
            self.store.move_replica(rec.id, R.DRAINING, R.SERVING, now=now, message=action.reason)
        elif action.kind == "park":
            self.store.move_replica(rec.id, R.DRAINING, R.PARKING, now=now, message=action.reason)
            self.manager.park(rec.id, setup.spec.park, now)

    def _launch(self, setup: ServiceSetup, slot: int, node: str, gpus: tuple[int, ...]) -> ReplicaLaunch:
        rid = f"{setup.spec.name}/{slot}"
        work_dir = f"{setup.work_root}/{setup.spec.name}/{slot}"
        return ReplicaLaunch(
            replica_id=rid,
            service=setup.spec.name,
            model=setup.spec.model,
            node=node,
            gpus=gpus,
            port=setup.port(slot),
            command=setup.render(slot, gpus),
            env={**setup.env, "CUDA_VISIBLE_DEVICES": cuda_visible_devices(gpus)},
            work_dir=work_dir,
            log_path=f"{work_dir}/replica.log",
            health_timeout_s=setup.health_timeout_s,
        )

    def _sync_gateway(self, records: Mapping[str, ReplicaRecord]) -> None:
        if self.gateway is None:
            return
        for name in self.services:
            serving = {
                r.id: url
                for r in records.values()
                if r.service == name and r.state == R.SERVING and (url := self.manager.url(r.id) or _url(r))
            }
            self.gateway.set_backends(name, serving)

    @staticmethod
    def _replica_gpus(records: Any) -> frozenset[GpuRef]:
        return frozenset(g for r in records if r.state in GPU_HOLDING_REPLICA_STATES for g in _refs(r))

    # -- the forecast profile ------------------------------------------------------------------

    def _load_profiles(self) -> None:
        if self.lending.mode != "forecast":
            return
        for name in self.services:
            raw = self.store.get_value(f"forecast:{name}")
            if raw:
                try:
                    self.profiles[name] = WeeklyProfile.from_dict(json.loads(raw))
                except (ValueError, KeyError, TypeError):
                    log.warning("ignoring an unreadable saved forecast profile for %s", name)

    def _save_profiles(self, now: float) -> None:
        if self.lending.mode != "forecast" or now - self._saved_profiles_at < FORECAST_SAVE_EVERY_S:
            return
        for name, profile in self.profiles.items():
            self.store.set_value(f"forecast:{name}", json.dumps(profile.to_dict()))
        self._saved_profiles_at = now


def _refs(r: ReplicaRecord) -> tuple[GpuRef, ...]:
    return tuple(GpuRef(r.node, i) for i in r.gpus) if r.node else ()


def _url(r: ReplicaRecord) -> str:
    return f"http://127.0.0.1:{r.port}"
