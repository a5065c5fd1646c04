"""The Argo world of the cluster-mode tests: lowtide's real loop (`sim.harness.LoopHarness`) with
`ArgoExecutor` and the unmodified `kubernetes` client against the fake API server (`k8sfake`),
while `argo_sim` plays Argo's controller and the kubelet on the loop's fake clock.

Shared by `tests/integration/test_argo_executor.py`, `tests/integration/test_argo_end_job.py`
and the `fake` backend of the cluster tier (`tests/cluster`). `argo_world()` yields a `World`
(recovered, ready to tick) and closes its executor afterwards; `World.run` steps the simulated
cluster, then ticks the loop, until a condition holds. Must not: hold test assertions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from argo_sim import ArgoSim
from k8sfake import FakeCluster
from lowtide.adapters.argo.executor import ArgoExecutor
from lowtide.adapters.argo.workflow import ArgoSettings
from lowtide.control.clock import FakeClock
from lowtide.control.inference import ServiceSetup
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.services import LendingPolicy
from lowtide.domain.states import AttemptState
from lowtide.policy.outcomes import RetryPolicy
from lowtide.sim.harness import LoopHarness
from lowtide.sim.scripted import FakeMetrics
from lowtide.store.memory import MemoryStore
from lowtide.wiring import argo_workflows

NS = "lowtide"
ROOT = "s3://bucket/lowtide"
SETTINGS = ArgoSettings(artifact_root=ROOT, namespace=NS, default_image="registry.example/step:1")
LAYOUT = ArtifactLayout(ROOT, "/work")
T0 = 1_800_000_000.0
NODES = (Node("n1", (0, 1)), Node("n2", (0, 1)), Node("n3", (0, 1)))


@dataclass
class World:
    h: LoopHarness
    sim: ArgoSim
    cluster: FakeCluster
    store: MemoryStore

    def executor(self, **kw: Any) -> ArgoExecutor:
        return ArgoExecutor(self.cluster.api_client(), SETTINGS, argo_workflows(self.store, SETTINGS), **kw)

    def run(self, until: Callable[[], bool], limit: int = 300) -> None:
        """Step the simulated cluster, then tick the loop, until `until()` (at most `limit` times)."""
        for _ in range(limit):
            self.sim.step()
            self.h.tick()
            if until():
                return
        raise AssertionError(f"not reached after {limit} ticks: {self.h.store.job_detail(self.h.jobs[-1])}")

    def running(self, job: str, step: str) -> bool:
        """The step's latest attempt runs (its pod is Running), not merely booked."""
        attempts = [a for a in self.h.store.job_detail(job).attempts if a.step_name == step]
        return bool(attempts) and attempts[-1].state == AttemptState.RUNNING

    def job_state(self, job: str) -> str:
        return self.h.store.job_detail(job).job.state.value

    def workflow_creates(self) -> list[int]:
        return [r.code for r in self.cluster.requests if r.verb == "create" and r.resource == "workflows"]


def argo_world(
    services: tuple[ServiceSetup, ...] = (),
    lending: LendingPolicy | None = None,
    nodes: tuple[Node, ...] = NODES,
) -> Iterator[World]:
    """A recovered `World` on a fresh fake cluster and memory store (a generator: a fixture body)."""
    clock = FakeClock(T0)
    cluster = FakeCluster(clock=lambda: datetime.fromtimestamp(clock.now(), UTC))
    with cluster:
        store = MemoryStore()
        sim = ArgoSim(cluster, clock.now, NS)
        world = World(None, sim, cluster, store)  # type: ignore[arg-type]
        kw: dict[str, Any] = {}
        if services:
            kw = {"services": services, "lending": lending, "sources": {"chat": FakeMetrics()}}
        world.h = LoopHarness(
            nodes=nodes,
            layout=LAYOUT,
            clock=clock,
            store=store,
            executor=world.executor(),
            retry=RetryPolicy(5.0, 5.0),
            **kw,
        )
        world.h.recover()
        yield world
        world.h.executor.close()


def two_steps(train: dict[str, Any] | None = None) -> dict[str, Any]:
    """prep (1 GPU) → train (2 GPUs, checkpointing), grace 30 s."""
    return {
        "name": "sft",
        "grace_seconds": 30,
        "steps": [
            {"name": "prep", "command": ["prep"], "gpus": 1},
            {
                "name": "train",
                "command": ["train"],
                "gpus": 2,
                "depends": ["prep"],
                "checkpoint": True,
                **(train or {}),
            },
        ],
    }
