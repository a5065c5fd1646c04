"""The fault harness: a real `lowtide up` (or two), real research steps and emulated vLLM replicas
behind the gateway, faults injected from outside, and the invariants checked while it runs and after.

Role: the one implementation of the chaos runs of issue 12, shared by `tests/faults/` (short runs,
one per fault kind, asserting zero violations) and `benchmarks/chaos.py` (the long form, which
prints and writes the figures). It only drives lowtide from outside, as an operator or a failing
machine would: processes started with `subprocess`, signals, HTTP through the API and the gateway,
and the store's database read directly with a read-only, consistent snapshot.

What a run is (`run_chaos(Plan, workdir)`): one node of declared GPUs, one emulated service behind
the gateway (replicas of 2 GPUs, 1..2, `park: sleep`), research jobs of two steps (a deterministic
`lowtide.examples.train` that checkpoints, then `lowtide.examples.eval`), load surges through the
gateway that make the service want its second replica (→ reclaims and preemptions), a steady
trickle of requests, and faults drawn from `random.Random` streams seeded by `plan.seed`: the same
seed gives the same schedule (which fault when) and the same jobs; victims are drawn from the
processes alive at that moment, so they repeat as far as the timings do:

- `kill -9` of `lowtide up` (restarted after a short pause; some kills land during start-up), of
  the gateway process (only once the gateway runs as its own process: until then the fault is
  skipped with a note), of step shims, of steps and of replicas;
- control-plane restarts under load, half graceful (SIGTERM), half `kill -9`;
- an unwritable store for N seconds: on SQLite a second connection holds `BEGIN EXCLUSIVE` (in
  WAL mode readers go on, writers wait: sqlite.org/lang_transaction.html, sqlite.org/wal.html);
  on PostgreSQL `ALTER DATABASE … SET default_transaction_read_only = on` and every backend of the
  database terminated, then undone the same way (PostgreSQL 16 docs: runtime-config-client,
  functions-admin `pg_terminate_backend`); root cannot be kept out by file modes;
- clock jumps through the Clock port: `lowtide up` gets `LOWTIDE_FAULT_CLOCK_OFFSET_FILE`, a file
  whose float content is added to its wall clock; the harness writes +J, then 0 (a −J jump), each
  right after cancelling a step that ignores SIGTERM, and measures when its deadline kill came;
- two control planes on one database (another state dir, the same store URL, work root and
  artifact root): the leader is `kill -9`ed and the standby must take over within the lease time.

Invariants (`INVARIANTS`; each run counts its violations, with samples): no acknowledged job
lost; no finished step rerun (no later attempt of a SUCCEEDED step, nor a later start in the
steps' own start log); no step running twice at once (two attempts' processes alive); no orphan
(a tagged step or replica process the store does not know, at the end); no GPU double-booked at
any poll (two open ledger rows, two holders, or a pool view listing a GPU twice); the ledger adds
up (per GPU the intervals follow each other without gap, overlap or negative length, and sum to
the span; every open row names a holder that holds the GPU); every job SUCCEEDED with results
identical to an uninterrupted run; no gateway request failed during a control-plane restart; no
exit lost while the store was unwritable (recorded within a bound after it recovered); no
deadline moved by a clock jump beyond a tick plus slack; one control plane acting at a time, and
the standby taking over within the lease time.

Must not: change lowtide's code paths or configuration beyond what an operator sets, assert
anything (callers do), or kill a process that is not this run's (every process it signals carries
this run's marker variable or is a `lowtide up` it started).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import sqlalchemy as sa
import yaml

from lowtide.adapters.local_executor import TAG_ENV as STEP_TAG_ENV
from lowtide.adapters.net import free_port_block
from lowtide.adapters.replica_processes import REPLICA_TAG_ENV
from lowtide.adapters.supervision import SHIM_MODULE
from lowtide.emulator.loadgen import LoadReport, run_load
from lowtide.emulator.traces import FixedTokens, synthetic
from lowtide.store import schema

MARKER_ENV = "LOWTIDE_CHAOS_RUN"  # set on every `lowtide up` of a run; steps get it (allowlist)
CLOCK_OFFSET_ENV = "LOWTIDE_FAULT_CLOCK_OFFSET_FILE"
PG_ADMIN_URL = os.environ.get("LOWTIDE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
SERVICE = "chat"
KILL_KINDS = ("lowtide", "lowtide_startup", "gateway", "shim", "step", "replica")
INVARIANTS = (
    "jobs_lost",
    "finished_step_rerun",
    "step_running_twice",
    "orphans",
    "double_booked_gpu",
    "ledger",
    "unfinished_jobs",
    "wrong_results",
    "gateway_failed_during_restarts",
    "exits_lost_in_outage",
    "submit_5xx_in_outage",
    "deadline_shift",
    "planes_acting_together",
    "standby_takeover",
)
#: Attempts that hold their GPUs (and maybe a process): PENDING too, from its booking to the
#: executor saying it runs (`policy.attempt_rules.ACTIVE_ATTEMPT_STATES`).
ACTIVE_ATTEMPT = ("PENDING", "RUNNING", "STOPPING")
GPU_HOLDING_REPLICA = ("STARTING", "SERVING", "DRAINING", "PARKING", "WAKING")
TERMINAL_JOB = ("SUCCEEDED", "FAILED", "CANCELLED")
POLL_S = 0.5
SAMPLES = 8  # messages kept per invariant

START_LOGGER = '''\
"""Appends "<job> <step> <attempt> <time>" to the file in argv[1], then runs argv[3:] in its place."""
import os, sys, time
line = "%s %s %s %.3f\\n" % (
    os.environ.get("LOWTIDE_JOB_ID"), os.environ.get("LOWTIDE_STEP"), os.environ.get("LOWTIDE_ATTEMPT"),
    time.time(),
)
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
os.write(fd, line.encode())
os.close(fd)
os.execv(sys.argv[3], sys.argv[3:])
'''

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"


# -- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What one run does. Random choices come from `random.Random(seed)`."""

    seed: int = 0
    duration_s: float = 20.0  # faults are injected within this; then the run waits for the jobs
    jobs: int = 8
    kills: int = 6  # random kill -9s, of the kinds in `kill_kinds`
    kill_kinds: tuple[str, ...] = KILL_KINDS
    restarts: int = 0  # control-plane restarts under steady load (even: SIGTERM, odd: kill -9)
    store_outage_s: float = 0.0
    clock_jump_s: float = 0.0
    two_control_planes: bool = False
    service: bool = True  # one emulated service behind the gateway (False: research only)
    surges: bool = True
    steady_rate: float = 3.0  # requests/s through the gateway all along (0: none)
    store: str = "sqlite"  # sqlite | postgresql
    pg_url: str = PG_ADMIN_URL
    tick_s: float = 0.3
    gpus: int = 8
    train_steps: int = 150
    step_seconds: float = 0.04
    checkpoint_every: int = 10
    grace_s: float = 10.0  # the jobs' grace
    probe_grace_s: float = 4.0  # the grace of the steps that ignore SIGTERM (clock jumps)
    lease_ttl_s: float | None = None  # control.lease_ttl / lease_renew (None: lowtide's defaults)
    lease_renew_s: float | None = None
    reclaim_grace_s: float = 4.0
    finish_timeout_s: float = 180.0
    startup_timeout_s: float = 60.0

    def describe(self) -> dict[str, Any]:
        return asdict(self)


