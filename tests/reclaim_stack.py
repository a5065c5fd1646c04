"""A real `lowtide up` for the reclaim tests: free ports, the server as a subprocess with a given
configuration and its teardown, a small HTTP client for it, and a load surge through its gateway
that runs until told to stop.

Used by `integration/test_reclaim_e2e.py` (the reclaim story with real trainers) and
`integration/test_sim_replay.py` (the same story replayed in the simulator). Step processes
outlive the control plane by design, so teardown kills the step shims this run started (found
by the run's temp dir on their command line).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from lowtide.adapters.net import free_port_block
from lowtide.emulator.loadgen import LoadReport, run_load
from lowtide.emulator.traces import TraceRequest
from support import wait_until


def free_ports(n: int) -> list[int]:
    out = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            out.append(int(s.getsockname()[1]))
    return out


def consecutive_ports(n: int) -> int:
    return free_port_block(n, start=31000)


@dataclass
class Stack:
    root: Path
    api: str
    gateway: str

    def get(self, path: str) -> Any:
        return httpx.get(f"{self.api}{path}", timeout=10).json()

    def submit(self, doc: dict[str, Any]) -> str:
        r = httpx.post(
            f"{self.api}/v1/jobs",
            content=yaml.safe_dump(doc),
            headers={"Content-Type": "application/yaml"},
            timeout=10,
        )
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def train_attempts(self, job: str) -> list[dict[str, Any]]:
        return [a for a in self.get(f"/v1/jobs/{job}")["attempts"] if a["step"] == "train"]


def shim_groups(root: Path) -> list[int]:
    """Process ids of the step shims started for the run under `root` (each leads its group)."""
    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if "lowtide.adapters.step_shim" in (cmd := " ".join(p.info["cmdline"] or [])) and str(root) in cmd
    ]


@contextlib.contextmanager
def lowtide_up(root: Path, config: dict[str, Any], *, replicas_serving: int = 1) -> Iterator[Stack]:
    """`lowtide up --stop-replicas-on-exit` in `root` with `config` (its `api.port` and each
    service's `gateway_port` say where it listens; the first service's gateway is `Stack.gateway`),
    yielded once `replicas_serving` replicas of the first service serve; stopped (and every step
    shim of this run killed) afterwards."""
    path = root / "lowtide.yaml"
    path.write_text(yaml.safe_dump(config))
    log = root / "server.log"
    server = subprocess.Popen(
        [sys.executable, "-m", "lowtide", "--config", str(path), "up", "--stop-replicas-on-exit"],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        cwd=root,
    )
    gateway = config["services"][0].get("gateway_port")
    st = Stack(root, f"http://127.0.0.1:{config['api']['port']}", f"http://127.0.0.1:{gateway}")

    def serving() -> bool:
        if server.poll() is not None:
            raise AssertionError("lowtide exited:\n" + log.read_text()[-3000:])
        with contextlib.suppress(httpx.HTTPError, KeyError, IndexError):
            states = [r["state"] for r in st.get("/v1/services")["services"][0]["replicas"]]
            return states.count("SERVING") == replicas_serving
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
        for pgid in shim_groups(root):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)


class Surge:
    """Replay `requests` through `gateway` (emulator hints on) on a thread of its own until the
    stream ends or `stop()` is called; `stop()` returns the load generator's report."""

    def __init__(self, requests: Iterator[TraceRequest], gateway: str) -> None:
        self._requests = requests
        self._gateway = gateway
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.report: LoadReport | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="surge", daemon=True)

    def __enter__(self) -> Surge:
        self._thread.start()
        if not self._ready.wait(10):
            raise AssertionError("the load generator did not start within 10 s")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        async def main() -> LoadReport:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._ready.set()
            return await run_load(
                self._requests,
                self._gateway,
                speedup=1,
                emulator_hints=True,
                drain_timeout_s=60,
                request_timeout_s=60,
                stop=self._stop,
            )

        try:
            self.report = asyncio.run(main())
        except BaseException as exc:  # reported by stop()
            self.error = exc
            self._ready.set()

    def stop(self) -> LoadReport:
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=120)
        if self.error is not None:
            raise AssertionError(f"the load generator failed: {self.error!r}") from self.error
        if self.report is None:
            raise AssertionError("the load generator did not finish within 120 s")
        return self.report
