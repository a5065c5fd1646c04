"""Benchmark: lowtide under faults, the long form of `tests/faults/` (issue 12).

Runs the fault harness (`tests/faults/harness.py`, imported from there: one implementation for
the tests and this script) against real `lowtide up` processes, one phase per fault kind asked
for, each on a fresh store and work dir:

1. **kills** (`--kills N`, on `--store`): N random `kill -9`s of lowtide (some during its
   start-up), of the gateway process, of step shims, steps and replicas, during load surges
   through the gateway that make the service take GPUs back from research (reclaims, preemptions);
2. **restarts** (`--restarts N`): N control-plane restarts (alternately SIGTERM and `kill -9`)
   under a steady load through the gateway; every request that failed during one is counted;
3. **store outage** (`--store-outage S`): the store unwritable for S seconds (SQLite: a held
   `BEGIN EXCLUSIVE`; PostgreSQL: the database read-only and its backends terminated), steps
   killed meanwhile: their exits must be recorded and their GPUs freed once it recovers;
4. **clock jump** (`--clock-jump S`): lowtide's wall clock moved +S then back (−S) through
   `LOWTIDE_FAULT_CLOCK_OFFSET_FILE`, each right after cancelling a step that ignores SIGTERM;
   its deadline kill must still come one grace after the cancel;
5. **two control planes** (`--two-control-planes`, PostgreSQL): a second `lowtide up` on the same
   database (its own state dir; the same work and artifact roots); one must act, and after the
   leader's `kill -9` the standby must take over within the lease time.

Every phase checks the invariants while it runs (every 0.5 s: the store read directly, read-only,
and `GET /v1/pool`) and at its end: no acknowledged job lost, no finished step rerun, no step
running twice, no orphan process, no GPU double-booked, the ledger equal to capacity × time, every
job SUCCEEDED with the results of an uninterrupted run, and the phase's own (gateway failures
during restarts, exits lost in the outage, deadline shift, planes acting together, takeover).

Prints a table per phase (faults injected, every invariant's violation count, figures) and writes
JSON (`--out`, default `results/chaos.json`). Exits 1 if any invariant was violated or a phase
failed. Not a test: it asserts nothing about time (docs/architecture.md §10); the bounds it checks
(a tick plus slack) are the issue's behaviour, and their figures are printed.

Run:  .venv/bin/python benchmarks/chaos.py [--duration 120] [--seed 0] [--kills 30] [--restarts 20]
      [--store-outage 40] [--clock-jump 600] [--two-control-planes] [--store sqlite|postgresql]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from faults.harness import INVARIANTS, PG_ADMIN_URL, Outcome, Plan, run_chaos

DEFAULT_OUT = Path(__file__).parent / "results" / "chaos.json"


def phases(args: argparse.Namespace) -> list[tuple[str, Plan]]:
    base = Plan(
        seed=args.seed,
        duration_s=args.duration,
        jobs=args.jobs,
        kills=0,
        store=args.store,
        pg_url=args.pg_url,
        surges=False,
        tick_s=args.tick,
    )
    out: list[tuple[str, Plan]] = []
    if args.kills:
        out.append(("kills", dataclasses.replace(base, kills=args.kills, surges=True)))
    if args.restarts:
        out.append(("restarts", dataclasses.replace(base, restarts=args.restarts)))
    if args.store_outage:
        duration = max(args.duration, args.store_outage * 2)
        out.append(
            ("store_outage", dataclasses.replace(base, store_outage_s=args.store_outage, duration_s=duration))
        )
    if args.clock_jump:
        out.append(("clock_jump", dataclasses.replace(base, clock_jump_s=args.clock_jump)))
    if args.two_control_planes:
        out.append(
            ("two_control_planes", dataclasses.replace(base, two_control_planes=True, store="postgresql"))
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of faults per phase")
    parser.add_argument("--seed", type=int, default=0, help="random choices (which fault, victim, when)")
    parser.add_argument("--kills", type=int, default=30, help="random kill -9s in the kills phase (0: skip)")
    parser.add_argument(
        "--restarts", type=int, default=20, help="control-plane restarts under load (0: skip)"
    )
    parser.add_argument("--store-outage", type=float, default=40.0, help="seconds unwritable (0: skip)")
    parser.add_argument("--clock-jump", type=float, default=600.0, help="seconds of the ± jump (0: skip)")
    parser.add_argument(
        "--two-control-planes", action="store_true", help="run the two-planes phase (PostgreSQL)"
    )
    parser.add_argument("--store", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument(
        "--pg-url", default=PG_ADMIN_URL, help="PostgreSQL server (a database is made per phase)"
    )
    parser.add_argument("--jobs", type=int, default=24, help="research jobs per phase")
    parser.add_argument("--tick", type=float, default=0.3, help="tick_seconds")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--keep", action="store_true", help="keep each phase's work dir (logs, database)")
    args = parser.parse_args(argv)

    results: dict[str, Any] = {}
    outcomes: list[tuple[str, Outcome]] = []
    began = time.monotonic()
    for name, plan in phases(args):
        workdir = Path(tempfile.mkdtemp(prefix=f"lowtide-chaos-{name}-"))
        print(f"== phase {name}: {workdir}", flush=True)
        outcome = run_chaos(plan, workdir)
        outcomes.append((name, outcome))
        print(outcome.table(), flush=True)
        results[name] = {**outcome.to_json(), "workdir": str(workdir) if args.keep else None}
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    totals = {name: sum(o.violations.get(name, 0) for _, o in outcomes) for name in INVARIANTS}
    print("\n== all phases")
    print(f"  {'phase':<20} {'faults':>7} {'violations':>11} {'wall s':>8}")
    for name, o in outcomes:
        status = "ok" if o.ok else ("ERROR" if o.error else "VIOLATED")
        print(
            f"  {name:<20} {sum(o.faults.values()):>7} {o.total_violations:>11} "
            f"{o.figures.get('wall_s', 0):>8}  {status}"
        )
    print("  invariant violations, all phases: " + ", ".join(f"{k} {v}" for k, v in totals.items()))
    output = {
        "benchmark": "chaos (kill -9, restarts under load, store outage, clock jumps, two control planes)",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "parameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "phases": results,
        "invariant_violations": totals,
        "wall_s": round(time.monotonic() - began, 1),
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(output, indent=2, default=str) + "\n")
    print(f"\nwrote {args.out} ({output['wall_s']:.0f} s in all)")
    return 0 if outcomes and all(o.ok for _, o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
