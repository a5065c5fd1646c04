"""Faithfulness of the simulator: the real-process reclaim story, replayed on the virtual clock with
the same inputs, makes the same sequence of decisions (docs/architecture.md §9.1).

The scenario is benchmarks/reclaim.py's, reduced to one surge per park mode (`sleep` and `stop`,
two real runs side by side: each mostly waits on cold starts, a drain and a stabilisation window):

- **Real run.** `lowtide up` on one node of 8 declared GPUs with one emulated vLLM service
  (`chat`: 2-GPU replicas, min 1 / max 2, emulator cold start 2 s, wake 1 s, `--max-num-seqs 4`,
  concurrency target 4 per replica, scale-up window 2 s, scale-down stabilisation 5 s, drain
  timeout 5 s, reclaim grace 5 s, tick 0.5 s, continuous lending). Once `chat/0` serves, three
  real trainers (`python -m lowtide.examples.train`, 2 GPUs each, 0.05 s per step) fill the six
  lent GPUs: `ckpt-often` checkpoints every 5 steps, the two `ckpt-never-*` only when told to
  stop, so the cheapest victim is the same trainer at any moment. A constant Poisson load of
  8 req/s (64-token prompts, 100 output tokens) through the gateway needs a second replica;
  lowtide preempts the trainer that loses the least work (`ckpt-often`), which checkpoints on
  SIGTERM and exits 143, and starts `chat/1` on its GPUs; the load stops as soon as the reclaim
  is DONE (as in the benchmark). When the load is gone `chat/1` drains and parks, and
  `ckpt-often` resumes from its checkpoint as attempt 2.
- **Replay.** The same configuration document goes through `sim.fleet.cluster_scenario` (as
  `lowtide simulate --cluster` reads it), so nodes, service spec, grace, tick, scheduler and
  lending are the production values; the replica's capacity is the emulator engine's for this
  request size and GPU count (`ReplicaCapacity.from_engine`), cold start and wake are the
  emulator's, and the research jobs are the trainers (same names, team, priority, GPUs, grace and
  `restart_seconds`; more work than the run lasts; each trainer's own cadence: a checkpoint every
  5 × 0.05 s, or none; 0.05 s to finish the step in progress and checkpoint on notice). Each job
  is submitted at the second the real one was, and the load curve steps up at the second the
  real surge began and down at the second it stopped (seconds from the moment `chat/0` was
  started). The world's own clock jumps are used (see below).
- **Decision log.** From each store (the real run's SQLite file, the simulator's MemoryStore)
  through the same `Store` methods: steps started (job/step, attempt number, node, GPUs, resumed
  from a checkpoint or not), replica state changes (replica id = service/slot; where a start or a
  wake places it), reclaims opened (victims as job/step#attempt, the replica to wake if any) and
  done, preemptions (which step, for which service), notices and how each attempt ended, plus the
  two inputs (load up, load down) as markers. Events are ordered by time, ties in the order one
  tick makes them, then by attempt id (booking order). Attempt and job ids and timestamps are
  left out; everything else must be equal, entry for entry.

What differs by design, so only the order is compared, not the times: the real autoscaler reads
a request-level emulator through Prometheus scrapes (concurrency builds up request by request,
over a 5 s window), the simulator a capacity model (an M/M/c queue with a fluid backlog), so the
surge is detected after a different number of ticks and the backlog drains at a different pace
after the load stops (which also changes how long the lending growth reserve holds the resume
back); a real replica's start-up adds a Python process start to the emulator's cold start, and
real trainers take their own time to start, checkpoint and exit; the real gateway counts
requests in flight while the simulator has none (the drained replica is the highest slot with
nothing in flight in both). None of these may change a decision or its order here.

Found by this test and fixed: (1) the world jumped its clock only to events, but while a service
is overloaded its modelled backlog grows between ticks and changes what the autoscaler reads
(with `--max-num-seqs` equal to the concurrency target an overload shows only through that
backlog, so the replay first saw the surge when the load went *down*); `sim.world` now ticks every
`tick_s` while any service is overloaded or has a backlog. (2) After the surge had passed and
the extra replica parked, the lending growth reserve still read a rising trend (the least-squares
slope of a 1 → 2 → 1 bump late in its window is positive) and held the resume back;
`policy.inference.growth_per_s` is now 0 once the needed count has come down within the window.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import pytest

from lowtide.config import Settings
from lowtide.control.records import JobDetail, JobRecord, ReclaimRecord, ServiceEventRecord
from lowtide.domain.states import ReclaimState
from lowtide.emulator.engine import EngineConfig
from lowtide.emulator.traces import FixedTokens, synthetic
from lowtide.sim.capacity import ReplicaCapacity
from lowtide.sim.fleet import cluster_scenario
from lowtide.sim.jobs import ResearchJob
from lowtide.sim.load import LoadCurve
from lowtide.sim.ports import ReplicaTimes
from lowtide.sim.scenario import Scenario, StepDefaults
from lowtide.sim.world import SimWorld
from lowtide.store.repo import Store
from reclaim_stack import Stack, Surge, consecutive_ports, free_ports, lowtide_up
from support import wait_until

pytestmark = pytest.mark.slow

# The benchmark's setup (benchmarks/reclaim.py `Setup`), reduced to one surge.
SERVICE = "chat"
NODE_GPUS = 8
GPUS_PER_REPLICA = 2
TRAINER_GPUS = 2
TICK_S = 0.5
GRACE_S = 5.0
COLD_START_S = 2.0
WAKE_S = 1.0
MAX_NUM_SEQS = 4
CONCURRENCY_PER_REPLICA = 4
LOAD_RATE = 8.0
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 100
STEP_S = 0.05
JOB_GRACE_S = 30.0
RESTART_S = 0.5  # the trainer's declared restart cost; also the simulated start-up time
NEVER = 100_000_000
#: (job name, --checkpoint-every): the first loses the least work when stopped, at any moment.
TRAINERS = (("ckpt-often", 5), ("ckpt-never-a", NEVER), ("ckpt-never-b", NEVER))
SETTLE_S = 30.0  # the replay runs this long past the moment the real run had settled


def config_doc(park: str, api_port: int = 0, gateway_port: int = 0, base_port: int = 31000) -> dict[str, Any]:
    """The benchmark's `lowtide.yaml` (benchmarks/reclaim.py `write_config`) for one park mode."""
    return {
        "state_dir": "state",
        "tick_seconds": TICK_S,
        "nodes": [{"name": "n1", "gpus": NODE_GPUS}],
        "api": {"host": "127.0.0.1", "port": api_port},
        "auth": {"enabled": False},
        "executor": {"checkpoint_poll": "1s", "retry_backoff": "1s"},
        "services": [
            {
                "name": SERVICE,
                "model": "demo-8b",
                "gpus_per_replica": GPUS_PER_REPLICA,
                "min_replicas": 1,
                "max_replicas": 2,
                "park": park,
                "emulate": True,
                "emulator_args": [
                    "--cold-start",
                    f"{COLD_START_S:g}",
                    "--wake",
                    f"{WAKE_S:g}",
                    "--max-num-seqs",
                    str(MAX_NUM_SEQS),
                ],
                "base_port": base_port,
                "gateway_port": gateway_port,
                "startup_timeout": "60s",
                "expected_startup": COLD_START_S,
                "expected_wake": WAKE_S,
                "drain_timeout": 5.0,
                "reclaim_grace": GRACE_S,
                "metrics": {"source": "scrape", "window": 5.0, "stale_after": "15s"},
                "autoscale": {
                    "concurrency_per_replica": CONCURRENCY_PER_REPLICA,
                    "kv_usage": None,
                    "scale_up_window": 2.0,
                    "scale_down_stabilization": 5.0,
                    "max_scale_down_stabilization": 5.0,  # as benchmarks/reclaim.py: no burst guard
                    "tolerance": 0,
                },
            }
        ],
        "lending": {"mode": "continuous", "stale_after": "15s", "stale_reclaim_after": "60s"},
    }


