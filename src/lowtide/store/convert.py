"""Row → record conversions and ResolvedStep (de)serialisation, shared by both stores.

A "row" is anything with the table's column names as attributes: a SQLAlchemy `Row` in the SQL
store, a row object of `store.memory`. Must not: query, or import SQLAlchemy (the in-memory store,
which the simulator imports, uses this module too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lowtide.control.records import AttemptRecord, JobRecord, StepRecord
from lowtide.domain.exit_reasons import ExitReason
from lowtide.domain.spec import ResolvedStep, SecretUse
from lowtide.domain.states import AttemptState, JobState, StepState


def resolved_to_doc(r: ResolvedStep) -> dict[str, Any]:
    return {
        "name": r.name,
        "command": list(r.command),
        "gpus": r.gpus,
        "image": r.image,
        "env": dict(r.env),
        "inputs": dict(r.inputs),
        "outputs": r.outputs,
        "checkpoint_dir": r.checkpoint_dir,
        # By reference only (docs/architecture.md §11): names, never values.
        "secrets": [{"name": u.name, "env": u.env} for u in r.secrets],
        # Only when declared: the snapshot reads it from this document (no column of its own).
        **({} if r.gpu_memory_gib is None else {"gpu_memory_gib": r.gpu_memory_gib}),
    }


def resolved_from_doc(doc: Mapping[str, Any]) -> ResolvedStep:
    return ResolvedStep(
        name=doc["name"],
        command=tuple(doc["command"]),
        gpus=int(doc["gpus"]),
        image=doc.get("image"),
        env=dict(doc.get("env") or {}),
        inputs=dict(doc.get("inputs") or {}),
        outputs=doc["outputs"],
        checkpoint_dir=doc.get("checkpoint_dir"),
        secrets=tuple(SecretUse(u["name"], u.get("env")) for u in doc.get("secrets") or ()),
        gpu_memory_gib=doc.get("gpu_memory_gib"),
    )


def job_record(r: Any, step_states: dict[str, int] | None = None) -> JobRecord:
    return JobRecord(
        id=r.id,
        name=r.name,
        team=r.team,
        owner=r.owner,
        priority=r.priority,
        state=JobState(r.state),
        submitted_at=r.submitted_at,
        started_at=r.started_at,
        finished_at=r.finished_at,
        cancel_requested_at=r.cancel_requested_at,
        grace_seconds=r.grace_seconds,
        template=r.template,
        rerun_of=r.rerun_of,
        spec=r.spec,
        source_text=r.source_text,
        message=r.message,
        step_states=step_states or {},
    )


def step_record(r: Any) -> StepRecord:
    return StepRecord(
        id=r.id,
        job_id=r.job_id,
        name=r.name,
        idx=r.idx,
        state=StepState(r.state),
        gpus=r.gpus,
        depends=tuple(r.depends),
        resolved=r.resolved,
        max_retries=r.max_retries,
        retries_used=r.retries_used,
        preemptions=r.preemptions,
        eligible_at=r.eligible_at,
        reason=r.reason,
        last_checkpoint=r.last_checkpoint,
        last_checkpoint_at=r.last_checkpoint_at,
        updated_at=r.updated_at,
        retried_at=r.retried_at,
    )


def attempt_record(r: Any) -> AttemptRecord:
    return AttemptRecord(
        id=r.id,
        job_id=r.job_id,
        step_name=r.step_name,
        number=r.number,
        state=AttemptState(r.state),
        node=r.node,
        gpus=tuple(r.gpus),
        started_at=r.started_at,
        ended_at=r.ended_at,
        handle=r.handle,
        handle_started_at=r.handle_started_at,
        running_at=r.running_at,
        exit_code=r.exit_code,
        signal=r.signal,
        notice_at=r.notice_at,
        stop_deadline=r.stop_deadline,
        stop_reason=r.stop_reason,
        killed_at_deadline=bool(r.killed_at_deadline),
        exit_reason=ExitReason(r.exit_reason) if r.exit_reason else None,
        exit_detail=r.exit_detail,
        work_dir=r.work_dir,
        record=r.record,
        message=r.message,
        lost_gpu_seconds=r.lost_gpu_seconds,
        preempted=bool(r.preempted),
    )
