"""Fake ports for the simulator: research steps, replicas and metrics on a virtual clock.

`SimExecutor` implements `control.executor_port.Executor`: a step needs `work_s` seconds of GPU
work; each attempt first spends `restart_s` loading (no progress), then progresses one second per
second and checkpoints every `checkpoint_every_s` of progress. On notice it writes a checkpoint in
`checkpoint_write_s` and exits 143 (non-zero: interrupted, docs/architecture.md §6); if the grace
is shorter than that it is killed at the deadline and resumes from its last periodic checkpoint. A
resumed attempt starts from the checkpoint the store told it about (`LOWTIDE_RESUME_FROM`), as a
real step would, never from the simulator's own memory.
`SimServiceManager` implements `control.inference_ports.ServiceManager`: a cold start is healthy
after `startup_s`, a wake after `wake_s`, a park completes after `park_s`; events carry their exact
time. `SimMetrics` implements `MetricsSource` from `sim.capacity` at the load curve's current rate
(the same tuple of replica signals while the modelled load and the serving replicas stay the same).
Each port also says when its next event is due (`next_event`), so the simulator can jump to it;
the executor keeps its attempts' next checkpoint reports in a heap and polls exits only once the
earliest is due, so a tick costs nothing per running attempt while none of them has news.
Neighbours: `sim.world` builds and drives them. Must not: decide anything (the production loop
does), read the wall clock, or import real adapters.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from lowtide.control.executor_port import (
    AdoptOutcome,
    AdoptRequest,
    AdoptResult,
    AttemptExit,
    AttemptHandle,
    LaunchRequest,
    PollReport,
)
from lowtide.control.inference_ports import ReplicaEvent, ReplicaLaunch
from lowtide.control.ports import PathStat
from lowtide.domain.metrics import ReplicaSignals, ServiceSignals
from lowtide.domain.services import ParkMode
from lowtide.sim.capacity import (
    ModelledLoad,
    ReplicaCapacity,
    ServiceLoadState,
    current_load,
    service_signals,
)
from lowtide.sim.load import LoadCurve

#: Exit code of a step that checkpointed and left on notice (128 + SIGTERM, as shells report it).
INTERRUPTED_EXIT = 143
_SIGKILL = 9
_NO_EXITS = PollReport()  # what a poll with nothing unacknowledged reports (frozen: one for all)
_LABEL_PREFIX = "p"


def checkpoint_label(progress_s: float) -> str:
    """The label a simulated step writes: its progress in whole seconds (``p3600``)."""
    return f"{_LABEL_PREFIX}{math.floor(progress_s)}"


def progress_of(resume_from: str | None) -> float:
    """Progress recorded in a resume URI (``.../checkpoints/p3600`` → 3600.0); 0 without one."""
    if not resume_from:
        return 0.0
    tail = resume_from.rstrip("/").rsplit("/", 1)[-1]
    if tail.startswith(_LABEL_PREFIX) and tail[1:].isdigit():
        return float(tail[1:])
    return 0.0


@dataclass(frozen=True, slots=True)
class StepBehaviour:
    """How a simulated research step works and stops."""

    work_s: float
    restart_s: float = 120.0
    checkpoint_every_s: float = 1800.0
    checkpoint_write_s: float = 20.0


@dataclass
class _Attempt:
    request: LaunchRequest
    behaviour: StepBehaviour
    started_at: float
    saved_s: float  # progress at start (resumed from a checkpoint)
    exit_at: float
    exit_code: int | None = 0
    signal: int | None = None
    killed: bool = False
    notice_ckpt: tuple[float, float] | None = None  # (at, progress) of the checkpoint written on notice
    recorded_s: float = -1.0  # progress of the last checkpoint reported to the store

    def progress(self, t: float) -> float:
        ran = max(0.0, t - self.started_at - self.behaviour.restart_s)
        return min(self.behaviour.work_s, self.saved_s + ran)

    def next_checkpoint_at(self) -> float:
        """When the next periodic checkpoint after the last reported one is written (inf: none)."""
        every = self.behaviour.checkpoint_every_s
        if every <= 0:
            return math.inf
        done = max(self.saved_s, self.recorded_s)
        nxt = (math.floor(done / every) + 1) * every
        if nxt > self.behaviour.work_s:
            return math.inf
        return self.started_at + self.behaviour.restart_s + (nxt - self.saved_s)

    def first_report_at(self) -> float:
        """The earliest time at which `SimExecutor.checkpoints_due` can have something new to report
        for this attempt (inf: never, until it is given notice)."""
        notice = self.notice_ckpt[0] if self.notice_ckpt is not None else math.inf
        return min(notice, self.next_checkpoint_at())

    def periodic_checkpoint(self, t: float) -> float | None:
        """Progress of the last periodic checkpoint at or before `t` in this attempt (None: none)."""
        every = self.behaviour.checkpoint_every_s
        if every <= 0:
            return None
        done = self.progress(t)
        last = math.floor(done / every) * every
        return last if last > self.saved_s else None


@dataclass
class SimExecutor:
    """Research steps as arithmetic (see the module docstring)."""

    behaviours: dict[str, StepBehaviour] = field(default_factory=dict)  # job id → behaviour
    running: dict[int, _Attempt] = field(default_factory=dict)
    launches: int = 0
    #: Exits reported but not acknowledged yet: reported again at every poll (the port's rule).
    unacked: dict[int, AttemptExit] = field(default_factory=dict)
    #: GPUs the running attempts hold (kept with `running`, so that nobody sums it per tick).
    held_gpus: int = 0
    # Nothing can be reported by `checkpoints_due` before this time: at most the earliest
    # `first_report_at` of the running attempts (kept low by `launch` and `notify_stop`).
    _quiet_until: float = field(default=-math.inf, repr=False)
    # The earliest `exit_at` of the running attempts (None: recompute; see `next_event`).
    _next_exit: float | None = field(default=None, repr=False)
    # Each running attempt's `first_report_at` as last worked out, and a heap of (time, attempt
    # id) over them (an entry whose time is no longer the attempt's is skipped when popped): what
    # `checkpoints_due` looks at, instead of every running attempt.
    _report_at: dict[int, float] = field(default_factory=dict, repr=False)
    _reports: list[tuple[float, int]] = field(default_factory=list, repr=False)

    def _schedule_report(self, attempt_id: int, att: _Attempt) -> None:
        at = att.first_report_at()
        self._report_at[attempt_id] = at
        if at < math.inf:
            heapq.heappush(self._reports, (at, attempt_id))
        self._quiet_until = min(self._quiet_until, at)

    def launch(self, request: LaunchRequest, now: float) -> AttemptHandle:
        behaviour = self.behaviours[request.job_id]
        saved = min(behaviour.work_s, progress_of(request.env.get("LOWTIDE_RESUME_FROM")))
        exit_at = now + behaviour.restart_s + (behaviour.work_s - saved)
        att = _Attempt(request, behaviour, now, saved, exit_at)
        self.running[request.attempt_id] = att
        self.held_gpus += len(request.gpus)
        self._schedule_report(request.attempt_id, att)
        self._next_exit = None
        self.launches += 1
        return AttemptHandle(f"sim/{request.attempt_id}", now, now)  # loading counts as running

    def notify_stop(self, attempt_id: int, deadline: float, now: float, *, reason: str | None = None) -> None:
        att = self.running.get(attempt_id)
        if att is None or att.notice_ckpt is not None or att.killed or att.exit_code != 0:
            return
        write_done = now + att.behaviour.checkpoint_write_s
        if write_done >= att.exit_at:
            return  # it finishes before it could checkpoint: exit 0 stands
        if write_done <= deadline:
            att.notice_ckpt = (write_done, att.progress(now))
            att.exit_at, att.exit_code = write_done, INTERRUPTED_EXIT
            self._schedule_report(attempt_id, att)
        else:
            att.exit_at, att.exit_code, att.signal, att.killed = deadline, None, _SIGKILL, True
        self._next_exit = None

    def checkpoints_due(self, now: float) -> list[tuple[int, str, float]]:
        """(attempt id, label, when) of each attempt's newest checkpoint not yet reported, up to
        `now`: the simulator reports them the way a step calls the API."""
        out: list[tuple[int, str, float]] = []
        if now < self._quiet_until:
            return out  # the common case: no attempt has anything new yet
        # The attempts whose first report is due by now, in id order (the order they were launched
        # in, the order of `running`); the others have nothing new since their last report.
        reports, report_at = self._reports, self._report_at
        due: list[int] = []
        while reports and reports[0][0] <= now:
            at, aid = heapq.heappop(reports)
            if report_at.get(aid) == at and aid in self.running:
                due.append(aid)
                del report_at[aid]  # worked out again below
        for aid in sorted(due):
            att = self.running[aid]
            when_progress: tuple[float, float] | None = None
            if att.notice_ckpt is not None and att.notice_ckpt[0] <= now:
                when_progress = att.notice_ckpt
            else:
                t = min(now, att.exit_at)
                periodic = att.periodic_checkpoint(t)
                if periodic is not None:
                    at = att.started_at + att.behaviour.restart_s + (periodic - att.saved_s)
                    when_progress = (at, periodic)
            if when_progress is not None and when_progress[1] > att.recorded_s:
                att.recorded_s = when_progress[1]
                out.append((aid, checkpoint_label(when_progress[1]), when_progress[0]))
        for aid in due:  # pushed back only now: one due again by `now` waits for the next call
            self._schedule_report(aid, self.running[aid])
        while reports and report_at.get(reports[0][1]) != reports[0][0]:
            heapq.heappop(reports)  # entries no longer an attempt's time
        self._quiet_until = reports[0][0] if reports else math.inf
        return out

    def poll(self, now: float) -> PollReport:
        soonest = self.next_event()
        if soonest is not None and soonest <= now:  # else no attempt exits yet: no scan
            for aid, att in list(self.running.items()):
                if att.exit_at <= now:
                    self.unacked[aid] = AttemptExit(
                        aid, att.exit_code, att.signal, att.exit_at, killed_at_deadline=att.killed
                    )
                    del self.running[aid]
                    self._report_at.pop(aid, None)
                    self.held_gpus -= len(att.request.gpus)
                    self._next_exit = None
        return PollReport(exits=tuple(self.unacked.values())) if self.unacked else _NO_EXITS

    def ack_exit(self, attempt_id: int) -> None:
        self.unacked.pop(attempt_id, None)

    def end_job(self, job_id: str, now: float) -> None:
        pass

    def next_event(self) -> float | None:
        if self._next_exit is None and self.running:
            self._next_exit = min(a.exit_at for a in self.running.values())
        return self._next_exit

    def adopt(self, request: AdoptRequest, now: float) -> AdoptResult:
        if request.attempt_id in self.running:
            return AdoptResult(AdoptOutcome.ADOPTED)
        return AdoptResult(AdoptOutcome.LOST)

    def reap_orphans(self, known_attempt_ids: set[int]) -> list[int]:
        return []

    def close(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class ReplicaTimes:
    """How long a simulated replica takes to change phase."""

    startup_s: float = 120.0
    wake_s: float = 10.0
    park_sleep_s: float = 3.0
    park_stop_s: float = 5.0


@dataclass
class _Replica:
    phase: str  # starting | waking | healthy | parking-sleep | parking-stop | asleep
    due: float | None  # when the current phase change completes


@dataclass
class SimServiceManager:
    times: Mapping[str, ReplicaTimes]  # service → times
    replicas: dict[str, _Replica] = field(default_factory=dict)
    cold_starts: int = 0
    wakes: int = 0
    # The earliest phase change due (inf: none; None: not known since the last poll that changed
    # a replica), kept so that a tick with nothing due neither sorts nor scans the replicas.
    _earliest: float | None = field(default=math.inf, init=False, repr=False)

    def _times(self, replica_id: str) -> ReplicaTimes:
        return self.times[replica_id.rsplit("/", 1)[0]]

    def _set(self, replica_id: str, replica: _Replica) -> None:
        old = self.replicas.get(replica_id)
        self.replicas[replica_id] = replica
        if old is not None and old.due is not None and old.due == self._earliest:
            self._earliest = None  # the earliest may have been the one replaced: not known now
        elif self._earliest is not None and replica.due is not None:
            self._earliest = min(self._earliest, replica.due)

    def _soonest(self) -> float:
        if self._earliest is None:
            self._earliest = min(
                (r.due for r in self.replicas.values() if r.due is not None), default=math.inf
            )
        return self._earliest

    def start(self, launch: ReplicaLaunch, now: float) -> None:
        self._set(launch.replica_id, _Replica("starting", now + self._times(launch.replica_id).startup_s))
        self.cold_starts += 1

    def park(self, replica_id: str, mode: ParkMode, now: float) -> None:
        t = self._times(replica_id)
        self._set(
            replica_id,
            _Replica(f"parking-{mode}", now + (t.park_sleep_s if mode == "sleep" else t.park_stop_s)),
        )

    def unpark(self, replica_id: str, now: float) -> None:
        rep = self.replicas.get(replica_id)
        t = self._times(replica_id)
        if rep is not None and rep.phase == "asleep":
            self._set(replica_id, _Replica("waking", now + t.wake_s))
            self.wakes += 1
        else:
            self._set(replica_id, _Replica("starting", now + t.startup_s))
            self.cold_starts += 1

    def poll(self, now: float) -> list[ReplicaEvent]:
        events: list[ReplicaEvent] = []
        if self._soonest() > now:
            return events  # nothing due yet: the common tick
        self._earliest = None  # what is left due is worked out again when asked
        for rid, rep in sorted(self.replicas.items()):
            if rep.due is None or rep.due > now:
                continue
            if rep.phase in ("starting", "waking"):
                events.append(ReplicaEvent(rid, "healthy", rep.due))
                self.replicas[rid] = _Replica("healthy", None)
            elif rep.phase == "parking-sleep":
                events.append(ReplicaEvent(rid, "asleep", rep.due))
                self.replicas[rid] = _Replica("asleep", None)
            elif rep.phase == "parking-stop":
                events.append(ReplicaEvent(rid, "stopped", rep.due))
                del self.replicas[rid]
        return events

    def next_event(self) -> float | None:
        soonest = self._soonest()
        return None if soonest == math.inf else soonest

    def url(self, replica_id: str) -> str | None:
        return f"sim://{replica_id}" if replica_id in self.replicas else None

    def adopt(self, replica_id: str, launch: ReplicaLaunch, now: float) -> bool:
        return replica_id in self.replicas

    def reap_orphans(self, known_ids: set[str]) -> list[str]:
        return []

    def close(self) -> None:
        pass


@dataclass
class SimMetrics:
    """A service's metrics as the capacity model gives them at the curve's current rate, with the
    backlog the world carries over from overloaded stretches (`state`, kept by `sim.world`).
    `start` is the epoch of the curve's t = 0."""

    curve: LoadCurve
    capacity: ReplicaCapacity
    start: float
    state: ServiceLoadState = field(default_factory=ServiceLoadState)
    # The last `current_load` and what it was computed from (capacity, state, rate, replicas): a
    # pure function of these frozen values, which stay the same over most ticks.
    _last: tuple[ReplicaCapacity, ServiceLoadState, float, int, ModelledLoad] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    # The last replicas' signals and what they were built from (the load, the replica ids): while
    # both stay the same, the figures are the same, so the tuple is handed out again. Their `at`
    # is then the tick that built them (when these figures began), not this tick: nothing on the
    # decision path reads a `ReplicaSignals.at` (`policy.autoscale` and `policy.inference` read the
    # figures and `stale`; `control.load_history` reads the `ServiceSignals.at`, which is `now`).
    _last_signals: tuple[ModelledLoad, frozenset[str], tuple[ReplicaSignals, ...]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def collect(self, service: str, replicas: Mapping[str, str], now: float) -> ServiceSignals:
        rate, n = self.curve.rate_at(now - self.start), len(replicas)
        last = self._last
        if last is not None and last[0] is self.capacity and last[1] == self.state and last[2:4] == (rate, n):
            load = last[4]
        else:
            load = current_load(self.state, self.capacity, rate, n)
            self._last = (self.capacity, self.state, rate, n, load)
        ids = frozenset(replicas)
        kept = self._last_signals
        if kept is not None and kept[0] is load and kept[1] == ids:
            return ServiceSignals(service=service, at=now, replicas=kept[2])
        signals = service_signals(service, load, tuple(sorted(ids)), now)
        self._last_signals = (load, ids, signals.replicas)
        return signals


class NoArtifacts:
    """The artifact port of a world without files: nothing to prepare, no LATEST to read (steps
    report checkpoints through the store, as the API does)."""

    def ensure_dir(self, uri: str) -> None:
        pass

    def read_text(self, uri: str, *, max_bytes: int) -> str | None:
        return None

    def stat(self, uri: str) -> PathStat | None:
        return PathStat("unknown")  # no files here: checkpoints cannot be checked, so they count

    def sha256(self, uri: str, *, max_bytes: int) -> str | None:
        return None
