"""Benchmark: read the `/metrics` of 200 vLLM replicas and compute their signals, per control tick.

Workload (fixed seed): 10 services × 20 replicas, each a vLLM V1 server with 2 engines (data
parallelism). Each replica's text starts as what prometheus_client writes for vLLM's families
(`tests/fixtures/metrics/vllm_exposition.py`: vLLM's names, labels `model_name`/`engine`, its
bucket lists, `_created` series, process/python/HTTP families; ~86 KB, ~860 lines) and then moves
every tick as a busy server's would: requests finish (Poisson), every histogram gains
observations, counters grow, gauges change. Texts are generated outside the timed region.

Timed, per tick (what `ScrapeSource.collect` does after the HTTP requests): parse all 200 texts
with `parse_vllm_metrics` (one shared `ParseCache`, as the source has), append each reading to its
replica's window (kept 150 s: max(window 60 s, frozen 120 s) + stale 30 s, at 2 s per tick = 75
readings) and compute `replica_signals` for every replica. The windows are filled by untimed
ticks first. The simulator's objects are frozen out of the garbage collector (`gc.freeze`), so
collections scan what lowtide keeps (the windows of readings), not the harness. Both wall time
and the ticking thread's CPU time are reported (the machine may be shared: the load average is
recorded). Also measured, for the record: the same ticks without the cache (prometheus_client
parses the selected families every time), and one tick of prometheus_client alone on the full
texts (what reading everything would cost).

Run:  .venv/bin/python benchmarks/metrics_ingest.py [--ticks 30] [--replicas 200] [--profile]
Prints min / median / p95 ms per tick and writes them, with the machine, as JSON to
benchmarks/results/metrics_ingest.json. Not a test: nothing here asserts a time (docs/architecture.md §10).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import os
import platform
import pstats
import random
import re
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from harness import percentile
from prometheus_client.parser import text_string_to_metric_families

from lowtide.adapters.vllm_metrics import ParseCache, parse_vllm_metrics
from lowtide.domain.metrics import ReplicaScrape
from lowtide.policy.signals import replica_signals

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "metrics"))
from vllm_exposition import Request, VllmExposition

DEFAULT_OUT = Path(__file__).parent / "results" / "metrics_ingest.json"
TICK_S = 2.0
WINDOW_S = 60.0
STALE_AFTER_S = 30.0
FROZEN_AFTER_S = 120.0
RETENTION_S = max(WINDOW_S, FROZEN_AFTER_S) + STALE_AFTER_S
NOW0 = 1_790_000_000.0
SERVICES = 10

# Median of each histogram family's observations (lognormal, sigma 0.8): seconds or tokens.
MEDIANS = {
    "vllm:time_to_first_token_seconds": 0.15,
    "vllm:time_per_output_token_seconds": 0.03,
    "vllm:inter_token_latency_seconds": 0.03,
    "vllm:e2e_request_latency_seconds": 6.0,
    "vllm:request_queue_time_seconds": 0.05,
    "vllm:request_inference_time_seconds": 5.5,
    "vllm:request_prefill_time_seconds": 0.1,
    "vllm:request_decode_time_seconds": 5.4,
    "vllm:request_prompt_tokens": 800.0,
    "vllm:request_generation_tokens": 200.0,
    "vllm:request_max_num_generation_tokens": 256.0,
    "vllm:request_params_max_tokens": 512.0,
    "vllm:request_params_n": 1.0,
    "vllm:iteration_tokens_total": 300.0,
    "http_request_duration_highr_seconds": 5.0,
    "http_request_duration_seconds": 5.0,
}
PER_TOKEN = {"vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"}
_SAMPLE = re.compile(r"^(?P<name>[^{\s]+)(?:\{(?P<labels>[^}]*)\})?$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class _Hist:
    bounds: list[float]
    bucket_lines: list[int]  # line index per bound (+Inf last)
    count_line: int
    sum_line: int
    proportions: list[float] = field(default_factory=list)  # share of observations per bucket
    mean: float = 0.0


class SimulatedReplica:
    """One replica's text, kept as lines; `tick` moves its numbers like a busy vLLM server's."""

    def __init__(self, server: VllmExposition, rng: random.Random) -> None:
        self.rng = rng
        lines = server.render(created=None).split("\n")
        self.lines = lines
        self.keys: dict[int, str] = {}
        self.values: dict[int, float] = {}
        hists: dict[tuple[str, str], _Hist] = {}
        self.counters: dict[tuple[str, str], list[int]] = {}
        self.gauges: dict[tuple[str, str], int] = {}
        for i, line in enumerate(lines):
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            self.keys[i], self.values[i] = key, float(value)
            m = _SAMPLE.match(key)
            assert m is not None, key
            name, labels = m["name"], dict(_LABEL.findall(m["labels"] or ""))
            engine = labels.get("engine", "")
            if name.endswith("_created"):
                continue
            for suffix in ("_bucket", "_count", "_sum"):
                base = name[: -len(suffix)]
                if name.endswith(suffix) and base in MEDIANS:
                    h = hists.setdefault((base, engine + labels.get("handler", "")), _Hist([], [], -1, -1))
                    if suffix == "_bucket":
                        bound = float(labels["le"])
                        h.bounds.append(bound)
                        h.bucket_lines.append(i)
                    elif suffix == "_count":
                        h.count_line = i
                    else:
                        h.sum_line = i
                    break
            else:
                if name.endswith("_total") and name.startswith("vllm:"):
                    self.counters.setdefault((name, engine), []).append(i)
                elif (
                    name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
                    or "cache_usage" in name
                ):
                    self.gauges[(name, engine)] = i
        self.hists = hists
        for (family, _), h in hists.items():
            h.proportions, h.mean = _lognormal_shares(h.bounds, MEDIANS[family])
        self.engines = sorted({engine for _, engine in self.gauges})

    def tick(self, requests_per_s: float) -> None:
        rng, values = self.rng, self.values
        for engine in self.engines:
            finished = _poisson(rng, requests_per_s * TICK_S / len(self.engines))
            tokens = finished * rng.randint(150, 250)
            for (name, eng), lines in self.counters.items():
                if eng != engine:
                    continue
                if name == "vllm:prompt_tokens_total":
                    values[lines[0]] += finished * rng.randint(600, 1000)
                elif name == "vllm:generation_tokens_total":
                    values[lines[0]] += tokens
                elif name == "vllm:request_success_total":
                    values[lines[0]] += finished  # finished_reason="stop" mostly
                    if finished and rng.random() < 0.2:
                        values[lines[1]] += 1
                else:
                    values[lines[0]] += rng.randint(0, 2000)
            for (family, key), h in self.hists.items():
                if not key.startswith(engine):
                    continue
                n = tokens if family in PER_TOKEN else (finished if family.startswith("vllm:") else 1)
                if n == 0:
                    continue
                cumulative = 0.0
                for share, line in zip(h.proportions, h.bucket_lines, strict=True):
                    cumulative += round(n * share * rng.uniform(0.8, 1.2))
                    values[line] += cumulative
                values[h.bucket_lines[-1]] = max(values[h.bucket_lines[-1]], values[h.bucket_lines[-2]])
                values[h.count_line] = values[h.bucket_lines[-1]]
                values[h.sum_line] += n * h.mean
            running = rng.randint(8, 64)
            for (name, eng), line in self.gauges.items():
                if eng != engine:
                    continue
                if name.endswith("running"):
                    values[line] = float(running)
                elif name.endswith("waiting"):
                    values[line] = float(max(0, rng.randint(-10, 10)))
                else:
                    values[line] = round(rng.uniform(0.2, 0.95), 4)

    def render(self) -> str:
        out = list(self.lines)
        for i, key in self.keys.items():
            out[i] = f"{key} {self.values[i]!r}"
        return "\n".join(out)


def _lognormal_shares(bounds: list[float], median: float, sigma: float = 0.8) -> tuple[list[float], float]:
    def cdf(x: float) -> float:
        if x <= 0:
            return 0.0
        if math.isinf(x):
            return 1.0
        return 0.5 * (1 + math.erf((math.log(x) - math.log(median)) / (sigma * math.sqrt(2))))

    shares, previous = [], 0.0
    for bound in bounds:
        c = cdf(bound)
        shares.append(c - previous)
        previous = c
    return shares, median * math.exp(sigma * sigma / 2)


def _poisson(rng: random.Random, mean: float) -> int:
    if mean > 30:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def build_fleet(replicas: int, seed: int) -> list[SimulatedReplica]:
    rng = random.Random(seed)
    fleet = []
    for i in range(replicas):
        model = f"org/model-{i % SERVICES}-8B-Instruct"
        server = VllmExposition(models=(model,), engines=(0, 1))
        # A few requests through every engine so every series exists, as on a live server.
        for engine in (0, 1):
            server.set_load(4, 0, 0.3, engine=engine)
            server.finish([Request(0.1, 3.0, [0.03] * 5, 500, 6)] * 3, engine=engine)
        fleet.append(SimulatedReplica(server, random.Random(rng.random())))
    return fleet


def figures(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {
        "min_ms": round(v[0], 3),
        "median_ms": round(statistics.median(v), 3),
        "p95_ms": round(percentile(v, 95), 3),
        "max_ms": round(v[-1], 3),
    }


class Ingest:
    """The timed part: parse every text, keep windows, compute signals (as ScrapeSource does)."""

    def __init__(self, cache: ParseCache | None) -> None:
        self.cache = cache
        self.windows: dict[int, deque[ReplicaScrape]] = {}

    def tick(self, texts: list[str], now: float) -> tuple[float, float, float, int]:
        """(parse ms, signals ms, CPU ms of this thread, stale replicas) for one tick."""
        cpu_started = time.thread_time()
        started = time.perf_counter()
        readings = [parse_vllm_metrics(text, at=now, cache=self.cache) for text in texts]
        parsed = time.perf_counter()
        stale = 0
        for i, reading in enumerate(readings):
            window = self.windows.setdefault(i, deque())
            window.append(reading)
            while window[0].at < now - RETENTION_S:
                window.popleft()
            s = replica_signals(
                f"r{i}",
                window,
                now=now,
                window_s=WINDOW_S,
                stale_after_s=STALE_AFTER_S,
                frozen_after_s=FROZEN_AFTER_S,
            )
            stale += s.stale
        done = time.perf_counter()
        cpu_ms = (time.thread_time() - cpu_started) * 1000
        return (parsed - started) * 1000, (done - parsed) * 1000, cpu_ms, stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=200)
    parser.add_argument("--ticks", type=int, default=30, help="measured ticks")
    parser.add_argument("--uncached-ticks", type=int, default=5, help="measured ticks without the cache")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--profile", action="store_true", help="print the cProfile top 25 of one tick")
    args = parser.parse_args(argv)

    fleet = build_fleet(args.replicas, args.seed)
    # The simulator's own objects are not what is measured: keep them out of the collector's scans
    # (the windows of readings, which are, stay in).
    gc.collect()
    gc.freeze()
    history = int(RETENTION_S / TICK_S)
    load = [random.Random(args.seed + i).uniform(4, 16) for i in range(len(fleet))]  # requests/s
    ingest = Ingest(ParseCache())
    uncached = Ingest(None)
    now = NOW0
    texts: list[str] = []
    cold_ms = 0.0
    print(
        f"{len(fleet)} replicas; filling {history} ticks of history ({history * TICK_S:.0f} s)...", flush=True
    )
    for t in range(history):
        for replica, rps in zip(fleet, load, strict=True):
            replica.tick(rps)
        texts = [replica.render() for replica in fleet]
        now = NOW0 + t * TICK_S
        parse_ms, signals_ms, _, _ = ingest.tick(texts, now)
        if t == 0:
            cold_ms = parse_ms + signals_ms
        if t >= history - args.uncached_ticks - 1:
            uncached.tick(texts, now)  # keeps its windows comparable; timed below
    sizes = [len(text.encode()) for text in texts]
    lines = [text.count("\n") + 1 for text in texts]

    per_tick, parse_part, signals_part, cpu_part, stale_counts = [], [], [], [], []
    uncached_ticks = []
    load_before = os.getloadavg()[0]
    for t in range(args.ticks):
        for replica, rps in zip(fleet, load, strict=True):
            replica.tick(rps)
        texts = [replica.render() for replica in fleet]
        now = NOW0 + (history + t) * TICK_S
        parse_ms, signals_ms, cpu_ms, stale = ingest.tick(texts, now)
        per_tick.append(parse_ms + signals_ms)
        parse_part.append(parse_ms)
        signals_part.append(signals_ms)
        cpu_part.append(cpu_ms)
        stale_counts.append(stale)
        if t < args.uncached_ticks:
            p, s, _, _ = uncached.tick(texts, now)
            uncached_ticks.append(p + s)
    load_after = os.getloadavg()[0]

    started = time.perf_counter()
    for text in texts:
        for _family in text_string_to_metric_families(text):
            pass
    full_library_ms = (time.perf_counter() - started) * 1000

    cache = ingest.cache
    assert cache is not None
    main_figures = figures(per_tick)
    result = {
        "benchmark": "metrics ingest: parse_vllm_metrics + replica_signals per tick",
        "workload": {
            "replicas": len(fleet),
            "services": SERVICES,
            "engines_per_replica": 2,
            "text_bytes_mean": round(statistics.mean(sizes)),
            "text_lines_mean": round(statistics.mean(lines)),
            "tick_s": TICK_S,
            "window_s": WINDOW_S,
            "readings_per_window": history,
            "seed": args.seed,
        },
        "ticks": args.ticks,
        **main_figures,
        "cpu": figures(cpu_part),
        "parse_median_ms": round(statistics.median(parse_part), 3),
        "signals_median_ms": round(statistics.median(signals_part), 3),
        "cold_first_tick_ms": round(cold_ms, 3),
        "cache": {"hits": cache.hits, "misses": cache.misses},
        "without_cache": {"ticks": len(uncached_ticks), **figures(uncached_ticks)}
        if uncached_ticks
        else None,
        "prometheus_client_full_texts_one_tick_ms": round(full_library_ms, 3),
        "stale_replicas_last_tick": stale_counts[-1],
        "target_ms": 100,
        "load_average_1m": [round(load_before, 2), round(load_after, 2)],
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        },
    }
    print(
        f"texts: {statistics.mean(sizes):,.0f} bytes, {statistics.mean(lines):.0f} lines each; "
        f"windows of {history} readings"
    )
    print(
        f"{args.ticks} ticks (parse {len(fleet)} + signals): min {main_figures['min_ms']:.1f} ms, "
        f"median {main_figures['median_ms']:.1f} ms, p95 {main_figures['p95_ms']:.1f} ms "
        f"(parse {result['parse_median_ms']:.1f} + signals {result['signals_median_ms']:.1f}; target 100 ms)"
    )
    cpu = result["cpu"]
    assert isinstance(cpu, dict)
    print(
        f"  CPU time of the ticking thread: median {cpu['median_ms']:.1f} ms, p95 {cpu['p95_ms']:.1f} ms "
        f"(1-min load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs)"
    )
    print(f"first tick (cold cache, {SERVICES} layouts to learn): {cold_ms:.1f} ms")
    if uncached_ticks:
        w = result["without_cache"]
        assert isinstance(w, dict)
        print(f"without the layout cache: median {w['median_ms']:.1f} ms, p95 {w['p95_ms']:.1f} ms")
    print(f"prometheus_client on the full texts alone, one tick: {full_library_ms:.0f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")

    if args.profile:
        for replica, rps in zip(fleet, load, strict=True):
            replica.tick(rps)
        texts = [replica.render() for replica in fleet]
        profiler = cProfile.Profile()
        profiler.runcall(ingest.tick, texts, now + TICK_S)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
