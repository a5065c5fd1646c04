"""Idempotent submits in the store, on every backend: the same owner, key and request digest
return the first job; another digest under the key is `IdempotencyConflict`; the key is the
owner's own; identical submits racing make exactly one job."""

from __future__ import annotations

import threading

import pytest
from storekit import LAYOUT, job_doc

from lowtide.control.clock import FakeClock
from lowtide.control.records import IdempotencyConflict, JobRecord, NewJob
from lowtide.domain.spec_parse import build_job_spec
from lowtide.domain.spec_render import render_step
from lowtide.store.repo import Store


def new_job(job_id: str, *, owner: str = "alice", key: str | None = "k-1", digest: str = "d1") -> NewJob:
    spec = build_job_spec(job_doc())
    return NewJob(
        id=job_id,
        spec=spec,
        resolved=tuple(render_step(spec, s, job_id=job_id, layout=LAYOUT) for s in spec.steps),
        source_text="name: sft\n",
        owner=owner,
        submitted_at=FakeClock().now(),
        idempotency_key=key,
        request_digest=digest if key is not None else None,
    )


def test_a_replay_returns_the_first_job(store: Store) -> None:
    first = store.create_job(new_job("job-000000000001"))
    again = store.create_job(new_job("job-000000000002"))
    assert again.id == first.id == "job-000000000001"
    assert [j.id for j in store.list_jobs()] == ["job-000000000001"]
    assert [e.kind for e in store.job_detail(first.id).events] == ["submitted"]  # no second event


def test_the_same_key_for_another_request_is_a_conflict(store: Store) -> None:
    store.create_job(new_job("job-000000000001"))
    with pytest.raises(IdempotencyConflict) as caught:
        store.create_job(new_job("job-000000000002", digest="d2"))
    assert caught.value.job_id == "job-000000000001"
    assert len(store.list_jobs()) == 1


def test_keys_are_per_owner_and_optional(store: Store) -> None:
    store.create_job(new_job("job-000000000001", owner="alice"))
    assert store.create_job(new_job("job-000000000002", owner="bob")).id == "job-000000000002"
    store.create_job(new_job("job-000000000003", key=None))
    store.create_job(new_job("job-000000000004", key=None))
    assert len(store.list_jobs()) == 4


def test_identical_submits_racing_make_one_job(store: Store, store_url: str) -> None:
    # SQL backends: one store per thread (separate connections) so the database itself decides.
    stores = (
        [store] * 6 if store_url.startswith("memory") else [store, *(Store.open(store_url) for _ in range(5))]
    )
    barrier = threading.Barrier(len(stores))
    results: list[JobRecord | BaseException] = []

    def go(i: int) -> None:
        barrier.wait()
        try:
            results.append(stores[i].create_job(new_job(f"job-00000000001{i}")))
        except BaseException as exc:
            results.append(exc)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    try:
        assert all(isinstance(r, JobRecord) for r in results), results
        assert len({r.id for r in results if isinstance(r, JobRecord)}) == 1
        assert len(results) == len(stores)
        assert len(store.list_jobs()) == 1
    finally:
        for s in stores[1:]:
            if s is not store:
                s.close()
