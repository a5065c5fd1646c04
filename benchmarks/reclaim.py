"""Benchmark: how fast inference gets lent GPUs back from research, phase by phase.

For each park mode (`stop`, `sleep`) this starts `lowtide up --stop-replicas-on-exit` as a
subprocess on declared GPUs (one node of 8) with one emulated vLLM service behind the gateway
(2 GPUs per replica, min 1 / max 2, small cold start and wake times, a small `--max-num-seqs` so
a modest load needs the second replica), and fills the GPUs it lends with real research steps:
`python -m lowtide.examples.train` (checkpoints on SIGTERM and exits 143), one per job, each
holding `--trainer-gpus` GPUs, as many as the envelope lends (three 2-GPU trainers by default).

Then it runs `--surges` load surges (after `--warmup` unmeasured ones). One surge:

1. a constant Poisson load through the gateway (`emulator.loadgen.run_load`, emulator hints on)
   large enough that the autoscaler wants the second replica, which has no free GPUs → lowtide
   reclaims GPUs from a trainer (notice, checkpoint, exit) and starts or wakes the replica;
2. when `GET /v1/reclaims` shows the reclaim DONE (the replica serves), the load stops;
3. the script waits until the extra replica has drained and parked, every trainer runs again
   (the preempted one resumed from its checkpoint) and no reclaim is open, then starts the next.

From each reclaim record: detect→decide, decide→notice, notice→freed, freed→healthy and the
total (detected→healthy); p50/p99/max per mode, against the target total ≤ tick + grace + unpark
+ 1 s (unpark: the emulator's cold start for `stop`, its wake time for `sleep`) and, with
`sleep`, freed→healthy ≤ wake + 1 s. Also: how many reclaims and trainer preemptions, the
GPU-seconds lost (the attempts' `lost_gpu_seconds`), every request that failed at the gateway
(the load generator's errors and the gateway's own counters) and whether every later attempt
resumed from a checkpoint (`record.resume_from`). What the inference side felt, per surge and
summed up per mode: surge→capacity (load start → the reclaim's `healthy_at`, the new replica
serving) and the TTFT of every answered request of the surge (p50/p99).

Cleanup: the server is stopped (SIGTERM; it stops its replicas), then every process carrying
this run's marker variable (step shims and trainers, which outlive the control plane by design;
replica shims if any survived) is killed by process group, and the run fails if one is left.

Run:  .venv/bin/python benchmarks/reclaim.py [--surges 50] [--park stop,sleep]
With PYTHONPATH set (e.g. to a frozen copy of src/ while the tree is being edited) the steps get it
too (`executor.env_allowlist`), so the server, its replicas and the trainers run the same code.
Writes benchmarks/results/reclaim.json. Not a test: nothing here asserts a time (docs/architecture.md §10).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml
from harness import MARKER_ENV, free_port, kill_marked, percentile, ps_leftovers, stop_process
from prometheus_client.parser import text_string_to_metric_families

from lowtide.adapters.net import free_port_block
from lowtide.emulator.loadgen import LoadReport, run_load
from lowtide.emulator.traces import FixedTokens, synthetic

DEFAULT_OUT = Path(__file__).parent / "results" / "reclaim.json"
SERVICE = "chat"
PHASES = (
    ("detect_to_decide", "detected_at", "decided_at"),
    ("decide_to_notice", "decided_at", "notice_at"),
    ("notice_to_freed", "notice_at", "freed_at"),
    ("freed_to_healthy", "freed_at", "healthy_at"),
    ("total", "detected_at", "healthy_at"),
)
_T = TypeVar("_T")


@dataclass(frozen=True)
class Setup:
    """Everything a run is configured with (also written to the JSON)."""

    nodes_gpus: int = 8
    gpus_per_replica: int = 2
    trainer_gpus: int = 2
    tick_s: float = 0.5
    grace_s: float = 5.0
    cold_start_s: float = 2.0
    wake_s: float = 1.0
    max_num_seqs: int = 4
    concurrency_per_replica: int = 4
    scale_up_window_s: float = 2.0
    scale_down_stabilization_s: float = 5.0
    drain_timeout_s: float = 5.0
    metrics_window_s: float = 5.0
    load_rate: float = 8.0
    prompt_tokens: int = 64
    output_tokens: int = 100
    step_seconds: float = 0.05
    checkpoint_every: int = 100

    @property
    def trainers(self) -> int:
        lendable = self.nodes_gpus - self.gpus_per_replica  # one replica at rest (min_replicas 1)
        return lendable // self.trainer_gpus

    def unpark_s(self, park: str) -> float:
        return self.cold_start_s if park == "stop" else self.wake_s

    def target_total_s(self, park: str) -> float:
        return self.tick_s + self.grace_s + self.unpark_s(park) + 1.0


# -- helpers ----------------------------------------------------------------------------------------


def summary(values: list[float]) -> dict[str, Any]:
    v = sorted(values)
    if not v:
        return {"n": 0}
    return {
        "n": len(v),
        "min": round(v[0], 3),
        "p50": round(percentile(v, 50), 3),
        "p99": round(percentile(v, 99), 3),
        "max": round(v[-1], 3),
        "mean": round(sum(v) / len(v), 3),
    }


def free_port_range(n: int) -> int:
    return free_port_block(n)


def wait_for(what: str, probe: Callable[[], _T | None], timeout: float, every: float = 0.1) -> _T:
    """Poll `probe` until it returns something truthy (returned), or raise after `timeout`."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = probe()
            if value:
                return value
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            last_error = exc
        if time.monotonic() > deadline:
            extra = f" (last error: {last_error})" if last_error else ""
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}{extra}")
        time.sleep(every)


