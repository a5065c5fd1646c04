"""Process supervision under the step shim: the mechanics the two local adapters share.

Role: everything about a process run under `adapters.step_shim` that does not depend on what it
runs. Building the shim's command line and recognising it in the process table; starting it in
its own session and process group with its output appended to a log; atomic JSON records (the
shim file with pid and start time, stop notices) and reading the exit record the shim writes;
proving that a pid still names the process we started (pid + start time, `START_TIME_TOLERANCE`;
start times count from a boot time pinned once per boot, `pin_boot_time`, so that a wall clock
stepped while processes run does not make lowtide disown them);
watching a shim without reaping it and signalling its group only while its leader is verifiably
that shim; SIGKILLing the processes whose environment carries a caller's tag.

Neighbours: `adapters.local_executor` (research step attempts) and `adapters.local_services`
(inference replicas) are its only users; each keeps its own numbering, tag format, file names,
log wording and error translation. `adapters.step_shim` is the supervised program; it imports
nothing from here (it stays standard-library only), so the command line built here and the one it
parses must be kept in step by hand. Identities are `control.executor_port.ProcessIdentity`.

Must not: know about attempts, replicas or the ports' errors (callers translate `OSError` and
`psutil` errors), decide when anything starts, stops or is killed, signal a process that is not
proven ours (a verified group leader, or a caller's tag), touch the store, read configuration, or
sleep.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

from lowtide.adapters.container import CUDA_VISIBLE_DEVICES
from lowtide.control.executor_port import ProcessIdentity

log = logging.getLogger(__name__)

SHIM_MODULE = "lowtide.adapters.step_shim"
START_TIME_TOLERANCE = 0.01  # seconds; a start time is derived from boot time and jiffies
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

K = TypeVar("K")


def reap_exited(children: list[subprocess.Popen[bytes]]) -> None:
    """Reap the children that have exited and keep only the others in `children`."""
    children[:] = [p for p in children if p.poll() is None]


# -- records --------------------------------------------------------------------------------------


def atomic_write_json(path: str | Path, payload: Mapping[str, Any]) -> None:
    """Write tmp + rename, so a reader (the process, a restarted control plane) never sees half a file."""
    tmp = Path(f"{path}.tmp.{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            json.dump(payload, f)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@dataclass(frozen=True, slots=True)
class ExitRecord:
    """How the shim's command ended, as the shim recorded it."""

    exit_code: int | None
    signal: int | None
    ended_at: float | None  # None when the record holds no valid time


