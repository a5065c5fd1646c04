"""A job of many steps, on every backend: what the per-job caches of the store (spec index, the
steps' `depends`, views reused from one read to the next) must never change.

Each test compares what the store returns after a move with what the job's own spec and the
moves made say, so a stale cached value fails it. See `store.attempts_repo` (`_JobCache`,
`_DagSteps`, the snapshot's reuse of queued views) and `store.memory.base` (views built when read).
"""

from __future__ import annotations

from typing import Any

from storekit import HALF_LIFE, LAYOUT, NODES, advance_dag, finish, start

from lowtide.control.clock import FakeClock
from lowtide.control.records import NewJob
from lowtide.domain.spec_parse import build_job_spec
from lowtide.domain.spec_render import render_step
from lowtide.domain.states import JobState, StepState
from lowtide.policy.attempt_rules import step_scoped_spec
from lowtide.policy.dag import advance
from lowtide.policy.outcomes import RetryPolicy
from lowtide.store.repo import Store

STEPS = 200


def fanout_doc(n: int = STEPS) -> dict[str, Any]:
    """`setup`, then n CPU-only steps after it, then `merge` after all of them."""
    names = [f"s{i:03d}" for i in range(n)]
    return {
        "name": "fan",
        "team": "nlp",
        "params": {"lr": 0.1, "layers": [1, 2]},
        "max_retries": 1,
        "steps": [
            {"name": "setup", "command": ["true"], "gpus": 0},
            *({"name": name, "command": ["echo", name], "gpus": 0, "depends": ["setup"]} for name in names),
            {"name": "merge", "command": ["true"], "gpus": 0, "depends": names},
        ],
    }


def submit_fanout(store: Store, clock: FakeClock, job_id: str = "job-0000000000f1") -> str:
    spec = build_job_spec(fanout_doc())
    resolved = tuple(render_step(spec, s, job_id=job_id, layout=LAYOUT) for s in spec.steps)
    store.create_job(
        NewJob(
            id=job_id,
            spec=spec,
            resolved=resolved,
            source_text="name: fan\n",
            owner="alice",
            submitted_at=clock.now(),
        )
    )
    return job_id


def states(store: Store, job_id: str) -> dict[str, StepState]:
    (view,) = store.job_views([job_id])
    return {s.name: s.state for s in view.steps}


def test_each_attempt_records_its_own_step_and_gets_its_own_params(store: Store, clock: FakeClock) -> None:
    store.ensure_gpus(NODES, clock.now())
    job_id = submit_fanout(store, clock)
    full = store.job_detail(job_id).job.spec
    first = start(store, job_id, "setup", clock.now())
    first.params["lr"] = 99  # the caller's copy: the next start must not see it
    first.params["layers"].append(3)
    finish(store, first.attempt_id, clock.advance(1))
    advance_dag(store, job_id, clock.now())
    for name in ("s007", "s150", "s000"):
        launch = start(store, job_id, name, clock.advance(1))
        assert launch.params == {"lr": 0.1, "layers": [1, 2]}
        record = store.attempt(launch.attempt_id).record
        assert record["spec"] == step_scoped_spec(full, name)
        assert [s["name"] for s in record["spec"]["steps"]] == [name]
        assert record["spec"]["steps"][0]["command"] == ["echo", name]
        assert record["params"] == {"lr": 0.1, "layers": [1, 2]}


def test_job_views_follow_every_move_and_keep_the_depends(store: Store, clock: FakeClock) -> None:
    store.ensure_gpus(NODES, clock.now())
    job_id = submit_fanout(store, clock)
    (view,) = store.job_views([job_id])
    assert [s.name for s in view.steps][:2] == ["setup", "s000"] and len(view.steps) == STEPS + 2
    assert {s.name: s.depends for s in view.steps}["merge"] == tuple(f"s{i:03d}" for i in range(STEPS))
    assert states(store, job_id)["s000"] == StepState.PENDING

    finish(store, start(store, job_id, "setup", clock.now()).attempt_id, clock.advance(1))
    assert states(store, job_id)["setup"] == StepState.SUCCEEDED
    advance_dag(store, job_id, clock.now())
    now_states = states(store, job_id)
    assert {now_states[f"s{i:03d}"] for i in range(STEPS)} == {StepState.READY}
    assert now_states["merge"] == StepState.PENDING

    for i in range(STEPS):  # one by one, reading the view between moves, as the loop does
        name = f"s{i:03d}"
        finish(store, start(store, job_id, name, clock.advance(1)).attempt_id, clock.advance(1))
        assert states(store, job_id)[name] == StepState.SUCCEEDED
        (view,) = store.job_views([job_id])
        changes = advance(view)
        assert [c.step for c in changes.steps] == (["merge"] if i == STEPS - 1 else [])
        store.apply_dag(changes, clock.now())
    assert states(store, job_id)["merge"] == StepState.READY
    finish(store, start(store, job_id, "merge", clock.advance(1)).attempt_id, clock.advance(1))
    advance_dag(store, job_id, clock.now())
    assert store.job_detail(job_id).job.state == JobState.SUCCEEDED
    assert store.job_views() == []  # finished, with every step finished: nothing may move


def test_the_snapshot_shows_each_change_of_a_queued_step(store: Store, clock: FakeClock) -> None:
    store.ensure_gpus(NODES, clock.now())
    job_id = submit_fanout(store, clock)
    finish(store, start(store, job_id, "setup", clock.now()).attempt_id, clock.advance(1))
    advance_dag(store, job_id, clock.now())

    def queued() -> dict[str, tuple[float, str]]:
        snap = store.snapshot(now=clock.now(), nodes=NODES, half_life_s=HALF_LIFE)
        return {q.step: (q.eligible_at, q.retry_note) for q in snap.queued}

    before = queued()
    assert len(before) == STEPS and before["s005"] == (0.0, "")
    assert queued() == before  # read again, nothing changed
    launch = start(store, job_id, "s005", clock.advance(1))
    assert "s005" not in queued()
    finish(store, launch.attempt_id, clock.advance(1), exit_code=1, retry=RetryPolicy(backoff_s=30))
    eligible_at, note = queued()["s005"]  # back in the queue, with its backoff and its retry
    assert eligible_at == clock.now() + 30 and note == "attempt 2 of 2"
    snap = store.snapshot(now=clock.now(), nodes=NODES, half_life_s=HALF_LIFE)
    assert [q.step for q in snap.queued] == [f"s{i:03d}" for i in range(STEPS)]  # in step order


def test_a_cancelled_fanout_leaves_nothing_to_move(store: Store, clock: FakeClock) -> None:
    store.ensure_gpus(NODES, clock.now())
    job_id = submit_fanout(store, clock)
    running = start(store, job_id, "setup", clock.now())
    store.request_cancel(job_id, by="alice", now=clock.advance(1))
    assert [v.job_id for v in store.job_views()] == [job_id]  # a step is still stopping
    assert set(states(store, job_id).values()) == {StepState.CANCELLING, StepState.CANCELLED}
    finish(store, running.attempt_id, clock.advance(1), noticed=True)
    advance_dag(store, job_id, clock.now())
    assert store.job_views() == []
