"""An ``s3://`` artifact root against a real S3-compatible server (moto's server mode, started here).

Outputs and checkpoints live in the bucket; work directories and logs stay local. Steps reach the
bucket through LOWTIDE_STORAGE_OPTIONS alone (no AWS endpoint in their environment), and lowtide
reads each step's ``LATEST`` through fsspec and hands the next attempt an ``s3://`` resume URI.
The loop is driven by hand (`tick_until`); every wait is bounded.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

from conftest import require_service
from lowtide.adapters.storage import FsspecArtifacts
from lowtide.config import ConfigError
from lowtide.wiring import Embedded, build
from support import embedded, kill_steps_and_close, settings_for, tick_until, wait_until
from support import job_detail as detail
from support import job_finished as finished
from support import step_log as logs
from support import submit_job as submit

pytestmark = pytest.mark.s3

PY = sys.executable
CREDENTIALS = {"key": "testing", "secret": "testing"}


# -- the server --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str, proc: subprocess.Popen[bytes]) -> bool:
    if proc.poll() is not None:
        return True  # exited: stop waiting (checked by the caller)
    try:
        urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
    except (urllib.error.URLError, OSError):
        return False
    return True


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's S3-compatible server on a free local port, for this module."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with log.open("wb") as out:
        try:
            proc = subprocess.Popen(
                [PY, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )  # in pytest's process group: an interrupted run stops it too
        except OSError as exc:
            require_service("s3 (moto)", f"cannot start moto's server: {exc}")
        try:
            try:
                wait_until(lambda: _answers(url, proc), timeout=30, what="moto's server to answer")
            except AssertionError as exc:
                require_service("s3 (moto)", str(exc))
            if proc.poll() is not None:
                require_service(
                    "s3 (moto)", f"moto's server exited {proc.returncode}: {log.read_text()[-500:]}"
                )
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@dataclass
class Bucket:
    name: str
    endpoint: str
    client: Any  # a boto3 S3 client: an oracle independent of fsspec

    @property
    def options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, **CREDENTIALS}

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))

    def text(self, key: str) -> str:
        return str(self.client.get_object(Bucket=self.name, Key=key)["Body"].read().decode("utf-8"))


@pytest.fixture
def bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A fresh bucket; credentials and region in the environment (step processes inherit it), and
    no AWS endpoint there: steps can only find the server through LOWTIDE_STORAGE_OPTIONS."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", CREDENTIALS["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CREDENTIALS["secret"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    name = f"lowtide-{secrets.token_hex(4)}"
    client.create_bucket(Bucket=name)
    return Bucket(name, s3_endpoint, client)


@pytest.fixture
def lt(tmp_path: Path, bucket: Bucket) -> Iterator[Embedded]:
    system = embedded(
        tmp_path,
        auth={"enabled": False},
        artifact_root=f"s3://{bucket.name}/lowtide",
        artifact_options=bucket.options,
    )
    system.loop.recover()
    yield system
    kill_steps_and_close(system)


# -- helpers -----------------------------------------------------------------------------------


def module(name: str, *args: str) -> list[str]:
    return ["python", "-m", f"lowtide.examples.{name}", *args]


# -- stories -----------------------------------------------------------------------------------


def test_a_three_step_job_keeps_its_outputs_and_checkpoints_in_the_bucket(
    lt: Embedded, bucket: Bucket, tmp_path: Path
) -> None:
    job = submit(
        lt,
        {
            "name": "s3-story",
            "steps": [
                {"name": "prep", "command": module("prep", "--out", "{{outputs}}", "--shards", "2")},
                {
                    "name": "train",
                    "depends": ["prep"],
                    "checkpoint": True,
                    "gpus": 1,
                    "command": module(
                        "train",
                        *("--data", "{{inputs.prep}}", "--out", "{{outputs}}", "--steps", "60"),
                        *("--checkpoint-every", "20", "--step-seconds", "0"),
                    ),
                },
                {
                    "name": "eval",
                    "depends": ["train"],
                    "command": module("eval", "--model", "{{inputs.train}}", "--out", "{{outputs}}"),
                },
            ],
        },
    )
    tick_until(lt, lambda: finished(lt, job), timeout=120, what="the job to finish")
    d = detail(lt, job)
    assert d["job"]["state"] == "SUCCEEDED", [(a["step"], a["message"]) for a in d["attempts"]]

    root = f"lowtide/jobs/{job}"
    steps = {s["name"]: s for s in d["steps"]}
    for name in ("prep", "train", "eval"):
        assert steps[name]["outputs"] == f"s3://{bucket.name}/{root}/{name}/outputs"
    assert steps["train"]["inputs"] == {"prep": steps["prep"]["outputs"]}
    assert steps["eval"]["inputs"] == {"train": steps["train"]["outputs"]}
    assert steps["train"]["checkpoint_dir"] == f"s3://{bucket.name}/{root}/train/checkpoints"
    assert steps["prep"]["checkpoint_dir"] is None

    # Every artifact is in the bucket, and nothing else is (no logs, no work directories).
    checkpoints = [
        f"{root}/train/checkpoints/step-{n:06d}.json{suffix}"
        for n in (20, 40, 60)
        for suffix in ("", ".manifest.json")  # the trainer writes a manifest beside each
    ]
    assert bucket.keys() == sorted(
        [
            f"{root}/prep/outputs/manifest.json",
            f"{root}/prep/outputs/shard-000.json",
            f"{root}/prep/outputs/shard-001.json",
            f"{root}/train/outputs/model.json",
            f"{root}/eval/outputs/metrics.json",
            f"{root}/train/checkpoints/LATEST",
            *checkpoints,
        ]
    )
    assert bucket.text(f"{root}/train/checkpoints/LATEST").strip() == "step-000060.json"
    model = json.loads(bucket.text(f"{root}/train/outputs/model.json"))
    metrics = json.loads(bucket.text(f"{root}/eval/outputs/metrics.json"))
    assert model["steps"] == 60 and metrics["steps"] == 60 and metrics["w"] == model["w"]
    assert json.loads(bucket.text(f"{root}/train/checkpoints/step-000040.json"))["step"] == 40

    # lowtide read LATEST from the bucket (through fsspec) and recorded the checkpoint.
    assert steps["train"]["last_checkpoint"] == "step-000060.json"
    train_attempt = next(a for a in d["attempts"] if a["step"] == "train")
    recorded = [(c["attempt_id"], c["label"], c["source"]) for c in d["checkpoints"]]
    assert recorded and recorded[-1] == (train_attempt["id"], "step-000060.json", "file")
    assert {label for _, label, _ in recorded} <= {p.rsplit("/", 1)[1] for p in checkpoints}
    assert all(c["step"] == "train" for c in d["checkpoints"])

    # Work directories and logs are local, under the state directory.
    work = tmp_path / "state" / "work" / "jobs" / job
    for name in ("prep", "train", "eval"):
        assert (work / name / "attempt-1" / "log").is_file()
    assert "prep: wrote 2 shards of 256 rows to s3://" in logs(lt, job, "prep")
    assert "train: done after 60 steps" in logs(lt, job, "train")
    assert "eval: mse " in logs(lt, job, "eval")
    assert not (tmp_path / "artifacts").exists()
    assert train_attempt["record"]["outputs"] == steps["train"]["outputs"]
    assert train_attempt["record"]["checkpoint_dir"] == steps["train"]["checkpoint_dir"]


RESUMABLE = textwrap.dedent(
    """
    import json, os, sys
    from fsspec.core import url_to_fs

    options = json.loads(os.environ["LOWTIDE_STORAGE_OPTIONS"])
    ckpt = os.environ["LOWTIDE_CHECKPOINT_DIR"]
    attempt = os.environ["LOWTIDE_ATTEMPT"]
    print("options", json.dumps(options, sort_keys=True), flush=True)

    def write(uri, text):
        fs, path = url_to_fs(uri, **options)
        with fs.open(path, "w") as fh:
            fh.write(text)

    def read(uri):
        fs, path = url_to_fs(uri, **options)
        with fs.open(path, "r") as fh:
            return fh.read()

    if attempt == "1":
        assert "LOWTIDE_RESUME_FROM" not in os.environ
        write(ckpt + "/ckpt-7.json", json.dumps({"step": 7}))
        write(ckpt + "/LATEST", "ckpt-7.json\\n")
        print("attempt 1: checkpointed step 7, then failed", flush=True)
        sys.exit(3)
    resume = os.environ["LOWTIDE_RESUME_FROM"]
    state = json.loads(read(resume))
    write(os.environ["LOWTIDE_OUTPUTS"] + "/resumed.json", json.dumps({"from": resume, "state": state}))
    print("attempt", attempt, "resumed from", resume, flush=True)
    """
)


def test_a_retried_step_resumes_from_the_checkpoint_it_wrote_to_the_bucket(
    lt: Embedded, bucket: Bucket
) -> None:
    job = submit(
        lt,
        {
            "name": "s3-resume",
            "steps": [
                {"name": "train", "checkpoint": True, "max_retries": 1, "command": [PY, "-c", RESUMABLE]}
            ],
        },
    )
    tick_until(lt, lambda: finished(lt, job), timeout=90, what="the retried step to finish")
    d = detail(lt, job)
    assert d["job"]["state"] == "SUCCEEDED", logs(lt, job, "train", 1)
    assert [(a["number"], a["state"], a["exit_code"]) for a in d["attempts"]] == [
        (1, "FAILED", 3),
        (2, "SUCCEEDED", 0),
    ]
    ckpt_dir = d["steps"][0]["checkpoint_dir"]
    expected = f"{ckpt_dir}/ckpt-7.json"
    assert ckpt_dir == f"s3://{bucket.name}/lowtide/jobs/{job}/train/checkpoints"

    # lowtide read LATEST from the bucket when attempt 1 ended, and gave attempt 2 an s3:// URI.
    first, second = d["attempts"]
    assert [(c["attempt_id"], c["label"], c["source"]) for c in d["checkpoints"]] == [
        (first["id"], "ckpt-7.json", "file")
    ]
    assert first["record"]["resume_from"] is None
    assert second["record"]["resume_from"] == "ckpt-7.json"
    resumed = json.loads(bucket.text(f"lowtide/jobs/{job}/train/outputs/resumed.json"))
    assert resumed == {"from": expected, "state": {"step": 7}}
    assert f"attempt 2 resumed from {expected}" in logs(lt, job, "train", 2).splitlines()

    # Both attempts saw the artifact root's storage options, exactly as configured.
    for n in (1, 2):
        assert (
            f"options {json.dumps(bucket.options, sort_keys=True)}" in logs(lt, job, "train", n).splitlines()
        )


# -- the adapter itself ------------------------------------------------------------------------


def test_fsspec_artifacts_on_s3_read_write_and_refuse_what_is_not_a_small_text(bucket: Bucket) -> None:
    root = f"s3://{bucket.name}/lowtide"
    artifacts = FsspecArtifacts(root, bucket.options)
    artifacts.check()  # the bucket exists: no error

    assert artifacts.read_text(f"{root}/a/LATEST", max_bytes=64) is None
    assert not artifacts.exists(f"{root}/a/LATEST")
    artifacts.write_text(f"{root}/a/LATEST", "step-1\n")
    assert bucket.text("lowtide/a/LATEST") == "step-1\n"
    assert artifacts.exists(f"{root}/a/LATEST")
    assert artifacts.read_text(f"{root}/a/LATEST", max_bytes=7) == "step-1\n"  # exactly at the limit

    with pytest.raises(ValueError, match=r"LATEST is larger than 6 bytes"):
        artifacts.read_text(f"{root}/a/LATEST", max_bytes=6)
    bucket.client.put_object(Bucket=bucket.name, Key="lowtide/a/binary", Body=b"ok\xff\xfe")
    with pytest.raises(ValueError, match=r"binary is not UTF-8 text \(byte 2\)"):
        artifacts.read_text(f"{root}/a/binary", max_bytes=64)

    # Object stores have no directories: ensure_dir writes nothing.
    before = bucket.keys()
    artifacts.ensure_dir(f"{root}/jobs/job-1/train/outputs")
    artifacts.ensure_dir(f"{root}/jobs/job-1/train/checkpoints")
    assert bucket.keys() == before == ["lowtide/a/LATEST", "lowtide/a/binary"]

    assert artifacts.list(f"{root}/a") == [
        f"{bucket.name}/lowtide/a/LATEST",
        f"{bucket.name}/lowtide/a/binary",
    ]
    assert artifacts.list(f"{root}/nothing-here") == []


def test_a_missing_bucket_fails_the_check_and_the_start_with_its_name(bucket: Bucket, tmp_path: Path) -> None:
    missing = f"{bucket.name}-missing"
    with pytest.raises(FileNotFoundError, match="bucket does not exist"):
        FsspecArtifacts(f"s3://{missing}/lowtide", bucket.options).check()
    settings = settings_for(
        tmp_path, artifact_root=f"s3://{missing}/lowtide", artifact_options=bucket.options
    )
    with pytest.raises(ConfigError, match=rf"artifact_root s3://{missing}/lowtide: .*bucket does not exist"):
        build(settings)
    assert missing not in {b["Name"] for b in bucket.client.list_buckets()["Buckets"]}


def test_fsspec_artifacts_on_s3_stat_and_hash_a_checkpoint_before_a_resume(bucket: Bucket) -> None:
    root = f"s3://{bucket.name}/lowtide"
    artifacts = FsspecArtifacts(root, bucket.options)
    assert artifacts.stat(f"{root}/ck/c1") is None
    artifacts.write_text(f"{root}/ck/c1/model.pt", "weights")
    file_stat = artifacts.stat(f"{root}/ck/c1/model.pt")
    assert file_stat is not None and (file_stat.kind, file_stat.size) == ("file", 7)
    dir_stat = artifacts.stat(f"{root}/ck/c1")
    assert dir_stat is not None and dir_stat.kind == "dir"
    assert artifacts.sha256(f"{root}/ck/c1/model.pt", max_bytes=100) == hashlib.sha256(b"weights").hexdigest()
    assert artifacts.sha256(f"{root}/ck/c1/model.pt", max_bytes=3) is None
