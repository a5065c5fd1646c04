"""The SQL store and the in-memory store, driven by the same random sequences of calls, return the
same things and raise the same errors, call by call; after each sequence everything a caller can
read (job details, snapshot, ledger, counts, reports, replicas, reclaims) is equal.

Both stores live for the whole test, so later sequences run on the history of earlier ones.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from storekit import HALF_LIFE, LAYOUT, NODES, submit

from lowtide.control.clock import FakeClock
from lowtide.domain.states import ReclaimState, ReplicaState
from lowtide.policy.dag import advance
from lowtide.policy.outcomes import RetryPolicy, classify_exit
from lowtide.store.memory import MemoryStore
from lowtide.store.repo import Store

T0 = 1_790_000_000.0

step_st = st.fixed_dictionaries({"gpus": st.sampled_from([0, 1, 2, 4]), "ckpt": st.booleans()})
op_st = st.one_of(
    st.tuples(
        st.just("submit"),
        st.lists(step_st, min_size=1, max_size=3),
        st.booleans(),  # chain the steps
        st.sampled_from(["a", "b"]),
        st.integers(0, 1),  # retries
        st.sampled_from([5, 30]),  # grace
    ),
    st.tuples(st.just("start"), st.integers(0, 9)),
    st.tuples(st.just("exit"), st.integers(0, 9), st.sampled_from([0, 1, 143])),
    st.tuples(st.just("preempt"), st.integers(0, 9), st.sampled_from([2.0, 60.0])),
    st.tuples(st.just("notice")),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("checkpoint"), st.integers(0, 9), st.sampled_from(["c1", "c2"])),
    st.tuples(st.just("dag")),
    st.tuples(st.just("wait"), st.sampled_from([1.0, 7.0, 60.0])),
    st.tuples(st.just("replica"), st.integers(0, 2), st.sampled_from(["begin", "wake", "serve", "fail"])),
    st.tuples(st.just("reclaim"), st.integers(0, 3), st.sampled_from(["open", "notice", "done", "abandon"])),
)


class Pair:
    """The same call on both stores; the results (or the errors) must be equal."""

    def __init__(self, sql: Store, mem: MemoryStore) -> None:
        self.sql, self.mem = sql, mem

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        results = []
        for store in (self.sql, self.mem):
            try:
                results.append(("ok", getattr(store, name)(*args, **kwargs)))
            except Exception as exc:  # compared below: the same kind, the same words
                results.append(("error", (type(exc).__name__, str(exc))))
        assert results[0] == results[1], name
        kind, value = results[1]
        return value if kind == "ok" else None

    def same(self, read: Callable[[Any], Any]) -> Any:
        a, b = read(self.sql), read(self.mem)
        assert a == b
        return b


@pytest.fixture
def pair(tmp_path: Path) -> Pair:
    return Pair(Store.open(f"sqlite:///{tmp_path / 'agree.db'}"), MemoryStore())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op_st, max_size=30))
def test_sql_and_memory_stores_agree_call_by_call(pair: Pair, ops: list[tuple[Any, ...]]) -> None:
    mem = pair.mem
    clock = FakeClock(max(T0, max((j.submitted_at for j in mem.list_jobs(limit=1)), default=T0)) + 1)
    pair("ensure_gpus", NODES, clock.now())
    for op in ops:
        now = clock.now()
        kind = op[0]
        if kind == "submit":
            _, steps, chain, team, retries, grace = op
            job_id = f"job-{len(mem.list_jobs(limit=-1)):012d}"
            doc_steps = [
                {
                    "name": f"s{i}",
                    "command": ["run"],
                    "gpus": s["gpus"],
                    "checkpoint": s["ckpt"],
                    **({"depends": [f"s{i - 1}"]} if chain and i else {}),
                }
                for i, s in enumerate(steps)
            ]
            for store in (pair.sql, mem):
                submit(
                    store, clock, job_id, team=team, max_retries=retries, grace_seconds=grace, steps=doc_steps
                )
        elif kind == "start":
            queued = mem.snapshot(now=now, nodes=NODES, half_life_s=HALF_LIFE).queued
            if queued:
                q = queued[op[1] % len(queued)]
                idle: dict[str, list[int]] = {n.name: [] for n in NODES}
                for h in mem.holdings():
                    if h.holder_kind == "idle":
                        idle[h.node].append(h.index)
                # Where it fits, or (to see GpuBusy) n1's first GPUs, held or not.
                node = next((n for n, free in idle.items() if len(free) >= q.gpus), "n1")
                gpus = tuple(idle[node][: q.gpus]) if len(idle[node]) >= q.gpus else tuple(range(q.gpus))
                pair(
                    "begin_attempt",
                    job_id=q.job_id,
                    step=q.step,
                    node=node,
                    gpus=gpus,
                    layout=LAYOUT,
                    now=now,
                    reason="r",
                )
        elif kind in ("exit", "preempt", "checkpoint"):
            active = mem.active_attempts()
            if not active:
                continue
            att = active[op[1] % len(active)]
            if kind == "exit":
                ctx = pair("exit_context", att.id)
                decision = classify_exit(
                    step_state=ctx.step_state,
                    noticed=att.notice_at is not None,
                    exit_code=op[2],
                    signal=None,
                    killed_at_deadline=False,
                    retries_used=ctx.retries_used,
                    max_retries=ctx.max_retries,
                    now=now,
                    retry=RetryPolicy(5, 20),
                    preemptions=ctx.preemptions,
                    max_preemptions=ctx.max_preemptions,
                )
                pair(
                    "finish_attempt",
                    ctx,
                    decision,
                    ended_at=now,
                    exit_code=op[2],
                    signal=None,
                    killed_at_deadline=False,
                    half_life_s=HALF_LIFE,
                )
            elif kind == "preempt":
                pair("request_preemption", att.id, grace_s=op[2], reason="reclaimed", now=now)
            else:
                pair("record_checkpoint", att.id, label=op[2], progress=None, source="api", now=now)
        elif kind == "notice":
            for due in pair("notices_due"):
                pair(
                    "mark_stopping",
                    due.attempt_id,
                    deadline=now + due.grace_seconds,
                    reason="notice",
                    now=now,
                )
        elif kind == "cancel":
            jobs = mem.list_jobs(limit=-1)
            if jobs:
                pair("request_cancel", jobs[op[1] % len(jobs)].id, by="alice", now=now)
        elif kind == "dag":
            for view in pair("job_views"):
                pair("apply_dag", advance(view), now)
        elif kind == "wait":
            clock.advance(op[1])
        elif kind == "replica":
            _, slot, action = op
            rid = f"chat/{slot}"
            if action in ("begin", "wake"):
                pair(
                    "begin_replica",
                    replica_id=rid,
                    service="chat",
                    slot=slot,
                    port=9000 + slot,
                    node="n2",
                    gpus=(slot % 2,),
                    wake=action == "wake",
                    now=now,
                    reason=action,
                )
            else:
                target = ReplicaState.SERVING if action == "serve" else ReplicaState.FAILED
                for expected in (ReplicaState.STARTING, ReplicaState.WAKING, ReplicaState.SERVING):
                    pair("move_replica", rid, expected, target, now=now, message=action, failures=1)
        else:
            _, index, action = op
            if action == "open":
                pair(
                    "open_reclaim",
                    service="chat" if index % 2 else None,
                    replica_id=None,
                    reason="surge",
                    gpus=index,
                    victims=(index, index + 1),
                    detected_at=now - 1,
                    decided_at=now,
                )
            elif action == "notice":
                pair("update_reclaim", index + 1, notice_at=now)
            else:
                state = ReclaimState.DONE if action == "done" else ReclaimState.ABANDONED
                pair("update_reclaim", index + 1, freed_at=now, state=state)
        pair.same(lambda s: s.snapshot(now=clock.now(), nodes=NODES, half_life_s=HALF_LIFE))
        pair.same(lambda s: s.active_attempts())
        pair.same(lambda s: s.notices_due())
        pair.same(lambda s: s.job_views())

    for job in pair.same(lambda s: s.list_jobs(limit=-1)):
        pair.same(lambda s, job_id=job.id: s.job_detail(job_id))
        pair.same(
            lambda s, job_id=job.id: [s.step_attempts(job_id, st.name) for st in s.job_detail(job_id).steps]
        )
    pair.same(lambda s: s.holdings())
    pair.same(lambda s: s.counts())
    pair.same(lambda s: s.preemption_totals())
    pair.same(lambda s: s.replicas())
    pair.same(lambda s: s.service_events("chat"))
    pair.same(lambda s: s.reclaims())
    pair.same(lambda s: s.reclaims(state=ReclaimState.OPEN, limit=2))
    end = clock.now() + 1
    pair.same(lambda s: s.gpu_seconds_by_holder(T0, end))
    for group_by in ("job", "team", "day", "holder"):
        pair.same(lambda s, g=group_by: s.usage_report(T0, end, group_by=g, tz="Europe/Berlin"))
