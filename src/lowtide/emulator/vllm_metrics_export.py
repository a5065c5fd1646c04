"""The emulator's `/metrics`: an `Engine`'s state in vLLM's exact Prometheus exposition.

Role: render what the engine recorded under vLLM's names, types, help texts, label names and
bucket boundaries, so that lowtide's metrics adapter (and Prometheus) cannot tell the emulator
from a real server. A custom collector reads the engine at scrape time into a dedicated
`CollectorRegistry` (no global registry, no process metrics); `prometheus_client.generate_latest`
writes the text, as it does inside vLLM.

``v1`` (default; vLLM's V1 engine, vllm/v1/metrics/loggers.py): every series has
``model_name`` and ``engine="0"``; counters and histograms carry ``<name>_created`` series (V1
does not disable them); ``vllm:kv_cache_usage_perc`` and ``vllm:inter_token_latency_seconds``;
``vllm:request_success_total`` has a series for every finish reason (stop, length, abort) from the
start. ``v0`` (vLLM's V0 engine, vllm/engine/metrics.py of 0.8–0.10): ``model_name`` only, no
``_created`` series (V0 called ``disable_created_metrics()``), ``vllm:gpu_cache_usage_perc``,
``vllm:cpu_cache_usage_perc``, ``vllm:num_requests_swapped`` and
``vllm:time_per_output_token_seconds``; a finish reason appears once a request finished with it.
Both expose ``vllm:cache_config_info`` (a gauge at 1 whose labels carry ``num_gpu_blocks`` and
``block_size``: the KV capacity in tokens is their product). V1 also exports, as current vLLM
does (vllm/v1/metrics/loggers.py, checked on the 0.33 line; docs/vllm.md):
``vllm:engine_sleep_state{sleep_state="awake"|"weights_offloaded"|"discard_all"}`` (one-hot: awake 1,
or level 1 → weights_offloaded 1, level 2 → discard_all 1, level 0 → all 0),
``vllm:num_requests_waiting_by_reason{reason="capacity"|"deferred"}`` (summing to
``num_requests_waiting``, as vLLM sets it: ``capacity`` = the scheduler's waiting requests,
``deferred`` = its skipped ones; every waiting request of the emulator waits for capacity, held
ones during a sleep included) and the
prefix-cache counters ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (in
tokens; the emulator caches no prefixes, so hits stay 0).

Data parallelism (`engine.EngineGroup`, ``--data-parallel-size N``, V1 only): every family has one
series per engine, ``engine="0"`` .. ``engine="N-1"`` (vLLM's ``PrometheusStatLogger`` keeps one
labelled child per engine index), each with that engine's own numbers.

Neighbours: `emulator.engine` (the numbers), `emulator.server` (serves `render()` at `/metrics`).
Must not: change the engine (a scrape only reads it; the server advances the engine's clock first).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import cast

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import utils as prometheus_utils
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from lowtide.domain.metrics import MetricsVersion
from lowtide.emulator.engine import FINISH_REASONS, BucketHistogram, Engine, EngineGroup, EngineLike

Labels = dict[str, str]
# How prometheus_client writes a bucket bound ("0.001", "1.0", "+Inf"); the library leaves it untyped.
float_to_go_string = cast(Callable[[float], str], prometheus_utils.floatToGoString)


class VllmMetricsExporter:
    """`render()` gives the engine's `/metrics` text in vLLM's V1 or V0 exposition."""

    def __init__(
        self,
        engine: EngineLike,
        model_name: str,
        version: MetricsVersion = "v1",
        *,
        created: float | None = None,
    ) -> None:
        if version not in ("v0", "v1"):
            raise ValueError(f"metrics version must be 'v0' or 'v1', not {version!r}")
        self.engine = engine
        self.engines: tuple[Engine, ...] = engine.engines if isinstance(engine, EngineGroup) else (engine,)
        if version == "v0" and len(self.engines) > 1:
            raise ValueError("vLLM's V0 metrics have no engine label: data parallelism needs v1")
        self.model_name = model_name
        self.version: MetricsVersion = version
        self.created = time.time() if created is None else created
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_VllmCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _VllmCollector(Collector):
    def __init__(self, exporter: VllmMetricsExporter) -> None:
        self._x = exporter

    def collect(self) -> Iterator[Metric]:
        """Every family once, with one series per engine (data parallelism) in engine order."""
        merged: dict[str, Metric] = {}
        for index, engine in enumerate(self._x.engines):
            for metric in self._one(engine, index):
                into = merged.get(metric.name)
                if into is None:
                    merged[metric.name] = metric
                else:
                    into.samples.extend(metric.samples)
        yield from merged.values()

    def _one(self, engine: Engine, index: int) -> Iterator[Metric]:
        x = self._x
        v1 = x.version == "v1"
        stats = engine.stats
        labels: Labels = {"model_name": x.model_name}
        if v1:
            labels["engine"] = str(index)
        created = x.created if v1 else None

        running_doc = (
            "Number of requests in model execution batches."
            if v1
            else "Number of requests currently running on GPU."
        )
        yield _gauge("vllm:num_requests_running", running_doc, labels, engine.num_running)
        yield _gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels,
            engine.num_waiting,
        )
        if v1:
            yield _gauge(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                labels,
                engine.kv_usage,
            )
        else:
            yield _gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.", labels, 0)
            yield _gauge(
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage.",
                labels,
                engine.kv_usage,
            )
            yield _gauge(
                "vllm:cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.", labels, 0
            )

        if v1:
            yield _by_label(
                "vllm:num_requests_waiting_by_reason",
                "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
                "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
                "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
                labels,
                "reason",
                {"capacity": engine.num_waiting, "deferred": 0},
            )
            level = engine.sleep_level if engine.is_sleeping else None
            yield _by_label(
                "vllm:engine_sleep_state",
                "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
                "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
                labels,
                "sleep_state",
                {
                    "awake": 1 if level is None else 0,
                    "weights_offloaded": 1 if level == 1 else 0,
                    "discard_all": 1 if level == 2 else 0,
                },
            )
            yield _counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                [(labels, stats.prompt_tokens)],
                created,
            )
            yield _counter(
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                [(labels, 0)],
                created,
            )
        yield _counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            [(labels, stats.preemptions)],
            created,
        )
        yield _counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            [(labels, stats.prompt_tokens)],
            created,
        )
        yield _counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            [(labels, stats.generation_tokens)],
            created,
        )
        # V1 creates a child per finish reason up front; V0 labels a reason when it first counts it.
        reasons = [r for r in FINISH_REASONS if v1 or stats.finished[r] > 0]
        yield _counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [({**labels, "finished_reason": r}, stats.finished[r]) for r in reasons],
            created,
        )

        histograms: list[tuple[str, str, BucketHistogram]] = [
            (
                "vllm:request_prompt_tokens",
                "Number of prefill tokens processed.",
                stats.request_prompt_tokens,
            ),
            (
                "vllm:request_generation_tokens",
                "Number of generation tokens processed.",
                stats.request_generation_tokens,
            ),
            (
                "vllm:iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                stats.iteration_tokens,
            ),
            (
                "vllm:request_params_max_tokens",
                "Histogram of the max_tokens request parameter.",
                stats.request_max_tokens,
            ),
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", stats.ttft),
        ]
        if v1:
            histograms.append(
                (
                    "vllm:inter_token_latency_seconds",
                    "Histogram of inter-token latency in seconds.",
                    stats.itl,
                )
            )
            e2e_doc = "Histogram of e2e request latency in seconds."
        else:
            histograms.append(
                (
                    "vllm:time_per_output_token_seconds",
                    "Histogram of time per output token in seconds.",
                    stats.itl,
                )
            )
            e2e_doc = "Histogram of end to end request latency in seconds."
        histograms += [
            ("vllm:e2e_request_latency_seconds", e2e_doc, stats.e2e),
            (
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                stats.queue,
            ),
            (
                "vllm:request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.",
                stats.inference,
            ),
            (
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                stats.prefill,
            ),
            (
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
                stats.decode,
            ),
        ]
        for name, doc, histogram in histograms:
            yield _histogram(name, doc, labels, histogram, created)

        yield _gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            _cache_config(x, v1, index),
            1.0,
        )


def _cache_config(x: VllmMetricsExporter, v1: bool, index: int = 0) -> Labels:
    """vLLM's ``CacheConfig.metrics_info()``: every value a string, as vLLM writes them."""
    config = x.engines[0].config
    info: Labels = {
        "block_size": str(config.block_size),
        "cache_dtype": "auto",
        "calculate_kv_scales": "False",
        "cpu_offload_gb": "0",
        "enable_prefix_caching": "False",  # the emulator models no prefix cache
        "gpu_memory_utilization": "0.9",
        "is_attention_free": "False",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(config.num_gpu_blocks),
        "num_gpu_blocks_override": "None",
        "sliding_window": "None",
        "swap_space": "4",
        "swap_space_bytes": str(4 << 30),
    }
    if v1:
        info["engine"] = str(index)
        # Current vLLM also labels the profiled KV capacity in tokens (and the concurrency it allows).
        info["kv_cache_size_tokens"] = str(config.num_gpu_blocks * config.block_size)
        info["kv_cache_max_concurrency"] = repr(
            config.num_gpu_blocks * config.block_size / config.max_model_len
        )
    return info