# -- results ----------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """Faults injected, invariant violations (count + samples), figures, and notes."""

    plan: Plan
    faults: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    violations: Counter[str] = field(default_factory=Counter)
    samples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timeline: list[tuple[float, str]] = field(default_factory=list)  # (time, what the harness did)
    error: str | None = None

    def violate(self, invariant: str, message: str) -> None:
        assert invariant in INVARIANTS, invariant
        self.violations[invariant] += 1
        if len(self.samples[invariant]) < SAMPLES:
            self.samples[invariant].append(message)

    def note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)

    @property
    def total_violations(self) -> int:
        return sum(self.violations.values())

    @property
    def ok(self) -> bool:
        return self.error is None and self.total_violations == 0

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan.describe(),
            "faults": dict(self.faults),
            "skipped_faults": dict(self.skipped),
            "invariants": {name: self.violations.get(name, 0) for name in INVARIANTS},
            "violation_samples": {k: v for k, v in self.samples.items() if v},
            "figures": self.figures,
            "timeline": self.timeline,
            "notes": self.notes,
            "error": self.error,
            "ok": self.ok,
        }

    def table(self) -> str:
        lines = ["faults injected:"]
        for kind in sorted(set(self.faults) | set(self.skipped)):
            extra = f"  (skipped {self.skipped[kind]})" if self.skipped.get(kind) else ""
            lines.append(f"  {kind:<32} {self.faults.get(kind, 0):>6}{extra}")
        lines.append("invariants (violations):")
        for name in INVARIANTS:
            n = self.violations.get(name, 0)
            lines.append(f"  {name:<32} {n:>6}{'' if n == 0 else '  <-- VIOLATED'}")
            lines.extend(f"      {s}" for s in self.samples.get(name, [])[:3])
        lines.append("figures:")
        for key, value in self.figures.items():
            lines.append(f"  {key:<32} {value}")
        lines.extend(f"note: {n}" for n in self.notes)
        if self.error:
            lines.append(f"ERROR: {self.error}")
        return "\n".join(lines)

    def summary(self) -> str:
        bad = {k: v for k, v in self.violations.items() if v}
        return f"violations {bad or 0}; error {self.error}; samples {dict(self.samples)}; notes {self.notes}"


# -- small helpers ----------------------------------------------------------------------------------


def _boot_time_error() -> float:
    """What to add to psutil's `create_time` to get the creation time to within a clock tick:
    psutil adds /proc/stat's `btime`, whole seconds (proc(5)), so its times are off by up to a
    second; the boot time from /proc/uptime (hundredths) is not. Compared with the lease's
    `acquired_at`, a second matters."""
    with open("/proc/uptime", encoding="ascii") as fh:
        uptime = float(fh.read().split()[0])
    return (time.time() - uptime) - psutil.boot_time()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def consecutive_ports(n: int, rng_base: int) -> int:
    return free_port_block(n, start=rng_base)


def wait_for(what: str, probe: Callable[[], Any], timeout: float, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, OSError, KeyError, IndexError, ValueError):
            value = probe()
            if value:
                return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


# -- a control plane --------------------------------------------------------------------------------


