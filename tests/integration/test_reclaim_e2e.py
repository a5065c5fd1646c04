"""Lend, reclaim, resume with real processes: `lowtide up` with emulated vLLM replicas behind its
gateway and two real example trainers on lent GPUs. A load surge makes the service want a second
replica; the trainer with the least work since its checkpoint is chosen, gets notice, checkpoints
and exits; the replica serves within the bound; when the load is gone the trainer resumes from its
checkpoint and ends with exactly the weights of an uninterrupted run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from lowtide.emulator.loadgen import LoadReport, run_load_sync
from lowtide.emulator.traces import FixedTokens, synthetic
from reclaim_stack import Stack, consecutive_ports, free_ports
from reclaim_stack import shim_groups as _shim_groups
from support import wait_until

pytestmark = pytest.mark.slow

TICK = 0.3
GRACE = 15.0
STARTUP = 3.0
TRAIN_ARGS = ["--steps", "500", "--lr", "0.05", "--step-seconds", "0.04"]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    api_port, gw_port = free_ports(2)
    base = consecutive_ports(2)
    config = tmp_path / "lowtide.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": "state",
                "tick_seconds": TICK,
                "nodes": [{"name": "n1", "gpus": 2}, {"name": "n2", "gpus": 2}, {"name": "n3", "gpus": 2}],
                "api": {"port": api_port},
                "auth": {"enabled": False},
                "executor": {"checkpoint_poll": "0.3s"},
                "services": [
                    {
                        "name": "chat",
                        "model": "demo-8b",
                        "gpus_per_replica": 2,
                        "min_replicas": 1,
                        "max_replicas": 2,
                        "park": "sleep",
                        "emulate": True,
                        "emulator_args": ["--cold-start", "1", "--wake", "0.5", "--max-num-seqs", "2"],
                        "base_port": base,
                        "gateway_port": gw_port,
                        "drain_timeout": "5s",
                        "reclaim_grace": f"{GRACE:g}s",
                        "expected_startup": f"{STARTUP:g}s",
                        "expected_wake": "1s",
                        "metrics": {"window": "5s", "stale_after": "10s"},
                        "autoscale": {
                            "concurrency_per_replica": 2,
                            "kv_usage": None,
                            "scale_up_window": "2s",
                            "scale_down_stabilization": "8s",
                            "tolerance": 0,
                        },
                    }
                ],
            }
        )
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "lowtide", "--config", str(config), "up", "--stop-replicas-on-exit"],
        stdout=(tmp_path / "server.log").open("wb"),
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    st = Stack(tmp_path, f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{gw_port}")

    def serving() -> bool:
        if server.poll() is not None:
            raise AssertionError("lowtide exited:\n" + (tmp_path / "server.log").read_text()[-3000:])
        with contextlib.suppress(httpx.HTTPError, KeyError, IndexError):
            return [r["state"] for r in st.get("/v1/services")["services"][0]["replicas"]] == ["SERVING"]
        return False

    try:
        wait_until(serving, timeout=60, what="the first replica")
        yield st
    finally:
        server.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=60)
        if server.poll() is None:
            server.kill()
        for pgid in _shim_groups(tmp_path):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)


def trainer_job(name: str, data: Path, checkpoint_every: int) -> dict[str, Any]:
    return {
        "name": name,
        "grace_seconds": 60,
        "steps": [
            {
                "name": "train",
                "gpus": 2,
                "checkpoint": True,
                "command": [
                    sys.executable,
                    "-m",
                    "lowtide.examples.train",
                    "--data",
                    str(data),
                    "--out",
                    "{{outputs}}",
                    "--checkpoint-every",
                    str(checkpoint_every),
                    *TRAIN_ARGS,
                ],
            }
        ],
    }


def test_a_surge_reclaims_the_cheapest_trainer_which_resumes_and_matches_an_uninterrupted_run(
    stack: Stack, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "lowtide.examples.prep", "--out", str(data), "--shards", "2"], check=True
    )
    cheap = stack.submit(trainer_job("checkpoints-often", data, checkpoint_every=5))
    costly = stack.submit(trainer_job("never-checkpoints", data, checkpoint_every=100000))
    wait_until(
        lambda: all(
            a and a[-1]["state"] == "RUNNING"
            for a in (stack.train_attempts(cheap), stack.train_attempts(costly))
        ),
        timeout=30,
        what="both trainers running",
    )
    wait_until(
        lambda: stack.get(f"/v1/jobs/{cheap}")["steps"][0]["last_checkpoint"],
        timeout=30,
        what="a first checkpoint",
    )
    first = {j: stack.train_attempts(j)[0] for j in (cheap, costly)}

    report: dict[str, LoadReport] = {}

    def surge() -> None:
        report["load"] = run_load_sync(
            synthetic("constant", rate=6, duration_s=12, seed=3, tokens=FixedTokens(32, 120)),
            stack.gateway,
            speedup=1,
            duration_s=12,
            emulator_hints=True,
            drain_timeout_s=60,
        )

    load = threading.Thread(target=surge, daemon=True)
    load.start()
    reclaim = wait_until(
        lambda: next((r for r in stack.get("/v1/reclaims") if r["state"] == "DONE"), None),
        timeout=60,
        what="a finished reclaim",
    )
    load.join(timeout=120)
    assert report["load"].failed == 0, report["load"].format_text()

    # The trainer with the least work since its checkpoint was the one chosen, and only it.
    assert reclaim["victims"] == [first[cheap]["id"]]
    stopped = stack.train_attempts(cheap)[0]
    assert (
        stopped["state"] == "INTERRUPTED"
        and stopped["exit_code"] == 143
        and not stopped["killed_at_deadline"]
    )
    assert stopped["notice_at"] is not None
    never = stack.train_attempts(costly)
    assert len(never) == 1 and never[0]["state"] in ("RUNNING", "SUCCEEDED") and never[0]["notice_at"] is None
    # The replica served within the bound: a tick + the grace + the replica's start-up, + 1 s.
    assert reclaim["total_s"] <= TICK + GRACE + STARTUP + 1.0, reclaim
    assert reclaim["detected_at"] <= reclaim["decided_at"] <= reclaim["notice_at"] <= reclaim["freed_at"]

    # Load gone: the second replica sleeps, the trainer resumes from its checkpoint and finishes.
    final = wait_until(
        lambda: (d := stack.get(f"/v1/jobs/{cheap}"))["job"]["state"] in ("SUCCEEDED", "FAILED") and d,
        timeout=120,
        what="the preempted trainer to finish",
    )
    assert final["job"]["state"] == "SUCCEEDED"
    attempts = [a for a in final["attempts"] if a["step"] == "train"]
    assert [a["state"] for a in attempts] == ["INTERRUPTED", "SUCCEEDED"]
    assert attempts[1]["record"]["resume_from"] is not None
    step = final["steps"][0]
    assert (step["preemptions"], step["retries_used"]) == (1, 0)

    # Same result as an uninterrupted run: identical weights, every step applied exactly once.
    resumed = json.loads((Path(step["outputs"]) / "model.json").read_text())
    alone = tmp_path / "alone"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "lowtide.examples.train",
            "--data",
            str(data),
            "--out",
            str(alone),
            *TRAIN_ARGS[:4],
            "--step-seconds",
            "0",
        ],
        check=True,
        env={**os.environ, "LOWTIDE_CHECKPOINT_DIR": ""},
    )
    reference = json.loads((alone / "model.json").read_text())
    assert resumed["w"] == reference["w"]
    assert resumed["updates"] == reference["updates"] == 500
