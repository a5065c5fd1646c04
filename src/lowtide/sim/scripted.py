"""Scripted ports: the caller decides when things happen (tests and hand-written scenarios).

Role: in-memory implementations of the ports of docs/architecture.md §5 that do nothing on their
own. `FakeExecutor` (`control.executor_port.Executor`) launches instantly, running at once, or
(`pending_launches`) pending until the caller says it runs (`start(attempt_id)`, like a pod whose
image is pulled); an attempt ends when the caller says so (`finish(attempt_id, exit_code)`, or
`end(...)` with an `ExitReason` and words, as a cluster executor reports an OOMKill or an
eviction), reported at the next `poll`, and a stop past its deadline is a kill, as with the real
executor; a pending attempt given notice is withdrawn at once (an exit without a code).
`FakeServiceManager` (`ServiceManager`): a
started or woken replica is healthy at the next poll unless the caller marks it `broken`; parking
completes at the next poll. `FakeMetrics` (`MetricsSource`) reports the `concurrency` the caller
set on every replica, or stale signals. `MemoryArtifacts` (`ArtifactPort`) reads `files[uri]`.
Contrast `sim.ports`, whose ports follow a model (work, restart and park times, a load curve)
and say when their next event is due.
Neighbours: `sim.harness.LoopHarness` builds the production loop over them; the tests drive it.
Must not: decide anything the loop decides, read the wall clock, or import real adapters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from lowtide.control.executor_port import (
    AdoptOutcome,
    AdoptRequest,
    AdoptResult,
    AttemptExit,
    AttemptHandle,
    AttemptStarted,
    ExitReason,
    LaunchRequest,
    PollReport,
)
from lowtide.control.inference_ports import ReplicaEvent, ReplicaLaunch
from lowtide.control.ports import PathStat
from lowtide.domain.metrics import ReplicaSignals, ServiceSignals
from lowtide.domain.services import ParkMode

#: Exit signal of an attempt killed at its stop deadline.
_SIGKILL = 9


@dataclass
class FakeProcess:
    request: LaunchRequest
    started_at: float
    deadline: float | None = None
    noticed_at: float | None = None
    running: bool = True


@dataclass
class FakeExecutor:
    """The executor port in memory: `launched` and `notices` record what the loop ordered."""

    running: dict[int, FakeProcess] = field(default_factory=dict)
    pending_exits: dict[int, int] = field(default_factory=dict)
    launched: list[LaunchRequest] = field(default_factory=list)
    notices: list[tuple[int, float]] = field(default_factory=list)
    #: Exits reported but not acknowledged yet: reported again at every poll (the port's rule).
    unacked: dict[int, AttemptExit] = field(default_factory=dict)
    #: Launch attempts PENDING (not running) until `start` says they run.
    pending_launches: bool = False
    starts: list[AttemptStarted] = field(default_factory=list)
    ended_jobs: list[str] = field(default_factory=list)
    scripted_ends: dict[int, AttemptExit] = field(default_factory=dict)

    def start(self, attempt_id: int, at: float) -> None:
        """A pending attempt begins to run at `at`; the next poll reports it."""
        proc = self.running[attempt_id]
        if not proc.running:
            proc.running = True
            self.starts.append(AttemptStarted(attempt_id, at))

    def end(
        self,
        attempt_id: int,
        at: float,
        reason: ExitReason,
        *,
        exit_code: int | None = None,
        detail: str | None = None,
    ) -> None:
        """The attempt ends for `reason` (an OOMKill, an eviction, an image that cannot be
        pulled); the next poll reports it."""
        if attempt_id in self.running:
            self.scripted_ends[attempt_id] = AttemptExit(
                attempt_id, exit_code, None, at, reason=reason, detail=detail
            )

    def launch(self, request: LaunchRequest, now: float) -> AttemptHandle:
        self.running[request.attempt_id] = FakeProcess(request, now)
        self.launched.append(request)
        running = not self.pending_launches
        self.running[request.attempt_id].running = running
        return AttemptHandle(f"fake/{request.attempt_id}", now, now if running else None)

    def notify_stop(self, attempt_id: int, deadline: float, now: float, *, reason: str | None = None) -> None:
        if attempt_id in self.unacked:
            return  # ended already; its exit waits for the store
        proc = self.running[attempt_id]
        if proc.deadline is None:
            proc.deadline, proc.noticed_at = deadline, now
            self.notices.append((attempt_id, now))
            if not proc.running:  # nothing runs yet: withdrawn at once, as a deleted pending pod
                self.scripted_ends[attempt_id] = AttemptExit(
                    attempt_id, None, None, now, reason=ExitReason.DELETED, detail="withdrawn while pending"
                )

    def finish(self, attempt_id: int, exit_code: int) -> None:
        """The process exits with `exit_code`; the next poll reports it."""
        if attempt_id in self.running:
            self.pending_exits[attempt_id] = exit_code

    def poll(self, now: float) -> PollReport:
        started, self.starts = tuple(self.starts), []
        for attempt_id, proc in list(self.running.items()):
            if attempt_id in self.scripted_ends:
                self.unacked[attempt_id] = self.scripted_ends.pop(attempt_id)
                del self.running[attempt_id]
            elif attempt_id in self.pending_exits:
                code = self.pending_exits.pop(attempt_id)
                self.unacked[attempt_id] = AttemptExit(attempt_id, code, None, now)
                del self.running[attempt_id]
            elif proc.deadline is not None and now >= proc.deadline:
                killed = AttemptExit(attempt_id, None, _SIGKILL, now, killed_at_deadline=True)
                self.unacked[attempt_id] = killed
                del self.running[attempt_id]
        return PollReport(exits=tuple(self.unacked.values()), started=started)

    def ack_exit(self, attempt_id: int) -> None:
        self.unacked.pop(attempt_id, None)

    def end_job(self, job_id: str, now: float) -> None:
        """Recorded in `ended_jobs` (in order, repeats included)."""
        self.ended_jobs.append(job_id)

    def adopt(self, request: AdoptRequest, now: float) -> AdoptResult:
        if request.attempt_id in self.running:
            return AdoptResult(AdoptOutcome.ADOPTED)
        return AdoptResult(AdoptOutcome.LOST)

    def reap_orphans(self, known_attempt_ids: set[int]) -> list[int]:
        orphans = [a for a in self.running if a not in known_attempt_ids]
        for a in orphans:
            del self.running[a]
        return orphans

    def close(self) -> None:
        pass


class MemoryArtifacts:
    """The artifact port over a dict: `files[uri] = text`. A path under which no file lies is
    "unknown" (checkpoints reported without files count as valid) unless `strict`: then it is
    missing."""

    def __init__(self, *, strict: bool = False) -> None:
        self.files: dict[str, str] = {}
        self.strict = strict

    def ensure_dir(self, uri: str) -> None:
        pass

    def read_text(self, uri: str, *, max_bytes: int) -> str | None:
        text = self.files.get(uri)
        if text is not None and len(text.encode()) > max_bytes:
            raise ValueError("too large")
        return text

    def stat(self, uri: str) -> PathStat | None:
        if uri in self.files:
            return PathStat("file", len(self.files[uri].encode()))
        if any(k.startswith(uri.rstrip("/") + "/") for k in self.files):
            return PathStat("dir")
        return None if self.strict else PathStat("unknown")

    def sha256(self, uri: str, *, max_bytes: int) -> str | None:
        data = self.files.get(uri)
        if data is None or len(data.encode()) > max_bytes:
            return None
        return hashlib.sha256(data.encode()).hexdigest()


@dataclass
class FakeServiceManager:
    """Replicas as the caller says: a started or woken replica is healthy at the next poll unless
    it is in `broken`; parking completes at the next poll."""

    started: list[str] = field(default_factory=list)
    broken: set[str] = field(default_factory=set)
    running: dict[str, str] = field(default_factory=dict)  # id -> phase: starting|healthy|parking-*|asleep

    def start(self, launch: ReplicaLaunch, now: float) -> None:
        self.started.append(launch.replica_id)
        self.running[launch.replica_id] = "starting"

    def park(self, replica_id: str, mode: ParkMode, now: float) -> None:
        self.running[replica_id] = f"parking-{mode}"

    def unpark(self, replica_id: str, now: float) -> None:
        self.running[replica_id] = "starting"

    def poll(self, now: float) -> list[ReplicaEvent]:
        events = []
        for rid, phase in list(self.running.items()):
            if phase == "starting":
                if rid in self.broken:
                    events.append(ReplicaEvent(rid, "failed", now, "never became healthy"))
                    del self.running[rid]
                else:
                    events.append(ReplicaEvent(rid, "healthy", now))
                    self.running[rid] = "healthy"
            elif phase == "parking-sleep":
                events.append(ReplicaEvent(rid, "asleep", now))
                self.running[rid] = "asleep"
            elif phase == "parking-stop":
                events.append(ReplicaEvent(rid, "stopped", now))
                del self.running[rid]
        return events

    def url(self, replica_id: str) -> str | None:
        return f"http://fake/{replica_id}" if replica_id in self.running else None

    def adopt(self, replica_id: str, launch: ReplicaLaunch, now: float) -> bool:
        return replica_id in self.running

    def reap_orphans(self, known_ids: set[str]) -> list[str]:
        return []

    def close(self) -> None:
        pass


@dataclass
class FakeMetrics:
    """Signals as the caller sets them: `concurrency` running requests per replica, or stale."""

    concurrency: float = 0.0
    stale: bool = False

    def collect(self, service: str, replicas: Mapping[str, str], now: float) -> ServiceSignals:
        return ServiceSignals(
            service=service,
            at=now,
            replicas=tuple(
                ReplicaSignals(
                    replica=rid,
                    at=now,
                    running=self.concurrency,
                    waiting=0.0,
                    stale=self.stale,
                    stale_reason="test says stale" if self.stale else "",
                )
                for rid in replicas
            ),
        )
