"""Benchmark: how long one `decide()` tick takes on a large, busy pool.

Synthetic snapshot (fixed seed): 250 nodes x 8 GPUs, a few nodes partly held by inference
replicas, 1,000 running steps of 1/2/4/8 GPUs placed consistently (no GPU held twice),
10,000 queued steps of 0/1/2/4/8 GPUs over 5 priority levels and 20 teams with random
submit times, some in retry backoff and some requeued after preemption.

Two more cases, measured the same way and written under "cases" in the JSON:
- "cpu_fanout": the issue's 10,000-step CPU fan-out. One host (one node, 8 GPUs), one user's job of
  10,000 queued `gpus: 0` steps plus 200 queued steps (0-2 GPUs) of 10 other users, 40 CPU-only steps
  already running, with `max_cpu_steps_per_node` 64 and `max_cpu_steps_per_user` 48: the decision
  starts the few that fit and gives every other step its limit as its reason.
- "mixed_quotas": the mixed snapshot with `team_quotas` for 10 of the 20 teams (60 GPUs each), so
  that the borrowing pass has work.

Run:  .venv/bin/python benchmarks/scheduler.py [--runs 30] [--warmup 3] [--profile]
Prints min / median / p95 milliseconds per tick and writes them, with the machine, as JSON.
Not a test: nothing here asserts a time (docs/architecture.md §10).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

from harness import percentile

from lowtide.domain.gpus import GpuRef, Node
from lowtide.policy.fairshare import FairSharePolicy
from lowtide.policy.plan import SchedulePlan
from lowtide.policy.scheduler import SchedulerPolicy, decide
from lowtide.policy.snapshot import QueuedStep, RunningStep, Snapshot

NODES = 250
GPUS_PER_NODE = 8
RUNNING = 1_000
QUEUED = 10_000
TEAMS = 20
PRIORITIES = (0, 10, 20, 50, 100)
NOW = 1_700_000_000.0
FANOUT_STEPS = 10_000
DEFAULT_OUT = Path(__file__).parent / "results" / "scheduler.json"


def build_snapshot(seed: int = 42) -> Snapshot:
    rng = random.Random(seed)
    names = [f"node-{i:03d}" for i in range(NODES)]
    nodes = tuple(Node(name, tuple(range(GPUS_PER_NODE))) for name in names)
    free = {name: list(range(GPUS_PER_NODE)) for name in names}

    # Inference replicas (4 GPUs each) on 20 nodes: those GPUs are not lendable.
    unavailable: set[GpuRef] = set()
    for name in rng.sample(names, 20):
        unavailable.update(GpuRef(name, i) for i in free[name][4:])
        del free[name][4:]

    # Placed largest first on a random node that still fits: with power-of-two sizes that
    # never fragments, so every step lands and no GPU is held twice.
    sizes = sorted(rng.choices([1, 2, 4, 8], weights=[65, 20, 10, 5], k=RUNNING), reverse=True)
    running: list[RunningStep] = []
    for attempt_id, size in enumerate(sizes, start=1):
        candidates = [name for name in names if len(free[name]) >= size]
        node = rng.choice(candidates)
        gpus = tuple(free[node][:size])
        del free[node][:size]
        running.append(
            RunningStep(
                attempt_id=attempt_id,
                job_id=f"run-{attempt_id:05d}",
                step="train",
                team=f"team-{rng.randrange(TEAMS):02d}",
                priority=rng.choice(PRIORITIES),
                node=node,
                gpus=gpus,
                started_at=NOW - rng.uniform(0, 48 * 3600),
            )
        )

    queued = tuple(
        QueuedStep(
            job_id=f"job-{i // 3:05d}",
            step=f"step-{i % 3}",
            team=f"team-{rng.randrange(TEAMS):02d}",
            priority=rng.choice(PRIORITIES),
            gpus=rng.choices([0, 1, 2, 4, 8], weights=[10, 40, 25, 15, 10])[0],
            submitted_at=NOW - rng.uniform(0, 7 * 24 * 3600),
            step_index=i % 3,
            eligible_at=NOW + rng.uniform(1, 600) if rng.random() < 0.05 else 0.0,
            preempted=rng.random() < 0.03,
            retry_note="attempt 2 of 3",
        )
        for i in range(QUEUED)
    )
    team_usage = {f"team-{t:02d}": rng.uniform(0, 2e6) for t in range(TEAMS)}
    return Snapshot(
        now=NOW,
        nodes=nodes,
        running=tuple(running),
        queued=queued,
        unavailable=frozenset(unavailable),
        team_usage=team_usage,
    )


def build_cpu_fanout_snapshot(seed: int = 42) -> Snapshot:
    """One host, one user's 10,000-step CPU fan-out behind 40 running CPU-only steps (see above)."""
    rng = random.Random(seed)
    node = Node("host", tuple(range(8)))
    running = tuple(
        RunningStep(
            attempt_id=i + 1,
            job_id="fanout",
            step=f"s{i:05d}",
            team="nlp",
            priority=50,
            node="host",
            gpus=(),
            started_at=NOW - rng.uniform(0, 600),
            owner="alice",
        )
        for i in range(40)
    )
    fanout = [
        QueuedStep(
            job_id="fanout",
            step=f"s{i:05d}",
            team="nlp",
            priority=50,
            gpus=0,
            submitted_at=NOW - 900,
            step_index=i,
            owner="alice",
        )
        for i in range(40, 40 + FANOUT_STEPS)
    ]
    others = [
        QueuedStep(
            job_id=f"job-{i:03d}",
            step="train",
            team=f"team-{i % 5}",
            priority=rng.choice(PRIORITIES),
            gpus=rng.choice([0, 1, 2]),
            submitted_at=NOW - rng.uniform(0, 3600),
            step_index=0,
            owner=f"user-{i % 10}",
        )
        for i in range(200)
    ]
    return Snapshot(now=NOW, nodes=(node,), running=running, queued=tuple(fanout + others))


