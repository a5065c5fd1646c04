"""The executor port: how the control loop starts, stops, watches and re-adopts step attempts.

Implemented by `adapters.local_executor` (processes, optionally inside docker/podman), by the
simulator's `sim.ports.SimExecutor`, and (cluster mode) by an executor of pods. The loop owns every
decision; an executor only carries out orders and reports what happened, with errors classified at
its edge (`ExecutorError.temporary`, `ExitReason`).

Nothing here assumes a local process (docs/architecture.md §5): an attempt is named by an opaque
`AttemptHandle` (a pid for the local executor, a pod's uid elsewhere); its life is pending →
running → exited, where *pending* means the executor holds it but it does not run yet (an image
being pulled, a pod waiting for its node): its GPUs are booked, its time is not run time. An exit
says why it happened (`ExitReason`) as well as its code. The paths in `LaunchRequest` are the
local executor's: a remote executor gives the step its own work dir and notice file and ignores them.
Must not: touch the store, decide retries, or read configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from lowtide.domain.exit_reasons import ExitReason

__all__ = ["ExitReason"]  # re-exported: executors name reasons through the port

#: Why the loop gives notice (`Executor.notify_stop`'s `reason`): its GPUs are reclaimed (a
#: preemption, `control.reclaimer`), its job was cancelled, or its step's walltime is spent. An
#: executor may say so to the step (the local notice file's `reason`) or to the cluster (the Argo
#: executor's Event reason); any other text is passed through as words.
NOTICE_PREEMPTED = "GPUs reclaimed"
NOTICE_CANCELLED = "job cancelled"
NOTICE_WALLTIME = "walltime limit reached"


class ExecutorError(Exception):
    """A launch or stop that did not happen. `temporary` errors may succeed if retried later.

    `infrastructure` names the part of the machinery that failed when it is not the step's
    fault ("storage", "permissions", "disk full", "runtime", "secrets", "store"): such a launch
    failure uses no retry of the step, backs off and raises an operator alert (§4.4)."""

    def __init__(self, message: str, *, temporary: bool, infrastructure: str | None = None) -> None:
        super().__init__(message)
        self.temporary = temporary
        self.infrastructure = infrastructure


@dataclass(frozen=True, slots=True)
class RunAs:
    """The Unix identity an attempt runs as (docs/architecture.md §6.4): one uid per job, the
    operator's step user's primary group, no supplementary groups."""

    uid: int
    gid: int
    user: str  # the configured step user's name (USER/LOGNAME of the step)


#: How many job uids one installation may hand out above `JobUsers.uid_base` (config checks the range).
JOB_UID_SPAN = 2**28


@dataclass(frozen=True, slots=True)
class JobUsers:
    """`executor.run_as` resolved once at start-up: uid = `uid_base` + the job's serial."""

    user: str
    gid: int
    uid_base: int

    def for_job(self, serial: int) -> RunAs:
        """The identity of a job's steps. Raises ValueError when the serial is out of range."""
        if not 0 <= serial < JOB_UID_SPAN:
            raise ValueError(f"job serial {serial} is outside 0..{JOB_UID_SPAN - 1}; no uid left for it")
        return RunAs(uid=self.uid_base + serial, gid=self.gid, user=self.user)


@dataclass(frozen=True, slots=True)
class LaunchRequest:
    attempt_id: int
    job_id: str
    step: str
    attempt: int  # 1-based attempt number of this step
    node: str
    gpus: tuple[int, ...]
    command: tuple[str, ...]
    image: str | None
    env: Mapping[str, str]  # the step contract (docs/architecture.md §6.2), computed by control.contract
    work_dir: str  # local directory: the process's cwd; its log, notice and exit status live here
    log_path: str  # local file receiving stdout and stderr
    notice_path: str  # local file written when notice is given (LOWTIDE_NOTICE_FILE)
    mounts: tuple[str, ...] = ()  # local paths a container must see at the same path
    #: Run as this identity (None: as the control plane's user); see docs/architecture.md §6.4.
    run_as: RunAs | None = None
    #: The job's local artifact dir (outputs, checkpoints), private to `run_as`; None if remote.
    job_dir: str | None = None


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """A local OS process: a pid plus its start time, so a re-used pid is never mistaken. What
    the local executor keeps in an `AttemptHandle` (`ref` = the pid) and the local service
    manager and gateway supervisor use for their processes."""

    pid: int
    started_at: float

    def handle(self, running_at: float | None) -> AttemptHandle:
        return AttemptHandle(str(self.pid), self.started_at, running_at)

    @classmethod
    def from_handle(cls, handle: AttemptHandle) -> ProcessIdentity | None:
        """The process a handle names; None when it names something else (not a pid)."""
        if not handle.ref.isdigit():
            return None
        return cls(int(handle.ref), handle.started_at)


@dataclass(frozen=True, slots=True)
class AttemptHandle:
    """What runs an attempt, as its executor names it: `ref` is opaque to everyone else (the local
    executor's pid; a pod's namespace/name/uid), `started_at` when the executor created it (with
    `ref`, so a re-used pid or name is never mistaken), `running_at` when it began to run (None:
    still pending; the executor reports the start later through `PollReport.started`)."""

    ref: str
    started_at: float
    running_at: float | None = None


