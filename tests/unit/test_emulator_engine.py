"""The emulator's capacity model under a fake clock, and its `/metrics` in vLLM's exposition.

The engine only moves when the test moves the clock to the end of the step in progress
(`run_until_idle`), so every duration below is exact: step times follow
``base + per_seq × seqs + prefill_tokens / prefill_tps`` (divided by the speedup).
The exposition is checked family by family (name, type, label names, ``_created``) and against
the real vLLM samples in ``$LOWTIDE_DATA_DIR/reference`` (skipped when the data is absent).
"""

from __future__ import annotations

import itertools
import os
import random
import re
from pathlib import Path

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from lowtide.adapters.vllm_metrics import parse_vllm_metrics
from lowtide.emulator.engine import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    BucketHistogram,
    Engine,
    EngineConfig,
    EngineGroup,
    EngineRequest,
    EngineState,
    EngineUnavailable,
    RequestRejected,
    build_1_2_5_buckets,
)
from lowtide.emulator.vllm_metrics_export import VllmMetricsExporter

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = Path(os.environ.get("LOWTIDE_DATA_DIR", REPO.parent / "shared" / "data"))
BASE, PER_SEQ, PREFILL_TPS = 0.012, 0.00008, 20_000.0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def engine_for(clock: Clock, **overrides: float) -> Engine:
    options: dict[str, float] = {"cold_start_s": 0.0, **overrides}
    return Engine(EngineConfig(**options), clock)  # type: ignore[arg-type]


def run_until_idle(engine: Engine, clock: Clock, watch: list[tuple[int, int, float]] | None = None) -> None:
    """Move the clock to the end of each step until no work is left."""
    while (end := engine.next_event_at()) is not None:
        clock.t = end
        engine.advance()
        if watch is not None:
            watch.append((engine.num_running, engine.num_waiting, engine.kv_usage))


def mean(h: BucketHistogram) -> float:
    return h.sum / h.count


# -- the step model ------------------------------------------------------------------------------


def test_one_request_follows_the_step_formula() -> None:
    clock = Clock()
    engine = engine_for(clock)
    request = engine.submit(prompt_tokens=100, max_tokens=3)
    run_until_idle(engine, clock)

    prefill_step = BASE + PER_SEQ + 100 / PREFILL_TPS
    decode_step = BASE + PER_SEQ
    assert request.finish_reason == "length" and request.generated == 3
    assert request.first_token_at == pytest.approx(prefill_step)
    assert request.finished_at == pytest.approx(prefill_step + 2 * decode_step)
    stats = engine.stats
    assert (stats.prompt_tokens, stats.generation_tokens, stats.finished) == (
        100,
        3,
        {"stop": 0, "length": 1, "abort": 0},
    )
    assert stats.ttft.sum == pytest.approx(prefill_step)
    assert (stats.itl.count, stats.itl.sum) == (2, pytest.approx(2 * decode_step))
    assert stats.queue.sum == 0.0
    assert stats.e2e.sum == pytest.approx(prefill_step + 2 * decode_step)
    assert stats.iteration_tokens.count == 3 and stats.iteration_tokens.sum == 102
    assert engine.kv_usage == 0.0 and engine.num_running == 0


def test_a_queue_builds_when_concurrency_exceeds_max_num_seqs() -> None:
    clock = Clock()
    engine = engine_for(clock, max_num_seqs=4)
    requests = [engine.submit(prompt_tokens=20, max_tokens=8) for _ in range(10)]
    # The first request started a step alone; the other nine arrived while it ran.
    assert (engine.num_running, engine.num_waiting) == (1, 9)
    seen: list[tuple[int, int, float]] = []
    run_until_idle(engine, clock, seen)

    assert seen[0][:2] == (4, 6)  # the second step admitted three more: the batch is full
    assert max(running for running, _, _ in seen) == 4
    assert [waiting for _, waiting, _ in seen] == sorted((w for _, w, _ in seen), reverse=True)
    assert all(r.finish_reason == "length" and r.generated == 8 for r in requests)
    first_tokens = [r.first_token_at for r in requests]
    assert first_tokens == sorted(first_tokens)  # first come, first served
    assert engine.stats.queue.sum > 0