# -- the server -------------------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    workdir: Path
    api: str
    gateway: str
    marker: str
    log_path: Path
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.api, timeout=10, trust_env=False)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"lowtide up exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}"
            )

    def get(self, path: str, **params: Any) -> Any:
        r = self.client.get(path, params=params)
        r.raise_for_status()
        return r.json()

    def service(self) -> dict[str, Any]:
        return dict(self.get(f"/v1/services/{SERVICE}"))

    def replica_states(self) -> list[str]:
        return [r["state"] for r in self.service()["replicas"]]

    def reclaims(self) -> list[dict[str, Any]]:
        return list(self.get("/v1/reclaims", limit=10000))

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self.get(f"/v1/jobs/{job_id}"))


def write_config(workdir: Path, setup: Setup, park: str, api_port: int, gw_port: int, base: int) -> Path:
    allowlist = [MARKER_ENV, *(["PYTHONPATH"] if os.environ.get("PYTHONPATH") else [])]
    config: dict[str, Any] = {
        "state_dir": "state",
        "tick_seconds": setup.tick_s,
        "nodes": [{"name": "n1", "gpus": setup.nodes_gpus}],
        "api": {"host": "127.0.0.1", "port": api_port},
        "auth": {"enabled": False},
        # Steps get a clean environment: let the run's marker through, so cleanup finds them, and
        # PYTHONPATH when set, so steps run the same lowtide as the server (e.g. a frozen copy).
        "executor": {"checkpoint_poll": "1s", "retry_backoff": "1s", "env_allowlist": allowlist},
        "services": [
            {
                "name": SERVICE,
                "model": "demo-8b",
                "gpus_per_replica": setup.gpus_per_replica,
                "min_replicas": 1,
                "max_replicas": 2,
                "park": park,
                "emulate": True,
                "emulator_args": [
                    "--cold-start",
                    f"{setup.cold_start_s:g}",
                    "--wake",
                    f"{setup.wake_s:g}",
                    "--max-num-seqs",
                    str(setup.max_num_seqs),
                ],
                "base_port": base,
                "gateway_port": gw_port,
                "startup_timeout": "60s",
                "expected_startup": setup.cold_start_s,
                "expected_wake": setup.wake_s,
                "drain_timeout": setup.drain_timeout_s,
                "reclaim_grace": setup.grace_s,
                "metrics": {
                    "source": "scrape",
                    "window": setup.metrics_window_s,
                    "stale_after": "15s",
                },
                "autoscale": {
                    "concurrency_per_replica": setup.concurrency_per_replica,
                    "kv_usage": None,
                    "scale_up_window": setup.scale_up_window_s,
                    "scale_down_stabilization": setup.scale_down_stabilization_s,
                    # The benchmark times the reclaim of surge after surge 12 s apart; the burst
                    # guard (on by default) would stop parking the second replica after two of
                    # them, so there would be nothing more to reclaim: it is off here.
                    "max_scale_down_stabilization": setup.scale_down_stabilization_s,
                    "tolerance": 0,
                },
            }
        ],
        "lending": {"mode": "continuous", "stale_after": "15s", "stale_reclaim_after": "60s"},
    }
    path = workdir / "lowtide.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def start_server(workdir: Path, setup: Setup, park: str) -> Server:
    api_port, gw_port = free_port(), free_port()
    base = free_port_range(2)
    cfg = write_config(workdir, setup, park, api_port, gw_port, base)
    marker = secrets.token_hex(8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWTIDE_")}
    env.update({"LOWTIDE_CONFIG": str(cfg), MARKER_ENV: marker})
    log_path = workdir / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lowtide", "up", "--stop-replicas-on-exit"],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Server(
        proc, workdir, f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{gw_port}", marker, log_path
    )


