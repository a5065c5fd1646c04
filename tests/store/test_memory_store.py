"""What only the in-memory store has to promise: no SQLAlchemy behind it, records that cannot
change the store, and per-tick reads that do not grow with the history."""

from __future__ import annotations

import copy
import inspect
import json
import pickle
import subprocess
import sys

import pytest
from storekit import HALF_LIFE, NODES, advance_dag, finish, start, submit

from lowtide.control.clock import FakeClock
from lowtide.store.memory import MemoryStore
from lowtide.store.memory.values import FrozenDict, FrozenList, freeze, thaw
from lowtide.store.repo import Store


def test_importing_it_does_not_import_sqlalchemy() -> None:
    code = (
        "import sys, lowtide.store.memory as m; m.MemoryStore.open('memory://').close(); "
        "bad = sorted(x for x in sys.modules if x.split('.')[0] in ('sqlalchemy', 'alembic', 'psycopg')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_open_takes_memory_urls_only_and_every_store_is_its_own() -> None:
    a, b = MemoryStore.open("memory://"), MemoryStore()
    a.set_value("k", "v")
    assert b.get_value("k") is None
    a.close()
    assert a.get_value("k") == "v"  # close keeps nothing to release
    with pytest.raises(ValueError, match="memory"):
        MemoryStore.open("sqlite:///x.db")


def test_frozen_documents_refuse_changes_and_copy_to_plain_values() -> None:
    doc = freeze({"a": [1, {"b": (2, 3)}], 4: "x"})
    assert doc == {"a": [1, {"b": [2, 3]}], "4": "x"}  # as a JSON column reads it back
    assert isinstance(doc, dict) and isinstance(doc["a"], list)
    assert json.loads(json.dumps(doc)) == doc
    for change in (
        lambda: doc.__setitem__("a", 1),
        lambda: doc.update(a=1),
        lambda: doc.pop("a"),
        lambda: doc["a"].append(1),
        doc["a"][1].clear,
        lambda: doc["a"].__setitem__(0, 9),
    ):
        with pytest.raises(TypeError, match="read-only"):
            change()
    for plain in (copy.deepcopy(doc), thaw(doc), pickle.loads(pickle.dumps(doc))):
        assert type(plain) is dict and type(plain["a"]) is list and type(plain["a"][1]) is dict
        plain["a"].append(5)
    assert doc["a"] == [1, {"b": [2, 3]}]
    assert type(dict(doc)) is dict and type(copy.copy(doc)) is dict
    assert freeze(doc) is doc  # frozen parts are shared, not copied
    assert isinstance(freeze([doc])[0], FrozenDict) and isinstance(freeze((1,)), FrozenList)


def test_records_cannot_change_the_store() -> None:
    store, clock = MemoryStore(), FakeClock(1_790_000_000.0)
    store.ensure_gpus(NODES, clock.now())
    job_id = submit(store, clock, params={"lr": [1, 2]}, steps=[{"name": "x", "command": ["t"], "gpus": 1}])
    launch = start(store, job_id, "x", clock.now(), gpus=(0,))
    launch.params["lr"].append(3)  # the launch's own copy
    detail = store.job_detail(job_id)
    with pytest.raises(TypeError):
        detail.job.spec["steps"].append({})  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        detail.steps[0].resolved["command"][0] = "rm"  # type: ignore[index]
    with pytest.raises(TypeError):
        detail.attempts[0].record["params"]["lr"] = 0  # type: ignore[index]
    listed = store.active_attempts()
    listed.clear()
    counts = store.job(job_id).step_states
    counts["RUNNING"] = 99  # type: ignore[index]
    assert [a.id for a in store.active_attempts()] == [launch.attempt_id]
    assert store.job(job_id).step_states == {"RUNNING": 1}
    assert store.attempt(launch.attempt_id).record["params"] == {"lr": [1, 2]}
    snap = store.snapshot(now=clock.now(), nodes=NODES, half_life_s=HALF_LIFE)
    snap.team_usage["x"] = 1.0  # type: ignore[index]
    assert "x" not in store.snapshot(now=clock.now(), nodes=NODES, half_life_s=HALF_LIFE).team_usage


def test_a_taken_job_id_is_refused_and_changes_nothing() -> None:
    store, clock = MemoryStore(), FakeClock(1_790_000_000.0)
    job_id = submit(store, clock)
    before = store.job_detail(job_id)
    with pytest.raises(ValueError, match="exists"):
        submit(store, clock, job_id, name="other")
    assert store.job_detail(job_id) == before and len(store.list_jobs()) == 1


def test_per_tick_reads_answer_from_indexes_whatever_the_history() -> None:
    store, clock = MemoryStore(), FakeClock(1_790_000_000.0)
    store.ensure_gpus(NODES, clock.now())
    for i in range(200):  # a history of finished attempts and jobs
        job_id = submit(store, clock, f"old-{i:04d}", steps=[{"name": "x", "command": ["t"], "gpus": 1}])
        finish(store, start(store, job_id, "x", clock.now(), gpus=(0,)).attempt_id, clock.advance(10))
        advance_dag(store, job_id, clock.now())
    queued = [submit(store, clock, f"new-{i:04d}") for i in range(3)]
    running = start(store, queued[0], "prep", clock.now())
    first = store.snapshot(now=clock.now(), nodes=NODES, half_life_s=HALF_LIFE)
    again = store.snapshot(now=clock.now(), nodes=NODES, half_life_s=HALF_LIFE)
    # Nothing changed in between: the very same tuples, not rebuilt.
    assert again.queued is first.queued and again.running is first.running
    assert [q.job_id for q in first.queued] == queued[1:]
    assert [r.attempt_id for r in first.running] == [running.attempt_id]
    assert [v.job_id for v in store.job_views()] == queued  # the finished jobs are not looked at
    assert store.counts()["jobs"] == {"QUEUED": 2, "RUNNING": 1, "SUCCEEDED": 200}
    assert store.notices_due() == []
    store.request_cancel(queued[0], by="x", now=clock.now())
    assert [d.attempt_id for d in store.notices_due()] == [running.attempt_id]
    assert store.snapshot(now=clock.now(), nodes=NODES, half_life_s=HALF_LIFE).running[0].stopping


def test_it_has_every_public_method_of_the_sql_store_with_the_same_signature() -> None:
    public = sorted(n for n in dir(Store) if not n.startswith("_") and callable(getattr(Store, n)))
    assert len(public) > 40
    for name in public:
        sql, mem = getattr(Store, name), getattr(MemoryStore, name, None)
        assert mem is not None, f"MemoryStore has no {name}"
        assert inspect.signature(mem) == inspect.signature(sql), name
