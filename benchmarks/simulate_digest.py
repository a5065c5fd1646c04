"""A digest of everything a simulated run decided: the gate that a speed-up changed no decision.

    .venv/bin/python benchmarks/simulate_digest.py [--days 14] [--first D] [--save FILE | --check FILE]

Runs the headline scenario of `benchmarks/simulate.py` (same fleet, load, jobs and seed; `--first`
runs only its first D days, the way the benchmark's growth rows do, for a quicker check) and
hashes, part by part: the summary (without its wall-clock figures), the tick count and tick
errors, every submitted job's detail (job, steps, attempts, checkpoints, events), every
service's event log, the reclaims, the replicas, the GPU ledger's intervals and the timeline
samples. Prints one line per part plus the CPU and wall seconds of the
run; `--save` writes the digests as JSON, `--check` compares with a saved file and exits 1 on any
difference (naming the parts that differ). Floats are hashed through `repr`, so "identical"
means bit for bit. Not a test (a run takes tens of seconds); run it before and after a change of
the loop, the policies or the simulator that must not change a decision.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from simulate import scenario

from lowtide.sim.run import run_one

_WALL_KEYS = frozenset({"wall_s", "simulated_s_per_wall_s"})


def _hash(items: Iterable[object]) -> str:
    h = hashlib.sha256()
    for item in items:
        h.update(repr(item).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def digests(days: float, first: float | None) -> tuple[dict[str, str], dict[str, Any]]:
    s = scenario(days)
    if first is not None:
        s = replace(s, days=first)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    run = run_one(s, "continuous", oracle_s=0.0, price=0.0, currency="USD", baseline=None)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    world, trace = run.world, run.trace
    assert world is not None and trace is not None
    store = world.store
    summary = {k: v for k, v in run.summary.items() if k not in _WALL_KEYS}
    services = sorted(svc.name for svc in s.services)
    parts = {
        "summary": _hash([json.dumps(summary, sort_keys=True, default=repr)]),
        "ticks": _hash([trace.ticks, trace.tick_errors]),
        "jobs": _hash(store.job_detail(job_id) for job_id in trace.submitted),
        "service_events": _hash(e for name in services for e in store.service_events(name, limit=-1)),
        "reclaims": _hash(store.reclaims(limit=-1)),
        "replicas": _hash(store.replicas()),
        "ledger": _hash(
            (iv.gpu, iv.holder_kind, iv.holder_id, iv.job_id, iv.team, iv.started_at, iv.ended_at)
            for iv in store._ledger.intervals  # the full history, as a report reads it
        ),
        "samples": _hash(trace.samples),
    }
    info = {
        "days": days,
        "first": first,
        "ticks": trace.ticks,
        "tick_errors": trace.tick_errors,
        "cpu_s": round(cpu, 2),
        "wall_s": round(wall, 2),
        "gpu_hours_harvested": run.summary["gpu_hours_harvested"],
        "preemptions": run.summary["preemptions"],
        "slo_violation_minutes": run.summary["slo_violation_minutes"],
    }
    return parts, info


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--days", type=float, default=14.0)
    parser.add_argument("--first", type=float, help="run only the first FIRST days of the scenario")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--save", type=Path, help="write the digests to this JSON file")
    group.add_argument("--check", type=Path, help="compare with digests saved by --save")
    args = parser.parse_args()
    parts, info = digests(args.days, args.first)
    for name, value in parts.items():
        print(f"{name:<16} {value}")
    print(json.dumps(info))
    if args.save:
        args.save.write_text(json.dumps({"info": info, "parts": parts}, indent=2) + "\n")
    if args.check:
        saved = json.loads(args.check.read_text())
        if (saved["info"]["days"], saved["info"]["first"]) != (info["days"], info["first"]):
            sys.exit(f"{args.check} was saved for another run: {saved['info']}")
        differ = [k for k in parts if saved["parts"].get(k) != parts[k]]
        if differ:
            print(f"DIFFERENT from {args.check}: {', '.join(differ)}")
            sys.exit(1)
        print(f"identical to {args.check}")


if __name__ == "__main__":
    main()