def trainer_job(name: str, every: int, data: Path) -> dict[str, Any]:
    """benchmarks/reclaim.py's TRAINER_SPEC, with the restart cost the replay's jobs declare."""
    return {
        "name": name,
        "team": "research",
        "priority": "normal",
        "grace_seconds": JOB_GRACE_S,
        "steps": [
            {
                "name": "train",
                "gpus": TRAINER_GPUS,
                "checkpoint": True,
                "restart_seconds": RESTART_S,
                "command": [
                    sys.executable,
                    "-m",
                    "lowtide.examples.train",
                    "--data",
                    str(data),
                    "--out",
                    "{{outputs}}",
                    "--steps",
                    str(NEVER),
                    "--step-seconds",
                    f"{STEP_S:g}",
                    "--checkpoint-every",
                    str(every),
                ],
            }
        ],
    }


# -- the decision log ---------------------------------------------------------------------------


class DecisionStore(Protocol):
    """What the log reads: the same methods on `store.repo.Store` and `store.memory.MemoryStore`."""

    def list_jobs(self, *, limit: int = 100) -> list[JobRecord]: ...

    def job_detail(self, job_id: str) -> JobDetail: ...

    def service_events(self, service: str, *, limit: int = 100) -> list[ServiceEventRecord]: ...

    def reclaims(self, *, limit: int = 1000) -> list[ReclaimRecord]: ...