def test_admission_waits_until_the_prompt_fits_in_the_kv_cache() -> None:
    clock = Clock()
    # 10 blocks of 16 tokens; a 50-token prompt plus 10 output tokens needs 4 blocks.
    engine = engine_for(clock, kv_cache_tokens=160, max_model_len=160, max_num_seqs=8)
    first, second, third = (engine.submit(prompt_tokens=50, max_tokens=10) for _ in range(3))
    clock.t = engine.next_event_at() or 0.0
    engine.advance()  # step 1 (first alone) ends; step 2 admits second but not third: 2 blocks left

    assert (engine.num_running, engine.num_waiting) == (2, 1)
    assert engine.used_blocks == 8 and engine.kv_usage == pytest.approx(0.8)
    run_until_idle(engine, clock)
    assert third.scheduled_at is not None and first.finished_at is not None
    assert third.scheduled_at >= first.finished_at
    assert engine.stats.preemptions == 0
    assert [r.finish_reason for r in (first, second, third)] == ["length"] * 3


def test_a_full_cache_preempts_the_newest_sequence_which_recomputes_later() -> None:
    clock = Clock()
    # Two sequences of 60 + 40 tokens need 7 blocks each; the cache has 10.
    engine = engine_for(clock, kv_cache_tokens=160, max_model_len=160)
    older, newer = (
        engine.submit(prompt_tokens=60, max_tokens=40),
        engine.submit(prompt_tokens=60, max_tokens=40),
    )
    seen: list[tuple[int, int, float]] = []
    run_until_idle(engine, clock, seen)

    assert engine.stats.preemptions >= 1
    assert newer.preemptions >= 1 and older.preemptions == 0
    assert max(kv for _, _, kv in seen) <= 1.0
    assert (older.generated, newer.generated) == (40, 40)
    assert engine.stats.generation_tokens == 80
    assert engine.stats.prompt_tokens == 120  # a recomputed prompt is not counted twice
    assert engine.used_blocks == 0


def test_ttft_grows_with_load() -> None:
    ttfts = []
    for concurrency in (1, 8, 32, 128):
        clock = Clock()
        engine = engine_for(clock, max_num_seqs=32)
        for _ in range(concurrency):
            engine.submit(prompt_tokens=500, max_tokens=50)
        run_until_idle(engine, clock)
        assert engine.stats.ttft.count == concurrency
        ttfts.append(mean(engine.stats.ttft))
    assert ttfts == sorted(ttfts) and len(set(ttfts)) == 4


def test_decode_throughput_grows_sublinearly_with_the_batch() -> None:
    throughput, itl = [], []
    for batch in (1, 4, 16, 64, 256):
        clock = Clock()
        engine = engine_for(clock)
        for _ in range(batch):
            engine.submit(prompt_tokens=16, max_tokens=200)
        run_until_idle(engine, clock)
        throughput.append(engine.stats.generation_tokens / clock.t)
        itl.append(mean(engine.stats.itl))
    assert throughput == sorted(throughput)  # more tokens per second with a bigger batch ...
    per_sequence = [t / b for t, b in zip(throughput, (1, 4, 16, 64, 256), strict=True)]
    assert per_sequence == sorted(per_sequence, reverse=True)  # ... but each sequence is slower
    assert itl == sorted(itl)
    assert throughput[-1] < 256 * throughput[0]


def test_counters_and_histograms_never_decrease_and_account_for_every_request() -> None:
    clock = Clock()
    engine = engine_for(clock, max_num_seqs=16, kv_cache_tokens=4096, max_model_len=2048)
    rng = random.Random(7)
    requests: list[EngineRequest] = []
    snapshots = []
    for _ in range(300):
        clock.t += rng.expovariate(40.0)
        engine.advance()
        if rng.random() < 0.7:
            requests.append(engine.submit(rng.randint(1, 400), rng.randint(1, 120)))
        elif requests and rng.random() < 0.3:
            engine.abort(rng.choice(requests))
        snapshots.append(_snapshot(engine))
    run_until_idle(engine, clock)
    snapshots.append(_snapshot(engine))

    for before, after in itertools.pairwise(snapshots):
        assert all(a >= b for a, b in zip(after, before, strict=True))
    stats = engine.stats
    assert sum(stats.finished.values()) == len(requests) == stats.e2e.count
    assert stats.generation_tokens == sum(r.generated for r in requests)
    assert stats.ttft.count == sum(1 for r in requests if r.first_token_at is not None)
    assert stats.finished["abort"] > 0 and stats.finished["length"] > 0
    assert engine.used_blocks == 0


