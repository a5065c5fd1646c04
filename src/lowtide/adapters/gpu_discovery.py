"""Which GPUs this host has: NVML (nvidia-ml-py) when a driver is present, else nothing.

`wiring` uses it for nodes declared with ``gpus: auto``. On machines without NVIDIA GPUs
(laptops, CI) declare GPUs in lowtide.yaml instead (``gpus: 4``). Must not: cache results across
calls or guess counts.
"""

from __future__ import annotations

from dataclasses import dataclass


class GpuDiscoveryError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class DiscoveredGpu:
    index: int
    name: str
    uuid: str
    memory_bytes: int


def discover_gpus() -> list[DiscoveredGpu]:
    """The GPUs NVML reports, in index order. Raises GpuDiscoveryError when NVML is unavailable."""
    try:
        import pynvml  # noqa: PLC0415 (optional at run time: only hosts with a driver have it working)
    except ImportError as exc:  # pragma: no cover - the package is a dependency
        raise GpuDiscoveryError("nvidia-ml-py is not installed") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise GpuDiscoveryError(
            f"NVML is not available on this host ({exc}); declare the GPUs in lowtide.yaml, "
            "for example 'nodes: [{name: local, gpus: 4}]'"
        ) from exc
    try:
        found = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            found.append(
                DiscoveredGpu(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    memory_bytes=int(mem.total),
                )
            )
        return found
    finally:
        pynvml.nvmlShutdown()
