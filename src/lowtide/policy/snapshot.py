"""The immutable snapshot the scheduling policy decides on.

Built by `control.snapshot` from the store once per tick; consumed by `policy.scheduler.decide`.
Everything a decision needs is here, including the time (`now`), so that the same snapshot
always gives the same plan, in production, in tests and in the simulator.
Must not: hold references to sessions, executors or anything mutable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from lowtide.domain.gpus import GpuRef, Node
from lowtide.policy.lending import GpuShare
from lowtide.policy.memo import Last

#: The last nodes tuple `pool_gpus` counted, and its GPUs.
_last_pool: Last[tuple[tuple[Node, ...], int]] = Last()


def pool_gpus(nodes: tuple[Node, ...]) -> int:
    """Every GPU of the nodes: counted once per tuple of (frozen) nodes, which the loop hands
    every snapshot and the inference side unchanged (`policy.memo.Last`), not once per tick."""
    last = _last_pool.entry
    if last is not None and last[0] is nodes:
        return last[1]
    count = sum(n.gpu_count for n in nodes)
    _last_pool.entry = (nodes, count)
    return count


@dataclass(frozen=True, slots=True)
class RunningStep:
    """A step attempt that holds GPUs now."""

    attempt_id: int
    job_id: str
    step: str
    team: str
    priority: int
    node: str
    gpus: tuple[int, ...]
    started_at: float
    last_checkpoint_at: float | None = None
    min_runtime: float = 0.0
    restart_seconds: float = 60.0
    stopping: bool = False  # notice given (cancel, preemption, timeout): its GPUs come back soon
    owner: str = ""  # who submitted the job (per-user limits of CPU-only steps)


@dataclass(frozen=True, slots=True)
class QueuedStep:
    """A step that may be started as soon as the policy places it (state READY or PREEMPTED)."""

    job_id: str
    step: str
    team: str
    priority: int
    gpus: int
    submitted_at: float  # the job's submit time: FIFO order within a class
    step_index: int  # position in the job spec: a stable tie-break
    eligible_at: float = 0.0  # retry backoff: not before this time
    preempted: bool = False  # requeued after preemption: goes to the head of its priority class
    retry_note: str = ""  # e.g. "attempt 2 of 3", shown in the waiting reason during backoff
    owner: str = ""  # who submitted the job (per-user limits of CPU-only steps)
    gpu_memory_gib: float | None = None  # GiB each of its GPUs must have free (None: no need)

    @property
    def key(self) -> tuple[str, str]:
        return (self.job_id, self.step)


@dataclass(frozen=True, slots=True)
class Snapshot:
    now: float
    nodes: tuple[Node, ...]
    running: tuple[RunningStep, ...] = ()
    queued: tuple[QueuedStep, ...] = ()
    #: GPUs held by something other than a step attempt (an inference replica, a broken GPU).
    unavailable: frozenset[GpuRef] = frozenset()
    #: Per team: GPU-seconds used recently, already decayed to `now` (see policy.fairshare).
    team_usage: Mapping[str, float] = field(default_factory=dict)
    #: Lendable GPUs a sleeping replica still holds memory on, and the memory left there
    #: (`policy.lending.gpu_shares`); placement reads it (`policy.placement`). Read-only.
    gpu_shares: Mapping[GpuRef, GpuShare] = field(default_factory=dict)

    @property
    def total_gpus(self) -> int:
        """Every GPU of the nodes (`pool_gpus`)."""
        return pool_gpus(self.nodes)

    def with_inference(
        self, unavailable: frozenset[GpuRef], gpu_shares: Mapping[GpuRef, GpuShare]
    ) -> Snapshot:
        """This snapshot with the inference half's answer (`dataclasses.replace` without its
        per-call field walk: the loop does this every tick). Every field is passed on."""
        return Snapshot(
            self.now, self.nodes, self.running, self.queued, unavailable, self.team_usage, gpu_shares
        )

    def cpu_steps_running(self) -> tuple[dict[str, int], dict[str, int]]:
        """Running CPU-only steps (stopping ones too: their processes still run), counted per
        node and per owner: what `scheduler.max_cpu_steps_per_node` and `..._per_user` limit."""
        by_node: dict[str, int] = {}
        by_owner: dict[str, int] = {}
        for step in self.running:
            if not step.gpus:
                by_node[step.node] = by_node.get(step.node, 0) + 1
                by_owner[step.owner] = by_owner.get(step.owner, 0) + 1
        return by_node, by_owner