def _snapshot(engine: Engine) -> list[float]:
    s = engine.stats
    values: list[float] = [s.prompt_tokens, s.generation_tokens, s.preemptions, *s.finished.values()]
    for h in (s.ttft, s.itl, s.e2e, s.queue, s.inference, s.prefill, s.decode, s.iteration_tokens):
        values += [h.count, h.sum, *(n for _, n in h.cumulative())]
    return values


def test_output_length_from_the_request_or_sampled() -> None:
    clock = Clock()
    engine = engine_for(clock)
    short = engine.submit(prompt_tokens=10, max_tokens=10, output_tokens=4)
    capped = engine.submit(prompt_tokens=10, max_tokens=5, output_tokens=9)
    run_until_idle(engine, clock)
    assert (short.finish_reason, short.generated) == ("stop", 4)
    assert (capped.finish_reason, capped.generated) == ("length", 5)

    sampled_engine = Engine(EngineConfig(cold_start_s=0, eos_probability=0.05), clock, rng=random.Random(3))
    sampled = [sampled_engine.submit(prompt_tokens=10, max_tokens=60) for _ in range(40)]
    run_until_idle(sampled_engine, clock)
    lengths = {r.generated for r in sampled}
    assert len(lengths) > 5 and max(lengths) <= 60
    assert all((r.finish_reason == "stop") == (r.generated < 60) for r in sampled)


def test_requests_the_model_cannot_serve_are_rejected() -> None:
    clock = Clock()
    engine = engine_for(clock, kv_cache_tokens=1600, max_model_len=1000)
    with pytest.raises(RequestRejected, match="maximum context length is 1000 tokens"):
        engine.submit(prompt_tokens=990, max_tokens=11)
    for prompt, max_tokens in ((0, 5), (5, 0)):
        with pytest.raises(RequestRejected):
            engine.submit(prompt_tokens=prompt, max_tokens=max_tokens)
    assert engine.num_waiting == 0 and sum(engine.stats.finished.values()) == 0


def test_abort_frees_a_running_or_waiting_request() -> None:
    clock = Clock()
    engine = engine_for(clock, max_num_seqs=1)
    calls: list[int] = []
    running = engine.submit(prompt_tokens=100, max_tokens=50, listener=lambda r: calls.append(r.id))
    waiting = engine.submit(prompt_tokens=100, max_tokens=50)
    clock.t = engine.next_event_at() or 0.0
    engine.advance()
    assert (engine.num_running, engine.num_waiting) == (1, 1) and engine.used_blocks > 0

    engine.abort(waiting)
    engine.abort(running)
    engine.abort(running)  # twice is harmless
    assert (running.finish_reason, waiting.finish_reason) == ("abort", "abort")
    assert (engine.num_running, engine.num_waiting, engine.used_blocks) == (0, 0, 0)
    assert engine.stats.finished["abort"] == 2 and calls[-1] == running.id
    run_until_idle(engine, clock)
    assert running.generated == 1  # nothing more after the abort


# -- lifecycle: cold start, sleep, wake ----------------------------------------------------------


def test_cold_start_refuses_requests_until_ready() -> None:
    clock = Clock()
    engine = Engine(EngineConfig(cold_start_s=30), clock)
    assert engine.state is EngineState.STARTING
    with pytest.raises(EngineUnavailable) as refused:
        engine.submit(prompt_tokens=10, max_tokens=5)
    assert refused.value.state is EngineState.STARTING
    clock.t = 29.99
    assert engine.state is EngineState.STARTING
    clock.t = 30.0
    assert engine.state is EngineState.READY
    assert engine.submit(prompt_tokens=10, max_tokens=5).arrival == 30.0