def stop_server(server: Server) -> None:
    server.client.close()
    stop_process(server.proc, timeout=60)


# -- research: the trainers -------------------------------------------------------------------------

TRAINER_SPEC = """\
name: bench-train-{n}
team: research
priority: normal
grace_seconds: 30
steps:
  - name: train
    command: [{python}, -m, lowtide.examples.train, --data, {data}, --out, "{{{{outputs}}}}",
              --steps, "100000000", --step-seconds, "{step_s:g}", --checkpoint-every, "{every}"]
    gpus: {gpus}
    checkpoint: true
"""


def prepare_data(root: Path) -> Path:
    data = root / "data"
    subprocess.run(
        [sys.executable, "-m", "lowtide.examples.prep", "--out", str(data)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return data


def submit_trainers(server: Server, setup: Setup, data: Path) -> list[str]:
    ids = []
    for n in range(setup.trainers):
        spec = TRAINER_SPEC.format(
            n=n,
            python=json.dumps(sys.executable),
            data=json.dumps(str(data)),
            step_s=setup.step_seconds,
            every=setup.checkpoint_every,
            gpus=setup.trainer_gpus,
        )
        r = server.client.post("/v1/jobs", content=spec, headers={"Content-Type": "application/yaml"})
        r.raise_for_status()
        ids.append(str(r.json()["id"]))
    return ids


def trainers_running(server: Server, job_ids: list[str]) -> bool:
    for job_id in job_ids:
        detail = server.job(job_id)
        step = detail["steps"][0]
        if step["state"] != "RUNNING":
            return False
        attempts = [a for a in detail["attempts"] if a["step"] == step["name"]]
        if not attempts or attempts[-1]["state"] != "RUNNING":
            return False
    return True


# -- the load ---------------------------------------------------------------------------------------


class Surge:
    """A constant Poisson load through the gateway on its own thread until `stop()`."""

    def __init__(self, target: str, setup: Setup, seed: int) -> None:
        self._target = target
        self._setup = setup
        self._seed = seed
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.report: LoadReport | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"surge-{seed}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        async def main() -> LoadReport:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._ready.set()
            requests = synthetic(
                "constant",
                rate=self._setup.load_rate,
                duration_s=3600,
                seed=self._seed,
                tokens=FixedTokens(self._setup.prompt_tokens, self._setup.output_tokens),
            )
            return await run_load(
                requests,
                self._target,
                speedup=1,
                duration_s=3600,
                emulator_hints=True,
                drain_timeout_s=60,
                request_timeout_s=60,
                stop=self._stop,
                keep_results=True,
            )

        try:
            self.report = asyncio.run(main())
        except BaseException as exc:  # reported by the caller
            self.error = exc
            self._ready.set()

    def stop(self) -> LoadReport:
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=120)
        if self.error is not None:
            raise RuntimeError(f"the load generator failed: {self.error!r}") from self.error
        if self.report is None:
            raise RuntimeError("the load generator did not finish within 120 s")
        return self.report


def gateway_errors(server: Server) -> dict[str, Any]:
    """Non-2xx answers and upstream errors the gateway counted for the service (cumulative)."""
    text = httpx.get(f"{server.gateway}/metrics", timeout=10, trust_env=False).text
    out: dict[str, Any] = {"requests": 0.0, "non_2xx": 0.0, "upstream_errors": 0.0, "no_backend": 0.0}
    codes: dict[str, float] = {}
    kinds: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("service") != SERVICE:
                continue
            if s.name == "lowtide_gateway_requests_total":
                code = str(s.labels.get("code", ""))
                out["requests"] += s.value
                codes[code] = codes.get(code, 0.0) + s.value
                if not code.startswith("2"):
                    out["non_2xx"] += s.value
            elif s.name == "lowtide_gateway_upstream_errors_total":
                out["upstream_errors"] += s.value
                kind = str(s.labels.get("kind", ""))
                kinds[kind] = kinds.get(kind, 0.0) + s.value
            elif s.name == "lowtide_gateway_no_backend_total":
                out["no_backend"] += s.value
    out["codes"] = codes
    out["upstream_error_kinds"] = kinds
    return out


# -- one mode ---------------------------------------------------------------------------------------


def settled(server: Server, job_ids: list[str]) -> bool:
    """One replica serving, the other parked, no reclaim open, every trainer running."""
    states = sorted(server.replica_states())
    if states.count("SERVING") != 1 or any(s not in ("SERVING", "PARKED") for s in states):
        return False
    if any(r["state"] == "OPEN" for r in server.reclaims()):
        return False
    return trainers_running(server, job_ids)


def run_mode(park: str, setup: Setup, args: argparse.Namespace, data: Path) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"lowtide-bench-reclaim-{park}-"))
    server: Server | None = None
    result: dict[str, Any] = {"park": park, "target_total_s": setup.target_total_s(park)}
    if park == "sleep":
        result["target_freed_to_healthy_s"] = setup.wake_s + 1.0
    surges: list[dict[str, Any]] = []
    result["surges"] = surges
    started = time.monotonic()
    try:
        server = start_server(workdir, setup, park)
        srv = server

        def first_serving() -> bool:
            srv.check_alive()
            return srv.replica_states().count("SERVING") == 1

        wait_for("lowtide up and its first replica serving", first_serving, 90, 0.2)
        job_ids = submit_trainers(srv, setup, data)
        result["jobs"] = job_ids
        wait_for("every trainer running", lambda: trainers_running(srv, job_ids), 60, 0.2)
        total = args.warmup + args.surges
        for i in range(total):
            srv.check_alive()
            surges.append(
                one_surge(srv, setup, job_ids, i, warmup=i < args.warmup, settle_timeout=args.settle_timeout)
            )
            s = surges[-1]
            print(
                f"  {park} surge {i + 1}/{total}{' (warm-up)' if s['warmup'] else ''}: "
                f"reclaims {len(s['reclaims'])}, total {s['total_s']}, "
                f"failed requests {s['load']['failed']}, cycle {s['cycle_s']:.1f}s",
                flush=True,
            )
            if s["unsettled"]:
                result["failed"] = s["unsettled"]
                print(f"error: {s['unsettled']}", flush=True)
                break
        result.update(collect(srv, setup, park, job_ids, surges))
        result["gateway"] = gateway_errors(srv)
    except Exception as exc:  # one mode failing still reports the other
        print(f"error: the {park} run failed: {exc}")
        result["failed"] = str(exc)
        if server is not None:
            result["server_log_tail"] = server.log_path.read_text(errors="replace")[-4000:]
    finally:
        result["wall_s"] = round(time.monotonic() - started, 1)
        if server is not None:
            stop_server(server)
            groups = kill_marked(server.marker)
            left = ps_leftovers(server.marker)
            result["cleanup"] = {"process_groups_killed": groups, "processes_left": left}
            if left:
                print(f"WARNING: processes left behind by the {park} run:", *left, sep="\n  ")
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return result


