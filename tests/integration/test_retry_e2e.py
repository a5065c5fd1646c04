"""`lowtide retry` end to end: `lowtide up` as a real server process, the CLI as real commands,
real step processes. A job's second step fails (no retries left), the job FAILS and its third
step is SKIPPED; the cause is fixed; `retry` runs the failed and the skipped step again, never the
first one (its one attempt and its output are kept), and the job SUCCEEDS."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_e2e_cli import REPO, Server, free_port, shims_of

from support import wait_until


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    config = tmp_path / "lowtide.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": "state",
                "templates_dir": str(REPO / "examples" / "templates"),
                "tick_seconds": 0.2,
                "nodes": [{"name": "node-a", "gpus": 2}],
                "api": {"port": free_port()},
                "executor": {"checkpoint_poll": 0.2},
            }
        )
    )
    srv = Server(tmp_path, config, yaml.safe_load(config.read_text())["api"]["port"])
    srv.start()
    yield srv
    srv.stop()
    for p in shims_of(tmp_path):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


def _spec(tmp_path: Path) -> dict[str, Any]:
    ran, fixed = tmp_path / "prep-ran.log", tmp_path / "fixed"
    return {
        "name": "pipeline",
        "team": "nlp",
        "max_retries": 0,
        "steps": [
            # Writes its output once per run, and says so in a log of its own.
            {
                "name": "prep",
                "command": [
                    "sh",
                    "-c",
                    f'echo "$LOWTIDE_JOB_ID" >> {ran}; echo data > "$0/data"',
                    "{{outputs}}",
                ],
            },
            # Fails until the cause is fixed; reads prep's output.
            {
                "name": "train",
                "depends": ["prep"],
                "command": ["sh", "-c", f'test -e {fixed} || exit 3; cat "$0/data"', "{{inputs.prep}}"],
                "gpus": 1,
            },
            {"name": "eval", "depends": ["train"], "command": ["true"]},
        ],
    }


def _states(detail: dict[str, Any]) -> dict[str, str]:
    return {s["name"]: s["state"] for s in detail["steps"]}


def _attempts(detail: dict[str, Any]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for a in detail["attempts"]:
        out.setdefault(a["step"], []).append(a["number"])
    return out


def test_retry_runs_the_failed_and_skipped_steps_and_keeps_the_first(server: Server, tmp_path: Path) -> None:
    spec = tmp_path / "pipeline.yaml"
    spec.write_text(yaml.safe_dump(_spec(tmp_path)))
    jobs = []
    for _ in range(2):
        r = server.cli("submit", str(spec), "--wait")
        assert r.returncode == 1 and "FAILED" in r.stdout, r.stderr
        jobs.append(server.json("jobs")["jobs"][0]["id"])
    for job in jobs:
        failed = server.api(f"/v1/jobs/{job}")
        assert failed["job"]["state"] == "FAILED"
        assert _states(failed) == {"prep": "SUCCEEDED", "train": "FAILED", "eval": "SKIPPED"}
    output = {job: server.api(f"/v1/jobs/{job}")["steps"][0] for job in jobs}
    assert (tmp_path / "prep-ran.log").read_text().split() == jobs

    # Bad ids: exit 2, nothing asked of the API for a malformed one.
    r = server.cli("retry", "not-a-job")
    assert r.returncode == 2 and "not a job id: not-a-job" in r.stderr
    r = server.cli("retry", "job-00000000ffff")
    assert r.returncode == 2 and "job-00000000ffff" in r.stderr and "not found" in r.stderr

    (tmp_path / "fixed").touch()  # the cause is fixed
    r = server.cli("retry", jobs[0], "-o", "json")
    assert r.returncode == 0, r.stderr
    retried = json.loads(r.stdout)
    assert (retried["job"]["id"], retried["job"]["state"]) == (jobs[0], "RUNNING")
    assert (retried["queued"], retried["waiting"], retried["kept"]) == (["train"], ["eval"], ["prep"])
    r = server.cli("retry", jobs[1], "--wait")
    assert r.returncode == 0, r.stderr
    assert f"{jobs[1]}: retried, now RUNNING" in r.stdout
    assert "back to the queue: train" in r.stdout and "waiting for upstream steps: eval" in r.stdout
    assert "kept (succeeded, not run again): prep" in r.stdout
    assert f"job {jobs[1]}: SUCCEEDED" in r.stdout

    wait_until(
        lambda: server.api(f"/v1/jobs/{jobs[0]}")["job"]["state"] == "SUCCEEDED",
        timeout=60,
        what="the retried job to succeed",
    )
    for job in jobs:
        done = server.api(f"/v1/jobs/{job}")
        assert _states(done) == {"prep": "SUCCEEDED", "train": "SUCCEEDED", "eval": "SUCCEEDED"}
        # prep ran once (one attempt, its log line and its step record untouched); train twice.
        assert _attempts(done) == {"prep": [1], "train": [1, 2], "eval": [1]}
        assert done["steps"][0] == output[job]
        log = server.cli("logs", job, "train", check=True).stdout
        assert "attempt 2" in log and "\ndata\n" in log  # the retry read prep's kept output
    assert (tmp_path / "prep-ran.log").read_text().split() == jobs

    # A job that SUCCEEDED has nothing to retry: refused, exit 2, with the reason.
    r = server.cli("retry", jobs[0])
    assert r.returncode == 2 and f"job {jobs[0]} is SUCCEEDED: nothing failed" in r.stderr
