"""The load generator against a real HTTP server (Starlette on uvicorn, a thread, a free port).

The server streams ``max_tokens`` SSE chunks with a controllable delay, counts the requests it
has in flight, and misbehaves on purpose for requests whose prompt has a magic word count:
400 → HTTP 400, 500 → HTTP 500, 666 → connection dropped mid-stream, 667 → stream ends without
[DONE], 668 → a data line that is not JSON, 669 → an error object in the stream, 670 → the
request ends with finish_reason "abort" (as vLLM's and the emulator's /sleep do), 999 → stalls.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import typer
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from typer.testing import CliRunner

from lowtide.cli.loadgen_cmd import loadgen_app
from lowtide.emulator.loadgen import LoadReport, completions_url, percentile, run_load, run_load_sync
from lowtide.emulator.traces import TraceRequest

HTTP_400, HTTP_500, DROP, NO_DONE, BAD_JSON, STREAM_ERROR, ABORT, STALL = (
    400,
    500,
    666,
    667,
    668,
    669,
    670,
    999,
)


@dataclass
class FakeVllm:
    chunk_delay_s: float = 0.0
    in_flight: int = 0
    max_in_flight: int = 0
    received: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""
    got_five: threading.Event = field(default_factory=threading.Event)

    def enter(self, body: dict[str, Any]) -> None:
        with self.lock:
            self.received += 1
            if self.received >= 5:
                self.got_five.set()
            self.bodies.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.enter(body)
        words = len(body["prompt"].split())
        if words in (HTTP_400, HTTP_500):
            self.leave()
            return JSONResponse({"error": {"message": "no", "code": words}}, status_code=words)
        return StreamingResponse(self.stream(words, int(body["max_tokens"])), media_type="text/event-stream")

    async def stream(self, words: int, max_tokens: int) -> AsyncIterator[str]:
        try:
            if words == STALL:
                await asyncio.sleep(3600)
            for i in range(max_tokens):
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": f" t{i}"}]}) + "\n\n"
                if i == 0 and words == DROP:
                    raise RuntimeError("dropping the connection on purpose")
                if i == 0 and words == BAD_JSON:
                    yield "data: {not json\n\n"
                if i == 0 and words == STREAM_ERROR:
                    yield 'data: {"error": {"message": "engine died", "code": 500}}\n\n'
                if i == 0 and words == ABORT:
                    yield (
                        "data: " + json.dumps({"choices": [{"text": "", "finish_reason": "abort"}]}) + "\n\n"
                    )
                    break
            if words == NO_DONE:
                return
            usage = {
                "prompt_tokens": words,
                "completion_tokens": max_tokens,
                "total_tokens": words + max_tokens,
            }
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.leave()

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    """Bounded polling (tests/support.py has the same, but importing it pulls in the whole app)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def _listen() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP: Nagle off
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    return sock


@pytest.fixture
def server() -> Iterator[FakeVllm]:
    fake = FakeVllm()
    app = Starlette(
        routes=[
            Route("/v1/completions", fake.completions, methods=["POST"]),
            Route("/v1/models", fake.models, methods=["GET"]),
        ]
    )
    sock = _listen()
    config = uvicorn.Config(app, log_level="critical", lifespan="off", timeout_graceful_shutdown=1)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: srv.started, timeout=10, what="the fake vLLM server to start")
    fake.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield fake
    srv.should_exit = True
    thread.join(timeout=10)
    sock.close()
    assert not thread.is_alive()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _accounted(report: LoadReport) -> None:
    assert report.scheduled == report.sent + report.dropped_concurrency
    assert report.sent == report.ok + report.failed + report.cancelled


