"""Which replicas to start, wake, drain and park so that each service has its desired count, and
which free GPUs research may use (pure).

Per service, given the desired replica count (from `policy.autoscale`):
- too few (serving + starting + waking < desired): first take back a replica that is draining;
  then wake a sleeping replica whose GPUs are all free (seconds); then start one (a stopped, failed
  past its retry time, or never-started slot) on a best-fit free block of `gpus_per_replica` GPUs
  on one node. What cannot be placed is reported as blocked, with the reason.
- too many: drain the serving replica with the fewest requests in flight (highest slot on ties):
  it leaves the gateway first; a draining replica is parked (`spec.park`: sleep or stop) once it
  has nothing in flight or its drain timeout has passed. A level-1 sleep keeps the weights in
  host RAM: where the node's budget for sleeping replicas (`Node.sleep_host_ram_gib`) cannot hold
  them too, the replica parks by stop instead (`choose_park`; the action's reason says why;
  docs/architecture.md §4.2). **Make before break**: a replica leaves
  routing only when the SERVING replicas that stay are at least the desired count, so replicas
  still starting or waking never stand in for one that serves (scale-down waits for them to
  serve; docs/architecture.md §4.2).
- hung (`restart`, decided by `policy.inference.hung_replicas`, not here): the replica is taken
  out of routing as FAILED and its process killed; it restarts after its backoff and, meanwhile,
  no longer counts as supply, so a replacement starts on another slot if one is free.
Research GPUs (`research_gpus`): the envelope says how many GPUs may be lent; lowtide offers that
many free GPUs, preferring GPUs no sleeping replica will want back, then whole nodes.
`plan_replicas_on` and `research_offer` are the same rules over GPU indices per node (what the
inference decision keeps each tick: no `GpuRef` is built or hashed per GPU of the pool). The free
GPUs and the host RAM of sleeping replicas are worked out only when a service brings a replica
up or parks one (`_Pool`): most ticks do neither.
Neighbours: `policy.inference` builds the views from the inference snapshot and calls both each
tick; `control.inference` applies the plan. Must not: read the clock (`now` is passed), do I/O,
or decide how many replicas a service needs (autoscale does).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from lowtide.domain.gpus import GpuRef, Node
from lowtide.domain.services import ParkMode, ServiceSpec
from lowtide.domain.states import SUPPLY_REPLICA_STATES, ReplicaState
from lowtide.policy.memo import Last

R = ReplicaState
ActionKind = Literal["start", "wake", "drain", "undrain", "park", "restart"]


#: GPU indices per node name (e.g. the GPUs held, or free, on each node).
GpuIndex = Mapping[str, Set[int]]


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """A replica slot as the policies see it: its record (state None: the slot never had one)
    and, from the gateway, the requests still in flight on it."""

    id: str
    service: str
    slot: int
    state: ReplicaState | None  # None: this slot never had a replica
    node: str | None = None
    gpus: tuple[int, ...] = ()
    parked_as: ParkMode | None = None  # how a PARKED replica is parked
    since: float = 0.0  # when it entered its state
    retry_at: float = 0.0  # a FAILED replica is not restarted before this
    in_flight: int = 0  # requests the gateway still has on it
    failures: int = 0  # failed starts in a row (a FAILED replica's restart backoff counts them)
    port: int = 0  # where the replica serves (its URL when the service manager knows none)

    @property
    def gpu_refs(self) -> tuple[GpuRef, ...]:
        return tuple(GpuRef(self.node, i) for i in self.gpus) if self.node else ()


@dataclass(frozen=True, slots=True)
class ServiceView:
    spec: ServiceSpec
    desired: int
    replicas: tuple[ReplicaView, ...]  # one per slot, 0 .. max_replicas-1
    drain_timeout_s: float = 30.0


@dataclass(frozen=True, slots=True)
class ReplicaAction:
    kind: ActionKind
    replica_id: str
    service: str
    node: str | None = None
    gpus: tuple[int, ...] = ()
    reason: str = ""
    park_as: ParkMode | None = None  # a park: how (None: the service's `park`)


@dataclass(frozen=True, slots=True)
class Blocked:
    service: str
    missing: int  # replicas the service wants but could not get this tick
    reason: str


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    actions: tuple[ReplicaAction, ...] = ()
    blocked: tuple[Blocked, ...] = ()


def plan_replicas(
    services: Iterable[ServiceView], nodes: tuple[Node, ...], busy: frozenset[GpuRef], now: float
) -> ReplicaPlan:
    """`busy`: GPUs held right now by anything (steps, replicas). Services are served in the
    order given (the caller orders them: e.g. by how far below their desired count they are)."""
    return plan_replicas_on(services, nodes, by_node(busy), now)


_NO_PLAN = ReplicaPlan()


def plan_replicas_on(
    services: Iterable[ServiceView], nodes: tuple[Node, ...], busy: GpuIndex, now: float
) -> ReplicaPlan:
    """`plan_replicas` with the busy GPUs given as indices per node."""
    actions: list[ReplicaAction] = []
    blocked: list[Blocked] = []
    services = tuple(services)
    pool = _Pool(services, nodes, busy)
    for svc in services:
        _plan_service(svc, pool, nodes, now, actions, blocked)
    if not actions and not blocked:
        return _NO_PLAN  # the common tick (frozen: one for all)
    return ReplicaPlan(tuple(actions), tuple(blocked))


class _Pool:
    """The working state of one plan, each part worked out from the plan's inputs the first time
    a service needs it: most ticks bring nothing up and park nothing, and need none of it."""

    def __init__(self, services: tuple[ServiceView, ...], nodes: tuple[Node, ...], busy: GpuIndex) -> None:
        self._services, self._nodes, self._busy = services, nodes, busy

    @cached_property
    def free(self) -> dict[str, list[int]]:
        """Free GPU indices per node; starts and wakes take from it as the plan goes."""
        free: dict[str, list[int]] = {}
        for n in self._nodes:
            held = self._busy.get(n.name)
            free[n.name] = [i for i in n.gpus if i not in held] if held else list(n.gpus)
        return free

    @cached_property
    def budgets(self) -> dict[str, float | None]:
        return {n.name: n.sleep_host_ram_gib for n in self._nodes}

    @cached_property
    def host_ram(self) -> dict[str, float]:
        """`sleeping_host_ram` before the plan; parks by sleep add to it as the plan goes."""
        return sleeping_host_ram(self._services, self.budgets)


def sleeping_host_ram(
    services: Iterable[ServiceView], budgets: Mapping[str, float | None]
) -> dict[str, float]:
    """Host RAM (GiB) per node held by sleeping replicas: PARKED asleep, and PARKING ones of a
    service that parks by sleep (counted as asleep until they report: the cautious side). A
    replica whose weights are unknown counts as its node's whole budget (`choose_park`)."""
    used: dict[str, float] = {}
    for svc in services:
        spec = svc.spec
        if spec.park != "sleep":
            continue
        for r in svc.replicas:
            state = r.state
            if not (state == R.PARKING or (state == R.PARKED and r.parked_as == "sleep")):
                continue
            node = r.node
            if node is None:
                continue
            gib = spec.sleep_host_gib
            if gib is None:
                gib = budgets.get(node) or 0.0
            used[node] = used.get(node, 0.0) + gib
    return used


