"""The local executor: runs step attempts as processes on this machine (optionally in containers).

Implements `control.executor_port.Executor`. Each attempt runs under `adapters.step_shim` in its
own session and process group, with stdout and stderr appended to the attempt's log; stopping is
cooperative: `notify_stop` writes the notice file and SIGTERMs the group, and the first `poll` at or
after the deadline SIGKILLs it. The shim records the exit status in ``<work_dir>/exit_status.json``
and the executor writes ``<work_dir>/shim.json`` (pid and start time), so a control plane that
crashed can `adopt` running attempts and learn how finished ones ended.

With a `container.ContainerRuntime`, the shim runs the docker/podman client instead of the
command; SIGTERM to the client is proxied to the container, but a SIGKILLed client leaves the
container running, so the deadline also runs ``<runtime> kill <name>``.

When an attempt ends, whatever it left running is killed (it would keep holding the GPUs): its
process group, and every process whose environment carries the attempt's tag (`TAG_ENV`), which
also finds descendants that left the group or outlived a dead shim.

Safety rules: a group is only signalled while its leader is verifiably our shim (an unreaped child
of ours, or pid and start time matching); single processes only by our tag; another installation's
processes are never touched. Every method takes `now` and none sleeps; `runtime kill` helpers are
started and reaped by later polls. Not thread-safe: the control loop calls it from one thread.
With an `adapters.exit_watch.ExitWatcher` the loop hears of a shim's end at once (then polls).
An exit is reported at every `poll` until the loop acknowledges it (`ack_exit`, once the store
has it), so a store outage cannot lose it (docs/architecture.md §4.4); its `ended_at` is the
shim's wall-clock time (`AttemptExit.wall_clock`). A launch that fails in lowtide's own
directories, log or shim (an OSError) or for want of the container engine is an infrastructure
failure (`ExecutorError.infrastructure`), never the step's.

The process mechanics (shim command line, pid + start time identity, group signalling, tag
sweeps, atomic records) are shared with `adapters.local_services` through `adapters.supervision`.

Isolation (docs/architecture.md §6.4, `adapters.step_identity`): a step's environment is built
from nothing (allowlist + contract + HOME/USER/LOGNAME/TMPDIR + tag), never lowtide's own. With
``LaunchRequest.run_as`` (lowtide is root) the executor first makes the attempt's work dir (cwd,
TMPDIR, exit status) and the job's local artifact dir private to the job's uid (0700; their
shared parents 0711), then starts the shim as that uid and group with no supplementary groups and
umask 077; the log stays lowtide's, opened here and inherited. Container steps keep the client
as lowtide's user (it needs the engine) and run the container as the job's uid (``--user``).
Files lowtide writes into a step's directory (notice, shim record) never follow a symlink the
step planted. A container attempt whose client exits 125 (the engine failed, not the step)
reports ``AttemptExit.infrastructure`` with the client's last log line.

Must not: decide retries or deadlines, touch the store, read configuration.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

import psutil

from lowtide.adapters.container import (
    ENGINE_CLIENT_ENV,
    ENGINE_FAILURE_EXIT,
    ContainerRuntime,
    container_command,
    container_name,
)
from lowtide.adapters.exit_watch import ExitWatcher
from lowtide.adapters.step_identity import (
    TMP_SUBDIR,
    current_user,
    is_regular_file,
    make_shared_dir,
    own_tree,
    relative_below,
    safe_write_json,
    step_environment_for,
)
from lowtide.adapters.supervision import (
    SHIM_MODULE,
    START_TIME_TOLERANCE,
    ShimProcess,
    command_problem,
    find_shim,
    identify_child,
    iter_shims,
    kill_orphan_shim,
    kill_tagged,
    live_shim_args,
    read_exit_record,
    read_shim_file,
    reap_exited,
    shim_argv,
    start_shim_as,
)
from lowtide.control.clock import OFFSET_FILE_ENV, Clock
from lowtide.control.executor_port import (
    AdoptOutcome,
    AdoptRequest,
    AdoptResult,
    AttemptExit,
    AttemptHandle,
    ExecutorError,
    LaunchRequest,
    PollReport,
    ProcessIdentity,
    RunAs,
)

log = logging.getLogger(__name__)


def _as_handle(identity: ProcessIdentity | None) -> AttemptHandle | None:
    """A local attempt's handle: its shim's pid, running since the process started."""
    return None if identity is None else identity.handle(running_at=identity.started_at)


__all__ = ["EXIT_FILE", "SHIM_FILE", "SHIM_MODULE", "START_TIME_TOLERANCE", "TAG_ENV", "LocalExecutor"]

EXIT_FILE = "exit_status.json"
SHIM_FILE = "shim.json"
# Set in every step's environment ("<instance>/<attempt id>") and inherited by its descendants,
# so what a step leaves behind can be found even after its group leader is gone or if it left the
# group (setsid). Processes are only ever killed by this tag or by a verified group leader.
TAG_ENV = "LOWTIDE_SHIM_TAG"

# Launch failures that may succeed later: the machine is short of processes, memory or fds.
_TEMPORARY_ERRNOS = frozenset(
    {errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EINTR, errno.EBUSY}
)


# Children of this process that no executor watches any more (after `close`). Kept referenced
# so they are reaped by a later poll when they exit, instead of lingering as zombies or being
# reported as "still running" when garbage-collected. Process-wide, as child processes are.
_DETACHED: list[subprocess.Popen[bytes]] = []


@dataclass(slots=True)
class _Watch(ShimProcess):
    """One attempt being watched: its shim (identity, `Popen` unless adopted, exit file) and more."""

    attempt_id: int
    notice_path: str
    container: str | None  # container name when run through a runtime
    log_path: str = ""
    deadline: float | None = None
    killed_at_deadline: bool = False


@dataclass(frozen=True, slots=True)
class _Status:
    exit_code: int | None
    signal: int | None
    ended_at: float


def _read_status(path: str) -> _Status | None:
    """The recorded exit status, or None if the file is missing or not a valid status. The step
    owns the directory: anything but a regular file (a FIFO would block us) is ignored."""
    if Path(path).is_symlink() or (Path(path).exists() and not is_regular_file(path)):
        log.warning("ignored exit file %s: not a regular file", path)
        return None
    record = read_exit_record(path, require_time=True)
    if record is None or record.ended_at is None:
        return None
    return _Status(exit_code=record.exit_code, signal=record.signal, ended_at=record.ended_at)


def _tag(instance_id: str, attempt_id: int) -> str:
    return f"{instance_id}/{attempt_id}"


def _parse_tag(tag: str) -> tuple[str, int] | None:
    instance, _, attempt = tag.rpartition("/")
    try:
        return (instance, int(attempt)) if instance else None
    except ValueError:
        return None


def _kill_tagged(tag: str) -> None:
    """SIGKILL every live process carrying `tag`: a finished attempt's leftovers."""
    for proc, _tag_value in kill_tagged(TAG_ENV, lambda value: value if value == tag else None):
        log.info("killed pid %s left behind by attempt %s", proc.pid, tag)


