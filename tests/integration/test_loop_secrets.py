"""Secrets by reference with real step processes, a real SQLite store and the real API
(docs/architecture.md §11): the value reaches the step's environment and nothing else."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from lowtide.wiring import Embedded
from support import embedded, kill_steps_and_close, tick_until
from support import submit_job as submit

FILE_VALUE = "file-s3cr3t-91b2"
ENV_VALUE = "env-s3cr3t-c4d5"
OPERATOR_VAR = "LT_TEST_OPERATOR_HF_TOKEN"

DUMP = [
    sys.executable,
    "-c",
    textwrap.dedent(
        """
        import json, os, pathlib
        out = pathlib.Path(os.environ["LOWTIDE_OUTPUTS"])
        out.mkdir(parents=True, exist_ok=True)
        keys = ["WANDB_API_KEY", "MY_HF", "HF_TOKEN"]
        (out / "env.json").write_text(json.dumps({k: os.environ.get(k) for k in keys}))
        print("done")
        """
    ),
]


@pytest.fixture
def lt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Embedded]:
    secret_file = tmp_path / "wandb.secret"
    secret_file.write_text(FILE_VALUE + "\n")
    monkeypatch.setenv(OPERATOR_VAR, ENV_VALUE)
    system = embedded(
        tmp_path,
        auth={"enabled": False},
        secrets={
            "wandb": {"env": "WANDB_API_KEY", "teams": ["nlp"], "source": {"file": str(secret_file)}},
            "hf": {"env": "HF_TOKEN", "teams": ["*"], "source": {"env": OPERATOR_VAR}},
            "gone": {"env": "GONE", "teams": ["*"], "source": {"file": str(tmp_path / "missing.secret")}},
        },
    )
    system.loop.recover()
    yield system
    kill_steps_and_close(system)


def finished(lt: Embedded, job_id: str) -> str:
    state = lt.store.job(job_id).state.value
    return state if state in ("SUCCEEDED", "FAILED", "CANCELLED") else ""


def test_a_step_gets_its_secrets_values_that_no_record_api_or_log_line_holds(
    lt: Embedded, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    job_id = submit(
        lt,
        {
            "name": "sft",
            "team": "nlp",
            "secrets": ["wandb"],
            "steps": [{"name": "train", "command": DUMP, "secrets": {"MY_HF": "hf"}}],
        },
    )
    assert tick_until(lt, lambda: finished(lt, job_id), what="the job to finish") == "SUCCEEDED"
    detail = TestClient(lt.app).get(f"/v1/jobs/{job_id}")
    outputs = Path(detail.json()["steps"][0]["outputs"])
    env = json.loads((outputs / "env.json").read_text())
    assert env == {"WANDB_API_KEY": FILE_VALUE, "MY_HF": ENV_VALUE, "HF_TOKEN": None}
    # Names only, everywhere lowtide keeps or shows the job.
    attempt = lt.store.job_detail(job_id).attempts[0]
    assert attempt.record["resolved"]["secrets"] == [
        {"name": "wandb", "env": None},
        {"name": "hf", "env": "MY_HF"},
    ]
    log = TestClient(lt.app).get(f"/v1/jobs/{job_id}/steps/train/logs").text
    for text in (
        detail.text,
        json.dumps(attempt.record),
        repr(lt.store.job_detail(job_id)),
        log,
        caplog.text,
    ):
        assert FILE_VALUE not in text and ENV_VALUE not in text


def test_a_secret_that_cannot_be_read_is_an_infrastructure_failure_until_it_can(
    lt: Embedded, tmp_path: Path
) -> None:
    """An unreadable secret file is the operator's problem, not the step's (docs/architecture.md
    §4.4): no retry is used, the step waits with a growing backoff, an alert is raised, and the
    job runs once the file is there."""
    job_id = submit(
        lt,
        {"name": "broken", "max_retries": 1, "steps": [{"name": "s", "command": DUMP, "secrets": ["gone"]}]},
    )
    tick_until(lt, lambda: len(lt.store.job_detail(job_id).attempts) >= 3, what="three launch tries")
    detail = lt.store.job_detail(job_id)
    assert detail.job.state.value != "FAILED"
    assert detail.steps[0].retries_used == 0  # not the step's failure
    for attempt in detail.attempts:
        assert attempt.handle is None  # never started
        assert "secret 'gone': cannot read its file" in attempt.message, attempt.message
        assert "No such file" in attempt.message and "not the step's failure" in attempt.message
    assert any(e.kind == "infrastructure_failure" for e in detail.events)
    assert set(lt.loop.infrastructure_alerts) == {"secrets"}
    health = TestClient(lt.app).get("/healthz")
    assert health.status_code == 200  # an alert, not an outage
    assert [a["kind"] for a in health.json()["alerts"]] == ["secrets"]
    assert 'lowtide_infrastructure_alert{kind="secrets"} 1.0' in TestClient(lt.app).get("/metrics").text

    (tmp_path / "missing.secret").write_text("found\n")
    assert tick_until(lt, lambda: finished(lt, job_id), what="the job to finish") == "SUCCEEDED"
    assert lt.loop.infrastructure_alerts == {}  # cleared by the launch that worked
    assert TestClient(lt.app).get("/healthz").json()["alerts"] == []
