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
``block_size``: the KV capacity in tokens is their product).

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
from lowtide.emulator.engine import FINISH_REASONS, BucketHistogram, Engine

Labels = dict[str, str]
# How prometheus_client writes a bucket bound ("0.001", "1.0", "+Inf"); the library leaves it untyped.
float_to_go_string = cast(Callable[[float], str], prometheus_utils.floatToGoString)


class VllmMetricsExporter:
    """`render()` gives the engine's `/metrics` text in vLLM's V1 or V0 exposition."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        version: MetricsVersion = "v1",
        *,
        created: float | None = None,
    ) -> None:
        if version not in ("v0", "v1"):
            raise ValueError(f"metrics version must be 'v0' or 'v1', not {version!r}")
        self.engine = engine
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
        x = self._x
        v1 = x.version == "v1"
        engine = x.engine
        stats = engine.stats
        labels: Labels = {"model_name": x.model_name}
        if v1:
            labels["engine"] = "0"
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
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", _cache_config(x, v1), 1.0
        )


def _cache_config(x: VllmMetricsExporter, v1: bool) -> Labels:
    """vLLM's ``CacheConfig.metrics_info()``: every value a string, as vLLM writes them."""
    config = x.engine.config
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
        info["engine"] = "0"
    return info


def _gauge(name: str, doc: str, labels: Labels, value: float) -> Metric:
    metric = Metric(name, doc, "gauge")
    metric.add_sample(name, dict(labels), float(value))
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