def choose_park(spec: ServiceSpec, budget_gib: float | None, used_gib: float) -> tuple[ParkMode, str]:
    """How a drained replica of `spec` parks on a node whose sleeping replicas already hold
    `used_gib` of a host-RAM budget of `budget_gib` (None: no budget), and why. A level-2 sleep
    holds no host RAM; a level-1 sleep holds the weights (`weights_host_gib`; unknown counts as
    the whole budget, so only one such replica sleeps per node). Past the budget: stop."""
    if spec.park != "sleep":
        return "stop", "park: stop"
    if spec.sleep_level == 2:
        return "sleep", "park: sleep (level 2: weights discarded, no host RAM held)"
    if budget_gib is None:
        return "sleep", "park: sleep"
    need = spec.sleep_host_gib
    known = need is not None
    need = need if need is not None else budget_gib
    if used_gib + need <= budget_gib:
        held = f"{used_gib + need:g} of {budget_gib:g} GiB"
        return "sleep", f"park: sleep (host RAM for sleeping replicas: {held})"
    weights = f"{need:g} GiB of weights" if known else "weights of unknown size (weights_host_gib unset)"
    return "stop", (
        f"parked by stop, not sleep: host RAM for sleeping replicas on this node is "
        f"{used_gib:g} of {budget_gib:g} GiB in use and this replica would add {weights}"
    )


