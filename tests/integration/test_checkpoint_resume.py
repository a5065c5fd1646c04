"""Checkpoints verified before resume, with real step processes, SQLite and the API (issue 12).

- LATEST naming a checkpoint that does not exist: the next attempt resumes from the newest one
  that does, and the job says so in an event.
- A truncated checkpoint whose manifest (written by the example trainer) no longer matches: the
  next attempt resumes from the one before it and the trainer finishes all its steps.
- A checkpoint without a manifest that makes every resume crash at once: marked bad, the step
  retried from the one before it without using a retry (max_retries 0), and the job succeeds.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lowtide.wiring import Embedded
from support import embedded, job_detail, kill_steps_and_close, step_log, submit_job, tick_until

PY = sys.executable


def py(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


@pytest.fixture
def lt(tmp_path: Path) -> Iterator[Embedded]:
    system = embedded(tmp_path, auth={"enabled": False})
    system.loop.recover()
    yield system
    kill_steps_and_close(system)


def finished(lt: Embedded, job: str) -> bool:
    return job_detail(lt, job)["job"]["state"] in ("SUCCEEDED", "FAILED", "CANCELLED")


def events(d: dict[str, Any], kind: str) -> list[str]:
    return [e["message"] for e in d["events"] if e["kind"] == kind]


def test_latest_naming_a_missing_checkpoint_resumes_from_the_newest_that_exists(lt: Embedded) -> None:
    code = py("""
        import os, pathlib, sys
        ckpt = pathlib.Path(os.environ["LOWTIDE_CHECKPOINT_DIR"])
        attempt = int(os.environ["LOWTIDE_ATTEMPT"])
        resume = os.environ.get("LOWTIDE_RESUME_FROM")
        print("attempt", attempt, "resumes from", resume, flush=True)
        if attempt == 1:
            (ckpt / "c1").write_text("600 steps of work")
            (ckpt / "LATEST").write_text("c1\\n")
            sys.exit(1)
        if attempt == 2:
            assert resume == str(ckpt / "c1"), resume
            (ckpt / "LATEST").write_text("c2\\n")  # names a checkpoint that was never written
            sys.exit(1)
        assert resume == str(ckpt / "c1"), resume
    """)
    job = submit_job(
        lt,
        {"name": "missing", "max_retries": 2, "steps": [{"name": "t", "command": code, "checkpoint": True}]},
    )
    tick_until(lt, lambda: finished(lt, job), what="the job")
    d = job_detail(lt, job)
    assert d["job"]["state"] == "SUCCEEDED", step_log(lt, job, "t")
    assert [c["label"] for c in d["checkpoints"]] == ["c1", "c2"]
    assert [a["record"]["resume_from"] for a in d["attempts"]] == [None, "c1", "c1"]
    assert events(d, "checkpoint_invalid") == ["checkpoint c2 invalid: it does not exist; resuming from c1"]


TRAIN_THEN_TRUNCATE = """
    import os, pathlib, subprocess, sys
    ckpt = pathlib.Path(os.environ["LOWTIDE_CHECKPOINT_DIR"])
    data, out = sys.argv[1], os.environ["LOWTIDE_OUTPUTS"]
    train = [sys.executable, "-m", "lowtide.examples.train", "--data", data, "--out", out,
             "--checkpoint-every", "10", "--step-seconds", "0"]
    attempt = os.environ["LOWTIDE_ATTEMPT"]
    if attempt == "1":  # checkpoints at step 10 (LATEST is read when the attempt ends), fails
        subprocess.run([*train, "--steps", "10"], check=True)
        sys.exit(3)
    if attempt == "2":  # resumes at 10, checkpoints at 20, which is then cut short, as by a full disk
        subprocess.run([*train, "--steps", "20"], check=True)
        newest = ckpt / "step-000020.json"
        newest.write_bytes(newest.read_bytes()[:40])
        sys.exit(3)
    os.execv(sys.executable, [*train, "--steps", "40"])
"""


def test_a_truncated_checkpoint_is_caught_by_its_manifest_and_the_trainer_resumes_before_it(
    lt: Embedded, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    rows = [[x / 10, (x % 7) / 10, 0.5 * x / 10 - 0.2 * (x % 7) / 10 + 0.1] for x in range(50)]
    (data / "shard-0.json").write_text(json.dumps(rows))
    job = submit_job(
        lt,
        {
            "name": "truncated",
            "max_retries": 2,
            "steps": [
                {"name": "train", "command": [*py(TRAIN_THEN_TRUNCATE), str(data)], "checkpoint": True}
            ],
        },
    )
    tick_until(lt, lambda: finished(lt, job), what="the job")
    d = job_detail(lt, job)
    assert d["job"]["state"] == "SUCCEEDED", step_log(lt, job, "train")
    resumed = [a["record"]["resume_from"] for a in d["attempts"]]
    assert resumed == [None, "step-000010.json", "step-000010.json"]
    (message,) = events(d, "checkpoint_invalid")
    assert message.startswith("checkpoint step-000020.json invalid: step-000020.json is 40 bytes")
    assert message.endswith("resuming from step-000010.json")
    assert "train: resumed at step 10" in step_log(lt, job, "train", attempt=3)
    model = json.loads((Path(d["steps"][0]["outputs"]) / "model.json").read_text())
    assert model["steps"] == 40


CRASHES_ON_A_BAD_CHECKPOINT = """
    import os, pathlib, signal, sys, time
    resume = os.environ.get("LOWTIDE_RESUME_FROM")
    if resume is None:  # the first attempt runs until it is preempted
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        print("running", flush=True)
        while True:
            time.sleep(0.05)
    if pathlib.Path(resume).read_text() != "good weights":
        sys.exit(7)  # cannot load it: crashes at once, every time
    out = pathlib.Path(os.environ["LOWTIDE_OUTPUTS"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "resumed-from").write_text(resume)
"""


def test_a_resume_that_crashes_at_once_falls_back_one_checkpoint_without_using_a_retry(
    lt: Embedded,
) -> None:
    job = submit_job(
        lt,
        {
            "name": "crashes",
            "max_retries": 0,
            "steps": [{"name": "t", "command": py(CRASHES_ON_A_BAD_CHECKPOINT), "checkpoint": True}],
        },
    )
    tick_until(lt, lt.store.active_attempts, what="the first attempt")
    (att,) = lt.store.active_attempts()
    ckpt = Path(att.record["checkpoint_dir"])
    (ckpt / "c1").write_text("good weights")
    (ckpt / "c2").write_text("garbage")  # exists, no manifest: only a resume shows it is bad
    for label in ("c1", "c2"):
        lt.store.record_checkpoint(att.id, label=label, progress=None, source="api", now=lt.clock.now())
    lt.store.request_preemption(att.id, grace_s=10, reason="test", now=lt.clock.now())
    tick_until(lt, lambda: finished(lt, job), what="the job")
    d = job_detail(lt, job)
    assert d["job"]["state"] == "SUCCEEDED", step_log(lt, job, "t")
    assert [a["record"]["resume_from"] for a in d["attempts"]] == [None, "c2", "c1"]
    assert d["steps"][0]["retries_used"] == 0
    (bad,) = events(d, "checkpoint_bad")
    assert bad.startswith("checkpoint c2 marked bad: attempt 2")
    assert events(d, "checkpoint_invalid") == [
        "checkpoint c2 invalid: an attempt crashed right after resuming from it; resuming from c1"
    ]
    assert (Path(d["steps"][0]["outputs"]) / "resumed-from").read_text().endswith("/c1")
