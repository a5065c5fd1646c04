"""The executor port: how the control loop starts, stops, watches and re-adopts step processes.

Implemented by `adapters.local_executor` (processes, optionally inside docker/podman) and, later,
by the Argo executor. The loop owns every decision; an executor only carries out orders and
reports what happened, with errors classified at its edge (`ExecutorError.temporary`).
Must not: touch the store, decide retries, or read configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


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
    """Which OS process runs an attempt: a pid plus its start time, so a re-used pid is never mistaken."""

    pid: int
    started_at: float


@dataclass(frozen=True, slots=True)
class AttemptExit:
    attempt_id: int
    exit_code: int | None  # None when the process was killed by a signal
    signal: int | None
    ended_at: float
    killed_at_deadline: bool = False  # we sent SIGKILL because the grace deadline passed
    #: Set when the attempt ended because the machinery failed, not the step (a container engine's
    #: exit 125): the reason. Such an exit uses no retry (`policy.outcomes.classify_exit`).
    infrastructure: str | None = None
    #: `ended_at` is another process's wall-clock time (a shim's exit record), not control
    #: time: the loop converts it with `Clock.wall()`/`Clock.now()` and clamps it.
    wall_clock: bool = False


@dataclass(frozen=True, slots=True)
class AdoptRequest:
    """A RUNNING/STOPPING attempt found in the store when the control plane starts."""

    attempt_id: int
    work_dir: str
    notice_path: str
    identity: ProcessIdentity | None  # None if the crash came before the pid was recorded
    stop_deadline: float | None  # set if notice had been given


class AdoptOutcome(StrEnum):
    ADOPTED = "ADOPTED"  # still the same process: watched again from now on
    EXITED = "EXITED"  # finished while we were down; `exit` holds its recorded status
    LOST = "LOST"  # gone without a recorded status (or a different process now has its pid)


@dataclass(frozen=True, slots=True)
class AdoptResult:
    outcome: AdoptOutcome
    exit: AttemptExit | None = None
    identity: ProcessIdentity | None = None


class Executor(Protocol):
    def launch(self, request: LaunchRequest, now: float) -> ProcessIdentity:
        """Start the attempt; return once the process exists. Raises ExecutorError."""
        ...

    def notify_stop(self, attempt_id: int, deadline: float, now: float) -> None:
        """Give notice: write the notice file (with the deadline) and SIGTERM the process group.
        The executor SIGKILLs the group at `deadline` during a later `poll`."""
        ...

    def poll(self, now: float) -> list[AttemptExit]:
        """Report attempts that have exited and whose exit is not yet acknowledged (`ack_exit`):
        an exit is reported again at every poll until the store has it, so a store outage
        cannot lose it. Kills attempts past their deadline."""
        ...

    def ack_exit(self, attempt_id: int) -> None:
        """The store has recorded this attempt's exit: stop reporting it (unknown ids: no-op)."""
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
