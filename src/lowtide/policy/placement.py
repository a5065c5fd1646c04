"""Best-fit placement of a step on the GPUs of one node.

Role: keep track of which GPUs are free while one decision hands them out, and answer
"which node should a step needing g GPUs go on?" in a few dictionary lookups. A step goes on
the node whose free-GPU count is the *smallest that is still ≥ g* (best fit: it keeps the large
free blocks whole for the large steps behind it); ties go to the node name (plain string
order); within the node it takes the lowest free indices.

Neighbours: built from a `policy.snapshot.Snapshot`; used by `policy.scheduler.decide`.
Must not: read the world or mutate the snapshot. `FreeGpus` is a working copy that belongs to
one decision and is thrown away with it.

Nodes sit in buckets by free count, so a lookup walks at most one bucket per possible count
(≤ GPUs per node, 8 in practice) instead of every node. Each bucket keeps its names sorted
lazily: sorting happens only after a `take` changed it, and takes are rare next to lookups
(most queued steps only ask and wait). The usable GPUs of each node (`_usable`: the pool minus
the unavailable set) are remembered by the identity of the nodes and the set, which the loop
hands every decision unchanged while inference keeps the same GPUs: a pure memo, never stale.

GPU memory (docs/architecture.md §4.2). A GPU under a sleeping replica is lent but not empty: it has
`GpuShare.limit_gib` left (the node's GPU memory − the replica's residual; `Snapshot.gpu_shares`).
A step that declares `gpu_memory_gib` (per GPU) is placed only on GPUs with at least that much:
a GPU under no sleeping replica counts as whole (its node's memory when known; unknown: allowed),
one under a sleeping replica whose node's memory is unknown is *not* allowed (conservative: what
is left there cannot be known). Best fit is unchanged for it (smallest free count first), it just
skips nodes with too few such GPUs. Reservations count only such GPUs too (`capacity_for`), so a
step is never held waiting for GPUs it can never use. Steps without a need: among equally good
fits (the same free count) the node where the take includes the fewest GPUs under sleeping
replicas comes first, and within a node those GPUs are taken last; with no sleeping replica's
residual anywhere (`gpu_shares` empty) nothing differs from plain best fit. `_usable` does not
read the shares, so its memo keys stay what they were; the nodes' GPU memory (`_memory_of`) is
remembered by the identity of the kept `nodes` tuple (`policy.memo.Last`), its only input. The
running steps' GPUs per node (`_held`, also for a new tuple of steps on the same GPUs), the
shares by node (`_by_node`) and each node's free GPUs, capacity and shares (`_parts`) are kept
from the last decision for the same inputs; the constructor copies what a decision changes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from types import MappingProxyType

from lowtide.domain.gpus import GpuRef, Node
from lowtide.policy.lending import GpuShare
from lowtide.policy.memo import Last
from lowtide.policy.snapshot import RunningStep, Snapshot

_NO_EXCLUSIONS: frozenset[str] = frozenset()


class FreeGpus:
    """Free GPU indices per node, bucketed by free count."""

    __slots__ = ("_buckets", "_capacity", "_free", "_memory", "_shares", "_sorted", "_top")

    def __init__(
        self,
        free: Mapping[str, Iterable[int]],
        capacity: Mapping[str, int],
        *,
        shares: Mapping[str, Mapping[int, GpuShare]] | None = None,
        memory: Mapping[str, float | None] | None = None,
    ) -> None:
        """`free`: node → free GPU indices; `capacity`: node → GPUs lowtide may ever use there
        (the node's GPUs minus the unavailable ones, whether free or held by a step now);
        `shares`: node → its GPUs among those under a sleeping replica (`GpuShare`); `memory`:
        node → GPU memory in GiB (absent or None: unknown)."""
        self._shares: dict[str, Mapping[int, GpuShare]] = {n: m for n, m in (shares or {}).items() if m}
        self._memory: Mapping[str, float | None] = memory or {}
        self._free: dict[str, list[int]] = {node: sorted(indices) for node, indices in free.items()}
        self._capacity: dict[str, int] = {node: capacity.get(node, 0) for node in self._free}
        self._top = max((len(idx) for idx in self._free.values()), default=0)
        self._top = max(self._top, max(self._capacity.values(), default=0))
        self._buckets: list[set[str]] = [set() for _ in range(self._top + 1)]
        for node, indices in self._free.items():
            self._buckets[len(indices)].add(node)
        # Sorted view of each bucket, or None when a take changed the bucket since last sorted.
        self._sorted: list[list[str] | None] = [None] * (self._top + 1)

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot) -> FreeGpus:
        """The nodes' GPUs minus those of running steps, minus `snapshot.unavailable`.

        Its parts are kept from the last call for the same running steps' GPUs (`_held`), the
        same usable GPUs (`_usable`) and the same read-only shares: the loop hands most ticks
        the same ones (the constructor copies what a decision changes)."""
        held = _held(snapshot.running)
        usable = _usable(snapshot.nodes, snapshot.unavailable)
        gpu_shares = snapshot.gpu_shares
        shares_key: object = (
            gpu_shares if type(gpu_shares) is MappingProxyType else (_EMPTY if not gpu_shares else None)
        )
        last = _last_parts.entry
        if (
            last is not None
            and shares_key is not None
            and last[0] is held
            and last[1] is usable
            and last[2] is shares_key
        ):
            free, capacity, shares = last[3]
        else:
            free, capacity, shares = _parts(held, usable, gpu_shares)
            _last_parts.entry = (held, usable, shares_key, (free, capacity, shares))
        return cls(free, capacity, shares=shares, memory=_memory_of(snapshot.nodes))

    # --- queries -----------------------------------------------------------------------------

    def nodes(self) -> list[str]:
        return sorted(self._free)

    def free_count(self, node: str) -> int:
        return len(self._free[node])

    def free_indices(self, node: str) -> tuple[int, ...]:
        return tuple(self._free[node])

    def capacity(self, node: str) -> int:
        """GPUs on `node` that lowtide may use at all (free or held by steps, not unavailable)."""
        return self._capacity[node]

    def largest_capacity(self, need_gib: float | None = None) -> int:
        if need_gib is None:
            return max(self._capacity.values(), default=0)
        return max((self.capacity_for(node, need_gib) for node in self._free), default=0)

    def capacity_for(self, node: str, need_gib: float | None) -> int:
        """`capacity`, counting only GPUs with at least `need_gib` GiB left (None: every one)."""
        if need_gib is None:
            return self._capacity[node]
        if not self._node_has(node, need_gib):
            return 0
        shares = self._shares.get(node)
        if not shares:
            return self._capacity[node]
        return self._capacity[node] - sum(1 for share in shares.values() if not _enough(share, need_gib))

    def free_for(self, node: str, need_gib: float | None) -> int:
        """Free GPUs on `node` with at least `need_gib` GiB left (None: every free GPU)."""
        return len(self._eligible(node, need_gib))

    def has_shares(self) -> bool:
        """Whether any usable GPU is under a sleeping replica that still holds memory."""
        return bool(self._shares)

    def best_fit(
        self, gpus: int, excluded_nodes: Collection[str] = _NO_EXCLUSIONS, need_gib: float | None = None
    ) -> str | None:
        """The node with the fewest free GPUs that still has `gpus` free (with at least `need_gib`
        GiB left each, when given); ties: the fewest GPUs under sleeping replicas taken, then name."""
        if gpus < 1:
            raise ValueError(f"best_fit needs at least 1 GPU, got {gpus}")
        if need_gib is None and not self._shares:
            for count in range(gpus, self._top + 1):
                if self._buckets[count]:
                    node = self._first_in_bucket(count, excluded_nodes)
                    if node is not None:
                        return node
            return None
        for count in range(gpus, self._top + 1):
            if not self._buckets[count]:
                continue
            best: str | None = None
            best_shared = 0
            for node in self._sorted_bucket(count):
                if node in excluded_nodes:
                    continue
                eligible = self._eligible(node, need_gib)
                if len(eligible) < gpus:
                    continue
                shared = self._shared_taken(node, eligible, gpus)
                if shared == 0:
                    return node  # the first by name that takes no shared GPU: nothing fits better
                if best is None or shared < best_shared:
                    best, best_shared = node, shared
            if best is not None:
                return best
        return None

    def largest_free_block(
        self, excluded_nodes: Collection[str] = _NO_EXCLUSIONS, need_gib: float | None = None
    ) -> int:
        """The most free GPUs (with `need_gib` GiB left, when given) on any one node outside
        `excluded_nodes` (0 when none is free)."""
        if need_gib is not None:
            return max(
                (self.free_for(node, need_gib) for node in self._free if node not in excluded_nodes),
                default=0,
            )
        for count in range(self._top, 0, -1):
            if self._buckets[count] and self._first_in_bucket(count, excluded_nodes) is not None:
                return count
        return 0

    def most_free_with_capacity(
        self, gpus: int, excluded_nodes: Collection[str] = _NO_EXCLUSIONS, need_gib: float | None = None
    ) -> str | None:
        """Among nodes whose capacity is ≥ `gpus`, the one with the most free GPUs (ties: name);
        with `need_gib`, capacity and free GPUs count only GPUs with that much left.

        This is where a blocked step can wait with the least still to free up.
        """
        if need_gib is not None:
            fits = [
                (-self.free_for(node, need_gib), node)
                for node in self._free
                if node not in excluded_nodes and self.capacity_for(node, need_gib) >= gpus
            ]
            return min(fits)[1] if fits else None
        for count in range(self._top, -1, -1):
            if not self._buckets[count]:
                continue
            for node in self._sorted_bucket(count):
                if node not in excluded_nodes and self._capacity[node] >= gpus:
                    return node
        return None

    def memory_shortfall(
        self, need_gib: float, excluded_nodes: Collection[str] = _NO_EXCLUSIONS, *, free_only: bool = True
    ) -> list[str]:
        """Why GPUs outside `excluded_nodes` lack `need_gib` GiB, grouped, e.g. "4 GPUs under
        sleeping replicas have 76 − 8 = 68 GiB free" (empty: none lacks it). The free GPUs, or
        with `free_only` False every GPU lowtide may use (free or held by a step now)."""
        small: dict[float, int] = {}  # node memory below the need -> GPUs
        shared: dict[tuple[float | None, float, float | None], int] = {}  # (memory, reserved, limit)
        for node in sorted(self._free):
            if node in excluded_nodes:
                continue
            total = self._memory.get(node)
            if total is not None and total < need_gib:
                n = len(self._free[node]) if free_only else self._capacity[node]
                if n:
                    small[total] = small.get(total, 0) + n
                continue
            shares = self._shares.get(node) or {}
            if not shares:
                continue
            for i in self._free[node] if free_only else shares:
                share = shares.get(i)
                if share is not None and not _enough(share, need_gib):
                    key = (total, share.reserved_gib, share.limit_gib)
                    shared[key] = shared.get(key, 0) + 1
        out = [
            f"{_gpus(n)} {'has' if n == 1 else 'have'} only {gib(m)} GiB" for m, n in sorted(small.items())
        ]
        for (total, reserved, limit), n in sorted(
            shared.items(), key=lambda kv: (kv[0][2] is None, kv[0][2] or 0)
        ):
            under = f"{_gpus(n)} under sleeping replicas"
            if total is None or limit is None:
                out.append(
                    f"{under} {'holds' if n == 1 else 'hold'} {gib(reserved)} GiB of an unknown GPU memory "
                    "(not lent to a step that "
                    "declares a need; set the node's gpu_memory_gib)"
                )
            else:
                verb = "has" if n == 1 else "have"
                out.append(f"{under} {verb} {gib(total)} − {gib(reserved)} = {gib(limit)} GiB free")
        return out

    # --- the one mutation --------------------------------------------------------------------

    def take(self, node: str, gpus: int, need_gib: float | None = None) -> tuple[int, ...]:
        """Take `gpus` free GPUs on `node`: the lowest indices, those under sleeping replicas
        last, only those with `need_gib` GiB left when given; raises ValueError if too few."""
        free = self._free[node]
        before = len(free)
        if need_gib is None and node not in self._shares:
            if gpus < 0 or gpus > before:
                raise ValueError(f"cannot take {gpus} GPUs on {node}: {before} free")
            taken = tuple(free[:gpus])
            del free[:gpus]
        else:
            eligible = self._eligible(node, need_gib)
            if gpus < 0 or gpus > len(eligible):
                what = "free" if need_gib is None else f"free with {gib(need_gib)} GiB"
                raise ValueError(f"cannot take {gpus} GPUs on {node}: {len(eligible)} {what}")
            shares = self._shares.get(node) or {}
            ordered = [i for i in eligible if i not in shares] + [i for i in eligible if i in shares]
            taken = tuple(sorted(ordered[:gpus]))
            gone = set(taken)
            free[:] = [i for i in free if i not in gone]
        after = len(free)
        if after != before:
            self._buckets[before].discard(node)
            self._buckets[after].add(node)
            self._sorted[before] = None
            self._sorted[after] = None
        return taken

    # --- internals ---------------------------------------------------------------------------

    def _sorted_bucket(self, count: int) -> list[str]:
        ordered = self._sorted[count]
        if ordered is None:
            ordered = self._sorted[count] = sorted(self._buckets[count])
        return ordered

    def _first_in_bucket(self, count: int, excluded_nodes: Collection[str]) -> str | None:
        for node in self._sorted_bucket(count):
            if node not in excluded_nodes:
                return node
        return None

    def _node_has(self, node: str, need_gib: float) -> bool:
        """The node's GPUs are big enough (unknown memory: taken as big enough, whole GPUs)."""
        total = self._memory.get(node)
        return total is None or total >= need_gib

    def _eligible(self, node: str, need_gib: float | None) -> list[int]:
        """The free GPUs of `node` a step needing `need_gib` GiB per GPU may take (ascending)."""
        free = self._free[node]
        if need_gib is None:
            return free
        if not self._node_has(node, need_gib):
            return []
        shares = self._shares.get(node)
        if not shares:
            return free
        return [i for i in free if (share := shares.get(i)) is None or _enough(share, need_gib)]

    def _shared_taken(self, node: str, eligible: list[int], gpus: int) -> int:
        """How many GPUs under sleeping replicas a take of `gpus` from `eligible` includes."""
        shares = self._shares.get(node)
        if not shares:
            return 0
        plain = sum(1 for i in eligible if i not in shares)
        return max(0, gpus - plain)


def _enough(share: GpuShare, need_gib: float) -> bool:
    """A GPU under a sleeping replica has `need_gib` left; unknown memory: no (conservative)."""
    return share.limit_gib is not None and share.limit_gib >= need_gib


#: The last nodes `_memory_of` looked at and its answer (the loop passes the same tuple each tick).
_Parts = tuple[dict[str, list[int]], dict[str, int], dict[str, dict[int, GpuShare]]]
_EMPTY = object()  # no GPU shares (an empty mapping), as the key of `_last_parts`
#: The last `_parts`, with the very held GPUs, usable GPUs and shares (or `_EMPTY`) it came from.
_last_parts: Last[tuple[Mapping[str, frozenset[int]], _Usable, object, _Parts]] = Last()


def _parts(
    held: Mapping[str, frozenset[int]], usable: _Usable, gpu_shares: Mapping[GpuRef, GpuShare]
) -> _Parts:
    """Each node's free GPUs, capacity and usable GPUs under sleeping replicas (`from_snapshot`)."""
    free: dict[str, list[int]] = {}
    capacity: dict[str, int] = {}
    shared = _by_node(gpu_shares)
    shares: dict[str, dict[int, GpuShare]] = {}
    for name, indices in usable:
        capacity[name] = len(indices)
        busy = held.get(name)
        free[name] = [i for i in indices if i not in busy] if busy else list(indices)
        under = shared.get(name)
        if under:  # only the usable ones: capacity_for counts them
            shares[name] = {i: under[i] for i in indices if i in under}
    return free, capacity, shares


#: The last `_held`, with the very tuple of running steps it came from (immutable).
_last_held: Last[tuple[tuple[RunningStep, ...], Mapping[str, frozenset[int]]]] = Last()


def _held(running: tuple[RunningStep, ...]) -> Mapping[str, frozenset[int]]:
    """The running steps' GPU indices per node (read-only). Kept for the same tuple, and for a
    new tuple whose steps hold the same GPUs of the same nodes in the same order (a checkpoint
    moved only a step's `last_checkpoint_at`): then the same object is handed back."""
    last = _last_held.entry
    if last is not None:
        if last[0] is running:
            return last[1]
        if len(last[0]) == len(running) and all(
            a is b or (a.gpus == b.gpus and a.node == b.node) for a, b in zip(last[0], running, strict=True)
        ):
            _last_held.entry = (running, last[1])
            return last[1]
    held: dict[str, set[int]] = {}
    for step in running:
        mine = held.get(step.node)
        if mine is None:
            held[step.node] = set(step.gpus)
        else:
            mine.update(step.gpus)
    result = MappingProxyType({node: frozenset(v) for node, v in held.items()})
    _last_held.entry = (running, result)
    return result


_last_memory: Last[tuple[tuple[Node, ...], Mapping[str, float | None]]] = Last()


def _memory_of(nodes: tuple[Node, ...]) -> Mapping[str, float | None]:
    """Each node's GPU memory (GiB, None: unknown), read-only; remembered by the identity of the
    kept `nodes` tuple (policy.memo), so not rebuilt at every decision."""
    last = _last_memory.entry
    if last is not None and last[0] is nodes:
        return last[1]
    memory = MappingProxyType({node.name: node.gpu_memory_gib for node in nodes})
    _last_memory.entry = (nodes, memory)
    return memory


#: The last `_by_node`, with the very read-only shares mapping it came from.
_last_by_node: Last[tuple[Mapping[GpuRef, GpuShare], dict[str, dict[int, GpuShare]]]] = Last()


def _by_node(shares: Mapping[GpuRef, GpuShare]) -> dict[str, dict[int, GpuShare]]:
    """The shares by node and GPU index (the caller only reads it). Kept for the same read-only
    mapping (the loop hands the inference half's, unchanged while the sleeping replicas are)."""
    last = _last_by_node.entry
    if last is not None and last[0] is shares:
        return last[1]
    out: dict[str, dict[int, GpuShare]] = {}
    for ref, share in shares.items():
        out.setdefault(ref.node, {})[ref.index] = share
    if type(shares) is MappingProxyType:
        _last_by_node.entry = (shares, out)
    return out


def gib(x: float) -> str:
    """GiB as a person reads it: 76, 67.5 (one decimal at most)."""
    return f"{x:.1f}".removesuffix(".0")


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


# --- the usable GPUs of the pool -------------------------------------------------------------------

_Usable = tuple[tuple[str, tuple[int, ...]], ...]
# (id(nodes), id(unavailable)) -> (nodes, unavailable, usable): the arguments are kept, so their ids
# cannot be reused while the entry lives, and a hit is checked by identity.
_USABLE: dict[tuple[int, int], tuple[tuple[Node, ...], frozenset[GpuRef], _Usable]] = {}
_USABLE_MAX = 64


def _usable(nodes: tuple[Node, ...], unavailable: frozenset[GpuRef]) -> _Usable:
    """Each node's GPU indices that are not `unavailable`, in the node's order: (name, indices).

    A pure function of its arguments, remembered by their identity: the loop hands every decision
    the same `nodes` and, while inference keeps the same GPUs, the same `unavailable` set, so the
    pool is not walked GPU by GPU at every tick.
    """
    key = (id(nodes), id(unavailable))
    hit = _USABLE.get(key)
    if hit is not None and hit[0] is nodes and hit[1] is unavailable:
        return hit[2]
    out: dict[str, set[int]] = {}
    for ref in unavailable:
        out.setdefault(ref.node, set()).add(ref.index)
    usable = tuple(
        (
            node.name,
            tuple(i for i in node.gpus if i not in excluded)
            if (excluded := out.get(node.name))
            else node.gpus,
        )
        for node in nodes
    )
    if len(_USABLE) >= _USABLE_MAX:
        _USABLE.clear()
    _USABLE[key] = (nodes, unavailable, usable)
    return usable