# Within one timestamp, the order in which one tick makes these (docs/architecture.md §4): exits
# are observed first, then the inference half moves replicas, closes and opens reclaims and asks
# for preemptions, then notice is given, then steps start.
EXIT, REPLICA, RECLAIM_DONE, RECLAIM_OPEN, PREEMPT, NOTICE, START = range(7)
INPUT = -1  # load changes: before anything the loop does at that moment
_REPLICA_KINDS = {"starting", "waking", "serving", "draining", "parking", "parked", "failed"}
_EXIT_KINDS = {"succeeded", "failed", "interrupted", "lost", "cancelled"}


@dataclass(frozen=True, order=True)
class Decision:
    at: float  # seconds since the first replica was started; not compared
    rank: int  # ties in time: the order one tick makes them in
    seq: int  # ties in time and rank: the attempt id (booking order), else 0
    what: str  # the decision in stable terms; compared

    def __str__(self) -> str:
        return f"{self.at:8.2f}  {self.what}"


def decision_log(store: DecisionStore, origin: float, inputs: Iterable[tuple[float, str]]) -> list[Decision]:
    """The ordered decisions in `store` (see the module docstring); times from `origin`."""
    log = [Decision(at - origin, INPUT, 0, what) for at, what in inputs]

    def add(at: float, rank: int, what: str, seq: int = 0) -> None:
        log.append(Decision(at - origin, rank, seq, what))

    reclaims = store.reclaims(limit=1000)
    for_service = {v: r.service or "lending" for r in reclaims for v in r.victims}
    name_of: dict[int, str] = {}  # attempt id → job/step#number
    for job in store.list_jobs(limit=1000):
        detail = store.job_detail(job.id)
        attempts = {a.id: a for a in detail.attempts}
        name_of.update({a.id: f"{job.name}/{a.step_name}#{a.number}" for a in detail.attempts})
        for e in detail.events:
            a = attempts.get(e.attempt_id) if e.attempt_id is not None else None
            if a is None:
                continue  # events of the job or of a step, not of an attempt (submitted, ready, ...)
            who = name_of[a.id]
            if e.kind == "started":
                resumed = " resuming from its checkpoint" if a.record.get("resume_from") else ""
                add(e.at, START, f"start {who} on {a.node} GPUs {','.join(map(str, a.gpus))}{resumed}", a.id)
            elif e.kind == "preempting":
                add(e.at, PREEMPT, f"preempt {who} for {for_service.get(a.id, '?')}", a.id)
            elif e.kind == "notice":
                add(e.at, NOTICE, f"notice to {who}", a.id)
            elif e.kind in _EXIT_KINDS:
                add(e.at, EXIT, f"{who} ended {e.kind.upper()}", a.id)
    for ev in store.service_events(SERVICE, limit=10_000):
        if ev.kind in _REPLICA_KINDS:
            # Where a start or a wake places the replica is in its message ("start on n1 GPUs 2,3").
            where = f": {ev.message}" if ev.kind in ("starting", "waking") else ""
            add(ev.at, REPLICA, f"replica {ev.replica_id} {ev.kind.upper()}{where}")
        elif ev.kind == "alert":
            add(ev.at, REPLICA, f"alert: {ev.message}")
    for r in reclaims:
        victims = ", ".join(name_of.get(v, f"attempt {v}") for v in r.victims)
        wake = f" (wake {r.replica_id})" if r.replica_id else ""
        add(r.decided_at, RECLAIM_OPEN, f"reclaim for {r.service}{wake} opened: {victims}")
        if r.state != ReclaimState.OPEN:
            ended = r.healthy_at or r.freed_at or r.decided_at
            add(ended, RECLAIM_DONE, f"reclaim for {r.service} {r.state.value}")
    return sorted(log)


