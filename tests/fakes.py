"""Scripted fake ports for driving the real control loop deterministically (fake clock, no
processes). They live in `lowtide.sim.scripted`, beside the loop harness that builds the
production loop over them (`lowtide.sim.harness.LoopHarness`); this module re-exports them.
"""

from __future__ import annotations

from lowtide.sim.scripted import FakeExecutor, FakeMetrics, FakeProcess, FakeServiceManager, MemoryArtifacts

__all__ = ["FakeExecutor", "FakeMetrics", "FakeProcess", "FakeServiceManager", "MemoryArtifacts"]
