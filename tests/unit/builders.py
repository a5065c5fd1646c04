"""Builders for policy tests: snapshots, queued and running steps, and readable views of a plan.

Tests read as stories: ``snapshot(nodes={"n1": 8, "n2": 4}, running=[running("n2", [0, 1])],
queued=[queued("job-a", gpus=4)])``. Every default is boring on purpose (one team, priority 0,
submitted at 0, started at ``NOW`` so running steps carry no usage history) so that a test only
spells out what its story is about.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

from lowtide.domain.gpus import GpuRef, Node
from lowtide.policy.fairshare import FairSharePolicy
from lowtide.policy.plan import SchedulePlan
from lowtide.policy.scheduler import SchedulerPolicy
from lowtide.policy.snapshot import QueuedStep, RunningStep, Snapshot

NOW = 100_000.0

_attempt_ids = itertools.count(1)


def snapshot(
    *,
    nodes: Mapping[str, int] | None = None,
    running: Iterable[RunningStep] = (),
    queued: Iterable[QueuedStep] = (),
    unavailable: Iterable[str] = (),
    team_usage: Mapping[str, float] | None = None,
    now: float = NOW,
) -> Snapshot:
    """`nodes`: name → GPU count (indices 0..n-1); `unavailable`: "node:index" strings."""
    node_sizes = {"n1": 8} if nodes is None else nodes
    return Snapshot(
        now=now,
        nodes=tuple(Node(name, tuple(range(count))) for name, count in node_sizes.items()),
        running=tuple(running),
        queued=tuple(queued),
        unavailable=frozenset(gpu(ref) for ref in unavailable),
        team_usage=dict(team_usage or {}),
    )


def gpu(ref: str) -> GpuRef:
    """Parse "n1:3" into GpuRef("n1", 3)."""
    node, index = ref.rsplit(":", 1)
    return GpuRef(node, int(index))


def queued(
    job_id: str = "job-1",
    step: str = "train",
    *,
    team: str = "nlp",
    priority: int = 0,
    gpus: int = 1,
    submitted_at: float = 0.0,
    index: int = 0,
    eligible_at: float = 0.0,
    preempted: bool = False,
    retry_note: str = "",
    owner: str = "",
    gpu_memory_gib: float | None = None,
) -> QueuedStep:
    return QueuedStep(
        job_id=job_id,
        step=step,
        team=team,
        priority=priority,
        gpus=gpus,
        submitted_at=submitted_at,
        step_index=index,
        eligible_at=eligible_at,
        preempted=preempted,
        retry_note=retry_note,
        owner=owner,
        gpu_memory_gib=gpu_memory_gib,
    )


def running(
    node: str,
    gpus: Sequence[int],
    *,
    job_id: str = "running-1",
    step: str = "train",
    team: str = "nlp",
    priority: int = 0,
    started_at: float = NOW,
    attempt_id: int | None = None,
    owner: str = "",
) -> RunningStep:
    return RunningStep(
        attempt_id=next(_attempt_ids) if attempt_id is None else attempt_id,
        job_id=job_id,
        step=step,
        team=team,
        priority=priority,
        node=node,
        gpus=tuple(gpus),
        started_at=started_at,
        owner=owner,
    )


def policy(
    *,
    max_reservations: int = 1,
    weights: Mapping[str, float] | None = None,
    half_life_s: float = 6 * 3600.0,
) -> SchedulerPolicy:
    return SchedulerPolicy(
        fair_share=FairSharePolicy(half_life_s=half_life_s, team_weights=dict(weights or {})),
        max_reservations=max_reservations,
    )


# --- views of a plan ------------------------------------------------------------------------------


def started(plan: SchedulePlan) -> list[str]:
    """Started steps as "job/step", in the order decide() placed them."""
    return [f"{s.job_id}/{s.step}" for s in plan.starts]


def placements(plan: SchedulePlan) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Started steps as "job/step" -> (node, GPU indices)."""
    return {f"{s.job_id}/{s.step}": (s.node, s.gpus) for s in plan.starts}


def start_reasons(plan: SchedulePlan) -> dict[str, str]:
    return {f"{s.job_id}/{s.step}": s.reason for s in plan.starts}


def waiting_reasons(plan: SchedulePlan) -> dict[str, str]:
    """Every step that stays queued, as "job/step" -> reason."""
    return {f"{w.job_id}/{w.step}": w.reason for w in plan.waiting}
