"""The control loop with real step processes, a real SQLite store and the real API: stories."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from fastapi.testclient import TestClient

from lowtide.wiring import Embedded
from support import embedded, kill_steps_and_close, tick_until, wait_until

PY = sys.executable


def submit(lt: Embedded, doc: dict[str, Any], **params: Any) -> str:
    client = TestClient(lt.app)
    query = [("param", f"{k}={v}") for k, v in params.items()]
    r = client.post(
        "/v1/jobs", content=yaml.safe_dump(doc), headers={"Content-Type": "application/yaml"}, params=query
    )
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def detail(lt: Embedded, job_id: str) -> dict[str, Any]:
    r = TestClient(lt.app).get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200
    return dict(r.json())


def job_state(lt: Embedded, job_id: str) -> str:
    return str(detail(lt, job_id)["job"]["state"])


def steps(lt: Embedded, job_id: str) -> dict[str, str]:
    return {s["name"]: s["state"] for s in detail(lt, job_id)["steps"]}


def step_said(lt: Embedded, job_id: str, step: str, line: str) -> bool:
    """True once the step printed `line` on a line of its own (the log header quotes the command)."""
    r = TestClient(lt.app).get(f"/v1/jobs/{job_id}/steps/{step}/logs")
    return r.status_code == 200 and line in r.text.splitlines()


def py(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


ENV_DUMP = py(
    """
    import json, os, pathlib
    out = pathlib.Path(os.environ["LOWTIDE_OUTPUTS"])
    out.mkdir(parents=True, exist_ok=True)
    keys = ["CUDA_VISIBLE_DEVICES", "LOWTIDE_JOB_ID", "LOWTIDE_STEP", "LOWTIDE_ATTEMPT", "LOWTIDE_PARAMS",
            "LOWTIDE_PARAM_LR", "LOWTIDE_INPUTS", "LOWTIDE_OUTPUTS", "LOWTIDE_NOTICE_FILE",
            "LOWTIDE_CHECKPOINT_DIR"]
    (out / "env.json").write_text(json.dumps({k: os.environ.get(k) for k in keys}))
    print("hello from", os.environ["LOWTIDE_STEP"])
    """
)


@pytest.fixture
def lt(tmp_path: Path) -> Embedded:
    system = embedded(tmp_path, auth={"enabled": False})
    system.loop.recover()
    yield system
    kill_steps_and_close(system)


def test_a_three_step_dag_runs_in_order_on_the_gpus_it_was_given(lt: Embedded) -> None:
    job = submit(
        lt,
        {
            "name": "dag",
            "params": {"lr": 0.001},
            "steps": [
                {"name": "prep", "command": ENV_DUMP, "gpus": 0},
                {"name": "train", "command": ENV_DUMP, "gpus": 4, "depends": ["prep"], "checkpoint": True},
                {"name": "eval", "command": ENV_DUMP, "gpus": 1, "depends": ["train"]},
            ],
        },
    )
    tick_until(lt, lambda: job_state(lt, job) in ("SUCCEEDED", "FAILED"), what="the job to finish")
    d = detail(lt, job)
    assert d["job"]["state"] == "SUCCEEDED", d
    envs = {s["name"]: json.loads((Path(s["outputs"]) / "env.json").read_text()) for s in d["steps"]}
    assert envs["prep"]["CUDA_VISIBLE_DEVICES"] == ""
    assert envs["train"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # best fit: only node-a has 4
    assert envs["eval"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert envs["train"]["LOWTIDE_PARAM_LR"] == "0.001"
    assert json.loads(envs["train"]["LOWTIDE_PARAMS"]) == {"lr": 0.001}
    assert json.loads(envs["eval"]["LOWTIDE_INPUTS"]) == {"train": d["steps"][1]["outputs"]}
    assert envs["train"]["LOWTIDE_CHECKPOINT_DIR"] == d["steps"][1]["checkpoint_dir"]
    assert envs["eval"]["LOWTIDE_CHECKPOINT_DIR"] is None
    attempts = {a["step"]: a for a in d["attempts"]}
    assert attempts["train"]["node"] == "node-a" and attempts["train"]["gpus"] == [0, 1, 2, 3]
    # Steps ran one after the other.
    assert attempts["prep"]["ended_at"] <= attempts["train"]["started_at"]
    assert attempts["train"]["ended_at"] <= attempts["eval"]["started_at"]
    # Their output is in the log, and every GPU is free again.
    log = TestClient(lt.app).get(f"/v1/jobs/{job}/steps/eval/logs").text
    assert "hello from eval" in log
    assert all(h.holder_kind == "idle" for h in lt.store.holdings())


def test_a_failing_step_is_retried_with_backoff_then_succeeds(lt: Embedded) -> None:
    code = py("""
        import os, sys
        sys.exit(0 if os.environ["LOWTIDE_ATTEMPT"] == "3" else 7)
    """)
    job = submit(lt, {"name": "flaky", "max_retries": 2, "steps": [{"name": "x", "command": code}]})
    tick_until(lt, lambda: job_state(lt, job) in ("SUCCEEDED", "FAILED"), what="retries")
    d = detail(lt, job)
    assert d["job"]["state"] == "SUCCEEDED"
    assert [(a["number"], a["state"], a["exit_code"]) for a in d["attempts"]] == [
        (1, "FAILED", 7),
        (2, "FAILED", 7),
        (3, "SUCCEEDED", 0),
    ]
    a = d["attempts"]
    # backoff 0.2 s then 0.4 s (base × 2^(n-1))
    assert a[1]["started_at"] - a[0]["ended_at"] >= 0.2
    assert a[2]["started_at"] - a[1]["ended_at"] >= 0.4
    assert d["steps"][0]["retries_used"] == 2


def test_a_failed_step_skips_its_downstream_and_fails_the_job(lt: Embedded) -> None:
    job = submit(
        lt,
        {
            "name": "broken",
            "steps": [
                {"name": "a", "command": py("import sys; sys.exit(3)")},
                {"name": "b", "command": ["true"], "depends": ["a"]},
            ],
        },
    )
    tick_until(lt, lambda: job_state(lt, job) == "FAILED", what="failure")
    assert steps(lt, job) == {"a": "FAILED", "b": "SKIPPED"}
    assert "exit code 3" in detail(lt, job)["job"]["message"] or "failed" in detail(lt, job)["job"]["message"]


def test_a_missing_command_fails_the_step_with_a_clear_message(lt: Embedded) -> None:
    job = submit(lt, {"name": "typo", "steps": [{"name": "a", "command": ["no-such-program-xyz"]}]})
    tick_until(lt, lambda: job_state(lt, job) == "FAILED", what="failure")
    att = detail(lt, job)["attempts"][0]
    assert att["state"] == "FAILED"
    assert att["exit_code"] == 127 or "not found" in att["message"].lower()


def test_cancel_gives_notice_and_the_step_checkpoints_and_exits(lt: Embedded, tmp_path: Path) -> None:
    marker = tmp_path / "got-notice"
    code = py(f"""
        import json, os, signal, sys, time, pathlib
        def stop(*_):
            notice = json.loads(pathlib.Path(os.environ["LOWTIDE_NOTICE_FILE"]).read_text())
            pathlib.Path({str(marker)!r}).write_text(str(notice["deadline"]))
            sys.exit(143)
        signal.signal(signal.SIGTERM, stop)
        print("ready", flush=True)
        while True:
            time.sleep(0.05)
    """)
    job = submit(
        lt, {"name": "long", "grace_seconds": 20, "steps": [{"name": "a", "command": code, "gpus": 2}]}
    )
    tick_until(lt, lambda: step_said(lt, job, "a", "ready"), what="the step to run")
    r = TestClient(lt.app).post(f"/v1/jobs/{job}/cancel")
    # Its step still holds GPUs: the job shows CANCELLING, not CANCELLED (issue 12).
    assert r.status_code == 200 and r.json()["state"] == "CANCELLING"
    assert job_state(lt, job) == "CANCELLING" and steps(lt, job)["a"] == "CANCELLING"
    tick_until(lt, lambda: job_state(lt, job) == "CANCELLED", what="the job to be cancelled")
    assert steps(lt, job)["a"] == "CANCELLED"
    att = detail(lt, job)["attempts"][0]
    assert marker.exists(), "the step never saw the notice"
    assert float(marker.read_text()) == pytest.approx(att["stop_deadline"])
    assert att["state"] == "INTERRUPTED" and att["exit_code"] == 143 and not att["killed_at_deadline"]
    assert att["notice_at"] is not None
    assert all(h.holder_kind == "idle" for h in lt.store.holdings())


def test_a_step_that_ignores_notice_is_killed_at_the_deadline(lt: Embedded) -> None:
    code = py("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        while True:
            time.sleep(0.05)
    """)
    job = submit(lt, {"name": "stubborn", "grace_seconds": 0.5, "steps": [{"name": "a", "command": code}]})
    tick_until(lt, lambda: step_said(lt, job, "a", "ready"), what="the step to run")
    TestClient(lt.app).post(f"/v1/jobs/{job}/cancel")
    tick_until(lt, lambda: steps(lt, job)["a"] == "CANCELLED", what="the kill")
    att = detail(lt, job)["attempts"][0]
    assert att["killed_at_deadline"] is True
    assert att["ended_at"] >= att["stop_deadline"]
    pid = int(att["handle"])  # the local executor's handle is the shim's pid
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_checkpoints_written_to_latest_are_recorded_and_handed_to_the_next_attempt(lt: Embedded) -> None:
    code = py("""
        import os, pathlib, sys
        ckpt = pathlib.Path(os.environ["LOWTIDE_CHECKPOINT_DIR"])
        attempt = int(os.environ["LOWTIDE_ATTEMPT"])
        print("resume from", os.environ.get("LOWTIDE_RESUME_FROM"))
        if attempt == 1:
            (ckpt / "step-5").write_text("5")
            (ckpt / "LATEST").write_text("step-5\\n")
            sys.exit(1)
        resume = os.environ.get("LOWTIDE_RESUME_FROM")
        assert resume == str(ckpt / "step-5"), resume
    """)
    job = submit(
        lt, {"name": "ckpt", "max_retries": 1, "steps": [{"name": "t", "command": code, "checkpoint": True}]}
    )
    tick_until(lt, lambda: job_state(lt, job) in ("SUCCEEDED", "FAILED"), what="the job")
    d = detail(lt, job)
    assert d["job"]["state"] == "SUCCEEDED", TestClient(lt.app).get(f"/v1/jobs/{job}/steps/t/logs").text
    assert [c["label"] for c in d["checkpoints"]] == ["step-5"]
    assert d["steps"][0]["last_checkpoint"] == "step-5"
    assert d["attempts"][1]["record"]["resume_from"] == "step-5"


