"""Helpers for the store tests: submit a job, start and finish attempts, advance a DAG — all
through the public API, so that every backend (SQLite, PostgreSQL, memory) runs them."""

from __future__ import annotations

from typing import Any

from lowtide.control.clock import FakeClock
from lowtide.control.records import AttemptLaunch, NewJob
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.spec_parse import build_job_spec
from lowtide.domain.spec_render import render_step
from lowtide.policy.dag import advance
from lowtide.policy.outcomes import ExitDecision, RetryPolicy, classify_exit
from lowtide.store.repo import Store
from support import running

LAYOUT = ArtifactLayout("/art", "/work")
NODES = (Node("n1", (0, 1, 2, 3)), Node("n2", (0, 1)))
HALF_LIFE = 3600.0


def job_doc(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "sft",
        "team": "nlp",
        "steps": [
            {"name": "prep", "command": ["python", "prep.py"], "gpus": 0},
            {
                "name": "train",
                "command": ["python", "train.py"],
                "gpus": 2,
                "depends": ["prep"],
                "checkpoint": True,
            },
        ],
    }
    doc.update(overrides)
    return doc


def submit(
    store: Store,
    clock: FakeClock,
    job_id: str = "job-000000000001",
    *,
    owner: str = "alice",
    **overrides: Any,
) -> str:
    spec = build_job_spec(job_doc(**overrides))
    resolved = tuple(render_step(spec, s, job_id=job_id, layout=LAYOUT) for s in spec.steps)
    store.create_job(
        NewJob(
            id=job_id,
            spec=spec,
            resolved=resolved,
            source_text="name: sft\n",
            owner=owner,
            submitted_at=clock.now(),
        )
    )
    return job_id


def start(
    store: Store, job_id: str, step: str, now: float, node: str = "n1", gpus: tuple[int, ...] = ()
) -> AttemptLaunch:
    return running(
        store,
        store.begin_attempt(
            job_id=job_id, step=step, node=node, gpus=gpus, layout=LAYOUT, now=now, reason="test"
        ),
    )


def finish(
    store: Store,
    attempt_id: int,
    now: float,
    *,
    exit_code: int | None = 0,
    noticed: bool = False,
    killed: bool = False,
    retry: RetryPolicy | None = None,
) -> ExitDecision:
    """Classify an exit as the loop does and apply it."""
    ctx = store.exit_context(attempt_id)
    decision = classify_exit(
        step_state=ctx.step_state,
        noticed=noticed,
        exit_code=exit_code,
        signal=None,
        killed_at_deadline=killed,
        retries_used=ctx.retries_used,
        max_retries=ctx.max_retries,
        now=now,
        retry=retry or RetryPolicy(),
        preemptions=ctx.preemptions,
        max_preemptions=ctx.max_preemptions,
    )
    store.finish_attempt(
        ctx,
        decision,
        ended_at=now,
        exit_code=exit_code,
        signal=None,
        killed_at_deadline=killed,
        half_life_s=HALF_LIFE,
    )
    return decision


def advance_dag(store: Store, job_id: str, now: float) -> None:
    for view in store.job_views([job_id]):
        store.apply_dag(advance(view), now)
