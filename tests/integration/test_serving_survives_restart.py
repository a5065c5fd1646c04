"""Serving survives restarts of the control plane (issue 12, defect 2), with real processes only:
`lowtide up` runs an emulated vLLM replica behind its gateway process; a steady stream of requests
goes through the gateway while lowtide is stopped with SIGTERM and started again, then killed
with SIGKILL and started again: not one request fails, and the same gateway process serves
throughout (adopted by each start). Then the gateway process itself is killed: the running lowtide
starts a new one, which routes from the same table.

Nothing asserts a duration; every wait is a bounded poll; every process is stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from reclaim_stack import consecutive_ports, free_ports, shim_groups
from support import GatewayLoad, wait_until

pytestmark = pytest.mark.slow

BODY = {"model": "demo-8b", "prompt": "hi", "max_tokens": 2}


class Lowtide:
    """`lowtide up` (replicas and gateway kept on exit) that can be stopped and started again."""

    def __init__(self, root: Path, config: dict[str, Any]) -> None:
        self.root = root
        self.path = root / "lowtide.yaml"
        self.path.write_text(yaml.safe_dump(config))
        self.api = f"http://127.0.0.1:{config['api']['port']}"
        self.gateway = f"http://127.0.0.1:{config['services'][0]['gateway_port']}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = (self.root / f"server-{self.starts}.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lowtide", "--config", str(self.path), "up"],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.root,
        )
        wait_until(self.serving, timeout=60, what="lowtide to serve")

    def serving(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            text = (self.root / f"server-{self.starts}.log").read_text()
            raise AssertionError("lowtide exited:\n" + text[-3000:])
        with contextlib.suppress(httpx.HTTPError, KeyError, IndexError):
            replicas = httpx.get(f"{self.api}/v1/services", timeout=5).json()["services"][0]["replicas"]
            return [r["state"] for r in replicas] == ["SERVING"]
        return False

    def stop(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)

    def gateway_pid(self) -> int:
        return int(json.loads((self.root / "state" / "gateway" / "gateway_shim.json").read_text())["pid"])


@pytest.fixture
def lowtide(tmp_path: Path) -> Iterator[Lowtide]:
    api_port, gw_port = free_ports(2)
    base = consecutive_ports(1)
    config = {
        "state_dir": "state",
        "tick_seconds": 0.5,
        "nodes": [{"name": "n1", "gpus": 2}],
        "api": {"port": api_port},
        "auth": {"enabled": False},
        "services": [
            {
                "name": "chat",
                "model": "demo-8b",
                "gpus_per_replica": 2,
                "min_replicas": 1,
                "max_replicas": 1,
                "emulate": True,
                "emulator_args": ["--cold-start", "0.5", "--no-access-log"],
                "base_port": base,
                "gateway_port": gw_port,
            }
        ],
    }
    lt = Lowtide(tmp_path, config)
    try:
        yield lt
    finally:
        if lt.proc is not None and lt.proc.poll() is None:
            lt.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                lt.proc.wait(timeout=30)
            if lt.proc.poll() is None:
                lt.proc.kill()
        for pgid in shim_groups(tmp_path):  # the replica and the gateway
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)


def test_requests_through_the_gateway_never_fail_while_lowtide_restarts(lowtide: Lowtide) -> None:
    lowtide.start()
    gateway = lowtide.gateway_pid()
    load = GatewayLoad(f"{lowtide.gateway}/v1/completions", BODY, pause_s=0.02)
    try:
        load.more(10, "requests to flow")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            lowtide.stop(sig)
            load.more(10, f"requests while lowtide is down after {sig.name}")
            lowtide.start()
            load.more(10, f"requests after the start that followed {sig.name}")
            assert lowtide.gateway_pid() == gateway  # adopted, never restarted
    finally:
        load.stop()
    assert load.failed == [], load.failed[:5]
    assert load.ok >= 60

    # The gateway process dies: the running lowtide starts another, routing from the same table.
    os.killpg(gateway, signal.SIGKILL)
    wait_until(lambda: lowtide.gateway_pid() != gateway, timeout=30, what="a new gateway process")

    def served() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.post(f"{lowtide.gateway}/v1/completions", json=BODY, timeout=10).status_code == 200
        return False

    wait_until(served, timeout=30, what="the new gateway to serve")
