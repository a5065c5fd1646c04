"""decide(): which queued steps start now, on which GPUs, and why the others wait.

Role: the scheduling policy of the control loop (docs/architecture.md §4.1, "decide"). It reads one immutable
`Snapshot` and returns a `SchedulePlan`; the actuator applies it. Neighbours: `policy.snapshot`
(input), `policy.plan` (output), `policy.fairshare` (team order), `policy.placement` (which
GPUs). Must not: do I/O, read the clock, sleep, draw random numbers or mutate the snapshot; the
same snapshot always gives the same plan.

Queue order
    Steps whose `eligible_at` is still in the future (retry backoff) are not considered. The
    others go by priority class, higher first. Within a class, steps requeued after preemption
    come first (among themselves in the same order as below); then teams by dominant share
    ascending (`policy.fairshare`), and within a team by submit time, job id and step index.
    Equal shares go by the teams' first steps, in that same order. The share is recomputed as
    this decision places steps: once team A gets GPUs its share rises, so two teams with equal
    claims interleave rather than one taking everything. Implemented as per-class, per-team
    FIFO queues and a heap of teams keyed by share: O(n log n) in the number of queued steps.

Placement
    A step with no GPUs (CPU-only) starts on the first node by name that runs fewer than
    `max_cpu_steps_per_node` CPU-only steps, if its owner runs fewer than
    `max_cpu_steps_per_user`; otherwise it waits, with the limit as its reason (None: no limit).
    Running CPU-only steps are counted from the snapshot (`Snapshot.cpu_steps_running`, stopping
    ones included: their processes still run) plus those this decision starts. A GPU step goes on
    one node, chosen best fit among the nodes not reserved in this decision (`policy.placement`).
    A step that declares `gpu_memory_gib` goes only on GPUs with that much memory left (a GPU under
    a sleeping replica has its node's memory − the replica's residual: `Snapshot.gpu_shares`); its
    reservation, too, counts only such GPUs, and its waiting reason says when memory holds it back.

Team quotas (nominal, borrowing only idle GPUs)
    `team_quotas` gives some teams a nominal number of GPUs (teams without one have no limit).
    A GPU step whose team would then hold more than its quota (GPUs its running steps hold, plus
    those this decision gives it, plus the step's) *borrows*: it is set aside in the first pass,
    which places every other step in queue order (priority, fair share, reservations, backfill);
    a second pass then places the borrowing steps, in queue order among themselves (fair share
    still interleaves borrowing teams), on the GPUs left, never on a reserved node and without
    reserving one. So a borrowing step only ever gets GPUs that no waiting step of a team within
    its quota could use now: such a step would have been placed in the first pass (free GPUs only
    shrink within a decision), or holds its node as a reservation. Quotas come before priority
    and fair share: a high-priority step of a team beyond its quota waits behind a low-priority
    step of a team within its quota. The model is Kueue's (API kueue.x-k8s.io/v1beta2: a
    ClusterQueue's `nominalQuota`, and the queues of a cohort borrow "the unused nominal quota
    of all the cluster queues in a cohort"; Red Hat build of Kueue docs, "Using cohorts",
    OpenShift 4.21), reduced to one cohort of all teams and no `borrowingLimit`.
    What is not done: reclaiming borrowed GPUs for a team back under its quota (Kueue's
    preemption within the cohort); that team waits until the borrowed GPUs free up.

Reservations and backfill
    When a GPU step cannot be placed and fewer than `max_reservations` reservations exist, it
    becomes a reserved head: among the non-reserved nodes able to hold it at all (GPUs minus
    unavailable ≥ its need) it reserves the one with the most free GPUs (ties: name). From then
    on no later step in this decision takes a GPU on that node. Later steps that fit elsewhere
    start anyway: that is backfill.

    What is guaranteed: within a decision, nothing ordered after a reserved head takes a GPU on
    its node, so the GPUs free there, and on later ticks the GPUs that free up there, are held
    for the head for as long as it stays first among the blocked steps. As holders finish, its
    node only gains free GPUs (unless inference takes some back), so the next tick picks it
    again unless another node has become closer to fitting the head; the reservation then
    moves there, which only helps the head.
    What is not: when the head starts. No runtime estimates exist, so lowtide cannot know when
    the node's current holders finish, and it does not bound it; backfilled steps cannot delay
    the head because they never hold its node's GPUs, but they may well run longer than it
    waits. A head that no node could ever hold (too many GPUs, or too many unavailable)
    reserves nothing and says so. A step that arrives later at a higher priority, or of a team
    whose share drops below the head's team, moves ahead of it and takes the reservation over.

Reasons
    Every queued step ends up in exactly one of `starts` or `waiting`, with a reason shown to
    researchers. Reasons depend only on the situation, never on timing, so the same situation
    gives the same string.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter

from lowtide.policy import placement
from lowtide.policy.fairshare import FairSharePolicy, TeamShares
from lowtide.policy.placement import FreeGpus
from lowtide.policy.plan import Reservation, SchedulePlan, StartStep, Waiting
from lowtide.policy.snapshot import QueuedStep, Snapshot


@dataclass(frozen=True)
class SchedulerPolicy:
    fair_share: FairSharePolicy = field(default_factory=FairSharePolicy)
    #: How many blocked heads may each hold a node back from backfill (0: pure greedy backfill).
    max_reservations: int = 1
    #: CPU-only steps (`gpus: 0`) running at once on one node (None: no limit).
    max_cpu_steps_per_node: int | None = None
    #: CPU-only steps running at once per user, the jobs' owner (None: no limit).
    max_cpu_steps_per_user: int | None = None
    #: Nominal GPUs per team; beyond it a team only borrows idle GPUs (a team not named: no quota).
    team_quotas: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_reservations < 0:
            raise ValueError(f"max_reservations must be ≥ 0, got {self.max_reservations}")
        for name in ("max_cpu_steps_per_node", "max_cpu_steps_per_user"):
            limit = getattr(self, name)
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be ≥ 1 (or None: no limit), got {limit}")
        for team, quota in self.team_quotas.items():
            if quota < 0:
                raise ValueError(f"the quota of team {team!r} must be ≥ 0, got {quota}")


def decide(snapshot: Snapshot, policy: SchedulerPolicy) -> SchedulePlan:
    """The plan for this tick: starts, waiting steps with reasons, reservations."""
    return _Decision(snapshot, policy).run()


# --- queue order ---------------------------------------------------------------------------------

_FifoKey = tuple[float, str, int, str]


#: (submitted_at, job_id, step_index, step) of a step: built in C, once per queued step per tick.
_fifo_key: Callable[[QueuedStep], _FifoKey] = attrgetter("submitted_at", "job_id", "step_index", "step")


def in_queue_order(steps: Iterable[QueuedStep], shares: TeamShares) -> Iterator[QueuedStep]:
    """Yield startable steps in queue order, reading team shares lazily.

    The share of a team is read when its next step is pushed onto the heap, which happens after
    the caller has handled the step just yielded: so GPUs the caller gives a team (through
    `shares.add_held`) already count against that team's next step. Only the team just served
    can have changed, so the other heap entries stay valid.
    """
    # Each queue holds (fifo key, step), earliest last so that pop() takes it; keys are built
    # once per step rather than on every heap push.
    classes: dict[tuple[int, bool], dict[str, list[tuple[_FifoKey, QueuedStep]]]] = {}
    for step in steps:
        class_key = (-step.priority, not step.preempted)  # sorts higher priority, then preempted first
        classes.setdefault(class_key, {}).setdefault(step.team, []).append((_fifo_key(step), step))
    for class_key in sorted(classes):
        by_team = classes[class_key]
        if len(by_team) == 1:  # one team: shares cannot reorder anything, so no heap (same order)
            (queue,) = by_team.values()
            queue.sort(key=_first)
            for entry in queue:
                yield entry[1]
            continue
        heap: list[tuple[float, _FifoKey, str]] = []
        for team, queue in by_team.items():
            queue.sort(key=_first, reverse=True)
            heap.append((shares.share(team), queue[-1][0], team))
        heapq.heapify(heap)
        while heap:
            team = heap[0][2]
            queue = by_team[team]
            yield queue.pop()[1]
            if queue:
                heapq.heapreplace(heap, (shares.share(team), queue[-1][0], team))
            else:
                heapq.heappop(heap)


def _first(entry: tuple[_FifoKey, QueuedStep]) -> _FifoKey:
    return entry[0]


# --- one decision --------------------------------------------------------------------------------


class _Decision:
    """The working state of one `decide` call; thrown away with it."""

    def __init__(self, snapshot: Snapshot, policy: SchedulerPolicy) -> None:
        self._snapshot = snapshot
        self._max_reservations = policy.max_reservations
        self._max_cpu_per_node = policy.max_cpu_steps_per_node
        self._max_cpu_per_user = policy.max_cpu_steps_per_user
        self._quotas = policy.team_quotas
        self._cpu_node_pos = 0  # nodes before it are at their CPU-only limit (counts only grow)
        self._cpu_full_reason: str | None = None  # why CPU-only steps wait once every node is full
        self._fair_share = policy.fair_share
        self._starts: list[StartStep] = []
        self._waiting: list[Waiting] = []
        self._reservations: list[Reservation] = []
        self._reserved_nodes: set[str] = set()
        # Waiting reasons by (GPU count, GiB per GPU): most queued steps wait for the same few
        # reasons, and a reason only changes when a take or a reservation changes the free GPUs.
        self._blocked_reasons: dict[tuple[int, float | None], str] = {}
        # (team, GPUs, GiB per GPU): same lifetime
        self._borrow_reasons: dict[tuple[str, int, float | None], str] = {}
        self._backfill_note = ""
        # Free GPUs only shrink during a decision, so a need that failed once fails again: with no
        # memory need (which also fails any step needing memory), and per GiB per GPU declared.
        self._smallest_unplaceable = math.inf
        self._smallest_unplaceable_gib: dict[float, int] = {}
        # Per GiB per GPU (None: no memory need): the smallest GPU count no node could be
        # reserved for (see `_consider`).
        self._smallest_unreservable: dict[float | None, int] = {}

    # What follows is built on first use: a tick with no step ready to start (the queue empty,
    # or every step backing off) needs none of it, and it costs O(running steps) or O(nodes).

    @cached_property
    def _cpu_nodes(self) -> list[str]:
        return sorted(node.name for node in self._snapshot.nodes)

    @cached_property
    def _cpu_node(self) -> str | None:
        return min((node.name for node in self._snapshot.nodes), default=None)

    @cached_property
    def _largest_node(self) -> int:
        return max((node.gpu_count for node in self._snapshot.nodes), default=0)

    @cached_property
    def _node_size(self) -> dict[str, int]:
        return {node.name: node.gpu_count for node in self._snapshot.nodes}

    @cached_property
    def _cpu_running(self) -> tuple[dict[str, int], dict[str, int]]:
        return self._snapshot.cpu_steps_running()  # counted up as CPU-only steps start

    @property
    def _cpu_by_node(self) -> dict[str, int]:
        return self._cpu_running[0]

    @property
    def _cpu_by_owner(self) -> dict[str, int]:
        return self._cpu_running[1]

    @cached_property
    def _free(self) -> FreeGpus:
        return FreeGpus.from_snapshot(self._snapshot)

    @cached_property
    def _shares(self) -> TeamShares:
        return TeamShares.from_snapshot(self._snapshot, self._fair_share)

    def run(self) -> SchedulePlan:
        now = self._snapshot.now
        ready = [step for step in self._snapshot.queued if step.eligible_at <= now]
        backing_off = [step for step in self._snapshot.queued if step.eligible_at > now]
        borrowing: list[QueuedStep] = []
        if ready:
            for step in in_queue_order(ready, self._shares):
                if self._quotas and self._borrows(step):
                    borrowing.append(step)
                else:
                    self._consider(step)
        if borrowing:
            for step in in_queue_order(borrowing, self._shares):
                self._consider_borrowing(step)
        for step in sorted(backing_off, key=lambda s: (s.eligible_at, _fifo_key(s))):
            self._waiting.append(Waiting(step.job_id, step.step, backoff_reason(step, now)))
        return SchedulePlan(
            starts=tuple(self._starts),
            waiting=tuple(self._waiting),
            reservations=tuple(self._reservations),
        )

    def _consider(self, step: QueuedStep) -> None:
        need = step.gpus
        if need <= 0:
            self._start_cpu_step(step)
            return
        gib = step.gpu_memory_gib
        node = self._place(need, gib)
        if node is not None:
            self._start_on(step, node)
            return
        if len(self._reservations) < self._max_reservations and need < self._smallest_unreservable.get(
            gib, math.inf
        ):
            target = self._free.most_free_with_capacity(need, self._reserved_nodes, gib)
            if target is not None:
                self._reserve(step, target)
                return
            # Capacities are fixed and reserved nodes only grow during a decision, so a need that
            # no node outside the reservations can hold stays so (a long queue asks it once).
            self._smallest_unreservable[gib] = need
        self._waiting.append(Waiting(step.job_id, step.step, self._blocked_reason(need, gib)))

    def _place(self, need: int, gib: float | None) -> str | None:
        """The best-fit node for `need` GPUs (with `gib` GiB left each), outside reservations."""
        if need >= self._smallest_unplaceable:
            return None
        if gib is not None and need >= self._smallest_unplaceable_gib.get(gib, math.inf):
            return None
        node = self._free.best_fit(need, self._reserved_nodes, gib)
        if node is None:
            if gib is None:
                self._smallest_unplaceable = need
            else:
                self._smallest_unplaceable_gib[gib] = need
        return node

    def _borrows(self, step: QueuedStep) -> bool:
        """Would starting this GPU step take its team beyond its quota?"""
        quota = self._quotas.get(step.team)
        return quota is not None and step.gpus > 0 and self._shares.held(step.team) + step.gpus > quota

    def _consider_borrowing(self, step: QueuedStep) -> None:
        """Second pass: place a borrowing step on GPUs nobody within quota can use now, or say why not."""
        need, gib = step.gpus, step.gpu_memory_gib
        quota = self._quotas[step.team]
        node = self._place(need, gib)
        if node is not None:
            self._start_on(step, node, f"; borrowed: team {step.team} is beyond its quota of {quota}")
            return
        reason = self._borrow_reasons.get((step.team, need, gib))
        if reason is None:
            held = int(self._shares.held(step.team))
            if held >= quota:
                why = f"team {step.team} is at its quota of {_count(quota, 'GPU')} (borrowing only idle GPUs)"
            else:
                why = (
                    f"team {step.team} would exceed its quota of {_count(quota, 'GPU')} "
                    f"(holds {held}, needs {need}; borrowing only idle GPUs)"
                )
            reason = f"{why}; {self._blocked_reason(need, gib)}"
            self._borrow_reasons[(step.team, need, gib)] = reason
        self._waiting.append(Waiting(step.job_id, step.step, reason))

    def _start_cpu_step(self, step: QueuedStep) -> None:
        if self._cpu_node is None:
            self._waiting.append(Waiting(step.job_id, step.step, "needs no GPUs, but the pool has no nodes"))
            return
        per_user = self._max_cpu_per_user
        if per_user is not None and (n := self._cpu_by_owner.get(step.owner, 0)) >= per_user:
            reason = f"user {step.owner or '(unknown)'} has {n} CPU-only steps running, the limit"
            self._waiting.append(Waiting(step.job_id, step.step, reason))
            return
        node = self._cpu_node_with_room()
        if node is None:
            if self._cpu_full_reason is None:  # the same for every CPU-only step from now on
                where = "" if len(self._cpu_nodes) == 1 else f" on all {len(self._cpu_nodes)} nodes"
                self._cpu_full_reason = (
                    f"node limit of {self._max_cpu_per_node} CPU-only steps reached{where}"
                )
            self._waiting.append(Waiting(step.job_id, step.step, self._cpu_full_reason))
            return
        self._cpu_by_node[node] = self._cpu_by_node.get(node, 0) + 1
        self._cpu_by_owner[step.owner] = self._cpu_by_owner.get(step.owner, 0) + 1
        reason = f"needs no GPUs: runs on {node}"
        self._starts.append(StartStep(step.job_id, step.step, node, (), reason))

    def _cpu_node_with_room(self) -> str | None:
        """The first node by name below its CPU-only limit (any node is, without a limit)."""
        limit = self._max_cpu_per_node
        if limit is None:
            return self._cpu_node
        while self._cpu_node_pos < len(self._cpu_nodes):
            name = self._cpu_nodes[self._cpu_node_pos]
            if self._cpu_by_node.get(name, 0) < limit:
                return name
            self._cpu_node_pos += 1
        return None

    def _start_on(self, step: QueuedStep, node: str, note: str = "") -> None:
        free_before = self._free.free_count(node)
        gpus = self._free.take(node, step.gpus, step.gpu_memory_gib)
        self._blocked_reasons.clear()
        self._borrow_reasons.clear()
        self._shares.add_held(step.team, step.gpus)
        verb = "backfilled" if self._reservations else "placed"
        reason = f"{verb} on {node} {_gpu_list(gpus)} (best fit: {free_before} free){self._backfill_note}"
        reason += note
        self._starts.append(StartStep(step.job_id, step.step, node, gpus, reason))

    def _reserve(self, step: QueuedStep, node: str) -> None:
        lead = "head of the queue" if not self._reservations else "next in line"
        gib = step.gpu_memory_gib
        missing = step.gpus - self._free.free_for(node, gib)
        self._reservations.append(Reservation(step.job_id, step.step, node, step.gpus))
        self._reserved_nodes.add(node)
        self._blocked_reasons.clear()
        self._borrow_reasons.clear()
        self._backfill_note = " while " + " and ".join(
            f"{r.job_id}/{r.step} waits for {r.node}" for r in self._reservations
        )
        more = _count(missing, "more GPU") + ("" if gib is None else f" with {placement.gib(gib)} GiB free")
        reason = f"{lead}: waiting for {more} on {node} (GPUs held back from backfill)"
        kept = self._node_size.get(node, 0) - self._free.capacity(node)
        if kept > 0:  # e.g. GPUs inference keeps: the wait may last until lending allows more
            reason += f"; {_count(kept, 'GPU')} of {node} not lendable now"
        self._waiting.append(Waiting(step.job_id, step.step, reason))

    def _blocked_reason(self, need: int, gib: float | None = None) -> str:
        key = (need, gib)
        reason = self._blocked_reasons.get(key)
        if reason is None:
            reason = self._blocked_reasons[key] = self._explain_blocked(need, gib)
        return reason

    def _explain_blocked(self, need: int, gib: float | None) -> str:
        wants = f"needs {need} GPUs on one node"
        if need > self._largest_node:
            return f"{wants}; no node has that many"
        if gib is not None:
            memory = self._memory_blocked(need, gib)
            if memory is not None:
                return memory
        lendable = self._free.largest_capacity()
        if need > lendable:
            if lendable == 0:
                return f"{wants}; no GPUs can be lent now"
            return f"{wants}; at most {lendable} on any node can be lent now"
        block = self._free.largest_free_block(self._reserved_nodes, gib)
        reason = "no free GPUs" if block == 0 else f"{wants}; largest free block is {block}"
        if gib is not None and block > 0:
            reason += f" with {placement.gib(gib)} GiB free"
        # Name the reservations that hide a bigger block than the one quoted: they are why
        # the figure is smaller than what the researcher may see free on the dashboard.
        holds = [
            f"{r.node} is held for {r.job_id}/{r.step}, which is {'first' if i == 0 else 'ahead'} in line"
            for i, r in enumerate(self._reservations)
            if self._free.free_for(r.node, gib) > block
        ]
        return f"{reason} ({'; '.join(holds)})" if holds else reason

    def _memory_blocked(self, need: int, gib: float) -> str | None:
        """The reason when GPU memory, not the GPU count, holds the step back (None: it does not:
        it would not fit even on GPUs with memory to spare)."""
        count_ok = need <= self._free.largest_free_block(self._reserved_nodes) or (
            need <= self._free.largest_capacity() and need > self._free.largest_capacity(gib)
        )
        if not count_ok:
            return None
        lendable = self._free.largest_capacity(gib)
        block = self._free.largest_free_block(self._reserved_nodes, gib)
        if lendable < need:  # not even once every step now running is done: say which GPUs lack it
            short = self._free.memory_shortfall(gib, free_only=False)
            tail = (
                f"no node has {_count(need, 'GPU')} with that much that can be lent now"
                if lendable == 0
                else f"at most {_count(lendable, 'GPU')} with that much on any node can be lent now"
            )
        else:
            short = self._free.memory_shortfall(gib, self._reserved_nodes)
            tail = f"largest free block with that much is {block}"
        detail = f"{'; '.join(short)}; " if short else ""
        return f"needs {placement.gib(gib)} GiB per GPU ({_count(need, 'GPU')} on one node): {detail}{tail}"


# --- wording -------------------------------------------------------------------------------------


def backoff_reason(step: QueuedStep, now: float) -> str:
    """E.g. "retry backoff: eligible in 12s (attempt 2 of 3)"."""
    note = f" ({step.retry_note})" if step.retry_note else ""
    return f"retry backoff: eligible in {_duration(step.eligible_at - now)}{note}"


def _duration(seconds: float) -> str:
    """Whole seconds, rounded up, at the precision a person needs: 12s, 4m 5s, 2h 3m."""
    total = math.ceil(seconds)
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m {total % 60}s"
    return f"{total // 3600}h {total % 3600 // 60}m"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _gpu_list(indices: tuple[int, ...]) -> str:
    word = "GPU" if len(indices) == 1 else "GPUs"
    return f"{word} {','.join(str(i) for i in indices)}"
