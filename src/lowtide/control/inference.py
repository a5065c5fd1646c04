"""The inference half of a tick, the observing and acting part: observe → snapshot → decide →
act (docs/architecture.md §4.2).

observe: the service manager's events (settled into replica moves by the pure
`policy.inference.settle_events` and booked at once), the replica records (one store read), the
open reclaims and their victims' times (`control.reclaimer`), each service's metrics (its
`MetricsSource`), what the gateway still has in flight and the requests it holds while a
service has no live replica (scale from zero).
snapshot: an immutable `policy.inference_snapshot.InferenceSnapshot`, with the memory the
decisions carry between ticks (`InferenceMemory`, kept here).
decide: `policy.inference.decide_inference` (scale, alerts, envelope, replica plan, reclaims,
the GPUs research may not take, when to decide again).
act: alerts written; the envelope recorded when `policy.lending_history.record_due` says so;
each replica action booked in the store first (GPUs in the ledger), then carried out through the
service manager (a hung replica's `restart`: booked FAILED, then killed through
`KillsReplicas.kill` where the manager has it, else stopped); the gateway told which
replicas serve; the reclaim decision booked by `control.reclaimer`; the forecast profiles saved
now and then. Every item is handled on its own: `StaleState` / `GpuBusy` skip it, any other
error is logged, and either asks for a follow-up tick (`InferenceTick.changed`); when a replica
action failed, the decision is completed again on the replicas as the store has them
(`policy.inference.complete`). With a `lease`, each action checks it before its booking and
again before its effect (`control.lease`): a control plane that lost the lease stops acting.
Must not: read the wall clock (`now` comes in), sleep, decide anything a policy decides, or do
I/O except through its ports.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Protocol

from lowtide.control.inference_ports import (
    Gateway,
    KillsReplicas,
    MetricsSource,
    ReplicaEvent,
    ReplicaLaunch,
    ServiceManager,
)
from lowtide.control.lease import LeaseGuard
from lowtide.control.load_history import LoadHistory
from lowtide.control.reclaimer import Reclaimer, ReclaimStore
from lowtide.control.records import GpuBusy, ReplicaRecord, StaleState, StoreUnavailable
from lowtide.domain.gpus import GpuRef, Node, cuda_visible_devices
from lowtide.domain.metrics import ServiceSignals
from lowtide.domain.services import LendingPolicy, ServiceSpec
from lowtide.domain.states import GPU_HOLDING_REPLICA_STATES, ReplicaState
from lowtide.policy.autoscale import ScaleDecision, ScaleState
from lowtide.policy.forecast import WeeklyProfile
from lowtide.policy.inference import (
    InferencePlan,
    ReplicaMove,
    complete,
    decide_inference,
    failure_move,
    settle_events,
)
from lowtide.policy.inference_memory import decode_memory, encode_memory
from lowtide.policy.inference_snapshot import (
    InferenceMemory,
    InferenceSnapshot,
    ServiceRules,
)
from lowtide.policy.lending import Envelope, GpuShare, gpu_shares
from lowtide.policy.lending_history import LendingPoint, record_due
from lowtide.policy.reclaim import ReclaimPlan
from lowtide.policy.replicas import ReplicaAction, ReplicaPlan, ReplicaView
from lowtide.policy.snapshot import RunningStep

log = logging.getLogger("lowtide.inference")
R = ReplicaState

#: How often the learned weekly profile is saved (seconds).
FORECAST_SAVE_EVERY_S = 600.0
#: The `control_state` key of the decisions' memory (`policy.inference_memory`).
MEMORY_KEY = "inference.memory"
#: The memory is saved when a decision changed (desired, needed, a guard, a surge, an alert) and
#: otherwise at most this often while its windows move (seconds).
MEMORY_SAVE_EVERY_S = 5.0
_SCRAPED = (R.SERVING, R.DRAINING)
#: Sleeping replicas as (node, GPU indices, residual GiB per GPU), the input of `gpu_shares`.
_Asleep = tuple[tuple[str, tuple[int, ...], float], ...]


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

    def get_state(self, key: str) -> Any | None: ...

    def put_state(self, key: str, value: Any, *, now: float) -> None: ...

    def record_lending(self, point: LendingPoint) -> None: ...


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
    hung_after_s: float | None = None  # see `ServiceRules.hung_after_s`
    drain_from_metrics: bool = False  # see `ServiceRules.drain_from_metrics`

    def port(self, slot: int) -> int:
        return self.base_port + slot

    @property
    def rules(self) -> ServiceRules:
        """What the inference decisions need to know about this service."""
        return ServiceRules(
            self.spec,
            self.drain_timeout_s,
            self.reclaim_grace_s,
            self.base_port,
            self.hung_after_s,
            self.drain_from_metrics,
        )

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
    #: The recent load, for the dashboard's charts (`control.load_history`).
    history: LoadHistory = field(default_factory=LoadHistory)


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
    #: Lendable GPUs a sleeping replica still holds memory on (`policy.lending.gpu_shares`).
    gpu_shares: Mapping[GpuRef, GpuShare] = field(default_factory=dict)


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
        lease: LeaseGuard | None = None,
        memory_save_every_s: float = MEMORY_SAVE_EVERY_S,
    ) -> None:
        self.store = store
        self.manager = manager
        #: With several control planes on one store: act only while holding the lease (§4.4).
        self.lease = lease
        self.sources = sources
        self.gateway = gateway
        self.services = {s.spec.name: s for s in services}
        self.lending = lending
        self.nodes = nodes
        self.rules = tuple(s.rules for s in services)
        #: What the decisions carry from one tick to the next.
        self.memory = InferenceMemory.start(self.rules)
        self.status: dict[str, ServiceStatus] = {s.spec.name: ServiceStatus() for s in services}
        self.last: InferenceTick | None = None
        self.last_plan: InferencePlan | None = None
        self.reclaimer = Reclaimer(store=store)
        self._saved_profiles_at = -math.inf
        self._saved_memory_at = -math.inf
        #: How often the memory is saved while only its windows move (a decision's change is
        #: saved at once); the simulator, which never restarts a control plane, passes infinity.
        self.memory_save_every_s = memory_save_every_s
        self._saved_memory: tuple[Any, Any] | None = None  # (decisions part, whole) last saved
        # The replica values of the last read, by the identity of the record they came from: the
        # in-memory store hands back the same record until it changes.
        self._views: dict[int, tuple[ReplicaRecord, ReplicaView]] = {}
        # The records of the last read and the views made of them (see `_read_replicas`).
        self._read: tuple[tuple[ReplicaRecord, ...], tuple[ReplicaView, ...]] | None = None
        # The views of the last `_grouped` and each service's share of them.
        self._mine: tuple[tuple[ReplicaView, ...], Mapping[str, Sequence[ReplicaView]]] | None = None
        # The replicas of the last tick, the sleeping ones and their `gpu_shares` (`_gpu_shares`).
        self._shares: tuple[tuple[ReplicaView, ...], _Asleep, Mapping[GpuRef, GpuShare]] | None = None
        #: The envelope point recorded last (None: none since this controller started).
        self._lending_recorded: LendingPoint | None = None

    @property
    def scale_states(self) -> Mapping[str, ScaleState]:
        return self.memory.scale_states

    @property
    def profiles(self) -> Mapping[str, WeeklyProfile]:
        return self.memory.profiles

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
                self._book(failure_move(_view(rec), now, "process gone after a control-plane restart"))
            elif rec.state == R.PARKING:  # the park was cut short by the restart: finish it
                self.manager.park(rec.id, setup.spec.park, now)
        killed = self.manager.reap_orphans(known)
        if killed:
            log.warning("killed replica processes nobody knows: %s", killed)
        self._load_memory(now)
        self._load_profiles()

    # -- the tick ------------------------------------------------------------------------------

    def tick(self, now: float, *, running: tuple[RunningStep, ...]) -> InferenceTick:
        # observe (the service manager's events settle into the store first: they happened)
        events = self.manager.poll(now)
        replicas = self._read_replicas()
        follow_up = False
        if events:
            replicas, follow_up = self._settle(events, replicas)
        snapshot = self._snapshot(now, running, replicas)
        # decide
        plan = decide_inference(snapshot)
        # act
        self._show(plan)
        follow_up = self._write_alerts(plan) or follow_up
        if self._act_replicas(plan.replica_plan, snapshot.replicas, now):
            follow_up = True
            plan = complete(snapshot, plan.scale, self._read_replicas())
        self.memory = plan.memory
        self.last_plan = plan
        follow_up = self._sync_gateway(plan.replicas) or follow_up
        follow_up = self.reclaimer.act(plan.reclaim, now) or follow_up
        result = InferenceTick(
            unavailable=plan.unavailable,
            envelope=plan.envelope,
            plan=plan.replica_plan,
            reclaim=plan.reclaim.plan,
            changed=plan.follow_up or follow_up,
            next_due=plan.next_due,
            gpu_shares=self._gpu_shares(plan.replicas),
        )
        self.last = result
        self._record_lending(plan.envelope, now)
        self._save_memory(now)
        self._save_profiles(now)
        return result

    def _gpu_shares(self, replicas: tuple[ReplicaView, ...]) -> Mapping[GpuRef, GpuShare]:
        """`policy.lending.gpu_shares` of the sleeping replicas: a pure function of them (the nodes
        never change), so it is rebuilt only when they do, not at every tick (read-only view).
        The replicas themselves are compared first: the views are frozen and mostly the very
        objects of the last tick (`_read_replicas`), so equal replicas cost a pass of identity
        checks and need no new list of the sleeping ones."""
        last = self._shares
        if last is not None and last[0] == replicas:
            return last[2]
        asleep = tuple(self._asleep(replicas))
        if last is None or last[1] != asleep:
            self._shares = (replicas, asleep, MappingProxyType(gpu_shares(self.nodes, asleep)))
        else:
            self._shares = (replicas, asleep, last[2])
        return self._shares[2]

    def _asleep(self, replicas: Sequence[ReplicaView]) -> list[tuple[str, tuple[int, ...], float]]:
        """Sleeping replicas as (node, GPUs, residual GiB per GPU) for `gpu_shares`."""
        return [
            (r.node, r.gpus, self.services[r.service].spec.sleep_residual_gib)
            for r in replicas
            if r.state == R.PARKED and r.parked_as == "sleep" and r.node and r.service in self.services
        ]

    # -- observe -------------------------------------------------------------------------------

    def _read_replicas(self) -> tuple[ReplicaView, ...]:
        records = tuple(self.store.replicas())
        last = self._read
        if last is not None and last[0] == records:
            # The same records as at the last read (the in-memory store hands back the very same
            # objects; the records are frozen): the same views, as the same tuple.
            return last[1]
        cache = self._views
        seen: dict[int, tuple[ReplicaRecord, ReplicaView]] = {}
        out = []
        for rec in records:
            hit = cache.get(id(rec))
            view = hit[1] if hit is not None and hit[0] is rec else _view(rec)
            seen[id(rec)] = (rec, view)
            out.append(view)
        self._views = seen
        views = tuple(out)
        self._read = (records, views)
        return views

    def _settle(
        self, events: Sequence[ReplicaEvent], replicas: tuple[ReplicaView, ...]
    ) -> tuple[tuple[ReplicaView, ...], bool]:
        """Book the moves the events make, in order. A move that fails is skipped; the events
        after it are settled again on the replicas as the store has them."""
        failed = False
        pending = events
        while True:
            outcome = settle_events(replicas, pending)
            stopped: int | None = None
            for move, source in zip(outcome.moves, outcome.sources, strict=True):
                try:
                    self._book(move)
                except StaleState as exc:
                    log.info(
                        "replica event %s for %s ignored: %s", pending[source].kind, move.replica_id, exc
                    )
                    stopped = source
                except Exception:
                    log.exception("replica event %s for %s failed", pending[source].kind, move.replica_id)
                    stopped = source
                if stopped is not None:
                    break
            if stopped is None:
                return outcome.replicas, failed
            failed = True
            replicas = self._read_replicas()
            pending = pending[stopped + 1 :]

    def _snapshot(
        self, now: float, running: tuple[RunningStep, ...], replicas: tuple[ReplicaView, ...]
    ) -> InferenceSnapshot:
        mine = self._grouped(replicas)
        signals = {name: self._collect(name, mine[name], now) for name in self.services}
        in_flight: dict[str, int] = {}
        upstream: dict[str, int] = {}
        held: dict[str, int] = {}
        if self.gateway is not None:
            by_id = {r.id: r for r in replicas}
            for name, setup in self.services.items():
                if n := self.gateway.held(name):
                    held[name] = n
                for slot in range(setup.spec.max_replicas):
                    rid = f"{name}/{slot}"
                    if rid in by_id:
                        in_flight[rid] = self.gateway.in_flight(name, rid)
                        if by_id[rid].state in _SCRAPED and (n := self.gateway.upstream_failures(name, rid)):
                            upstream[rid] = n
        return InferenceSnapshot(
            now=now,
            nodes=self.nodes,
            services=self.rules,
            lending=self.lending,
            replicas=replicas,
            signals=signals,
            running=running,
            reclaims=self.reclaimer.observe(),
            memory=self.memory,
            in_flight=in_flight,
            upstream_failures=upstream,
            held=held,
        )

    def _grouped(self, replicas: tuple[ReplicaView, ...]) -> Mapping[str, Sequence[ReplicaView]]:
        """Each service's replicas; kept for the same tuple of (frozen) views, which
        `_read_replicas` hands back while no replica moved."""
        last = self._mine
        if last is not None and last[0] is replicas:
            return last[1]
        mine: dict[str, list[ReplicaView]] = {name: [] for name in self.services}
        for r in replicas:
            if r.service in mine:
                mine[r.service].append(r)
        grouped = {name: tuple(views) for name, views in mine.items()}
        self._mine = (replicas, grouped)
        return grouped

    def _collect(self, name: str, mine: Sequence[ReplicaView], now: float) -> ServiceSignals:
        urls = {
            r.id: url for r in mine if r.state in _SCRAPED and (url := self.manager.url(r.id)) is not None
        }
        source = self.sources.get(name)
        if source is None or not urls:
            return ServiceSignals(service=name, at=now)
        return source.collect(name, urls, now)

    # -- act -----------------------------------------------------------------------------------

    def _book(self, move: ReplicaMove) -> None:
        self.store.move_replica(
            move.replica_id, move.expected, move.target, now=move.at, message=move.message, **move.columns()
        )

    def _show(self, plan: InferencePlan) -> None:
        for outcome in plan.scale.services:
            status = self.status[outcome.name]
            status.decision = outcome.decision
            status.signals = outcome.signals
            status.fresh_at = outcome.fresh_at
            status.target = outcome.target
            status.blocked = outcome.blocked
            status.alert = outcome.alert
            status.history.add(outcome.signals, outcome.decision.desired if outcome.decision else None)

    def _write_alerts(self, plan: InferencePlan) -> bool:
        failed = False
        for ev in plan.scale.alerts:
            log.warning("service %s: %s", ev.service, ev.message)
            try:
                self.store.add_service_event(
                    ev.service, ev.replica_id, at=ev.at, kind=ev.kind, message=ev.message
                )
            except Exception:
                failed = True
                log.exception("writing the %s event of %s failed", ev.kind, ev.service)
        return failed

    def _act_replicas(self, plan: ReplicaPlan, replicas: Sequence[ReplicaView], now: float) -> bool:
        """Carry out the replica plan; returns whether an action failed."""
        if not plan.actions:
            return False
        by_id = {r.id: r for r in replicas}
        failed = False
        for action in plan.actions:
            if self.lease is not None and not self.lease.may_act():
                return True  # not the leader any more: the next leader decides again
            try:
                self._act(action, by_id, now)
            except (StaleState, GpuBusy) as exc:
                failed = True
                log.info("%s %s skipped: %s", action.kind, action.replica_id, exc)
            except Exception:
                failed = True
                log.exception("%s of %s failed", action.kind, action.replica_id)
        return failed

    def _act(self, action: ReplicaAction, replicas: Mapping[str, ReplicaView], now: float) -> None:
        """Book the action in the store (fenced), then carry it out; the lease is checked before
        both, so a control plane that lost it neither books nor acts."""
        self._check_lease()
        setup = self.services[action.service]
        slot = int(action.replica_id.rsplit("/", 1)[1])
        rec = replicas.get(action.replica_id)
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
            self._check_lease()
            if action.kind == "wake":
                self.manager.unpark(action.replica_id, now)
            else:
                self.manager.start(self._launch(setup, slot, action.node, action.gpus), now)
            return
        assert rec is not None
        if action.kind == "restart":
            # Hung (policy.inference.hung_replicas): out of routing first, then the process ends.
            self._book(failure_move(rec, now, action.reason))
            log.warning("replica %s: %s; killing and restarting it", rec.id, action.reason)
            self._check_lease()
            if isinstance(self.manager, KillsReplicas):
                self.manager.kill(rec.id, now, action.reason)
            else:
                self.manager.park(rec.id, "stop", now)
        elif action.kind == "drain":
            self.store.move_replica(rec.id, R.SERVING, R.DRAINING, now=now, message=action.reason)
        elif action.kind == "undrain":
            self.store.move_replica(rec.id, R.DRAINING, R.SERVING, now=now, message=action.reason)
        elif action.kind == "park":
            self.store.move_replica(rec.id, R.DRAINING, R.PARKING, now=now, message=action.reason)
            self._check_lease()
            self.manager.park(rec.id, action.park_as or setup.spec.park, now)

    def _check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check()

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
            sleep_level=setup.spec.sleep_level,
        )

    def _sync_gateway(self, replicas: Sequence[ReplicaView]) -> bool:
        if self.gateway is None:
            return False
        failed = False
        for name in self.services:
            serving = {
                r.id: url
                for r in replicas
                if r.service == name and r.state == R.SERVING and (url := self.manager.url(r.id))
            }
            try:
                self.gateway.set_backends(name, serving)
            except Exception:
                failed = True
                log.exception("telling the gateway the replicas of %s failed", name)
        return failed

    # -- the memory across restarts (docs/architecture.md §4.4) ----------------------------------

    def _load_memory(self, now: float) -> None:
        """Start from the memory an earlier control plane saved (autoscaler windows, guards, surge
        times, alerts), so a restart neither forgets a surge nor restarts the stabilisation."""
        try:
            document = self.store.get_state(MEMORY_KEY)
        except Exception:
            log.exception("reading the saved inference memory failed; starting afresh")
            return
        if document is None:
            return
        self.memory = decode_memory(document, self.memory, tuple(self.services), now)
        restored = {n: s.desired for n, s in self.memory.scale_states.items() if s.desired is not None}
        if restored:
            log.info("restored the autoscaler's memory: desired %s", restored)

    def _save_memory(self, now: float) -> None:
        memory = self.memory
        decisions = {
            name: (
                state.desired,
                state.needed,
                state.down_from,
                state.flap_guard,
                state.panic_at,
                memory.surge_at.get(name),
                memory.alerts.get(name, ""),
            )
            for name, state in memory.scale_states.items()
        }
        last = self._saved_memory
        if (
            last is not None
            and last[0] == decisions
            and now - self._saved_memory_at < self.memory_save_every_s
        ):
            return  # the cheap test first: the simulator ticks millions of times
        document = encode_memory(memory, now)
        if last is not None and last[1] == document["services"]:
            self._saved_memory_at = now
            return
        try:
            self.store.put_state(MEMORY_KEY, document, now=now)
        except StoreUnavailable as exc:  # an outage: the loop already says so, once
            log.debug("saving the inference memory failed (%s); the next tick tries again", exc)
            return
        except Exception:
            log.exception("saving the inference memory failed; the next tick tries again")
            return
        self._saved_memory = (decisions, document["services"])
        self._saved_memory_at = now

    # -- the envelope's history (the dashboard's timeline) -------------------------------------

    def _record_lending(self, envelope: Envelope, now: float) -> None:
        """Record the envelope when it changed, and every few minutes otherwise; a failed write
        is tried again at the next tick (the last recorded point stays the one written)."""
        lendable, mode = envelope.lendable_gpus, self.lending.mode
        if not record_due(self._lending_recorded, lendable, mode, now=now):
            return
        point = LendingPoint(now, lendable, mode)
        try:
            self.store.record_lending(point)
        except StoreUnavailable as exc:  # an outage: the loop already says so, once
            log.debug("recording the lending envelope failed (%s); the next tick tries again", exc)
            return
        except Exception:
            log.exception("recording the lending envelope failed; the next tick tries again")
            return
        self._lending_recorded = point

    # -- the forecast profile ------------------------------------------------------------------

    def _load_profiles(self) -> None:
        if self.lending.mode != "forecast":
            return
        profiles = dict(self.memory.profiles)
        for name in self.services:
            raw = self.store.get_value(f"forecast:{name}")
            if raw:
                try:
                    profiles[name] = WeeklyProfile.from_dict(json.loads(raw))
                except (ValueError, KeyError, TypeError):
                    log.warning("ignoring an unreadable saved forecast profile for %s", name)
        self.memory = replace(self.memory, profiles=profiles)

    def _save_profiles(self, now: float) -> None:
        if self.lending.mode != "forecast" or now - self._saved_profiles_at < FORECAST_SAVE_EVERY_S:
            return
        try:
            for name, profile in self.memory.profiles.items():
                self.store.set_value(f"forecast:{name}", json.dumps(profile.to_dict()))
        except Exception:
            log.exception("saving the forecast profiles failed; the next tick tries again")
            return
        self._saved_profiles_at = now


def _view(rec: ReplicaRecord) -> ReplicaView:
    """A replica record as the policies see it."""
    return ReplicaView(
        rec.id,
        rec.service,
        rec.slot,
        rec.state,
        rec.node,
        rec.gpus,
        parked_as="sleep" if rec.parked_as == "sleep" else ("stop" if rec.parked_as else None),
        since=rec.since,
        retry_at=rec.retry_at,
        failures=rec.failures,
        port=rec.port,
    )