@dataclass(frozen=True, slots=True)
class AttemptExit:
    attempt_id: int
    exit_code: int | None  # None when the process was killed by a signal (or never ran)
    signal: int | None
    ended_at: float
    killed_at_deadline: bool = False  # we sent SIGKILL because the grace deadline passed
    #: Set when the attempt ended because the machinery failed, not the step (a container engine's
    #: exit 125): the reason. Such an exit uses no retry (`policy.outcomes.classify_exit`).
    infrastructure: str | None = None
    #: `ended_at` is another process's wall-clock time (a shim's exit record), not control
    #: time: the loop converts it with `Clock.wall()`/`Clock.now()` and clamps it.
    wall_clock: bool = False
    #: Why it ended; None: the executor could not tell (read as EXITED or SIGNALLED from the code).
    reason: ExitReason | None = None
    #: The executor's own words (a pod's status message, "Unschedulable: 0/3 nodes are available"),
    #: kept with the attempt for the user.
    detail: str | None = None
    #: What ran it, when known only now and not reported by a start (`AttemptStarted.handle`): a
    #: pod that ran and ended between two polls. The loop records it with the exit, so the log
    #: port finds the pod. None: the handle the store has stands.
    handle: AttemptHandle | None = None

    def effective_reason(self) -> ExitReason:
        """`reason`, or what the code and signal say when the executor gave none."""
        if self.reason is not None:
            return self.reason
        if self.infrastructure is not None:
            return ExitReason.INFRASTRUCTURE
        if self.killed_at_deadline:
            return ExitReason.DEADLINE
        return ExitReason.SIGNALLED if self.exit_code is None else ExitReason.EXITED


@dataclass(frozen=True, slots=True)
class AttemptStarted:
    """A pending attempt began to run at `at` (its image pulled, its pod running). `handle`: what
    runs it, when that is known only now (a pod claimed after `launch` returned a pending handle):
    the loop records it, so the log port and a restart find the pod."""

    attempt_id: int
    at: float
    handle: AttemptHandle | None = None


@dataclass(frozen=True, slots=True)
class PollReport:
    """What one `poll` saw: attempts that began to run, and exits not yet acknowledged."""

    exits: tuple[AttemptExit, ...] = ()
    started: tuple[AttemptStarted, ...] = ()


@dataclass(frozen=True, slots=True)
class AdoptRequest:
    """A RUNNING/STOPPING attempt found in the store when the control plane starts."""

    attempt_id: int
    work_dir: str
    notice_path: str
    handle: AttemptHandle | None  # None if the crash came before the handle was recorded
    stop_deadline: float | None  # set if notice had been given


class AdoptOutcome(StrEnum):
    ADOPTED = "ADOPTED"  # still the same process: watched again from now on
    EXITED = "EXITED"  # finished while we were down; `exit` holds its recorded status
    LOST = "LOST"  # gone without a recorded status (or a different process now has its pid)


@dataclass(frozen=True, slots=True)
class AdoptResult:
    outcome: AdoptOutcome
    exit: AttemptExit | None = None
    handle: AttemptHandle | None = None  # found again when the store had none (or it began to run)


class Executor(Protocol):
    def launch(self, request: LaunchRequest, now: float) -> AttemptHandle:
        """Start the attempt; return once the executor holds it (running, or pending with
        `running_at` None). Raises ExecutorError."""
        ...

    def notify_stop(self, attempt_id: int, deadline: float, now: float, *, reason: str | None = None) -> None:
        """Give notice: tell the step its deadline (locally: the notice file and SIGTERM to its
        process group; a pod: a graceful delete). The executor kills it at `deadline` during a
        later `poll`. A pending attempt is simply withdrawn (it reports an exit without a code).
        `reason`: why (`NOTICE_PREEMPTED`, `NOTICE_CANCELLED`, `NOTICE_WALLTIME`; None: not said),
        for the executor to pass on; it changes nothing in how the attempt is stopped."""
        ...

    def poll(self, now: float) -> PollReport:
        """Report pending attempts that began to run since the last poll (once each), and
        attempts that have exited and whose exit is not yet acknowledged (`ack_exit`): an exit is
        reported again at every poll until the store has it, so a store outage cannot lose it.
        Kills attempts past their deadline."""
        ...

    def ack_exit(self, attempt_id: int) -> None:
        """The store has recorded this attempt's exit: stop reporting it (unknown ids: no-op)."""
        ...

    def end_job(self, job_id: str, now: float) -> None:
        """The job will start nothing more (cancelled, failed or finished): let go of what the
        executor keeps for it (a cluster executor stops the job's Workflow, so that its own retry
        machinery starts no new pod). Running attempts are stopped only by `notify_stop`.
        Idempotent; raises ExecutorError (the loop tries again at the next tick)."""
        ...

    def adopt(self, request: AdoptRequest, now: float) -> AdoptResult:
        """Re-attach to an attempt started by an earlier control-plane process."""
        ...

    def reap_orphans(self, known_attempt_ids: set[int]) -> list[int]:
        """Kill process groups this installation started for attempts it no longer knows.
        Returns the attempt ids that were killed."""
        ...

    def close(self) -> None:
        """Stop watching (processes keep running; a later control plane re-adopts them)."""
        ...
