#!/usr/bin/env python3
"""`make demo`: a day of an inference fleet and the research that runs on what it does not use.

lowtide runs embedded on declared GPUs (2 nodes x 8, no GPU needed) with two emulated vLLM
services (chat: 2-GPU replicas, code: 1-GPU replicas), each behind lowtide's gateway. A real
ServeGen day (Alibaba's m-large clients: chat is client 142, code clients 112 and 148; day 1,
00:00 to 24:00) is compressed to DEMO_MINUTES and replayed through the gateways with `lowtide
loadgen`; without the data folder, the built-in synthetic day (a diurnal curve, night at 00:00).
A handful of research jobs (examples/jobs/demo-*.yaml and sft-dag.yaml) that checkpoint run on
the GPUs lent at night; the morning ramp takes GPUs back (notice, checkpoint, requeue), the jobs
resume on what is left and finish; in the evening the replicas park again.

It prints the dashboard URL and a login token first, then a line every few seconds (time of the
compressed day, load against capacity per service, GPUs by holder, jobs, preemptions) and each
event as it happens, and at the end a report (GPU-hours harvested, preemptions, how fast GPUs
came back, jobs finished), also written to <dir>/report.json. It leaves nothing running.

Environment: DEMO_MINUTES (length of the day, default 10), DEMO_KEEP=1 (keep lowtide running at
the end until Ctrl-C, for the dashboard), DEMO_TORCH=1 (pip install torch==2.13.0 into this
Python when it is missing, so that the SFT job trains with PyTorch; without torch it uses numpy),
LOWTIDE_DATA (the reference data, default ../shared/data), DEMO_DIR (state, default
.lowtide-demo). Exit codes: 0 the story completed, 1 it did not (the report says what is
missing), 2 bad settings.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from lowtide.adapters.net import free_port_block

REPO = Path(__file__).resolve().parents[1]
DAY_S = 86400.0
#: The jobs of the day: (spec file, parameters, the part of the day their training runs). A step's
#: pace is set so that it runs that part of the day plus LAG_S: the time the services take to see a
#: ramp does not shrink with the day, and the trainers should still hold GPUs when it comes.
JOBS: tuple[tuple[str, dict[str, int], float], ...] = (
    ("examples/jobs/demo-pretrain.yaml", {"steps": 1200, "checkpoint_every": 100}, 0.6),
    ("examples/jobs/demo-sft-torch.yaml", {"steps": 800, "checkpoint_every": 50}, 0.43),
    ("examples/jobs/demo-rl.yaml", {"steps": 600, "checkpoint_every": 200}, 0.4),
    ("examples/jobs/sft-dag.yaml", {"steps": 300}, 0.0),
)
LAG_S = 8.0
#: Submitted in the evening, when the replicas park again: (hour of the day, spec, parameters).
EVENING_JOB = (19.0, "examples/jobs/sft-dag.yaml", {"steps": 300})
ACTIVE = {"STARTING", "SERVING", "DRAINING", "PARKING", "WAKING"}  # replica states that hold GPUs
ASLEEP = {"PARKED"}


def bold(text: str) -> str:
    return f"\033[1m{text}\033[0m" if sys.stdout.isatty() else text


def say(text: str) -> None:
    print(text, flush=True)  # noqa: T201 (a script that talks to a person)


def bad(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)  # noqa: T201
    sys.exit(2)


def env_float(name: str, default: float, low: float, high: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        bad(f"{name} must be a number, got {raw!r}")
    if not low <= value <= high:
        bad(f"{name} must be between {low:g} and {high:g}, got {raw!r}")
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def consecutive_ports(n: int, avoid: set[int]) -> int:
    return free_port_block(n, start=23000, avoid=avoid)


def reachable_by_others(paths: list[Path]) -> bool:
    """Whether every one of `paths` and their parents can be entered by other users (o+x)."""
    return all(p.stat().st_mode & 0o001 for d in paths for p in [d, *d.parents])


def hhmm(trace_s: float) -> str:
    trace_s = max(0.0, trace_s)
    return f"{int(trace_s // 3600) % 24 + 24 * int(trace_s // DAY_S):02d}:{int(trace_s % 3600 // 60):02d}"


@dataclass
class Story:
    """What happened, counted from what the API shows (the test asserts on these)."""

    parks: int = 0
    wakes: int = 0
    starts: int = 0
    notices: int = 0
    preemptions: int = 0
    resumes: int = 0
    jobs_finished: int = 0
    jobs_failed: int = 0
    seen: dict[str, str] = field(default_factory=dict)


class Demo:
    def __init__(self) -> None:
        self.minutes = env_float("DEMO_MINUTES", 10.0, 0.25, 24 * 60)
        self.keep = os.environ.get("DEMO_KEEP", "") not in ("", "0")
        self.want_torch = os.environ.get("DEMO_TORCH", "") not in ("", "0")
        self.dir = Path(os.environ.get("DEMO_DIR") or REPO / ".lowtide-demo").resolve()
        data = os.environ.get("LOWTIDE_DATA") or str(REPO.parent / "shared" / "data")
        self.data = Path(data) if Path(data).is_absolute() else (REPO / data).resolve()
        self.f = self.minutes / 10.0  # every duration of the 10-minute day scales with this
        self.day_wall = self.minutes * 60.0
        self.speedup = DAY_S / self.day_wall
        self.api_port, self.gw = free_port(), {"chat": free_port(), "code": free_port()}
        used = {self.api_port, *self.gw.values()}
        self.base = {"chat": consecutive_ports(4, used)}
        self.base["code"] = consecutive_ports(4, used | set(range(self.base["chat"], self.base["chat"] + 4)))
        self.api = f"http://127.0.0.1:{self.api_port}"
        self.server: subprocess.Popen[bytes] | None = None
        self.loads: dict[str, subprocess.Popen[bytes]] = {}
        self.t0 = 0.0
        self.jobs: dict[str, str] = {}  # id -> name
        self.story = Story()
        self.replica_state: dict[str, str] = {}
        self.attempt_state: dict[int, str] = {}
        self.token = ""
        self.admin = ""

    # -- setup -------------------------------------------------------------------------------

    def scaled(self, seconds: float, least: float) -> float:
        return round(max(least, seconds * self.f), 2)

    def torch_ready(self) -> bool:
        probe = [sys.executable, "-c", "import torch"]
        if subprocess.run(probe, capture_output=True, check=False).returncode == 0:
            return True
        if not self.want_torch:
            return False
        say("installing PyTorch (CPU) into this Python for the SFT job: pip install torch==2.13.0 …")
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "torch==2.13.0"]
        if subprocess.run(pip, check=False).returncode != 0:
            say("note: could not install torch; the SFT job trains with numpy instead")
            return False
        return True

    def service(self, name: str, gpus: int, max_replicas: int, seqs: int, per_replica: int) -> dict[str, Any]:
        return {
            "name": name,
            "model": f"demo-{name}-8b",
            "gpus_per_replica": gpus,
            "min_replicas": 1,
            "max_replicas": max_replicas,
            "park": "sleep",
            "emulate": True,
            "emulator_args": [
                "--cold-start",
                str(self.scaled(4, 1)),
                "--wake",
                str(self.scaled(1.5, 0.3)),
                "--max-num-seqs",
                str(seqs),
                "--no-access-log",
                "--log-level",
                "warning",
            ],
            "base_port": self.base[name],
            "gateway_port": self.gw[name],
            "drain_timeout": f"{self.scaled(10, 2)}s",
            "reclaim_grace": f"{self.scaled(20, 3)}s",
            "expected_startup": f"{self.scaled(4, 1)}s",
            "expected_wake": f"{self.scaled(1.5, 0.5)}s",
            "metrics": {"window": f"{self.scaled(10, 2)}s", "stale_after": "15s"},
            "autoscale": {
                "concurrency_per_replica": per_replica,
                "kv_usage": None,
                "scale_up_window": f"{self.scaled(10, 1.5)}s",
                "scale_down_stabilization": f"{self.scaled(40, 3)}s",
                "tolerance": 0.1,
            },
        }

    def write_config(self) -> Path:
        cfg: dict[str, Any] = {
            "state_dir": str(self.dir / "state"),
            "templates_dir": str(REPO / "examples" / "templates"),
            "tick_seconds": 0.5,
            "nodes": [{"name": "gpu-node-1", "gpus": 8}, {"name": "gpu-node-2", "gpus": 8}],
            "api": {"host": "127.0.0.1", "port": self.api_port},
            "executor": {"checkpoint_poll": "1s", "retry_backoff": "2s"},
            "services": [self.service("chat", 2, 4, 8, 4), self.service("code", 1, 4, 4, 2)],
            "lending": {"mode": "continuous", "timezone": "UTC", "stale_after": "15s"},
            "accounting": {"price_per_gpu_hour": 2.5, "currency": "USD"},
        }
        py = Path(sys.executable)
        import lowtide  # noqa: PLC0415 (only to locate the package)

        dirs = [py.parent, Path(sys.prefix), Path(lowtide.__file__).parent, self.dir]
        if os.geteuid() == 0:
            try:
                import pwd  # noqa: PLC0415

                pwd.getpwnam("lowtide-step")
                if reachable_by_others(dirs):
                    cfg["executor"]["run_as"] = "lowtide-step"
                    cfg["artifact_root"] = str(self.dir / "artifacts")
                else:
                    say(
                        "note: this Python or the demo dir lies where other users cannot reach it; "
                        "steps run as root"
                    )
            except KeyError:
                say("note: no lowtide-step user (`make step-user`); steps run as root, not isolated")
        path = self.dir / "lowtide.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def trace_specs(self) -> tuple[str, dict[str, str]]:
        """The load of each service: (description, {service: --trace spec})."""
        peaks = {"chat": 8.0, "code": 6.0}  # requests/s at the busiest 10 minutes, wall clock
        tokens = {"chat": "256/128", "code": "512/64"}
        clients = {"chat": "142", "code": "112,148"}
        folder = self.data / "traces" / "servegen-m-large"
        if folder.is_dir():
            from lowtide.emulator.traces import read_servegen_client  # noqa: PLC0415

            specs = {}
            for name, ids in clients.items():
                per_window: dict[float, float] = {}
                for cid in ids.split(","):
                    for w in read_servegen_client(folder / f"chunk-{cid}-trace.csv"):
                        if w.start_s < DAY_S:
                            per_window[w.start_s] = per_window.get(w.start_s, 0.0) + w.rate
                scale = peaks[name] / (max(per_window.values()) * self.speedup)
                specs[name] = f"servegen:{folder}#clients={ids}#scale={scale:.6g}#tokens={tokens[name]}"
            return "ServeGen m-large, day 1 (chat: client 142; code: clients 112+148)", specs
        specs = {
            name: f"synthetic:diurnal,rate={peaks[name] / 40 / self.speedup:.6g},"
            f"peak={peaks[name] / self.speedup:.6g}#tokens={tokens[name]}"
            for name in peaks
        }
        return f"the built-in synthetic day ({folder} is absent)", specs

    # -- API ---------------------------------------------------------------------------------

    def get(self, path: str, token: str | None = None) -> Any:
        r = httpx.get(self.api + path, headers={"Authorization": f"Bearer {token or self.admin}"}, timeout=10)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: Any = None, token: str | None = None, **kw: Any) -> Any:
        headers = {"Authorization": f"Bearer {token or self.admin}", **kw.pop("headers", {})}
        r = httpx.post(self.api + path, json=body, headers=headers, timeout=10, **kw)
        r.raise_for_status()
        return r.json()

    def clock(self) -> str:
        return hhmm((time.monotonic() - self.t0) * self.speedup) if self.t0 else "--:--"

    def event(self, text: str) -> None:
        say(f"  [{self.clock()}] {text}")

    # -- the run -----------------------------------------------------------------------------

    def start(self) -> None:
        if self.dir.exists():
            import shutil  # noqa: PLC0415

            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        torch = self.torch_ready()
        config = self.write_config()
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        for key in [k for k in env if k.startswith("LOWTIDE_") and k != "LOWTIDE_DATA"]:
            del env[key]
        began = time.monotonic()
        say(
            bold(
                f"lowtide demo: a {self.minutes:g}-minute day on 2 nodes x 8 declared GPUs "
                f"(state in {self.dir})"
            )
        )
        self.server = subprocess.Popen(
            [sys.executable, "-m", "lowtide", "--config", str(config), "up", "--stop-replicas-on-exit"],
            stdout=(self.dir / "server.log").open("wb"),
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            env=env,
            start_new_session=True,  # Ctrl-C reaches the demo, which cancels the jobs, then stops it
        )
        token_file = self.dir / "state" / "admin.token"
        while True:
            self.check_server()
            with contextlib.suppress(httpx.HTTPError, OSError):
                if token_file.exists() and httpx.get(self.api + "/healthz", timeout=2).status_code == 200:
                    break
            if time.monotonic() - began > 60:
                raise RuntimeError("lowtide did not answer within 60 s (see server.log)")
            time.sleep(0.2)
        self.admin = token_file.read_text().strip()
        made = self.post("/v1/tokens", {"name": "demo", "role": "user", "teams": ["*"], "max_priority": 100})
        self.token = made["token"]
        (self.dir / "demo.token").write_text(self.token + "\n")
        (self.dir / "demo.token").chmod(0o600)
        ui = httpx.get(self.api + "/ui/", timeout=5).status_code
        say(bold(f"dashboard: {self.api}/ui/") + ("" if ui == 200 else "  (not built: run `make web`)"))
        say(
            bold(f"login token: {self.token}") + f"  (user 'demo', every team; also in {self.dir}/demo.token)"
        )
        say(f"admin token: {token_file}   API docs: {self.api}/docs   ({time.monotonic() - began:.0f} s)")
        say(f"the SFT job trains with {'PyTorch' if torch else 'numpy (DEMO_TORCH=1 installs PyTorch)'}")

    def check_server(self) -> None:
        if self.server is not None and self.server.poll() is not None:
            tail = (self.dir / "server.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"lowtide exited ({self.server.returncode}):\n{tail}")

    def wait_serving(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.check_server()
            with contextlib.suppress(httpx.HTTPError):
                svcs = self.get("/v1/services")["services"]
                if all(any(r["state"] == "SERVING" for r in s["replicas"]) for s in svcs):
                    return
            time.sleep(0.3)
        raise RuntimeError("the services had no serving replica within 60 s (see server.log)")

    def start_load(self) -> None:
        what, specs = self.trace_specs()
        say(f"load: {what}, 24 h compressed x{self.speedup:.0f} into {self.day_wall:.0f} s")
        env = {**os.environ, "LOWTIDE_DATA_DIR": str(self.data)}
        for name, spec in specs.items():
            args = [
                sys.executable, "-m", "lowtide", "loadgen", "--trace", spec,
                "--target", f"http://127.0.0.1:{self.gw[name]}", "--speedup", f"{self.speedup:.6g}",
                "--duration", str(DAY_S), "--emulator-hints", "--max-concurrency", "64",
                "--request-timeout", "120", "--drain-timeout", str(self.scaled(10, 3)), "--json",
            ]  # fmt: skip
            self.loads[name] = subprocess.Popen(
                args,
                stdout=(self.dir / f"loadgen-{name}.json").open("wb"),
                stderr=(self.dir / f"loadgen-{name}.log").open("wb"),
                env=env,
                start_new_session=True,
            )
        self.t0 = time.monotonic()
        say(
            "each line: [time of the day] per service: requests in flight / what the serving replicas "
            "take (replicas) | GPUs by holder | jobs by state | preemptions so far; events are indented"
        )

    def submit_jobs(self) -> None:
        for path, params, part in JOBS:
            self.submit(path, params, part)

    def submit(self, path: str, params: dict[str, int], part: float = 0.0) -> None:
        query = [("param", f"{k}={v}") for k, v in params.items()]
        if part:
            pace = (part * self.day_wall + LAG_S) / params["steps"]
            query.append(("param", f"step_seconds={pace:.4f}"))
        job = self.post_spec(REPO / path, query)
        self.jobs[job["id"]] = job["name"]
        self.event(f"submitted {job['name']} ({job['team']}): {path}")

    def post_spec(self, path: Path, query: list[tuple[str, str]]) -> Any:
        r = httpx.post(
            self.api + "/v1/jobs",
            params=query,
            content=path.read_bytes(),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/yaml"},
            timeout=10,
        )
        if r.status_code >= 400:
            raise RuntimeError(f"submit {path.name}: {r.status_code} {r.text}")
        return r.json()

    # -- watching ----------------------------------------------------------------------------

    def observe(self) -> dict[str, Any]:
        """Poll the API once: print events, return what the summary line shows."""
        svcs = self.get("/v1/services")["services"]
        pool = self.get("/v1/pool")
        owner: dict[tuple[str, int], str] = {}
        line_svcs = []
        for s in svcs:
            counts: dict[str, int] = {}
            for r in s["replicas"]:
                key = f"{s['name']}#{r['slot']}"
                state = r["state"]
                counts[state] = counts.get(state, 0) + 1
                before = self.replica_state.get(key)
                if before != state:
                    self.replica_event(key, before, state, r)
                    self.replica_state[key] = state
                if state in ACTIVE:
                    for g in r["gpus"]:
                        owner[(r["node"], g)] = s["name"]
            load = sum(
                (sig["running"] or 0) + (sig["waiting"] or 0) for sig in s["signals"] if not sig["stale"]
            )
            serving = counts.get("SERVING", 0)
            cap = serving * self.per_replica(s["name"])
            asleep = sum(v for k, v in counts.items() if k in ASLEEP)
            coming = counts.get("STARTING", 0) + counts.get("WAKING", 0)
            parts = (
                [f"{serving} serving"]
                + [f"{coming} coming"] * bool(coming)
                + [f"{asleep} asleep"] * bool(asleep)
            )
            line_svcs.append(f"{s['name']} load {load:.0f}/{cap} ({', '.join(parts)})")
        holders = {"chat": 0, "code": 0, "research": 0, "idle": 0}
        for node in pool["nodes"]:
            for g in node["gpus"]:
                if g["holder"] == "attempt":
                    holders["research"] += 1
                elif (node["name"], g["index"]) in owner:
                    holders[owner[(node["name"], g["index"])]] += 1
                else:
                    holders["idle"] += 1
        jobs = self.watch_jobs()
        return {"services": line_svcs, "gpus": holders, "jobs": jobs}

    def per_replica(self, name: str) -> int:
        return 4 if name == "chat" else 2

    def replica_event(self, key: str, before: str | None, state: str, r: dict[str, Any]) -> None:
        where = f"{r['node']} GPUs {','.join(map(str, r['gpus']))}" if r["node"] else ""
        if state in ASLEEP and before is not None:
            self.story.parks += 1
            self.event(f"park: {key} {state.lower()} (load is low), {where} lent to research")
        elif state == "WAKING":
            self.story.wakes += 1
            self.event(f"wake: {key} waking on {where} (load is rising)")
        elif state == "STARTING" and before is None:
            self.story.starts += 1
            self.event(f"start: {key} starting on {where}")
        elif state == "SERVING" and before is not None:
            self.event(f"serving: {key} back in the gateway")

    def watch_jobs(self) -> dict[str, int]:
        states: dict[str, int] = {}
        for jid, name in self.jobs.items():
            d = self.get(f"/v1/jobs/{jid}")
            job = d["job"]
            state = job["state"]
            states[state] = states.get(state, 0) + 1
            if self.story.seen.get(jid) != state and state in ("SUCCEEDED", "FAILED", "CANCELLED"):
                if state == "SUCCEEDED":
                    self.story.jobs_finished += 1
                    self.event(f"done: {name} succeeded")
                else:
                    self.story.jobs_failed += 1
                    self.event(f"{state.lower()}: {name}: {job['message']}")
            self.story.seen[jid] = state
            ckpt = {s["name"]: s["last_checkpoint"] for s in d["steps"]}
            by_step: dict[str, list[dict[str, Any]]] = {}
            for a in sorted(d["attempts"], key=lambda a: a["number"]):
                by_step.setdefault(a["step"], []).append(a)
            for step, attempts in by_step.items():
                for i, a in enumerate(attempts):
                    before = self.attempt_state.get(a["id"])
                    now = a["state"]
                    if before == now:
                        continue
                    self.attempt_state[a["id"]] = now
                    label = f"{name}/{step}"
                    if now == "RUNNING" and before is None:
                        if i and attempts[i - 1]["state"] == "INTERRUPTED":
                            self.story.resumes += 1
                            self.event(
                                f"resume: {label} attempt {a['number']} resumes from {ckpt.get(step)} "
                                f"on {a['node']} GPUs {a['gpus']}"
                            )
                        else:
                            self.event(f"run: {label} on {a['node']} GPUs {a['gpus']}")
                    elif now == "STOPPING" or (now == "INTERRUPTED" and before != "STOPPING"):
                        self.story.notices += 1
                        why = a["stop_reason"] or "reclaim"
                        self.event(
                            f"notice: {label} must give GPUs {a['gpus']} back ({why}): checkpoint and exit"
                        )
                    if now == "INTERRUPTED":
                        self.story.preemptions += 1
                        self.event(f"preempted: {label} checkpointed ({ckpt.get(step)}) and stepped aside")
        return states

    def summary(self, view: dict[str, Any]) -> None:
        g, j = view["gpus"], view["jobs"]
        jobs = ", ".join(f"{v} {k.lower()}" for k, v in sorted(j.items()))
        say(
            bold(f"[{self.clock()}]")
            + " " + " | ".join(view["services"])
            + f" | GPUs: chat {g['chat']}, code {g['code']}, research {g['research']}, idle {g['idle']}"
            + f" | jobs: {jobs} | preemptions {self.story.preemptions}"
        )  # fmt: skip

    def run_day(self) -> None:
        every = max(1.0, min(5.0, self.day_wall / 120))
        last = 0.0
        evening = False
        while any(p.poll() is None for p in self.loads.values()):
            self.check_server()
            if not evening and (time.monotonic() - self.t0) * self.speedup >= EVENING_JOB[0] * 3600:
                evening = True
                self.event("a nightly job for the GPUs the evening gives back:")
                self.submit(EVENING_JOB[1], EVENING_JOB[2])
            view = self.observe()
            if time.monotonic() - last >= every:
                self.summary(view)
                last = time.monotonic()
            time.sleep(0.5)
        # The day is over; the jobs get a while longer to finish.
        deadline = time.monotonic() + max(20.0, self.day_wall * 0.3)
        while time.monotonic() < deadline:
            view = self.observe()
            if all(s in ("SUCCEEDED", "FAILED", "CANCELLED") for s in self.story.seen.values()):
                break
            if time.monotonic() - last >= every:
                self.summary(view)
                last = time.monotonic()
            time.sleep(0.5)
        self.summary(self.observe())

    # -- the end -----------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        usage = self.get("/v1/reports/usage?start=1d&group_by=team")
        t = usage["totals"]
        reclaims = self.get("/v1/reclaims?limit=200")
        reclaims = reclaims.get("reclaims", reclaims) if isinstance(reclaims, dict) else reclaims
        times = sorted(r["total_s"] for r in reclaims if r.get("total_s") is not None)
        frees = sorted(r["freed_at"] - r["detected_at"] for r in reclaims if r.get("freed_at") is not None)
        loads = {}
        for name in self.loads:
            with contextlib.suppress(OSError, ValueError):
                loads[name] = json.loads((self.dir / f"loadgen-{name}.json").read_text())
        research_h = t["research_gpu_seconds"] / 3600
        rep = {
            "minutes": self.minutes,
            "speedup": self.speedup,
            "research_gpu_hours": research_h,
            "research_gpu_hours_day": research_h * self.speedup,
            "lent_gpu_hours": t["lent_gpu_seconds"] / 3600,
            "lost_gpu_hours": t["lost_gpu_seconds"] / 3600,
            "preemptions": self.story.preemptions,
            "notices": self.story.notices,
            "resumes": self.story.resumes,
            "parks": self.story.parks,
            "wakes": self.story.wakes,
            "reclaims": len(reclaims),
            "reclaim_total_s": times,
            "reclaim_freed_s": frees,
            "jobs": len(self.jobs),
            "jobs_finished": self.story.jobs_finished,
            "jobs_failed": self.story.jobs_failed,
            "requests": {n: {k: v.get(k) for k in ("sent", "ok", "failed")} for n, v in loads.items()},
        }
        say(bold("\n== the day's report"))
        say(
            f"GPU-hours harvested by research: {research_h:.2f} GPU-h of wall time "
            f"(≈ {research_h * self.speedup:.0f} GPU-h of a real day at x{self.speedup:.0f}), "
            f"worth {usage['price_per_gpu_hour'] * research_h * self.speedup:.0f} {usage['currency']}"
        )
        for row in usage["rows"]:
            if row["research_gpu_seconds"]:
                say(
                    f"  team {row['key']}: {row['research_gpu_seconds'] / 3600:.3f} GPU-h, "
                    f"{row['preemptions']} preemptions"
                )
        say(
            f"preemptions: {self.story.preemptions} (notices {self.story.notices}), "
            f"resumed from a checkpoint: {self.story.resumes}; work lost: {t['lost_gpu_seconds']:.0f} GPU-s"
        )
        if times or frees:
            med = times[len(times) // 2] if times else None
            say(
                f"GPUs came back: {len(reclaims)} reclaims; surge → GPUs free: "
                + (f"median {frees[len(frees) // 2]:.1f} s, max {frees[-1]:.1f} s" if frees else "-")
                + "; surge → replica serving: "
                + (f"median {med:.1f} s, max {times[-1]:.1f} s" if times else "-")
            )
        else:
            say("GPUs came back: no reclaim was needed")
        say(f"replicas: {self.story.parks} parks, {self.story.wakes} wakes, {self.story.starts} starts")
        say(
            f"jobs finished: {self.story.jobs_finished} of {len(self.jobs)} ({self.story.jobs_failed} failed)"
        )
        for name, v in loads.items():
            ttft = v.get("ttft_s") or {}
            p90 = ttft.get("p90") if isinstance(ttft, dict) else None
            say(
                f"requests to {name}: {v.get('sent')} sent, {v.get('ok')} ok, {v.get('failed')} failed"
                + (f", TTFT p90 {p90:.2f} s" if isinstance(p90, float) else "")
            )
        (self.dir / "report.json").write_text(json.dumps(rep, indent=2))
        return rep

    def stop(self) -> list[str]:
        """Stop the load, cancel what still runs, stop lowtide (gateways and replicas with it);
        return what was left running (and killed)."""
        for p in self.loads.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self.loads.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=15)
            if p.poll() is None:
                p.kill()
        if self.server is not None and self.server.poll() is None:
            unfinished = [
                j for j, s in self.story.seen.items() if s not in ("SUCCEEDED", "FAILED", "CANCELLED")
            ]
            for jid in unfinished:
                with contextlib.suppress(httpx.HTTPError):
                    self.post(f"/v1/jobs/{jid}/cancel")
            deadline = time.monotonic() + 30
            while unfinished and time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if all(
                        self.get(f"/v1/jobs/{j}")["job"]["state"] in ("FAILED", "CANCELLED", "SUCCEEDED")
                        for j in unfinished
                    ):
                        break
                time.sleep(0.5)
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        return self.leftovers()

    def leftovers(self) -> list[str]:
        ports = {str(p) for b in self.base.values() for p in range(b, b + 4)} | {
            str(p) for p in self.gw.values()
        }
        mine, found = str(self.dir), []
        time.sleep(0.5)
        for p in psutil.process_iter(["pid", "cmdline"]):
            if p.pid == os.getpid():
                continue
            cmd = p.info["cmdline"] or []
            text = " ".join(cmd)
            ours = mine in text or ("lowtide" in text and any(
                a == "--port" and i + 1 < len(cmd) and cmd[i + 1] in ports for i, a in enumerate(cmd)
            ))  # fmt: skip
            if ours:
                found.append(f"{p.pid}: {text[:120]}")
                with contextlib.suppress(psutil.Error):
                    p.kill()
        return found


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    demo = Demo()
    code = 1
    # Ctrl-C or SIGTERM (even where the shell started us with SIGINT ignored): stop cleanly.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        demo.start()
        demo.wait_serving()
        demo.start_load()
        demo.submit_jobs()
        demo.run_day()
        rep = demo.report()
        story = (
            rep["parks"] >= 1 and rep["preemptions"] >= 1 and rep["resumes"] >= 1
            and rep["jobs_finished"] == rep["jobs"]
        )  # fmt: skip
        say(
            bold(
                "the whole story happened: replicas parked, jobs ran on lent GPUs, got notice, "
                "checkpointed, resumed and finished"
            )
            if story
            else bold(
                "the story is incomplete: see the counts above (a slow or busy machine stretches the day)"
            )
        )
        code = 0 if story else 1
        if demo.keep:
            say(f"DEMO_KEEP: lowtide keeps running at {demo.api}/ui/ (token above); Ctrl-C stops it")
            with contextlib.suppress(KeyboardInterrupt):
                while demo.server is not None and demo.server.poll() is None:
                    time.sleep(1)
    except KeyboardInterrupt:
        say("\ninterrupted")
    except Exception as exc:  # the demo's last word: say why, then clean up
        say(f"demo failed: {exc}")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the clean-up runs to its end
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        left = demo.stop()
        if left:
            say("left running (now killed): " + "; ".join(left))
            code = 1
        else:
            say(f"stopped: lowtide, the gateways and the replicas; nothing left running. State in {demo.dir}")
    return code


if __name__ == "__main__":
    sys.exit(main())
