"""The Argo world of the cluster-mode tests: lowtide's real loop (`sim.harness.LoopHarness`) with
`ArgoExecutor` and the unmodified `kubernetes` client against the fake API server (`k8sfake`),
while `argo_sim` plays Argo's controller and the kubelet on the loop's fake clock.

Shared by `tests/integration/test_argo_executor.py`, `tests/integration/test_argo_end_job.py`
and the `fake` backend of the cluster tier (`tests/cluster`). `argo_world()` yields a `World`
(recovered, ready to tick) and closes its executor afterwards; `World.run` steps the simulated
cluster, then ticks the loop, until a condition holds.

The executor reads pods from a watch cache, which sees a write a few milliseconds after it: after
each simulated step (and after a test's own pod writes) `settle` waits, bounded, until the cache
has seen the last pod write in the namespace (its resourceVersion), as a real control loop's next
poll a second later would. `ArgoSim.settle` does it at the end of each step; a test that breaks
the watch on purpose turns it off (`World.settling`). Must not: hold test assertions beyond
"the cache caught up".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from argo_sim import ArgoSim
from k8sfake import FakeCluster
from lowtide.adapters.argo.executor import ArgoExecutor
from lowtide.adapters.argo.workflow import ArgoSettings
from lowtide.control.clock import FakeClock
from lowtide.control.inference import ServiceSetup
from lowtide.deploy.manifests import Release
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
#: A bound, not a duration: a cache is caught up within milliseconds.
SETTLE_S = 10.0
#: Test executors back off 0.05-0.5 s between watch attempts (client-go: 0.8-30 s).
WATCH_BACKOFF = (0.05, 0.5)
NODES = (Node("n1", (0, 1)), Node("n2", (0, 1)), Node("n3", (0, 1)))
#: The chart's release, and the control plane's ServiceAccount as the RBAC tests log in with it
#: (`cluster.add_user(SA_TOKEN, SA)` after loading the chart's RBAC).
RELEASE = Release("lowtide", "lowtide-system")
SA = f"system:serviceaccount:{RELEASE.namespace}:{RELEASE.name}"
SA_TOKEN = "chart-sa-token"


def node_object(
    name: str,
    gpus: int,
    *,
    labels: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
    allocatable: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Ready Node named `name` with `gpus` allocatable `nvidia.com/gpu` (plus the given labels,
    taints and other allocatable resources), as the kubelet reports it."""
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "spec": {"taints": taints} if taints else {},
        "status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
            "allocatable": {"nvidia.com/gpu": str(gpus), **(allocatable or {})},
        },
    }


@dataclass
class World:
    h: LoopHarness
    sim: ArgoSim
    cluster: FakeCluster
    store: MemoryStore
    #: Whether `ArgoSim.step` waits for the executor's pod cache (off while a test breaks it).
    settling: bool = field(default=True, kw_only=True)
    #: Every executor `executor()` made: closed with the world (a replaced one's watch thread too).
    made: list[ArgoExecutor] = field(default_factory=list, kw_only=True)

    def executor(self, **kw: Any) -> ArgoExecutor:
        kw.setdefault("watch_backoff_s", WATCH_BACKOFF)
        made = ArgoExecutor(self.cluster.api_client(), SETTINGS, argo_workflows(self.store, SETTINGS), **kw)
        self.made.append(made)
        return made

    def settle(self) -> None:
        if self.settling:
            settle(self.cluster, self.h.executor)

    def run(self, until: Callable[[], bool], limit: int = 300) -> None:
        drive(self.sim, self.h, until, limit)

    def running(self, job: str, step: str) -> bool:
        """The step's latest attempt runs (its pod is Running), not merely booked."""
        attempts = [a for a in self.h.store.job_detail(job).attempts if a.step_name == step]
        return bool(attempts) and attempts[-1].state == AttemptState.RUNNING

    def job_state(self, job: str) -> str:
        return self.h.store.job_detail(job).job.state.value

    def workflow_creates(self) -> list[int]:
        return [r.code for r in self.cluster.requests if r.verb == "create" and r.resource == "workflows"]


def drive(sim: ArgoSim, h: LoopHarness, until: Callable[[], bool], limit: int = 300) -> None:
    """Step the simulated cluster, then tick the loop, until `until()` (at most `limit` times);
    the failure names the last attempts of every job."""
    for _ in range(limit):
        sim.step()
        h.tick()
        if until():
            return
    said = [(a.state.value, a.exit_detail) for job in h.jobs for a in h.store.job_detail(job).attempts[-3:]]
    raise AssertionError(f"not reached after {limit} ticks: {said}")


def settle(cluster: FakeCluster, executor: Any, namespace: str = NS) -> None:
    """Wait until `executor`'s pod cache has seen the last pod write in `namespace` (only while
    the fake is listening: a cache cannot catch up with a server that is away)."""
    if cluster.listening and isinstance(executor, ArgoExecutor):
        last = cluster.last_write("pods", namespace)
        assert executor.caught_up(last, SETTLE_S), "the executor's pod cache did not catch up"


def settling(sim: ArgoSim, executor: Callable[[], Any]) -> None:
    """Make each `sim.step()` end with `settle` on the executor `executor()` returns then."""
    sim.settle = lambda: settle(sim.cluster, executor(), sim.namespace)


def argo_world(
    services: tuple[ServiceSetup, ...] = (),
    lending: LendingPolicy | None = None,
    nodes: tuple[Node, ...] = NODES,
) -> Iterator[World]:
    """A recovered `World` on a fresh fake cluster and memory store (a generator: a fixture body)."""
    clock = FakeClock(T0)
    # Bookmarks every 50 ms: a write the cache's selector does not match shows in its version soon.
    cluster = FakeCluster(clock=lambda: datetime.fromtimestamp(clock.now(), UTC), bookmark_interval=0.05)
    with cluster:
        store = MemoryStore()
        sim = ArgoSim(cluster, clock.now, NS)
        world = World(None, sim, cluster, store)  # type: ignore[arg-type]
        sim.settle = world.settle
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
        for made in world.made:
            made.close()  # closing twice is harmless


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
