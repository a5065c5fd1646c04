"""Benchmark: control-loop ticks while one N-step CPU fan-out fills the queue (issue 10).

An embedded lowtide (the API app and the control loop of `lowtide.wiring.build`, no HTTP server,
no loop thread) on a fresh SQLite file store in a temporary directory, one node with no GPUs and
`scheduler.max_cpu_steps_per_node` (default 4). One job of `--steps` (10,000) steps running `true`
is submitted through the API (`POST /v1/jobs`, auth off); the script then drives
`loop.tick()` by hand, `--gap` seconds apart, for `--ticks` ticks (or until the job ends with
`--until-done`). Reported:

- per-tick wall time (min / median / p95 / max ms) over the measured ticks, all with the queue
  full (thousands of steps READY);
- the store + scheduler part alone, measured beside each tick: `store.snapshot()`, then
  `store.job_views([job])` with `policy.dag.advance`, then `policy.scheduler.decide()`
  (what grows with the queue; the tick also polls processes and starts them);
- steps started per second (attempts started over the measured wall time, gaps included);
- the most steps seen RUNNING at once after any tick (`store.counts()`): it must not exceed the
  limit (`within_limit` in the JSON; the script exits 1 if it does).

Run:  .venv/bin/python benchmarks/fanout.py [--steps 10000] [--limit 4] [--ticks 20] [--gap 0.05]
      [--until-done] [--profile] [--out PATH]
Writes `results/fanout.json`. Not a test: nothing here asserts a time (docs/architecture.md §10).
Step processes are `true` and end at once; the run waits for the ones it started before it exits.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from fastapi.testclient import TestClient
from harness import percentile

from lowtide.config import load_settings
from lowtide.policy.dag import advance
from lowtide.policy.scheduler import decide
from lowtide.wiring import Embedded, build

DEFAULT_OUT = Path(__file__).parent / "results" / "fanout.json"


def make_lowtide(tmp: Path, steps: int, limit: int) -> Embedded:
    config: dict[str, Any] = {
        "state_dir": str(tmp / "state"),
        "artifact_root": str(tmp / "artifacts"),
        "tick_seconds": 0.1,
        "nodes": [{"name": "cpu-node", "gpus": 0}],
        "auth": {"enabled": False},
        "scheduler": {"max_cpu_steps_per_node": limit, "max_steps_per_job": max(steps, 1)},
        "api": {"port": 0},
    }
    path = tmp / "lowtide.yaml"
    path.write_text(yaml.safe_dump(config))
    return build(load_settings(path))


def submit(lt: Embedded, steps: int) -> tuple[str, float]:
    doc = {"name": "fanout", "steps": [{"name": f"s{i}", "command": ["true"]} for i in range(steps)]}
    started = time.perf_counter()
    resp = TestClient(lt.app).post(
        "/v1/jobs", content=yaml.safe_dump(doc), headers={"Content-Type": "application/yaml"}
    )
    took = time.perf_counter() - started
    if resp.status_code != 201:
        raise SystemExit(f"submit failed: HTTP {resp.status_code}: {resp.text[:500]}")
    return str(resp.json()["id"]), took


def store_and_scheduler_s(lt: Embedded, job_id: str) -> float:
    """One pass of what scales with the queue: snapshot, the job's DAG view and advance, decide."""
    settings = lt.loop.settings
    started = time.perf_counter()
    snapshot = lt.store.snapshot(
        now=lt.clock.now(), nodes=settings.nodes, half_life_s=settings.scheduler.fair_share.half_life_s
    )
    for view in lt.store.job_views([job_id]):
        advance(view)
    decide(snapshot, settings.scheduler)
    return time.perf_counter() - started


def summary_ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "min_ms": round(ordered[0] * 1000, 2),
        "median_ms": round(statistics.median(ordered) * 1000, 2),
        "p95_ms": round(percentile(ordered, 95) * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--limit", type=int, default=4, help="scheduler.max_cpu_steps_per_node")
    parser.add_argument("--ticks", type=int, default=20, help="measured ticks (after 3 warm-up ticks)")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between ticks")
    parser.add_argument("--until-done", action="store_true", help="tick until the job ends")
    parser.add_argument("--profile", action="store_true", help="print the cProfile top 25 of the ticks")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.steps < 1 or args.limit < 1 or args.ticks < 1:
        parser.error("--steps, --limit and --ticks must be ≥ 1")

    with tempfile.TemporaryDirectory(prefix="lowtide-fanout-") as tmp:
        lt = make_lowtide(Path(tmp), args.steps, args.limit)
        try:
            job_id, submit_s = submit(lt, args.steps)
            for _ in range(3):  # warm-up: the first starts, the first exits
                lt.loop.tick()
                time.sleep(args.gap)
            result = measure(lt, job_id, args)
            result["submit_s"] = round(submit_s, 3)
        finally:
            drain(lt)
            lt.close()

    result.update(
        steps=args.steps,
        limit=args.limit,
        gap_s=args.gap,
        backend="sqlite",
        machine={"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count()},
    )
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if result["within_limit"] else 1


def measure(lt: Embedded, job_id: str, args: argparse.Namespace) -> dict[str, Any]:
    profiler = cProfile.Profile() if args.profile else None
    ticks: list[float] = []
    parts: list[float] = []
    max_running = 0
    succeeded_before = lt.store.counts()["steps"].get("SUCCEEDED", 0)
    queued_min = args.steps
    t0 = time.perf_counter()
    starts = 0
    while True:
        if profiler is not None:
            profiler.enable()
        began = time.perf_counter()
        report = lt.loop.tick()
        ticks.append(time.perf_counter() - began)
        if profiler is not None:
            profiler.disable()
        starts += report.started
        counts = lt.store.counts()
        max_running = max(max_running, counts["steps"].get("RUNNING", 0))
        queued_min = min(queued_min, counts["steps"].get("READY", 0))
        if not args.until_done:
            parts.append(store_and_scheduler_s(lt, job_id))
        done = not (counts["jobs"].get("QUEUED") or counts["jobs"].get("RUNNING"))
        if done or (not args.until_done and len(ticks) >= args.ticks):
            break
        time.sleep(args.gap)
    wall = time.perf_counter() - t0
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    finished = lt.store.counts()["steps"].get("SUCCEEDED", 0) - succeeded_before
    return {
        "ticks": len(ticks),
        "tick": summary_ms(ticks),
        "store_and_scheduler": summary_ms(parts) if parts else None,
        "queued_at_least": queued_min,
        "starts": starts,
        "starts_per_s": round(starts / wall, 2),
        "succeeded_during_run": finished,
        "wall_s": round(wall, 3),
        "max_running": max_running,
        "within_limit": max_running <= args.limit,
        "job_states": lt.store.counts()["jobs"],
    }


def drain(lt: Embedded) -> None:
    """Cancel the job and tick until no step process is left (they are `true`: it is quick)."""
    try:
        for job in lt.store.list_jobs(limit=-1):
            lt.store.request_cancel(job.id, by="bench", now=lt.clock.now())
        deadline = time.monotonic() + 60
        while lt.store.active_attempts() and time.monotonic() < deadline:
            lt.loop.tick()
            time.sleep(0.05)
    except Exception as exc:  # a benchmark cleanup: say so, never hide the figures
        print(f"cleanup: {type(exc).__name__}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