def test_sleep_aborts_in_flight_requests_frees_the_cache_and_wake_takes_wake_s() -> None:
    clock = Clock()
    engine = engine_for(clock, wake_s=3.0, max_num_seqs=2)
    finished: list[str | None] = []
    requests = [
        engine.submit(prompt_tokens=200, max_tokens=100, listener=lambda r: finished.append(r.finish_reason))
        for _ in range(3)
    ]
    for _ in range(5):
        clock.t = engine.next_event_at() or clock.t
        engine.advance()
    assert engine.kv_usage > 0 and engine.num_waiting == 1

    assert engine.sleep(level=1) is EngineState.SLEEPING
    assert (engine.num_running, engine.num_waiting, engine.kv_usage) == (0, 0, 0.0)
    assert [r.finish_reason for r in requests] == ["abort"] * 3
    assert finished.count("abort") == 3 and engine.stats.finished["abort"] == 3
    assert engine.next_event_at() is None
    # Asleep, a request is held (vLLM queues it while paused) and counts as waiting.
    held = engine.submit(prompt_tokens=10, max_tokens=5)
    assert (engine.num_running, engine.num_waiting, engine.next_event_at()) == (0, 1, None)

    clock.t = 100.0
    assert engine.wake_up() == 103.0
    assert engine.state is EngineState.WAKING and engine.is_sleeping
    assert engine.next_event_at() == 103.0  # the driver wakes up for the end of the wake
    also_held = engine.submit(prompt_tokens=10, max_tokens=5)
    clock.t = 102.999
    assert engine.state is EngineState.WAKING
    clock.t = 103.0
    assert engine.state is EngineState.READY and not engine.is_sleeping
    again = engine.submit(prompt_tokens=10, max_tokens=5)
    run_until_idle(engine, clock)
    assert [r.finish_reason for r in (held, also_held, again)] == ["length"] * 3
    # Queued from its arrival, served after the wake.
    assert held.arrival < 100.0 and held.first_token_at is not None and held.first_token_at >= 103.0


def test_sleep_in_wait_mode_lets_in_flight_requests_finish_first() -> None:
    clock = Clock()
    engine = engine_for(clock)
    requests = [engine.submit(prompt_tokens=50, max_tokens=20) for _ in range(3)]
    assert engine.sleep(level=1, mode="wait") is EngineState.DRAINING
    late = engine.submit(prompt_tokens=10, max_tokens=5)  # held: it does not delay the sleep
    run_until_idle(engine, clock)
    assert engine.state is EngineState.SLEEPING
    assert [r.finish_reason for r in requests] == ["length"] * 3
    assert engine.stats.finished["abort"] == 0
    assert not late.finished and engine.num_waiting == 1
    clock.t = engine.wake_up()
    run_until_idle(engine, clock)
    assert late.finish_reason == "length"


def test_sleep_in_keep_mode_keeps_requests_for_after_the_wake() -> None:
    clock = Clock()
    engine = engine_for(clock, wake_s=1.0)
    request = engine.submit(prompt_tokens=50, max_tokens=20)
    for _ in range(3):
        clock.t = engine.next_event_at() or clock.t
        engine.advance()
    assert request.generated > 0
    assert engine.sleep(level=1, mode="keep") is EngineState.SLEEPING
    assert (engine.num_running, engine.num_waiting, engine.kv_usage) == (0, 1, 0.0)
    assert not request.finished and engine.stats.preemptions == 0
    clock.t = engine.wake_up()
    run_until_idle(engine, clock)
    assert request.finish_reason == "length" and request.generated == 20


def test_wake_up_by_tags_keeps_the_engine_asleep_until_every_tag_is_awake() -> None:
    clock = Clock()
    engine = engine_for(clock, wake_s=2.0)
    engine.sleep(level=2)
    assert engine.sleep_level == 2 and engine.sleeping_tags == {"weights", "kv_cache"}
    assert engine.wake_up(["weights"]) == clock.t + 2.0  # the weights take wake_s
    assert engine.state is EngineState.SLEEPING and engine.is_sleeping
    with pytest.raises(ValueError, match="unknown tags"):
        engine.wake_up(["gpu"])
    assert engine.wake_up(["kv_cache"]) == clock.t + 2.0  # awake once the weights are back
    assert engine.state is EngineState.WAKING
    clock.t += 2.0
    assert engine.state is EngineState.READY and engine.sleep_level is None
    assert engine.sleep(level=0) is EngineState.SLEEPING  # level 0 is accepted (vLLM: 0..2)


def test_wake_up_calls_off_a_pending_sleep_and_sleep_levels_are_checked() -> None:
    clock = Clock()
    engine = engine_for(clock)
    request = engine.submit(prompt_tokens=50, max_tokens=20)
    engine.sleep(mode="wait")
    assert engine.wake_up() == clock.t and engine.state is EngineState.READY
    run_until_idle(engine, clock)
    assert request.finish_reason == "length" and engine.state is EngineState.READY
    with pytest.raises(ValueError, match="level"):
        engine.sleep(level=3)
    with pytest.raises(ValueError, match="mode"):
        engine.sleep(mode="later")  # type: ignore[arg-type]
    starting = Engine(EngineConfig(cold_start_s=5), clock)
    with pytest.raises(EngineUnavailable):
        starting.sleep()


