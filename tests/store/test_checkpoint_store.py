"""The store's checkpoint reads and marks for resume verification (issue 12), on every backend:
the step's checkpoints in report order, where an attempt resumes, a checkpoint marked bad."""

from __future__ import annotations

from storekit import LAYOUT, NODES, submit

from lowtide.control.clock import FakeClock
from lowtide.store.repo import Store
from support import running


def test_checkpoints_resumes_and_bad_marks_are_kept_with_the_attempt(store: Store, clock: FakeClock) -> None:
    store.ensure_gpus(NODES, clock.now())
    job_id = submit(store, clock)
    launch = running(
        store,
        store.begin_attempt(
            job_id=job_id, step="prep", node="n1", gpus=(), layout=LAYOUT, now=clock.now(), reason=""
        ),
    )
    assert store.step_checkpoints(job_id, "prep") == []
    for label in ("c1", "c2"):
        store.record_checkpoint(
            launch.attempt_id, label=label, progress=None, source="api", now=clock.advance(1)
        )
    assert [(c.label, c.attempt_id) for c in store.step_checkpoints(job_id, "prep")] == [
        ("c1", launch.attempt_id),
        ("c2", launch.attempt_id),
    ]
    store.record_resume(
        launch.attempt_id,
        resume_from="c1",
        fingerprint="fp",
        skipped=[("c2", "checkpoint c2 invalid: it does not exist; resuming from c1")],
        now=clock.now(),
    )
    store.mark_checkpoint_bad(
        launch.attempt_id, label="c1", fingerprint="fp", message="checkpoint c1 marked bad", now=clock.now()
    )
    (att,) = store.step_attempts(job_id, "prep")
    assert att.record["resume_from"] == "c1"
    assert att.record["resume_fingerprint"] == "fp"
    assert att.record["bad_checkpoint"] == {"label": "c1", "fingerprint": "fp"}
    assert att.record["node"] == "n1"  # the rest of the record is kept
    events = [
        (e.kind, e.message) for e in store.job_detail(job_id).events if e.kind.startswith("checkpoint_")
    ]
    assert events == [
        ("checkpoint_invalid", "checkpoint c2 invalid: it does not exist; resuming from c1"),
        ("checkpoint_bad", "checkpoint c1 marked bad"),
    ]