def read_exit_record(path: str, *, require_time: bool = False) -> ExitRecord | None:
    """The shim's exit record, or None if the file is missing or not a valid record (logged);
    with `require_time`, a record without a valid ``ended_at`` is not valid."""
    try:
        with Path(path).open(encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("unreadable exit file %s: %s", path, exc)
        return None
    fields = data if isinstance(data, dict) else {}
    code, sig, ended = fields.get("exit_code"), fields.get("signal"), fields.get("ended_at")
    # `type(x) is int` rejects bools, which JSON true/false would otherwise pass as ints.
    ended_at = float(ended) if isinstance(ended, int | float) and not isinstance(ended, bool) else None
    if (
        not isinstance(data, dict)
        or (code is not None and type(code) is not int)
        or (sig is not None and type(sig) is not int)
        or (require_time and ended_at is None)
    ):
        log.warning("invalid exit file %s: %r", path, data)
        return None
    return ExitRecord(exit_code=code, signal=sig, ended_at=ended_at)


def record_shim(path: Path, identity: ProcessIdentity, fields: Mapping[str, Any], who: str) -> None:
    """Write the shim file: pid and start time, then `fields`. Only an aid to a later adoption (the
    process runs either way), so failing to write it is logged, as ``"<who>: cannot write ..."``."""
    try:
        atomic_write_json(path, {"pid": identity.pid, "started_at": identity.started_at, **fields})
    except OSError as exc:
        log.warning("%s: cannot write %s: %s", who, path.name, exc)


def read_shim_file(path: Path, expect: Mapping[str, Any]) -> tuple[ProcessIdentity, dict[str, Any]] | None:
    """The identity a shim file records, with the whole record, when its `expect` fields match;
    None when it is missing, unreadable (logged) or another's."""
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
        if any(data.get(key) != value for key, value in expect.items()):
            return None
        identity = ProcessIdentity(pid=int(data["pid"]), started_at=float(data["started_at"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("unreadable %s: %s", path, exc)
        return None
    return identity, data


# -- starting -------------------------------------------------------------------------------------


def shim_argv(python: str, instance: str, number: int, exit_file: str, command: Sequence[str]) -> list[str]:
    """The shim's command line (``parse_shim_cmdline`` reads it back)."""
    return [
        python, "-I", "-m", SHIM_MODULE,
        "--instance", instance,
        "--attempt", str(number),
        "--exit-file", exit_file,
        "--", *command,
    ]  # fmt: skip


def child_env(extra: Mapping[str, str], gpus: Iterable[int]) -> dict[str, str]:
    """This process's environment with `extra` over it. Unless `extra` sets CUDA_VISIBLE_DEVICES
    it names `gpus`: a child never inherits the control plane's view of the GPUs."""
    env = {**os.environ, **extra}
    if CUDA_VISIBLE_DEVICES not in extra:
        env[CUDA_VISIBLE_DEVICES] = ",".join(str(i) for i in sorted(gpus))
    return env


def command_problem(exe: str, env: Mapping[str, str], cwd: str | Path) -> str | None:
    """Why `exe` cannot be executed at all from `cwd` with `env`'s PATH, or None."""
    if "/" in exe:
        path = Path(cwd, exe)  # an absolute exe replaces cwd
        if not path.is_file():
            return f"command not found: {exe}"
        if not os.access(path, os.X_OK):
            return f"command is not executable: {exe}"
    elif shutil.which(exe, path=env.get("PATH", os.defpath)) is None:
        return f"command not found on PATH: {exe}"
    return None


def start_shim(
    argv: Sequence[str], *, cwd: str | Path, env: Mapping[str, str], log_path: str, header: str
) -> subprocess.Popen[bytes]:
    """Start `argv` in its own session (it leads its process group, and gets no SIGHUP when the
    control plane dies), with `header` and then its stdout and stderr appended to `log_path`.
    Raises OSError."""
    with Path(log_path).open("ab") as logf:
        logf.write(header.encode())
        logf.flush()
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )


# -- start times --------------------------------------------------------------------------------------
#
# psutil's `create_time()` is the process's start in clock ticks since boot (/proc/PID/stat field
# 22, "starttime", proc(5)) plus the boot time of /proc/stat "btime", which Linux derives from the
# wall clock: stepping the wall clock (settimeofday, NTP, a VM restore) moves btime, and with it
# every create_time (psutil 7.2 docs: "may be affected by changes such as manual adjustments or
# time synchronization"). Identities compared that way stop matching after a step, and lowtide
# would take its own live steps and replicas for dead ones. So start times here count the ticks
# from a boot time pinned once per boot (kept in the state dir with the kernel's boot id), which
# gives the same values as create_time until the clock is stepped, and keeps them after.

_pinned_lock = threading.Lock()
_pinned: list[float] = []  # at most one boot time: the first pinned (or read) in this process


def _boot_id() -> str | None:
    try:
        return Path(BOOT_ID_PATH).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def pin_boot_time(path: Path | None = None) -> float:
    """The boot time (epoch seconds) every start time of this process counts from: with `path`, the
    one recorded there for this boot (the kernel's boot id), else the current one, recorded there;
    without, the current one. Pinned once per process; later calls return it. A file this process
    cannot read or write only loses the protection across restarts (logged)."""
    with _pinned_lock:
        if _pinned:
            return _pinned[0]
        btime = psutil.boot_time()
        boot_id = _boot_id()
        if path is not None and boot_id is not None:
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if data.get("boot_id") == boot_id and isinstance(data.get("btime"), int | float):
                    if abs(float(data["btime"]) - btime) > 1.0:
                        log.warning(
                            "the wall clock moved by %+.1f s since lowtide first ran in this boot; "
                            "process start times keep counting from then",
                            btime - float(data["btime"]),
                        )
                    btime = float(data["btime"])
                else:
                    raise ValueError("another boot")
            except (OSError, ValueError, AttributeError):
                try:
                    atomic_write_json(path, {"boot_id": boot_id, "btime": btime})
                except OSError as exc:
                    log.warning("cannot record the boot time in %s: %s", path, exc)
        _pinned.append(btime)
        return btime


def start_time(proc: psutil.Process) -> float:
    """When `proc` started: its clock ticks since boot from /proc/PID/stat, plus the pinned boot
    time (`pin_boot_time`). Raises psutil.NoSuchProcess when it is gone; where /proc has no such
    file (not Linux), psutil's create_time."""
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text(encoding="ascii", errors="replace")
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            raise psutil.NoSuchProcess(proc.pid) from None
        return proc.create_time()
    except PermissionError:
        raise psutil.AccessDenied(proc.pid) from None
    # Fields after "(comm)", which may itself hold spaces or parentheses: state is field 3.
    ticks = float(stat[stat.rfind(")") + 2 :].split()[19])  # field 22, starttime
    return ticks / _CLOCK_TICKS + pin_boot_time()


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def identify_child(
    popen: subprocess.Popen[bytes], reap_later: list[subprocess.Popen[bytes]]
) -> ProcessIdentity:
    """The identity of a child just started. Raises psutil.Error, having SIGKILLed the child and
    queued it in `reap_later` (cannot happen for an unreaped child; be explicit if it does)."""
    try:
        started_at = start_time(psutil.Process(popen.pid))
    except psutil.Error:
        popen.kill()
        reap_later.append(popen)
        raise
    return ProcessIdentity(pid=popen.pid, started_at=started_at)


# -- identity -------------------------------------------------------------------------------------


def same_process(identity: ProcessIdentity) -> psutil.Process | None:
    """The process with this pid if it is the one that started at `identity.started_at`."""
    try:
        proc = psutil.Process(identity.pid)
        if abs(start_time(proc) - identity.started_at) > START_TIME_TOLERANCE:
            return None
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return proc


def is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def still_there(proc: psutil.Process) -> bool:
    """False once a process we listed has exited (a zombie has freed its memory and GPUs)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap_if_child(proc: psutil.Process) -> None:
    """An adopted shim is our child when the same process re-adopts it (tests, embedded mode)."""
    with contextlib.suppress(psutil.Error, ChildProcessError):
        if proc.ppid() == os.getpid():
            os.waitpid(proc.pid, os.WNOHANG)


@dataclass(slots=True)
class ShimProcess:
    """A shim being watched: its identity, our `Popen` when we started it, its exit record's path."""

    identity: ProcessIdentity
    popen: subprocess.Popen[bytes] | None  # None for adopted processes (not our child)
    exit_file: str

    def alive(self) -> bool:
        if self.popen is not None:
            # WNOWAIT: look without reaping, so the pid (the group id) stays ours until swept.
            try:
                info = os.waitid(os.P_PID, self.identity.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                self.popen = None  # reaped behind our back (a SIGCHLD handler?): pid + start time
            else:
                return info is None
        proc = same_process(self.identity)
        if proc is None:
            return False
        if is_zombie(proc):
            reap_if_child(proc)
            return False
        return True

    def group_is_ours(self) -> bool:
        """True while the group's leader, the shim, is still there (running or an unreaped zombie)
        with the recorded start time, so the group id cannot name anybody else's group. A group
        whose leader is gone is left to the tag sweep."""
        if self.popen is not None and self.popen.returncode is None:
            return True  # an unreaped child's pid cannot be reused
        return same_process(self.identity) is not None

    def signal_group(self, sig: signal.Signals) -> bool:
        """Signal the shim's group if it is ours; False when its leader is gone (not signalled).
        A group that has just gone counts as signalled. Raises PermissionError."""
        if not self.group_is_ours():
            return False
        with contextlib.suppress(ProcessLookupError):  # already gone; the next poll sees it
            os.killpg(self.identity.pid, sig)
        return True


# -- the process table ----------------------------------------------------------------------------


def parse_shim_cmdline(cmdline: Sequence[str]) -> tuple[str, int] | None:
    """(instance, number) if `cmdline` is a shim's; options after ``--`` are the command's."""
    try:
        start = cmdline.index(SHIM_MODULE)
    except ValueError:
        return None
    if start == 0 or cmdline[start - 1] != "-m":
        return None
    instance: str | None = None
    number: int | None = None
    args = list(cmdline[start + 1 :])
    for i, arg in enumerate(args[:-1]):
        if arg == "--":
            break
        if arg == "--instance":
            instance = args[i + 1]
        elif arg == "--attempt":
            try:
                number = int(args[i + 1])
            except ValueError:
                return None
    if instance is None or number is None:
        return None
    return instance, number


def iter_shims() -> Iterator[tuple[psutil.Process, str, int]]:
    """Live (non-zombie) shims on this machine: (process, instance, number)."""
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            parsed = parse_shim_cmdline(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if parsed is not None:
            yield proc, parsed[0], parsed[1]


def live_shim_args(identity: ProcessIdentity) -> tuple[str, int] | None:
    """(instance, number) of the shim `identity` names while it runs; None when that process is
    gone, a zombie (reaped if it is our child) or not a shim."""
    proc = same_process(identity)
    if proc is None:
        return None
    try:
        if is_zombie(proc):
            reap_if_child(proc)
            return None
        return parse_shim_cmdline(proc.cmdline())
    except psutil.Error:
        return None


def find_shim(match: Callable[[psutil.Process, str, int], bool]) -> ProcessIdentity | None:
    """The identity of the first live shim that `match(process, instance, number)` accepts."""
    for proc, instance, number in iter_shims():
        if match(proc, instance, number):
            try:
                return ProcessIdentity(pid=proc.pid, started_at=start_time(proc))
            except psutil.Error:
                continue
    return None


def kill_orphan_shim(proc: psutil.Process, what: str) -> bool:
    """SIGKILL a shim listed by `iter_shims` with its group (it leads one: a new session), or only
    the shim if it somehow does not. False when it is gone already or may not be killed (logged as
    ``"cannot kill orphan <what> ..."``)."""
    try:
        # is_running() re-checks the start time: the pid still names the shim we listed.
        if proc.is_running() and os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, psutil.NoSuchProcess):
        return False
    except (PermissionError, psutil.AccessDenied) as exc:
        log.warning("cannot kill orphan %s (pid %s): %s", what, proc.pid, exc)
        return False
    return True


def process_env(proc: psutil.Process, name: str) -> str | None:
    """The value of `name` in a process's environment; None if unset or unreadable."""
    try:
        return proc.environ().get(name)
    except (psutil.Error, OSError):
        return None


def kill_tagged(name: str, select: Callable[[str], K | None]) -> list[tuple[psutil.Process, K]]:
    """SIGKILL every live process but this one whose environment sets `name` to a value that
    `select` maps to a key (None: spare it). Returns the processes signalled, with their keys."""
    hit: list[tuple[psutil.Process, K]] = []
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        value = process_env(proc, name)
        key = select(value) if value is not None else None
        if key is None:
            continue
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            proc.kill()  # psutil refuses if the pid was reused since it was listed
            hit.append((proc, key))
    return hit


def start_shim_as(
    argv: Sequence[str],
    *,
    cwd: str | Path,
    env: Mapping[str, str],
    log_path: str,
    header: str,
    user: int | None,
    group: int | None,
    umask: int = -1,
) -> subprocess.Popen[bytes]:
    """`start_shim` for a step that may run as another user: the log is opened by this process
    (never following a symlink, mode 0640) and inherited as stdout/stderr; with `user`, the
    child runs as that uid and `group`, with no supplementary groups (``extra_groups=[]``) and
    `umask` (Python docs, ``subprocess.Popen``: needs privilege). Raises OSError."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    with os.fdopen(fd, "ab") as logf:
        logf.write(header.encode())
        logf.flush()
        identity: dict[str, Any] = (
            {"user": user, "group": group, "extra_groups": []} if user is not None else {}
        )
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            umask=umask,
            **identity,
        )