def _gauge(name: str, doc: str, labels: Labels, value: float) -> Metric:
    metric = Metric(name, doc, "gauge")
    metric.add_sample(name, dict(labels), float(value))
    return metric


def _by_label(name: str, doc: str, labels: Labels, key: str, values: dict[str, float]) -> Metric:
    metric = Metric(name, doc, "gauge")
    for value_label, value in values.items():
        metric.add_sample(name, {**labels, key: value_label}, float(value))
    return metric


def _counter(name: str, doc: str, series: list[tuple[Labels, float]], created: float | None) -> Metric:
    """`name` without ``_total``; samples ``<name>_total`` and, in V1, ``<name>_created``."""
    metric = Metric(name, doc, "counter")
    for labels, value in series:
        metric.add_sample(name + "_total", dict(labels), float(value))
        if created is not None:
            metric.add_sample(name + "_created", dict(labels), created)
    return metric


def _histogram(
    name: str, doc: str, labels: Labels, histogram: BucketHistogram, created: float | None
) -> Metric:
    metric = Metric(name, doc, "histogram")
    for bound, cumulative in histogram.cumulative():
        metric.add_sample(name + "_bucket", {**labels, "le": float_to_go_string(bound)}, float(cumulative))
    metric.add_sample(name + "_count", dict(labels), float(histogram.count))
    metric.add_sample(name + "_sum", dict(labels), histogram.sum)
    if created is not None:
        metric.add_sample(name + "_created", dict(labels), created)
    return metric