@dataclass
class ControlPlane:
    """One `lowtide up` of the run (its own state dir and API port; the shared store)."""

    name: str
    root: Path
    config: Path
    api_port: int
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0  # time.time() of the last start
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.name}.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            log.write(f"\n===== harness: start #{self.starts + 1} at {time.time():.3f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lowtide", "--config", str(self.config), "up"],
                cwd=self.root,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started_at = time.time()
        self.starts += 1

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not answer /healthz within {timeout:g}s:\n{self.tail()}")
            time.sleep(0.1)

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def terminate(self, timeout: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""


# -- reading the store ------------------------------------------------------------------------------


@dataclass
class Snapshot:
    at: float
    ledger_open: Sequence[Any]
    attempts: Sequence[Any]
    replicas: Sequence[Any]
    steps: Sequence[Any]
    jobs: dict[str, str]
    lease: list[dict[str, Any]]


class StoreReader:
    """The store's database, read directly and read-only, one consistent snapshot per call
    (SQLite: an explicit deferred transaction, which in WAL mode reads one snapshot; PostgreSQL:
    REPEATABLE READ in a read-only session)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sqlite = url.startswith("sqlite")
        if self.sqlite:
            self.engine = sa.create_engine(url, isolation_level="AUTOCOMMIT", connect_args={"timeout": 5})

            @sa.event.listens_for(self.engine, "connect")
            def _query_only(dbapi_conn: Any, _record: Any) -> None:
                dbapi_conn.execute("PRAGMA query_only=ON")

        else:
            self.engine = sa.create_engine(
                url,
                isolation_level="REPEATABLE READ",
                pool_pre_ping=True,
                connect_args={"options": "-c default_transaction_read_only=on", "connect_timeout": 5},
            )

    def close(self) -> None:
        self.engine.dispose()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sa.Connection]:
        with self.engine.connect() as conn:
            if self.sqlite:
                conn.exec_driver_sql("BEGIN")
                try:
                    yield conn
                finally:
                    conn.exec_driver_sql("COMMIT")
            else:
                with conn.begin():
                    yield conn

    def snapshot(self) -> Snapshot:
        a, r, s, j, g = schema.attempts, schema.replicas, schema.steps, schema.jobs, schema.gpu_ledger
        with self._tx() as conn:
            ledger_open = conn.execute(
                sa.select(g.c.node, g.c.gpu_index, g.c.holder_kind, g.c.holder_id).where(
                    g.c.ended_at.is_(None)
                )
            ).all()
            attempts = conn.execute(
                sa.select(
                    a.c.id,
                    a.c.step_id,
                    a.c.job_id,
                    a.c.number,
                    a.c.state,
                    a.c.node,
                    a.c.gpus,
                    a.c.started_at,
                    a.c.ended_at,
                    a.c.work_dir,
                    a.c.notice_at,
                    a.c.stop_deadline,
                )
            ).all()
            replicas = conn.execute(sa.select(r.c.id, r.c.state, r.c.node, r.c.gpus, r.c.parked_as)).all()
            steps = conn.execute(sa.select(s.c.id, s.c.job_id, s.c.name, s.c.state)).all()
            jobs = {row.id: row.state for row in conn.execute(sa.select(j.c.id, j.c.state))}
            lease = self._lease(conn)
        return Snapshot(time.time(), ledger_open, attempts, replicas, steps, jobs, lease)

    @staticmethod
    def _lease(conn: sa.Connection) -> list[dict[str, Any]]:
        table = getattr(schema, "control_lease", None)
        if table is None:
            return []
        try:
            return [dict(row._mapping) for row in conn.execute(sa.select(table))]
        except sa.exc.DBAPIError:
            return []

    def ledger(self) -> list[Any]:
        g = schema.gpu_ledger
        with self._tx() as conn:
            return list(conn.execute(sa.select(g).order_by(g.c.node, g.c.gpu_index, g.c.started_at, g.c.id)))

    def instance_id(self) -> str | None:
        with self._tx() as conn:
            value = conn.execute(
                sa.select(schema.meta.c.value).where(schema.meta.c.key == "instance_id")
            ).scalar()
        return str(value) if value is not None else None


# -- processes --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    kind: str  # step | shim | replica | replica_shim | gateway | gateway_shim | other
    created: float
    attempt_id: int | None = None
    replica_id: str | None = None
    instance: str | None = None


def scan_processes(marker: str, exclude: set[int]) -> list[Proc]:
    """This run's live processes (they carry `MARKER_ENV` = marker), classified by tag and command
    line; the pids in `exclude` (the control planes) are left out."""
    found: list[Proc] = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline", "create_time", "status"]):
        info = p.info
        if info["pid"] in exclude or info["status"] == psutil.STATUS_ZOMBIE or info["pid"] == os.getpid():
            continue
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if env.get(MARKER_ENV) != marker:
            continue
        cmd = info["cmdline"] or []
        is_shim = SHIM_MODULE in cmd
        step_tag, replica_tag = env.get(STEP_TAG_ENV), env.get(REPLICA_TAG_ENV)
        created = info["create_time"] + _boot_time_error()
        common = {"pid": info["pid"], "ppid": info["ppid"], "created": created}
        if step_tag:
            instance, _, attempt = step_tag.rpartition("/")
            with contextlib.suppress(ValueError):
                kind = "shim" if is_shim else "step"
                found.append(Proc(kind=kind, attempt_id=int(attempt), instance=instance, **common))
                continue
        if replica_tag:
            instance, _, rid = replica_tag.partition(" ")
            kind = "replica_shim" if is_shim else "replica"
            found.append(Proc(kind=kind, replica_id=rid, instance=instance, **common))
            continue
        text = " ".join(cmd)
        # The gateway process, and the shim it runs under.
        kind = ("gateway_shim" if is_shim else "gateway") if "gateway" in text else "other"
        found.append(Proc(kind=kind, **common))
    return found


def kill_marked(marker: str) -> int:
    """SIGKILL every process of this run (cleanup); how many were signalled."""
    n = 0
    for proc in scan_processes(marker, set()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, signal.SIGKILL)
            n += 1
    return n


# -- load through the gateway -----------------------------------------------------------------------


class Load:
    """A Poisson load through the gateway on a thread of its own until `stop()`; every request's
    result is kept with its absolute send time."""

    def __init__(
        self, gateway: str, rate: float, seed: int, tokens: FixedTokens, drain_s: float = 30.0
    ) -> None:
        self.gateway = gateway
        self.drain_s = drain_s
        self._requests = synthetic("constant", rate=rate, duration_s=1e6, seed=seed, tokens=tokens)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.started_at = 0.0
        self.report: LoadReport | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="chaos-load", daemon=True)

    def start(self) -> Load:
        self._thread.start()
        self._ready.wait(10)
        return self

    def _run(self) -> None:
        async def main() -> LoadReport:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self.started_at = time.time()
            self._ready.set()
            return await run_load(
                self._requests,
                self.gateway,
                speedup=1,
                emulator_hints=True,
                discover=False,
                model="demo-8b",
                drain_timeout_s=self.drain_s,
                request_timeout_s=30,
                connect_timeout_s=3,
                keep_results=True,
                stop=self._stop,
            )

        try:
            self.report = asyncio.run(main())
        except BaseException as exc:
            self.error = exc
            self._ready.set()

    def stop(self) -> LoadReport | None:
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)
        return self.report

    def failures(self) -> list[tuple[float, str]]:
        """(absolute send time, error class) of every failed request."""
        if self.report is None:
            return []
        return [
            (self.started_at + r.sent_at_s, f"{r.error}: {r.detail or r.status}")
            for r in self.report.results
            if r.error is not None
        ]


class SteadyLoad:
    """Requests at a steady Poisson rate through the gateway, on a thread of its own, each kept
    with when it was sent and when it ended (a failure is blamed on what happened when it ended)."""

    def __init__(self, gateway: str, rate: float, seed: int) -> None:
        self.url = f"{gateway}/v1/completions"
        self.rate = rate
        self.rng = random.Random(f"steady:{seed}")
        self.results: list[tuple[float, float, str | None]] = []  # (sent, ended, error or None)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main()), name="chaos-steady", daemon=True
        )

    def start(self) -> SteadyLoad:
        self._thread.start()
        return self

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        sent = time.time()
        body = {"model": "demo-8b", "prompt": f"steady {i}", "max_tokens": 8, "prompt_tokens": 16}
        error: str | None = None
        try:
            r = await client.post(self.url, json=body)
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {r.text[:160]}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"[:200]
        self.results.append((sent, time.time(), error))

    async def _main(self) -> None:
        timeout = httpx.Timeout(30.0, connect=3.0)
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            tasks: set[asyncio.Task[None]] = set()
            i = 0
            while not self._stop.is_set():
                task = asyncio.create_task(self._one(client, i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
                await asyncio.sleep(self.rng.expovariate(self.rate))
            if tasks:
                await asyncio.wait(tasks, timeout=35)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    @property
    def sent(self) -> int:
        return len(self.results)

    def failures(self) -> list[tuple[float, str]]:
        """(when it failed, why) of every failed request."""
        return [(ended, error) for _sent, ended, error in self.results if error is not None]


# -- the run ----------------------------------------------------------------------------------------


class ChaosRun:
    """One run of a `Plan` in `workdir` (see the module docstring)."""

    def __init__(self, plan: Plan, workdir: Path) -> None:
        self.plan = plan
        self.root = workdir
        # Three streams, so that what one consumes (a victim drawn from a process list whose
        # length depends on timing) never shifts the others: the schedule and the jobs are the
        # same for a seed; the victims and pauses as far as the processes alive allow.
        self.rng = random.Random(f"{plan.seed}:schedule")
        self.victims = random.Random(f"{plan.seed}:victims")
        self.out = Outcome(plan)
        self.marker = secrets.token_hex(8)
        self.data = self.root / "data"
        self.starts_file = self.root / "starts.log"
        self.offset_file = self.root / "clock_offset"
        self.logger = self.root / "start_logger.py"
        self.pg_db: str | None = None
        self.store_url = ""
        self.planes: list[ControlPlane] = []
        self.reader: StoreReader | None = None
        self.acked: dict[str, float] = {}  # job id → when the API acknowledged it
        self.probes: list[str] = []  # stubborn jobs (cancelled on purpose)
        self.lock = threading.Lock()
        self.stop_poll = threading.Event()
        self.restart_windows: list[tuple[float, float]] = []
        self.gateway_windows: list[tuple[float, float]] = []  # a gateway kill → listening again
        self.replica_windows: list[tuple[float, float]] = []  # a replica kill → its requests' timeout
        self.timeline = self.out.timeline
        self.outage: tuple[float, float] | None = None
        self.outage_submits: list[str] = []  # what each submit in the outage got
        self.outage_exits: dict[int, float] = {}  # attempt id → when its process ended (in the outage)
        self.seen_ended: dict[int, float] = {}  # attempt id → first poll that saw it ended
        self.succeeded: dict[int, int] = {}  # step id → number of its SUCCEEDED attempt
        self.reported: set[str] = set()
        self.spawned_by: dict[int, tuple[str, int, float]] = {}  # shim pid → (plane, its pid, created)
        self.lease_terms: list[tuple[float, int | None]] = []  # (acquired_at, holder pid), in order
        self.polls = 0
        self.pool_polls = 0
        self.instance: str | None = None
        self.lease_holders: list[tuple[float, str]] = []
        self.clock_offset = 0.0
        self.mono_first_start = self.mono_first_healthy = 0.0
        self.gateway = ""
        self.loads: list[Load] = []
        self.steady: SteadyLoad | None = None

    # -- set-up -------------------------------------------------------------------------------------

    def setup(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.logger.write_text(START_LOGGER)
        self.offset_file.write_text("0\n")
        subprocess.run(
            [sys.executable, "-m", "lowtide.examples.prep", "--out", str(self.data), "--shards", "2"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        if self.plan.store == "postgresql":
            self.pg_db = f"lowtide_chaos_{secrets.token_hex(4)}"
            admin = sa.create_engine(self.plan.pg_url, isolation_level="AUTOCOMMIT")
            try:
                with admin.connect() as conn:
                    conn.execute(sa.text(f'CREATE DATABASE "{self.pg_db}"'))
            finally:
                admin.dispose()
            self.store_url = sa.make_url(self.plan.pg_url).set(database=self.pg_db).render_as_string(False)
        else:
            self.store_url = f"sqlite:///{self.root / 'lowtide.db'}"
        api_ports = [free_port() for _ in range(2)]
        gw_ports = [free_port()]
        base = consecutive_ports(2, 24000 + (os.getpid() % 300) * 97)
        self.gateway = f"http://127.0.0.1:{gw_ports[0]}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOWTIDE_")}
        env.update({MARKER_ENV: self.marker, CLOCK_OFFSET_ENV: str(self.offset_file)})
        names = ["a", "b"] if self.plan.two_control_planes else ["a"]
        for i, name in enumerate(names):
            config = self.root / f"lowtide-{name}.yaml"
            # One gateway for both planes (the same port, a shared gateway_dir): whichever leads
            # adopts it, as a hot standby on one host must (docs/architecture.md §4.4).
            config.write_text(yaml.safe_dump(self.config(name, api_ports[i], gw_ports[0], base)))
            self.planes.append(ControlPlane(name, self.root, config, api_ports[i], env))

    def config(self, name: str, api_port: int, gw_port: int, base: int) -> dict[str, Any]:
        p = self.plan
        return {
            "state_dir": str(self.root / f"state-{name}"),
            "store_url": self.store_url,
            "artifact_root": str(self.root / "artifacts"),
            "tick_seconds": p.tick_s,
            "nodes": [{"name": "n1", "gpus": p.gpus}],
            "api": {"host": "127.0.0.1", "port": api_port},
            "auth": {"enabled": False},
            "executor": {
                "checkpoint_poll": p.tick_s,
                "retry_backoff": 0.3,
                "retry_backoff_max": 2.0,
                "env_allowlist": [MARKER_ENV],
                "work_root": str(self.root / "work"),
            },
            "services": []
            if not p.service
            else [
                {
                    "name": SERVICE,
                    "model": "demo-8b",
                    "gpus_per_replica": 2,
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "park": "sleep",
                    "emulate": True,
                    "emulator_args": ["--cold-start", "1", "--wake", "0.5", "--max-num-seqs", "2"],
                    "base_port": base,
                    "gateway_port": gw_port,
                    "startup_timeout": "60s",
                    "expected_startup": "2s",
                    "expected_wake": "1s",
                    "drain_timeout": "3s",
                    "reclaim_grace": p.reclaim_grace_s,
                    "metrics": {"window": "3s", "stale_after": "10s"},
                    "autoscale": {
                        "concurrency_per_replica": 2,
                        "kv_usage": None,
                        "scale_up_window": "1s",
                        "scale_down_stabilization": "4s",
                        # Surges every 12 s must keep making the service take GPUs back: no burst
                        # guard (it would keep the replicas up after two surges).
                        "max_scale_down_stabilization": "4s",
                        "tolerance": 0,
                    },
                }
            ],
            "lending": {"mode": "continuous", "stale_after": "10s", "stale_reclaim_after": "30s"},
            "control": {**self.lease_config(), "gateway_dir": str(self.root / "gateway")},
        }

    def lease_config(self) -> dict[str, float]:
        p = self.plan
        pairs = (("lease_ttl", p.lease_ttl_s), ("lease_renew", p.lease_renew_s))
        return {k: v for k, v in pairs if v is not None}

    def lease_renew(self) -> float:
        """How often a standby tries to take the lease: the plan's, else lowtide's default."""
        if self.plan.lease_renew_s is not None:
            return self.plan.lease_renew_s
        from lowtide.config import ControlConfig  # noqa: PLC0415 (only where a lease exists)

        return float(ControlConfig().lease_renew)

    def job_doc(self, i: int) -> dict[str, Any]:
        rng = random.Random(f"{self.plan.seed}:job:{i}")
        p, py = self.plan, sys.executable
        wrap = [py, str(self.logger), str(self.starts_file), "--"]
        return {
            "name": f"chaos-{i}",
            "team": rng.choice(["red", "blue"]),
            "grace_seconds": p.grace_s,
            "max_retries": 50,
            "steps": [
                {
                    "name": "train",
                    "gpus": rng.choice([1, 2]),
                    "checkpoint": True,
                    "command": [
                        *wrap,
                        py,
                        "-m",
                        "lowtide.examples.train",
                        "--data",
                        str(self.data),
                        "--out",
                        "{{outputs}}",
                        "--steps",
                        str(p.train_steps),
                        "--lr",
                        "0.05",
                        "--step-seconds",
                        str(p.step_seconds),
                        "--checkpoint-every",
                        str(p.checkpoint_every),
                    ],
                },
                {
                    "name": "eval",
                    "gpus": 0,
                    "depends": ["train"],
                    "command": [
                        *wrap,
                        py,
                        "-m",
                        "lowtide.examples.eval",
                        "--model",
                        "{{inputs.train}}",
                        "--out",
                        "{{outputs}}",
                    ],
                },
            ],
        }

    def probe_doc(self, i: int) -> dict[str, Any]:
        wrap = [sys.executable, str(self.logger), str(self.starts_file), "--"]
        return {
            "name": f"stubborn-{i}",
            "grace_seconds": self.plan.probe_grace_s,
            "steps": [{"name": "hold", "gpus": 0, "command": [*wrap, sys.executable, "-c", STUBBORN]}],
        }

    def reference(self) -> dict[str, Any]:
        """The results of an uninterrupted run of the same trainer and eval."""
        out = self.root / "reference"
        env = {**os.environ, "LOWTIDE_CHECKPOINT_DIR": ""}
        py = [sys.executable, "-m"]
        train = [
            *py, "lowtide.examples.train", "--data", str(self.data), "--out", str(out / "train"),
            "--steps", str(self.plan.train_steps), "--lr", "0.05", "--step-seconds", "0",
        ]  # fmt: skip
        evaluate = [*py, "lowtide.examples.eval", "--model", str(out / "train"), "--out", str(out / "eval")]
        for argv in (train, evaluate):
            subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
        return {
            "train": json.loads((out / "train" / "model.json").read_text()),
            "eval": json.loads((out / "eval" / "metrics.json").read_text()),
        }

    # -- the API ------------------------------------------------------------------------------------

    def leader(self) -> ControlPlane:
        """A control plane that answers (the first that does), else the first."""
        for plane in self.planes:
            if plane.pid is not None:
                return plane
        return self.planes[0]

    def api(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """The request to the first control plane that answers; the last error if none does."""
        last: httpx.HTTPError = httpx.ConnectError(f"no control plane is running to answer {path}")
        for plane in self.planes:
            if plane.pid is None:
                continue
            try:
                return httpx.request(method, f"{plane.url}{path}", timeout=10, trust_env=False, **kw)
            except httpx.HTTPError as exc:
                last = exc
        raise last

    def submit(self, doc: dict[str, Any], timeout: float = 60.0) -> str:
        """Submit until the API acknowledges (201); the job id is recorded as acknowledged."""
        key = secrets.token_hex(12)
        body = yaml.safe_dump(doc)
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = self.api(
                    "POST",
                    "/v1/jobs",
                    content=body,
                    headers={"Content-Type": "application/yaml", "Idempotency-Key": key},
                )
            except httpx.HTTPError as exc:
                if self.in_outage():
                    self.outage_submits.append(type(exc).__name__)
            else:
                if self.in_outage():
                    self.outage_submits.append(str(r.status_code))
                if r.status_code in (200, 201):
                    job_id = str(r.json()["id"])
                    with self.lock:
                        self.acked.setdefault(job_id, time.time())
                    return job_id
                if r.status_code >= 500 and r.status_code != 503 and self.in_outage():
                    self.out.violate(
                        "submit_5xx_in_outage", f"submit answered {r.status_code}: {r.text[:200]}"
                    )
                if r.status_code < 500 and r.status_code != 429:
                    raise RuntimeError(f"submit refused: {r.status_code} {r.text[:300]}")
            if time.monotonic() > deadline:
                raise TimeoutError("no control plane acknowledged a submit")
            time.sleep(0.3)

    def in_outage(self) -> bool:
        return self.outage is not None and self.outage[0] <= time.time() <= self.outage[1]

    # -- polling ------------------------------------------------------------------------------------

    def plane_pids(self) -> dict[int, str]:
        return {p.pid: p.name for p in self.planes if p.pid is not None}

    def poll_once(self) -> None:
        assert self.reader is not None
        pids = self.plane_pids()
        procs = scan_processes(self.marker, set(pids))
        try:
            snap = self.reader.snapshot()
        except sa.exc.DBAPIError:
            return  # the store is unreachable (an outage): nothing to compare
        if self.instance is None:
            with contextlib.suppress(sa.exc.DBAPIError):
                self.instance = self.reader.instance_id()
        self.polls += 1
        self.check_gpus(snap)
        self.check_steps(snap, procs)
        self.track_spawns(procs, pids)
        self.track_lease(snap)
        self.check_pool()

    def check_gpus(self, snap: Snapshot) -> None:
        expected = {("n1", i) for i in range(self.plan.gpus)}
        rows = Counter((r.node, r.gpu_index) for r in snap.ledger_open)
        for gpu, n in rows.items():
            if n > 1:
                self.out.violate("double_booked_gpu", f"{gpu}: {n} open ledger rows at {snap.at:.2f}")
        if rows and set(rows) != expected:
            self.once("ledger", f"open rows cover {sorted(rows)}, not every GPU", key=f"cover{sorted(rows)}")
        claims: dict[tuple[str, int], list[str]] = defaultdict(list)
        for a in snap.attempts:
            if a.state in ACTIVE_ATTEMPT:
                for g in a.gpus or []:
                    claims[(a.node, g)].append(f"attempt {a.id}")
        for r in snap.replicas:
            if r.state in GPU_HOLDING_REPLICA:
                for g in r.gpus or []:
                    claims[(r.node, g)].append(f"replica {r.id}")
        for gpu, who in claims.items():
            if len(who) > 1:
                self.once("double_booked_gpu", f"{gpu} held by {who} at {snap.at:.2f}", key=f"{gpu}{who}")
        for r in snap.ledger_open:
            holder = f"{r.holder_kind} {r.holder_id}" if r.holder_kind != "idle" else None
            who = claims.get((r.node, r.gpu_index), [])
            if (holder is None and who) or (holder is not None and who != [holder]):
                self.once(
                    "ledger",
                    f"{(r.node, r.gpu_index)}: the ledger says {holder or 'idle'}, "
                    f"the holders {who or 'none'}",
                    key=f"holder{r.node}{r.gpu_index}{holder}{who}",
                )

    def check_steps(self, snap: Snapshot, procs: list[Proc]) -> None:
        attempt_step = {a.id: a.step_id for a in snap.attempts}
        by_step: dict[int, set[int]] = defaultdict(set)
        for p in procs:
            if p.kind == "step" and p.attempt_id is not None and p.instance == self.instance:
                step = attempt_step.get(p.attempt_id)
                if step is not None:
                    by_step[step].add(p.attempt_id)
        for step, ids in by_step.items():
            if len(ids) > 1:
                self.once(
                    "step_running_twice", f"step {step}: attempts {sorted(ids)} alive at once", key=f"{ids}"
                )
        state_of = {s.id: s.state for s in snap.steps}
        for a in snap.attempts:
            if a.ended_at is not None and a.id not in self.seen_ended:
                self.seen_ended[a.id] = snap.at
            if a.state == "SUCCEEDED":
                self.succeeded.setdefault(a.step_id, a.number)
        for a in snap.attempts:
            first = self.succeeded.get(a.step_id)
            if first is not None and a.number > first:
                self.once(
                    "finished_step_rerun",
                    f"step {a.step_id} (job {a.job_id}) got attempt {a.number} "
                    f"after attempt {first} succeeded",
                    key=f"rerun{a.id}",
                )
        for step, _n in self.succeeded.items():
            if state_of.get(step, "SUCCEEDED") != "SUCCEEDED":
                self.once(
                    "finished_step_rerun", f"step {step} left SUCCEEDED for {state_of[step]}", key=f"s{step}"
                )

    def track_spawns(self, procs: list[Proc], pids: dict[int, str]) -> None:
        for p in procs:
            if p.kind in ("shim", "replica_shim") and p.pid not in self.spawned_by and p.ppid in pids:
                self.spawned_by[p.pid] = (pids[p.ppid], p.ppid, p.created)

    def track_lease(self, snap: Snapshot) -> None:
        if not snap.lease:
            return
        holder = ";".join(sorted(str(row.get("pid")) for row in snap.lease))
        if not self.lease_holders or self.lease_holders[-1][1] != holder:
            self.lease_holders.append((snap.at, holder))
        for row in snap.lease:
            term = (float(row.get("acquired_at") or 0.0), row.get("pid"))
            if term not in self.lease_terms:
                self.lease_terms.append(term)
        self.out.figures["lease_rows"] = [
            {
                k: v
                for k, v in row.items()
                if k in ("name", "holder", "pid", "token", "renewed_at", "expires_at")
            }
            for row in snap.lease
        ]

    def check_pool(self) -> None:
        try:
            r = self.api("GET", "/v1/pool")
        except httpx.HTTPError:
            return
        if r.status_code != 200:
            return
        self.pool_polls += 1
        pool = r.json()
        seen: Counter[tuple[str, int]] = Counter()
        for node in pool["nodes"]:
            for gpu in node["gpus"]:
                seen[(node["name"], gpu["index"])] += 1
        for gpu, n in seen.items():
            if n > 1:
                self.out.violate("double_booked_gpu", f"/v1/pool lists {gpu} {n} times")
        if pool["total"] != self.plan.gpus:
            self.once(
                "ledger", f"/v1/pool total {pool['total']} != {self.plan.gpus}", key=f"pool{pool['total']}"
            )

    def once(self, invariant: str, message: str, *, key: str) -> None:
        k = f"{invariant}:{key}"
        if k not in self.reported:
            self.reported.add(k)
            self.out.violate(invariant, message)

    def poller(self) -> None:
        while not self.stop_poll.wait(POLL_S):
            try:
                self.poll_once()
            except Exception as exc:  # the poller must outlive anything odd in one poll
                self.out.note(f"a poll failed: {type(exc).__name__}: {exc}"[:300])

    # -- faults -------------------------------------------------------------------------------------

    def restart_plane(self, plane: ControlPlane, *, graceful: bool, pause: float) -> None:
        began = time.time()
        if graceful:
            plane.terminate()
        else:
            plane.kill9()
        time.sleep(pause)
        plane.start()
        plane.wait_healthy(self.plan.startup_timeout_s)
        self.restart_windows.append((began, time.time()))

    def kill(self, kind: str) -> None:
        """One `kill -9` of `kind`; counted under `kill_<kind>` (or skipped, with the reason)."""
        plane = self.leader()
        if kind == "lowtide":
            self.restart_plane(plane, graceful=False, pause=self.victims.uniform(0.1, 1.5))
        elif kind == "lowtide_startup":
            began = time.time()
            plane.kill9()
            plane.start()
            time.sleep(self.victims.uniform(0.05, 1.0))  # somewhere in its start-up (recovery, first ticks)
            plane.kill9()
            time.sleep(self.victims.uniform(0.1, 0.5))
            plane.start()
            plane.wait_healthy(self.plan.startup_timeout_s)
            self.restart_windows.append((began, time.time()))
        else:
            want = {"gateway": ("gateway",), "shim": ("shim",), "step": ("step",), "replica": ("replica",)}[
                kind
            ]
            procs = sorted(
                (p for p in scan_processes(self.marker, set(self.plane_pids())) if p.kind in want),
                key=lambda p: p.pid,
            )
            if not procs:
                self.out.skipped[f"kill_{kind}"] += 1
                if kind == "gateway" and not self.gateway_windows:
                    self.out.note(
                        "kill_gateway skipped: no gateway process of its own (the gateway runs inside "
                        "`lowtide up` until it is a supervised process)"
                    )
                return
            victim = self.victims.choice(procs)
            began = time.time()
            self.timeline.append((began, f"kill -9 {kind} pid {victim.pid}"))
            if kind == "replica":  # its requests fail; others may be held until a replica serves (≤ 30 s)
                self.replica_windows.append((began, began + 35.0))
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.pid, signal.SIGKILL)
            if kind == "gateway":  # requests fail until lowtide starts it again: not a restart's doing
                with contextlib.suppress(TimeoutError):
                    wait_for("the gateway to listen again", self.gateway_listens, 30, 0.1)
                self.gateway_windows.append((began, time.time()))
            if kind == "step" and self.in_outage() and victim.attempt_id is not None:
                self.outage_exits[victim.attempt_id] = time.time()
        self.out.faults[f"kill_{kind}"] += 1

    def gateway_listens(self) -> bool:
        port = int(self.gateway.rsplit(":", 1)[1])
        with socket.socket() as sock:
            sock.settimeout(0.5)
            return sock.connect_ex(("127.0.0.1", port)) == 0

    def store_outage(self, seconds: float) -> None:
        """The store unwritable for `seconds`; steps killed meanwhile make exits to record. A
        submit is tried (503 expected, never another 5xx) and `/healthz` read every few seconds."""
        self.ensure_running_steps()
        taken = threading.Event()
        holder = threading.Thread(
            target=self._hold_store, args=(seconds, taken), name="chaos-outage", daemon=True
        )
        holder.start()
        taken.wait(120)
        began = time.time()
        time.sleep(min(0.5, seconds / 8))
        for _ in range(2):  # exits during the outage: they must be recorded once it ends
            self.kill("step")
            time.sleep(min(1.0, seconds / 8))
        with contextlib.suppress(httpx.HTTPError, RuntimeError, TimeoutError):
            self.submit(self.job_doc(1000 + len(self.acked)), timeout=3)
        health = []
        while holder.is_alive():
            health.append({"at_s": round(time.time() - began, 1), "codes": self.healthz_codes()})
            holder.join(timeout=5)
        self.out.figures["healthz_during_outage"] = health
        self.out.faults["store_outage"] += 1
        assert self.outage is not None
        self.out.figures["store_outage_s"] = round(self.outage[1] - self.outage[0], 2)

    def ensure_running_steps(self) -> None:
        """Wait until a step runs (submitting one more job if none does), so the outage has
        exits to lose."""

        def running() -> bool:
            return any(p.kind == "step" for p in scan_processes(self.marker, set(self.plane_pids())))

        with contextlib.suppress(TimeoutError):
            wait_for("a step running", running, 3, 0.2)
            return
        self.submit(self.job_doc(2000 + len(self.acked)))
        with contextlib.suppress(TimeoutError):
            wait_for("a step running", running, 30, 0.2)

    def healthz_codes(self) -> list[int]:
        codes = []
        for plane in self.planes:
            with contextlib.suppress(httpx.HTTPError):
                codes.append(httpx.get(f"{plane.url}/healthz", timeout=3, trust_env=False).status_code)
        return codes

    def _hold_store(self, seconds: float, taken: threading.Event) -> None:
        if self.pg_db is None:
            path = self.store_url.removeprefix("sqlite:///")
            lite = sqlite3.connect(path, timeout=60, isolation_level=None)
            try:
                lite.execute("BEGIN EXCLUSIVE")
                began = time.time()
                self.outage = (began, began + seconds + 3600)
                taken.set()
                time.sleep(seconds)
                lite.execute("ROLLBACK")
            finally:
                lite.close()
        else:
            admin = sa.create_engine(self.plan.pg_url, isolation_level="AUTOCOMMIT")
            try:
                with admin.connect() as conn:
                    conn.execute(
                        sa.text(f'ALTER DATABASE "{self.pg_db}" SET default_transaction_read_only = on')
                    )
                    self._terminate_backends(conn)
                    began = time.time()
                    self.outage = (began, began + seconds + 3600)
                    taken.set()
                    time.sleep(seconds)
                    conn.execute(
                        sa.text(f'ALTER DATABASE "{self.pg_db}" SET default_transaction_read_only = off')
                    )
                    self._terminate_backends(conn)
            finally:
                admin.dispose()
        self.outage = (self.outage[0] if self.outage else time.time(), time.time())

    def _terminate_backends(self, conn: sa.Connection) -> None:
        conn.execute(
            sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = :db AND pid <> pg_backend_pid()"
            ),
            {"db": self.pg_db},
        )

    def clock_jumps(self, jump: float) -> None:
        """Cancel a step that ignores SIGTERM, jump the clock +jump; cancel a second one, jump back
        (−jump). Each must still be killed one grace after its own cancel: both jumps happen
        within both graces."""
        grace = self.plan.probe_grace_s
        probes = [self.submit(self.probe_doc(i)) for i in range(2)]
        self.probes.extend(probes)
        pids = [self.wait_probe_running(job) for job in probes]
        cancelled: list[float] = []
        for job, offset in zip(probes, (jump, 0.0), strict=True):
            cancelled.append(time.monotonic())
            self.api("POST", f"/v1/jobs/{job}/cancel").raise_for_status()
            time.sleep(0.3)
            self.offset_file.write_text(f"{offset}\n")
            self.clock_offset = offset
            self.timeline.append((time.time(), f"clock offset {offset:+g}s"))
            self.out.faults["clock_jump"] += 1
            time.sleep(0.4)
        shifts = []
        bound = self.plan.tick_s + 1.5  # a tick, plus the machine's slack
        for pid, at, offset in zip(pids, cancelled, (jump, -jump), strict=True):
            died = self.wait_dead(pid, timeout=grace + abs(jump) + 30 - (time.monotonic() - at))
            took = (died - at) if died is not None else float("inf")
            shift = took - grace
            shifts.append(round(shift, 2))
            if abs(shift) > bound:
                self.out.violate(
                    "deadline_shift",
                    f"a step ignoring SIGTERM, cancelled before a {offset:+g}s jump, died {took:.1f}s "
                    f"after its cancel (grace {grace:g}s; allowed ±{bound:g}s)",
                )
        self.out.figures["deadline_shift_s"] = shifts

    def wait_probe_running(self, job: str) -> int:
        assert self.reader is not None
        reader = self.reader

        def pid() -> int | None:
            mine = {a.id for a in reader.snapshot().attempts if a.job_id == job}
            for p in scan_processes(self.marker, set(self.plane_pids())):
                if p.kind == "step" and p.attempt_id in mine:
                    return p.pid
            return None

        return int(wait_for(f"the stubborn step of {job} to run", pid, 60, 0.2))

    @staticmethod
    def wait_dead(pid: int, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return time.monotonic()
            except psutil.NoSuchProcess:
                return time.monotonic()
            time.sleep(0.05)
        return None

    def second_plane_failover(self) -> None:
        """Kill the leader (the plane holding the lease); the standby must take over."""
        if len(self.planes) < 2:
            return
        holder = self.lease_pid()
        leader = next((p for p in self.planes if p.pid is not None and p.pid == holder), self.planes[0])
        standby = next(p for p in self.planes if p is not leader)
        ttl = self.lease_ttl()
        killed = time.time()
        leader.kill9()
        self.out.faults["kill_leader"] += 1
        # A standby takes over at most a lease time (plus one renew interval) after the leader died.
        bound = (ttl if ttl is not None else 0.0) + self.lease_renew() + 2 * self.plan.tick_s + 1.5
        took = None
        deadline = time.monotonic() + max(bound, 5.0) + 30
        while time.monotonic() < deadline:
            if standby.pid is not None and self.lease_pid() == standby.pid:
                took = time.time() - killed
                break
            time.sleep(0.1)
        self.out.figures["standby_takeover_s"] = round(took, 2) if took is not None else None
        self.out.figures["lease_ttl_s"] = ttl
        if took is None or ttl is None or took > bound:
            self.out.violate(
                "standby_takeover",
                f"the standby {'never took' if took is None else f'took {took:.1f}s to take'} the lease "
                f"(lease time {ttl}, allowed {bound:.1f}s)",
            )
        leader.start()  # back as the standby
        self.out.faults["restart_old_leader"] += 1

    def lease_pid(self) -> int | None:
        assert self.reader is not None
        with contextlib.suppress(sa.exc.DBAPIError):
            rows = self.reader.snapshot().lease
            live = [r for r in rows if r.get("expires_at") is None or float(r["expires_at"]) > time.time()]
            if live and live[0].get("pid") is not None:
                return int(live[0]["pid"])
        return None

    def lease_ttl(self) -> float | None:
        assert self.reader is not None
        with contextlib.suppress(sa.exc.DBAPIError):
            rows = self.reader.snapshot().lease
            if rows and rows[0].get("expires_at") is not None and rows[0].get("renewed_at") is not None:
                return round(float(rows[0]["expires_at"]) - float(rows[0]["renewed_at"]), 2)
        return None

    # -- the schedule -------------------------------------------------------------------------------

    def schedule(self) -> list[tuple[float, str]]:
        """(seconds into the run, action), drawn from the seed."""
        p, d, rng = self.plan, self.plan.duration_s, self.rng
        events: list[tuple[float, str]] = []
        kinds = list(p.kill_kinds)
        rng.shuffle(kinds)  # every kind once (as far as `kills` goes), then at random
        chosen = [*kinds[: p.kills], *(rng.choice(kinds) for _ in range(p.kills - len(kinds)))]
        for kind in chosen:
            events.append((rng.uniform(0.1 * d, 0.85 * d), f"kill:{kind}"))
        for i in range(p.restarts):
            events.append(
                ((i + 0.5) * 0.85 * d / max(1, p.restarts), f"restart:{'kill' if i % 2 else 'term'}")
            )
        if p.store_outage_s > 0:
            events.append((0.3 * d, "outage"))
        if p.clock_jump_s:
            events.append((0.2 * d, "clock"))
        if p.two_control_planes:
            events.append((0.4 * d, "failover"))
        if p.surges and p.service:
            t = 1.0
            while t < d:
                events.append((t, "surge:on"))
                events.append((t + 6.0, "surge:off"))
                t += 12.0
        for i in range(max(0, p.jobs - p.jobs // 2)):
            events.append((rng.uniform(0, 0.7 * d), f"submit:{p.jobs // 2 + i}"))
        return sorted(events, key=lambda e: e[0])

    def act(self, action: str) -> None:
        self.timeline.append((time.time(), action))
        kind, _, arg = action.partition(":")
        if kind == "kill":
            self.kill(arg)
        elif kind == "restart":
            self.restart_plane(self.leader(), graceful=arg == "term", pause=0.2)
            self.out.faults[f"restart_{arg}"] += 1
        elif kind == "outage":
            self.store_outage(self.plan.store_outage_s)
        elif kind == "clock":
            self.clock_jumps(self.plan.clock_jump_s)
        elif kind == "failover":
            self.second_plane_failover()
        elif kind == "surge" and arg == "on":
            seed = self.rng.randrange(1 << 30)
            self.loads.append(Load(self.gateway, 6.0, seed, FixedTokens(32, 120), drain_s=10.0).start())
            self.out.faults["load_surge"] += 1
        elif kind == "surge" and arg == "off" and self.loads and self.loads[-1].report is None:
            self.loads[-1].stop()
        elif kind == "submit":
            self.submit(self.job_doc(int(arg)))

    # -- the whole run ------------------------------------------------------------------------------

    def run(self) -> Outcome:
        began = last = time.monotonic()
        phases: dict[str, float] = {}

        def mark(phase: str) -> None:
            nonlocal last
            now = time.monotonic()
            phases[phase] = round(now - last, 1)
            last = now

        poller = threading.Thread(target=self.poller, name="chaos-poll", daemon=True)
        try:
            self.setup()
            reference = self.reference()
            mark("setup")
            self.reader = StoreReader(self.store_url)
            first = self.planes[0]
            self.mono_first_start = time.monotonic()
            first.start()
            first.wait_healthy(self.plan.startup_timeout_s)
            self.mono_first_healthy = time.monotonic()
            for plane in self.planes[1:]:
                plane.start()
                time.sleep(1.0)
                if plane.proc is not None and plane.proc.poll() is not None:
                    self.out.note(f"the second control plane exited at start: {plane.tail(400)}")
            if self.plan.service:
                self.wait_serving()
            mark("start_up")
            poller.start()
            if self.plan.service and self.plan.steady_rate > 0:
                self.steady = SteadyLoad(self.gateway, self.plan.steady_rate, self.plan.seed).start()
            for i in range(self.plan.jobs // 2):
                self.submit(self.job_doc(i))
            t0 = time.monotonic()
            for at, action in self.schedule():
                delay = at - (time.monotonic() - t0)
                if delay > 0:
                    time.sleep(delay)
                self.act(action)
            for load in self.loads:
                load.stop()
            mark("faults")
            self.ensure_planes_up()
            self.wait_finished()
            mark("jobs_finishing")
            if self.steady is not None:
                self.steady.stop()
            time.sleep(max(1.0, 3 * self.plan.tick_s))  # let the last exits settle
            self.stop_poll.set()
            poller.join(timeout=30)
            self.final_checks(reference)
            mark("final_checks")
        except Exception as exc:
            self.out.error = f"{type(exc).__name__}: {exc}"
            for plane in self.planes:
                self.out.notes.append(f"{plane.name} log tail: {plane.tail(1500)}")
        finally:
            self.stop_poll.set()
            for load in self.loads:
                load.stop()
            if self.steady is not None:
                self.steady.stop()
            self.teardown()
            mark("teardown")
            self.out.figures["phases_s"] = phases
            self.out.figures["wall_s"] = round(time.monotonic() - began, 1)
        return self.out

    def wait_serving(self) -> None:
        def serving() -> bool:
            services = self.api("GET", "/v1/services").json()["services"]
            return any(r["state"] == "SERVING" for r in services[0]["replicas"])

        wait_for("the first replica to serve", serving, self.plan.startup_timeout_s, 0.2)

    def ensure_planes_up(self) -> None:
        for plane in self.planes:
            if plane.pid is None:
                plane.start()
        for plane in self.planes[:1]:
            plane.wait_healthy(self.plan.startup_timeout_s)

    def wait_finished(self) -> None:
        jobs = [j for j in self.acked if j not in self.probes]

        def done() -> bool:
            assert self.reader is not None
            with contextlib.suppress(sa.exc.DBAPIError):
                states = self.reader.snapshot().jobs
                return all(states.get(j) in TERMINAL_JOB for j in jobs)
            return False

        with contextlib.suppress(TimeoutError):
            wait_for("every job to finish", done, self.plan.finish_timeout_s, 0.5)

    # -- final checks -------------------------------------------------------------------------------

    def final_checks(self, reference: dict[str, Any]) -> None:
        assert self.reader is not None
        snap = self.reader.snapshot()
        out = self.out
        jobs = [j for j in self.acked if j not in self.probes]
        for job in self.acked:
            if job not in snap.jobs:
                out.violate("jobs_lost", f"acknowledged job {job} is not in the store")
        for job in jobs:
            state = snap.jobs.get(job)
            if state is not None and state != "SUCCEEDED":
                out.violate("unfinished_jobs", f"job {job} is {state}")
        self.check_results(jobs, reference)
        self.check_starts(snap)
        self.check_orphans(snap)
        self.check_ledger()
        self.check_gateway()
        self.check_outage(snap)
        self.check_planes()
        attempts = [a for a in snap.attempts if a.job_id in set(jobs)]
        out.figures.update(
            {
                "jobs": len(jobs),
                "jobs_unacknowledged_extra": max(0, len(snap.jobs) - len(self.acked)),
                "attempts": len(attempts),
                "store_polls": self.polls,
                "pool_polls": self.pool_polls,
                "restarts_of_control_plane": sum(p.starts - 1 for p in self.planes),
            }
        )
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            reclaims = self.api("GET", "/v1/reclaims", params={"limit": 10000}).json()
            out.figures["reclaims"] = len(reclaims)
            out.figures["reclaims_done"] = sum(r["state"] == "DONE" for r in reclaims)
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            preempted = 0
            for job in jobs:
                detail = self.api("GET", f"/v1/jobs/{job}").json()
                preempted += sum(bool(a["preempted"]) for a in detail["attempts"])
            out.figures["preemptions"] = preempted

    def check_results(self, jobs: list[str], reference: dict[str, Any]) -> None:
        for job in jobs:
            try:
                detail = self.api("GET", f"/v1/jobs/{job}").json()
            except httpx.HTTPError as exc:
                self.out.violate("wrong_results", f"job {job}: cannot read it: {exc}")
                continue
            if detail["job"]["state"] != "SUCCEEDED":
                continue
            outputs = {s["name"]: s["outputs"] for s in detail["steps"]}
            try:
                model = json.loads((Path(outputs["train"]) / "model.json").read_text())
                metrics = json.loads((Path(outputs["eval"]) / "metrics.json").read_text())
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self.out.violate("wrong_results", f"job {job}: results unreadable: {exc}")
                continue
            ref = reference["train"]
            if model["w"] != ref["w"] or model["updates"] != ref["updates"]:
                self.out.violate(
                    "wrong_results",
                    f"job {job}: w {model['w']} updates {model['updates']} != {ref['w']} {ref['updates']}",
                )
            if metrics != reference["eval"]:
                self.out.violate("wrong_results", f"job {job}: eval {metrics} != {reference['eval']}")

    def check_starts(self, snap: Snapshot) -> None:
        """The steps' own start log: no start after the start of the attempt that succeeded."""
        step_id = {(s.job_id, s.name): s.id for s in snap.steps}
        starts: dict[int, list[int]] = defaultdict(list)
        with contextlib.suppress(OSError):
            for line in self.starts_file.read_text().splitlines():
                parts = line.split()
                if len(parts) == 4 and (parts[0], parts[1]) in step_id:
                    starts[step_id[(parts[0], parts[1])]].append(int(parts[2]))
        for step, numbers in starts.items():
            won = self.succeeded.get(step)
            later = [n for n in numbers if won is not None and n > won]
            if later:
                self.out.violate(
                    "finished_step_rerun", f"step {step}: started as attempt(s) {later} after {won}"
                )
        self.out.figures["step_starts"] = sum(len(v) for v in starts.values())

    def check_orphans(self, snap: Snapshot) -> None:
        """At the end (every job done): no tagged process the store does not know. Processes that
        are ending are given a few seconds."""
        live_attempts = {a.id for a in snap.attempts if a.state in ACTIVE_ATTEMPT}
        with_process = {
            r.id
            for r in snap.replicas
            if r.state in GPU_HOLDING_REPLICA or (r.state == "PARKED" and r.parked_as == "sleep")
        }

        def orphans() -> list[Proc]:
            return [
                p
                for p in scan_processes(self.marker, set(self.plane_pids()))
                if (p.attempt_id is not None and p.attempt_id not in live_attempts)
                or (p.replica_id is not None and p.replica_id not in with_process)
                or (p.instance is not None and p.instance != self.instance)
            ]

        left: list[Proc] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = orphans()
            if not left:
                break
            time.sleep(0.5)
        for p in left:
            self.out.violate(
                "orphans", f"{p.kind} pid {p.pid} (attempt {p.attempt_id}, replica {p.replica_id})"
            )

    def check_ledger(self) -> None:
        """Per GPU: intervals back to back, none negative, summing to the span (capacity × time)."""
        assert self.reader is not None
        rows = self.reader.ledger()
        # "Now" for the open rows: lowtide's records may run ahead of this clock after a jump.
        now = max([time.time(), *(r.started_at for r in rows), *(r.ended_at or 0.0 for r in rows)])
        real = time.monotonic()
        per_gpu: dict[tuple[str, int], list[Any]] = defaultdict(list)
        for r in rows:
            per_gpu[(r.node, r.gpu_index)].append(r)
        tolerance = 0.01
        total = span_total = 0.0
        negative = 0
        for gpu, items in per_gpu.items():
            items.sort(key=lambda r: (r.started_at, r.id))
            for r in items:
                end = r.ended_at if r.ended_at is not None else now
                if end - r.started_at < -1e-9:
                    negative += 1
                    self.out.violate("ledger", f"{gpu}: row {r.id} lasts {end - r.started_at:.4f}s")
                total += max(0.0, end - r.started_at)
            for prev, nxt in itertools.pairwise(items):
                if prev.ended_at is None:
                    self.out.violate("ledger", f"{gpu}: row {prev.id} is open but row {nxt.id} follows it")
                elif abs(nxt.started_at - prev.ended_at) > tolerance:
                    what = "gap" if nxt.started_at > prev.ended_at else "overlap"
                    self.out.violate(
                        "ledger",
                        f"{gpu}: {what} of {abs(nxt.started_at - prev.ended_at):.3f}s before row {nxt.id}",
                    )
            open_rows = [r for r in items if r.ended_at is None]
            if len(open_rows) != 1:
                self.out.violate("ledger", f"{gpu}: {len(open_rows)} open rows at the end")
            span = now - items[0].started_at
            span_total += span
            # Capacity × time against real time: the ledger began between the first start and the
            # first answer of /healthz; a clock jump must not stretch or shrink it.
            upper, lower = real - self.mono_first_start + 2.0, real - self.mono_first_healthy - 2.0
            if not lower <= span <= upper:
                self.once(
                    "ledger",
                    f"{gpu}: the ledger spans {span:.1f}s, real time {lower + 2:.1f}..{upper - 2:.1f}s",
                    key=f"span{gpu}",
                )
        if len(per_gpu) != self.plan.gpus:
            self.out.violate("ledger", f"the ledger knows {len(per_gpu)} GPUs, the pool has {self.plan.gpus}")
        self.out.figures["ledger_gpu_seconds"] = round(total, 2)
        self.out.figures["capacity_x_time_gpu_seconds"] = round(span_total, 2)
        self.out.figures["ledger_rows"] = len(rows)
        if abs(total - span_total) > tolerance * max(1, len(rows)):
            self.out.violate("ledger", f"GPU-seconds {total:.3f} != capacity × time {span_total:.3f}")

    def check_gateway(self) -> None:
        fails = self.steady.failures() if self.steady is not None else []

        def within(t: float, windows: list[tuple[float, float]]) -> bool:
            return any(a - 0.5 <= t <= b + 2.0 for a, b in windows)

        other = self.gateway_windows + self.replica_windows
        gateway_killed = [(t, e) for t, e in fails if within(t, self.gateway_windows)]
        in_restarts = [(t, e) for t, e in fails if within(t, self.restart_windows)]
        during = [(t, e) for t, e in in_restarts if not within(t, other)]
        for t, e in during:
            self.out.violate("gateway_failed_during_restarts", f"a request failed at {t:.2f}: {e}")
        self.out.figures["steady_requests"] = {
            "sent": self.steady.sent if self.steady is not None else 0,
            "failed": len(fails),
            "failed_during_restarts": len(during),
            "failed_after_gateway_kills": len(gateway_killed),
            "failed_during_restarts_beside_other_kills": len(in_restarts) - len(during),
            "restart_windows": len(self.restart_windows),
        }
        surge_sent = sum(load.report.sent for load in self.loads if load.report is not None)
        surge_failed = sum(len(load.failures()) for load in self.loads)
        self.out.figures["surge_requests"] = {"sent": surge_sent, "failed": surge_failed}

    def check_outage(self, snap: Snapshot) -> None:
        if self.outage is None:
            return
        _began, ended = self.outage
        bound = self.plan.tick_s + POLL_S + 2.0  # a tick, a poll, and the machine's slack
        lags = []
        for attempt_id, died in sorted(self.outage_exits.items()):
            seen = self.seen_ended.get(attempt_id)
            if seen is None:
                self.out.violate(
                    "exits_lost_in_outage", f"attempt {attempt_id} (died {died:.1f}) never recorded"
                )
                continue
            lag = max(0.0, seen - ended)
            lags.append(round(lag, 2))
            if lag > bound:
                self.out.violate(
                    "exits_lost_in_outage",
                    f"attempt {attempt_id}: its exit was recorded {lag:.1f}s after the store recovered "
                    f"(bound {bound:g}s)",
                )
        self.out.figures["exit_recorded_after_recovery_s"] = lags
        self.out.figures["exits_during_outage"] = len(self.outage_exits)
        self.out.figures["submits_in_outage"] = self.outage_submits

    def check_planes(self) -> None:
        """Every process a control plane started, it started while it held the lease (the lease
        row's `acquired_at` and pid, as every poll saw them)."""
        if len(self.planes) < 2:
            return
        by_plane: Counter[str] = Counter(name for name, _pid, _t in self.spawned_by.values())
        self.out.figures["processes_started_by_plane"] = dict(by_plane)
        self.out.figures["lease_holders"] = [h for _t, h in self.lease_holders]
        terms = sorted(self.lease_terms, key=lambda t: t[0])
        if not terms:
            self.out.violate("planes_acting_together", "no control-plane lease in the store")
            return
        for shim, (name, pid, created) in sorted(self.spawned_by.items()):
            holder = next((h for at, h in reversed(terms) if at <= created + 0.05), None)
            if holder is not None and holder != pid:
                self.out.violate(
                    "planes_acting_together",
                    f"plane {name} (pid {pid}) started pid {shim} at {created:.2f} "
                    f"while pid {holder} held the lease",
                )

    # -- teardown -----------------------------------------------------------------------------------

    def teardown(self) -> None:
        for plane in self.planes:
            with contextlib.suppress(Exception):
                plane.terminate(timeout=30)
        killed = kill_marked(self.marker)
        time.sleep(0.2)
        kill_marked(self.marker)
        self.out.figures["processes_killed_at_cleanup"] = killed
        if self.reader is not None:
            self.reader.close()
        if self.pg_db is not None:
            admin = sa.create_engine(self.plan.pg_url, isolation_level="AUTOCOMMIT")
            with contextlib.suppress(sa.exc.DBAPIError), admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.pg_db}" WITH (FORCE)'))
            admin.dispose()


def run_chaos(plan: Plan, workdir: Path) -> Outcome:
    """Run `plan` in `workdir` (created; left in place with the logs) and return its outcome."""
    return ChaosRun(plan, workdir).run()
