"""The local service manager: inference replicas (vLLM, or the emulator) as processes on this machine.

Implements `control.inference_ports.ServiceManager` for the embedded mode; a Kubernetes scaler
implements the same port later. The control loop (`control.inference`) decides; this module only
starts, health-checks, parks (graceful stop, or vLLM sleep mode) and unparks replicas, and reports
what happened through `poll`.

**Processes.** A replica runs under the same supervisor as research steps, `adapters.step_shim`,
in its own session and process group, so it outlives a control-plane crash and its exit status is
recorded (``<work_dir>/replica_exit.json``). The shim needs an integer ``--attempt``; replicas use
their own numbering, kept apart from step attempts by the shim's ``--instance``, which for replicas
is ``"<instance id>:replicas"``: `LocalExecutor.reap_orphans` only touches shims of its own instance
id, and this manager only shims of the ``:replicas`` one. The number is a stable 32-bit hash of the
replica id (the same for every start of a replica, so a restarted control plane can recognise the
shim by its command line); the exact replica id travels in the process environment
(`REPLICA_TAG_ENV`, ``"<instance id> <replica id>"``), which every descendant inherits (a vLLM
engine core too), so leftovers are found even if they left the group. The executor's step tag
(`local_executor.TAG_ENV`) is removed from a replica's environment, so the two never meet.
``<work_dir>/replica_shim.json`` holds the shim's pid and start time for `adopt`.

**Health checks never block the loop.** Every HTTP request runs on one background thread with an
asyncio loop (`httpx.AsyncClient`, no proxies from the environment, no keep-alive, `http_timeout_s`
per request); `poll` only collects finished results, checks process liveness (a `waitid` without
reaping, or pid + start time for adopted processes), applies deadlines and submits the next
request. A replica has at most one request in flight (so a POST /sleep and a later POST /wake_up
reach it in order) and gets one at most every `health_interval_s`. A request that hangs only
delays that replica.

**States tracked per replica** (`Phase`; "live" = a process exists):
- STARTING (live): launched; GET /health until 200 → HEALTHY, event ``healthy``. Not healthy
  within ``launch.health_timeout_s`` → KILLING.
- HEALTHY (live): serving; only the process is watched (no HTTP).
- SLEEPING (live): park "sleep": POST /sleep?level=1, then GET /is_sleeping until true → ASLEEP,
  event ``asleep``; deadline ``launch.health_timeout_s`` → KILLING. A POST answered with an error
  status (sleep mode not enabled) falls back to a graceful stop (event ``stopped``, saying so).
- ASLEEP (live): weights in host RAM, GPU memory freed; only the process is watched.
- WAKING (live): unpark of an asleep replica: POST /wake_up, then /is_sleeping false and /health
  200 → HEALTHY, event ``healthy``; deadline ``launch.health_timeout_s`` → KILLING.
- CHECKING (live): adopted after a control-plane restart: /is_sleeping true → ASLEEP (``asleep``),
  else /health 200 → HEALTHY (``healthy``); deadline ``launch.health_timeout_s`` after adoption.
- STOPPING (live): park "stop": SIGTERM to the group; SIGKILL once `stop_grace_s` has passed; when
  the shim has exited → STOPPED, event ``stopped``.
- KILLING (live): a deadline passed or a wake was refused; the group got SIGKILL; when the shim has
  exited → FAILED, event ``failed`` with the reason.
- REAPING (the shim has exited): what it left behind (its group, processes with its tag, e.g. an
  engine core) was SIGKILLed and has not disappeared yet; the ``stopped`` / ``failed`` event waits
  for it (at most `REAP_LIMIT_S`), so that when the loop hears it the GPUs really are free and a
  new start cannot meet the old processes on its port.
- STOPPED / FAILED (no process): the launch is remembered; `start` or `unpark` starts it again.
A live replica whose process exits unexpectedly → FAILED, event ``failed`` with its exit status.
When a process ends, what it left (its group, processes carrying its tag) is SIGKILLed.

Per replica the manager also keeps: the launch, the process (pid + start time, our `Popen` when we
started it), the phase's deadline, the request in flight and when the next one is due, whether the
POST of a SLEEPING/WAKING phase got through, the last check's outcome (for failure messages), and
the detail of its last terminal event (repeated when a parked replica is parked again).

Safety: a group is only signalled while its leader is verifiably our shim (an unreaped child, or
pid + start time matching); single processes only by our tag; other installations' replicas and
research steps are never touched. Methods take `now` and none sleeps; `close` cancels requests
in flight. Not thread-safe: the loop calls it from one thread (the check thread only runs HTTP).

Must not: decide anything (when to start, park or retry is the loop's), touch the store, read
configuration, or raise from `poll`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import httpx
import psutil

from lowtide.adapters.local_executor import SHIM_MODULE, START_TIME_TOLERANCE
from lowtide.adapters.local_executor import TAG_ENV as STEP_TAG_ENV
from lowtide.control.executor_port import ProcessIdentity
from lowtide.control.inference_ports import ReplicaEvent, ReplicaEventKind, ReplicaLaunch
from lowtide.domain.services import ParkMode

log = logging.getLogger(__name__)

EXIT_FILE = "replica_exit.json"
SHIM_FILE = "replica_shim.json"
#: ``"<instance id> <replica id>"`` in every replica process's environment (and its descendants').
REPLICA_TAG_ENV = "LOWTIDE_REPLICA_TAG"
SHIM_INSTANCE_SUFFIX = ":replicas"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
CHECK_THREAD_NAME = "lowtide-replica-checks"

# Children of this process that no manager watches any more (after `close`), kept referenced so a
# later poll reaps them instead of leaving zombies. Process-wide, as child processes are.
_DETACHED: list[subprocess.Popen[bytes]] = []


def _reap(children: list[subprocess.Popen[bytes]]) -> None:
    children[:] = [p for p in children if p.poll() is None]


class Phase(StrEnum):
    """What the manager believes a replica is doing (see the module docstring)."""

    STARTING = "starting"
    HEALTHY = "healthy"
    SLEEPING = "sleeping"
    ASLEEP = "asleep"
    WAKING = "waking"
    CHECKING = "checking"
    STOPPING = "stopping"
    KILLING = "killing"
    REAPING = "reaping"
    STOPPED = "stopped"
    FAILED = "failed"


_GONE = frozenset({Phase.STOPPED, Phase.FAILED})
# Phases whose process may still answer HTTP (`url` gives its address).
_SERVING_PROCESS = frozenset(Phase) - _GONE - {Phase.REAPING}
#: How long `stopped` / `failed` waits for SIGKILLed leftovers to disappear before it is reported.
REAP_LIMIT_S = 30.0
# Phases waiting for an HTTP answer before a deadline.
_PROBING = frozenset({Phase.STARTING, Phase.SLEEPING, Phase.WAKING, Phase.CHECKING})

ProbeKind = Literal["health", "state", "sleep", "is_sleeping", "wake", "awake"]


@dataclass(frozen=True, slots=True)
class _Answer:
    """The outcome of one background check (one or two HTTP requests)."""

    status: int | None = None  # HTTP status of the first request; None: no answer
    sleeping: bool | None = None  # from /is_sleeping; None: not asked or not understood
    healthy: bool = False  # /health answered 200
    error: str = ""  # why no answer came
    sent: bool = False  # no answer, but the request reached the server (a read timeout)


@dataclass(slots=True)
class _Proc:
    identity: ProcessIdentity
    popen: subprocess.Popen[bytes] | None  # None for adopted processes (not our child)
    exit_file: str


@dataclass(slots=True)
class _Replica:
    launch: ReplicaLaunch
    phase: Phase
    proc: _Proc | None = None
    since: float = 0.0  # when the phase began
    deadline: float | None = None  # probing phases: fail then; STOPPING: SIGKILL then
    op: int = 0  # bumped on every phase change: answers to an older phase's request are dropped
    inflight: Future[_Answer] | None = None
    inflight_op: int = 0
    inflight_kind: ProbeKind = "health"
    inflight_since: float = 0.0
    next_check: float = 0.0
    posted: bool = False  # SLEEPING / WAKING: the POST reached the server
    last: str = "no answer yet"  # the last check's outcome, for failure messages
    reason: str = ""  # KILLING: why it fails; STOPPING: a note for the stopped event
    killed: bool = False  # STOPPING: SIGKILL sent after the grace
    detail: str = ""  # STOPPED / FAILED: detail of the event that said so
    lingering: list[psutil.Process] = field(default_factory=list)  # REAPING: SIGKILLed, not gone yet
    outcome: tuple[ReplicaEventKind, str, Phase] | None = None  # REAPING: what to report once gone


# -- process helpers ------------------------------------------------------------------------------


def _shim_number(replica_id: str) -> int:
    """The shim's ``--attempt`` for a replica: stable across starts and control-plane restarts."""
    return int.from_bytes(hashlib.blake2b(replica_id.encode(), digest_size=4).digest(), "big")