def test_counts_error_classes_tokens_and_percentiles(server: FakeVllm) -> None:
    server.chunk_delay_s = 0.002
    kinds = (
        [10] * 20
        + [HTTP_400] * 3
        + [HTTP_500] * 2
        + [DROP] * 2
        + [NO_DONE, BAD_JSON, STREAM_ERROR, ABORT, STALL]
    )
    stream = [TraceRequest(at_s=0.01 * i, prompt_tokens=k, max_tokens=5) for i, k in enumerate(kinds)]
    report = run_load_sync(
        stream, server.url, speedup=1.0, request_timeout_s=1.0, keep_results=True, max_concurrency=64
    )
    _accounted(report)
    assert (report.scheduled, report.sent, report.ok, report.dropped_concurrency, report.cancelled) == (
        32,
        32,
        20,
        0,
        0,
    )
    assert report.errors == {"http_4xx": 3, "http_5xx": 2, "broken_stream": 5, "aborted": 1, "timeout": 1}
    assert report.status_codes == {"200": 27, "400": 3, "500": 2}
    assert report.model == "fake-model"
    assert report.output_tokens == 20 * 5  # from the usage chunk of the successful streams
    assert report.prompt_tokens_sent == sum(kinds)
    assert server.received == 32
    assert report.error_samples["http_4xx"] == ['HTTP 400: {"error":{"message":"no","code":400}}']
    assert len(report.error_samples["broken_stream"]) == 3  # at most 3 distinct messages per class
    detail = {r.prompt_tokens: r.detail or "" for r in report.results}
    assert "RemoteProtocolError" in detail[DROP]
    assert detail[NO_DONE] == "stream ended without [DONE]"
    assert detail[BAD_JSON].startswith("bad SSE data: '{not json'")
    assert "engine died" in detail[STREAM_ERROR]
    assert detail[STALL] == "no complete answer within 1 s"
    assert detail[ABORT] == 'finish_reason "abort"'
    for summary in (report.ttft_s, report.latency_s):
        assert summary is not None and summary.count == 20
        assert summary.p50 <= summary.p90 <= summary.p99 <= summary.max
    ok = [r for r in report.results if r.error is None]
    assert len(ok) == 20 and all(r.ttft_s is not None and r.latency_s is not None for r in ok)
    assert all(r.ttft_s <= r.latency_s for r in ok if r.ttft_s is not None and r.latency_s is not None)
    assert [r.index for r in report.results] == list(range(32))
    assert [r.error for r in report.results if r.prompt_tokens == STALL] == ["timeout"]
    assert [r.error for r in report.results if r.prompt_tokens == DROP] == ["broken_stream"] * 2
    data = json.loads(report.to_json())
    assert data["ok"] == 20 and data["failed"] == 12 and data["errors"]["timeout"] == 1
    assert data["ttft_s"]["count"] == 20 and "results" not in data
    text = report.format_text()
    assert "dropped (concurrency limit 64) 0" in text and "http_5xx 2" in text


def test_speedup_compresses_trace_time_and_duration_stops_sending(server: FakeVllm) -> None:
    stream = [TraceRequest(at_s=float(t), prompt_tokens=20, max_tokens=3) for t in range(120)]
    report = run_load_sync(stream, server.url, speedup=60.0, duration_s=60.0)
    _accounted(report)
    assert (report.scheduled, report.sent, report.ok) == (60, 60, 60)  # at_s 0..59: a 60 s trace, ~1 s
    assert report.errors == {} and report.cancelled == 0
    assert report.send_window_s == pytest.approx(1.0)  # the duration ended it: 60 trace s / 60
    assert report.offered_rps == pytest.approx(60.0)
    assert server.received == 60


def test_concurrency_bound_drops_arrivals_beyond_it(server: FakeVllm) -> None:
    server.chunk_delay_s = 0.1  # every request takes >= 0.3 s
    burst = [TraceRequest(at_s=0.0, prompt_tokens=5, max_tokens=3) for _ in range(40)]
    report = run_load_sync(burst, server.url, speedup=1.0, max_concurrency=4)
    _accounted(report)
    assert (report.scheduled, report.sent, report.ok, report.dropped_concurrency) == (40, 4, 4, 36)
    assert server.max_in_flight == 4 and report.max_in_flight == 4
    assert "dropped (concurrency limit 4) 36" in report.format_text()