def one_surge(
    server: Server, setup: Setup, job_ids: list[str], index: int, *, warmup: bool, settle_timeout: float = 180
) -> dict[str, Any]:
    known = {r["id"] for r in server.reclaims()}
    t0 = time.time()
    surge = Surge(server.gateway, setup, seed=index)
    surge.start()

    def done() -> list[dict[str, Any]] | None:
        server.check_alive()
        new = [r for r in server.reclaims() if r["id"] not in known]
        if any(r["state"] == "OPEN" for r in new):
            return None
        mine = [r for r in new if r["service"] == SERVICE]
        return new if mine and all(r["state"] == "DONE" for r in mine) else None

    try:
        new = wait_for(f"surge {index + 1}: a reclaim for {SERVICE} to be done", done, 120, 0.05)
        seen_done = time.time()
    finally:
        report = surge.stop()
    load_stopped = time.time()
    unsettled = None
    try:
        wait_for(
            f"surge {index + 1}: the extra replica parked and every trainer running again",
            lambda: settled(server, job_ids),
            settle_timeout,
            0.2,
        )
    except TimeoutError as exc:  # this surge's figures still count; the run stops after it
        unsettled = str(exc)
    settled_at = time.time()
    new = [r for r in server.reclaims() if r["id"] not in known]  # final phases of every reclaim
    mine = [r for r in new if r["service"] == SERVICE]
    first = min(mine, key=lambda r: r["detected_at"])
    unpark = unpark_split(server, first)
    healthy = first["healthy_at"]
    ttfts = sorted(r.ttft_s for r in report.results if r.ttft_s is not None and r.error is None)
    return {
        "index": index,
        "warmup": warmup,
        "load_started_at": t0,
        "reclaim_seen_done_at": seen_done,
        "load_start_to_detected_s": round(first["detected_at"] - t0, 3),
        "load_stopped_at": load_stopped,
        "settled_at": settled_at,
        "cycle_s": settled_at - t0,
        "unsettled": unsettled,
        "total_s": round(first["total_s"], 3) if first["total_s"] is not None else None,
        # What the inference side felt: load start → the new replica serving (the reclaim's
        # healthy_at), and the TTFT of every request of this surge that got an answer.
        "surge_to_capacity_s": round(healthy - t0, 3) if healthy is not None else None,
        "ttfts_s": [round(v, 4) for v in ttfts],
        **unpark,
        "reclaims": new,
        "load": {
            "sent": report.sent,
            "ok": report.ok,
            "failed": report.failed,
            "errors": report.errors,
            "cancelled": report.cancelled,
            "error_samples": report.error_samples,
            "ttft_p50_s": report.ttft_s.p50 if report.ttft_s else None,
            "ttft_p99_s": report.ttft_s.p99 if report.ttft_s else None,
        },
    }