def measure(
    snapshot: Snapshot, policy: SchedulerPolicy, runs: int, warmup: int
) -> tuple[dict[str, float], SchedulePlan]:
    """Milliseconds per `decide()` (min, median, p95, max) over `runs` after `warmup`, and the plan."""
    plan = decide(snapshot, policy)
    for _ in range(warmup):
        plan = decide(snapshot, policy)
    timings_ms: list[float] = []
    for _ in range(runs):
        started = time.perf_counter()
        plan = decide(snapshot, policy)
        timings_ms.append((time.perf_counter() - started) * 1000)
    timings_ms.sort()
    figures = {
        "min_ms": round(timings_ms[0], 3),
        "median_ms": round(statistics.median(timings_ms), 3),
        "p95_ms": round(percentile(timings_ms, 95), 3),
        "max_ms": round(timings_ms[-1], 3),
    }
    return figures, plan


def _plan_counts(plan: SchedulePlan) -> dict[str, int]:
    return {"starts": len(plan.starts), "waiting": len(plan.waiting), "reservations": len(plan.reservations)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--profile", action="store_true", help="print the cProfile top 25 of one tick")
    args = parser.parse_args(argv)

    snapshot = build_snapshot(args.seed)
    policy = SchedulerPolicy(fair_share=FairSharePolicy(), max_reservations=1)
    figures, plan = measure(snapshot, policy, args.runs, args.warmup)

    fanout = build_cpu_fanout_snapshot(args.seed)
    fanout_policy = SchedulerPolicy(max_cpu_steps_per_node=64, max_cpu_steps_per_user=48)
    fanout_figures, fanout_plan = measure(fanout, fanout_policy, args.runs, args.warmup)
    quota_policy = SchedulerPolicy(
        fair_share=FairSharePolicy(), team_quotas={f"team-{t:02d}": 60 for t in range(0, TEAMS, 2)}
    )
    quota_figures, quota_plan = measure(snapshot, quota_policy, args.runs, args.warmup)
    cases = {
        "cpu_fanout": {
            "workload": {
                "nodes": 1,
                "queued_cpu_steps_of_one_user": FANOUT_STEPS,
                "queued_steps": len(fanout.queued),
                "running_cpu_steps": len(fanout.running),
                "max_cpu_steps_per_node": fanout_policy.max_cpu_steps_per_node,
                "max_cpu_steps_per_user": fanout_policy.max_cpu_steps_per_user,
            },
            "plan": _plan_counts(fanout_plan),
            **fanout_figures,
        },
        "mixed_quotas": {
            "workload": {
                "as": "the mixed case",
                "teams_with_quota": len(quota_policy.team_quotas),
                "quota": 60,
            },
            "plan": _plan_counts(quota_plan),
            **quota_figures,
        },
    }
    result = {
        "benchmark": "policy.scheduler.decide",
        "workload": {
            "nodes": NODES,
            "gpus_per_node": GPUS_PER_NODE,
            "unavailable_gpus": len(snapshot.unavailable),
            "running_steps": len(snapshot.running),
            "queued_steps": len(snapshot.queued),
            "teams": TEAMS,
            "priorities": len(PRIORITIES),
            "seed": args.seed,
        },
        "plan": _plan_counts(plan),
        "runs": args.runs,
        "warmup": args.warmup,
        **figures,
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        },
        "cases": cases,
    }
    print(
        f"decide(): {len(snapshot.queued)} queued, {len(snapshot.running)} running on "
        f"{NODES}x{GPUS_PER_NODE} GPUs -> {len(plan.starts)} starts, {len(plan.reservations)} reservations"
    )
    print(
        f"{args.runs} runs: min {figures['min_ms']:.1f} ms, median {figures['median_ms']:.1f} ms, "
        f"p95 {figures['p95_ms']:.1f} ms"
    )
    for name, case in cases.items():
        print(
            f"{name}: {case['plan']['starts']} starts, {case['plan']['waiting']} waiting -> "
            f"min {case['min_ms']:.1f} ms, median {case['median_ms']:.1f} ms, p95 {case['p95_ms']:.1f} ms"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")

    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(decide, snapshot, policy)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
