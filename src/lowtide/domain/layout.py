"""Where a job's files live: outputs and checkpoints under the artifact root, logs and
working directories under a local work root. Pure string arithmetic, no I/O.

The artifact root may be a local path or any fsspec URL (``s3://bucket/prefix``); the work
root is always local because a process needs a real directory to run in and a file to log to.
"""

from __future__ import annotations

from dataclasses import dataclass


def join_uri(base: str, *parts: str) -> str:
    """Join path parts onto a local path or URL with single slashes."""
    out = base.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


def is_remote(uri: str) -> bool:
    """True for fsspec URLs other than local files (``s3://``, ``gs://``, ``memory://``...)."""
    return "://" in uri and not uri.startswith("file://")


@dataclass(frozen=True, slots=True)
class ArtifactLayout:
    artifact_root: str
    work_root: str

    def job_root(self, job_id: str) -> str:
        return join_uri(self.artifact_root, "jobs", job_id)

    def outputs(self, job_id: str, step: str) -> str:
        return join_uri(self.job_root(job_id), step, "outputs")

    def checkpoints(self, job_id: str, step: str) -> str:
        return join_uri(self.job_root(job_id), step, "checkpoints")

    def attempt_dir(self, job_id: str, step: str, attempt: int) -> str:
        return join_uri(self.work_root, "jobs", job_id, step, f"attempt-{attempt}")

    def attempt_log(self, job_id: str, step: str, attempt: int) -> str:
        return join_uri(self.attempt_dir(job_id, step, attempt), "log")

    def notice_file(self, job_id: str, step: str, attempt: int) -> str:
        return join_uri(self.attempt_dir(job_id, step, attempt), "NOTICE")