def unpark_split(server: Server, reclaim: dict[str, Any]) -> dict[str, Any]:
    """Split freed→healthy at the moment the loop started or woke the replica (its service event):
    freed→unpark is seeing the exit and deciding; unpark→healthy is the start or wake itself."""
    events = server.service()["events"]
    freed, healthy = reclaim["freed_at"], reclaim["healthy_at"]
    if freed is None or healthy is None:
        return {}
    began = [
        e
        for e in events
        if e["kind"] in ("starting", "waking")
        and reclaim["decided_at"] <= e["at"] <= healthy
        and (reclaim["replica_id"] is None or e["replica_id"] == reclaim["replica_id"])
    ]
    if not began:
        return {}
    at = min(e["at"] for e in began)
    return {
        "unpark_kind": began[0]["kind"],
        "freed_to_unpark_s": round(at - freed, 3),
        "unpark_to_healthy_s": round(healthy - at, 3),
    }


def collect(
    server: Server, setup: Setup, park: str, job_ids: list[str], surges: list[dict[str, Any]]
) -> dict[str, Any]:
    measured = [s for s in surges if not s["warmup"]]
    reclaims = [r for s in measured for r in s["reclaims"]]
    served = [r for r in reclaims if r["service"] == SERVICE]
    phases: dict[str, dict[str, Any]] = {}
    for name, a, b in PHASES:
        values = [r[b] - r[a] for r in served if r[a] is not None and r[b] is not None]
        phases[name] = summary(values)
    unpark_kinds = {
        "wake": sum("wake " in r["reason"] for r in served),
        "start": sum("start a replica" in r["reason"] for r in served),
    }
    # Research side: every attempt of every trainer job, over the whole run (warm-up included).
    preemptions = 0
    lost = 0.0
    attempts_after_first = 0
    resumed = 0
    not_resumed: list[str] = []
    for job_id in job_ids:
        detail = server.job(job_id)
        for att in detail["attempts"]:
            if att["preempted"]:
                preemptions += 1
            if att["lost_gpu_seconds"] is not None:
                lost += float(att["lost_gpu_seconds"])
            if att["number"] > 1:
                attempts_after_first += 1
                if att["record"].get("resume_from"):
                    resumed += 1
                else:
                    not_resumed.append(f"{job_id} attempt {att['number']}")
    failed_requests = sum(s["load"]["failed"] for s in surges)
    target = setup.target_total_s(park)
    total = phases["total"]
    out: dict[str, Any] = {
        "measured_surges": len(measured),
        "reclaims": len(reclaims),
        "reclaims_for_service": len(served),
        "reclaims_for_lending": len(reclaims) - len(served),
        "reclaims_all_surges": sum(len(s["reclaims"]) for s in surges),
        "unpark": unpark_kinds,
        "phases_s": phases,
        "freed_to_healthy_split_s": {
            "freed_to_unpark": summary(
                [s["freed_to_unpark_s"] for s in measured if "freed_to_unpark_s" in s]
            ),
            "unpark_to_healthy": summary(
                [s["unpark_to_healthy_s"] for s in measured if "unpark_to_healthy_s" in s]
            ),
        },
        "load_start_to_detected_s": summary([s["load_start_to_detected_s"] for s in measured]),
        "surge_to_capacity_s": summary(
            [s["surge_to_capacity_s"] for s in measured if s.get("surge_to_capacity_s") is not None]
        ),
        "surge_ttft_s": summary([v for s in measured for v in s["ttfts_s"]]),
        "cycle_s": summary([s["cycle_s"] for s in measured]),
        "meets_total_target": bool(total.get("n")) and total["p99"] <= target,
        "trainer_preemptions": preemptions,
        "lost_gpu_seconds": round(lost, 3),
        "later_attempts": attempts_after_first,
        "later_attempts_resumed_from_checkpoint": resumed,
        "not_resumed": not_resumed,
        "all_resumed": attempts_after_first > 0 and resumed == attempts_after_first,
        "requests": {
            "sent": sum(s["load"]["sent"] for s in surges),
            "ok": sum(s["load"]["ok"] for s in surges),
            "failed": failed_requests,
            "cancelled": sum(s["load"]["cancelled"] for s in surges),
        },
    }
    if park == "sleep":
        f2h = phases["freed_to_healthy"]
        out["meets_wake_target"] = bool(f2h.get("n")) and f2h["p99"] <= setup.wake_s + 1.0
    return out


