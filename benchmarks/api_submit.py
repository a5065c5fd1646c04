"""Benchmark: job submissions per second through the real HTTP API (`POST /v1/jobs`).

For each store backend (SQLite file, PostgreSQL) this starts `lowtide up` as a subprocess with a
generated config in a temporary directory (2 nodes x 8 declared GPUs, auth on, the store URL
under test), waits for /healthz, reads the admin token from the state dir's ``admin.token``, and
submits N job specs (YAML, three steps like examples/jobs/sft-dag.yaml) from C concurrent client
threads (one keep-alive httpx client each). It reports submissions/s over the wall time of the
measured phase, latency percentiles (p50/p95/p99, nearest rank) and the error count.

The workload keeps the control loop honest without spawning thousands of processes: every job's
root step needs 8 GPUs (`sleep 600`), so on 2 x 8 GPUs at most two root steps run and every other
job stays queued; the loop still wakes on each submit and plans over a growing queue, as it would
in production. At the end the server is stopped (SIGTERM) and the step processes it started,
which by design outlive the control plane, are killed by process group; every process carrying
this run's marker variable is then looked for (`ps e`) and the run fails loudly if one is left.

PostgreSQL: a fresh database ``lowtide_bench_<random>`` is created on --pg-url's server and dropped
afterwards; if the server is unreachable the backend is skipped with a note.

Run:  .venv/bin/python benchmarks/api_submit.py [--jobs 2000] [--concurrency 8]
          [--backends sqlite,postgresql] [--pg-url postgresql+psycopg://postgres@127.0.0.1:5432/test]
Writes benchmarks/results/api_submit.json (machine, parameters, figures).
Not a test: nothing here asserts a time (docs/architecture.md §10).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import sqlalchemy as sa
import yaml
from harness import MARKER_ENV, free_port, kill_marked, percentile, ps_leftovers, stop_process

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path(__file__).parent / "results" / "api_submit.json"
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
NODES = 2
GPUS_PER_NODE = 8

SPEC_TEMPLATE = """\
# api_submit benchmark job {n}: the root step needs a whole node, so nearly all jobs stay queued.
name: bench-{n}
team: team-{team}
priority: normal
grace_seconds: 5
max_retries: 1
params:
  lr: 0.05
  steps: 300
  shards: 4
steps:
  - name: prep
    image: ghcr.io/example/lowtide-steps:0.1
    command: [sleep, "600"]
    gpus: 8
  - name: train
    depends: [prep]
    image: ghcr.io/example/lowtide-steps:0.1
    command: [sleep, "600", --data, "{{{{inputs.prep}}}}", --out, "{{{{outputs}}}}",
              --steps, "{{{{params.steps}}}}", --lr, "{{{{params.lr}}}}"]
    gpus: 2
    checkpoint: true
  - name: eval
    depends: [train]
    image: ghcr.io/example/lowtide-steps:0.1
    command: [sleep, "600", --model, "{{{{inputs.train}}}}", --out, "{{{{outputs}}}}"]
    gpus: 1
