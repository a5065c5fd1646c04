"""GPU discovery through the real NVML library: on this kind of machine (no NVIDIA driver) it must
fail with a message that tells the operator to declare GPUs; on a GPU host it lists them."""

from __future__ import annotations

import pytest

from lowtide.adapters.gpu_discovery import GpuDiscoveryError, discover_gpus
from lowtide.config import ConfigError, Settings
from lowtide.wiring import resolve_nodes


def test_discovery_lists_gpus_or_says_how_to_declare_them() -> None:
    try:
        gpus = discover_gpus()
    except GpuDiscoveryError as exc:
        assert "declare the GPUs in lowtide.yaml" in str(exc)
        with pytest.raises(ConfigError, match=r"nodes\[0\]\.gpus: 'auto' needs NVML"):
            resolve_nodes(Settings(nodes=[{"name": "local", "gpus": "auto"}]))
        return
    assert [g.index for g in gpus] == list(range(len(gpus)))
    assert all(g.uuid.startswith("GPU-") and g.memory_bytes > 0 for g in gpus)
    (node,) = resolve_nodes(Settings(nodes=[{"name": "local", "gpus": "auto"}]))
    assert node.gpus == tuple(range(len(gpus)))


def test_declared_gpus_need_no_driver() -> None:
    nodes = resolve_nodes(Settings(nodes=[{"name": "a", "gpus": 3}, {"name": "b", "gpus": [4, 6]}]))
    assert [(n.name, n.gpus) for n in nodes] == [("a", (0, 1, 2)), ("b", (4, 6))]
