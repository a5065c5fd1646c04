"""Inference services as values: what a service is, how it scales, how it parks, and when GPUs may
be lent (docs/architecture.md §2: service, replica, desired replicas, envelope, park/unpark, window).

Built from `config.ServiceConfig` / `config.LendingConfig` by `wiring`; consumed by the pure
policies (`policy.autoscale`, `policy.lending`) and the loop. Must not: do I/O or read the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ParkMode = Literal["stop", "sleep"]
LendingMode = Literal["window", "continuous", "forecast"]


@dataclass(frozen=True, slots=True)
class AutoscaleTargets:
    """Per-replica targets; a signal whose target is None is not used."""

    concurrency_per_replica: float | None = 32.0  # running + waiting requests per replica
    kv_usage: float | None = 0.8  # KV-cache usage per replica (0..1)
    generation_tokens_per_s_per_replica: float | None = None  # a replica's decode capacity
    token_utilization: float = 0.8  # aim for this fraction of the token capacity
    ttft_p90_slo_s: float | None = None  # guard: above it, never scale down and add one replica
    scale_up_window_s: float = 30.0  # recommendations are maxed over this window to go up fast
    scale_down_stabilization_s: float = 300.0  # ... and over this one before going down
    tolerance: float = 0.1  # ignore changes within ±10 % of the current replica count
    #: scale down only to a count that carries the load at (1 − this) of each target
    scale_down_tolerance: float = 0.1


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    name: str
    model: str
    gpus_per_replica: int
    min_replicas: int = 1
    max_replicas: int = 1
    headroom_replicas: int = 0  # kept on top of what the load needs
    min_safe_replicas: int = 1  # kept (reclaimed if needed) when metrics are stale too long
    park: ParkMode = "stop"
    startup_s: float = 120.0  # expected cold start (process start to healthy)
    wake_s: float = 10.0  # expected wake from sleep
    autoscale: AutoscaleTargets = field(default_factory=AutoscaleTargets)

    @property
    def unpark_s(self) -> float:
        """How long it takes to get a parked replica serving again."""
        return self.wake_s if self.park == "sleep" else self.startup_s


@dataclass(frozen=True, slots=True)
class TimeWindow:
    """A local-time range, e.g. 20:00–08:00 (crossing midnight is allowed)."""

    start_minute: int  # minutes after local midnight, 0..1439
    end_minute: int

    def contains(self, minute_of_day: int) -> bool:
        if self.start_minute <= self.end_minute:
            return self.start_minute <= minute_of_day < self.end_minute
        return minute_of_day >= self.start_minute or minute_of_day < self.end_minute


@dataclass(frozen=True, slots=True)
class LendingPolicy:
    mode: LendingMode = "continuous"
    windows: tuple[TimeWindow, ...] = ()  # for mode "window"
    timezone: str = "UTC"  # IANA name; windows and the weekly profile are in this local time
    reclaim_lead_s: float = 60.0  # time to get GPUs back and a replica serving (tick+grace+unpark)
    stale_after_s: float = 30.0  # signals older than this are stale: lend nothing new
    stale_reclaim_after_s: float = 120.0  # stale this long: reclaim up to min_safe_replicas