"""


def job_spec(n: int) -> bytes:
    return SPEC_TEMPLATE.format(n=n, team=n % 4).encode("utf-8")


# -- PostgreSQL database for one run ----------------------------------------------------------


def create_pg_database(admin_url: str) -> tuple[str | None, str]:
    """(url of a fresh database, note); (None, why) when the server cannot be used."""
    name = f"lowtide_bench_{secrets.token_hex(4)}"
    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # unreachable, auth, permissions: say so and go on
        return None, f"PostgreSQL unavailable at {admin_url}: {str(exc).splitlines()[0]}"
    finally:
        engine.dispose()
    url = sa.make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    return url, name


def drop_pg_database(admin_url: str, name: str) -> None:
    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        engine.dispose()


# -- the server ---------------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    token: str
    marker: str
    log_path: Path


def start_server(workdir: Path, store_url: str | None, lowtide: Path) -> Server:
    port = free_port()
    config: dict[str, Any] = {
        "state_dir": "state",
        "nodes": [{"name": f"node-{i}", "gpus": GPUS_PER_NODE} for i in range(NODES)],
        "api": {"host": "127.0.0.1", "port": port},
        "auth": {"enabled": True},
    }
    if store_url:
        config["store_url"] = store_url
    cfg = workdir / "lowtide.yaml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    marker = secrets.token_hex(8)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("LOWTIDE_") or k == "LOWTIDE_REQUIRE_SERVICES"
    }
    env.update({"LOWTIDE_CONFIG": str(cfg), MARKER_ENV: marker})
    log_path = workdir / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(lowtide), "up"],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    server = Server(proc, url, "", marker, log_path)
    token_file = workdir / "state" / "admin.token"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"lowtide up exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"lowtide up did not become healthy in 60 s:\n{log_path.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200 and token_file.exists():
                server.token = token_file.read_text().strip()
                if server.token:
                    return server
        time.sleep(0.1)


def stop_server(server: Server) -> None:
    stop_process(server.proc, timeout=30)


# -- the load -------------------------------------------------------------------------------------


@dataclass
class Load:
    latencies_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)


def submit_all(url: str, token: str, first: int, count: int, concurrency: int) -> tuple[Load, float]:
    specs = [job_spec(first + i) for i in range(count)]
    next_index = iter(range(count))
    lock = threading.Lock()
    load = Load()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/yaml"}
    start_gate = threading.Barrier(concurrency + 1)

    def worker() -> None:
        latencies: list[float] = []
        errors: list[str] = []
        statuses: dict[int, int] = {}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
            start_gate.wait()
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    break
                t0 = time.perf_counter()
                try:
                    r = client.post("/v1/jobs", content=specs[i])
                    elapsed = (time.perf_counter() - t0) * 1000
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    if r.status_code == 201:
                        latencies.append(elapsed)
                    else:
                        errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
                except httpx.HTTPError as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
        with lock:
            load.latencies_ms.extend(latencies)
            load.errors.extend(errors)
            for code, n in statuses.items():
                load.statuses[code] = load.statuses.get(code, 0) + n

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    start_gate.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    return load, time.perf_counter() - started


def run_backend(
    backend: str, store_url: str | None, args: argparse.Namespace, lowtide: Path
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"lowtide-bench-{backend}-"))
    server: Server | None = None
    result: dict[str, Any] = {"backend": backend}
    try:
        server = start_server(workdir, store_url, lowtide)
        if args.warmup:
            warm, _ = submit_all(server.url, server.token, 0, args.warmup, args.concurrency)
            if warm.errors:
                raise RuntimeError(f"warm-up failed: {warm.errors[0]}")
        if args.profile_server:
            profile = start_py_spy(server, args.out.parent / f"profile-{backend}.txt")
        ticks0 = _loop_ticks(server)
        server_cpu0 = _cpu_seconds(psutil.Process(server.proc.pid))
        client_cpu0 = time.process_time()
        load, wall = submit_all(server.url, server.token, args.warmup, args.jobs, args.concurrency)
        client_cpu = time.process_time() - client_cpu0
        server_cpu = _cpu_seconds(psutil.Process(server.proc.pid)) - server_cpu0
        ticks = _loop_ticks(server) - ticks0
        if args.profile_server:
            stop_py_spy(profile)
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=60
        ) as client:
            stored = client.get("/metrics").text
            running = client.get("/v1/jobs", params={"state": "RUNNING"}).json()["jobs"]
        lat = sorted(load.latencies_ms)
        ok = len(lat)
        result.update(
            {
                "store_url": _redact(store_url) if store_url else "sqlite:///<tmp>/state/lowtide.db",
                "submitted": args.jobs,
                "succeeded": ok,
                "errors": len(load.errors),
                "statuses": {str(k): v for k, v in sorted(load.statuses.items())},
                "error_samples": load.errors[:5],
                "wall_s": round(wall, 3),
                "submissions_per_s": round(ok / wall, 1) if wall > 0 else None,
                "latency_ms": {
                    "p50": round(percentile(lat, 50), 2),
                    "p95": round(percentile(lat, 95), 2),
                    "p99": round(percentile(lat, 99), 2),
                    "mean": round(statistics.fmean(lat), 2) if lat else None,
                    "max": round(lat[-1], 2) if lat else None,
                },
                # CPU seconds used during the measured phase; the client shares the machine.
                "cpu_s": {"server": round(server_cpu, 2), "client": round(client_cpu, 2)},
                # Control-loop ticks during the measured phase (each submit wakes the loop).
                "loop_ticks": ticks,
                "jobs_running_at_end": len(running),
                "queued_jobs_metric": _metric(stored, 'lowtide_jobs{state="QUEUED"}'),
            }
        )
    finally:
        if server is not None:
            stop_server(server)
            groups = kill_marked(server.marker)
            left = ps_leftovers(server.marker)
            result["cleanup"] = {"step_process_groups_killed": groups, "processes_left": len(left)}
            if left:
                print(f"WARNING: processes left behind by the {backend} run:", *left, sep="\n  ")
            if args.keep:
                print(f"kept {workdir}")
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return result


def _loop_ticks(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return _metric(text, "lowtide_loop_ticks") or 0.0


def _cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def _redact(url: str) -> str:
    return sa.make_url(url).render_as_string(hide_password=True)


def start_py_spy(server: Server, out: Path) -> subprocess.Popen[bytes]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    proc = subprocess.Popen(
        [spy, "record", "--pid", str(server.proc.pid), "--threads", "--gil", "--rate", "200", "-o", str(out)]
        + (["--format", "raw"] if out.suffix == ".txt" else []),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)
    return proc


def stop_py_spy(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)


# -- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=2000, help="measured submissions per backend")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent client threads")
    parser.add_argument("--warmup", type=int, default=50, help="unmeasured submissions first")
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--pg-url", default=DEFAULT_PG_URL, help="PostgreSQL server (admin database)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--keep", action="store_true", help="keep the temp dirs (server.log)")
    parser.add_argument(
        "--profile-server",
        action="store_true",
        help="record the server (threads holding the GIL) with py-spy during the measured phase, as "
        "collapsed stacks in profile-<backend>.txt beside --out (pip install py-spy into the venv)",
    )
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - {"sqlite", "postgresql"}
    if unknown:
        parser.error(f"unknown backend(s): {', '.join(sorted(unknown))}")
    lowtide = Path(sys.executable).parent / "lowtide"
    if not lowtide.exists():
        parser.error(f"{lowtide} not found: install lowtide into this interpreter's environment")

    results: list[dict[str, Any]] = []
    notes: list[str] = []
    for backend in backends:
        url: str | None = None
        database = ""
        if backend == "postgresql":
            url, database = create_pg_database(args.pg_url)
            if url is None:
                print(f"note: {database}; skipping the postgresql backend")
                notes.append(database)
                continue
        try:
            results.append(run_backend(backend, url, args, lowtide))
        except Exception as exc:  # one backend failing still reports the others
            print(f"error: the {backend} run failed: {exc}")
            results.append({"backend": backend, "failed": str(exc)})
        finally:
            if url is not None:
                drop_pg_database(args.pg_url, database)

    columns = ("jobs", "errors", "wall s", "subs/s", "p50 ms", "p95 ms", "p99 ms")
    header = f"{'backend':<11} " + " ".join(f"{c:>8}" for c in columns)
    print(f"\nPOST /v1/jobs, {args.concurrency} concurrent clients, {NODES}x{GPUS_PER_NODE} GPUs, auth on")
    print(header)
    print("-" * len(header))
    for r in results:
        if "failed" in r:
            print(f"{r['backend']:<11} failed: {r['failed'].splitlines()[0]}")
            continue
        lat = r["latency_ms"]
        print(
            f"{r['backend']:<11} {r['submitted']:>8} {r['errors']:>8} {r['wall_s']:>8.2f} "
            f"{r['submissions_per_s']:>8.1f} {lat['p50']:>8.1f} {lat['p95']:>8.1f} {lat['p99']:>8.1f}"
        )
        if r["error_samples"]:
            print(f"  first errors: {r['error_samples'][:2]}")
    for note in notes:
        print(f"note: {note}")

    output = {
        "benchmark": "api.submit (POST /v1/jobs through lowtide up)",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "parameters": {
            "jobs": args.jobs,
            "warmup": args.warmup,
            "concurrency": args.concurrency,
            "nodes": NODES,
            "gpus_per_node": GPUS_PER_NODE,
            "auth": True,
            "spec": "YAML, 3 steps (prep 8 GPUs -> train 2 -> eval 1), ~1 KiB",
        },
        "results": results,
        "notes": notes,
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(output, indent=2) + "\n")
    print(f"wrote {args.out}")
    failed = any("failed" in r or r.get("cleanup", {}).get("processes_left") for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
