"""One active control plane (docs/architecture.md §4.4): two real `lowtide up` on one PostgreSQL
database, with their own state dirs and the same work root and artifacts (a hot standby on the
same host).

Only the leader acts: the standby serves its API (a submit through it runs), answers /healthz
200 as "standby", and never launches, adopts or kills anything. `kill -9` of the leader: the
standby takes over once the lease expires (a 2 s ttl here), re-adopts the running step (the
same attempt and pid: the step, which appends a line to a file each time it starts, started
once) and the job finishes. A leader paused past its lease (SIGSTOP) is taken over the same way
and, resumed, stands by without touching the step. A graceful stop releases the lease and the
other takes over at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from conftest import _fresh_pg
from support import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

TTL = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Up:
    """One `lowtide up` process with its own state dir, on the shared database and work root."""

    def __init__(self, root: Path, name: str, db_url: str) -> None:
        self.root = root
        self.name = name
        self.port = free_port()
        self.config = root / f"{name}.yaml"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "state_dir": str(root / f"state-{name}"),
                    "store_url": db_url,
                    "artifact_root": str(root / "artifacts"),
                    "executor": {"work_root": str(root / "work"), "checkpoint_poll": 0.2},
                    "tick_seconds": 0.2,
                    "nodes": [{"name": "node-a", "gpus": 2}],
                    "api": {"port": self.port},
                    "auth": {"enabled": False},
                    "control": {"lease_ttl": TTL, "lease_renew": 0.5},
                }
            )
        )
        self.log_path = root / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lowtide", "--config", str(self.config), "up"],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
            )
        wait_until(self.health, timeout=60, what=f"lowtide up {self.name} to answer /healthz")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict[str, Any] | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"lowtide up {self.name} exited:\n{self.log()}")
        try:
            r = self.http.get("/healthz")
        except httpx.HTTPError:
            return None
        assert r.status_code == 200, r.text  # a standby is healthy too
        return dict(r.json())

    def role(self) -> str | None:
        body = self.health()
        return body["control"]["role"] if body else None

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.http.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.http.close()


@pytest.fixture
def db_url(pg_database_url: str) -> str:
    _fresh_pg(pg_database_url)
    return pg_database_url


@pytest.fixture
def planes(tmp_path: Path, db_url: str) -> Iterator[tuple[Up, Up]]:
    a, b = Up(tmp_path, "a", db_url), Up(tmp_path, "b", db_url)
    yield a, b
    for up in (a, b):
        up.stop()
    for p in psutil.process_iter(["cmdline"]):  # the step, if the test failed before it ended
        cmd = p.info["cmdline"] or []
        if "lowtide.adapters.step_shim" in cmd and any(str(tmp_path) in part for part in cmd):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


def step_spec(starts: Path, release: Path) -> str:
    code = textwrap.dedent(
        f"""
        import os, time
        with open({str(starts)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        while not os.path.exists({str(release)!r}):
            time.sleep(0.05)
        """
    )
    return yaml.safe_dump(
        {
            "name": "once",
            "team": "nlp",
            "steps": [{"name": "run", "command": ["python", "-c", code], "gpus": 1}],
        }
    )


def test_only_the_leader_acts_and_the_standby_takes_over_a_killed_leader_without_rerunning_its_step(
    planes: tuple[Up, Up], tmp_path: Path
) -> None:
    a, b = planes
    a.start()
    b.start()
    assert a.role() == "leader" and b.role() == "standby"
    standby = b.health()
    assert standby is not None and standby["control"]["holder"] == a.health()["control"]["me"]  # type: ignore[index]
    assert "lowtide_leader 0.0" in b.http.get("/metrics").text
    assert "lowtide_leader 1.0" in a.http.get("/metrics").text

    starts, release = tmp_path / "starts.txt", tmp_path / "release"
    r = b.http.post(
        "/v1/jobs", content=step_spec(starts, release), headers={"Content-Type": "application/yaml"}
    )
    assert r.status_code == 201, r.text  # the standby's API takes submits; the leader runs them
    job = r.json()["id"]

    def running() -> dict[str, Any] | None:
        atts = [x for x in a.job(job)["attempts"] if x["state"] == "RUNNING" and x["handle"]]
        return atts[0] if atts and starts.exists() else None

    attempt = wait_until(running, timeout=60, what="the leader to launch the step")
    assert psutil.pid_exists(int(attempt["handle"]))
    assert "recovered:" not in b.log()  # the standby never recovered (adopted, reaped) anything

    a.kill9()
    wait_until(lambda: b.role() == "leader", timeout=TTL * 10, what="the standby to take over")
    assert "took over the expired lease" in b.log()
    wait_until(lambda: "recovered: 1 adopted" in b.log(), timeout=30, what="the standby to adopt the step")
    release.touch()
    final = wait_until(
        lambda: (d := b.job(job))["job"]["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") and d,
        timeout=60,
        what="the job to finish under the new leader",
    )
    assert final["job"]["state"] == "SUCCEEDED"
    assert [x["id"] for x in final["attempts"]] == [attempt["id"]]  # adopted, not run again
    assert len(starts.read_text().split()) == 1  # the step started exactly once

    # The old leader comes back as a standby. The leader is paused past its lease with a step
    # running: the standby takes over and adopts the step; the paused one, resumed, finds itself
    # fenced out and stands by without touching the step (its watch is dropped, nothing killed).
    a.start()
    assert a.role() == "standby" and b.role() == "leader"
    starts2, release2 = tmp_path / "starts2.txt", tmp_path / "release2"
    r = a.http.post(
        "/v1/jobs", content=step_spec(starts2, release2), headers={"Content-Type": "application/yaml"}
    )
    assert r.status_code == 201, r.text
    job2 = r.json()["id"]

    def running2() -> dict[str, Any] | None:
        atts = [x for x in a.job(job2)["attempts"] if x["state"] == "RUNNING" and x["handle"]]
        return atts[0] if atts and starts2.exists() else None

    attempt2 = wait_until(running2, timeout=60, what="the leader b to launch the second step")
    assert b.proc is not None
    b.proc.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: a.role() == "leader", timeout=TTL * 10, what="a takeover from the paused leader")
        wait_until(lambda: a.log().count("recovered: 1 adopted") == 1, timeout=30, what="a to adopt the step")
    finally:
        b.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: b.role() == "standby", timeout=TTL * 10, what="the resumed leader to stand by")
    assert "stepping down" in b.log() and "stopped acting" in b.log()
    assert psutil.pid_exists(int(attempt2["handle"]))  # the old leader killed nothing
    release2.touch()
    done = wait_until(
        lambda: (d := a.job(job2))["job"]["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") and d,
        timeout=60,
        what="the second job to finish under a",
    )
    assert done["job"]["state"] == "SUCCEEDED" and [x["id"] for x in done["attempts"]] == [attempt2["id"]]
    assert len(starts2.read_text().split()) == 1

    # A graceful stop of the leader releases the lease: the standby takes over at once.
    a.stop()
    wait_until(lambda: b.role() == "leader", timeout=TTL * 10, what="a takeover after the lease was released")
    assert "released the control lease" in a.log()