def _plan_service(
    svc: ServiceView,
    pool: _Pool,
    nodes: tuple[Node, ...],
    now: float,
    actions: list[ReplicaAction],
    blocked: list[Blocked],
) -> None:
    spec = svc.spec
    supplied, draining = supply_and_draining(svc.replicas)
    missing = svc.desired - supplied
    if missing == 0 and not draining:
        return  # the common tick: nothing to park, bring up or drain

    # Park what has drained (whether or not more replicas are needed: undrain comes first below).
    if missing <= 0:
        for r in draining:
            if r.in_flight == 0 or now - r.since >= svc.drain_timeout_s:
                why = "drained" if r.in_flight == 0 else f"drain timeout ({r.in_flight} still in flight)"
                node = r.node or ""
                budgets, host_ram = pool.budgets, pool.host_ram
                mode, how = choose_park(spec, budgets.get(node), host_ram.get(node, 0.0))
                if mode == "sleep" and spec.sleep_level == 1:
                    held = spec.sleep_host_gib or budgets.get(node) or 0.0
                    host_ram[node] = host_ram.get(node, 0.0) + held
                actions.append(
                    ReplicaAction("park", r.id, spec.name, r.node, r.gpus, f"{why}; {how}", park_as=mode)
                )

    if missing > 0:
        for r in draining[:missing]:
            actions.append(
                ReplicaAction("undrain", r.id, spec.name, r.node, r.gpus, "needed again while draining")
            )
            missing -= 1
    if missing > 0:
        missing = _bring_up(svc, missing, pool.free, nodes, now, actions, blocked)
    elif missing < 0:
        serving = sorted(
            (r for r in svc.replicas if r.state == R.SERVING), key=lambda r: (r.in_flight, -r.slot)
        )
        # Make before break: the replicas that stay in routing must serve already.
        surplus = min(-missing, max(0, len(serving) - svc.desired))
        for r in serving[:surplus]:
            actions.append(
                ReplicaAction(
                    "drain",
                    r.id,
                    spec.name,
                    r.node,
                    r.gpus,
                    f"{supplied} replicas, {svc.desired} desired: drain before parking",
                )
            )


#: The last `supply_and_draining`, with the very tuple of replicas it came from (immutable).
_last_supply: Last[tuple[tuple[ReplicaView, ...], tuple[int, tuple[ReplicaView, ...]]]] = Last()


def supply_and_draining(replicas: tuple[ReplicaView, ...]) -> tuple[int, tuple[ReplicaView, ...]]:
    """How many of a service's replicas count as supply, and its DRAINING ones, most in flight
    first (then by slot); kept for the same tuple of (frozen) replica views, which the inference
    decision hands in unchanged while the service's replicas and target stay the same."""
    last = _last_supply.entry
    if last is not None and last[0] is replicas:
        return last[1]
    supplied = sum(1 for r in replicas if r.state in SUPPLY_REPLICA_STATES)
    draining = tuple(
        sorted((r for r in replicas if r.state == R.DRAINING), key=lambda r: (-r.in_flight, r.slot))
    )
    result = (supplied, draining)
    _last_supply.entry = (replicas, result)
    return result


def _bring_up(
    svc: ServiceView,
    missing: int,
    free: dict[str, list[int]],
    nodes: tuple[Node, ...],
    now: float,
    actions: list[ReplicaAction],
    blocked: list[Blocked],
) -> int:
    spec = svc.spec
    g = spec.gpus_per_replica
    reasons: list[str] = []
    asleep = [r for r in svc.replicas if r.state == R.PARKED and r.parked_as == "sleep"]
    for r in sorted(asleep, key=lambda r: r.slot):
        if missing == 0:
            break
        if r.node is not None and all(i in free.get(r.node, []) for i in r.gpus):
            _take(free, r.node, r.gpus)
            actions.append(ReplicaAction("wake", r.id, spec.name, r.node, r.gpus, "wake from sleep (fast)"))
            missing -= 1
        else:
            reasons.append(f"{r.id} sleeps on {r.node} GPUs {_gpus(r.gpus)}, which are in use")
    startable = [
        r
        for r in svc.replicas
        if r.state is None
        or (r.state == R.PARKED and r.parked_as != "sleep")
        or (r.state == R.FAILED and r.retry_at <= now)
    ]
    waiting_retry = [r for r in svc.replicas if r.state == R.FAILED and r.retry_at > now]
    for r in sorted(startable, key=lambda r: (r.state is None, r.slot)):
        if missing == 0:
            break
        node = _best_fit(free, nodes, g)
        if node is None:
            largest = max((len(v) for v in free.values()), default=0)
            reasons.append(f"needs {g} GPUs on one node; largest free block is {largest}")
            break
        gpus = tuple(sorted(free[node])[:g])
        _take(free, node, gpus)
        verb = "restart after failure" if r.state == R.FAILED else "start"
        actions.append(
            ReplicaAction("start", r.id, spec.name, node, gpus, f"{verb} on {node} GPUs {_gpus(gpus)}")
        )
        missing -= 1
    if missing > 0:
        if waiting_retry and not reasons:
            first = min(r.retry_at for r in waiting_retry)
            reasons.append(f"{len(waiting_retry)} failed replica(s) retry in {max(0.0, first - now):.0f}s")
        if not reasons:
            reasons.append("no replica slot left (max_replicas reached)")
        blocked.append(Blocked(spec.name, missing, "; ".join(dict.fromkeys(reasons))))
    return missing


