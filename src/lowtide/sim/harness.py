"""The production control loop on a fake clock, over ports the caller gives: one harness for the
tests and the simulator.

Role: `LoopHarness` builds `control.loop.ControlLoop` and, when there is anything for it to do
(services, or lending that is not `continuous`), `control.inference.InferenceController`, the
way `wiring.build` does, with the same `LoopSettings` and policies; only what sits behind the
ports of docs/architecture.md §5 is replaced. The store defaults to `store.memory.MemoryStore`
(a test may pass an SQL `store.repo.Store`: it has the same methods); the executor, artifact
port, service manager and metrics sources default to the scripted ports of `sim.scripted`.
It then drives the loop as a control plane would: `tick` moves the clock and runs one tick,
`recover` runs start-up recovery, `restart` is a new control-plane process on the same store
and ports, and `submit` stores a job the way the API does (`build_job_spec` with the largest
node as the GPU limit, `render_step`, `create_job`).
Neighbours: `sim.world` builds its loop here over the modelled ports of `sim.ports`; the
integration tests build theirs over `sim.scripted`. Must not: decide anything (the production
loop and policies do), read the wall clock, or import real adapters, `wiring` or `api` (the
import contract of §3.2; `wiring` is the production twin of `_build`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from lowtide.control.clock import FakeClock
from lowtide.control.executor_port import Executor
from lowtide.control.inference import MEMORY_SAVE_EVERY_S, InferenceController, InferenceStore, ServiceSetup
from lowtide.control.inference_ports import Gateway, MetricsSource, ServiceManager
from lowtide.control.loop import ControlLoop, LoopSettings, RecoveryReport, TickReport
from lowtide.control.ports import ArtifactPort, StorePort
from lowtide.control.records import AttemptRecord, JobDetail, JobRecord, NewJob, StepRecord
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.services import LendingPolicy
from lowtide.domain.spec_parse import build_job_spec
from lowtide.domain.spec_render import render_step
from lowtide.policy.outcomes import RetryPolicy
from lowtide.policy.scheduler import SchedulerPolicy
from lowtide.sim.scripted import FakeExecutor, FakeMetrics, FakeServiceManager, MemoryArtifacts
from lowtide.store.memory import MemoryStore


class HarnessStore(StorePort, InferenceStore, Protocol):
    """What the harness needs of a store: the loop's and the inference side's ports, plus the
    API's `create_job` and the reads its accessors use (`store.repo.Store` and
    `store.memory.MemoryStore` both have them)."""

    def create_job(self, new: NewJob) -> JobRecord: ...

    def job_detail(self, job_id: str) -> JobDetail: ...

    def close(self) -> None: ...


class TickFailed(AssertionError):
    """A tick reported errors (a failed item is logged and skipped by the loop; a harness that
    checks treats it as a failed expectation)."""

    def __init__(self, report: TickReport) -> None:
        super().__init__(f"tick at {report.at} reported {report.errors} error(s): {report}")
        self.report = report


class LoopHarness:
    """The production loop over the given ports on a `FakeClock` (see the module docstring).

    The ports are kept as given (`store`, `executor`, `artifacts`, `manager`, `sources`,
    `gateway`), so the caller scripts them through its own references; `loop` and `inference`
    are replaced by `restart`."""

    def __init__(
        self,
        *,
        nodes: tuple[Node, ...],
        layout: ArtifactLayout,
        clock: FakeClock,
        store: HarnessStore | None = None,
        executor: Executor | None = None,
        artifacts: ArtifactPort | None = None,
        scheduler: SchedulerPolicy | None = None,
        retry: RetryPolicy | None = None,
        checkpoint_poll_s: float | None = None,
        services: tuple[ServiceSetup, ...] = (),
        lending: LendingPolicy | None = None,
        manager: ServiceManager | None = None,
        sources: Mapping[str, MetricsSource] | None = None,
        gateway: Gateway | None = None,
        with_inference: bool | None = None,
        tick_s: float = 1.0,
        memory_save_every_s: float = MEMORY_SAVE_EVERY_S,
    ) -> None:
        """`with_inference`: None builds the inference side exactly when `wiring` would (services
        or non-continuous lending); True or False force it. `tick_s`: how far `tick` moves the
        clock unless told otherwise."""
        self.nodes = nodes
        self.layout = layout
        self.clock = clock
        self.store: HarnessStore = store if store is not None else MemoryStore()
        self.executor: Executor = executor if executor is not None else FakeExecutor()
        self.artifacts: ArtifactPort = artifacts if artifacts is not None else MemoryArtifacts()
        poll: dict[str, Any] = {} if checkpoint_poll_s is None else {"checkpoint_poll_s": checkpoint_poll_s}
        self.settings = LoopSettings(
            nodes=nodes,
            layout=layout,
            scheduler=scheduler if scheduler is not None else SchedulerPolicy(),
            retry=retry if retry is not None else RetryPolicy(),
            **poll,
        )
        self.services = services
        self.lending = lending if lending is not None else LendingPolicy()
        if with_inference is None:
            with_inference = bool(services) or self.lending.mode != "continuous"
        self.with_inference = with_inference
        self.manager: ServiceManager = manager if manager is not None else FakeServiceManager()
        self.sources: Mapping[str, MetricsSource] = (
            sources if sources is not None else {s.spec.name: FakeMetrics() for s in services}
        )
        self.gateway = gateway
        self.tick_s = tick_s
        #: The inference side's memory save cadence (`InferenceController`); production's by default.
        self.memory_save_every_s = memory_save_every_s
        #: Ids of the jobs `submit` stored, in order.
        self.jobs: list[str] = []
        self.loop, self._inference = self._build()

    def _build(self) -> tuple[ControlLoop, InferenceController | None]:
        """The loop (and its inference side) as `wiring.build` and `wiring.build_inference` make them."""
        inference = None
        if self.with_inference:
            inference = InferenceController(
                store=self.store,
                manager=self.manager,
                sources=self.sources,
                gateway=self.gateway,
                services=self.services,
                lending=self.lending,
                nodes=self.nodes,
                memory_save_every_s=self.memory_save_every_s,
            )
        loop = ControlLoop(
            store=self.store,
            executor=self.executor,
            artifacts=self.artifacts,
            clock=self.clock,
            inference=inference,
            settings=self.settings,
        )
        return loop, inference

    @property
    def inference(self) -> InferenceController:
        """The loop's inference side; raises LookupError when the harness runs without one."""
        if self._inference is None:
            raise LookupError("this harness runs no inference side (no services, continuous lending)")
        return self._inference

    # -- driving -------------------------------------------------------------------------------

    def recover(self) -> RecoveryReport:
        """Start-up recovery, as `wiring.serve` runs it before the first tick."""
        return self.loop.recover()

    def restart(self) -> RecoveryReport:
        """A new control-plane process on the same store and ports: a fresh loop (and inference
        side, with none of the old one's memory), then recovery."""
        self.loop, self._inference = self._build()
        return self.loop.recover()

    def tick(self, n: int = 1, dt: float | None = None, *, check: bool = True) -> TickReport:
        """`n` times: move the clock by `dt` (default `tick_s`), then tick. With `check`, a tick
        that reports errors raises `TickFailed`. Returns the last tick's report."""
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        step = self.tick_s if dt is None else dt
        report = None
        for _ in range(n):
            self.clock.advance(step)
            report = self.loop.tick()
            if check and report.errors:
                raise TickFailed(report)
        assert report is not None
        return report

    def submit(self, doc: Mapping[str, Any], *, owner: str = "u", at: float | None = None) -> str:
        """Store a job from its document as the API would (no source text), submitted `at` (default
        now); ids are ``job-<n as 12 hex digits>``, counting from 0. Returns the job id."""
        job_id = f"job-{len(self.jobs):012x}"
        spec = build_job_spec(doc, max_gpus_per_node=max((n.gpu_count for n in self.nodes), default=0))
        resolved = tuple(render_step(spec, s, job_id=job_id, layout=self.layout) for s in spec.steps)
        submitted_at = self.clock.now() if at is None else at
        self.store.create_job(NewJob(job_id, spec, resolved, "", owner, submitted_at))
        self.jobs.append(job_id)
        return job_id

    def close(self) -> None:
        """Close the ports (the scripted ones hold nothing) and the store."""
        self.manager.close()
        self.executor.close()
        self.store.close()

    # -- reading -------------------------------------------------------------------------------

    def step(self, job_id: str, name: str | None = None) -> StepRecord:
        """A job's step `name` (default: its first step), as stored now."""
        steps = self.store.job_detail(job_id).steps
        for step in steps:
            if name is None or step.name == name:
                return step
        raise KeyError(f"job {job_id} has no step {name!r}")

    def last_attempt(self, job_id: str) -> AttemptRecord:
        """The job's latest attempt, as stored now."""
        return self.store.job_detail(job_id).attempts[-1]
