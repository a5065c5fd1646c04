"""Helpers shared by tests: bounded waiting, an embedded lowtide in a temp dir, spec writing, and
the job calls the integration tests make through its API (auth off)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn
import yaml
from fastapi.testclient import TestClient

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


# -- an embedded lowtide's API with auth off (tests that drive the loop by hand) -------------------

FINISHED_JOB_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")


def submit_job(lt: Embedded, doc: dict[str, Any]) -> str:
    """Submit `doc` as YAML; the new job's id (the submit must succeed)."""
    r = TestClient(lt.app).post(
        "/v1/jobs", content=yaml.safe_dump(doc), headers={"Content-Type": "application/yaml"}
    )
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def job_detail(lt: Embedded, job_id: str) -> dict[str, Any]:
    r = TestClient(lt.app).get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def job_finished(lt: Embedded, job_id: str) -> bool:
    return job_detail(lt, job_id)["job"]["state"] in FINISHED_JOB_STATES


def step_log(lt: Embedded, job_id: str, step: str, attempt: int | None = None) -> str:
    params = {"attempt": attempt} if attempt else {}
    r = TestClient(lt.app).get(f"/v1/jobs/{job_id}/steps/{step}/logs", params=params)
    assert r.status_code == 200, r.text
    return r.text


def kill_steps_and_close(lt: Embedded) -> None:
    """Close an embedded lowtide after killing the process groups of its active attempts."""
    for att in lt.store.active_attempts():
        if att.handle and att.handle.isdigit():  # the local executor's handle: the shim's pid
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(att.handle), signal.SIGKILL)
    lt.close()


# -- the step user of `executor.run_as` ----------------------------------------------------------

STEP_USER = "lowtide-step"


def step_attempt_token(lt: Embedded, job_id: str, step: str) -> tuple[int, str]:
    """Book an attempt of `step` (no GPUs) as the loop would, and mint its step token: what a
    running step reports checkpoints with. Returns (attempt id, raw token)."""
    lt.store.ensure_gpus(lt.nodes, lt.clock.now())
    launch = running(
        lt.store,
        lt.store.begin_attempt(
            job_id=job_id,
            step=step,
            node=lt.nodes[0].name,
            gpus=(),
            layout=lt.loop.settings.layout,
            now=lt.clock.now(),
            reason="test",
        ),
    )
    _, token = lt.store.create_token(
        name="s", owner=f"step:{job_id}", role="step", now=lt.clock.now(), attempt_id=launch.attempt_id
    )
    return launch.attempt_id, token


class GatewayLoad:
    """Requests through a gateway, one after another, on a thread, until `stop()`: counts those
    answered 200 (`ok`) and describes every other (`failed`)."""

    def __init__(self, url: str, body: dict[str, Any] | None = None, pause_s: float = 0.01) -> None:
        self.url = url
        self.body = body if body is not None else {}
        self.pause_s = pause_s
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                try:
                    r = client.post(self.url, json=self.body)
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failed.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failed.append(repr(exc))
                self._stop.wait(self.pause_s)

    def more(self, n: int, what: str) -> None:
        """Wait until `n` more requests have been answered 200."""
        then = self.ok
        wait_until(lambda: self.ok >= then + n, timeout=30, what=what)

    def stop(self) -> GatewayLoad:
        self._stop.set()
        self._thread.join(timeout=60)
        return self


def ensure_step_user() -> str:
    """The operator's step user (created when missing, as `make test` and CI do); the Python
    that runs lowtide and the repository must be reachable by other uids, or steps cannot run.
    Call only as root."""
    import pwd  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from conftest import require_service  # noqa: PLC0415
    from lowtide.wiring import _unreachable  # noqa: PLC0415

    try:
        pwd.getpwnam(STEP_USER)
    except KeyError:
        shell = "/usr/sbin/nologin" if Path("/usr/sbin/nologin").exists() else "/bin/false"
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", shell, STEP_USER], check=True)
    python = Path(sys.executable).resolve().parent
    for where in (python, Path(sys.prefix), Path(__file__).resolve().parents[1]):
        blocked = _unreachable(where)
        if blocked is not None:
            require_service(
                "a Python the step user can run",
                f"{blocked} is not traversable by other users (.ci/run makes it so: chmod o+x)",
            )
    return STEP_USER


def running(store: Any, launch: Any) -> Any:
    """A booked attempt that began to run at its launch, as the loop records it once the executor
    says so (`Store.record_launch`); store-level tests that play the loop call this."""
    store.mark_running(launch.attempt_id, store.attempt(launch.attempt_id).started_at)
    return launch
