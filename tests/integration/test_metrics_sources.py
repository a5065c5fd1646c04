"""The two metrics sources against real HTTP servers and a real Prometheus server.

`ScrapeSource`: local HTTP servers on free ports (a healthy vLLM-like replica, one answering 500,
one that hangs past the timeout, one answering garbage, and a port nobody listens on), all in the
same `collect`. `PromQLSource`: `/usr/bin/prometheus` (Debian package `prometheus`) started on a
free port with a generated config that scrapes local servers every second; the test waits until
Prometheus holds enough samples, then checks the signals against hand-computed values. Without
the binary those tests skip (fail under ``LOWTIDE_REQUIRE_SERVICES=1``).

The Prometheus targets serve counters that grow linearly with time (so ``rate`` is exact) and
bucket counts that grow in fixed proportions (so quantiles are exact whatever the timing).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from typer.testing import CliRunner, Result

from conftest import require_service
from lowtide.adapters.metrics_sources import PromQLSource, ScrapeSource, instance_of
from lowtide.api.services import signals_out
from lowtide.cli.metrics_cmd import metrics_app
from lowtide.domain.metrics import ReplicaSignals, ServiceSignals
from lowtide.emulator.engine import Engine, EngineConfig
from lowtide.emulator.vllm_metrics_export import VllmMetricsExporter
from support import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "metrics"))
from vllm_exposition import MODEL, Request, VllmExposition

T0 = 1_790_000_000.0
PROMETHEUS = "/usr/bin/prometheus"

Reply = tuple[int, str] | None  # (status, body); None: hang until the test ends


class TextServer:
    """A real HTTP server on a free port; `reply()` decides each answer to GET /metrics."""

    def __init__(self, reply: Callable[[], Reply]) -> None:
        self.reply = reply
        self.release = threading.Event()
        self.requests = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests += 1
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                answer = server.reply()
                if answer is None:
                    server.release.wait(30)
                    return
                status, body = answer
                data = body.encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


StartServer = Callable[[Callable[[], Reply]], "TextServer"]


@pytest.fixture
def servers() -> Iterator[StartServer]:
    started: list[TextServer] = []

    def start(reply: Callable[[], Reply]) -> TextServer:
        s = TextServer(reply)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def by_id(signals: ServiceSignals) -> dict[str, ReplicaSignals]:
    return {r.replica: r for r in signals.replicas}


# -- ScrapeSource ------------------------------------------------------------------------------------


@pytest.fixture
def scrape_source() -> Iterator[ScrapeSource]:
    source = ScrapeSource(timeout_s=0.5, window_s=60, stale_after_s=30, frozen_after_s=120)
    yield source
    source.close()


def test_one_collect_reads_the_healthy_and_classifies_every_failure(
    servers: StartServer, scrape_source: ScrapeSource
) -> None:
    vllm = VllmExposition()
    vllm.set_load(3, 1, 0.25, engine=0)
    vllm.set_load(5, 0, 0.75, engine=1)
    healthy = servers(lambda: (200, vllm.render()))
    failing = servers(lambda: (500, "internal error"))
    hanging = servers(lambda: None)
    garbage = servers(lambda: (200, "<html><body>Welcome to nginx!</body></html>\n"))
    replicas = {
        "svc/0": healthy.url,
        "svc/1": failing.url,
        "svc/2": hanging.url,
        "svc/3": garbage.url,
        "svc/4": closed_port_url(),
    }
    result = scrape_source.collect("svc", replicas, T0)
    assert result.service == "svc" and result.at == T0 and result.source_error is None
    assert [r.replica for r in result.replicas] == list(replicas)
    got = by_id(result)

    ok = got["svc/0"]
    assert not ok.stale and ok.stale_reason == ""
    assert (ok.running, ok.waiting, ok.kv_usage) == (8.0, 1.0, 0.5)
    assert ok.kv_tokens_used == 0.5 * 2 * 2048 * 16
    assert ok.generation_tokens_per_s is None  # one reading: no rate yet

    assert got["svc/1"].stale and got["svc/1"].stale_reason == (
        f"scrape failed: HTTP 500 Internal Server Error ({failing.url}/metrics)"
    )
    assert got["svc/2"].stale_reason == f"scrape failed: timeout after 0.5s ({hanging.url}/metrics)"
    assert got["svc/3"].stale_reason.startswith("scrape failed: unparsable at line 1: invalid metric name")
    assert got["svc/4"].stale_reason.startswith("scrape failed: connection refused")
    for rid in ("svc/1", "svc/2", "svc/3", "svc/4"):
        assert got[rid].stale_since == T0
        assert got[rid].running is None
    assert scrape_source.last_scrapes[("svc", "svc/0")].ok


def test_rates_and_quantiles_across_collects_and_a_restart(
    servers: StartServer, scrape_source: ScrapeSource
) -> None:
    current = {"server": VllmExposition()}
    replica = servers(lambda: (200, current["server"].render()))

    def finish(n: int, ttft: float, engine: int) -> None:
        current["server"].finish(
            [Request(ttft=ttft, e2e=2.0, itl=[0.02] * 9, prompt_tokens=50, generation_tokens=10)] * n,
            engine=engine,
        )

    scrape_source.collect("svc", {"svc/0": replica.url}, T0)
    finish(6, 0.03, engine=0)
    finish(4, 0.03, engine=1)
    scrape_source.collect("svc", {"svc/0": replica.url}, T0 + 10)
    current["server"] = VllmExposition()  # the replica restarted: every counter from 0
    finish(5, 0.7, engine=1)
    result = scrape_source.collect("svc", {"svc/0": replica.url}, T0 + 20)
    s = by_id(result)["svc/0"]
    assert not s.stale
    assert s.requests_per_s == pytest.approx((10 + 5) / 20)
    assert s.generation_tokens_per_s == pytest.approx(150 / 20)
    assert s.prompt_tokens_per_s == pytest.approx(750 / 20)
    # TTFT: ten at 0.03 (0.02..0.04], five at 0.7 (0.5..0.75]; p50 rank 7.5 -> 0.02 + 0.02 × 7.5/10
    assert s.ttft_p50_s == pytest.approx(0.035)
    # p90 rank 13.5 -> 0.5 + 0.25 × 3.5/5
    assert s.ttft_p90_s == pytest.approx(0.675)
    assert s.e2e_p50_s == pytest.approx(1.5 + 0.5 * 7.5 / 15)  # all fifteen in (1.5, 2.0]


def test_frozen_gauges_and_forgotten_replicas(servers: StartServer, scrape_source: ScrapeSource) -> None:
    stuck = VllmExposition()
    stuck.set_load(4, 0, 0.3, engine=0)  # in flight, yet nothing ever moves
    replica = servers(lambda: (200, stuck.render()))
    other = servers(lambda: (200, VllmExposition().render()))
    both = {"svc/0": replica.url, "svc/1": other.url}
    for t in (0, 40, 80, 110):
        assert not by_id(scrape_source.collect("svc", both, T0 + t))["svc/0"].stale
    s = by_id(scrape_source.collect("svc", both, T0 + 130))["svc/0"]
    assert s.stale and s.stale_reason.startswith("gauges frozen: 4 running, 0 waiting, and no counter moved")
    assert s.stale_since == T0 + 120
    assert not by_id(scrape_source.collect("svc", both, T0 + 130))["svc/1"].stale  # idle: nothing in flight

    scrape_source.collect("svc", {"svc/0": replica.url}, T0 + 140)
    assert set(scrape_source.last_scrapes) == {("svc", "svc/0")}
    assert ("svc", "svc/1") not in scrape_source._windows


def test_old_readings_are_dropped_and_the_window_stays_bounded(
    servers: StartServer, scrape_source: ScrapeSource
) -> None:
    replica = servers(lambda: (200, VllmExposition().render()))
    for t in range(0, 400, 10):
        scrape_source.collect("svc", {"svc/0": replica.url}, T0 + t)
    window = scrape_source._windows[("svc", "svc/0")]
    assert window[0].at >= T0 + 390 - scrape_source.retention_s
    assert len(window) == int(scrape_source.retention_s / 10) + 1


def test_the_newer_vllm_families_reach_the_signals_and_the_api(
    servers: StartServer, scrape_source: ScrapeSource
) -> None:
    """The emulator's `/metrics` (waiting by reason, preemptions, sleep state as current vLLM
    exports them) through a real scrape: a preemption rate, KV pressure and the sleep state."""
    clock = [0.0]
    # A cache that holds one of two sequences: the newer one is preempted while the other runs.
    engine = Engine(EngineConfig(cold_start_s=0.0, kv_cache_tokens=160, max_model_len=160), lambda: clock[0])
    exporter = VllmMetricsExporter(engine, "m")
    server = servers(lambda: (200, exporter.render().decode()))
    first = scrape_source.collect("svc", {"svc/0": server.url}, T0)
    assert first.replicas[0].preemptions_per_s is None  # one reading: no rate yet
    for _ in range(2):
        engine.submit(prompt_tokens=60, max_tokens=40)
    while engine.stats.preemptions == 0 and (end := engine.next_event_at()) is not None:
        clock[0] = end
        engine.advance()
    second = scrape_source.collect("svc", {"svc/0": server.url}, T0 + 10)
    s = second.replicas[0]
    assert not s.stale
    assert s.preemptions_per_s == pytest.approx(engine.stats.preemptions / 10)
    assert s.waiting_capacity == engine.num_waiting > 0 and s.waiting_deferred == 0.0
    assert (s.sleep_state, s.kv_pressure) == ("awake", True)
    engine.sleep(level=1)
    shown = signals_out(scrape_source.collect("svc", {"svc/0": server.url}, T0 + 20).replicas[0])
    assert (shown.sleep_state, shown.waiting_capacity) == ("weights_offloaded", 0.0)


def test_collect_never_raises(scrape_source: ScrapeSource) -> None:
    result = scrape_source.collect("svc", {"svc/0": "not a url", "svc/1": "http://[::1"}, T0)
    assert all(r.stale and r.stale_reason.startswith("scrape failed:") for r in result.replicas)
    scrape_source.close()
    closed = scrape_source.collect("svc", {"svc/0": "http://127.0.0.1:1"}, T0)
    assert closed.source_error == "scrape source is closed" and closed.replicas[0].stale


# -- PromQLSource against a real Prometheus ---------------------------------------------------------


def linear_vllm_text(elapsed: float, *, v0: bool = False) -> str:
    """A vLLM text whose counters grow linearly: 2 engines (V1) or none (V0).

    Per second (all engines together): 200 prompt tokens, 50 generation tokens, 2 requests,
    10 TTFT observations (4 in (0.04, 0.06], 4 in (0.06, 0.08], 2 in (0.25, 0.5]) and, in V1 only,
    2 e2e observations in (1.0, 1.5]. Gauges: running 3 + 5, waiting 1 + 0, KV 0.25 / 0.75 (a V0
    server: running 2, waiting 4, KV 0.3). V1 only, as newer vLLM: waiting by reason (capacity
    1 + 0, deferred 0 + 0), 0.5 preemptions per second and every engine asleep at level 1.
    """
    engines = [""] if v0 else ['engine="0",', 'engine="1",']
    share = 1 / len(engines)
    model = f'model_name="{MODEL}"'
    lines = []

    def family(name: str, kind: str) -> None:
        lines.append(f"# HELP {name} {name}.")
        lines.append(f"# TYPE {name} {kind}")

    gauges: dict[str, tuple[float, ...]]
    if v0:
        gauges = {"running": (2.0,), "waiting": (4.0,), "kv": (0.3,)}
    else:
        gauges = {"running": (3.0, 5.0), "waiting": (1.0, 0.0), "kv": (0.25, 0.75)}
    for name, key in (("vllm:num_requests_running", "running"), ("vllm:num_requests_waiting", "waiting")):
        family(name, "gauge")
        lines += [f"{name}{{{e}{model}}} {v}" for e, v in zip(engines, gauges[key], strict=True)]
    kv_names = (
        ["vllm:gpu_cache_usage_perc"] if v0 else ["vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"]
    )
    for name in kv_names:
        family(name, "gauge")
        # The deprecated V1 twin shows 0.9 to prove the V1 name is preferred.
        values = (0.9, 0.9) if (name == "vllm:gpu_cache_usage_perc" and not v0) else gauges["kv"]
        lines += [f"{name}{{{e}{model}}} {v}" for e, v in zip(engines, values, strict=True)]
    family("vllm:cache_config_info", "gauge")
    lines += [f'vllm:cache_config_info{{block_size="16",{e}num_gpu_blocks="2048"}} 1.0' for e in engines]
    if not v0:
        family("vllm:num_requests_waiting_by_reason", "gauge")
        for reason, values in (("capacity", (1.0, 0.0)), ("deferred", (0.0, 0.0))):
            lines += [
                f'vllm:num_requests_waiting_by_reason{{{e}{model},reason="{reason}"}} {v}'
                for e, v in zip(engines, values, strict=True)
            ]
        family("vllm:engine_sleep_state", "gauge")
        for state, v in (("awake", 0.0), ("weights_offloaded", 1.0), ("discard_all", 0.0)):
            lines += [f'vllm:engine_sleep_state{{{e}{model},sleep_state="{state}"}} {v}' for e in engines]
        family("vllm:num_preemptions_total", "counter")
        lines += [f"vllm:num_preemptions_total{{{e}{model}}} {0.5 * share * elapsed!r}" for e in engines]
    for name, per_s in (("vllm:prompt_tokens_total", 200), ("vllm:generation_tokens_total", 50)):
        family(name, "counter")
        lines += [f"{name}{{{e}{model}}} {per_s * share * elapsed!r}" for e in engines]
        lines += [f"{name[:-6]}_created{{{e}{model}}} 1.7e9" for e in engines]
    family("vllm:request_success_total", "counter")
    for e in engines:
        lines.append(
            f'vllm:request_success_total{{{e}finished_reason="stop",{model}}} {1.5 * share * elapsed!r}'
        )
        lines.append(
            f'vllm:request_success_total{{{e}finished_reason="length",{model}}} {0.5 * share * elapsed!r}'
        )
    hists = {"vllm:time_to_first_token_seconds": {0.04: 0, 0.06: 4, 0.08: 8, 0.25: 8, 0.5: 10, 1.0: 10}}
    if not v0:
        hists["vllm:e2e_request_latency_seconds"] = {1.0: 0, 1.5: 2, 5.0: 2}
    for name, cumulative in hists.items():
        family(name, "histogram")
        total = max(cumulative.values())
        for e in engines:
            for bound, per_s in cumulative.items():
                lines.append(f'{name}_bucket{{{e}le="{bound}",{model}}} {per_s * share * elapsed!r}')
            lines.append(f'{name}_bucket{{{e}le="+Inf",{model}}} {total * share * elapsed!r}')
            lines.append(f"{name}_count{{{e}{model}}} {total * share * elapsed!r}")
            lines.append(f"{name}_sum{{{e}{model}}} {0.1 * total * share * elapsed!r}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    if not Path(PROMETHEUS).exists() and shutil.which("prometheus") is None:
        require_service("prometheus", f"{PROMETHEUS} not found (Debian package `prometheus`)")
    binary = PROMETHEUS if Path(PROMETHEUS).exists() else str(shutil.which("prometheus"))
    start = time.monotonic()
    targets = {
        "v1": TextServer(lambda: (200, linear_vllm_text(time.monotonic() - start))),
        "v0": TextServer(lambda: (200, linear_vllm_text(time.monotonic() - start, v0=True))),
        "down": TextServer(lambda: (500, "engine dead\n")),
    }
    tmp = tmp_path_factory.mktemp("prometheus")
    host = lambda name: instance_of(targets[name].url)  # noqa: E731
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": "vllm", "static_configs": [{"targets": [host("v1"), host("v0"), host("down")]}]},
            {"job_name": "vllm-again", "static_configs": [{"targets": [host("v0")]}]},
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (tmp / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def enough_history() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"prometheus exited: {(tmp / 'prometheus.log').read_text()}")
            try:
                answer = httpx.get(
                    f"{url}/api/v1/query",
                    params={"query": 'min(count_over_time(vllm:num_requests_running{job="vllm"}[20s]))'},
                    timeout=2,
                ).json()
            except (httpx.HTTPError, ValueError):  # a starting Prometheus answers 503 in plain text
                return False
            result = answer.get("data", {}).get("result", [])
            return bool(result) and float(result[0]["value"][1]) >= 6  # >= 6 s of 1 s samples

        wait_until(enough_history, timeout=60, interval=0.2, what="Prometheus to hold 6 s of samples")
        yield {"url": url, **{name: s.url for name, s in targets.items()}}
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        for s in targets.values():
            s.close()


@pytest.mark.slow
def test_promql_signals_match_the_served_load(prometheus: dict[str, str]) -> None:
    source = PromQLSource(prometheus["url"], selector='job="vllm"', window_s=4, stale_after_s=30)
    try:
        replicas = {"svc/v1": prometheus["v1"], "svc/v0": prometheus["v0"], "svc/down": prometheus["down"]}
        replicas["svc/absent"] = closed_port_url()
        result = source.collect("svc", replicas, T0)
    finally:
        source.close()
    assert result.source_error is None
    got = by_id(result)

    v1 = got["svc/v1"]
    assert not v1.stale and v1.at == T0
    assert (v1.running, v1.waiting) == (8.0, 1.0)  # engines summed
    assert v1.kv_usage == 0.5  # avg over engines, V1 name preferred over its 0.9 twin
    assert v1.kv_tokens_used == 0.5 * 2 * 2048 * 16
    assert v1.prompt_tokens_per_s == pytest.approx(200, rel=0.03)
    assert v1.generation_tokens_per_s == pytest.approx(50, rel=0.03)
    assert v1.requests_per_s == pytest.approx(2, rel=0.03)
    # TTFT per second: cumulative 0.06: 4, 0.08: 8, 0.25: 8, 0.5: 10 of 10.
    assert v1.ttft_p50_s == pytest.approx(0.06 + 0.02 * (5 - 4) / 4)  # rank 5
    assert v1.ttft_p90_s == pytest.approx(0.25 + 0.25 * (9 - 8) / 2)  # rank 9
    assert v1.ttft_p99_s == pytest.approx(0.25 + 0.25 * (9.9 - 8) / 2)  # rank 9.9
    assert v1.e2e_p50_s == pytest.approx(1.0 + 0.5 * 1 / 2)  # 2 in (1.0, 1.5], rank 1
    assert (v1.waiting_capacity, v1.waiting_deferred) == (1.0, 0.0)
    assert v1.preemptions_per_s == pytest.approx(0.5, rel=0.03)
    assert v1.sleep_state == "weights_offloaded"  # both engines at level 1
    assert v1.kv_pressure is True  # preempting while a request waits for capacity

    v0 = got["svc/v0"]
    assert not v0.stale
    assert (v0.running, v0.waiting, v0.kv_usage) == (2.0, 4.0, 0.3)  # the V0 name, through `or`
    assert v0.kv_tokens_used == pytest.approx(0.3 * 2048 * 16)
    assert v0.e2e_p50_s is None and v0.e2e_p99_s is None  # no such histogram: unknown, not 0
    assert v0.ttft_p50_s == pytest.approx(0.065)
    # families an older vLLM does not have: unknown, not 0
    assert (v0.waiting_capacity, v0.waiting_deferred, v0.preemptions_per_s, v0.sleep_state) == (None,) * 4
    assert v0.kv_pressure is None

    down = got["svc/down"]
    assert (
        down.stale
        and down.stale_reason == f"Prometheus could not scrape {instance_of(prometheus['down'])} (up=0)"
    )
    assert down.stale_since == T0 and down.running is None

    absent = got["svc/absent"]
    assert absent.stale and absent.stale_reason.startswith("Prometheus has no target for 127.0.0.1:")
    assert source.last_problems == ()


@pytest.mark.slow
def test_promql_several_series_for_one_instance_are_combined_and_noted(prometheus: dict[str, str]) -> None:
    source = PromQLSource(prometheus["url"], selector='job=~"vllm|vllm-again"', window_s=4)
    try:
        result = source.collect("svc", {"svc/v0": prometheus["v0"]}, T0)
    finally:
        source.close()
    s = by_id(result)["svc/v0"]
    inst = instance_of(prometheus["v0"])
    assert not s.stale
    assert s.running == 4.0  # two jobs scrape it: sum by (instance) adds both
    assert f"up: 2 series for instance {inst!r}, lowest taken" in source.last_problems


@pytest.mark.slow
def test_promql_query_errors_fail_the_whole_source(prometheus: dict[str, str]) -> None:
    source = PromQLSource(prometheus["url"], selector='job="vllm",,bad{')
    try:
        result = source.collect("svc", {"svc/v1": prometheus["v1"]}, T0)
    finally:
        source.close()
    assert result.source_error is not None and "bad_data" in result.source_error
    assert result.replicas[0].stale and result.replicas[0].stale_reason.startswith("metrics source failed:")


def test_promql_unreachable_prometheus_is_a_source_error() -> None:
    url = closed_port_url()
    source = PromQLSource(url, timeout_s=1)
    try:
        first = source.collect("svc", {"svc/0": "http://10.0.0.1:8000", "svc/1": "http://10.0.0.2:8000"}, T0)
        later = source.collect("svc", {"svc/0": "http://10.0.0.1:8000"}, T0 + 10)
    finally:
        source.close()
    assert first.source_error is not None and first.source_error.startswith(
        f"up: Prometheus at {url} unreachable"
    )
    assert f"(and {len(source.queries(['x:1'])) - 1} more failed queries)" in first.source_error
    assert [r.replica for r in first.replicas] == ["svc/0", "svc/1"]
    assert all(r.stale and r.running is None and r.stale_since == T0 for r in first.replicas)
    assert later.replicas[0].stale_since == T0  # still the first time it was seen stale


def test_promql_queries_are_what_the_docstring_says() -> None:
    source = PromQLSource("http://prometheus:9090", selector='job="vllm", namespace="llm"', window_s=90)
    try:
        queries = source.queries(["10.0.0.1:8000", "vllm-0.svc:8000"])
    finally:
        source.close()
    sel = 'job="vllm", namespace="llm",instance=~"10\\\\.0\\\\.0\\\\.1:8000|vllm-0\\\\.svc:8000"'
    assert queries["running"] == f"sum by (instance) (vllm:num_requests_running{{{sel}}})"
    assert queries["kv_usage"] == (
        f"avg by (instance) (vllm:kv_cache_usage_perc{{{sel}}})"
        f" or avg by (instance) (vllm:gpu_cache_usage_perc{{{sel}}})"
    )
    assert (
        queries["generation_tokens_per_s"]
        == f"sum by (instance) (rate(vllm:generation_tokens_total{{{sel}}}[90s]))"
    )
    assert queries["ttft_p99"] == (
        "histogram_quantile(0.99, sum by (instance, le) "
        f"(rate(vllm:time_to_first_token_seconds_bucket{{{sel}}}[90s])))"
    )
    assert queries["waiting_capacity"] == (
        f'sum by (instance) (vllm:num_requests_waiting_by_reason{{{sel},reason="capacity"}})'
    )
    assert (
        queries["preemptions_per_s"] == f"sum by (instance) (rate(vllm:num_preemptions_total{{{sel}}}[90s]))"
    )
    assert queries["sleep_state"] == f"vllm:engine_sleep_state{{{sel}}}"
    assert len(queries) == 19


# -- `lowtide metrics parse` ------------------------------------------------------------------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"


def run_parse(*args: str) -> Result:
    return CliRunner().invoke(metrics_app, ["parse", *args], env={"COLUMNS": "200"})


def test_cli_parse_a_file_as_json() -> None:
    result = run_parse(str(FIXTURES / "v1_dp2.txt"), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is True and data["error"] is None and data["version"] == "v1"
    assert (data["running"], data["waiting"], data["kv_usage"]) == (8.0, 1.0, 0.5)
    assert (data["kv_capacity_tokens"], data["kv_tokens_used"]) == (65536.0, 32768.0)
    assert (data["prompt_tokens_total"], data["generation_tokens_total"], data["requests_total"]) == (
        2100,
        210,
        5,  # 6 finished, one of them aborted: not served
    )
    ttft = data["histograms"]["ttft"]
    assert ttft["count"] == 6 and ttft["buckets"][-1] == ["+Inf", 6.0]
    # six TTFTs: p50 rank 3 -> 0.04 + 0.02 × (3 - 1) / 2
    assert ttft["p50"] == pytest.approx(0.06)
    assert data["problems"] == []


def test_cli_parse_a_file_as_a_table() -> None:
    result = run_parse(str(FIXTURES / "v0.txt"))
    assert result.exit_code == 0, result.output
    assert "vLLM metrics as lowtide reads them" in result.stdout
    assert "v0" in result.stdout and "32,768" in result.stdout
    assert "TTFT: p50 / p90 / p99 (s)" in result.stdout


def test_cli_parse_a_pasted_transcript_with_a_broken_line(tmp_path: Path) -> None:
    pasted = tmp_path / "pasted.txt"
    pasted.write_text(
        "$ curl http://0.0.0.0:8000/metrics\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 8.0\n'
        "...\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m",...} 1\n'
    )
    result = run_parse(str(pasted), "--json")
    assert result.exit_code == 2
    assert json.loads(result.stdout)["running"] == 8.0  # the family finished before the bad line
    assert "unparsable at line 4" in result.stderr  # of the text without `$ curl` and `...`


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        (b"\xff\xfe\x00garbage", "not UTF-8 text"),
        (b"<html>hello</html>\n", "unparsable at line 1"),
        (b"process_cpu_seconds_total 3\n", "no vLLM metrics"),
    ],
)
def test_cli_parse_exits_2_when_unusable(tmp_path: Path, content: bytes | None, message: str) -> None:
    path = tmp_path / "metrics.txt"
    if content is not None:
        path.write_bytes(content)
    result = run_parse(str(path))
    assert result.exit_code == 2
    assert message in result.stderr


def test_cli_parse_a_url(servers: StartServer) -> None:
    text = (FIXTURES / "v1_dp2.txt").read_text()
    healthy = servers(lambda: (200, text))
    cut = servers(lambda: (200, text[:5000]))
    failing = servers(lambda: (503, "overloaded"))
    ok = run_parse(f"{healthy.url}/metrics", "--json")
    assert ok.exit_code == 0 and json.loads(ok.stdout)["running"] == 8.0
    truncated = run_parse(f"{cut.url}/metrics")
    assert truncated.exit_code == 2 and "truncated" in truncated.stderr
    http_error = run_parse(f"{failing.url}/metrics")
    assert http_error.exit_code == 2 and "HTTP 503 Service Unavailable" in http_error.stderr
    refused = run_parse(f"{closed_port_url()}/metrics")
    assert refused.exit_code == 2 and "cannot fetch" in refused.stderr
