"""Inference services as values: what a service is, how it scales, how it parks, and when GPUs may
be lent (docs/architecture.md §2: service, replica, desired replicas, envelope, park/unpark, window).

Built from `config.ServiceConfig` / `config.LendingConfig` by `wiring`; consumed by the pure
policies (`policy.autoscale`, `policy.lending`) and the loop. Must not: do I/O or read the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ParkMode = Literal["stop", "sleep"]
SleepLevel = Literal[1, 2]
LendingMode = Literal["window", "continuous", "forecast"]


@dataclass(frozen=True, slots=True)
class AutoscaleTargets:
    """Per-replica targets; a signal whose target is None is not used."""

    concurrency_per_replica: float | None = 32.0  # running + waiting requests per replica
    kv_usage: float | None = 0.8  # KV-cache usage per replica (0..1)
    generation_tokens_per_s_per_replica: float | None = None  # a replica's decode capacity
    token_utilization: float = 0.8  # aim for this fraction of the token capacity
    ttft_p90_slo_s: float | None = None  # guard: above it, never scale down and add one replica
    #: the stable window: go up to what the load asked for during the whole window (its lowest)
    scale_up_window_s: float = 30.0
    scale_down_stabilization_s: float = 300.0  # go down to the highest ask of this window
    #: the burst guard: a scale-down undone within two windows doubles the service's window, up
    #: to this (= scale_down_stabilization_s: off) ...
    max_scale_down_stabilization_s: float = 3600.0
    #: ... and a lengthened window halves again after each burst_memory_s without one
    burst_memory_s: float = 86400.0
    tolerance: float = 0.1  # ignore changes within ±10 % of the current replica count
    #: the up / down band (None: `tolerance`); the down one also bounds the flap guard
    scale_up_tolerance: float | None = None
    scale_down_tolerance: float | None = None
    #: the panic window (None: 10 % of scale_up_window_s); it acts alone only when its ask is at
    #: least panic_threshold × the serving replicas, and holds scale-downs for a stable window
    panic_window_s: float | None = None
    panic_threshold: float = 2.0
    #: one scale-up within any scale_up_window_s goes at most to
    #: max(⌈floor × max_scale_up_rate⌉, floor + max_scale_up_step) (floor: the window's lowest
    #: needed count); None: no cap
    max_scale_up_rate: float | None = 2.0
    max_scale_up_step: int = 1
    #: metrics unknown for fallback_after_s: desired = this (None: hold what was decided)
    fallback_replicas: int | None = None
    fallback_after_s: float = 60.0

    @property
    def up_tolerance(self) -> float:
        return self.tolerance if self.scale_up_tolerance is None else self.scale_up_tolerance

    @property
    def down_tolerance(self) -> float:
        return self.tolerance if self.scale_down_tolerance is None else self.scale_down_tolerance

    @property
    def panic_s(self) -> float:
        return 0.1 * self.scale_up_window_s if self.panic_window_s is None else self.panic_window_s


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
    #: vLLM sleep level for `park: sleep`: 1 keeps the weights in host RAM, 2 discards them (the
    #: wake reloads them from disk); docs/architecture.md §4.2.
    sleep_level: SleepLevel = 1
    #: GPU memory (GiB, per GPU) a sleeping replica still holds: CUDA graphs, NCCL buffers, the
    #: CUDA context. A step lent such a GPU gets the rest as its limit.
    sleep_residual_gib: float = 2.0
    #: Host RAM (GiB) one level-1 sleeping replica holds: its weights (None: unknown).
    weights_host_gib: float | None = None

    @property
    def sleep_host_gib(self) -> float | None:
        """Host RAM one sleeping replica holds: 0 at level 2 (weights discarded), else the
        weights (None: unknown)."""
        return 0.0 if self.sleep_level == 2 else self.weights_host_gib

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
