"""Store outages and infrastructure failures with real step processes, a real SQLite store held
locked by another connection, and the real API (docs/architecture.md §4.4).

Steps that finish while the store cannot be written keep their exits (the executor re-reports
them, the loop keeps ticking and backs off); when the lock is released, one tick records every
exit and frees every GPU. `/healthz` turns 503 after `api.store_unhealthy_after` and back to 200;
submits answer 503 with `Retry-After`. A launch that fails because lowtide's artifact storage is
broken uses no retry, waits with a backoff and raises an alert until a launch works.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from lowtide.control.loop import STORE_RETRY_MAX_S
from lowtide.domain.states import AttemptState
from lowtide.wiring import Embedded
from support import embedded, kill_steps_and_close, tick_until
from support import submit_job as submit


@pytest.fixture
def lt(tmp_path: Path) -> Iterator[Embedded]:
    system = embedded(
        tmp_path,
        auth={"enabled": False},
        store_busy_timeout=0.05,
        api={"store_unhealthy_after": 0.3},
    )
    system.loop.recover()
    yield system
    kill_steps_and_close(system)


def wait_for(go: Path) -> list[str]:
    """A step that runs until `go` exists, then exits 0."""
    code = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.02)\n"
    return [sys.executable, "-c", code]


def lock(lt: Embedded) -> sqlite3.Connection:
    """Another connection takes SQLite's write lock and keeps it (WAL: readers go on)."""
    other = sqlite3.connect(lt.settings.database_url.split("///", 1)[1], isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    return other


def test_exits_during_a_store_outage_are_recorded_and_gpus_freed_when_it_ends(
    lt: Embedded, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    jobs = [
        submit(lt, {"name": f"j{i}", "steps": [{"name": "s", "command": wait_for(go), "gpus": 1}]})
        for i in range(3)
    ]
    tick_until(
        lt, lambda: len([a for a in lt.store.active_attempts() if a.handle]) == 3, what="3 steps running"
    )
    attempts = {a.id for a in lt.store.active_attempts()}
    api = TestClient(lt.app)

    other = lock(lt)
    try:
        go.touch()  # every step exits now, while the store cannot record it
        ticks = lt.loop.ticks
        tick_until(lt, lambda: lt.executor.pending_exits() == attempts, what="the exits to be seen")
        for _ in range(3):  # the loop keeps ticking, and keeps every exit
            report = lt.loop.tick()
            assert report.store_unavailable and report.exits == 0
        assert lt.loop.ticks >= ticks + 4
        assert lt.executor.pending_exits() == attempts
        retry = lt.loop.store_retry_s()
        assert retry is not None and 0 < retry <= STORE_RETRY_MAX_S
        # Still RUNNING in the store, GPUs booked: reads work, the exits wait.
        assert {a.id for a in lt.store.active_attempts()} == attempts

        health = tick_until(
            lt, lambda: (r := api.get("/healthz")).status_code == 503 and r, what="/healthz 503"
        )
        body = health.json()
        assert body["status"] == "unhealthy" and "database is locked" in body["reason"]
        assert body["store"]["ok"] is False and body["store"]["failing"] == "write"
        assert health.headers["Retry-After"]
        refused = api.post(
            "/v1/jobs",
            content=yaml.safe_dump({"name": "late", "steps": [{"name": "s", "command": ["true"]}]}),
            headers={"Content-Type": "application/yaml"},
        )
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"] == "store_unavailable" and int(refused.headers["Retry-After"]) > 0
        assert "lowtide_store_up 0.0" in api.get("/metrics").text  # reads still work (WAL)
    finally:
        other.execute("ROLLBACK")
        other.close()

    report = lt.loop.tick()  # one tick records every exit
    assert report.exits == 3 and not report.store_unavailable
    assert lt.executor.pending_exits() == set()
    assert lt.store.active_attempts() == []
    assert lt.store.counts()["gpus"].get("attempt", 0) == 0  # every GPU free
    for job_id in jobs:
        (att,) = lt.store.job_detail(job_id).attempts
        assert att.state == AttemptState.SUCCEEDED and att.exit_code == 0
    assert lt.loop.store_retry_s() is None
    assert api.get("/healthz").status_code == 200
    assert api.get("/healthz").json()["store"] == {"ok": True}
    assert "lowtide_store_up 1.0" in api.get("/metrics").text


def test_an_unwritable_artifact_root_is_an_infrastructure_failure_not_the_steps(
    lt: Embedded, tmp_path: Path
) -> None:
    jobs_dir = Path(lt.settings.artifacts) / "jobs"
    jobs_dir.mkdir(parents=True, exist_ok=True)
    jobs_dir.rmdir()
    jobs_dir.write_text("not a directory")  # root is not stopped by chmod; a file in the way is
    job_id = submit(lt, {"name": "j", "max_retries": 0, "steps": [{"name": "s", "command": ["true"]}]})
    tick_until(lt, lambda: len(lt.store.job_detail(job_id).attempts) >= 2, what="two launch tries")

    detail = lt.store.job_detail(job_id)
    assert detail.job.state.value not in ("FAILED", "SUCCEEDED")
    step = detail.steps[0]
    assert step.retries_used == 0 and step.state.value in ("READY", "RUNNING")
    assert all("storage" in a.message and "not the step's failure" in a.message for a in detail.attempts)
    assert "storage" in lt.loop.infrastructure_alerts
    api = TestClient(lt.app)
    assert [a["kind"] for a in api.get("/healthz").json()["alerts"]] == ["storage"]
    metrics = api.get("/metrics").text
    assert 'lowtide_infrastructure_alert{kind="storage"} 1.0' in metrics
    assert 'lowtide_infrastructure_failures_total{kind="storage"}' in metrics

    jobs_dir.unlink()
    assert tick_until(lt, lambda: lt.store.job(job_id).state.value == "SUCCEEDED", what="the job to succeed")
    assert lt.loop.infrastructure_alerts == {}
    assert 'lowtide_infrastructure_alert{kind="storage"}' not in api.get("/metrics").text
