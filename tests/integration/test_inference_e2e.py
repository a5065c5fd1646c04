"""The inference side end to end, with real parts only: `lowtide up` runs emulated vLLM replicas
behind its gateway; a real Prometheus server (the Debian `prometheus` binary, started here on a
free port with a generated scrape config) scrapes the replicas; lowtide reads the load through
PromQL. Load up → more desired replicas and more replicas serving; load down → fewer after the
stabilisation window; a steady trickle of requests through the gateway never fails while the
extra replicas drain and are put to sleep.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from conftest import require_service
from lowtide.emulator.loadgen import LoadReport, run_load_sync
from lowtide.emulator.traces import FixedTokens, synthetic
from reclaim_stack import consecutive_ports, free_ports, shim_groups
from support import wait_until

pytestmark = pytest.mark.slow

STABILISATION_S = 15.0


@dataclass
class Stack:
    root: Path
    api: str
    gateway: str
    prometheus: str

    def services(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.api}/v1/services", timeout=5).json())

    def chat(self) -> dict[str, Any]:
        return dict(self.services()["services"][0])

    def states(self) -> list[str]:
        return [r["state"] for r in self.chat()["replicas"]]


def _kill_groups(groups: list[int]) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    binary = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None
    )
    if binary is None:
        require_service("prometheus", "the `prometheus` binary is not installed (Debian package prometheus)")
    api_port, gw_port, prom_port = free_ports(3)
    base = consecutive_ports(3)
    prom_dir = tmp_path / "prometheus"
    prom_dir.mkdir()
    (prom_dir / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "vllm",
                        "scrape_interval": "1s",
                        "static_configs": [{"targets": [f"127.0.0.1:{base + i}" for i in range(3)]}],
                    }
                ],
            }
        )
    )
    prom = subprocess.Popen(
        [
            str(binary),
            f"--config.file={prom_dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={prom_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--storage.tsdb.retention.time=1h",
        ],
        stdout=(prom_dir / "prometheus.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    prom_url = f"http://127.0.0.1:{prom_port}"

    def ready() -> bool:
        if prom.poll() is not None:
            raise AssertionError("prometheus exited:\n" + (prom_dir / "prometheus.log").read_text()[-3000:])
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{prom_url}/-/ready", timeout=1).status_code == 200
        return False

    wait_until(ready, timeout=30, what="prometheus to be ready")
    config = tmp_path / "lowtide.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": "state",
                "tick_seconds": 0.5,
                "nodes": [{"name": "n1", "gpus": 8}],
                "api": {"port": api_port},
                "auth": {"enabled": False},
                "services": [
                    {
                        "name": "chat",
                        "model": "demo-8b",
                        "gpus_per_replica": 2,
                        "min_replicas": 1,
                        "max_replicas": 3,
                        "park": "sleep",
                        "emulate": True,
                        "emulator_args": ["--cold-start", "1", "--wake", "0.5", "--max-num-seqs", "4"],
                        "base_port": base,
                        "gateway_port": gw_port,
                        "drain_timeout": "20s",
                        "metrics": {
                            "source": "prometheus",
                            "prometheus_url": prom_url,
                            "selector": 'job="vllm"',
                            "window": "10s",
                            "stale_after": "15s",
                        },
                        "autoscale": {
                            "concurrency_per_replica": 4,
                            "kv_usage": None,
                            "scale_up_window": "5s",
                            "scale_down_stabilization": f"{STABILISATION_S:g}s",
                            "tolerance": 0,
                        },
                    }
                ],
                "lending": {"stale_after": "15s", "stale_reclaim_after": "60s"},
            }
        )
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "lowtide", "--config", str(config), "up", "--stop-replicas-on-exit"],
        stdout=(tmp_path / "server.log").open("wb"),
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    st = Stack(tmp_path, f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{gw_port}", prom_url)

    def serving() -> bool:
        if server.poll() is not None:
            raise AssertionError("lowtide exited:\n" + (tmp_path / "server.log").read_text()[-3000:])
        with contextlib.suppress(httpx.HTTPError, IndexError, KeyError):
            return st.states() == ["SERVING"]
        return False

    try:
        wait_until(serving, timeout=60, what="the first replica to serve")
        yield st
        # `lowtide up --stop-replicas-on-exit`: a clean stop leaves no replica behind.
        assert shim_groups(tmp_path), "replica processes should be running before the stop"
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        wait_until(lambda: not shim_groups(tmp_path), timeout=10, what="the replicas to be stopped")
    finally:
        if server.poll() is None:
            server.kill()
        _kill_groups(shim_groups(tmp_path))
        prom.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            prom.wait(timeout=10)
        if prom.poll() is None:
            prom.kill()


def load(
    stack: Stack, rate: float, seconds: float, result: dict[str, LoadReport], output_tokens: int = 160
) -> threading.Thread:
    def run() -> None:
        tokens = FixedTokens(64, output_tokens)
        requests = synthetic("constant", rate=rate, duration_s=seconds, seed=7, tokens=tokens)
        result["report"] = run_load_sync(
            requests, stack.gateway, speedup=1, duration_s=seconds, emulator_hints=True, drain_timeout_s=60
        )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_load_drives_replicas_up_and_down_through_prometheus_without_failing_a_request(stack: Stack) -> None:
    # The data comes from Prometheus, fresh.
    wait_until(
        lambda: (c := stack.chat())["signals"] and not c["signals"][0]["stale"],
        timeout=30,
        what="fresh signals from Prometheus",
    )
    assert stack.chat()["source_error"] is None

    burst: dict[str, LoadReport] = {}
    burst_thread = load(stack, rate=8, seconds=25, result=burst)
    up = wait_until(lambda: (c := stack.chat())["desired"] >= 2 and c, timeout=40, what="a scale-up")
    assert "concurrency" in up["reason"]
    wait_until(lambda: stack.states().count("SERVING") >= 2, timeout=40, what="a second replica serving")
    burst_thread.join(timeout=120)
    burst_ended = time.monotonic()
    # The count to come down from is the one the burst left (it may have grown after the first step up).
    peak_desired = max(up["desired"], stack.chat()["desired"])
    assert burst["report"].failed == 0, burst["report"].format_text()
    assert burst["report"].ok > 100

    trickle: dict[str, LoadReport] = {}
    # Short answers (~0.5 s each at batch 1): about one request in flight, well inside one replica
    # even when a loaded CI machine stretches the emulator's decode steps.
    trickle_thread = load(stack, rate=1, seconds=60, result=trickle, output_tokens=40)
    down = wait_until(
        lambda: (c := stack.chat())["desired"] < peak_desired and c, timeout=90, what="the scale-down"
    )
    assert time.monotonic() - burst_ended >= STABILISATION_S * 0.8  # held through the stabilisation window
    wait_until(
        lambda: "PARKED" in (st := stack.states()) and "DRAINING" not in st and "PARKING" not in st,
        timeout=60,
        what="a replica drained and parked",
    )
    parked = [r for r in stack.chat()["replicas"] if r["state"] == "PARKED"]
    assert all(r["parked_as"] == "sleep" for r in parked)
    assert down["desired"] >= 1
    trickle_thread.join(timeout=120)
    report = trickle["report"]
    assert report.failed == 0 and report.ok >= 30, report.format_text()

    # The ledger gave the parked replicas' GPUs back, and the envelope lends them.
    # (Read both until they agree: another replica may start parking between the two reads.)
    def replica_gpus_match_serving() -> bool:
        pool = httpx.get(f"{stack.api}/v1/pool", timeout=5).json()
        replica_gpus = sum(g["holder"] == "replica" for n in pool["nodes"] for g in n["gpus"])
        return replica_gpus == 2 * stack.states().count("SERVING")

    wait_until(replica_gpus_match_serving, timeout=30, what="the pool to match the serving replicas")
    lending = stack.services()["lending"]
    assert lending["lendable_gpus"] >= 8 - 2 * stack.chat()["desired"] - lending["reserve_gpus"]
    events = httpx.get(f"{stack.api}/v1/services/chat", timeout=5).json()["events"]
    kinds = [e["kind"] for e in events]
    for kind in ("starting", "serving", "draining", "parking", "parked"):
        assert kind in kinds, kinds