# -- main -------------------------------------------------------------------------------------------


def print_mode(r: dict[str, Any], setup: Setup) -> None:
    park = r["park"]
    print(f"\npark: {park}  ({r.get('measured_surges', 0)} measured surges, {r['wall_s']:.0f} s)")
    if "failed" in r:
        print(f"  failed: {r['failed'].splitlines()[0]}")
        if "phases_s" not in r:
            return
    header = f"  {'phase':<18} {'n':>4} {'p50 s':>8} {'p99 s':>8} {'max s':>8}"
    print(header)
    for name, _, _ in PHASES:
        p = r["phases_s"][name]
        if not p.get("n"):
            print(f"  {name:<18} {0:>4}")
            continue
        print(f"  {name:<18} {p['n']:>4} {p['p50']:>8.3f} {p['p99']:>8.3f} {p['max']:>8.3f}")
    for name, p in r["freed_to_healthy_split_s"].items():
        if p.get("n"):
            print(f"    {name:<16} {p['n']:>4} {p['p50']:>8.3f} {p['p99']:>8.3f} {p['max']:>8.3f}")
    t = r["phases_s"]["total"]
    verdict = "meets" if r["meets_total_target"] else "MISSES"
    print(
        f"  target total ≤ tick {setup.tick_s:g} + grace {setup.grace_s:g} + unpark "
        f"{setup.unpark_s(park):g} + 1 = {r['target_total_s']:g} s at p99: {verdict} "
        f"(p99 {t.get('p99', float('nan')):.3f} s)"
    )
    if park == "sleep":
        f = r["phases_s"]["freed_to_healthy"]
        verdict = "meets" if r["meets_wake_target"] else "MISSES"
        print(
            f"  target freed→healthy ≤ wake {setup.wake_s:g} + 1 = {setup.wake_s + 1:g} s at p99: {verdict} "
            f"(p99 {f.get('p99', float('nan')):.3f} s)"
        )
    print(
        f"  reclaims {r['reclaims']} ({r['reclaims_for_service']} for {SERVICE}: "
        f"{r['unpark']['wake']} wake, {r['unpark']['start']} start; "
        f"{r['reclaims_for_lending']} for lending); "
        f"trainer preemptions {r['trainer_preemptions']} (all runs incl. warm-up); "
        f"lost {r['lost_gpu_seconds']:.2f} GPU-s"
    )
    req = r["requests"]
    gw = r["gateway"]
    print(
        f"  requests sent {req['sent']}, ok {req['ok']}, failed {req['failed']}, "
        f"cancelled {req['cancelled']}; "
        f"gateway non-2xx {gw['non_2xx']:g}, upstream errors {gw['upstream_errors']:g}, "
        f"no backend {gw['no_backend']:g}"
    )
    print(
        f"  attempts after the first: {r['later_attempts']}, resumed from a checkpoint: "
        f"{r['later_attempts_resumed_from_checkpoint']} ({'all' if r['all_resumed'] else 'NOT all'})"
    )
    print("  what the inference side felt (measured surges):")
    for label, key in (("surge→capacity", "surge_to_capacity_s"), ("TTFT in surges", "surge_ttft_s")):
        p = r[key]
        if p.get("n"):
            print(f"    {label:<16} {p['n']:>4} {p['p50']:>8.3f} {p['p99']:>8.3f} {p['max']:>8.3f}")
    c = r["cycle_s"]
    print(f"  surge cycle (load start → settled again): p50 {c.get('p50')} s, max {c.get('max')} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--surges", type=int, default=50, help="measured surges per park mode")
    parser.add_argument(
        "--warmup", type=int, default=1, help="unmeasured surges first (the first wake is a start)"
    )
    parser.add_argument("--park", default="stop,sleep", help="park modes to run: stop, sleep or both")
    parser.add_argument("--trainer-gpus", type=int, default=2, choices=(1, 2), help="GPUs per trainer job")
    parser.add_argument("--grace", type=float, default=5.0, help="the service's reclaim_grace (s)")
    parser.add_argument("--tick", type=float, default=0.5, help="tick_seconds")
    parser.add_argument("--rate", type=float, default=8.0, help="surge load, requests/s")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--keep", action="store_true", help="keep the temp dirs (server.log)")
    parser.add_argument(
        "--settle-timeout", type=float, default=180.0, help="seconds to wait for the calm after a surge"
    )
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.park.split(",") if m.strip()]
    if not modes or set(modes) - {"stop", "sleep"}:
        parser.error("--park takes stop, sleep or stop,sleep")
    if args.surges < 1 or args.warmup < 0:
        parser.error("--surges must be ≥ 1 and --warmup ≥ 0")
    setup = Setup(trainer_gpus=args.trainer_gpus, grace_s=args.grace, tick_s=args.tick, load_rate=args.rate)

    root = Path(tempfile.mkdtemp(prefix="lowtide-bench-reclaim-data-"))
    results: list[dict[str, Any]] = []
    began = time.monotonic()
    try:
        data = prepare_data(root)
        for park in modes:
            print(f"park: {park}: {args.warmup} warm-up + {args.surges} surges", flush=True)
            results.append(run_mode(park, setup, args, data))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"\nreclaim: 1 node x {setup.nodes_gpus} GPUs, replicas of {setup.gpus_per_replica} GPUs (1..2), "
        f"{setup.trainers} trainers x {setup.trainer_gpus} GPUs, tick {setup.tick_s:g}s, "
        f"grace {setup.grace_s:g}s, "
        f"cold start {setup.cold_start_s:g}s, wake {setup.wake_s:g}s"
    )
    for r in results:
        print_mode(r, setup)
    shims = subprocess.run(["pgrep", "-af", "step_shim"], capture_output=True, text=True, check=False).stdout
    output = {
        "benchmark": "reclaim (lend → surge → reclaim → replica healthy → resume), through lowtide up",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "parameters": {
            **{k: getattr(setup, k) for k in setup.__dataclass_fields__},
            "trainers": setup.trainers,
            "surges": args.surges,
            "warmup": args.warmup,
            "park": modes,
        },
        "results": results,
        "wall_s": round(time.monotonic() - began, 1),
        "step_shims_left": shims.splitlines(),
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(output, indent=2) + "\n")
    print(f"\nwrote {args.out} ({output['wall_s']:.0f} s in all)")
    if shims.strip():
        print("note: `pgrep -af step_shim` is not empty (other runs?):", shims, sep="\n")
    failed = any("failed" in r or r.get("cleanup", {}).get("processes_left") for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