def _parse_tag(tag: str | None) -> tuple[str, str] | None:
    if not tag:
        return None
    instance, sep, replica_id = tag.partition(" ")
    return (instance, replica_id) if sep and instance and replica_id else None


def _process_tag(proc: psutil.Process) -> tuple[str, str] | None:
    try:
        return _parse_tag(proc.environ().get(REPLICA_TAG_ENV))
    except (psutil.Error, OSError):
        return None


def _shim_args(cmdline: Sequence[str]) -> tuple[str, int] | None:
    """(instance, number) when `cmdline` is a step shim's; what follows ``--`` is the command's."""
    try:
        at = cmdline.index(SHIM_MODULE)
    except ValueError:
        return None
    if at == 0 or cmdline[at - 1] != "-m":
        return None
    instance: str | None = None
    number: int | None = None
    args = list(cmdline[at + 1 :])
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
    return (instance, number) if instance is not None and number is not None else None


def _same_process(identity: ProcessIdentity) -> psutil.Process | None:
    """The process with this pid if it is the one that started at `identity.started_at`."""
    try:
        proc = psutil.Process(identity.pid)
        if abs(proc.create_time() - identity.started_at) > START_TIME_TOLERANCE:
            return None
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return proc


def _is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _still_there(proc: psutil.Process) -> bool:
    """False once a process we listed has exited (a zombie has freed its memory and GPUs)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap_if_child(proc: psutil.Process) -> None:
    """An adopted shim is our child when the same process re-adopts it (tests, embedded mode)."""
    with contextlib.suppress(psutil.Error, ChildProcessError):
        if proc.ppid() == os.getpid():
            os.waitpid(proc.pid, os.WNOHANG)


def _read_status(path: str) -> tuple[int | None, int | None] | None:
    """(exit code, signal) recorded by the shim, or None when there is no valid record."""
    try:
        with Path(path).open(encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("unreadable exit file %s: %s", path, exc)
        return None
    if not isinstance(data, dict):
        return None
    code, sig = data.get("exit_code"), data.get("signal")
    if (code is not None and type(code) is not int) or (sig is not None and type(sig) is not int):
        return None
    return code, sig


def _describe_exit(code: int | None, sig: int | None) -> str:
    if sig is not None:
        try:
            return f"was killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"was killed by signal {sig}"
    return f"exited with code {code}"


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(payload), encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _port_taken(port: int) -> bool:
    """True when something already listens on `port` (an old replica would answer our checks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _launch_problem(launch: ReplicaLaunch, env: dict[str, str], cwd: Path) -> str | None:
    """Why the replica cannot start at all, or None."""
    exe = launch.command[0]
    if "/" in exe:
        path = cwd / exe  # an absolute exe replaces cwd
        if not path.is_file():
            return f"command not found: {exe}"
        if not os.access(path, os.X_OK):
            return f"command is not executable: {exe}"
    elif shutil.which(exe, path=env.get("PATH", os.defpath)) is None:
        return f"command not found on PATH: {exe}"
    if _port_taken(launch.port):
        return f"port {launch.port} is already in use"
    return None


# -- HTTP checks (run on the check thread; they touch no manager state) ---------------------------


def _sleeping_flag(response: httpx.Response) -> bool | None:
    if response.status_code != 200:
        return None
    try:
        value = response.json().get("is_sleeping")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, bool) else None


