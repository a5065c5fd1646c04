"""How fast the simulator runs lowtide's loop: simulated seconds per wall second, and how it grows.

    .venv/bin/python benchmarks/simulate.py [--days 14] [--long-days 90] [--skip-growth] [--profile]

The headline: 14 days of the default fleet (32 nodes × 8 GPUs, 4-GPU replicas), ServeGen m-large
load (all clients), Alibaba GPU v2023 research jobs (1,000+), policy `continuous`, plus the 90-day
run; then the growth of wall time with days (1, 3, 7, 14), GPUs (64, 128, 256) and jobs (250,
500, 1,000) on 7 days. Without ../shared/data (LOWTIDE_DATA_DIR) it falls back to the synthetic
day/night load and synthetic jobs and says so. Prints a table (wall and CPU seconds: on a shared
machine only the CPU time compares) and writes results/simulate.json.
Not a test: nothing here asserts a time (docs/architecture.md §10).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from lowtide.emulator.traces import data_dir
from lowtide.sim.fleet import FleetOptions, default_scenario
from lowtide.sim.jobs import job_workload, parse_jobs_spec
from lowtide.sim.load import load_curve
from lowtide.sim.run import run_one
from lowtide.sim.scenario import Scenario

RESULTS = Path(__file__).resolve().parent / "results"


def specs() -> tuple[str, str, bool]:
    root = data_dir()
    servegen = root / "traces" / "servegen-m-large"
    alibaba = root / "traces" / "alibaba-gpu-v2023" / "openb_pod_list_default.csv"
    if servegen.is_dir() and alibaba.is_file():
        return f"servegen:{servegen}", f"alibaba:{alibaba}", True
    return "synthetic", "synthetic#jobs=1000", False


def scenario(days: float, *, nodes: int = 32, jobs: int | None = None) -> Scenario:
    load, job_text, _ = specs()
    if jobs is not None:
        job_text += f"#jobs={jobs}"
    curve = load_curve(load, days=days)
    workload = job_workload(parse_jobs_spec(job_text), days=days, seed=1, max_gpus=8)
    return default_scenario(curve, workload.jobs, days=days, seed=1, options=FleetOptions(nodes=nodes))


def timed(s: Scenario, label: str) -> dict[str, Any]:
    cpu = time.process_time()
    run = run_one(s, "continuous", oracle_s=0.0, price=0.0, currency="USD", baseline=None)
    cpu = time.process_time() - cpu  # what a run costs on a shared machine, where wall time lies
    row = {
        "run": label,
        "days": s.days,
        "gpus": s.pool_gpus,
        "jobs": len(s.jobs),
        "wall_s": round(run.wall_s, 3),
        "cpu_s": round(cpu, 3),
        "ticks": run.summary["ticks"],
        "ms_per_tick": round(1000 * run.wall_s / max(1, run.summary["ticks"]), 3),
        "cpu_ms_per_tick": round(1000 * cpu / max(1, run.summary["ticks"]), 3),
        "simulated_s_per_wall_s": round(s.days * 86400 / run.wall_s),
        "gpu_hours_harvested": round(run.summary["gpu_hours_harvested"], 1),
        "preemptions": run.summary["preemptions"],
    }
    print(
        f"{label:<22} {row['days']:>5g} d {row['gpus']:>4} GPUs {row['jobs']:>5} jobs  "
        f"{row['wall_s']:>7.2f} s wall  {row['cpu_s']:>7.2f} s CPU  {row['ticks']:>6} ticks  "
        f"{row['ms_per_tick']:>6.3f} ms/tick  {row['simulated_s_per_wall_s']:>9,} sim-s/s"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--days", type=float, default=14.0)
    parser.add_argument("--long-days", type=float, default=90.0)
    parser.add_argument("--skip-growth", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile the headline run (top 30).")
    args = parser.parse_args()
    load, jobs, real = specs()
    print(f"load {load}\njobs {jobs}\n" + ("" if real else "(../shared/data absent: synthetic inputs)\n"))
    rows = []
    headline = scenario(args.days)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
    rows.append(timed(headline, "headline"))
    if args.profile:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    if args.long_days:
        rows.append(timed(scenario(args.long_days), "long"))
    if not args.skip_growth:
        for days in (1.0, 3.0, 7.0):
            rows.append(timed(replace(headline, days=days), "growth: days"))
        for nodes in (8, 16):
            rows.append(timed(scenario(7.0, nodes=nodes), "growth: GPUs"))
        for n in (250, 500, 1000):
            rows.append(timed(scenario(7.0, jobs=n), "growth: jobs"))
    RESULTS.mkdir(exist_ok=True)
    document = {
        "benchmark": "simulate",
        "load": load,
        "jobs": jobs,
        "real_traces": real,
        "machine": {
            "python": platform.python_version(),
            "processor": platform.machine(),
            "load_average": [round(x, 2) for x in os.getloadavg()],  # at the end of the runs
        },
        "at": time.time(),
        "rows": rows,
    }
    (RESULTS / "simulate.json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {RESULTS / 'simulate.json'}")


if __name__ == "__main__":
    main()
