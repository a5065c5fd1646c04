"""The control loop: observe → snapshot → decide → act, once per tick (docs/architecture.md §4).

observe: exits reported by the executor, notices owed to cancelled steps, new checkpoints.
walltime: notice (reason "timeout: ...") to running attempts past their step's `timeout`, which
`policy.walltime` decides from stored start times and specs only (the same after a restart);
the next deadline joins `TickReport.next_due`.
snapshot: the store builds an immutable `Snapshot` with `now` from the injected clock.
decide: `policy.scheduler.decide` (placement, fair share, backfill) and `policy.dag.advance`.
act: book each start in the store first (so the next tick cannot double-book), then launch; a
failed launch is classified and rolled forward as an attempt that ended.
end: `Executor.end_job` for every job that will start nothing more: a cancelled job when its
steps get notice, and each finished job the store lists as not yet ended (`jobs_to_end`, marked
once the executor took it), so a restart, a new leader or a cancel of a job holding no GPUs
still ends it (docs/cluster.md "When a job will start nothing more").
With inference services, `control.inference` runs inside the tick before the step decision and
says which GPUs research may use (the lending envelope); everything else is unavailable to steps.

Every item is handled on its own: one failing exit, notice or start is logged and costs that
item only, never the tick. Store outages (docs/architecture.md §4.4): an exit is acknowledged to
the executor only once the store has it (the executor re-reports it every tick until then), a
failed launch or lost attempt the store could not record is retried every tick, and a tick that
met `StoreUnavailable` is reported (`TickReport.store_unavailable`) so that `run` ticks again
soon (0.5 s, doubling to 5 s) instead of logging every failure. A launch that failed because of
the infrastructure (`ExecutorError.infrastructure`) uses no retry of the step, backs off
(growing), and raises an alert (`infrastructure_alerts`) until a launch succeeds.
`recover()` runs once at start-up and re-adopts what an earlier control-plane process left
running. With a `lease` (several control planes on one store) nothing acts unless this one holds
it: a tick does nothing, and each launch and notice checks it just before the effect
(`control.lease`; the store refuses a stale leader's writes by its fencing token).
Must not: read the wall clock (use `clock`), sleep inside a
tick, or touch SQL, processes or files except through its ports.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lowtide.control.checkpoint_check import choose_for_launch, resume_crash_decision
from lowtide.control.clock import Clock
from lowtide.control.contract import parse_checkpoint_label, step_environment
from lowtide.control.executor_port import (
    NOTICE_CANCELLED,
    NOTICE_PREEMPTED,
    NOTICE_WALLTIME,
    AdoptOutcome,
    AdoptRequest,
    AttemptExit,
    AttemptHandle,
    Executor,
    ExecutorError,
    ExitReason,
    JobUsers,
    LaunchRequest,
    PollReport,
    RunAs,
)
from lowtide.control.inference import InferenceController, InferenceTick
from lowtide.control.lease import LeaseGuard
from lowtide.control.ports import ArtifactPort, StorePort
from lowtide.control.records import (
    AttemptLaunch,
    AttemptRecord,
    ExitContext,
    FencedOut,
    GpuBusy,
    NotFound,
    NoticeDue,
    StaleState,
    StoreUnavailable,
)
from lowtide.control.secrets_port import SecretResolver
from lowtide.domain.gpus import GpuRef, Node
from lowtide.domain.layout import ArtifactLayout, is_remote, join_uri
from lowtide.domain.states import AttemptState, StepState
from lowtide.policy import walltime
from lowtide.policy.checkpoints import RESUME_CRASH_WINDOW_S
from lowtide.policy.dag import JobView, advance
from lowtide.policy.evolve import evolve
from lowtide.policy.lending import GpuShare, step_gpu_share
from lowtide.policy.outcomes import (
    ExitDecision,
    RetryPolicy,
    classify_exit,
    classify_launch_failure,
    classify_lost,
)
from lowtide.policy.plan import SchedulePlan, StartStep
from lowtide.policy.scheduler import SchedulerPolicy, decide

log = logging.getLogger("lowtide.loop")
_NOTHING_POLLED = PollReport()  # what a failed poll saw (frozen: one for every tick)
_T = TypeVar("_T")

#: Re-examine every active job's DAG this often (seconds), besides those touched by events.
FULL_DAG_SWEEP_S = 60.0
#: The shortest time between the end of a tick and a tick that `wake()` brought forward.
MIN_WAKE_GAP_S = 0.05
LATEST_MAX_BYTES = 4096
#: At most this many finished jobs are ended in the executor per tick (`jobs_to_end`).
END_JOBS_BATCH = 50
#: While the store is unavailable the next tick comes after this, doubling per tick, up to the max.
STORE_RETRY_S = 0.5
STORE_RETRY_MAX_S = 5.0


@dataclass(frozen=True)
class LoopSettings:
    nodes: tuple[Node, ...]
    layout: ArtifactLayout
    scheduler: SchedulerPolicy
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    checkpoint_poll_s: float = 10.0
    api_url: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    #: Walltime of steps whose spec sets no `timeout` (config `scheduler.default_step_timeout`).
    default_step_timeout_s: float | None = None
    #: A resumed attempt failing on its own this soon, before a new checkpoint, crashed on its
    #: checkpoint: the next resumes from the one before (`policy.checkpoints`; 0: never).
    resume_crash_window_s: float = RESUME_CRASH_WINDOW_S
    #: `executor.run_as` resolved by wiring: each job's steps run as their own uid (§6.4).
    job_users: JobUsers | None = None


@dataclass
class TickReport:
    at: float
    exits: int = 0
    notices: int = 0
    started: int = 0
    waiting: int = 0
    errors: int = 0
    duration_s: float = 0.0
    #: Something this tick did settles only at the next one (a drain, a failed item): tick soon.
    active: bool = False
    #: The earliest time a decision changes with nothing new observed: a retry backoff ending,
    #: a waiting scale-down, a window edge (None: nothing pending). Observation (metrics, exits)
    #: is paced by the caller; see docs/architecture.md §4.
    next_due: float | None = None
    #: The store was unavailable for part of this tick: what it could not record is retried.
    store_unavailable: bool = False

    def store_failed(self) -> None:
        """An item met `StoreUnavailable`: count it, and leave the other writes to the next tick."""
        self.errors += 1
        self.store_unavailable = True


@dataclass(frozen=True, slots=True)
class InfrastructureAlert:
    """Launches fail because of the machinery, not the steps (an operator must look)."""

    kind: str  # "storage", "permissions", "disk full", "runtime", "secrets", "store"
    message: str  # the last failure
    since: float  # control time of the first failure since the last successful launch
    failures: int


@dataclass(frozen=True, slots=True)
class _LaunchFailure:
    """A failed launch the store has not recorded yet (retried every tick)."""

    launch: AttemptLaunch
    message: str
    temporary: bool
    infrastructure: str | None
    at: float


@dataclass(frozen=True)
class RecoveryReport:
    adopted: tuple[int, ...]
    exited: tuple[int, ...]
    lost: tuple[int, ...]
    orphans_killed: tuple[int, ...]


class ControlLoop:
    def __init__(
        self,
        *,
        store: StorePort,
        executor: Executor,
        artifacts: ArtifactPort,
        clock: Clock,
        settings: LoopSettings,
        inference: InferenceController | None = None,
        secrets: SecretResolver | None = None,
        lease: LeaseGuard | None = None,
    ) -> None:
        self.store = store
        #: With several control planes on one store: act only while holding the lease (§4.4).
        self.lease = lease
        #: Reads the values of an attempt's secrets at launch (docs/architecture.md §11).
        self.secrets = secrets
        self.executor = executor
        self.artifacts = artifacts
        self.clock = clock
        self.settings = settings
        self.inference = inference
        self._reasons: dict[tuple[str, str], str] = {}
        # Jobs whose steps changed since their DAG was last advanced (exits, failed launches).
        self._dirty_jobs: set[str] = set()
        self._checkpoint_polled: dict[int, float] = {}
        self._bad_latest: dict[int, str] = {}
        self._swept_at = -math.inf
        self._settled_views: dict[str, JobView] = {}  # see `_advance`
        # Walltime budgets of running attempts and the timeouts of their jobs' specs: caches of
        # what the store keeps (rebuilt from it after a restart), pruned to the active attempts.
        self._budgets: dict[int, walltime.WalltimeBudget] = {}
        # The active attempts of the last clean walltime scan and its budgets (`_enforce_walltime`).
        self._walltime_scan: (
            tuple[tuple[AttemptRecord, ...], tuple[int, ...], list[walltime.WalltimeBudget]] | None
        ) = None
        self._job_timeouts: dict[tuple[str, str], walltime.JobTimeouts] = {}
        self._start_deadlines: list[float] = []  # deadlines of the attempts this tick started
        # Lendable GPUs a sleeping replica still holds memory on, from this tick's inference side.
        self._gpu_shares: Mapping[GpuRef, GpuShare] = {}
        self._ticks = 0
        self.errors_total = 0
        # Durable against store outages (§4.4): what could not be recorded yet, retried each tick.
        self._unrecorded_launches: dict[int, _LaunchFailure] = {}
        self._unrecorded_lost: dict[int, float] = {}
        #: Pending attempts the executor saw begin to run, not yet recorded (a store outage).
        self._unrecorded_started: dict[int, float] = {}
        #: Of those, handles the executor learnt after launch (a pod claimed later): kept with the start.
        self._started_handles: dict[int, AttemptHandle] = {}
        #: Cancelled jobs whose steps got notice, to end in the executor now (`_end_jobs`); memory
        #: only: once CANCELLED the store lists them anyway (`jobs_to_end`).
        self._cancelling_to_end: set[str] = set()
        #: Of those, the ones the executor took: once finished they are only marked, not ended twice.
        self._ended_early: set[str] = set()
        self._end_cursor: str | None = None  # where the next `jobs_to_end` batch starts
        self._end_failing: set[str] = set()  # jobs whose `end_job` fails (logged once each)
        self._exit_failing: set[int] = set()  # exits whose recording failed (logged once)
        self._store_down_ticks = 0
        # Infrastructure launch failures: per step in a row (backoff), alerts and totals by kind.
        self._infra_streak: dict[tuple[str, str], int] = {}
        self.infrastructure_alerts: dict[str, InfrastructureAlert] = {}
        self.infrastructure_failures_total: dict[str, int] = {}
        self._wake = threading.Event()
        self.last_tick: TickReport | None = None
        self.last_plan: SchedulePlan = SchedulePlan()

    # -- start-up ------------------------------------------------------------------------------

    def recover(self) -> RecoveryReport:
        """Re-attach to attempts an earlier control plane started; requeue the lost ones."""
        now = self.clock.now()
        self.store.ensure_gpus(self.settings.nodes, now)
        adopted: list[int] = []
        exited: list[int] = []
        lost: list[int] = []
        for att in self.store.active_attempts():
            try:
                handle = (
                    AttemptHandle(att.handle, att.handle_started_at, att.running_at)
                    if att.handle is not None and att.handle_started_at is not None
                    else None
                )
                result = self.executor.adopt(
                    AdoptRequest(
                        attempt_id=att.id,
                        work_dir=att.work_dir,
                        notice_path=self._notice_path(att.job_id, att.step_name, att.number),
                        handle=handle,
                        stop_deadline=att.stop_deadline,
                    ),
                    now,
                )
                if result.outcome == AdoptOutcome.ADOPTED:
                    adopted.append(att.id)
                    if result.handle is not None and result.handle != handle:
                        self.store.record_launch(att.id, result.handle)
                elif result.outcome == AdoptOutcome.EXITED and result.exit is not None:
                    exited.append(att.id)
                    # Unrecorded (a store outage): the executor re-reports it at every poll.
                    self._record_exit(result.exit, now, TickReport(at=now))
                else:
                    lost.append(att.id)
                    self._unrecorded_lost[att.id] = now
                    self._record_lost(att.id, now, TickReport(at=now))
            except Exception:
                log.exception("recovery of attempt %s failed; will retry at next start", att.id)
        if self.inference is not None:
            try:
                self.inference.recover(now)
            except Exception:
                log.exception("recovery of inference replicas failed; they restart as needed")
        killed = self.executor.reap_orphans(set(adopted))
        if killed:
            log.warning("killed orphaned step processes of unknown attempts: %s", killed)
        self._advance(None, now)
        return RecoveryReport(tuple(adopted), tuple(exited), tuple(lost), tuple(killed))

    # -- the tick ------------------------------------------------------------------------------

    def tick(self) -> TickReport:
        now = self.clock.now()
        report = TickReport(at=now)
        if not self._acting():  # a standby, or a leader past its deadline: nothing may act
            return report

        # What an earlier tick could not record (the store was unavailable) goes first.
        # Once the store has failed this tick, later writes are left to the next tick: each
        # could wait out a lock (SQLite's busy timeout) and stall the tick.
        for failure in list(self._unrecorded_launches.values()):
            if not report.store_unavailable:
                self._record_launch_failure(failure, report)
        for attempt_id, lost_at in list(self._unrecorded_lost.items()):
            if not report.store_unavailable:
                self._record_lost(attempt_id, lost_at, report)
        polled: PollReport = self._guard(
            report, "executor poll", lambda: self.executor.poll(now), _NOTHING_POLLED
        )
        for started in polled.started:  # kept until recorded: the executor reports a start once
            self._unrecorded_started[started.attempt_id] = started.at
            if started.handle is not None:
                self._started_handles[started.attempt_id] = started.handle
        for attempt_id, running_at in list(self._unrecorded_started.items()):
            if not report.store_unavailable:
                self._record_running(attempt_id, running_at, report)
        for ex in polled.exits:  # an exit not recorded now is reported again by the next poll
            if not report.store_unavailable and self._record_exit(ex, now, report):
                report.exits += 1

        active: list[AttemptRecord] = self._guard(report, "active attempts", self.store.active_attempts, [])
        self._guard(report, "checkpoint poll", lambda: self._poll_checkpoints(now, active), None)
        self._guard(report, "DAG advance", lambda: self._advance_dirty(now), None)

        try:
            snapshot = self.store.snapshot(
                now=now, nodes=self.settings.nodes, half_life_s=self.settings.scheduler.fair_share.half_life_s
            )
        except StoreUnavailable:  # nothing to decide on: the next tick (soon) tries again
            report.store_failed()
            return self._end_tick(report, now)
        due_times = [q.eligible_at for q in snapshot.queued if q.eligible_at > now]
        inference: InferenceTick | None = None
        if self.inference is not None:
            running = snapshot.running
            inference = self._guard(
                report,
                "inference",
                lambda: self.inference.tick(now, running=running) if self.inference else None,
                None,
            )
            # Without a fresh inference answer, lend nothing new this tick (fail safe).
            unavailable = (
                inference.unavailable
                if inference is not None
                else frozenset(g for n in self.settings.nodes for g in n.refs())
            )
            self._gpu_shares = inference.gpu_shares if inference is not None else {}
            # Placement reads the memory left on GPUs under sleeping replicas (policy.placement).
            snapshot = snapshot.with_inference(unavailable, self._gpu_shares)
            if inference is not None:
                report.active = inference.changed
                if inference.next_due is not None:
                    due_times.append(inference.next_due)

        # Notice to steps being cancelled or preempted (the inference side may just have asked).
        dues: list[NoticeDue] = self._guard(report, "notices", self.store.notices_due, [])
        for due in dues:
            if report.store_unavailable or not self._acting():
                break  # still due next tick
            try:
                self._give_notice(due.attempt_id, due.grace_seconds, due.step_state, now)
                report.notices += 1
                if due.step_state == StepState.CANCELLING:
                    self._cancelling_to_end.add(due.job_id)
            except StoreUnavailable:  # notice was sent; the record is retried next tick
                report.store_failed()
            except Exception:
                report.errors += 1
                log.exception("giving notice to attempt %s failed", due.attempt_id)
        self._end_jobs(report, now)  # cancelled (noticed just now) or finished jobs
        # Notice to attempts past their walltime (not to those just given notice above).
        noticed = {due.attempt_id for due in dues}
        timeout_due = self._guard(
            report, "walltime", lambda: self._enforce_walltime(active, noticed, now, report), None
        )
        if timeout_due is not None:
            due_times.append(timeout_due)

        plan = decide(snapshot, self.settings.scheduler)
        self.last_plan = plan
        self._start_deadlines = []
        for start in plan.starts:
            if report.store_unavailable or not self._acting():
                break  # nothing can be booked now; the next tick decides again
            try:
                if self._start(start, now):
                    report.started += 1
            except StoreUnavailable:
                report.store_failed()
            except Exception:
                report.errors += 1
                log.exception("starting %s/%s failed", start.job_id, start.step)
        due_times.extend(self._start_deadlines)
        report.waiting = len(plan.waiting)
        self._guard(report, "waiting reasons", lambda: self._write_reasons(plan), None)
        # Exits, notices and starts are settled within this tick; what is not (a failed item, a
        # launch failure whose job is advanced next tick, a drain) asks for another tick soon.
        report.active = report.active or bool(report.errors or self._dirty_jobs)
        report.next_due = min(due_times, default=None)
        return self._end_tick(report, now)

    def _end_tick(self, report: TickReport, now: float) -> TickReport:
        if report.store_unavailable:
            report.active = True
            self._store_down_ticks += 1
        else:
            self._store_down_ticks = 0
        self._ticks += 1
        self.errors_total += report.errors
        report.duration_s = max(0.0, self.clock.now() - now)
        self.last_tick = report
        return report

    def store_retry_s(self) -> float | None:
        """How soon to tick again while the store is unavailable (None: it is not)."""
        if self._store_down_ticks == 0:
            return None
        return min(STORE_RETRY_MAX_S, STORE_RETRY_S * 2.0 ** min(16, self._store_down_ticks - 1))

    def run(self, stop: threading.Event, tick_seconds: float) -> None:
        """Tick until `stop` is set; `wake()` makes the next tick come soon.

        A woken tick waits until at least `MIN_WAKE_GAP_S`, and at least as long as the last
        tick took, have passed since the last tick ended: a burst of wakes (every submit wakes
        the loop) is then planned in a few ticks rather than one tick per wake, and the loop
        cannot take more than half the time of a process it shares with the API.
        """
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except Exception:
                log.exception("tick failed; the loop goes on")
            ended = time.monotonic()
            retry = self.store_retry_s()
            wait_s = tick_seconds if retry is None else min(tick_seconds, retry)
            self._wake.wait(wait_s)
            rest = min(wait_s, max(MIN_WAKE_GAP_S, ended - started)) - (time.monotonic() - ended)
            if rest > 0:
                stop.wait(rest)
            self._wake.clear()

    def wake(self) -> None:
        self._wake.set()

    @property
    def ticks(self) -> int:
        return self._ticks

    # -- observe -------------------------------------------------------------------------------

    def _record_exit(self, ex: AttemptExit, now: float, report: TickReport) -> bool:
        """Record an exit and acknowledge it to the executor; False when the store could not
        (the executor reports it again next tick). An exit of an attempt the store does not
        know is acknowledged (there is nothing to record it on)."""
        try:
            self._on_exit(ex, now)
        except NotFound as exc:
            log.warning("exit of attempt %s not recorded: %s", ex.attempt_id, exc)
        except StoreUnavailable:
            report.store_failed()
            return False
        except Exception:
            report.errors += 1
            if ex.attempt_id not in self._exit_failing:  # once, not at every tick's retry
                self._exit_failing.add(ex.attempt_id)
                log.exception("handling the exit of attempt %s failed; retrying every tick", ex.attempt_id)
            return False
        self._exit_failing.discard(ex.attempt_id)
        self.executor.ack_exit(ex.attempt_id)
        return True

    def _control_time(self, ex: AttemptExit, ctx: ExitContext, now: float) -> float:
        """The exit's end in control time: a shim's wall-clock time converted with the clock
        port, then clamped between the attempt's start and now (a clock jump cannot make an
        attempt end before it started, or in the future)."""
        ended = ex.ended_at
        if ex.wall_clock:
            ended -= self.clock.wall() - self.clock.now()
        if ctx.started_at is not None:
            ended = max(ended, ctx.started_at)
        return min(ended, now)

    def _on_exit(self, ex: AttemptExit, now: float) -> None:
        ctx = self.store.exit_context(ex.attempt_id)
        # It ran (it has an exit status) but its start was never recorded: from its launch.
        has_status = ex.exit_code is not None or ex.signal is not None
        ran = ctx.attempt_state == AttemptState.PENDING and has_status
        running_at = (ctx.started_at if ctx.started_at is not None else now) if ran else None
        if ex.handle is not None:  # known only now (a pod that ran between two polls): one write
            handle = AttemptHandle(ex.handle.ref, ex.handle.started_at, running_at)
            self.store.record_launch(ex.attempt_id, handle)
        elif running_at is not None:
            self.store.mark_running(ex.attempt_id, running_at)
        if ran:  # its state moved to RUNNING
            ctx = self.store.exit_context(ex.attempt_id)
        ex = evolve(ex, ended_at=self._control_time(ex, ctx, now), wall_clock=False)
        self._read_latest(ctx, ex.ended_at)
        timed_out = self._walltime_verdict(ctx, ex.ended_at)
        for _ in range(3):
            decision = classify_exit(
                step_state=ctx.step_state,
                noticed=ctx.attempt_state == AttemptState.STOPPING,
                exit_code=ex.exit_code,
                signal=ex.signal,
                killed_at_deadline=ex.killed_at_deadline,
                retries_used=ctx.retries_used,
                max_retries=ctx.max_retries,
                now=ex.ended_at,
                retry=self.settings.retry,
                preemptions=ctx.preemptions,
                max_preemptions=ctx.max_preemptions,
                infrastructure=ex.infrastructure,
                timed_out=timed_out,
                reason=ex.reason,
                detail=ex.detail,
            )
            decision = self._resume_crash(ctx, ex, timed_out is not None) or decision
            if self._finish(ctx, decision, ex, ex.effective_reason()):
                break
            ctx = self.store.exit_context(ex.attempt_id)  # someone moved the step: decide again
        self._dirty_jobs.add(ctx.job_id)
        self._checkpoint_polled.pop(ex.attempt_id, None)
        self._bad_latest.pop(ex.attempt_id, None)
        self._budgets.pop(ex.attempt_id, None)

    def _record_running(self, attempt_id: int, at: float, report: TickReport) -> None:
        """Record that a pending attempt began to run (retried every tick until the store has it)."""
        handle = self._started_handles.get(attempt_id)
        try:
            if handle is None:
                self.store.mark_running(attempt_id, at)
            else:  # the handle and the start in one write
                self.store.record_launch(attempt_id, AttemptHandle(handle.ref, handle.started_at, at))
            self._budgets.pop(attempt_id, None)  # its walltime runs from now: read it again
        except StoreUnavailable:
            report.store_failed()
            return
        except Exception:
            report.errors += 1
            log.exception("recording the start of attempt %s failed; retrying every tick", attempt_id)
            return
        self._unrecorded_started.pop(attempt_id, None)
        self._started_handles.pop(attempt_id, None)

    def _record_lost(self, attempt_id: int, now: float, report: TickReport) -> None:
        """Record an attempt lost while the control plane was down (retried every tick until
        the store has it)."""
        try:
            self._on_lost(attempt_id, now)
        except StoreUnavailable:
            report.store_failed()
            return
        except NotFound:
            pass
        except Exception:
            report.errors += 1
            log.exception("recording the loss of attempt %s failed; retrying every tick", attempt_id)
            return
        self._unrecorded_lost.pop(attempt_id, None)

    def _on_lost(self, attempt_id: int, now: float) -> None:
        ctx = self.store.exit_context(attempt_id)
        timed_out = None
        if ctx.attempt_state == AttemptState.STOPPING:  # lost after its timeout notice: FAILED
            att = self.store.attempt(attempt_id)
            if walltime.is_timeout_stop(att.stop_reason):
                timed_out = walltime.timed_out(self._budget(att), ended_at=now, stop_reason=att.stop_reason)
        decision = classify_lost(
            step_state=ctx.step_state, retries_used=ctx.retries_used, timed_out=timed_out
        )
        self._finish(ctx, decision, AttemptExit(attempt_id, None, None, now), None)

    def _finish(
        self, ctx: ExitContext, decision: ExitDecision, ex: AttemptExit, reason: ExitReason | None
    ) -> bool:
        try:
            self.store.finish_attempt(
                ctx,
                decision,
                ended_at=ex.ended_at,
                exit_code=ex.exit_code,
                signal=ex.signal,
                killed_at_deadline=ex.killed_at_deadline,
                half_life_s=self.settings.scheduler.fair_share.half_life_s,
                reason=reason,
                detail=ex.detail,
            )
        except StaleState:
            return False
        log.info("%s/%s attempt %s: %s", ctx.job_id, ctx.step, ctx.attempt_id, decision.message)
        return True

    def _end_jobs(self, report: TickReport, now: float) -> None:
        """Tell the executor about jobs that will start nothing more (`Executor.end_job`): the
        cancelled jobs given notice this tick or earlier, then a batch of the finished jobs the
        store lists (`jobs_to_end`), each marked in the store once the executor took it. A job
        whose `end_job` fails is tried again at the next tick, the others go on; the batch starts
        after the previous one, so jobs that keep failing cannot hold back the rest."""
        for job_id in sorted(self._cancelling_to_end):
            if not self._acting():
                return
            if self._end_job(job_id, now, report):
                self._cancelling_to_end.discard(job_id)
                self._ended_early.add(job_id)
        if report.store_unavailable:
            return  # the store failed this tick: what it lists is ended next tick
        batch: list[str] = self._guard(
            report,
            "jobs to end",
            lambda: self.store.jobs_to_end(after=self._end_cursor, limit=END_JOBS_BATCH),
            [],
        )
        self._end_cursor = batch[-1] if len(batch) == END_JOBS_BATCH else None
        ended: list[str] = []
        for job_id in batch:
            if not self._acting():
                break
            if job_id in self._ended_early or self._end_job(job_id, now, report):
                ended.append(job_id)
        if ended:
            # Unrecorded (the store failed): listed again next tick, and `end_job` is idempotent.
            self._guard(report, "recording ended jobs", lambda: self.store.mark_jobs_ended(ended, at=now), 0)
            if not report.store_unavailable:
                self._ended_early.difference_update(ended)

    def _end_job(self, job_id: str, now: float, report: TickReport) -> bool:
        """`Executor.end_job`; False (logged once per failing job) when it failed."""
        try:
            self.executor.end_job(job_id, now)
        except Exception as exc:
            unclassified = not isinstance(exc, ExecutorError)
            report.errors += unclassified
            if job_id not in self._end_failing:
                self._end_failing.add(job_id)
                log.warning(
                    "ending job %s in the executor failed (%s); retrying every tick",
                    job_id,
                    exc,
                    exc_info=unclassified,
                )
            return False
        if self._end_failing:
            self._end_failing.discard(job_id)
        return True

    def _give_notice(self, attempt_id: int, grace: float, step_state: StepState, now: float) -> None:
        reason = NOTICE_CANCELLED if step_state == StepState.CANCELLING else NOTICE_PREEMPTED
        deadline = now + grace
        # Notice first, then the record: a crash in between re-sends notice, never kills unwarned.
        # The lease is checked just before (a stale leader's record would be refused too late).
        self._check_lease()
        self.executor.notify_stop(attempt_id, deadline, now, reason=reason)
        self.store.mark_stopping(
            attempt_id, deadline=deadline, reason=f"{reason}: notice given, deadline in {grace:g}s", now=now
        )

    # -- walltime (policy.walltime) --------------------------------------------------------------

    def _enforce_walltime(
        self, active: list[AttemptRecord], noticed: set[int], now: float, report: TickReport
    ) -> float | None:
        """Give notice to the running attempts past their step's walltime; return the next
        deadline (for `next_due`). Deadlines derive from stored start times and specs only."""
        # The very (frozen) records of the last clean scan, compared by identity (the scan keeps
        # them, so their ids are theirs): the same budgets (each is made once per attempt and
        # kept), without a pass over the attempts. A store that reads new records each tick
        # misses here and scans as before.
        ids = tuple(map(id, active))
        last = self._walltime_scan
        if not noticed and last is not None and last[1] == ids:
            budgets = last[2]
        else:
            budgets, clean = self._walltime_budgets(active, noticed, report)
            self._walltime_scan = (tuple(active), ids, budgets) if clean and not noticed else None
        # Pruned to the active attempts once they may hold twice as many (an entry of an attempt
        # that ended is never read again: attempt ids are not reused, a step's spec never changes).
        bound = 2 * len(active) + 16
        if len(self._budgets) > bound or len(self._job_timeouts) > bound:
            live = {att.id for att in active}
            steps = {(att.job_id, att.step_name) for att in active}
            self._budgets = {k: v for k, v in self._budgets.items() if k in live}
            self._job_timeouts = {k: v for k, v in self._job_timeouts.items() if k in steps}
        for budget in walltime.overdue(budgets, now):
            if report.store_unavailable:
                break  # still overdue next tick
            try:
                if self._give_timeout_notice(budget, now):
                    report.notices += 1
            except StoreUnavailable:
                report.store_failed()
            except Exception:
                report.errors += 1
                log.exception("giving timeout notice to attempt %s failed", budget.attempt_id)
        return walltime.next_deadline(budgets, now)

    def _walltime_budgets(
        self, active: list[AttemptRecord], noticed: set[int], report: TickReport
    ) -> tuple[list[walltime.WalltimeBudget], bool]:
        """The budgets with a limit (the others have no deadline) of the running attempts not
        given notice just now, and whether every one could be read (else the scan is not kept)."""
        budgets: list[walltime.WalltimeBudget] = []
        known = self._budgets
        clean = True
        for att in active:
            if att.state != AttemptState.RUNNING or att.id in noticed:
                continue
            try:
                budget = known.get(att.id) or self._budget(att)
            except StoreUnavailable:
                report.store_failed()
                clean = False
                continue
            except Exception:
                report.errors += 1
                log.exception("reading the walltime of attempt %s failed", att.id)
                clean = False
                continue
            if budget.limit_s is not None:
                budgets.append(budget)
        return budgets, clean

    def _give_timeout_notice(self, budget: walltime.WalltimeBudget, now: float) -> bool:
        att_id = budget.attempt_id
        deadline = now + budget.grace_s
        # Notice first, then the record (as `_give_notice`): a crash in between re-sends notice.
        self._check_lease()
        self.executor.notify_stop(budget.attempt_id, deadline, now, reason=NOTICE_WALLTIME)
        try:
            self.store.mark_stopping(
                budget.attempt_id, deadline=deadline, reason=walltime.stop_reason(budget), now=now
            )
        except StaleState as exc:  # it ended or got notice meanwhile: nothing more to do
            log.info("attempt %s: no timeout notice recorded: %s", budget.attempt_id, exc)
            return False
        self.store.set_waiting_reasons({(budget.job_id, budget.step): walltime.stopping_reason(budget)})
        log.info("%s/%s attempt %s: walltime spent, notice given", budget.job_id, budget.step, att_id)
        return True

    def _walltime_verdict(self, ctx: ExitContext, ended_at: float) -> str | None:
        """The verdict "timed out after ..." when the attempt that ended was stopped for its walltime or spent
        its step's budget (`policy.walltime.timed_out`), else None."""
        budget = self._budgets.get(ctx.attempt_id)
        stop_reason = None
        if ctx.attempt_state == AttemptState.STOPPING:  # the stop reason says why it had notice
            att = self.store.attempt(ctx.attempt_id)
            stop_reason = att.stop_reason
            budget = budget or self._budget(att)
        return walltime.timed_out(budget, ended_at=ended_at, stop_reason=stop_reason)

    def _budget(self, att: AttemptRecord) -> walltime.WalltimeBudget:
        began = att.running_at if att.running_at is not None else att.started_at
        return self._make_budget(att.id, att.job_id, att.step_name, att.number, began, lambda: att.record)

    def _make_budget(
        self,
        attempt_id: int,
        job_id: str,
        step: str,
        number: int,
        started_at: float,
        record: Callable[[], Mapping[str, Any]],
    ) -> walltime.WalltimeBudget:
        """An attempt's walltime budget, from its stored spec (`record()["spec"]`, read once per
        step: the step's timeout, else the job's, else the configured default) and the running
        times of the step's earlier attempts."""
        budget = self._budgets.get(attempt_id)
        if budget is not None:
            return budget
        timeouts = self._job_timeouts.get((job_id, step))
        if timeouts is None:
            timeouts = walltime.job_timeouts(record().get("spec") or {})
            self._job_timeouts[(job_id, step)] = timeouts
        limit = timeouts.limit(step, self.settings.default_step_timeout_s)
        used = 0.0
        if limit is not None and number > 1:
            earlier = self.store.step_attempts(job_id, step)
            # Running time only (not a pending image pull), and only since the last `retry`.
            retried_at = self.store.step(job_id, step).retried_at
            used = walltime.used_before(
                (
                    (a.number, a.running_at, a.ended_at)
                    for a in earlier
                    if a.running_at is not None and (retried_at is None or a.started_at >= retried_at)
                ),
                number,
            )
        budget = walltime.WalltimeBudget(
            attempt_id=attempt_id,
            job_id=job_id,
            step=step,
            number=number,
            started_at=started_at,
            limit_s=limit,
            used_before_s=used,
            grace_s=timeouts.grace_s,
        )
        self._budgets[attempt_id] = budget
        return budget

    def _poll_checkpoints(self, now: float, active: list[AttemptRecord]) -> None:
        every = self.settings.checkpoint_poll_s
        if every == math.inf:
            return  # never polled (steps report through the API: the simulator)
        for att in active:
            if now - self._checkpoint_polled.get(att.id, -1e18) < every:
                continue
            self._checkpoint_polled[att.id] = now
            ckpt_dir = att.record.get("checkpoint_dir")
            if not ckpt_dir:
                continue
            try:
                self._read_latest_for(att.id, att.job_id, att.step_name, ckpt_dir, now)
            except StoreUnavailable:
                self._checkpoint_polled.pop(att.id, None)  # read again once the store works
                raise
            except Exception:
                log.exception("reading LATEST of attempt %s failed", att.id)

    def _resume_crash(self, ctx: ExitContext, ex: AttemptExit, timed_out: bool) -> ExitDecision | None:
        """`checkpoint_check.resume_crash_decision`; a store outage is raised (the exit is retried
        whole), any other failure to find out costs only the fallback."""
        try:
            return resume_crash_decision(
                self.store, ctx, ex, timed_out=timed_out, window_s=self.settings.resume_crash_window_s
            )
        except StoreUnavailable:
            raise
        except Exception:
            log.exception("checking attempt %s for a crash on resume failed", ctx.attempt_id)
            return None

    def _read_latest(self, ctx: ExitContext, now: float) -> None:
        if ctx.checkpoint_dir:
            try:
                self._read_latest_for(ctx.attempt_id, ctx.job_id, ctx.step, ctx.checkpoint_dir, now)
            except StoreUnavailable:
                raise  # the whole exit is retried next tick, its last checkpoint with it
            except Exception:
                log.exception("reading LATEST of attempt %s failed", ctx.attempt_id)

    def _read_latest_for(self, attempt_id: int, job_id: str, step: str, ckpt_dir: str, now: float) -> None:
        uri = join_uri(ckpt_dir, "LATEST")
        try:
            text = self.artifacts.read_text(uri, max_bytes=LATEST_MAX_BYTES)
            if text is None:
                return
            label = parse_checkpoint_label(text, checkpoint_dir=ckpt_dir)
        except ValueError as exc:
            problem = str(exc)
            if self._bad_latest.get(attempt_id) != problem:
                self._bad_latest[attempt_id] = problem
                self.store.add_event(
                    job_id,
                    step,
                    attempt_id,
                    at=now,
                    kind="checkpoint_invalid",
                    message=f"ignored {uri}: {problem}",
                )
            return
        self.store.record_checkpoint(attempt_id, label=label, progress=None, source="file", now=now)

    def _advance_dirty(self, now: float) -> None:
        if now - self._swept_at >= FULL_DAG_SWEEP_S or now < self._swept_at:
            self._swept_at = now
            self._dirty_jobs.clear()
            self._advance(None, now)
        elif self._dirty_jobs:
            dirty, self._dirty_jobs = self._dirty_jobs, set()
            self._advance(dirty, now)

    def _advance(self, job_ids: Iterable[str] | None, now: float) -> None:
        # `advance` is pure over an immutable view: a view it found nothing to change in (kept
        # by job) is not advanced again while the store hands back that same view (the in-memory
        # store keeps a job's view until the job or a step moves).
        known = settled = self._settled_views
        if job_ids is None:  # a full sweep keeps only the jobs it sees
            settled = self._settled_views = {}
        for view in self.store.job_views(job_ids):
            if known.get(view.job_id) is view:
                settled[view.job_id] = view
                continue
            changes = advance(view)
            if changes.empty:
                settled[view.job_id] = view
                continue
            try:
                self.store.apply_dag(changes, now)
            except StaleState:
                log.info("job %s moved while advancing its DAG; next tick retries", view.job_id)
                continue

    # -- act -----------------------------------------------------------------------------------

    def _start(self, start: StartStep, now: float) -> bool:
        self._check_lease()  # then the booking (fenced in the store), then the launch
        try:
            launch = self.store.begin_attempt(
                job_id=start.job_id,
                step=start.step,
                node=start.node,
                gpus=start.gpus,
                layout=self.settings.layout,
                now=now,
                reason=start.reason,
            )
        except (StaleState, GpuBusy) as exc:
            log.info("not starting %s/%s: %s", start.job_id, start.step, exc)
            return False
        self._reasons.pop((start.job_id, start.step), None)
        try:
            request = self._launch_request(launch, now)
            self._check_lease()
            handle = self.executor.launch(request, now)
        except ExecutorError as exc:
            self._launch_failed(launch, str(exc), exc.temporary, now, exc.infrastructure)
            return False
        except StoreUnavailable as exc:  # the store failed while preparing the launch
            self._launch_failed(launch, exc.reason, True, now, "store")
            return False
        except FencedOut:  # not the leader any more: the next leader finds the booking LOST
            raise
        except Exception as exc:  # an unclassified error: treat as permanent, but keep the loop
            log.exception("launch of %s/%s failed", launch.job_id, launch.step)
            self._launch_failed(launch, f"{type(exc).__name__}: {exc}", False, now)
            return False
        self._launch_succeeded(launch)
        self.store.record_launch(launch.attempt_id, handle)
        if handle.running_at is None:
            return True  # pending: its walltime starts when it runs (`_record_running`)
        try:  # its walltime deadline joins this tick's `next_due` (the scan sees it from next tick)
            budget = self._make_budget(
                launch.attempt_id,
                launch.job_id,
                launch.step,
                launch.number,
                now,
                lambda: self.store.attempt(launch.attempt_id).record,
            )
            if budget.deadline is not None:
                self._start_deadlines.append(budget.deadline)
        except Exception:
            log.exception("reading the walltime of attempt %s failed; the next tick does", launch.attempt_id)
        return True

    def _launch_request(self, launch: AttemptLaunch, now: float) -> LaunchRequest:
        resolved = launch.resolved
        secret_env = self._secret_env(launch)  # values go into the request's env only, never logged
        # With per-job uids the executor makes a local job dir's subdirs as the job's (§6.4).
        private = self.settings.job_users is not None and not is_remote(
            self.settings.layout.job_root(launch.job_id)
        )
        for uri in (resolved.outputs, resolved.checkpoint_dir):
            if uri and not private:
                try:
                    self.artifacts.ensure_dir(uri)
                except OSError as exc:  # lowtide's artifact storage, not the step
                    kind = "permissions" if isinstance(exc, PermissionError) else "storage"
                    raise ExecutorError(
                        f"cannot create {uri}: {exc}", temporary=True, infrastructure=kind
                    ) from exc
        _, token = self.store.create_token(
            name=f"{launch.job_id}/{launch.step}#{launch.number}",
            owner=f"step:{launch.job_id}",
            role="step",
            now=now,
            attempt_id=launch.attempt_id,
        )
        notice = self._notice_path(launch.job_id, launch.step, launch.number)
        grace = launch.grace_seconds
        env = step_environment(
            job_id=launch.job_id,
            attempt=launch.number,
            node=launch.node,
            gpus=launch.gpus,
            resolved=resolved,
            params=launch.params,
            grace_seconds=grace,
            notice_path=notice,
            last_checkpoint=choose_for_launch(self.store, self.artifacts, launch, now),
            api_url=self.settings.api_url,
            step_token=token,
            storage_options=self.settings.storage_options,
            gpu_share=step_gpu_share(self._gpu_shares, launch.node, launch.gpus),
        )
        env = {**env, **secret_env}
        mounts = tuple(
            u
            for u in (resolved.outputs, resolved.checkpoint_dir, *resolved.inputs.values())
            if u and not is_remote(u)
        )
        return LaunchRequest(
            attempt_id=launch.attempt_id,
            job_id=launch.job_id,
            step=launch.step,
            attempt=launch.number,
            node=launch.node,
            gpus=launch.gpus,
            command=resolved.command,
            image=resolved.image,
            env=env,
            work_dir=launch.work_dir,
            log_path=self.settings.layout.attempt_log(launch.job_id, launch.step, launch.number),
            notice_path=notice,
            mounts=mounts,
            run_as=self._run_as(launch.job_id),
            job_dir=None if is_remote(job_dir := self.settings.layout.job_root(launch.job_id)) else job_dir,
        )

    def _run_as(self, job_id: str) -> RunAs | None:
        """The job's own Unix identity (docs/architecture.md §6.4); ExecutorError (permanent)
        when its serial has no uid left."""
        users = self.settings.job_users
        if users is None:
            return None
        try:
            return users.for_job(self.store.job_serial(job_id))
        except ValueError as exc:
            raise ExecutorError(str(exc), temporary=False) from exc

    def _secret_env(self, launch: AttemptLaunch) -> dict[str, str]:
        """The values of the attempt's secrets by variable; ExecutorError (permanent) when one
        cannot be read, or when no resolver is configured."""
        uses = launch.resolved.secrets
        if not uses:
            return {}
        if self.secrets is None:
            raise ExecutorError("this lowtide has no secrets configured (config secrets:)", temporary=False)
        return self.secrets.environment(uses)

    def _launch_failed(
        self,
        launch: AttemptLaunch,
        message: str,
        temporary: bool,
        now: float,
        infrastructure: str | None = None,
    ) -> None:
        """Roll a failed launch forward as an attempt that ended; an infrastructure failure
        also raises its alert. Kept and retried every tick while the store cannot record it."""
        if infrastructure is not None:
            self._infrastructure_failed(infrastructure, message, now)
        failure = _LaunchFailure(launch, message, temporary, infrastructure, now)
        self._unrecorded_launches[launch.attempt_id] = failure
        report = TickReport(at=now)
        self._record_launch_failure(failure, report)
        if report.store_unavailable:
            raise StoreUnavailable(f"the failed launch of attempt {launch.attempt_id} is not recorded yet")

    def _record_launch_failure(self, failure: _LaunchFailure, report: TickReport) -> None:
        launch = failure.launch
        key = (launch.job_id, launch.step)
        try:
            ctx = self.store.exit_context(launch.attempt_id)
            decision = classify_launch_failure(
                step_state=ctx.step_state,
                message=failure.message,
                temporary=failure.temporary,
                retries_used=ctx.retries_used,
                max_retries=ctx.max_retries,
                now=failure.at,
                retry=self.settings.retry,
                infrastructure=failure.infrastructure,
                infrastructure_failures=self._infra_streak.get(key, 0),
            )
            finished = self._finish(
                ctx, decision, AttemptExit(launch.attempt_id, None, None, failure.at), None
            )
            if finished and failure.infrastructure is not None:
                self._infra_streak[key] = self._infra_streak.get(key, 0) + 1
                self.store.add_event(
                    launch.job_id,
                    launch.step,
                    launch.attempt_id,
                    at=failure.at,
                    kind="infrastructure_failure",
                    message=decision.message,
                )
        except StoreUnavailable:
            report.store_failed()
            return
        except NotFound:
            pass
        except Exception:
            report.errors += 1
            log.exception("recording the failed launch of attempt %s failed", launch.attempt_id)
        self._unrecorded_launches.pop(launch.attempt_id, None)
        self._dirty_jobs.add(launch.job_id)

    def _infrastructure_failed(self, kind: str, message: str, now: float) -> None:
        known = self.infrastructure_alerts.get(kind)
        if known is None:
            log.error("infrastructure failure (%s): %s; steps wait, no retry used", kind, message)
        self.infrastructure_alerts[kind] = InfrastructureAlert(
            kind, message, known.since if known else now, (known.failures if known else 0) + 1
        )
        self.infrastructure_failures_total[kind] = self.infrastructure_failures_total.get(kind, 0) + 1

    def _launch_succeeded(self, launch: AttemptLaunch) -> None:
        """A launch worked: the machinery works again, so its alerts clear."""
        self._infra_streak.pop((launch.job_id, launch.step), None)
        if self.infrastructure_alerts:
            kinds = ", ".join(self.infrastructure_alerts)
            log.warning("a launch succeeded; clearing infrastructure alerts: %s", kinds)
            self.infrastructure_alerts = {}

    def _write_reasons(self, plan: SchedulePlan) -> None:
        changed = {
            (w.job_id, w.step): w.reason
            for w in plan.waiting
            if self._reasons.get((w.job_id, w.step)) != w.reason
        }
        if changed:
            self.store.set_waiting_reasons(changed)
            self._reasons.update(changed)
        if len(self._reasons) > 4 * max(1, len(plan.waiting)) + 1000:
            waiting = {(w.job_id, w.step) for w in plan.waiting}
            self._reasons = {k: v for k, v in self._reasons.items() if k in waiting}

    # -- helpers -------------------------------------------------------------------------------

    def _acting(self) -> bool:
        return self.lease is None or self.lease.may_act()

    def _check_lease(self) -> None:
        """Raise FencedOut unless this control plane holds the lease (no lease: it always acts)."""
        if self.lease is not None:
            self.lease.check()

    def _notice_path(self, job_id: str, step: str, number: int) -> str:
        return self.settings.layout.notice_file(job_id, step, number)

    def _guard(self, report: TickReport, what: str, fn: Callable[[], _T], default: _T) -> _T:
        try:
            return fn()
        except StoreUnavailable:  # logged once per outage by the store; the next tick retries
            report.store_failed()
            return default
        except Exception:
            report.errors += 1
            log.exception("%s failed; the tick goes on", what)
            return default