async def _probe(client: httpx.AsyncClient, base: str, kind: ProbeKind) -> _Answer:
    try:
        if kind == "health":
            return _Answer(status=(await client.get(f"{base}/health")).status_code)
        if kind == "sleep":
            return _Answer(status=(await client.post(f"{base}/sleep", params={"level": "1"})).status_code)
        if kind == "wake":
            return _Answer(status=(await client.post(f"{base}/wake_up")).status_code)
        response = await client.get(f"{base}/is_sleeping")
        sleeping = _sleeping_flag(response)
        if (
            kind == "is_sleeping"
            or (kind == "state" and sleeping)
            or (kind == "awake" and sleeping is not False)
        ):
            return _Answer(status=response.status_code, sleeping=sleeping)
        healthy = (await client.get(f"{base}/health")).status_code == 200
        return _Answer(status=response.status_code, sleeping=sleeping, healthy=healthy)
    except httpx.ReadTimeout as exc:
        return _Answer(error=f"no answer within the timeout ({type(exc).__name__})", sent=True)
    except httpx.HTTPError as exc:
        return _Answer(error=f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # a check must never take the event loop down
        return _Answer(error=f"{type(exc).__name__}: {exc}")


class _Checker:
    """An asyncio loop on one daemon thread that runs the HTTP checks: submitting one costs
    microseconds (no thread to start), a hanging request holds no thread, and `close` cancels
    whatever is in flight at once."""

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = httpx.AsyncClient(
            timeout=timeout_s,
            trust_env=False,  # never route 127.0.0.1 through a proxy from the environment
            # At most one check per replica is in flight; no keep-alive, so a replica restarted on
            # the same port never gets a request on its predecessor's connection.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
        )
        self._thread = threading.Thread(target=self._run, name=CHECK_THREAD_NAME, daemon=True)
        self._thread.start()
        self._closed = False

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
            self._loop.run_until_complete(self._drain())
        finally:
            self._loop.close()

    async def _drain(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.aclose()

    def submit(self, base: str, kind: ProbeKind) -> Future[_Answer]:
        return asyncio.run_coroutine_threadsafe(_probe(self._client, base, kind), self._loop)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():
            log.warning("the replica check thread did not stop within 10 s")


def _describe_answer(kind: ProbeKind, answer: _Answer) -> str:
    if answer.error:
        return f"{kind} check: {answer.error}"
    parts = [f"{kind} check: HTTP {answer.status}"]
    if answer.sleeping is not None:
        parts.append(f"is_sleeping={str(answer.sleeping).lower()}")
    if kind in ("state", "awake") and answer.sleeping is not True:
        parts.append(f"health {'200' if answer.healthy else 'not 200'}")
    return ", ".join(parts)


# -- the manager ----------------------------------------------------------------------------------


class LocalServiceManager:
    """Runs replicas as local process groups; see the module docstring."""

    def __init__(
        self,
        instance_id: str,
        *,
        health_interval_s: float = 1.0,
        http_timeout_s: float = 2.0,
        stop_grace_s: float = 30.0,
        python: str = sys.executable,
    ) -> None:
        if not instance_id or any(c.isspace() for c in instance_id):
            raise ValueError(f"instance id must be non-empty without spaces: {instance_id!r}")
        if health_interval_s <= 0 or http_timeout_s <= 0 or stop_grace_s < 0:
            raise ValueError("health_interval_s and http_timeout_s must be > 0, stop_grace_s >= 0")
        self.instance_id = instance_id
        self.health_interval_s = health_interval_s
        self.http_timeout_s = http_timeout_s
        self.stop_grace_s = stop_grace_s
        self._python = python
        self._shim_instance = instance_id + SHIM_INSTANCE_SUFFIX
        self._replicas: dict[str, _Replica] = {}
        self._events: list[ReplicaEvent] = []
        self._reap_later: list[subprocess.Popen[bytes]] = []
        self._checker = _Checker(http_timeout_s)
        self._closed = False

    # -- the port -------------------------------------------------------------------------------

    def start(self, launch: ReplicaLaunch, now: float) -> None:
        """Start a replica that is not running (new, stopped or failed); `poll` reports `healthy`
        or `failed`. Raises ValueError if it is running. A replica that cannot be started at all
        (command not found, port in use) is reported `failed` by the next poll, not raised."""
        if not launch.command:
            raise ValueError(f"replica {launch.replica_id}: empty command")
        current = self._replicas.get(launch.replica_id)
        if current is not None and current.phase not in _GONE:
            raise ValueError(f"replica {launch.replica_id} is running ({current.phase})")
        self._spawn(launch, now)

    def park(self, replica_id: str, mode: ParkMode, now: float) -> None:
        """`sleep`: POST /sleep?level=1 → `asleep`; `stop`: SIGTERM → `stopped` (SIGKILL after
        `stop_grace_s`). A replica that is not serving yet cannot sleep and is stopped instead.
        Parking a parked replica reports its state again. Raises ValueError if unknown."""
        if mode not in ("stop", "sleep"):
            raise ValueError(f"unknown park mode {mode!r}")
        rep = self._get(replica_id)
        phase = rep.phase
        if phase in _GONE:
            self._emit(rep, "stopped" if phase == Phase.STOPPED else "failed", now, rep.detail)
        elif phase in (Phase.STOPPING, Phase.KILLING, Phase.REAPING) or (
            mode == "sleep" and phase == Phase.SLEEPING
        ):
            return  # already on its way
        elif mode == "stop":
            self._begin_stop(rep, now)
        elif phase == Phase.ASLEEP:
            self._emit(rep, "asleep", now)
        elif phase == Phase.STARTING:
            self._begin_stop(rep, now, note="not serving yet, so stopped instead of put to sleep")
        else:  # HEALTHY, WAKING, CHECKING
            self._set_phase(rep, Phase.SLEEPING, now, deadline=now + rep.launch.health_timeout_s)

    def unpark(self, replica_id: str, now: float) -> None:
        """Asleep → POST /wake_up; stopped or failed → start again with the same launch; `poll`
        reports `healthy` when it serves. Raises ValueError if unknown or still being parked."""
        rep = self._get(replica_id)
        phase = rep.phase
        if phase in (Phase.ASLEEP, Phase.CHECKING):
            # CHECKING: an adopted replica may be asleep; /wake_up on an awake vLLM does nothing.
            self._set_phase(rep, Phase.WAKING, now, deadline=now + rep.launch.health_timeout_s)
        elif phase in _GONE:
            self._spawn(rep.launch, now)
        elif phase == Phase.HEALTHY:
            self._emit(rep, "healthy", now)
        elif phase in (Phase.SLEEPING, Phase.STOPPING, Phase.KILLING, Phase.REAPING):
            raise ValueError(f"replica {replica_id} is being parked or ending ({phase}); not now")
        # STARTING, WAKING: `healthy` comes when it serves.

    def poll(self, now: float) -> list[ReplicaEvent]:
        """Events since the last poll. Never raises; returns quickly (no HTTP on this thread)."""
        _reap(self._reap_later)
        _reap(_DETACHED)
        exited: list[_Replica] = []
        for rep in list(self._replicas.values()):
            try:
                if self._poll_one(rep, now):
                    exited.append(rep)
            except Exception:
                # One bad replica must not blind the loop to the others.
                log.exception("replica %s: poll failed", rep.launch.replica_id)
        if exited:
            self._on_exits(exited, now)
        events, self._events = self._events, []
        return events

    def url(self, replica_id: str) -> str | None:
        rep = self._replicas.get(replica_id)
        if rep is None or rep.phase not in _SERVING_PROCESS:
            return None
        return _base_url(rep.launch)

    def adopt(self, replica_id: str, launch: ReplicaLaunch, now: float) -> bool:
        """Re-attach to a replica an earlier control plane started: True when its shim still runs
        (its state is then re-checked: `poll` reports `healthy`, `asleep` or `failed`); False when it
        is gone (what it left is killed)."""
        if launch.replica_id != replica_id:
            raise ValueError(f"launch is for {launch.replica_id!r}, not {replica_id!r}")
        known = self._replicas.get(replica_id)
        if known is not None and known.phase not in _GONE:
            return True
        work_dir = Path(launch.work_dir).absolute()
        exit_file = str(work_dir / EXIT_FILE)
        identity = None
        if _read_status(exit_file) is None:
            identity = self._find_shim(replica_id, self._read_shim_file(work_dir, replica_id))
        if identity is None:
            self._kill_tagged({replica_id})
            log.info("replica %s: not running any more; nothing to adopt", replica_id)
            return False
        rep = _Replica(launch=launch, phase=Phase.CHECKING, proc=_Proc(identity, None, exit_file))
        self._set_phase(rep, Phase.CHECKING, now, deadline=now + launch.health_timeout_s)
        self._replicas[replica_id] = rep
        log.info("replica %s: adopted shim pid %s", replica_id, identity.pid)
        return True

    def reap_orphans(self, known_ids: set[str]) -> list[str]:
        """SIGKILL the replica processes of this installation whose id is not in `known_ids`."""
        _reap(_DETACHED)
        killed: set[str] = set()
        for proc, _number in self._iter_shims():
            tag = _process_tag(proc)
            if tag is None or tag[0] != self.instance_id or tag[1] in known_ids:
                continue
            try:
                # is_running() re-checks the start time: the pid still names the shim we listed.
                if proc.is_running() and os.getpgid(proc.pid) == proc.pid:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
            except (PermissionError, psutil.AccessDenied) as exc:
                log.warning("cannot kill orphan replica %s (pid %s): %s", tag[1], proc.pid, exc)
                continue
            log.warning("killed orphan replica %s (shim pid %s)", tag[1], proc.pid)
            killed.add(tag[1])
        # What outlived its shim, or left its group, still carries the tag.
        killed.update(replica_id for _proc, replica_id in self._kill_tagged(None, spare=known_ids))
        return sorted(killed)

    def close(self) -> None:
        """Stop watching; replica processes keep running for a later control plane to adopt.
        Checks in flight are cancelled."""
        if self._closed:
            return
        self._closed = True
        for rep in self._replicas.values():
            if rep.proc is not None and rep.proc.popen is not None:
                _DETACHED.append(rep.proc.popen)
        _DETACHED.extend(self._reap_later)
        self._replicas.clear()
        self._reap_later = []
        self._checker.close()
        _reap(_DETACHED)

    # -- diagnostics ------------------------------------------------------------------------------

    def phase(self, replica_id: str) -> Phase | None:
        rep = self._replicas.get(replica_id)
        return None if rep is None else rep.phase

    def pid(self, replica_id: str) -> int | None:
        """The replica's shim pid (its process group id) while it has a process."""
        rep = self._replicas.get(replica_id)
        return None if rep is None or rep.proc is None else rep.proc.identity.pid

    # -- start ------------------------------------------------------------------------------------

    def _spawn(self, launch: ReplicaLaunch, now: float) -> None:
        rid = launch.replica_id
        rep = _Replica(launch=launch, phase=Phase.STARTING)
        self._set_phase(rep, Phase.STARTING, now, deadline=now + launch.health_timeout_s)
        self._replicas[rid] = rep
        work_dir = Path(launch.work_dir).absolute()
        env = {**os.environ, **launch.env}
        env.pop(STEP_TAG_ENV, None)  # a replica is not a research step
        if CUDA_VISIBLE_DEVICES not in launch.env:
            # Never let a replica inherit the control plane's view of the GPUs.
            env[CUDA_VISIBLE_DEVICES] = ",".join(str(i) for i in sorted(launch.gpus))
        env[REPLICA_TAG_ENV] = f"{self.instance_id} {rid}"
        exit_file = work_dir / EXIT_FILE
        argv = [
            self._python, "-I", "-m", SHIM_MODULE,
            "--instance", self._shim_instance,
            "--attempt", str(_shim_number(rid)),
            "--exit-file", str(exit_file),
            "--", *launch.command,
        ]  # fmt: skip
        try:
            for directory in {work_dir, Path(launch.log_path).absolute().parent}:
                directory.mkdir(parents=True, exist_ok=True)
            problem = _launch_problem(launch, env, work_dir)
            if problem is not None:
                self._fail_now(rep, now, problem)
                return
            # Leftovers of the previous run would be read as this one's.
            for stale in (exit_file, work_dir / SHIM_FILE):
                stale.unlink(missing_ok=True)
            with Path(launch.log_path).open("ab") as logf:
                stamp = datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds")
                logf.write(
                    f"=== lowtide {stamp}: replica {rid} (model {launch.model}) on {launch.node} gpus "
                    f"[{','.join(map(str, launch.gpus))}] port {launch.port}: "
                    f"{shlex.join(launch.command)}\n".encode()
                )
                logf.flush()
                popen = subprocess.Popen(
                    argv,
                    cwd=work_dir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # own group; no SIGHUP when the control plane dies
                    close_fds=True,
                )
        except OSError as exc:
            self._fail_now(rep, now, f"cannot start: {exc}")
            return
        try:
            started_at = psutil.Process(popen.pid).create_time()
        except psutil.Error as exc:  # cannot happen for an unreaped child; be explicit if it does
            popen.kill()
            self._reap_later.append(popen)
            self._fail_now(rep, now, f"cannot read the start time of pid {popen.pid}: {exc}")
            return
        identity = ProcessIdentity(pid=popen.pid, started_at=started_at)
        rep.proc = _Proc(identity, popen, str(exit_file))
        try:
            _write_json(
                work_dir / SHIM_FILE,
                {
                    "pid": identity.pid,
                    "started_at": identity.started_at,
                    "instance": self.instance_id,
                    "replica_id": rid,
                    "port": launch.port,
                },
            )
        except OSError as exc:  # only an aid to adoption: the process runs, so keep it
            log.warning("replica %s: cannot write %s: %s", rid, SHIM_FILE, exc)
        log.info("replica %s: started (shim pid %s, port %s)", rid, popen.pid, launch.port)

    def _fail_now(self, rep: _Replica, now: float, why: str) -> None:
        log.warning("replica %s: %s", rep.launch.replica_id, why)
        self._set_phase(rep, Phase.FAILED, now)
        rep.detail = why
        self._emit(rep, "failed", now, why)

    # -- watch ------------------------------------------------------------------------------------

    def _poll_one(self, rep: _Replica, now: float) -> bool:
        """Advance one replica; True when its process has exited (handled by `_on_exits`)."""
        if rep.phase == Phase.REAPING:
            rep.lingering = [p for p in rep.lingering if _still_there(p)]
            if not rep.lingering or (rep.deadline is not None and now >= rep.deadline):
                self._conclude(rep, now)
            return False
        if rep.phase in _GONE or rep.proc is None:
            return False
        if not self._alive(rep.proc):
            return True
        future = rep.inflight
        if future is not None and future.done():
            rep.inflight = None
            if rep.inflight_op == rep.op and not future.cancelled():
                self._on_answer(rep, rep.inflight_kind, future.result(), now)
        if rep.deadline is not None and now >= rep.deadline:
            if rep.phase == Phase.STOPPING and not rep.killed:
                log.warning("replica %s: still running after the stop grace; SIGKILL", rep.launch.replica_id)
                self._signal_group(rep, signal.SIGKILL)
                rep.killed = True
            elif rep.phase in _PROBING:
                what = {
                    Phase.STARTING: "not healthy",
                    Phase.CHECKING: "neither healthy nor asleep",
                    Phase.SLEEPING: "not asleep",
                    Phase.WAKING: "not awake and healthy",
                }[rep.phase]
                timeout = rep.deadline - rep.since
                last = rep.last
                if rep.inflight is not None and rep.inflight_op == rep.op:
                    waited = now - rep.inflight_since
                    last = f"{rep.inflight_kind} check still unanswered after {waited:.1f}s"
                self._kill(rep, now, f"{what} within {timeout:g}s (last {last})")
        if rep.phase in _PROBING and rep.inflight is None and now >= rep.next_check:
            self._submit(rep, now)
        return False

    def _submit(self, rep: _Replica, now: float) -> None:
        kind: ProbeKind
        if rep.phase == Phase.STARTING:
            kind = "health"
        elif rep.phase == Phase.CHECKING:
            kind = "state"
        elif rep.phase == Phase.SLEEPING:
            kind = "is_sleeping" if rep.posted else "sleep"
        else:
            kind = "awake" if rep.posted else "wake"
        rep.inflight = self._checker.submit(_base_url(rep.launch), kind)
        rep.inflight_op = rep.op
        rep.inflight_kind = kind
        rep.inflight_since = now
        rep.next_check = now + self.health_interval_s

    def _on_answer(self, rep: _Replica, kind: ProbeKind, answer: _Answer, now: float) -> None:
        rep.last = _describe_answer(kind, answer)
        ok = answer.status is not None and 200 <= answer.status < 300
        if kind == "health" and answer.status == 200:
            self._to(rep, Phase.HEALTHY, now, "healthy")
        elif kind == "state" and answer.sleeping:
            self._to(rep, Phase.ASLEEP, now, "asleep")
        elif kind == "state" and answer.healthy:
            self._to(rep, Phase.HEALTHY, now, "healthy")
        elif kind == "is_sleeping" and answer.sleeping:
            self._to(rep, Phase.ASLEEP, now, "asleep")
        elif kind == "awake" and answer.sleeping is False and answer.healthy:
            self._to(rep, Phase.HEALTHY, now, "healthy")
        elif kind in ("sleep", "wake") and (ok or answer.sent):
            rep.posted = True
            rep.next_check = now  # look at once: vLLM answers the POST when it is done
        elif kind == "sleep" and answer.status is not None:
            self._begin_stop(
                rep, now, note=f"POST /sleep answered HTTP {answer.status} (sleep mode off?): stopped instead"
            )
        elif kind == "wake" and answer.status is not None:
            self._kill(rep, now, f"POST /wake_up answered HTTP {answer.status}")
        # Anything else: not there yet; the next check is due after `health_interval_s`.

    def _to(self, rep: _Replica, phase: Phase, now: float, kind: ReplicaEventKind) -> None:
        self._set_phase(rep, phase, now)
        log.info("replica %s: %s", rep.launch.replica_id, kind)
        self._emit(rep, kind, now)

    def _on_exits(self, exited: list[_Replica], now: float) -> None:
        """Replicas whose shim has exited: sweep what they left (one scan of the process table for
        all of them), reap, and report, or wait in REAPING for SIGKILLed leftovers to disappear."""
        for rep in exited:
            # While an unreaped shim still reserves the group id, the whole group can be killed.
            self._signal_group(rep, signal.SIGKILL)
        try:
            leftovers = self._kill_tagged({rep.launch.replica_id for rep in exited})
        except Exception:  # psutil trouble must not leave the replicas unreported
            log.exception("sweeping the leftovers of %s failed", [r.launch.replica_id for r in exited])
            leftovers = []
        for rep in exited:
            try:
                lingering = [proc for proc, rid in leftovers if rid == rep.launch.replica_id]
                self._on_exit(rep, lingering, now)
            except Exception:
                log.exception("replica %s: handling its exit failed", rep.launch.replica_id)

    def _on_exit(self, rep: _Replica, lingering: list[psutil.Process], now: float) -> None:
        proc = rep.proc
        assert proc is not None
        how = self._ended(rep, proc)
        kind: ReplicaEventKind
        if rep.phase == Phase.STOPPING:
            detail = how
            if rep.killed:
                detail += f" (SIGKILLed after the {self.stop_grace_s:g}s stop grace)"
            if rep.reason:
                detail = f"{rep.reason}; {detail}"
            kind, next_phase = "stopped", Phase.STOPPED
        elif rep.phase == Phase.KILLING:
            detail, kind, next_phase = rep.reason, "failed", Phase.FAILED
        else:
            detail, kind, next_phase = f"process {how} while {rep.phase}", "failed", Phase.FAILED
        self._set_phase(rep, Phase.REAPING, now, deadline=now + REAP_LIMIT_S)
        rep.outcome = (kind, detail, next_phase)
        rep.lingering = lingering
        if not lingering:
            self._conclude(rep, now)

    def _conclude(self, rep: _Replica, now: float) -> None:
        """Report how the process ended, once its leftovers are gone (or `REAP_LIMIT_S` passed)."""
        assert rep.outcome is not None
        kind, detail, next_phase = rep.outcome
        if rep.lingering:
            pids = ", ".join(str(p.pid) for p in rep.lingering)
            detail += f"; pids {pids} were SIGKILLed but had not exited after {REAP_LIMIT_S:g}s"
        (log.info if kind == "stopped" else log.warning)(
            "replica %s: %s: %s", rep.launch.replica_id, kind, detail
        )
        self._set_phase(rep, next_phase, now)
        rep.outcome = None
        rep.lingering = []
        rep.detail = detail
        self._emit(rep, kind, now, detail)

    def _ended(self, rep: _Replica, proc: _Proc) -> str:
        """Reap the (swept) shim and say how it ended."""
        returncode: int | None = None
        if proc.popen is not None:
            returncode = proc.popen.poll()
            if returncode is None:
                self._reap_later.append(proc.popen)  # wrote its status, exits in a moment
        rep.proc = None
        status = _read_status(proc.exit_file)
        if status is not None:
            how = _describe_exit(*status)
        elif returncode is not None and returncode < 0:
            how = _describe_exit(None, -returncode)
        elif returncode is not None:
            how = f"ended without an exit record (shim exit status {returncode})"
        else:
            how = "ended while nobody watched; exit status unknown"
        return how

    def _alive(self, proc: _Proc) -> bool:
        if proc.popen is not None:
            # WNOWAIT: look without reaping, so the pid (the group id) stays ours until swept.
            try:
                info = os.waitid(os.P_PID, proc.identity.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                proc.popen = None  # reaped behind our back: fall back to pid + start time
            else:
                return info is None
        found = _same_process(proc.identity)
        if found is None:
            return False
        if _is_zombie(found):
            _reap_if_child(found)
            return False
        return True

    # -- park and kill ----------------------------------------------------------------------------

    def _begin_stop(self, rep: _Replica, now: float, note: str = "") -> None:
        self._set_phase(rep, Phase.STOPPING, now, deadline=now + self.stop_grace_s)
        rep.reason = note
        log.info("replica %s: stopping (SIGTERM)%s", rep.launch.replica_id, f": {note}" if note else "")
        self._signal_group(rep, signal.SIGTERM)

    def _kill(self, rep: _Replica, now: float, reason: str) -> None:
        log.warning("replica %s: %s; killing it", rep.launch.replica_id, reason)
        self._set_phase(rep, Phase.KILLING, now)
        rep.reason = reason
        self._signal_group(rep, signal.SIGKILL)

    def _group_is_ours(self, proc: _Proc) -> bool:
        """True while the group's leader, our shim, is still there (running or an unreaped zombie)
        with the recorded start time, so the group id cannot name anybody else's group."""
        if proc.popen is not None and proc.popen.returncode is None:
            return True  # an unreaped child's pid cannot be reused
        return _same_process(proc.identity) is not None

    def _signal_group(self, rep: _Replica, sig: signal.Signals) -> None:
        proc = rep.proc
        if proc is None or not self._group_is_ours(proc):
            return  # its leader is gone; leftovers are found by tag
        try:
            os.killpg(proc.identity.pid, sig)
        except ProcessLookupError:
            pass  # already gone; the next poll sees it
        except PermissionError as exc:
            log.warning("replica %s: cannot signal its group: %s", rep.launch.replica_id, exc)

    def _kill_tagged(
        self, replica_ids: AbstractSet[str] | None, *, spare: AbstractSet[str] = frozenset()
    ) -> list[tuple[psutil.Process, str]]:
        """SIGKILL processes carrying this instance's tag for `replica_ids` (None: any id not in
        `spare`). Returns the processes signalled, with their replica id."""
        hit: list[tuple[psutil.Process, str]] = []
        me = os.getpid()
        for proc in psutil.process_iter():
            if proc.pid == me:
                continue
            tag = _process_tag(proc)
            if tag is None or tag[0] != self.instance_id:
                continue
            if (tag[1] not in replica_ids) if replica_ids is not None else (tag[1] in spare):
                continue
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                proc.kill()  # psutil refuses if the pid was reused since it was listed
                log.info("killed pid %s left by replica %s", proc.pid, tag[1])
                hit.append((proc, tag[1]))
        return hit

    # -- adoption ---------------------------------------------------------------------------------

    def _iter_shims(self) -> Iterator[tuple[psutil.Process, int]]:
        """Live shims of this installation's replicas: (process, number)."""
        for proc in psutil.process_iter():
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                parsed = _shim_args(proc.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if parsed is not None and parsed[0] == self._shim_instance:
                yield proc, parsed[1]

    def _is_live_shim(self, identity: ProcessIdentity, replica_id: str) -> bool:
        proc = _same_process(identity)
        if proc is None:
            return False
        try:
            if _is_zombie(proc):
                _reap_if_child(proc)
                return False
            parsed = _shim_args(proc.cmdline())
        except psutil.Error:
            return False
        return parsed == (self._shim_instance, _shim_number(replica_id))

    def _find_shim(self, replica_id: str, hint: ProcessIdentity | None) -> ProcessIdentity | None:
        if hint is not None and self._is_live_shim(hint, replica_id):
            return hint
        # No (valid) shim file: the earlier control plane may have died before writing it.
        number = _shim_number(replica_id)
        for proc, found in self._iter_shims():
            if found == number and _process_tag(proc) == (self.instance_id, replica_id):
                try:
                    return ProcessIdentity(pid=proc.pid, started_at=proc.create_time())
                except psutil.Error:
                    continue
        return None

    def _read_shim_file(self, work_dir: Path, replica_id: str) -> ProcessIdentity | None:
        path = work_dir / SHIM_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("instance") != self.instance_id or data.get("replica_id") != replica_id:
                return None
            return ProcessIdentity(pid=int(data["pid"]), started_at=float(data["started_at"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("unreadable %s: %s", path, exc)
            return None

    # -- bookkeeping ------------------------------------------------------------------------------

    def _get(self, replica_id: str) -> _Replica:
        rep = self._replicas.get(replica_id)
        if rep is None:
            raise ValueError(f"replica {replica_id} is not managed here (start or adopt it first)")
        return rep

    @staticmethod
    def _set_phase(rep: _Replica, phase: Phase, now: float, *, deadline: float | None = None) -> None:
        rep.phase = phase
        rep.op += 1
        rep.since = now
        rep.deadline = deadline
        rep.next_check = now
        rep.posted = False
        rep.killed = False
        rep.reason = ""
        rep.last = "no answer yet"

    def _emit(self, rep: _Replica, kind: ReplicaEventKind, now: float, detail: str = "") -> None:
        self._events.append(ReplicaEvent(rep.launch.replica_id, kind, now, detail))


def _base_url(launch: ReplicaLaunch) -> str:
    return f"http://127.0.0.1:{launch.port}"