# Launch failures of lowtide's own directories, by what an operator must look at.
_PERMISSION_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def _classify_os_error(exc: OSError, what: str) -> ExecutorError:
    """An OSError while preparing or starting an attempt: lowtide's directories, log or shim
    failed, never the step's command (checked before), so it is an infrastructure failure."""
    temporary = exc.errno in _TEMPORARY_ERRNOS
    if exc.errno in _PERMISSION_ERRNOS:
        kind = "permissions"
    elif exc.errno in _FULL_ERRNOS:
        kind = "disk full"
    else:
        kind = "storage"
    return ExecutorError(f"{what}: {exc}", temporary=temporary, infrastructure=kind)


def _last_log_line(log_path: str, max_bytes: int = 8192) -> str:
    """The last line the attempt's command wrote (lowtide's own ``=== lowtide`` lines skipped),
    printable and at most 300 characters; "" when there is none."""
    try:
        with Path(log_path).open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    for line in reversed(tail.splitlines()):
        text = "".join(c if c.isprintable() else " " for c in line).strip()
        if text and not text.startswith("=== lowtide"):
            return text[:300]
    return ""


def _write_record(path: Path, payload: dict[str, object], who: str) -> None:
    """The shim file, written without following a link the step may have planted (an aid to a
    later adoption only: failing to write it is logged)."""
    try:
        safe_write_json(path, payload)
    except OSError as exc:
        log.warning("%s: cannot write %s: %s", who, path.name, exc)