def show(title: str, log: list[Decision]) -> str:
    return "\n".join([f"{title} ({len(log)} decisions):", *map(str, log)])


# -- the real run -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RealRun:
    origin: float  # when chat/0 was started (epoch s)
    submitted: dict[str, float]  # job name → submit time, from origin
    load_up: float  # from origin
    load_down: float  # from origin
    settled: float  # from origin
    log: list[Decision]


def _settled(st: Stack, jobs: dict[str, str], park: str) -> bool:
    replicas = {r["id"]: r for r in st.get(f"/v1/services/{SERVICE}")["replicas"]}
    if [replicas[k]["state"] for k in sorted(replicas)] != ["SERVING", "PARKED"]:
        return False
    if replicas[f"{SERVICE}/1"]["parked_as"] != park:
        return False
    if any(r["state"] == "OPEN" for r in st.get("/v1/reclaims")):
        return False
    # The preempted trainer runs its second attempt, the others still their first.
    preempted = TRAINERS[0][0]
    for name, job in jobs.items():
        attempts = st.train_attempts(job)
        number = 2 if name == preempted else 1
        if not attempts or (attempts[-1]["state"], attempts[-1]["number"]) != ("RUNNING", number):
            return False
    return True


def run_real(root: Path, park: str, data: Path, ports: tuple[int, int, int]) -> RealRun:
    """The real story in `root` (`ports`: the API's, the gateway's, the replicas' first)."""
    root.mkdir()
    with lowtide_up(root, config_doc(park, *ports)) as st:
        jobs = {name: st.submit(trainer_job(name, every, data)) for name, every in TRAINERS}
        wait_until(
            lambda: all((a := st.train_attempts(j)) and a[-1]["state"] == "RUNNING" for j in jobs.values()),
            timeout=30,
            what="every trainer running",
        )
        cheap = jobs[TRAINERS[0][0]]
        wait_until(
            lambda: st.get(f"/v1/jobs/{cheap}")["steps"][0]["last_checkpoint"],
            timeout=30,
            what="a first checkpoint",
        )
        requests = synthetic(
            "constant",
            rate=LOAD_RATE,
            duration_s=300,
            seed=1,
            tokens=FixedTokens(PROMPT_TOKENS, OUTPUT_TOKENS),
        )
        load_up = time.time()
        with Surge(requests, st.gateway) as surge:
            wait_until(
                lambda: any(r["state"] == "DONE" for r in st.get("/v1/reclaims")),
                timeout=60,
                what="a finished reclaim",
            )
            load_down = time.time()
            report = surge.stop()
        assert report.failed == 0, report.format_text()
        wait_until(lambda: _settled(st, jobs, park), timeout=90, what="chat/1 parked, every trainer running")
        settled = time.time()
        store = Store.open(f"sqlite:///{root / 'state' / 'lowtide.db'}", migrate_schema=False)
        try:
            first = min(e.at for e in store.service_events(SERVICE, limit=10_000) if e.kind == "starting")
            submitted = {name: store.job_detail(j).job.submitted_at for name, j in jobs.items()}
            log = decision_log(store, first, [(load_up, "load up"), (load_down, "load down")])
        finally:
            store.close()
    return RealRun(
        origin=first,
        submitted={n: t - first for n, t in submitted.items()},
        load_up=load_up - first,
        load_down=load_down - first,
        settled=settled - first,
        log=[d for d in log if d.at <= settled - first],  # nothing the shutdown did
    )


# -- the replay ---------------------------------------------------------------------------------