def test_concurrency_bound_under_a_steady_stream(server: FakeVllm) -> None:
    server.chunk_delay_s = 0.05  # ~0.2 s per request at 100 req/s: ~20 wanted in flight
    stream = [TraceRequest(at_s=0.01 * i, prompt_tokens=5, max_tokens=4) for i in range(150)]
    report = run_load_sync(stream, server.url, speedup=1.0, max_concurrency=5)
    _accounted(report)
    assert report.scheduled == 150
    assert report.dropped_concurrency > 0
    assert report.ok == report.sent
    assert server.max_in_flight <= 5 and report.max_in_flight <= 5


def test_unreachable_target_is_a_connect_error() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    stream = [TraceRequest(at_s=0.0, prompt_tokens=5, max_tokens=5) for _ in range(5)]
    report = run_load_sync(stream, url, speedup=1.0, connect_timeout_s=2.0)
    _accounted(report)
    assert report.errors == {"connect": 5}
    assert (report.ok, report.status_codes, report.model) == (0, {}, None)
    assert report.ttft_s is None and report.latency_s is None


def test_requests_in_flight_at_the_end_are_cancelled_after_the_drain(server: FakeVllm) -> None:
    stream = [TraceRequest(at_s=0.0, prompt_tokens=STALL, max_tokens=1)] * 3 + [
        TraceRequest(at_s=0.0, prompt_tokens=5, max_tokens=1)
    ] * 2
    report = run_load_sync(stream, server.url, speedup=1.0, drain_timeout_s=0.3)
    _accounted(report)
    assert (report.sent, report.ok, report.cancelled, report.failed) == (5, 2, 3, 0)
    wait_until(lambda: server.in_flight == 0, timeout=10, what="the server to see the cancelled requests go")


def test_stop_event_ends_sending_early(server: FakeVllm) -> None:
    stream = [TraceRequest(at_s=0.05 * i, prompt_tokens=5, max_tokens=1) for i in range(400)]  # 20 s

    async def main() -> LoadReport:
        stop = asyncio.Event()
        task = asyncio.create_task(run_load(stream, server.url, speedup=1.0, stop=stop))
        assert await asyncio.to_thread(server.got_five.wait, 10)
        stop.set()
        return await asyncio.wait_for(task, timeout=30)

    report = asyncio.run(main())
    _accounted(report)
    assert 5 <= report.scheduled < 400
    assert report.ok == report.sent


def test_request_body_extensions_are_opt_in(server: FakeVllm) -> None:
    stream = [TraceRequest(at_s=0.0, prompt_tokens=37, max_tokens=2)]
    run_load_sync(stream, server.url, speedup=1.0)
    plain = server.bodies[-1]
    assert plain["model"] == "fake-model" and plain["stream"] is True and plain["max_tokens"] == 2
    assert len(plain["prompt"].split()) == 37
    assert "prompt_tokens" not in plain and "ignore_eos" not in plain
    run_load_sync(stream, server.url + "/v1", speedup=1.0, model="m2", emulator_hints=True, ignore_eos=True)
    hinted = server.bodies[-1]
    assert (hinted["model"], hinted["prompt_tokens"], hinted["ignore_eos"]) == ("m2", 37, True)
    # Distinct prompts: no two requests share a prefix.
    run_load_sync([TraceRequest(0.0, 50, 1), TraceRequest(0.0, 50, 1)], server.url, speedup=1.0)
    first, second = (b["prompt"] for b in server.bodies[-2:])
    assert first.split()[0] != second.split()[0]


