"""Limits that hold, with real step processes, a real SQLite store and the real API (in process):
a hung step over its `timeout` ends FAILED with the reason after notice and grace, its GPUs free;
a CPU-only fan-out never runs more steps at once than the node limit, and all of them finish; a
job with more steps than `scheduler.max_steps_per_job` is refused with a located 422."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from fastapi.testclient import TestClient

from lowtide.wiring import Embedded
from support import embedded, kill_steps_and_close, tick_until
from support import job_detail as detail
from support import submit_job as submit

PY = sys.executable


def job_state(lt: Embedded, job_id: str) -> str:
    return str(detail(lt, job_id)["job"]["state"])


def start(system: Embedded) -> Iterator[Embedded]:
    system.loop.recover()
    yield system
    kill_steps_and_close(system)


@pytest.fixture
def lt(tmp_path: Path) -> Iterator[Embedded]:
    # One node: the limit is per declared node (in the embedded mode all of them are this host).
    yield from start(
        embedded(
            tmp_path,
            auth={"enabled": False},
            nodes=[{"name": "node-a", "gpus": 4}],
            scheduler={"max_cpu_steps_per_node": 3},
        )
    )


HANGS = [
    PY,
    "-c",
    textwrap.dedent(
        """
        import os, pathlib, signal, sys, time
        ckpt = pathlib.Path(os.environ["LOWTIDE_CHECKPOINT_DIR"])
        def stop(*_):
            (ckpt / "LATEST").write_text("step-7")
            sys.exit(143)
        signal.signal(signal.SIGTERM, stop)
        print("hanging", flush=True)
        while True:
            time.sleep(1)
        """
    ),
]


def test_a_hung_step_over_its_timeout_fails_with_the_reason_and_frees_its_gpus(lt: Embedded) -> None:
    job = submit(
        lt,
        {
            "name": "hangs",
            "grace_seconds": 5,
            "max_retries": 3,
            "steps": [
                {"name": "train", "command": HANGS, "gpus": 2, "checkpoint": True, "timeout": "2s"},
                {"name": "eval", "command": ["true"], "depends": ["train"]},
            ],
        },
    )
    tick_until(lt, lambda: job_state(lt, job) in ("SUCCEEDED", "FAILED", "CANCELLED"), what="the timeout")
    d = detail(lt, job)
    assert d["job"]["state"] == "FAILED"
    steps = {s["name"]: s for s in d["steps"]}
    assert steps["train"]["state"] == "FAILED"
    assert steps["train"]["reason"] == "timed out after 2s (walltime limit); exit code 143"
    assert steps["eval"]["state"] == "SKIPPED"
    (attempt,) = d["attempts"]  # no retry, although max_retries is 3
    assert attempt["exit_code"] == 143
    # It ran its 2 s (the deadline) and stopped within its grace: notice, then exit.
    assert attempt["ended_at"] - attempt["started_at"] >= 2.0
    att = lt.store.attempt(attempt["id"])
    assert att.stop_reason == "timeout: walltime limit of 2s reached; notice given, deadline in 5s"
    assert not att.killed_at_deadline
    assert att.handle is not None and not psutil.pid_exists(int(att.handle))  # locally, the pid
    assert any(e["kind"] == "notice" and e["message"] == att.stop_reason for e in d["events"])
    assert steps["train"]["last_checkpoint"] == "step-7"  # it checkpointed on notice
    assert all(h.holder_kind == "idle" for h in lt.store.holdings())


COUNTS = textwrap.dedent(
    """
    d="$1"
    touch "$d/$LOWTIDE_STEP"
    sleep 0.05
    ls "$d" | wc -l >> "$d.counts"
    rm "$d/$LOWTIDE_STEP"
    """
)


def test_a_cpu_fan_out_never_runs_more_than_the_node_limit(lt: Embedded, tmp_path: Path) -> None:
    running_dir = tmp_path / "running"
    running_dir.mkdir()
    running_dir.chmod(0o777)  # steps may run as another user (executor.run_as)
    steps = 200
    job = submit(
        lt,
        {
            "name": "fan-out",
            "steps": [
                {"name": f"s{i:03d}", "command": ["sh", "-c", COUNTS, "sh", str(running_dir)], "gpus": 0}
                for i in range(steps)
            ],
        },
    )
    most = 0

    def finished() -> bool:
        nonlocal most
        active = lt.store.active_attempts()
        most = max(most, len(active))
        assert len(active) <= 3, [a.step_name for a in active]
        return lt.store.job(job).state.value in ("SUCCEEDED", "FAILED")

    tick_until(lt, finished, timeout=240, what="200 CPU-only steps")
    d = detail(lt, job)
    assert d["job"]["state"] == "SUCCEEDED"
    assert len(d["attempts"]) == steps
    assert most == 3
    # What the steps themselves saw: never more than 3 of them at once.
    counts = [int(n) for n in (tmp_path / "running.counts").read_text().split()]
    assert len(counts) == steps
    assert max(counts) <= 3
    assert all(h.holder_kind == "idle" for h in lt.store.holdings())


def test_a_waiting_cpu_step_shows_the_node_limit_as_its_reason(lt: Embedded) -> None:
    job = submit(
        lt,
        {
            "name": "sleepy",
            "steps": [{"name": f"s{i}", "command": ["sleep", "30"], "gpus": 0} for i in range(5)],
        },
    )
    tick_until(
        lt, lambda: sum(s["state"] == "RUNNING" for s in detail(lt, job)["steps"]) == 3, what="3 running"
    )
    lt.loop.tick()
    waiting = [s for s in detail(lt, job)["steps"] if s["state"] == "READY"]
    assert [s["reason"] for s in waiting] == ["node limit of 3 CPU-only steps reached"] * 2
    TestClient(lt.app).post(f"/v1/jobs/{job}/cancel")
    tick_until(lt, lambda: job_state(lt, job) == "CANCELLED", what="the cancel")


def test_a_job_over_the_step_limit_is_refused_and_a_higher_limit_lets_10000_steps_in(tmp_path: Path) -> None:
    many = {
        "name": "fan",
        "steps": [{"name": f"s{i:05d}", "command": ["true"], "gpus": 0} for i in range(10_000)],
    }
    body = json.dumps(many)
    (tmp_path / "default").mkdir()
    (tmp_path / "high").mkdir()
    for system in start(embedded(tmp_path / "default", auth={"enabled": False})):
        client = TestClient(system.app)
        for route in ("/v1/jobs", "/v1/jobs/validate"):
            r = client.post(route, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 422, r.text
            problem = r.json()
            assert [(d["loc"], d["msg"]) for d in problem["errors"]] == [
                ("steps", "10000 steps; the limit is 1000 (scheduler.max_steps_per_job)")
            ], problem
    for system in start(
        embedded(tmp_path / "high", auth={"enabled": False}, scheduler={"max_steps_per_job": 10_000})
    ):
        r = TestClient(system.app).post(
            "/v1/jobs", content=body, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 201, r.text[:500]
        assert len(detail(system, r.json()["id"])["steps"]) == 10_000