class ReplayWorld(SimWorld):
    """SimWorld with each trainer's own checkpoint cadence (the scenario has one for all jobs)."""

    def __init__(self, scenario: Scenario, every_s: dict[str, float]) -> None:
        super().__init__(scenario)
        self.every_s = every_s

    def _submit_due(self, now: float) -> None:
        super()._submit_due(now)
        for job_id, job in self.trace.submitted.items():
            behaviour = self.executor.behaviours[job_id]
            if behaviour.checkpoint_every_s != self.every_s[job.name]:
                self.executor.behaviours[job_id] = replace(
                    behaviour, checkpoint_every_s=self.every_s[job.name]
                )


def replay(real: RealRun, park: str) -> tuple[ReplayWorld, list[Decision]]:
    settings = Settings(**config_doc(park))
    curve = LoadCurve(
        (0.0, real.load_up, real.load_down),
        (0.0, LOAD_RATE, 0.0),
        prompt_tokens=PROMPT_TOKENS,
        output_tokens=OUTPUT_TOKENS,
    )
    jobs = tuple(
        ResearchJob(name, "research", real.submitted[name], TRAINER_GPUS, 1e9, "normal")
        for name, _ in TRAINERS
    )
    end = real.settled + SETTLE_S
    base = cluster_scenario(settings, curve, jobs, days=end / 86400.0, seed=0)
    engine = EngineConfig.for_gpus(
        GPUS_PER_REPLICA, max_num_seqs=MAX_NUM_SEQS, cold_start_s=COLD_START_S, wake_s=WAKE_S
    )
    service = replace(
        base.services[0],
        # The real run's replicas and load, as measured (not the fleet's fit of a light load).
        curve=curve,
        load_scale=1.0,
        capacity=ReplicaCapacity.from_engine(PROMPT_TOKENS, OUTPUT_TOKENS, engine),
        times=ReplicaTimes(
            startup_s=engine.cold_start_s, wake_s=engine.wake_s, park_sleep_s=0.1, park_stop_s=0.5
        ),
    )
    scenario = replace(
        base,
        services=(service,),
        steps=StepDefaults(
            grace_s=JOB_GRACE_S, restart_s=RESTART_S, checkpoint_every_s=0.0, checkpoint_write_s=STEP_S
        ),
    )
    world = ReplayWorld(
        scenario, {name: (every * STEP_S if every < NEVER else 0.0) for name, every in TRAINERS}
    )
    world.run()
    inputs = [(scenario.start + real.load_up, "load up"), (scenario.start + real.load_down, "load down")]
    return world, decision_log(world.store, scenario.start, inputs)


# -- the test -----------------------------------------------------------------------------------

PARKS = ("sleep", "stop")


def test_the_simulator_replays_the_real_reclaim_story_decision_for_decision(tmp_path: Path) -> None:
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "lowtide.examples.prep", "--out", str(data)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    # Both park modes at once: each run mostly waits (cold starts, a drain, a stabilisation window).
    ports = free_ports(2 * len(PARKS))
    base = consecutive_ports(2 * len(PARKS))
    with ThreadPoolExecutor(len(PARKS)) as pool:
        futures = {
            park: pool.submit(
                run_real, tmp_path / park, park, data, (ports[2 * i], ports[2 * i + 1], base + 2 * i)
            )
            for i, park in enumerate(PARKS)
        }
        reals = {park: f.result() for park, f in futures.items()}

    for park, real in reals.items():
        world, sim = replay(real, park)
        print(show(f"real run, park {park}", real.log), show(f"replay, park {park}", sim), "", sep="\n\n")
        # The story itself, on the real run (the replay must then match it entry for entry).
        whats = [d.what for d in real.log]
        often = f"{TRAINERS[0][0]}/train"
        assert f"reclaim for {SERVICE} opened: {often}#1" in whats, show("real", real.log)
        assert f"{often}#1 ended INTERRUPTED" in whats, show("real", real.log)
        assert f"start {often}#2 on n1 GPUs 2,3 resuming from its checkpoint" in whats, show("real", real.log)
        assert world.trace.tick_errors == 0

        assert [d.what for d in sim] == whats, (
            f"park {park}: the replay decided differently:\n"
            + show("real", real.log)
            + "\n\n"
            + show("replay", sim)
        )