def test_helpers() -> None:
    assert completions_url("http://h:8000") == "http://h:8000/v1/completions"
    assert completions_url("http://h:8000/v1/") == "http://h:8000/v1/completions"
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError, match="speedup"):
        run_load_sync([], "http://h", speedup=0)
    with pytest.raises(ValueError, match="http"):
        run_load_sync([], "h:80")


# -- the command line --------------------------------------------------------------------------------


def _root() -> typer.Typer:
    root = typer.Typer(add_completion=False)

    @root.command()
    def version() -> None:
        """Another command, so that the root is a group as in lowtide's CLI."""

    root.add_typer(loadgen_app, name="loadgen")
    return root


def test_cli_runs_a_synthetic_trace(server: FakeVllm) -> None:
    result = CliRunner().invoke(
        _root(),
        [
            "loadgen",
            "--trace",
            "synthetic:constant,rate=20#tokens=8/2",
            "--target",
            server.url,
            "--speedup",
            "10",
            "--duration",
            "5",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["scheduled"] == data["sent"] == data["ok"] == server.received > 40
    assert data["trace"] == "synthetic:constant,rate=20#tokens=8/2"
    assert data["model"] == "fake-model" and data["errors"] == {}
    assert all(len(b["prompt"].split()) == 8 and b["max_tokens"] == 2 for b in server.bodies)


def test_cli_text_report(server: FakeVllm) -> None:
    args = [
        "loadgen",
        "--trace",
        "synthetic#rate=5",
        "--target",
        server.url,
        "--duration",
        "2",
        "--speedup",
        "20",
    ]
    result = CliRunner().invoke(_root(), args)
    assert result.exit_code == 0, result.output
    assert "requests  scheduled" in result.stdout and "TTFT" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "nope:x"], "unknown trace source 'nope'"),
        (["--trace", "azure:/no/such.csv"], "no readable file '/no/such.csv'"),
        (["--trace", "synthetic"], "synthetic traces need --duration"),
        (["--trace", "synthetic", "--duration", "5", "--speedup", "0"], "--speedup must be > 0"),
        (["--trace", "synthetic", "--duration", "5", "--target", "localhost:8000"], "http(s) URL"),
    ],
)
def test_cli_bad_input_exits_2(args: list[str], message: str) -> None:
    full = ["loadgen", *args]
    if "--target" not in full:
        full += ["--target", "http://127.0.0.1:9"]
    result = CliRunner().invoke(_root(), full)
    assert result.exit_code == 2, result.output
    assert message in result.stderr


def test_cli_nothing_succeeded_exits_1() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    result = CliRunner().invoke(
        _root(),
        ["loadgen", "--trace", "synthetic#rate=20", "--target", url, "--duration", "1", "--speedup", "10"],
    )
    assert result.exit_code == 1, result.output
    assert "no request succeeded" in result.stderr
    assert "connect" in result.stdout


def test_a_stream_that_fails_midway_raises_after_draining(server: FakeVllm) -> None:
    def stream() -> Iterator[TraceRequest]:
        for i in range(3):
            yield TraceRequest(at_s=0.01 * i, prompt_tokens=5, max_tokens=2)
        raise ValueError("chunk-1-trace.csv:7: rate is not a number")

    with pytest.raises(ValueError, match="rate is not a number"):
        run_load_sync(stream(), server.url, speedup=1.0)
    assert server.received == 3
    wait_until(lambda: server.in_flight == 0, timeout=10, what="the three requests to finish")


def test_cli_malformed_trace_file_exits_2(tmp_path: Path) -> None:
    (tmp_path / "chunk-1-trace.csv").write_text("0,1.0,1.0,Gamma,1.0,1.0\n600,x,1.0,Gamma,1.0,1.0\n")
    result = CliRunner().invoke(
        _root(),
        ["loadgen", "--trace", f"servegen:{tmp_path}", "--target", "http://127.0.0.1:9", "--duration", "5"],
    )
    assert result.exit_code == 2, result.output
    assert "chunk-1-trace.csv:2: rate is not a number: 'x'" in result.stderr
