"""The simulator's world: the production control loop on a virtual clock, jumping between events.

`SimWorld` builds `control.loop.ControlLoop` and `control.inference.InferenceController` exactly
as production does, over the in-memory store and the fake ports of `sim.ports`, then runs them
on a `FakeClock`. Time is event-driven (docs/architecture.md §9): after each tick the world moves
the clock to the earliest of
- the next tick the loop asks for (`TickReport.active`: something moved, look again after the
  production `tick_s`; `TickReport.next_due`: a waiting scale-down, a backoff, a window edge),
- the fake ports' next event (a step exits, a replica becomes healthy or parks),
- the next job submission and the next change of any service's load curve,
- `max_gap_s` (the loop still observes regularly, as production does);
so a quiet night costs a few ticks instead of thousands. Between two ticks nothing the loop sees
changes, which is what makes the jump exact; the SLO and the timeline are integrated over each
jump. Checkpoints are reported at the exact time a step wrote them (the way a step calls the
API), before the tick that follows.
Neighbours: `sim.scenario` (what to run), `sim.summary` (figures from the store and the trace
this produces). Must not: decide anything itself or import real adapters.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from lowtide.control.clock import FakeClock
from lowtide.control.records import NewJob, ReplicaRecord
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.spec import JobSpec
from lowtide.domain.spec_issues import is_valid_name
from lowtide.domain.spec_parse import build_job_spec
from lowtide.domain.spec_render import render_step
from lowtide.domain.states import ReplicaState
from lowtide.policy.evolve import evolve
from lowtide.policy.outcomes import RetryPolicy
from lowtide.sim.capacity import advance, slo_violation_s
from lowtide.sim.harness import LoopHarness
from lowtide.sim.jobs import ResearchJob
from lowtide.sim.ports import NoArtifacts, SimExecutor, SimMetrics, SimServiceManager, StepBehaviour
from lowtide.sim.scenario import Scenario
from lowtide.store.memory import MemoryStore

log = logging.getLogger("lowtide.sim")
LAYOUT = ArtifactLayout("sim://artifacts", "sim://work")
R = ReplicaState


@dataclass(frozen=True, slots=True)
class Sample:
    """The world between two ticks: [at, until) with everything constant."""

    at: float
    until: float
    replica_gpus: int  # held by replicas (serving, starting, waking, draining, parking)
    serving_gpus: int
    research_gpus: int  # held by research step attempts
    lendable_gpus: int  # the envelope
    queued_steps: int
    rate_rps: float  # total load over all services
    capacity_rps: float  # what the serving replicas can take (at full batch)
    slo_violated: bool


@dataclass
class RunTrace:
    samples: list[Sample] = field(default_factory=list)
    slo_violation_s: dict[str, float] = field(default_factory=dict)
    ticks: int = 0
    tick_errors: int = 0
    submitted: dict[str, ResearchJob] = field(default_factory=dict)  # job id → trace job


class SimWorld:
    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.clock = FakeClock(scenario.start)
        self.store = MemoryStore()
        self.executor = SimExecutor()
        self.manager = SimServiceManager({s.name: s.times for s in scenario.services})
        self.metrics = {s.name: SimMetrics(s.curve, s.capacity, scenario.start) for s in scenario.services}
        self.harness = LoopHarness(
            nodes=scenario.nodes,
            layout=LAYOUT,
            clock=self.clock,
            store=self.store,
            executor=self.executor,
            artifacts=NoArtifacts(),
            scheduler=scenario.scheduler,
            retry=RetryPolicy(),
            checkpoint_poll_s=float("inf"),  # steps report checkpoints through the store
            services=tuple(s.setup for s in scenario.services),
            lending=scenario.lending,
            manager=self.manager,
            sources=dict(self.metrics),
            with_inference=True,  # every policy runs the inference side, even with no service
            # No control plane restarts here, so the memory kept for one is saved only when a
            # decision changes, not also every few seconds while the windows move (~5 % of a run).
            memory_save_every_s=math.inf,
        )
        self.inference = self.harness.inference
        self.loop = self.harness.loop
        self.trace = RunTrace(slo_violation_s={s.name: 0.0 for s in scenario.services})
        submit = scenario.policy != "none"  # nothing is lent under `none`: research never runs
        self._jobs = sorted(scenario.jobs, key=lambda j: (j.submit_s, j.name)) if submit else []
        self._next_job = 0
        self._pool_gpus = scenario.pool_gpus
        self._shapes: dict[tuple[str, str, int], JobSpec] = {}  # `_job_spec`, by (team, priority, GPUs)
        self._counted: tuple[tuple[ReplicaRecord, ...], dict[str, int], int] | None = None

    # -- running -------------------------------------------------------------------------------

    def run(self) -> RunTrace:
        with cyclic_gc_paused():
            return self._run()

    def _run(self) -> RunTrace:
        s = self.scenario
        self.loop.recover()
        now = self.clock.now()
        while now < s.end:
            self._submit_due(now)
            self._report_checkpoints(now)
            report = self.loop.tick()
            self.trace.ticks += 1
            self.trace.tick_errors += report.errors
            # The replicas stay as the tick left them until the next one: counted once for both.
            serving, replica_gpus = self._replica_counts()
            candidates = [s.end, now + s.max_gap_s]
            if report.active or self._overloaded(serving):
                # An overload's backlog grows between ticks and the autoscaler reads it: look as
                # often as production does while it lasts.
                candidates.append(now + s.tick_s)
            if report.next_due is not None:
                candidates.append(report.next_due)
            for port_next in (self.executor.next_event(), self.manager.next_event()):
                if port_next is not None:
                    candidates.append(port_next)
            if self._next_job < len(self._jobs) and self._free_for_research() > 0:
                # With no GPU research may take, an arrival can change no decision (the next exit
                # or envelope change ticks anyway, and sees it queued since its submit time).
                candidates.append(s.start + self._jobs[self._next_job].submit_s)
            for svc in s.services:
                candidates.append(s.start + svc.curve.next_change_after(now - s.start))
            nxt = max(min(candidates), now + 1e-3)
            self._integrate(now, min(nxt, s.end), serving, replica_gpus)
            self.clock.set(nxt)
            now = nxt
        return self.trace

    def _replica_counts(self) -> tuple[dict[str, int], int]:
        """Serving replicas per service, and the GPUs replicas hold (`_HOLDING`); counted again
        only when the store's (frozen) replica records are not those of the last count."""
        records = self.store.replica_records()
        last = self._counted
        if last is not None and last[0] is records:
            return last[1], last[2]
        serving: dict[str, int] = {svc.name: 0 for svc in self.scenario.services}
        gpus = 0
        for r in records:
            if r.state in _HOLDING:
                gpus += len(r.gpus)
                if r.state == R.SERVING and r.service in serving:
                    serving[r.service] += 1
        self._counted = (records, serving, gpus)
        return serving, gpus

    def _overloaded(self, serving: dict[str, int]) -> bool:
        """Some service gets more than its serving replicas can take, or still has a backlog."""
        s = self.scenario
        t = self.clock.now() - s.start
        for svc in s.services:
            if self.metrics[svc.name].state.backlog > 0:
                return True
            if svc.curve.rate_at(t) > serving[svc.name] * svc.capacity.throughput_rps:
                return True
        return False

    def _free_for_research(self) -> int:
        """GPUs the last tick offered research that no step holds."""
        last = self.inference.last
        unavailable = len(last.unavailable) if last is not None else 0
        return self._pool_gpus - unavailable - self.executor.held_gpus

    # -- inputs --------------------------------------------------------------------------------

    def _submit_due(self, now: float) -> None:
        s = self.scenario
        while self._next_job < len(self._jobs) and s.start + self._jobs[self._next_job].submit_s <= now:
            job = self._jobs[self._next_job]
            self._next_job += 1
            job_id = f"job-{self._next_job:012x}"
            spec = self._job_spec(job)
            resolved = tuple(render_step(spec, st, job_id=job_id, layout=LAYOUT) for st in spec.steps)
            submitted_at = s.start + job.submit_s
            self.store.create_job(NewJob(job_id, spec, resolved, "", "sim", submitted_at))
            self.executor.behaviours[job_id] = StepBehaviour(
                work_s=job.work_s,
                restart_s=s.steps.restart_s,
                checkpoint_every_s=s.steps.checkpoint_every_s,
                checkpoint_write_s=s.steps.checkpoint_write_s,
            )
            self.trace.submitted[job_id] = job

    def _job_spec(self, job: ResearchJob) -> JobSpec:
        """The validated spec of a trace job (`build_job_spec`). Jobs of the same team, priority
        and size have the same spec but for the name, so it is built once per such shape and
        given each job's (valid) name; a name `build_job_spec` would refuse goes through it."""
        shape = (job.team, job.priority, job.gpus)
        known = self._shapes.get(shape)
        if known is not None and is_valid_name(job.name):
            return evolve(known, name=job.name)
        s = self.scenario
        spec = build_job_spec(
            {
                "name": job.name,
                "team": job.team,
                "priority": job.priority,
                "grace_seconds": s.steps.grace_s,
                "steps": [
                    {
                        "name": "train",
                        "command": ["simulated"],
                        "gpus": job.gpus,
                        "checkpoint": True,
                        "restart_seconds": s.steps.restart_s,
                    }
                ],
            }
        )
        self._shapes.setdefault(shape, spec)
        return spec

    def _report_checkpoints(self, now: float) -> None:
        for attempt_id, label, at in self.executor.checkpoints_due(now):
            self.store.record_checkpoint(attempt_id, label=label, progress=None, source="api", now=at)

    # -- what happened between ticks -----------------------------------------------------------

    def _integrate(self, start: float, end: float, serving_of: dict[str, int], replica_gpus: int) -> None:
        if end <= start:
            return
        s = self.scenario
        t = start - s.start
        serving_gpus = 0
        rate = capacity = 0.0
        violated = False
        for svc in s.services:
            serving = serving_of[svc.name]
            serving_gpus += serving * svc.setup.spec.gpus_per_replica
            svc_rate = svc.curve.rate_at(t)
            rate += svc_rate
            capacity += serving * svc.capacity.throughput_rps
            metrics = self.metrics[svc.name]
            bad = slo_violation_s(
                metrics.state, svc.capacity, svc_rate, serving, end - start, svc.slo_ttft_p90_s
            )
            metrics.state = advance(metrics.state, svc.capacity, svc_rate, serving, end - start)
            if bad > 0:
                self.trace.slo_violation_s[svc.name] += bad
                violated = True
        last = self.inference.last
        self.trace.samples.append(
            Sample(
                at=start,
                until=end,
                replica_gpus=replica_gpus,
                serving_gpus=serving_gpus,
                research_gpus=self.executor.held_gpus,
                lendable_gpus=last.envelope.lendable_gpus if last is not None else 0,
                queued_steps=len(self.loop.last_plan.waiting),
                rate_rps=rate,
                capacity_rps=capacity,
                slo_violated=violated,
            )
        )


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (put back as it was after, and then run as usual).

    A tick allocates thousands of short-lived objects while the store keeps a large heap of
    long-lived ones; CPython's collector would now and then walk that whole heap (~6 % of a run,
    even with rarer collections). The loop and the store make almost no reference cycles (a few
    hundred objects over a 14-day run), and reference counting frees everything else as before,
    so a run keeps at most those until the collector's next full collection after it. Nothing a decision
    reads changes: the identity memos of `policy.memo` keep what they compare against alive."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            # Everything allocated meanwhile goes to the oldest generation (freeze, then unfreeze):
            # re-enabled as it was, the collector would otherwise first walk the whole young
            # heap the run left (~2 % of a 14-day run); the next full collection sees it all.
            gc.freeze()
            gc.unfreeze()
            gc.enable()


_HOLDING = frozenset({R.STARTING, R.SERVING, R.DRAINING, R.PARKING, R.WAKING})


def run_scenario(scenario: Scenario) -> tuple[SimWorld, RunTrace]:
    world = SimWorld(scenario)
    return world, world.run()