def _best_fit(free: Mapping[str, list[int]], nodes: tuple[Node, ...], g: int) -> str | None:
    fits = [(len(free[n.name]), n.name) for n in nodes if len(free[n.name]) >= g]
    return min(fits)[1] if fits else None


def _take(free: dict[str, list[int]], node: str, gpus: Iterable[int]) -> None:
    taken = set(gpus)
    free[node] = [i for i in free[node] if i not in taken]


def _gpus(gpus: Iterable[int]) -> str:
    return ",".join(str(i) for i in gpus)


def research_gpus(
    nodes: tuple[Node, ...],
    *,
    busy: frozenset[GpuRef],
    reserved: frozenset[GpuRef],
    affinity: frozenset[GpuRef],
    new_lendable: int,
) -> frozenset[GpuRef]:
    """The free GPUs research may take now: at most `new_lendable` of them (the envelope minus
    what is already lent), never a `busy` or `reserved` one (booked for a replica this tick).
    GPUs that a sleeping replica will want back (`affinity`) are offered last; among the rest,
    nodes with the most free GPUs first (so research gets whole blocks), lowest index first."""
    if new_lendable <= 0:
        return frozenset()
    offer = research_offer(
        nodes, busy=by_node(busy | reserved), affinity=by_node(affinity), new_lendable=new_lendable
    )
    return frozenset(GpuRef(node, i) for node, indices in offer.items() for i in indices)


def research_offer(
    nodes: tuple[Node, ...], *, busy: GpuIndex, affinity: GpuIndex, new_lendable: int
) -> dict[str, list[int]]:
    """`research_gpus` over indices per node: the GPU indices offered on each node that gets any
    (`busy` includes what is reserved). Same order of preference: GPUs outside `affinity` first;
    then nodes with the most free GPUs, node name, lowest index."""
    if new_lendable <= 0:
        return {}
    rows: list[tuple[int, str, list[int], list[int]]] = []  # (−free count, node, plain, affine)
    ascending = _ascending(nodes)  # then the idle GPUs, kept in node order, are sorted already
    for n in nodes:
        name = n.name
        held = busy.get(name)
        idle = [i for i in n.gpus if i not in held] if held else list(n.gpus)
        if not idle:
            continue
        if not ascending:
            idle.sort()
        wanted = affinity.get(name)
        if wanted:
            plain = [i for i in idle if i not in wanted]
            affine = [i for i in idle if i in wanted]
        else:  # the common case: no sleeping replica here, every idle GPU is plain
            plain, affine = idle, []
        rows.append((-len(idle), name, plain, affine))
    rows.sort()  # (−free count, node): node names are unique, so the lists are never compared
    offer: dict[str, list[int]] = {}
    left = new_lendable
    for affine_pass in (False, True):  # plain GPUs of every node first, then those a replica wants
        for _, node, plain, affine in rows:
            taken = (affine if affine_pass else plain)[:left]
            if taken:
                offer.setdefault(node, []).extend(taken)
                left -= len(taken)
                if left <= 0:
                    return offer
    return offer


#: The last nodes `_ascending` looked at, and its answer (the loop passes the same tuple each tick).
_last_ascending: Last[tuple[tuple[Node, ...], bool]] = Last()


def _ascending(nodes: tuple[Node, ...]) -> bool:
    """Whether every node lists its GPU indices in ascending order (answered once per tuple)."""
    last = _last_ascending.entry
    if last is not None and last[0] is nodes:
        return last[1]
    answer = all(list(n.gpus) == sorted(n.gpus) for n in nodes)
    _last_ascending.entry = (nodes, answer)
    return answer


def by_node(refs: Iterable[GpuRef]) -> dict[str, set[int]]:
    """GPU references as indices per node."""
    out: dict[str, set[int]] = {}
    for g in refs:
        held = out.get(g.node)
        if held is None:
            out[g.node] = {g.index}
        else:
            held.add(g.index)
    return out