def test_a_corrupt_latest_is_ignored_and_reported(lt: Embedded) -> None:
    code = py("""
        import os, pathlib
        (pathlib.Path(os.environ["LOWTIDE_CHECKPOINT_DIR"]) / "LATEST").write_bytes(b"\\xff\\xfe garbage")
    """)
    job = submit(lt, {"name": "corrupt", "steps": [{"name": "t", "command": code, "checkpoint": True}]})
    tick_until(lt, lambda: job_state(lt, job) == "SUCCEEDED", what="the job")
    d = detail(lt, job)
    assert d["checkpoints"] == []
    assert any(e["kind"] == "checkpoint_invalid" and "UTF-8" in e["message"] for e in d["events"])


def test_restart_of_the_control_plane_readopts_a_running_step(tmp_path: Path) -> None:
    first = embedded(tmp_path, auth={"enabled": False})
    first.loop.recover()
    job = submit(
        first,
        {
            "name": "survivor",
            "steps": [
                {
                    "name": "a",
                    "command": py("""
        import time, sys
        time.sleep(1.5)
        sys.exit(0)
    """),
                }
            ],
        },
    )
    tick_until(first, lambda: steps(first, job)["a"] == "RUNNING", what="start")
    pid = int(first.store.active_attempts()[0].handle or 0)
    # The control plane goes away without stopping anything (as after kill -9).
    first.close()
    second = embedded(tmp_path, auth={"enabled": False})
    report = second.loop.recover()
    assert len(report.adopted) == 1 and report.lost == () and report.orphans_killed == ()
    assert psutil.pid_exists(pid)
    tick_until(second, lambda: job_state(second, job) == "SUCCEEDED", what="the adopted step to finish")
    att = detail(second, job)["attempts"][0]
    assert (att["state"], att["exit_code"]) == ("SUCCEEDED", 0)
    second.close()


def test_a_step_that_vanished_while_the_control_plane_was_down_is_requeued(tmp_path: Path) -> None:
    first = embedded(tmp_path, auth={"enabled": False})
    first.loop.recover()
    job = submit(
        first,
        {
            "name": "victim",
            "steps": [
                {
                    "name": "a",
                    "command": py("""
        import os, time, sys
        if os.environ["LOWTIDE_ATTEMPT"] == "1":
            time.sleep(60)
    """),
                }
            ],
        },
    )
    tick_until(first, lambda: steps(first, job)["a"] == "RUNNING", what="start")
    pid = int(first.store.active_attempts()[0].handle or 0)
    first.close()
    os.killpg(pid, signal.SIGKILL)  # the whole step group dies while nobody watches
    wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    second = embedded(tmp_path, auth={"enabled": False})
    report = second.loop.recover()
    assert len(report.lost) == 1 or len(report.exited) == 1
    tick_until(second, lambda: job_state(second, job) == "SUCCEEDED", what="the requeued step to finish")
    d = detail(second, job)
    assert d["attempts"][0]["state"] in ("LOST", "FAILED")
    assert d["attempts"][-1]["state"] == "SUCCEEDED"
    second.close()
