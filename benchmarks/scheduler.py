"""Benchmark: how long one `decide()` tick takes on a large, busy pool.

Synthetic snapshot (fixed seed): 250 nodes x 8 GPUs, a few nodes partly held by inference
replicas, 1,000 running steps of 1/2/4/8 GPUs placed consistently (no GPU held twice),
10,000 queued steps of 0/1/2/4/8 GPUs over 5 priority levels and 20 teams with random
submit times, some in retry backoff and some requeued after preemption.

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
from lowtide.policy.scheduler import SchedulerPolicy, decide
from lowtide.policy.snapshot import QueuedStep, RunningStep, Snapshot

NODES = 250
GPUS_PER_NODE = 8
RUNNING = 1_000
QUEUED = 10_000
TEAMS = 20
PRIORITIES = (0, 10, 20, 50, 100)
NOW = 1_700_000_000.0
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
    for _ in range(args.warmup):
        plan = decide(snapshot, policy)

    timings_ms: list[float] = []
    for _ in range(args.runs):
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
        "plan": {
            "starts": len(plan.starts),
            "waiting": len(plan.waiting),
            "reservations": len(plan.reservations),
        },
        "runs": args.runs,
        "warmup": args.warmup,
        **figures,
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        },
    }
    print(
        f"decide(): {len(snapshot.queued)} queued, {len(snapshot.running)} running on "
        f"{NODES}x{GPUS_PER_NODE} GPUs -> {len(plan.starts)} starts, {len(plan.reservations)} reservations"
    )
    print(
        f"{args.runs} runs: min {figures['min_ms']:.1f} ms, median {figures['median_ms']:.1f} ms, "
        f"p95 {figures['p95_ms']:.1f} ms"
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
