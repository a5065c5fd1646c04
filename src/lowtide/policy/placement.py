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
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from lowtide.domain.gpus import GpuRef, Node
from lowtide.policy.snapshot import Snapshot

_NO_EXCLUSIONS: frozenset[str] = frozenset()


class FreeGpus:
    """Free GPU indices per node, bucketed by free count."""

    __slots__ = ("_buckets", "_capacity", "_free", "_sorted", "_top")

    def __init__(self, free: Mapping[str, Iterable[int]], capacity: Mapping[str, int]) -> None:
        """`free`: node → free GPU indices; `capacity`: node → GPUs lowtide may ever use there
        (the node's GPUs minus the unavailable ones, whether free or held by a step now)."""
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
        """The nodes' GPUs minus those of running steps, minus `snapshot.unavailable`."""
        held: dict[str, set[int]] = {}
        for step in snapshot.running:
            mine = held.get(step.node)
            if mine is None:
                held[step.node] = set(step.gpus)
            else:
                mine.update(step.gpus)
        free: dict[str, list[int]] = {}
        capacity: dict[str, int] = {}
        for name, usable in _usable(snapshot.nodes, snapshot.unavailable):
            capacity[name] = len(usable)
            busy = held.get(name)
            free[name] = [i for i in usable if i not in busy] if busy else list(usable)
        return cls(free, capacity)

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

    def largest_capacity(self) -> int:
        return max(self._capacity.values(), default=0)

    def best_fit(self, gpus: int, excluded_nodes: Collection[str] = _NO_EXCLUSIONS) -> str | None:
        """The node with the fewest free GPUs that still has `gpus` free; ties by name."""
        if gpus < 1:
            raise ValueError(f"best_fit needs at least 1 GPU, got {gpus}")
        for count in range(gpus, self._top + 1):
            if self._buckets[count]:
                node = self._first_in_bucket(count, excluded_nodes)
                if node is not None:
                    return node
        return None

    def largest_free_block(self, excluded_nodes: Collection[str] = _NO_EXCLUSIONS) -> int:
        """The most free GPUs on any one node outside `excluded_nodes` (0 when none is free)."""
        for count in range(self._top, 0, -1):
            if self._buckets[count] and self._first_in_bucket(count, excluded_nodes) is not None:
                return count
        return 0

    def most_free_with_capacity(
        self, gpus: int, excluded_nodes: Collection[str] = _NO_EXCLUSIONS
    ) -> str | None:
        """Among nodes whose capacity is ≥ `gpus`, the one with the most free GPUs (ties: name).

        This is where a blocked step can wait with the least still to free up.
        """
        for count in range(self._top, -1, -1):
            if not self._buckets[count]:
                continue
            for node in self._sorted_bucket(count):
                if node not in excluded_nodes and self._capacity[node] >= gpus:
                    return node
        return None

    # --- the one mutation --------------------------------------------------------------------

    def take(self, node: str, gpus: int) -> tuple[int, ...]:
        """Take the `gpus` lowest free indices on `node`; raises ValueError if too few are free."""
        free = self._free[node]
        before = len(free)
        if gpus < 0 or gpus > before:
            raise ValueError(f"cannot take {gpus} GPUs on {node}: {before} free")
        taken = tuple(free[:gpus])
        del free[:gpus]
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