def test_speedup_divides_every_duration() -> None:
    results = []
    for speedup in (1.0, 4.0):
        clock = Clock()
        engine = Engine(EngineConfig(cold_start_s=10, wake_s=2, speedup=speedup), clock)
        ready_in = engine.ready_at
        clock.t = ready_in
        for _ in range(20):
            engine.submit(prompt_tokens=300, max_tokens=40)
        run_until_idle(engine, clock)
        engine.sleep()
        wake_in = engine.wake_up() - clock.t
        s = engine.stats
        results.append((ready_in, wake_in, s.ttft.sum, s.itl.sum, s.e2e.sum, clock.t - ready_in))
    slow, fast = results
    assert fast == pytest.approx([value / 4 for value in slow])
    assert slow[:2] == (10.0, 2.0)


# -- configuration -------------------------------------------------------------------------------


def test_config_defaults_scale_with_gpus_and_bad_values_are_refused() -> None:
    default = EngineConfig()
    assert (default.max_num_seqs, default.kv_cache_tokens, default.num_gpu_blocks) == (256, 600_000, 37_500)
    assert default.decode_step_s(256) == pytest.approx(0.012 + 256 * 0.00008)
    eight = EngineConfig.for_gpus(8)
    assert (eight.kv_cache_tokens, eight.prefill_tokens_per_s) == (1_200_000, 40_000.0)
    assert EngineConfig.for_gpus(4) == default
    small = EngineConfig.for_gpus(1, kv_cache_tokens=10_000, max_num_seqs=None)
    assert (small.max_model_len, small.max_num_seqs) == (10_000, 256)

    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="must fit in the KV cache"):
        EngineConfig(kv_cache_tokens=1000, max_model_len=2000)
    with pytest.raises(ValueError, match="speedup must be positive"):
        EngineConfig(speedup=0)
    with pytest.raises(ValueError, match="at least one block"):
        EngineConfig.for_gpus(1, kv_cache_tokens=10)


def test_vllm_bucket_lists() -> None:
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80.0 and len(ITL_BUCKETS) == 19
    assert REQUEST_LATENCY_BUCKETS[0] == 0.3 and REQUEST_LATENCY_BUCKETS[-1] == 7680.0
    h = BucketHistogram((1, 2))
    for value in (0.5, 1.0, 1.5, 9.0):
        h.observe(value)
    assert h.cumulative() == [(1.0, 2), (2.0, 3), (float("inf"), 4)] and h.sum == 12.0


# -- the /metrics exposition ---------------------------------------------------------------------

V1_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:engine_sleep_state": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
}
V1_ONLY = (
    "vllm:kv_cache_usage_perc",
    "vllm:inter_token_latency_seconds",
    "vllm:num_requests_waiting_by_reason",
    "vllm:engine_sleep_state",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
)
V0_ONLY = {
    "vllm:num_requests_swapped": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:cpu_cache_usage_perc": "gauge",
    "vllm:time_per_output_token_seconds": "histogram",
}
V0_FAMILIES = {
    **{k: v for k, v in V1_FAMILIES.items() if k not in V1_ONLY},
    **V0_ONLY,
}


def busy_engine() -> tuple[Engine, Clock]:
    clock = Clock()
    engine = engine_for(clock, max_num_seqs=2)
    for i in range(4):
        engine.submit(prompt_tokens=100 + i, max_tokens=5)
    for _ in range(3):
        clock.t = engine.next_event_at() or clock.t
        engine.advance()
    return engine, clock


