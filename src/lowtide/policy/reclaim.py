"""Reclaim planning: which running research steps give their GPUs back when inference needs them,
at the least cost (pure).

Role: given what research holds now and what inference is missing (whole replicas, each needing
`gpus` GPUs on ONE node, and possibly GPUs lent beyond the envelope), choose the victims and say
where each replica will fit once they are gone, and why each victim was chosen.
Neighbours: `policy.reclaim_phases` builds the `ReclaimRequest` each tick from the replica plan
(`policy.replicas`: what it could not place), the envelope (`policy.lending`) and the running
steps; `control.reclaimer` books the notice requests for the victims; `policy.replicas` starts or
wakes the replica once the GPUs are free. Must not: read the clock (`now` is in the request),
do I/O, give notice, or mutate the request (what-if evaluations run on it; everything working is
a private copy).

Rules
- Cost of stopping a step now (`victim_cost`), in GPU-seconds, with g = its GPU count:
  lost work = g × (now − max(started_at, last_checkpoint_at or started_at)), never below 0
  (`policy.attempt_rules.lost_work`, which the stores also record when an attempt ends);
  cost = lost work + g × restart_s.
- A step within its `min_runtime_s` (now − started_at < min_runtime_s) is protected: never a
  victim, unless the need it would serve has `below_min` (its service is below min_replicas).
  Steps already `stopping` (notice given) are never new victims: their GPUs count as freeing
  soon, at no cost, for any need on their node. Steps holding no GPU are ignored.
- Needs are served in the order given (the caller puts services below min first); GPUs placed
  for one need are not available to the next. GPUs a victim frees beyond what its need uses stay
  available (freeing) for later needs on that node, at no further cost.
- `exact` need (a sleeping replica's own GPUs): every running step holding one of them must go.
  The need is unmet (no victim chosen) when one of them is held by something that is neither
  free nor a research step (a replica, an unavailable GPU), is not a GPU of a known node, was
  placed for an earlier need, or is held by a protected step.
- "any block" need: on every node with at least `gpus` GPUs, find the cheapest set of victims
  that, with the node's available GPUs (free now, or freeing: stopping steps and earlier
  victims), yields `gpus` GPUs. With ≤ 12 candidate steps on the node the search is exact over
  all subsets; above that, greedy by cost per GPU (ties as below), then victims that turn out
  unnecessary are dropped, most expensive first. Among equally cheap sets on a node: the one
  whose most important victim has the lowest priority, then whose oldest victim started most
  recently, then fewer victims, then lower attempt ids. The node chosen is the cheapest to return
  (Lyra's server-preemption cost); ties: the victims' lowest priority (a set counts as its
  highest priority number; lower = less important, preferred), then most recently started (a set
  counts as its oldest start), then best fit (fewest available GPUs left over after placing),
  then node name. Costs are compared as whole micro-GPU-seconds, so sums in any order tie.
  Placement: the lowest-index GPUs of the node, those free now before those freeing.
- A need no node can hold, even if every candidate stopped, is unmet with the reason; no victim
  is ever chosen for an unmet need.
- `excess_lent_gpus`: research (steps without notice) holds this many GPUs more than the lending
  envelope allows. GPUs of victims chosen for needs count toward it; then further victims are
  chosen anywhere, cheapest cost per GPU first (ties: lowest priority, most recent start,
  attempt id), until it is covered. min_runtime protects here (no service is below min when
  lending shrinks); what cannot be covered is reported in `notes`. These victims have
  `for_need` = "lending".
- `Victim.for_need` is the service name of the need served (what the caller keys grace and
  records on); reasons name the replica (its id, or "<service>#<need index>" for a new one).
- Deterministic: the result depends on the request's contents, never on set or dict order.
  Inconsistent input (a GPU with two holders, a GPU both free and held, duplicate node names or
  attempt ids) is a caller bug and raises ValueError.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lowtide.domain.gpus import GpuRef, Node
from lowtide.policy.attempt_rules import lost_work

#: Above this many candidate steps on one node, the cheapest set is found greedily.
EXACT_SEARCH_MAX = 12
LENDING = "lending"
_UNITS = 1_000_000  # costs are compared as integers of 1e-6 GPU-s: exact sums, exact ties


@dataclass(frozen=True, slots=True)
class RunningVictim:
    """A running step attempt that could give its GPUs back."""

    attempt_id: int
    job_id: str
    step: str
    team: str
    priority: int
    node: str
    gpus: tuple[int, ...]
    started_at: float
    last_checkpoint_at: float | None
    min_runtime_s: float = 0.0
    restart_s: float = 60.0
    stopping: bool = False  # already has notice: its GPUs free soon; never a new victim

    def __post_init__(self) -> None:
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"attempt {self.attempt_id}: duplicate GPUs {self.gpus}")
        if self.restart_s < 0 or self.min_runtime_s < 0:
            raise ValueError(f"attempt {self.attempt_id}: restart_s and min_runtime_s must be ≥ 0")

    def protected(self, now: float) -> bool:
        """Within its min_runtime: spared unless a service is below min_replicas."""
        return now - self.started_at < self.min_runtime_s


@dataclass(frozen=True, slots=True)
class ReplicaNeed:
    """A replica inference wants and cannot place on free GPUs."""

    service: str
    replica_id: str | None
    gpus: int
    exact: tuple[GpuRef, ...] = ()  # a sleeping replica's own GPUs (all must be freed); () = any block
    below_min: bool = False  # the service is below min_replicas: min_runtime does not protect

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"{self.service}: a replica needs at least 1 GPU, got {self.gpus}")
        if self.exact:
            if len(set(self.exact)) != len(self.exact) or len(self.exact) != self.gpus:
                raise ValueError(f"{self.service}: exact GPUs {self.exact} must be {self.gpus} distinct GPUs")
            if len({g.node for g in self.exact}) != 1:
                raise ValueError(f"{self.service}: exact GPUs {self.exact} must be on one node")


@dataclass(frozen=True, slots=True)
class ReclaimRequest:
    now: float
    nodes: tuple[Node, ...]
    free: frozenset[GpuRef]  # idle now; GPUs held by replicas are neither free nor in `running`
    running: tuple[RunningVictim, ...]
    needs: tuple[ReplicaNeed, ...]
    excess_lent_gpus: int = 0  # research (steps without notice) holds this many more than allowed


@dataclass(frozen=True, slots=True)
class Victim:
    attempt_id: int
    job_id: str
    step: str
    node: str
    gpus: tuple[int, ...]
    cost_gpu_s: float
    lost_work_gpu_s: float
    for_need: str  # the service name, or "lending"
    reason: str


@dataclass(frozen=True, slots=True)
class Placement:
    """Where need `need_index` will fit once the victims are gone."""

    need_index: int
    node: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReclaimPlan:
    victims: tuple[Victim, ...] = ()
    placements: tuple[Placement, ...] = ()
    unmet: tuple[tuple[int, str], ...] = ()  # (need index, why)
    notes: tuple[str, ...] = ()


def victim_cost(v: RunningVictim, now: float) -> tuple[float, float]:
    """(cost, lost work) of stopping `v` now, both in GPU-seconds (`attempt_rules.lost_work`:
    the same figure the store records when the attempt ends)."""
    n = len(v.gpus)
    lost = lost_work(n, v.started_at, v.last_checkpoint_at, now)
    return lost + n * v.restart_s, lost


def plan_reclaim(req: ReclaimRequest) -> ReclaimPlan:
    pool = _Pool(req)
    for index, need in enumerate(req.needs):
        if need.exact:
            pool.serve_exact(index, need)
        else:
            pool.serve_block(index, need)
    pool.cover_excess(req.excess_lent_gpus)
    return ReclaimPlan(tuple(pool.victims), tuple(pool.placements), tuple(pool.unmet), tuple(pool.notes))


# --- internals ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Option:
    """The cheapest way to fit a block on one node."""

    node: str
    victims: tuple[RunningVictim, ...]
    units: int  # cost in 1e-6 GPU-s
    leftover: int  # available GPUs left on the node after placing
    key: tuple[int, float, float, int, str]

    @property
    def cost(self) -> float:
        return self.units / _UNITS


_KEY_NAMES = ("cost", "victims' priority", "victims' start time", "best fit", "node name")


def _set_tiebreak(victims: Sequence[RunningVictim]) -> tuple[float, float]:
    """(highest priority, −oldest start): smaller is better; no victim is best."""
    if not victims:
        return (-math.inf, -math.inf)
    return (float(max(v.priority for v in victims)), -min(v.started_at for v in victims))


class _Pool:
    """The working state of one plan: what is available where, what is chosen. Thrown away after."""

    def __init__(self, req: ReclaimRequest) -> None:
        self.now = req.now
        self.nodes: dict[str, Node] = {}
        for node in req.nodes:
            if node.name in self.nodes:
                raise ValueError(f"duplicate node {node.name!r}")
            self.nodes[node.name] = node
        self.holder: dict[GpuRef, RunningVictim] = {}
        ids: set[int] = set()
        for s in req.running:
            if s.attempt_id in ids:
                raise ValueError(f"duplicate attempt id {s.attempt_id}")
            ids.add(s.attempt_id)
            for i in s.gpus:
                ref = GpuRef(s.node, i)
                other = self.holder.get(ref)
                if other is not None:
                    raise ValueError(f"GPU {ref} held by attempts {other.attempt_id} and {s.attempt_id}")
                if ref in req.free:
                    raise ValueError(f"GPU {ref} is both free and held by attempt {s.attempt_id}")
                self.holder[ref] = s
        self.running = sorted(req.running, key=lambda s: s.attempt_id)
        self.cost = {s.attempt_id: victim_cost(s, req.now) for s in self.running}
        self.units = {aid: round(cost * _UNITS) for aid, (cost, _) in self.cost.items()}
        self.now_free: dict[str, set[int]] = {name: set() for name in self.nodes}
        self.freeing: dict[str, set[int]] = {name: set() for name in self.nodes}
        for ref in req.free:
            known = self.nodes.get(ref.node)
            if known is not None and ref.index in known.gpus:
                self.now_free[ref.node].add(ref.index)
        self.steps_on: dict[str, list[RunningVictim]] = {name: [] for name in self.nodes}
        for s in self.running:
            if s.node not in self.nodes or not s.gpus:
                continue
            if s.stopping:
                self.freeing[s.node].update(i for i in s.gpus if i in self.nodes[s.node].gpus)
            else:
                self.steps_on[s.node].append(s)
        self.guarded_nodes = {
            n for n, steps in self.steps_on.items() if any(s.protected(req.now) for s in steps)
        }
        self.promised: dict[GpuRef, str] = {}
        self.chosen: set[int] = set()
        self.cache: dict[str, dict[tuple[int, bool], _Option | None]] = {}
        self.victims: list[Victim] = []
        self.placements: list[Placement] = []
        self.unmet: list[tuple[int, str]] = []
        self.notes: list[str] = []

    # --- exact needs (wake a sleeping replica on its own GPUs) ---------------------------------

    def serve_exact(self, index: int, need: ReplicaNeed) -> None:
        label = _label(index, need)
        name = need.exact[0].node
        refs = sorted(need.exact)
        where = f"wake {label} on {name} GPUs {_idx(r.index for r in refs)}"
        node = self.nodes.get(name)
        if node is None:
            self.unmet.append((index, f"{where}: {name} is not a known node"))
            return
        problems: list[str] = []
        must_go: dict[int, RunningVictim] = {}
        for ref in refs:
            if ref.index not in node.gpus:
                problems.append(f"{ref} is not a GPU lowtide manages")
            elif ref in self.promised:
                problems.append(f"{ref} is already placed for {self.promised[ref]}")
            elif ref.index in self.now_free[name] or ref.index in self.freeing[name]:
                continue
            elif ref in self.holder:
                s = self.holder[ref]  # neither stopping nor chosen: their GPUs are freeing
                if s.protected(self.now) and not need.below_min:
                    left = s.started_at + s.min_runtime_s - self.now
                    problems.append(
                        f"{ref} is held by {_who(s)}, within its min_runtime for another {left:.0f}s"
                    )
                else:
                    must_go[s.attempt_id] = s
            else:
                problems.append(f"{ref} is neither free nor held by a research step (a replica holds it?)")
        if problems:
            self.unmet.append((index, f"{where}: " + "; ".join(problems)))
            return
        for s in must_go.values():
            why = f"frees {name} GPUs {_idx(s.gpus)} for {label} (wake on its own GPUs): {self._work(s)}"
            self._choose(s, need.service, why + self._min_note(s, need))
        self._place(index, need, label, name, tuple(r.index for r in refs))
        if not must_go:
            self.notes.append(f"{label}: its own GPUs on {name} are free or freeing; nothing to stop")

    # --- any-block needs -----------------------------------------------------------------------

    def serve_block(self, index: int, need: ReplicaNeed) -> None:
        label = _label(index, need)
        g = need.gpus
        options = [
            opt
            for name, node in self.nodes.items()
            if len(node.gpus) >= g and (opt := self._cheapest_on(name, g, need.below_min)) is not None
        ]
        if not options:
            self.unmet.append((index, self._why_not(g, need.below_min)))
            return
        options.sort(key=lambda o: o.key)
        best = options[0]
        summary = (
            f"cheapest of {len(options)} node(s) that can hold {g} GPUs ({best.node}: {best.cost:.0f} GPU-s"
        )
        if len(options) > 1:
            second = options[1]
            summary += f"; next {second.node}: {second.cost:.0f} GPU-s"
            decided = next(i for i, (a, b) in enumerate(zip(best.key, second.key, strict=True)) if a != b)
            if decided > 0:
                summary += f", same cost: chosen by {_KEY_NAMES[decided]}"
        summary += ")"
        for s in best.victims:
            why = f"frees {best.node} GPUs {_idx(s.gpus)} for {label}: {self._work(s)}; {summary}"
            self._choose(s, need.service, why + self._min_note(s, need))
        free_first = sorted(self.now_free[best.node]) + sorted(self.freeing[best.node])
        self._place(index, need, label, best.node, tuple(free_first[:g]))
        if not best.victims:
            self.notes.append(f"{label}: fits on {best.node} without stopping another step")

    def _cheapest_on(self, name: str, g: int, below_min: bool) -> _Option | None:
        cache = self.cache.setdefault(name, {})
        # below_min only changes the answer where a step is protected (fewer searches to run).
        key = (g, below_min and name in self.guarded_nodes)
        if key in cache:
            return cache[key]
        have = len(self.now_free[name]) + len(self.freeing[name])
        deficit = g - have
        option: _Option | None
        if deficit <= 0:
            option = _option(name, (), 0, have - g)
        else:
            eligible = [
                s
                for s in self.steps_on[name]
                if s.attempt_id not in self.chosen and (below_min or not s.protected(self.now))
            ]
            if sum(len(s.gpus) for s in eligible) < deficit:
                option = None
            else:
                if len(eligible) <= EXACT_SEARCH_MAX:
                    victims = self._exact_search(eligible, deficit)
                else:
                    victims = self._greedy(eligible, deficit)
                units = sum(self.units[s.attempt_id] for s in victims)
                freed = sum(len(s.gpus) for s in victims)
                option = _option(name, victims, units, have + freed - g)
        cache[key] = option
        return option

    def _exact_search(self, eligible: list[RunningVictim], deficit: int) -> tuple[RunningVictim, ...]:
        """Cheapest subset freeing ≥ `deficit` GPUs, over all 2^n subsets (n ≤ 12)."""
        n = len(eligible)
        sizes = [len(s.gpus) for s in eligible]
        costs = [self.units[s.attempt_id] for s in eligible]
        got = [0] * (1 << n)
        spent = [0] * (1 << n)
        best = -1
        best_masks: list[int] = []
        for mask in range(1, 1 << n):
            low = mask & -mask
            bit = low.bit_length() - 1
            rest = mask ^ low
            got[mask] = got[rest] + sizes[bit]
            spent[mask] = spent[rest] + costs[bit]
            if got[mask] >= deficit:
                if best < 0 or spent[mask] < best:
                    best, best_masks = spent[mask], [mask]
                elif spent[mask] == best:
                    best_masks.append(mask)
        subsets = (tuple(s for bit, s in enumerate(eligible) if mask >> bit & 1) for mask in best_masks)
        return min(subsets, key=_subset_key)

    def _greedy(self, eligible: list[RunningVictim], deficit: int) -> tuple[RunningVictim, ...]:
        """Cheapest per GPU first until enough; then drop what is not needed, most expensive first."""
        picked: list[RunningVictim] = []
        got = 0
        for s in sorted(eligible, key=self._per_gpu_key):
            if got >= deficit:
                break
            picked.append(s)
            got += len(s.gpus)
        for s in sorted(picked, key=lambda s: (-self.units[s.attempt_id], -s.attempt_id)):
            if got - len(s.gpus) >= deficit:
                picked.remove(s)
                got -= len(s.gpus)
        return tuple(sorted(picked, key=lambda s: s.attempt_id))

    def _per_gpu_key(self, s: RunningVictim) -> tuple[float, int, float, int]:
        return (self.units[s.attempt_id] / len(s.gpus), s.priority, -s.started_at, s.attempt_id)

    def _why_not(self, g: int, below_min: bool) -> str:
        big = [node for node in self.nodes.values() if len(node.gpus) >= g]
        if not big:
            largest = max((len(node.gpus) for node in self.nodes.values()), default=0)
            return f"needs {g} GPUs on one node; the largest node has {largest}"
        rows = []
        for node in big:
            name = node.name
            have = len(self.now_free[name]) + len(self.freeing[name])
            steps = [s for s in self.steps_on[name] if s.attempt_id not in self.chosen]
            could = sum(len(s.gpus) for s in steps if below_min or not s.protected(self.now))
            guarded = sum(len(s.gpus) for s in steps) - could
            rows.append((-(have + could), -guarded, name, have, could, guarded))
        _, _, name, have, could, guarded = min(rows)
        why = (
            f"needs {g} GPUs on one node; no node can free that many even if every candidate step "
            f"stopped: the best, {name}, has {have} free or freeing and {could} held by steps that may stop"
        )
        if guarded:
            why += f"; {guarded} more are held by steps within their min_runtime"
        rest = len(self.nodes[name].gpus) - have - could - guarded
        if rest:
            why += f"; {rest} are held by replicas, unavailable or placed for earlier needs"
        return why

    # --- lending shrank --------------------------------------------------------------------------

    def cover_excess(self, excess: int) -> None:
        if excess <= 0:
            return
        already = sum(len(v.gpus) for v in self.victims)
        remaining = excess - already
        if remaining <= 0:
            self.notes.append(
                f"{LENDING}: {excess} GPU(s) over the envelope are covered by the victims above"
            )
            return
        candidates = [
            s
            for s in self.running
            if s.gpus and not s.stopping and s.attempt_id not in self.chosen and not s.protected(self.now)
        ]
        candidates.sort(key=self._per_gpu_key)
        for s in candidates:
            if remaining <= 0:
                break
            per_gpu = self.cost[s.attempt_id][0] / len(s.gpus)
            why = (
                f"returns {s.node} GPUs {_idx(s.gpus)}: research holds {excess} GPU(s) more than the "
                f"lending envelope allows; cheapest per GPU of {len(candidates)} candidate step(s) "
                f"({per_gpu:.0f} GPU-s/GPU): {self._work(s)}"
            )
            self._choose(s, LENDING, why)
            remaining -= len(s.gpus)
        if remaining > 0:
            self.notes.append(
                f"{LENDING}: {remaining} GPU(s) over the envelope stay with research: "
                "every other step has notice already or is within its min_runtime"
            )

    # --- bookkeeping ---------------------------------------------------------------------------

    def _choose(self, s: RunningVictim, for_need: str, reason: str) -> None:
        cost, lost = self.cost[s.attempt_id]
        self.chosen.add(s.attempt_id)
        self.victims.append(
            Victim(s.attempt_id, s.job_id, s.step, s.node, s.gpus, cost, lost, for_need, reason)
        )
        node = self.nodes.get(s.node)
        if node is not None:
            self.freeing[s.node].update(i for i in s.gpus if i in node.gpus)
            self.cache.pop(s.node, None)

    def _place(self, index: int, need: ReplicaNeed, label: str, node: str, gpus: tuple[int, ...]) -> None:
        gpus = tuple(sorted(gpus))
        stoppers: dict[int, RunningVictim] = {}
        for i in gpus:
            ref = GpuRef(node, i)
            self.promised[ref] = label
            self.now_free[node].discard(i)
            self.freeing[node].discard(i)
            s = self.holder.get(ref)
            if s is not None and s.stopping:
                stoppers[s.attempt_id] = s
        self.cache.pop(node, None)
        self.placements.append(Placement(index, node, gpus))
        for s in stoppers.values():
            self.notes.append(f"{label}: uses GPUs of {_who(s)}, which already has notice (no new cost)")

    def _work(self, s: RunningVictim) -> str:
        cost, lost = self.cost[s.attempt_id]
        since = (
            "since its last checkpoint"
            if s.last_checkpoint_at is not None
            else "since it started (no checkpoint)"
        )
        return f"{lost:.0f} GPU-s of work {since} + {cost - lost:.0f} GPU-s restart"

    def _min_note(self, s: RunningVictim, need: ReplicaNeed) -> str:
        if s.protected(self.now):
            return f"; within its min_runtime, but {need.service} is below min_replicas"
        return ""


def _option(node: str, victims: tuple[RunningVictim, ...], units: int, leftover: int) -> _Option:
    prio, start = _set_tiebreak(victims)
    return _Option(node, victims, units, leftover, (units, prio, start, leftover, node))


def _subset_key(victims: tuple[RunningVictim, ...]) -> tuple[float, float, int, tuple[int, ...]]:
    prio, start = _set_tiebreak(victims)
    return (prio, start, len(victims), tuple(v.attempt_id for v in victims))


def _label(index: int, need: ReplicaNeed) -> str:
    return need.replica_id if need.replica_id is not None else f"{need.service}#{index}"


def _who(s: RunningVictim) -> str:
    return f"{s.job_id}/{s.step} (attempt {s.attempt_id})"


def _idx(indices: Iterable[int]) -> str:
    return ",".join(str(i) for i in indices)
