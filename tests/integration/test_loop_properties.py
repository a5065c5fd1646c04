"""The real control loop, a real SQLite store, a fake clock and a fake executor, driven by random
sequences of submissions, exits, cancellations and control-plane restarts. After every tick the
invariants of the system must hold."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowtide.control.clock import FakeClock
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.states import ACTIVE_STEP_STATES, TERMINAL_STEP_STATES, JobState, StepState
from lowtide.policy.fairshare import FairSharePolicy
from lowtide.policy.outcomes import RetryPolicy
from lowtide.policy.scheduler import SchedulerPolicy
from lowtide.sim.harness import LoopHarness
from lowtide.sim.scripted import FakeExecutor
from lowtide.store.repo import Store
from lowtide.store.schema import attempts, gpu_ledger, jobs, steps

NODES = (Node("n1", (0, 1, 2, 3)), Node("n2", (0, 1)))
LAYOUT = ArtifactLayout("/art", "/work")
T0 = 1_800_000_000.0

step_st = st.fixed_dictionaries(
    {"gpus": st.sampled_from([0, 1, 2, 4]), "code": st.sampled_from([0, 0, 0, 1])}
)
job_st = st.fixed_dictionaries(
    {
        "steps": st.lists(step_st, min_size=1, max_size=3),
        "retries": st.integers(0, 1),
        "team": st.sampled_from(["a", "b"]),
        "priority": st.sampled_from(["low", "normal", "high"]),
        "grace": st.sampled_from([0, 5, 30]),
    }
)
op_st = st.one_of(
    st.tuples(st.just("submit"), job_st),
    st.tuples(st.just("exit"), st.integers(0, 50), st.sampled_from([0, 0, 1, 143])),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("wait"), st.sampled_from([1.0, 10.0, 40.0])),
    st.tuples(st.just("restart")),
)


class World:
    """A random history on the loop harness, with the invariants it must keep."""

    nodes = NODES

    def __init__(self, root: Path) -> None:
        self.store = Store.open(f"sqlite:///{root / 'db.sqlite'}")
        self.executor = FakeExecutor()
        self.h = LoopHarness(
            nodes=self.nodes,
            layout=LAYOUT,
            clock=FakeClock(T0),
            store=self.store,
            executor=self.executor,
            scheduler=SchedulerPolicy(FairSharePolicy(half_life_s=600)),
            retry=RetryPolicy(5, 20),
            **self.inference_side(),
        )
        self.clock = self.h.clock
        self.jobs = self.h.jobs
        self.h.recover()

    def inference_side(self) -> dict[str, Any]:
        """The harness's inference arguments (none: the loop runs without an inference side)."""
        return {}

    def submit(self, j: dict[str, Any]) -> None:
        doc = {
            "name": "j",
            "team": j["team"],
            "priority": j["priority"],
            "grace_seconds": j["grace"],
            "max_retries": j["retries"],
            "steps": [
                {
                    "name": f"s{i}",
                    "command": ["x"],
                    "gpus": s["gpus"],
                    **({"depends": [f"s{i - 1}"]} if i else {}),
                }
                for i, s in enumerate(j["steps"])
            ],
        }
        self.h.submit(doc)  # GPUs per step are limited to the largest node's 4

    def apply(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "submit":
            self.submit(op[1])
        elif kind == "exit" and self.executor.running:
            ids = sorted(self.executor.running)
            self.executor.finish(ids[op[1] % len(ids)], op[2])
        elif kind == "cancel" and self.jobs:
            self.store.request_cancel(self.jobs[op[1] % len(self.jobs)], by="u", now=self.clock.now())
        elif kind == "wait":
            self.clock.advance(op[1])
        elif kind == "restart":
            self.h.restart()  # a new control-plane process on the same store
        self.h.tick(dt=0.5)  # fails on a tick that reports errors

    def check(self) -> None:
        with self.store.engine.connect() as conn:
            open_rows = conn.execute(sa.select(gpu_ledger).where(gpu_ledger.c.ended_at.is_(None))).all()
            active = conn.execute(
                sa.select(attempts).where(attempts.c.state.in_(["RUNNING", "STOPPING"]))
            ).all()
            step_rows = conn.execute(sa.select(steps)).all()
            job_rows = {r.id: r for r in conn.execute(sa.select(jobs)).all()}
            all_rows = conn.execute(sa.select(gpu_ledger)).all()
        # Each GPU has exactly one holder at a time.
        keys = [(r.node, r.gpu_index) for r in open_rows]
        assert sorted(keys) == sorted((n.name, i) for n in NODES for i in n.gpus)
        # Each active attempt holds exactly its GPUs, and the executor runs it.
        held = {(r.node, r.gpu_index): r.holder_id for r in open_rows if r.holder_kind == "attempt"}
        for a in active:
            assert a.id in self.executor.running
            for g in a.gpus:
                assert held[(a.node, g)] == str(a.id)
        assert len(held) == sum(len(a.gpus) for a in active)
        assert set(self.executor.running) == {a.id for a in active}
        # A step holds an attempt exactly when it is active.
        active_steps = {a.step_id for a in active}
        for s in step_rows:
            assert (s.id in active_steps) == (StepState(s.state) in ACTIVE_STEP_STATES), (s.name, s.state)
        # The ledger adds up: capacity × time.
        now = self.clock.now()
        total = sum((r.ended_at if r.ended_at is not None else now) - r.started_at for r in all_rows)
        assert abs(total - 6 * (now - T0)) < 1e-6 * max(1.0, total)
        # A finished job has only finished steps (a cancelled one may still be stopping some).
        for s in step_rows:
            job_state = JobState(job_rows[s.job_id].state)
            if job_state in (JobState.SUCCEEDED, JobState.FAILED):
                assert StepState(s.state) in TERMINAL_STEP_STATES

    def drain(self) -> None:
        """Let everything run to the end: every job must finish."""
        for _ in range(400):
            for attempt_id in list(self.executor.running):
                self.executor.finish(attempt_id, 0)
            self.h.tick(dt=30, check=False)
            self.check()
            if (
                all(self.store.job(j).state.value in ("SUCCEEDED", "FAILED", "CANCELLED") for j in self.jobs)
                and not self.executor.running
            ):
                return
        raise AssertionError("jobs did not finish")


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(op_st, min_size=1, max_size=30))
def test_invariants_hold_through_random_histories(ops: list[tuple[Any, ...]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        world = World(Path(tmp))
        try:
            for op in ops:
                world.apply(op)
                world.check()
            world.drain()
        finally:
            world.store.close()


def test_a_cancelled_step_gets_notice_then_is_killed_at_its_deadline(tmp_path: Path) -> None:
    world = World(tmp_path)
    world.submit(
        {"steps": [{"gpus": 2, "code": 0}], "retries": 0, "team": "a", "priority": "normal", "grace": 30}
    )
    world.apply(("wait", 1.0))
    (attempt_id,) = world.executor.running
    world.store.request_cancel(world.jobs[0], by="u", now=world.clock.now())
    world.apply(("wait", 1.0))
    assert [a for a, _ in world.executor.notices] == [attempt_id]
    assert world.store.attempt(attempt_id).state.value == "STOPPING"
    world.apply(("wait", 20.0))
    assert attempt_id in world.executor.running  # within its grace
    world.apply(("wait", 20.0))
    att = world.store.attempt(attempt_id)
    assert (att.state.value, att.killed_at_deadline) == ("INTERRUPTED", True)
    assert att.ended_at is not None and att.stop_deadline is not None and att.ended_at >= att.stop_deadline
    world.check()
    world.store.close()


def test_backoff_is_respected_on_the_fake_clock(tmp_path: Path) -> None:
    world = World(tmp_path)
    world.submit(
        {"steps": [{"gpus": 1, "code": 1}], "retries": 2, "team": "a", "priority": "normal", "grace": 0}
    )
    world.apply(("wait", 0.0))
    first = next(iter(world.executor.running))
    world.executor.finish(first, 1)
    world.apply(("wait", 0.0))
    failed_at = world.clock.now()
    assert not world.executor.running
    world.apply(("wait", 3.0))  # backoff is 5 s: not yet
    assert not world.executor.running
    reason = world.store.job_detail(world.jobs[0]).steps[0].reason
    assert reason.startswith("retry backoff: eligible in"), reason
    world.apply(("wait", 3.0))
    assert len(world.executor.running) == 1
    assert world.clock.now() - failed_at >= 5.0
    world.store.close()


# -- with the inference side: load changes, reclaims, restarts ------------------------------------

from lowtide.control.inference import ServiceSetup  # noqa: E402
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec  # noqa: E402
from lowtide.sim.scripted import FakeMetrics, FakeServiceManager  # noqa: E402
from lowtide.store.schema import replicas as replica_table  # noqa: E402

INF_NODES = (Node("n1", (0, 1, 2, 3)), Node("n2", (0, 1, 2, 3)))
GRACE = 20.0
UNPARK = 5.0
CHAT = ServiceSpec(
    name="chat",
    model="m",
    gpus_per_replica=2,
    min_replicas=1,
    max_replicas=3,
    park="sleep",
    startup_s=UNPARK,
    wake_s=UNPARK,
    autoscale=AutoscaleTargets(
        concurrency_per_replica=4,
        kv_usage=None,
        scale_up_window_s=2,
        scale_down_stabilization_s=10,
        tolerance=0,
    ),
)

inf_op_st = st.one_of(
    st.tuples(st.just("submit"), job_st),
    st.tuples(st.just("exit"), st.integers(0, 50), st.sampled_from([0, 0, 1, 143])),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("wait"), st.sampled_from([1.0, 5.0, 30.0])),
    st.tuples(st.just("load"), st.sampled_from([0.0, 2.0, 6.0, 12.0, 20.0])),
    st.tuples(st.just("restart")),
)


class InferenceWorld(World):
    nodes = INF_NODES

    def __init__(self, root: Path) -> None:
        self.manager = FakeServiceManager()
        self.metrics = FakeMetrics()
        self.below_min_since: float | None = None
        super().__init__(root)

    def inference_side(self) -> dict[str, Any]:
        return {
            "services": (ServiceSetup(spec=CHAT, command=("serve",), base_port=9000, reclaim_grace_s=GRACE),),
            "lending": LendingPolicy(
                reclaim_lead_s=1 + GRACE + UNPARK, stale_after_s=30, stale_reclaim_after_s=120
            ),
            "manager": self.manager,
            "sources": {"chat": self.metrics},
        }

    def apply(self, op: tuple[Any, ...]) -> None:
        if op[0] == "load":
            self.metrics.concurrency = op[1]
            op = ("wait", 0.0)
        super().apply(op)

    def check(self) -> None:
        with self.store.engine.connect() as conn:
            open_rows = conn.execute(sa.select(gpu_ledger).where(gpu_ledger.c.ended_at.is_(None))).all()
            all_rows = conn.execute(sa.select(gpu_ledger)).all()
            ended = conn.execute(sa.select(attempts).where(attempts.c.state.in_(["INTERRUPTED"]))).all()
            killed = conn.execute(sa.select(attempts).where(attempts.c.killed_at_deadline.is_(True))).all()
            reps = conn.execute(sa.select(replica_table)).all()
        # A GPU never has two holders: one open ledger row per GPU, and nothing else.
        keys = sorted((r.node, r.gpu_index) for r in open_rows)
        assert keys == sorted((n.name, i) for n in INF_NODES for i in n.gpus)
        # Replicas that hold GPUs hold exactly theirs in the ledger.
        held = {(r.node, r.gpu_index): (r.holder_kind, r.holder_id) for r in open_rows}
        for r in reps:
            if r.state in ("STARTING", "SERVING", "DRAINING", "PARKING", "WAKING"):
                for g in r.gpus:
                    assert held[(r.node, g)] == ("replica", r.id), (r.id, r.state, held[(r.node, g)])
        # No step is stopped without notice.
        for a in ended:
            assert a.notice_at is not None and a.notice_at <= a.ended_at, a.id
        for a in killed:
            assert a.notice_at is not None and a.stop_deadline is not None and a.ended_at >= a.stop_deadline
        # The ledger adds up.
        now = self.clock.now()
        total = sum((r.ended_at if r.ended_at is not None else now) - r.started_at for r in all_rows)
        assert abs(total - 8 * (now - T0)) < 1e-6 * max(1.0, total)
        # The service is never below min_replicas for longer than a grace plus an unpark.
        serving = sum(r.state == "SERVING" for r in reps)
        if serving >= CHAT.min_replicas:
            self.below_min_since = None
        elif self.below_min_since is None:
            self.below_min_since = now
        else:
            assert now - self.below_min_since <= GRACE + UNPARK + 2.0, (now - self.below_min_since, reps)


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(inf_op_st, min_size=1, max_size=30))
def test_invariants_hold_with_inference_load_and_reclaims(ops: list[tuple[Any, ...]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        world = InferenceWorld(Path(tmp))
        try:
            for op in ops:
                world.apply(op)
                world.check()
            world.metrics.concurrency = 0.0
            world.drain()
        finally:
            world.store.close()
