"""The narrow ports the control loop talks through, besides the executor (see executor_port).

`StorePort` is the loop's half of `store.repo.Store`; `ArtifactPort` reads and prepares paths
under the artifact root (local or fsspec). Must not: contain implementations.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from lowtide.control.executor_port import AttemptHandle
from lowtide.control.records import (
    AttemptLaunch,
    AttemptRecord,
    CheckpointRecord,
    ExitContext,
    NoticeDue,
    StepRecord,
    TokenRecord,
)
from lowtide.domain.exit_reasons import ExitReason
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.policy.dag import DagChanges, JobView
from lowtide.policy.outcomes import ExitDecision
from lowtide.policy.snapshot import Snapshot


class StorePort(Protocol):
    def ensure_gpus(self, nodes: Iterable[Node], now: float) -> None: ...

    def snapshot(self, *, now: float, nodes: tuple[Node, ...], half_life_s: float) -> Snapshot: ...

    def begin_attempt(
        self,
        *,
        job_id: str,
        step: str,
        node: str,
        gpus: tuple[int, ...],
        layout: ArtifactLayout,
        now: float,
        reason: str,
    ) -> AttemptLaunch: ...

    def record_launch(self, attempt_id: int, handle: AttemptHandle) -> None: ...

    def mark_running(self, attempt_id: int, at: float) -> None: ...

    def active_attempts(self) -> list[AttemptRecord]: ...

    def job_serial(self, job_id: str) -> int: ...

    def exit_context(self, attempt_id: int) -> ExitContext: ...

    def attempt(self, attempt_id: int) -> AttemptRecord: ...

    def step(self, job_id: str, step: str) -> StepRecord: ...

    def step_attempts(self, job_id: str, step: str) -> list[AttemptRecord]: ...

    def finish_attempt(
        self,
        ctx: ExitContext,
        decision: ExitDecision,
        *,
        ended_at: float,
        exit_code: int | None,
        signal: int | None,
        killed_at_deadline: bool,
        half_life_s: float,
        reason: ExitReason | None = None,
        detail: str | None = None,
    ) -> None: ...

    def notices_due(self) -> list[NoticeDue]: ...

    def mark_stopping(self, attempt_id: int, *, deadline: float, reason: str, now: float) -> None: ...

    def job_views(self, job_ids: Iterable[str] | None = None) -> list[JobView]: ...

    def apply_dag(self, changes: DagChanges, now: float) -> None: ...

    def set_waiting_reasons(self, reasons: Mapping[tuple[str, str], str]) -> None: ...

    def record_checkpoint(
        self, attempt_id: int, *, label: str, progress: str | None, source: str, now: float
    ) -> bool: ...

    def add_event(
        self, job_id: str, step: str | None, attempt_id: int | None, *, at: float, kind: str, message: str
    ) -> None: ...

    def step_checkpoints(self, job_id: str, step: str) -> list[CheckpointRecord]:
        """Every checkpoint the step reported, in the order reported."""
        ...

    def record_resume(
        self,
        attempt_id: int,
        *,
        resume_from: str | None,
        fingerprint: str | None,
        skipped: Sequence[tuple[str, str]],
        now: float,
    ) -> None:
        """Record where the attempt resumes (its record's ``resume_from``, ``resume_fingerprint``)
        and one ``checkpoint_invalid`` event per skipped checkpoint: (label, message)."""
        ...

    def mark_checkpoint_bad(
        self, attempt_id: int, *, label: str, fingerprint: str | None, message: str, now: float
    ) -> None:
        """Record with the attempt that it crashed on resuming from `label` (its record's
        ``bad_checkpoint``) and a ``checkpoint_bad`` event."""
        ...

    def create_token(
        self, *, name: str, owner: str, role: str, now: float, attempt_id: int | None = None
    ) -> tuple[TokenRecord, str]: ...

    def jobs_to_end(self, *, after: str | None = None, limit: int = 100) -> list[str]:
        """Ids of finished jobs (SUCCEEDED, FAILED, CANCELLED) whose end the executor has not yet
        taken (`mark_jobs_ended`), in id order after `after`, at most `limit`."""
        ...

    def mark_jobs_ended(self, job_ids: Sequence[str], *, at: float) -> int:
        """Record that `Executor.end_job` succeeded for these jobs (a fenced write; only finished,
        unmarked jobs are marked). Returns how many were marked."""
        ...


@dataclass(frozen=True, slots=True)
class PathStat:
    """What is at a path: a regular file (with its size), a directory, something else ("other":
    a symbolic link, a FIFO; lowtide does not follow links in a step's directory), or "unknown"
    (the port cannot see files at all). `modified`: seconds since the epoch, when known."""

    kind: Literal["file", "dir", "other", "unknown"]
    size: int | None = None
    modified: float | None = None


class ArtifactPort(Protocol):
    def ensure_dir(self, uri: str) -> None:
        """Make sure a directory exists (a no-op on object stores, which have no directories)."""
        ...

    def read_text(self, uri: str, *, max_bytes: int) -> str | None:
        """The file's text, or None if it does not exist. Raises ValueError if it is larger than
        `max_bytes` or not UTF-8, OSError for storage errors."""
        ...

    def stat(self, uri: str) -> PathStat | None:
        """What is at `uri` (None: nothing). Raises OSError for storage errors."""
        ...

    def sha256(self, uri: str, *, max_bytes: int) -> str | None:
        """The hex sha256 of a regular file, or None if it is larger than `max_bytes` (or gone).
        Raises ValueError if it is not a regular file, OSError for storage errors."""
        ...