def families(text: str) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_v1_exposition_has_vllm_names_types_labels_and_created_series() -> None:
    engine, clock = busy_engine()
    text = VllmMetricsExporter(
        engine, "meta-llama/Llama-3.1-8B-Instruct", "v1", created=1_700_000_000.0
    ).render()
    parsed = families(text.decode())

    created = {name for name in parsed if name.endswith("_created")}
    main = {name: f.type for name, f in parsed.items() if name not in created}
    assert main == V1_FAMILIES
    expected_created = {f"{n}_created" for n, t in V1_FAMILIES.items() if t in ("counter", "histogram")}
    assert created == expected_created
    for name in created:
        assert parsed[name].type == "gauge"
        assert {s.value for s in parsed[name].samples} == {1_700_000_000.0}
    for name, family in parsed.items():
        for sample in family.samples:
            assert sample.labels["engine"] == "0"
            if name != "vllm:cache_config_info":  # vLLM's info gauge carries CacheConfig's fields only
                assert sample.labels["model_name"] == "meta-llama/Llama-3.1-8B-Instruct"

    def value(name: str, **labels: str) -> float:
        (hit,) = (s.value for s in parsed[name].samples if labels.items() <= s.labels.items())
        return hit

    assert value("vllm:num_requests_running") == engine.num_running == 2
    assert value("vllm:num_requests_waiting") == engine.num_waiting == 2
    assert value("vllm:kv_cache_usage_perc") == pytest.approx(engine.kv_usage)
    assert value("vllm:prompt_tokens") == engine.stats.prompt_tokens > 0
    assert value("vllm:generation_tokens") == engine.stats.generation_tokens > 0
    reasons = {s.labels["finished_reason"]: s.value for s in parsed["vllm:request_success"].samples}
    assert reasons == {"stop": 0.0, "length": 0.0, "abort": 0.0}
    ttft = parsed["vllm:time_to_first_token_seconds"].samples
    buckets = [(s.labels["le"], s.value) for s in ttft if s.name.endswith("_bucket")]
    assert [le for le, _ in buckets] == [*(repr(float(b)) for b in TTFT_BUCKETS), "+Inf"]
    assert [n for _, n in buckets] == sorted(n for _, n in buckets)
    (count,) = (s.value for s in ttft if s.name.endswith("_count"))
    assert buckets[-1][1] == count == engine.stats.ttft.count == 2
    info = parsed["vllm:cache_config_info"].samples[0]
    assert info.value == 1.0
    assert int(info.labels["num_gpu_blocks"]) * int(info.labels["block_size"]) == 600_000

    run_until_idle(engine, clock)
    parsed = families(VllmMetricsExporter(engine, "m").render().decode())
    reasons = {s.labels["finished_reason"]: s.value for s in parsed["vllm:request_success"].samples}
    assert reasons == {"stop": 0.0, "length": 4.0, "abort": 0.0}


def test_v0_exposition_uses_v0_names_without_engine_label_or_created_series() -> None:
    engine, clock = busy_engine()
    parsed = families(VllmMetricsExporter(engine, "m", "v0").render().decode())
    assert {name: f.type for name, f in parsed.items()} == V0_FAMILIES
    assert all("engine" not in s.labels for f in parsed.values() for s in f.samples)
    assert parsed["vllm:gpu_cache_usage_perc"].samples[0].value == pytest.approx(engine.kv_usage)
    assert parsed["vllm:request_success"].samples == []  # V0 labels a reason once it has counted one
    run_until_idle(engine, clock)
    parsed = families(VllmMetricsExporter(engine, "m", "v0").render().decode())
    assert [(s.labels["finished_reason"], s.value) for s in parsed["vllm:request_success"].samples] == [
        ("length", 4.0)
    ]
    tpot = parsed["vllm:time_per_output_token_seconds"]
    assert next(s for s in tpot.samples if s.name.endswith("_count")).value == engine.stats.itl.count
    with pytest.raises(ValueError, match="metrics version"):
        VllmMetricsExporter(engine, "m", "v2")  # type: ignore[arg-type]


def _reference(name: str) -> str:
    path = DATA_DIR / "reference" / name
    if not path.exists():
        pytest.skip(f"reference data absent: {path} (set LOWTIDE_DATA_DIR to the shared data directory)")
    # The docs' fragments: drop the shell prompts and "..." elisions, close the elided label list.
    lines = [
        re.sub(r",\.\.\.\}", "}", line)
        for line in path.read_text().splitlines()
        if line.strip() and not line.startswith("$") and line.strip() != "..."
    ]
    return "\n".join(lines) + "\n"


def _bounds(family: Metric) -> list[str]:
    return [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]


