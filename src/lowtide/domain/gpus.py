"""GPU and node values: what the pool is made of. No discovery here (see adapters.gpu_discovery)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, order=True, slots=True)
class GpuRef:
    """One GPU: the node it lives on and its index there (as CUDA_VISIBLE_DEVICES counts)."""

    node: str
    index: int

    def __str__(self) -> str:
        return f"{self.node}:{self.index}"


@dataclass(frozen=True, slots=True)
class Node:
    """A host and the GPU indices lowtide manages on it; the memory of each GPU (GiB, None:
    unknown) and the host RAM sleeping replicas may hold there (GiB, None: no budget)."""

    name: str
    gpus: tuple[int, ...]
    gpu_memory_gib: float | None = None
    sleep_host_ram_gib: float | None = None
    _refs: tuple[GpuRef, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        # Built once: policies ask for every GPU of the pool several times a tick.
        object.__setattr__(self, "_refs", tuple(GpuRef(self.name, i) for i in self.gpus))

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def refs(self) -> tuple[GpuRef, ...]:
        return self._refs


def cuda_visible_devices(indices: tuple[int, ...]) -> str:
    """The CUDA_VISIBLE_DEVICES value for a set of GPU indices ("" for a CPU-only step)."""
    return ",".join(str(i) for i in sorted(indices))
