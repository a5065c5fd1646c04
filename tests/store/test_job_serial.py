"""`job_serial`: a number unique to a job and stable for its life, on every backend (§6.4: the
executor derives the job's Unix uid from it)."""

from __future__ import annotations

import pytest
from storekit import submit

from lowtide.control.clock import FakeClock
from lowtide.control.records import NotFound
from lowtide.store.repo import Store


def test_each_job_has_its_own_serial_and_it_does_not_change(store: Store) -> None:
    clock = FakeClock(1000.0)
    first = submit(store, clock, "job-000000000001")
    second = submit(store, clock, "job-000000000002")
    serials = {job: store.job_serial(job) for job in (first, second)}
    assert serials[first] != serials[second]
    assert all(s >= 1 for s in serials.values())
    # Stable: more jobs later do not move it.
    submit(store, clock, "job-000000000003")
    assert {job: store.job_serial(job) for job in (first, second)} == serials
    # The first job's two steps got ids before the second job's: its serial (smallest) is lower.
    assert serials[first] < serials[second]


def test_an_unknown_job_has_no_serial(store: Store) -> None:
    with pytest.raises(NotFound, match="job 'job-404' not found"):
        store.job_serial("job-404")
