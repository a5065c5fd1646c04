"""The local service manager: inference replicas (vLLM, or the emulator) as processes on this machine.

Implements `control.inference_ports.ServiceManager` for the embedded mode; a Kubernetes scaler
implements the same port later. The control loop (`control.inference`) decides; this module only
starts, health-checks, parks (graceful stop, or vLLM sleep mode) and unparks replicas, and reports
what happened through `poll`.

**Processes.** A replica runs under the same supervisor as research steps, `adapters.step_shim`,
in its own session and process group, so it outlives a control-plane crash and its exit status is
recorded. Starting, finding (for `adopt`) and killing replica processes, and how they are named
apart from step attempts (shim ``--instance "<instance id>:replicas"``, `REPLICA_TAG_ENV`), is
`adapters.replica_processes`; the mechanics it shares with `adapters.local_executor` are
`adapters.supervision`.

**Health checks never block the loop.** Every HTTP request runs on one background thread with an
asyncio loop (`adapters.replica_checks`, `http_timeout_s` per request); `poll` only collects
finished results, checks process liveness (a `waitid` without reaping, or pid + start time for
adopted processes), applies deadlines and submits the next request. A replica has at most one
request in flight (so a POST /sleep and a later POST /wake_up reach it in order) and gets one at
most every `health_interval_s`. A request that hangs only delays that replica. A park or unpark
sends its POST at once; an answer that moves a replica on calls `on_progress` (the loop's wake) and
an `adapters.exit_watch.ExitWatcher` reports a replica's process ending, so a woken replica serves
within milliseconds of its wake, not a tick or two later.

**States tracked per replica** (`Phase`; "live" = a process exists):
- STARTING (live): launched; GET /health until 200 → HEALTHY, event ``healthy``. Not healthy
  within ``launch.health_timeout_s`` → KILLING.
- HEALTHY (live): serving; only the process is watched (no HTTP).
- SLEEPING (live): park "sleep": POST /sleep?level=N (N: `ReplicaLaunch.sleep_level`, 1 or 2),
  then GET /is_sleeping until true → ASLEEP,
  event ``asleep``; deadline ``launch.health_timeout_s`` → KILLING. vLLM serves ``/sleep``,
  ``/wake_up`` and ``/is_sleeping`` only with ``VLLM_SERVER_DEV_MODE=1`` in its environment (and
  frees memory only with ``--enable-sleep-mode``; see docs/vllm.md): a POST answered 404 (dev mode
  off) or any other error status falls back to a graceful stop, event ``stopped`` whose detail
  says why, logged as a warning naming ``VLLM_SERVER_DEV_MODE``.
- ASLEEP (live): level 1: weights in host RAM, level 2: weights discarded; GPU memory freed but
  for CUDA graphs, NCCL buffers and the context (docs/vllm.md); only the process is watched.
- WAKING (live): unpark of an asleep replica: POST /wake_up (level 2: wake the weights, POST
  /collective_rpc reload_weights, wake the KV cache: `replica_checks`), then /is_sleeping false
  and /health 200 → HEALTHY, event ``healthy``; deadline ``launch.health_timeout_s`` → KILLING.
- CHECKING (live): adopted after a control-plane restart: /is_sleeping true → ASLEEP (``asleep``),
  else /health 200 → HEALTHY (``healthy``); deadline ``launch.health_timeout_s`` after adoption.
- STOPPING (live): park "stop": SIGTERM to the group; SIGKILL once `stop_grace_s` has passed; when
  the shim has exited → STOPPED, event ``stopped``.
- KILLING (live): a deadline passed, a wake was refused, or the loop found the replica hung
  (`kill`); the group got SIGKILL; when the shim has exited → FAILED, event ``failed`` with the
  reason. A `start` that arrives while a replica is STOPPING, KILLING or REAPING is kept and
  carried out once the old process is gone (its end is then not reported: the loop moved on).
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

import logging
import signal
import sys
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial

import psutil

from lowtide.adapters.exit_watch import ExitWatcher
from lowtide.adapters.replica_checks import CHECK_THREAD_NAME, Answer, Checker, ProbeKind, describe_answer
from lowtide.adapters.replica_processes import (
    EXIT_FILE,
    REPLICA_TAG_ENV,
    SHIM_FILE,
    SHIM_INSTANCE_SUFFIX,
    ReplicaProcesses,
    SpawnError,
)
from lowtide.adapters.supervision import ShimProcess, still_there
from lowtide.control.inference_ports import ReplicaEvent, ReplicaEventKind, ReplicaLaunch
from lowtide.domain.services import ParkMode

log = logging.getLogger(__name__)

__all__ = [
    "CHECK_THREAD_NAME",
    "EXIT_FILE",
    "REAP_LIMIT_S",
    "REPLICA_TAG_ENV",
    "SHIM_FILE",
    "SHIM_INSTANCE_SUFFIX",
    "LocalServiceManager",
    "Phase",
]


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
# Phases whose process is on its way out: a `start` waits for it to be gone.
_ENDING = frozenset({Phase.STOPPING, Phase.KILLING, Phase.REAPING})
# Phases waiting for an HTTP answer before a deadline.
_PROBING = frozenset({Phase.STARTING, Phase.SLEEPING, Phase.WAKING, Phase.CHECKING})


@dataclass(slots=True)
class _Replica:
    launch: ReplicaLaunch
    phase: Phase
    proc: ShimProcess | None = None
    since: float = 0.0  # when the phase began
    deadline: float | None = None  # probing phases: fail then; STOPPING: SIGKILL then
    op: int = 0  # bumped on every phase change: answers to an older phase's request are dropped
    inflight: Future[Answer] | None = None
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
    pending: ReplicaLaunch | None = None  # KILLING/STOPPING/REAPING: started again once gone


# -- the manager ----------------------------------------------------------------------------------


class LocalServiceManager:
    """Runs replicas as local process groups; see the module docstring."""

    def __init__(
        self,
        instance_id: str,
        *,
        health_interval_s: float = 0.25,
        http_timeout_s: float = 2.0,
        stop_grace_s: float = 30.0,
        python: str = sys.executable,
        watcher: ExitWatcher | None = None,
        on_progress: Callable[[], None] | None = None,
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
        self._procs = ReplicaProcesses(instance_id, python)
        self._replicas: dict[str, _Replica] = {}
        self._events: list[ReplicaEvent] = []
        self._checker = Checker(http_timeout_s)
        self._closed = False
        # Both make the loop poll soon: a replica's process ended, or a check's answer moves it on.
        self._watcher = watcher
        self._on_progress = on_progress

    # -- the port -------------------------------------------------------------------------------

    def start(self, launch: ReplicaLaunch, now: float) -> None:
        """Start a replica that is not running (new, stopped or failed); `poll` reports `healthy`
        or `failed`. Raises ValueError if it is running. A replica that cannot be started at all
        (command not found, port in use) is reported `failed` by the next poll, not raised."""
        if not launch.command:
            raise ValueError(f"replica {launch.replica_id}: empty command")
        current = self._replicas.get(launch.replica_id)
        if current is not None and current.phase in _ENDING:
            # Its old process is still being killed (a hung replica restarted at once): start the
            # new one the moment the old one is gone, without reporting the old one's end.
            current.pending = launch
            log.info("replica %s: will start once its old process is gone", launch.replica_id)
            return
        if current is not None and current.phase not in _GONE:
            raise ValueError(f"replica {launch.replica_id} is running ({current.phase})")
        self._spawn(launch, now)

    def park(self, replica_id: str, mode: ParkMode, now: float) -> None:
        """`sleep`: POST /sleep?level=N (the launch's `sleep_level`) → `asleep`; `stop`: SIGTERM
        → `stopped` (SIGKILL after `stop_grace_s`). A replica that is not serving yet cannot
        sleep and is stopped instead. Parking a parked replica reports its state again. Raises
        ValueError if unknown."""
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
            self._submit_now(rep, now)

    def unpark(self, replica_id: str, now: float) -> None:
        """Asleep → POST /wake_up; stopped or failed → start again with the same launch; `poll`
        reports `healthy` when it serves. Raises ValueError if unknown or still being parked."""
        rep = self._get(replica_id)
        phase = rep.phase
        if phase in (Phase.ASLEEP, Phase.CHECKING):
            # CHECKING: an adopted replica may be asleep; /wake_up on an awake vLLM does nothing.
            self._set_phase(rep, Phase.WAKING, now, deadline=now + rep.launch.health_timeout_s)
            self._submit_now(rep, now)  # every tick counts while research waits for the wake
        elif phase in _GONE:
            self._spawn(rep.launch, now)
        elif phase == Phase.HEALTHY:
            self._emit(rep, "healthy", now)
        elif phase in (Phase.SLEEPING, Phase.STOPPING, Phase.KILLING, Phase.REAPING):
            raise ValueError(f"replica {replica_id} is being parked or ending ({phase}); not now")
        # STARTING, WAKING: `healthy` comes when it serves.

    def kill(self, replica_id: str, now: float, reason: str) -> None:
        """End a hung replica now (`control.inference_ports.KillsReplicas`): SIGKILL to its group,
        since a stopped (SIGSTOP) or stuck process does not act on SIGTERM; `poll` reports
        `failed` with `reason` once its processes are gone. Raises ValueError if unknown."""
        rep = self._get(replica_id)
        if rep.phase in _GONE or rep.phase in (Phase.KILLING, Phase.REAPING):
            return
        self._kill(rep, now, reason)

    def poll(self, now: float) -> list[ReplicaEvent]:
        """Events since the last poll. Never raises; returns quickly (no HTTP on this thread)."""
        self._procs.reap()
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
        proc = self._procs.find(launch)
        if proc is None:
            self._procs.kill_tagged({replica_id})
            log.info("replica %s: not running any more; nothing to adopt", replica_id)
            return False
        rep = _Replica(launch=launch, phase=Phase.CHECKING, proc=proc)
        self._set_phase(rep, Phase.CHECKING, now, deadline=now + launch.health_timeout_s)
        self._replicas[replica_id] = rep
        self._watch_exit(rep)
        log.info("replica %s: adopted shim pid %s", replica_id, proc.identity.pid)
        return True

    def reap_orphans(self, known_ids: set[str]) -> list[str]:
        """SIGKILL the replica processes of this installation whose id is not in `known_ids`."""
        return self._procs.reap_orphans(known_ids)

    def close(self) -> None:
        """Stop watching; replica processes keep running for a later control plane to adopt.
        Checks in flight are cancelled."""
        if self._closed:
            return
        self._closed = True
        self.forget()
        self._checker.close()

    def forget(self) -> None:
        """Stop watching every replica (they keep running; a control plane that lost its lease
        leaves them to the next leader) and stay usable: `adopt` re-attaches them later."""
        if self._watcher is not None:
            for rid in self._replicas:
                self._watcher.forget(("replica", rid))
        self._procs.detach(
            rep.proc.popen
            for rep in self._replicas.values()
            if rep.proc is not None and rep.proc.popen is not None
        )
        self._replicas.clear()
        self._events.clear()

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
        try:
            rep.proc = self._procs.spawn(launch, now)
        except SpawnError as exc:
            self._fail_now(rep, now, str(exc))
            return
        self._watch_exit(rep)
        log.info("replica %s: started (shim pid %s, port %s)", rid, rep.proc.identity.pid, launch.port)

    def _fail_now(self, rep: _Replica, now: float, why: str) -> None:
        log.warning("replica %s: %s", rep.launch.replica_id, why)
        self._set_phase(rep, Phase.FAILED, now)
        rep.detail = why
        self._emit(rep, "failed", now, why)

    # -- watch ------------------------------------------------------------------------------------

    def _poll_one(self, rep: _Replica, now: float) -> bool:
        """Advance one replica; True when its process has exited (handled by `_on_exits`)."""
        if rep.phase == Phase.REAPING:
            rep.lingering = [p for p in rep.lingering if still_there(p)]
            if not rep.lingering or (rep.deadline is not None and now >= rep.deadline):
                self._conclude(rep, now)
            return False
        if rep.phase in _GONE or rep.proc is None:
            return False
        if not rep.proc.alive():
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

    def _submit_now(self, rep: _Replica, now: float) -> None:
        """Send the new phase's first request now rather than at the next poll (when none is in
        flight: one request per replica at a time keeps a POST /sleep and /wake_up in order)."""
        if rep.inflight is None and rep.proc is not None:
            self._submit(rep, now)

    def _watch_exit(self, rep: _Replica) -> None:
        if self._watcher is not None and rep.proc is not None:
            self._watcher.watch(("replica", rep.launch.replica_id), rep.proc.identity)

    def _answered(self, kind: ProbeKind, future: Future[Answer]) -> None:
        """On the check thread: nudge the loop when an answer will move the replica on (not for a
        "still starting" or "still asleep" answer), so `poll` hears it now, not a tick later."""
        if self._on_progress is None or future.cancelled() or future.exception() is not None:
            return
        a = future.result()
        waiting = (
            (kind == "health" and a.status != 200)
            or (kind == "is_sleeping" and not a.sleeping)
            or (kind == "awake" and not (a.sleeping is False and a.healthy))
        )
        if not waiting:
            self._on_progress()

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
        rep.inflight = self._checker.submit(_base_url(rep.launch), kind, rep.launch.sleep_level)
        rep.inflight.add_done_callback(partial(self._answered, kind))
        rep.inflight_op = rep.op
        rep.inflight_kind = kind
        rep.inflight_since = now
        rep.next_check = now + self.health_interval_s

    def _on_answer(self, rep: _Replica, kind: ProbeKind, answer: Answer, now: float) -> None:
        rep.last = describe_answer(kind, answer)
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
            if answer.status == 404:
                why = (
                    "POST /sleep answered HTTP 404: vLLM serves it only with VLLM_SERVER_DEV_MODE=1 "
                    "in its environment; stopped instead of put to sleep"
                )
            else:
                why = (
                    f"POST /sleep answered HTTP {answer.status} (is --enable-sleep-mode set?); "
                    "stopped instead of put to sleep"
                )
            log.warning("replica %s: %s", rep.launch.replica_id, why)
            self._begin_stop(rep, now, note=why)
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
            leftovers = self._procs.kill_tagged({rep.launch.replica_id for rep in exited})
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
        how = self._procs.ended(proc)  # reaps the (swept) shim
        rep.proc = None
        if self._watcher is not None:
            self._watcher.forget(("replica", rep.launch.replica_id))
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
        if rep.pending is not None:
            # The loop already moved on (the replica is STARTING again): the old end is not news.
            log.info(
                "replica %s: old process %s (%s); starting the new one", rep.launch.replica_id, kind, detail
            )
            self._spawn(rep.pending, now)
            return
        (log.info if kind == "stopped" else log.warning)(
            "replica %s: %s: %s", rep.launch.replica_id, kind, detail
        )
        self._set_phase(rep, next_phase, now)
        rep.outcome = None
        rep.lingering = []
        rep.detail = detail
        self._emit(rep, kind, now, detail)

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

    def _signal_group(self, rep: _Replica, sig: signal.Signals) -> None:
        if rep.proc is None:
            return
        try:
            rep.proc.signal_group(sig)  # not when its leader is gone: leftovers are found by tag
        except PermissionError as exc:
            log.warning("replica %s: cannot signal its group: %s", rep.launch.replica_id, exc)

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
