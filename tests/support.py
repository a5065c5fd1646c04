"""Helpers shared by tests: bounded waiting, an embedded lowtide in a temp dir, spec writing."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
import yaml

from lowtide.config import Settings, load_settings
from lowtide.wiring import Embedded, build

T = TypeVar("T")


def wait_until(cond: Callable[[], T], timeout: float = 20.0, interval: float = 0.05, what: str = "") -> T:
    """Poll `cond` until it returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")
        time.sleep(interval)


def settings_for(tmp_path: Path, **overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "state_dir": str(tmp_path / "state"),
        "artifact_root": str(tmp_path / "artifacts"),
        "templates_dir": str(Path(__file__).resolve().parents[1] / "examples" / "templates"),
        "tick_seconds": 0.1,
        "nodes": [{"name": "node-a", "gpus": 4}, {"name": "node-b", "gpus": 2}],
        "executor": {"retry_backoff": 0.2, "retry_backoff_max": 1, "checkpoint_poll": 0.1},
        "api": {"port": 0},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    config = tmp_path / "lowtide.yaml"
    config.write_text(yaml.safe_dump(base))
    return load_settings(config)


def embedded(tmp_path: Path, **overrides: Any) -> Embedded:
    return build(settings_for(tmp_path, **overrides))


def tick_until(lt: Embedded, cond: Callable[[], T], timeout: float = 30.0, what: str = "") -> T:
    """Drive the loop by hand (no thread) until `cond` holds."""

    def step() -> T:
        lt.loop.tick()
        return cond()

    return wait_until(step, timeout=timeout, interval=0.05, what=what)


class Served:
    """An ASGI app on a free loopback port in a uvicorn thread (for CLI tests over real HTTP)."""

    def __init__(self, app: Any) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off"))
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._server.serve([self._sock])), daemon=True
        )
        self._thread.start()
        wait_until(lambda: self._server.started, timeout=10, what="the API server to start")

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
        self._sock.close()
        assert not self._thread.is_alive()
