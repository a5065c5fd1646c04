"""What lowtide knows about an inference replica's load, as plain values (docs/architecture.md §2 "load").

`ReplicaScrape` is one normalised reading of a replica's vLLM metrics (counters cumulative, as
exposed); `ReplicaSignals` is what a window of readings says (rates, quantiles, staleness). A
metric that a replica does not expose is ``None`` (unknown), never 0: policies must treat
unknown as "do not lend on this", not as "no load".
Neighbours: `adapters.vllm_metrics` builds scrapes from `/metrics` text; `policy.signals` turns a
window of scrapes into signals; the PromQL source builds signals directly from Prometheus.
Must not: parse text, do I/O or read the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

MetricsVersion = Literal["v0", "v1"]
#: A server's sleep state from ``vllm:engine_sleep_state``: every engine awake, or asleep at level 1
#: (``weights_offloaded``), 2 (``discard_all``) or 0 (``asleep``: no label at 1); ``mixed`` when its
#: engines disagree.
SleepState = Literal["awake", "weights_offloaded", "discard_all", "asleep", "mixed"]


@dataclass(frozen=True, slots=True)
class Histogram:
    """A cumulative histogram as exposed: `buckets` are (upper bound, cumulative count), +Inf last."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float


@dataclass(frozen=True, slots=True)
class ReplicaScrape:
    """One reading of one replica's `/metrics`, summed over vLLM engines (data parallelism)."""

    at: float
    ok: bool = True
    error: str | None = None  # why the scrape failed (timeout, HTTP 500, garbage...)
    version: MetricsVersion | None = None
    model: str | None = None
    running: float | None = None  # vllm:num_requests_running
    waiting: float | None = None  # vllm:num_requests_waiting
    kv_usage: float | None = None  # vllm:kv_cache_usage_perc | gpu_cache_usage_perc, 0..1
    kv_capacity_tokens: float | None = None  # cache_config_info num_gpu_blocks × block_size
    prompt_tokens_total: float | None = None  # vllm:prompt_tokens_total (counter)
    generation_tokens_total: float | None = None  # vllm:generation_tokens_total (counter)
    requests_total: float | None = None  # vllm:request_success_total summed over finish reasons
    ttft: Histogram | None = None  # vllm:time_to_first_token_seconds
    e2e: Histogram | None = None  # vllm:e2e_request_latency_seconds
    itl: Histogram | None = None  # vllm:inter_token_latency_seconds | time_per_output_token_seconds
    problems: tuple[str, ...] = ()  # what was odd but not fatal (NaN values, missing families...)
    # Newer vLLM only (absent on older servers: None); adapters.vllm_metrics cites the source.
    waiting_capacity: float | None = None  # vllm:num_requests_waiting_by_reason{reason="capacity"}
    waiting_deferred: float | None = None  # vllm:num_requests_waiting_by_reason{reason="deferred"}
    preemptions_total: float | None = None  # vllm:num_preemptions_total (counter)
    sleep_state: SleepState | None = None  # vllm:engine_sleep_state, one-hot per engine


@dataclass(frozen=True, slots=True)
class ReplicaSignals:
    """What a window of readings says about one replica's load now."""

    replica: str
    at: float
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    kv_tokens_used: float | None = None  # kv_usage × capacity
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    requests_per_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    ttft_p99_s: float | None = None
    e2e_p50_s: float | None = None
    e2e_p90_s: float | None = None
    e2e_p99_s: float | None = None
    waiting_capacity: float | None = None  # waiting for KV cache or max_num_seqs (newer vLLM)
    waiting_deferred: float | None = None  # deferred (LoRA budget, KV transfer, blocked)
    preemptions_per_s: float | None = None  # rate of vllm:num_preemptions_total over the window
    sleep_state: SleepState | None = None
    stale: bool = False
    stale_reason: str = ""
    stale_since: float | None = None  # when the data stopped being trustworthy

    @property
    def concurrency(self) -> float | None:
        """Requests in the replica: running + waiting (unknown if either is)."""
        if self.running is None or self.waiting is None:
            return None
        return self.running + self.waiting

    @property
    def kv_pressure(self) -> bool | None:
        """Whether the KV cache is short: vLLM preempted running requests in the window (it does so
        only when it cannot allocate KV blocks for them) while requests wait. Waiting counts those
        waiting for capacity where the server says so, else all. None when either is unknown."""
        waiting = self.waiting_capacity if self.waiting_capacity is not None else self.waiting
        if self.preemptions_per_s is None or waiting is None:
            return None
        return self.preemptions_per_s > 0 and waiting > 0


@dataclass(frozen=True, slots=True)
class ServiceSignals:
    """A service's load: its replicas' signals (sums and means are derived by the policies)."""

    service: str
    at: float
    replicas: tuple[ReplicaSignals, ...] = field(default_factory=tuple)
    source_error: str | None = None  # the whole source failed (Prometheus down, bad query...)