@pytest.mark.parametrize(
    ("version", "sample"), [("v1", "vllm_metrics_sample_v1.txt"), ("v0", "vllm_metrics_sample_v0.txt")]
)
def test_exposition_matches_the_real_vllm_samples(version: str, sample: str) -> None:
    reference = {n: f for n, f in families(_reference(sample)).items() if n.startswith("vllm:")}
    assert reference, "the reference sample has vLLM families"
    engine, _ = busy_engine()
    ours = families(VllmMetricsExporter(engine, "m", version).render().decode())  # type: ignore[arg-type]
    for name, theirs in reference.items():
        assert name in ours, f"{name} missing from the {version} exposition"
        assert ours[name].type == theirs.type, name
        their_labels = set().union(*(s.labels for s in theirs.samples)) - {"le"}
        our_labels = set().union(*(s.labels for s in ours[name].samples)) - {"le"}
        assert their_labels <= our_labels, (name, their_labels - our_labels)
        if theirs.type == "histogram":
            assert _bounds(ours[name])[: len(_bounds(theirs))] == _bounds(theirs), name
        for suffix in ("_total", "_bucket", "_count", "_sum"):
            their_names = {s.name for s in theirs.samples if s.name.endswith(suffix)}
            assert their_names <= {s.name for s in ours[name].samples}, name


@pytest.mark.parametrize("version", ["v1", "v0"])
def test_lowtides_metrics_adapter_reads_the_emulator(version: str) -> None:
    from lowtide.adapters.vllm_metrics import parse_vllm_metrics  # noqa: PLC0415

    engine, _ = busy_engine()
    text = VllmMetricsExporter(engine, "m", version).render().decode()  # type: ignore[arg-type]
    scrape = parse_vllm_metrics(text, at=1.0)
    assert (scrape.ok, scrape.version, scrape.model) == (True, version, "m")
    if version == "v1":
        assert (scrape.requests_total, scrape.problems) == (0, ())
    else:  # V0 shows no request_success series before a request finished: unknown, not 0
        assert scrape.requests_total is None
        assert [p for p in scrape.problems if "request_success" not in p] == []
    assert (scrape.running, scrape.waiting) == (engine.num_running, engine.num_waiting)
    assert scrape.kv_usage == pytest.approx(engine.kv_usage)
    assert scrape.kv_capacity_tokens == engine.config.kv_capacity_tokens
    assert scrape.prompt_tokens_total == engine.stats.prompt_tokens
    assert scrape.generation_tokens_total == engine.stats.generation_tokens
    assert scrape.ttft is not None and scrape.ttft.count == engine.stats.ttft.count
    assert scrape.itl is not None and scrape.itl.count == engine.stats.itl.count


# -- data parallelism ----------------------------------------------------------------------------


def test_data_parallel_engines_share_the_load_and_export_one_series_each() -> None:
    clock = Clock()
    group = EngineGroup(EngineConfig(cold_start_s=0.0, max_num_seqs=2), clock, 2)
    requests = [group.submit(prompt_tokens=100, max_tokens=5) for _ in range(3)]
    # The least loaded engine takes each request: 2 on engine 0, 1 on engine 1.
    assert [e.num_running + e.num_waiting for e in group.engines] == [2, 1]
    parsed = families(VllmMetricsExporter(group, "m").render().decode())
    in_flight = {
        (f, s.labels["engine"]): s.value
        for f in ("vllm:num_requests_running", "vllm:num_requests_waiting")
        for s in parsed[f].samples
    }
    assert in_flight == {
        ("vllm:num_requests_running", "0"): 1.0,  # one step in progress, the other request queued
        ("vllm:num_requests_waiting", "0"): 1.0,
        ("vllm:num_requests_running", "1"): 1.0,
        ("vllm:num_requests_waiting", "1"): 0.0,
    }
    info = [s.labels for s in parsed["vllm:cache_config_info"].samples]
    assert [i["engine"] for i in info] == ["0", "1"]
    # lowtide reads the server as one replica: engines summed (KV capacity too), usage averaged.
    scrape = parse_vllm_metrics(VllmMetricsExporter(group, "m").render().decode(), at=0.0)
    assert (scrape.running, scrape.waiting) == (2, 1)
    assert scrape.kv_capacity_tokens == 2 * group.config.kv_cache_tokens
    # Sleep and wake apply to every engine; the work resumes where each engine holds it.
    group.sleep(level=1, mode="keep")
    assert all(e.is_sleeping for e in group.engines) and group.is_sleeping
    clock.t = group.wake_up()
    while (t := group.next_event_at()) is not None:
        clock.t = t
        group.advance()
    assert [r.finish_reason for r in requests] == ["length"] * 3
    with pytest.raises(ValueError, match="engine label"):
        VllmMetricsExporter(group, "m", "v0")