def _prepare_private_dirs(req: LaunchRequest, run_as: RunAs) -> None:
    """Make the attempt's work dir and the job's local artifact dir the job uid's own (0700),
    their shared parents lowtide's (0711). See `adapters.step_identity`."""
    work_dir = Path(req.work_dir)
    # <work_root>/jobs/<job>/<step>/attempt-N: the three levels above are shared.
    for shared in (work_dir.parents[2], work_dir.parents[1], work_dir.parents[0]):
        make_shared_dir(shared)
    own_tree(work_dir, [PurePosixPath(TMP_SUBDIR)], run_as)
    if req.job_dir is not None:
        job_dir = Path(req.job_dir.removeprefix("file://"))
        make_shared_dir(job_dir.parent)
        below = [rel for m in req.mounts if (rel := relative_below(m, str(job_dir))) is not None]
        own_tree(job_dir, below, run_as)


def _check_command(command: Sequence[str], env: dict[str, str], cwd: str) -> None:
    """Fail the launch now (permanently) when the command cannot be executed at all."""
    if not command:
        raise ExecutorError("empty command", temporary=False)
    problem = command_problem(command[0], env, cwd)
    if problem is not None:
        raise ExecutorError(problem, temporary=False)


class LocalExecutor:
    """Runs attempts as local process groups; see the module docstring."""

    def __init__(
        self,
        instance_id: str,
        *,
        runtime: ContainerRuntime | None = None,
        python: str = sys.executable,
        watcher: ExitWatcher | None = None,
        env_allowlist: Sequence[str] = (),
        clock: Clock | None = None,
    ) -> None:
        if not instance_id or any(c.isspace() for c in instance_id):
            raise ValueError(f"instance id must be non-empty without spaces: {instance_id!r}")
        self.instance_id = instance_id
        self._runtime = runtime
        self._python = python
        self._watched: dict[int, _Watch] = {}
        # Exits reported but not yet acknowledged (`ack_exit`): re-reported at every poll, so an
        # exit the store could not record (an outage) is never forgotten (§4.4).
        self._exited: dict[int, AttemptExit] = {}
        self._reap_later: list[subprocess.Popen[bytes]] = []  # exited shims and `runtime kill`s
        # Makes the loop poll as soon as a shim ends (its GPUs are free), not at the next tick.
        self._watcher = watcher
        self._allowlist = tuple(env_allowlist)
        self._user = current_user()
        # Converts the notice's deadline (control time) to the wall clock the step reads.
        self._clock = clock

    # -- launch ---------------------------------------------------------------------------

    def launch(self, request: LaunchRequest, now: float) -> AttemptHandle:
        if request.attempt_id in self._watched or request.attempt_id in self._exited:
            raise ExecutorError(f"attempt {request.attempt_id} is already running", temporary=False)
        req = replace(request, work_dir=str(Path(request.work_dir).absolute()))
        run_as = req.run_as
        if run_as is not None and os.geteuid() != 0:
            raise ExecutorError("running steps as another user needs lowtide to run as root", temporary=False)
        # Built from nothing: never lowtide's environment, nor its view of the GPUs.
        env = step_environment_for(
            req.env,
            gpus=req.gpus,
            allowlist=self._allowlist,
            home=req.work_dir,
            tmp_dir=str(Path(req.work_dir) / TMP_SUBDIR),
            user=run_as.user if run_as is not None else self._user,
            tag=(TAG_ENV, _tag(self.instance_id, req.attempt_id)),
            # The clock's fault-injection hook reaches the shim, so its `ended_at` jumps with ours.
            keep=(*(ENGINE_CLIENT_ENV if self._runtime is not None else ()), OFFSET_FILE_ENV),
        )
        name: str | None = None
        if self._runtime is not None:
            if not os.access(self._runtime.binary, os.X_OK):
                raise ExecutorError(
                    f"runtime {self._runtime.engine!r} executable {self._runtime.binary!r} is missing",
                    temporary=False,
                    infrastructure="runtime",
                )
            name = container_name(self.instance_id, req.attempt_id)
            try:
                default_user = (os.geteuid(), os.getegid()) if os.geteuid() != 0 else None
                command = container_command(self._runtime, req, name=name, default_user=default_user)
            except ValueError as exc:
                raise ExecutorError(str(exc), temporary=False) from exc
        else:
            command = list(req.command)
            _check_command(command, env, req.work_dir)

        work_dir = Path(req.work_dir)
        exit_file = str(work_dir / EXIT_FILE)
        argv = shim_argv(self._python, self.instance_id, req.attempt_id, exit_file, command)
        # The shim runs as the job's uid for a process step; a container client stays ours.
        shim_user = run_as if run_as is not None and self._runtime is None else None
        try:
            if run_as is not None:
                _prepare_private_dirs(req, run_as)
            else:
                (work_dir / TMP_SUBDIR).mkdir(parents=True, exist_ok=True)
            for directory in {work_dir, Path(req.log_path).parent, Path(req.notice_path).parent}:
                directory.mkdir(parents=True, exist_ok=True)
            # Leftovers of an earlier launch of this attempt would be read as this run's.
            for stale in (exit_file, req.notice_path, work_dir / SHIM_FILE):
                Path(stale).unlink(missing_ok=True)
            stamp = datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds")
            header = (
                f"=== lowtide {stamp}: job {req.job_id} step {req.step} attempt {req.attempt} "
                f"(id {req.attempt_id}) on {req.node} gpus [{','.join(map(str, req.gpus))}]: "
                f"{shlex.join(command)}\n"
            )
            popen = start_shim_as(
                argv,
                cwd=req.work_dir,
                env=env,
                log_path=req.log_path,
                header=header,
                user=shim_user.uid if shim_user is not None else None,
                group=shim_user.gid if shim_user is not None else None,
                umask=0o077 if shim_user is not None else -1,
            )
        except OSError as exc:
            raise _classify_os_error(exc, f"cannot start attempt {req.attempt_id}") from exc

        try:
            identity = identify_child(popen, self._reap_later)
        except psutil.Error as exc:
            raise ExecutorError(f"cannot read start time of pid {popen.pid}: {exc}", temporary=True) from exc
        _write_record(
            work_dir / SHIM_FILE,
            {
                "pid": identity.pid,
                "started_at": identity.started_at,
                "instance": self.instance_id,
                "attempt_id": req.attempt_id,
                "container": name,
            },
            who=f"attempt {req.attempt_id}",
        )
        self._watched[req.attempt_id] = _Watch(
            attempt_id=req.attempt_id,
            identity=identity,
            exit_file=exit_file,
            notice_path=req.notice_path,
            popen=popen,
            container=name,
            log_path=req.log_path,
        )
        self._watch_exit(req.attempt_id, identity)
        return identity.handle(running_at=now)  # a local process runs from its launch

    # -- stop -----------------------------------------------------------------------------

    def notify_stop(self, attempt_id: int, deadline: float, now: float, *, reason: str | None = None) -> None:
        watch = self._watched.get(attempt_id)
        if watch is None:
            if attempt_id in self._exited:
                return  # it has ended already; the exit is waiting for the store
            raise ExecutorError(f"attempt {attempt_id} is not watched by this executor", temporary=False)
        first = watch.deadline is None
        if not first and watch.deadline is not None and deadline >= watch.deadline:
            return  # idempotent: a later or equal deadline changes nothing
        watch.deadline = deadline
        # The step compares with its own wall clock: control time + (wall − control) now, so a
        # wall clock that jumped before the notice does not hide or shorten the grace (§4.3).
        skew = self._clock.wall() - self._clock.now() if self._clock is not None else 0.0
        notice = {
            "deadline": deadline + skew,
            "deadline_iso": datetime.fromtimestamp(deadline + skew, UTC).isoformat(),
            "grace_seconds": max(0.0, deadline - now),
            "reason": reason or "stop requested",
            "given_at": now + skew,
        }
        try:
            safe_write_json(watch.notice_path, notice)  # the step may own the directory
        except OSError as exc:
            # SIGTERM is the notice that matters; the file only carries the deadline.
            log.warning("attempt %s: cannot write notice %s: %s", attempt_id, watch.notice_path, exc)
        if first:
            self._signal_group(watch, signal.SIGTERM)

    def _signal_group(self, watch: _Watch, sig: signal.Signals) -> None:
        try:
            signalled = watch.signal_group(sig)
        except PermissionError as exc:
            raise ExecutorError(f"cannot signal attempt {watch.attempt_id}: {exc}", temporary=False) from exc
        if not signalled:
            log.info(
                "attempt %s: group leader %s is gone; not signalled", watch.attempt_id, watch.identity.pid
            )

    def _sweep(self, watch: _Watch) -> None:
        """Kill what a finished attempt left behind: it would keep holding the GPUs."""
        with contextlib.suppress(ExecutorError):
            self._signal_group(watch, signal.SIGKILL)
        _kill_tagged(_tag(self.instance_id, watch.attempt_id))

    def _kill_container(self, attempt_id: int, container: str | None) -> None:
        if self._runtime is None or container is None:
            return
        try:
            helper = subprocess.Popen(
                [self._runtime.binary, "kill", container],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            log.warning("attempt %s: cannot run %s kill: %s", attempt_id, self._runtime.engine, exc)
            return
        self._reap_later.append(helper)

    # -- watch ----------------------------------------------------------------------------

    def poll(self, now: float) -> PollReport:
        """New exits join those not yet acknowledged; all are reported (see `ack_exit`)."""
        reap_exited(self._reap_later)
        reap_exited(_DETACHED)
        exits: list[AttemptExit] = list(self._exited.values())
        for watch in list(self._watched.values()):
            try:
                result = self._poll_one(watch, now)
            except Exception:
                # One bad attempt must not blind the loop to the others.
                log.exception("attempt %s: poll failed", watch.attempt_id)
                continue
            if result is not None:
                del self._watched[watch.attempt_id]
                if self._watcher is not None:
                    self._watcher.forget(("attempt", watch.attempt_id))
                self._exited[watch.attempt_id] = result
                exits.append(result)
        return PollReport(exits=tuple(exits))  # nothing is ever pending: a process runs at once

    def ack_exit(self, attempt_id: int) -> None:
        self._exited.pop(attempt_id, None)

    def end_job(self, job_id: str, now: float) -> None:
        """Nothing is kept per job: a local attempt is its process, stopped by `notify_stop`."""

    def pending_exits(self) -> set[int]:
        """Attempt ids whose exit is reported but not yet acknowledged (diagnostics, tests)."""
        return set(self._exited)

    def _watch_exit(self, attempt_id: int, identity: ProcessIdentity) -> None:
        if self._watcher is not None:
            self._watcher.watch(("attempt", attempt_id), identity)

    def _poll_one(self, watch: _Watch, now: float) -> AttemptExit | None:
        status = _read_status(watch.exit_file)
        if status is None:
            if watch.alive():
                if watch.deadline is not None and now >= watch.deadline and not watch.killed_at_deadline:
                    log.info("attempt %s: grace deadline passed; killing its group", watch.attempt_id)
                    self._signal_group(watch, signal.SIGKILL)
                    self._kill_container(watch.attempt_id, watch.container)
                    watch.killed_at_deadline = True
                return None
            # Gone: the shim may have written its status just before exiting.
            status = _read_status(watch.exit_file)
        # Finished. Sweep leftovers while an unreaped shim still reserves the group id, then reap.
        self._sweep(watch)
        if status is None and not watch.killed_at_deadline:
            self._kill_container(watch.attempt_id, watch.container)  # the client died, maybe not it
        returncode: int | None = None
        if watch.popen is not None:
            returncode = watch.popen.poll()
            if returncode is None:
                self._reap_later.append(watch.popen)  # wrote its status, exits in a moment
        if status is not None:
            return AttemptExit(
                attempt_id=watch.attempt_id,
                exit_code=status.exit_code,
                signal=status.signal,
                ended_at=status.ended_at,
                killed_at_deadline=watch.killed_at_deadline,
                infrastructure=self._engine_failure(watch.container, status.exit_code, watch.log_path),
                wall_clock=True,
            )
        sig: int | None = -returncode if returncode is not None and returncode < 0 else None
        if sig is None and watch.killed_at_deadline:
            sig = signal.SIGKILL  # we killed it and nobody was left to record it
        log.warning(
            "attempt %s: ended without an exit status (shim return code %s)", watch.attempt_id, returncode
        )
        return AttemptExit(
            attempt_id=watch.attempt_id,
            exit_code=None,
            signal=sig,
            ended_at=now,
            killed_at_deadline=watch.killed_at_deadline,
        )

    def _engine_failure(self, container: str | None, exit_code: int | None, log_path: str) -> str | None:
        """Why a container attempt's end is the engine's fault (exit 125), else None."""
        if self._runtime is None or container is None or exit_code != ENGINE_FAILURE_EXIT:
            return None
        said = _last_log_line(log_path) if log_path else ""
        return f"container engine failed (exit {ENGINE_FAILURE_EXIT})" + (f": {said}" if said else "")

    # -- adoption -------------------------------------------------------------------------

    def adopt(self, request: AdoptRequest, now: float) -> AdoptResult:
        """Re-attach to an attempt's shim. A local attempt runs from its launch: the handle
        found (a pid) carries `running_at` = the process's start."""
        given = ProcessIdentity.from_handle(request.handle) if request.handle is not None else None
        known = self._watched.get(request.attempt_id)
        if known is not None:
            return AdoptResult(AdoptOutcome.ADOPTED, handle=_as_handle(known.identity))
        ended = self._exited.get(request.attempt_id)
        if ended is not None:  # reported, not yet recorded: still reported until acknowledged
            return AdoptResult(AdoptOutcome.EXITED, exit=ended, handle=_as_handle(given))
        work_dir = Path(request.work_dir).absolute()
        exit_file = str(work_dir / EXIT_FILE)
        shim_info = self._read_shim_file(work_dir, request.attempt_id)
        container = shim_info[1] if shim_info is not None else None
        if container is None and self._runtime is not None:
            container = container_name(self.instance_id, request.attempt_id)

        identity = given
        if _read_status(exit_file) is None:
            if identity is not None:
                live = self._is_live_shim(identity, request.attempt_id, require_instance=False)
            else:
                identity = self._find_shim(request.attempt_id, shim_info[0] if shim_info else None)
                live = identity is not None
            if live and identity is not None:
                # Notice is written before SIGTERM: no notice file means the earlier control plane
                # died before giving it, so give it now (a step sees SIGTERM once per notice file).
                resend = request.stop_deadline is not None and not Path(request.notice_path).exists()
                watch = _Watch(
                    attempt_id=request.attempt_id,
                    identity=identity,
                    exit_file=exit_file,
                    notice_path=request.notice_path,
                    popen=None,
                    container=container,
                    log_path=str(work_dir / "log"),
                    deadline=None if resend else request.stop_deadline,
                )
                self._watched[request.attempt_id] = watch
                self._watch_exit(request.attempt_id, identity)
                if resend and request.stop_deadline is not None:
                    self.notify_stop(request.attempt_id, request.stop_deadline, now)
                return AdoptResult(AdoptOutcome.ADOPTED, handle=_as_handle(identity))

        # Not running: it finished while we were down, or vanished. Its leftovers must not keep
        # the GPUs; only processes carrying its tag are touched (never whoever has the pid now).
        _kill_tagged(_tag(self.instance_id, request.attempt_id))
        status = _read_status(exit_file)  # re-read: it may have been written since the first look
        known_identity = given or (shim_info[0] if shim_info else None)
        if status is None:
            self._kill_container(request.attempt_id, container)  # its client is gone, maybe not it
            return AdoptResult(AdoptOutcome.LOST, handle=_as_handle(known_identity))
        ended = AttemptExit(
            request.attempt_id,
            status.exit_code,
            status.signal,
            status.ended_at,
            infrastructure=self._engine_failure(container, status.exit_code, str(work_dir / "log")),
            wall_clock=True,
        )
        self._exited[request.attempt_id] = ended  # reported by `poll` too until acknowledged
        return AdoptResult(AdoptOutcome.EXITED, exit=ended, handle=_as_handle(known_identity))

    def _is_live_shim(self, identity: ProcessIdentity, attempt_id: int, *, require_instance: bool) -> bool:
        parsed = live_shim_args(identity)
        if parsed is None or parsed[1] != attempt_id:
            return False
        return not require_instance or parsed[0] == self.instance_id

    def _read_shim_file(self, work_dir: Path, attempt_id: int) -> tuple[ProcessIdentity, str | None] | None:
        found = read_shim_file(work_dir / SHIM_FILE, {"instance": self.instance_id, "attempt_id": attempt_id})
        if found is None:
            return None
        identity, data = found
        container = data.get("container")
        return identity, container if isinstance(container, str) else None

    def _find_shim(self, attempt_id: int, hint: ProcessIdentity | None) -> ProcessIdentity | None:
        if hint is not None and self._is_live_shim(hint, attempt_id, require_instance=True):
            return hint
        return find_shim(lambda _proc, instance, found: instance == self.instance_id and found == attempt_id)

    # -- housekeeping ---------------------------------------------------------------------

    def reap_orphans(self, known_attempt_ids: set[int]) -> list[int]:
        def orphan(tag: str) -> int | None:
            parsed = _parse_tag(tag)
            if parsed is None or parsed[0] != self.instance_id or parsed[1] in known_attempt_ids:
                return None
            return parsed[1]

        killed: set[int] = set()
        for proc, instance, attempt_id in iter_shims():
            if instance != self.instance_id or attempt_id in known_attempt_ids:
                continue
            if not kill_orphan_shim(proc, f"shim of attempt {attempt_id}"):
                continue
            log.info("killed orphan attempt %s (shim pid %s)", attempt_id, proc.pid)
            killed.add(attempt_id)
        # What outlived its shim (or left its group) still carries the attempt's tag.
        for proc, attempt_id in kill_tagged(TAG_ENV, orphan):
            log.info("killed pid %s left by orphan attempt %s", proc.pid, attempt_id)
            killed.add(attempt_id)
        if self._runtime is not None:
            for attempt_id in killed:
                self._kill_container(attempt_id, container_name(self.instance_id, attempt_id))
        return sorted(killed)

    def close(self) -> None:
        """Stop watching; processes keep running for a later control plane to adopt."""
        _DETACHED.extend(w.popen for w in self._watched.values() if w.popen is not None)
        _DETACHED.extend(self._reap_later)
        if self._watcher is not None:
            for attempt_id in self._watched:
                self._watcher.forget(("attempt", attempt_id))
        self._watched.clear()
        self._exited.clear()  # their exit files stay: the next control plane adopts them as EXITED
        self._reap_later = []
        reap_exited(_DETACHED)

    def watched(self) -> set[int]:
        """Attempt ids currently watched (for diagnostics and tests)."""
        return set(self._watched)
