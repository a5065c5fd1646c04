"""Replay a request stream against an OpenAI-compatible server and measure what it does.

`run_load` sends each `TraceRequest` at ``at_s / speedup`` wall seconds after the start as a
streaming ``POST {target}/v1/completions`` (``stream: true``, ``max_tokens``, a prompt of exactly
``prompt_tokens`` words — about that many tokens for common English words with BPE tokenizers —
that starts with the request's index so no two prompts share a prefix-cache block) and records:

* TTFT: from sending the request to the first SSE ``data:`` event that carries ``choices``;
* latency: from sending to ``data: [DONE]``;
* output tokens: ``usage.completion_tokens`` when the server sends usage (we ask with
  ``stream_options.include_usage``), else the number of content chunks;
* status codes and an error class for every failed request: ``connect`` (no connection: refused,
  unreachable, connect timeout), ``timeout`` (no answer within ``request_timeout_s`` / a read
  stalled that long), ``http_4xx`` / ``http_5xx`` (error status), ``broken_stream`` (the
  connection broke or closed after the request was sent, a stream ended without ``[DONE]``, a
  ``data:`` line that is not JSON, or an ``error`` object inside the stream), ``aborted`` (the
  server ended the request with ``finish_reason: "abort"``, as vLLM and the emulator do for
  requests aborted by ``/sleep`` or shutdown), ``other`` (any other client-side failure).

Arrivals are open-loop, like real traffic: a request whose turn comes while ``max_concurrency``
requests are in flight is **dropped** and counted as "dropped (concurrency limit)"; it is never
delayed, so the offered load keeps the trace's timing and a slow server cannot slow the
generator down (delaying would hide overload). Every request of the stream is accounted for:
``scheduled = sent + dropped`` and ``sent = ok + failed + cancelled``.

Stopping: no request is sent at or after trace second ``duration_s`` (or once `stop` is set);
requests still in flight then get ``drain_timeout_s`` wall seconds to finish, after which they are
cancelled and counted as "cancelled at stop". The stream is produced by a helper thread up to
32k requests ahead, so generating a large ServeGen window does not stall response timing, and the
clock starts when the first requests are ready (reading 162 ServeGen files takes a second or two).

Extensions, both off by default: ``emulator_hints`` adds ``"prompt_tokens": N`` to the body (the
lowtide emulator reads it; real vLLM accepts unknown fields — its request models use pydantic
``extra="allow"`` — but logs "The following fields were present in the request but ignored" for
every request); ``ignore_eos`` sends vLLM's ``ignore_eos: true`` so that a real model generates the
trace's ``max_tokens``. Without hints the emulator estimates ``ceil(words × 1.3)`` prompt
tokens, i.e. 30 % more than the trace says.

`run_load_sync` is the blocking wrapper. Neighbours: `emulator.traces` makes the streams,
`cli.loadgen_cmd` is the command line. Must not: import lowtide beyond `lowtide.domain` and
`lowtide.emulator`, or retry requests (a retry would change the load).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from lowtide.emulator.traces import TraceRequest

ErrorClass = Literal["connect", "timeout", "http_4xx", "http_5xx", "broken_stream", "aborted", "other"]
ERROR_CLASSES: tuple[ErrorClass, ...] = (
    "connect",
    "timeout",
    "http_4xx",
    "http_5xx",
    "broken_stream",
    "aborted",
    "other",
)
ERROR_SAMPLES = 3  # distinct messages kept per error class
_WORDS = (  # common English words, one token each for most BPE tokenizers
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education"
)
_VOCABULARY = _WORDS.split()


def completions_url(target: str) -> str:
    """``{target}/v1/completions``; a target that already ends in ``/v1`` is not doubled."""
    base = target.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return f"{base}/v1/completions"


class _Prompts:
    """Prompts of an exact word count, distinct per request, cheap to build."""

    def __init__(self, seed: int, size: int = 32768) -> None:
        rng = random.Random(f"prompts:{seed}")
        self._words = rng.choices(_VOCABULARY, k=size)
        self._size = size

    def build(self, index: int, words: int) -> str:
        rest = max(words - 1, 0)
        start = (index * 7919) % self._size
        chunk = self._words[start : start + rest]
        while len(chunk) < rest:
            chunk += self._words[: rest - len(chunk)]
        return " ".join([str(index), *chunk]) if words > 0 else ""


@dataclass(frozen=True, slots=True)
class Percentiles:
    """Summary of a sample in seconds; percentiles interpolate linearly between order statistics."""

    count: int
    p50: float
    p90: float
    p99: float
    mean: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Percentiles | None:
        ordered = sorted(values)
        if not ordered:
            return None
        return cls(
            count=len(ordered),
            p50=percentile(ordered, 50),
            p90=percentile(ordered, 90),
            p99=percentile(ordered, 99),
            mean=math.fsum(ordered) / len(ordered),
            max=ordered[-1],
        )


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile of an ascending list (linear interpolation, like numpy's default)."""
    if not ordered:
        raise ValueError("percentile of an empty sample")
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What happened to one sent request (times in seconds; `sent_at_s` since the run started)."""

    index: int
    at_s: float
    sent_at_s: float
    prompt_tokens: int
    max_tokens: int
    status: int | None = None
    error: ErrorClass | None = None
    detail: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0


@dataclass
class LoadReport:
    """The outcome of a replay; `format_text` for people, `to_dict`/`to_json` for programs.

    Rates are per wall second over the sending window `send_window_s`: ``duration_s / speedup``
    when a duration was given and the replay was not stopped early, else the wall time until the
    last request was sent. Divide them by `speedup` for trace-time rates. Latency and TTFT
    percentiles cover successful requests only.
    """

    target: str
    model: str | None
    speedup: float
    max_concurrency: int
    duration_s: float | None
    scheduled: int = 0
    sent: int = 0
    ok: int = 0
    dropped_concurrency: int = 0
    cancelled: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    status_codes: dict[str, int] = field(default_factory=dict)
    ttft_s: Percentiles | None = None
    latency_s: Percentiles | None = None
    prompt_tokens_sent: int = 0
    output_tokens: int = 0
    send_window_s: float = 0.0
    wall_s: float = 0.0
    max_in_flight: int = 0
    max_send_lag_s: float = 0.0
    error_samples: dict[str, list[str]] = field(default_factory=dict)
    results: list[RequestResult] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    @property
    def offered_rps(self) -> float:
        """Requests the trace asked for, per wall second of the sending window."""
        return self.scheduled / self.send_window_s if self.send_window_s > 0 else 0.0

    @property
    def achieved_rps(self) -> float:
        """Requests actually sent, per wall second of the sending window."""
        return self.sent / self.send_window_s if self.send_window_s > 0 else 0.0

    @property
    def ok_rps(self) -> float:
        """Successful requests per wall second of the sending window."""
        return self.ok / self.send_window_s if self.send_window_s > 0 else 0.0

    def to_dict(self, include_results: bool = False) -> dict[str, Any]:
        data = asdict(self)
        if not include_results:
            data.pop("results")
        data.update(
            failed=self.failed,
            offered_rps=self.offered_rps,
            achieved_rps=self.achieved_rps,
            ok_rps=self.ok_rps,
        )
        return data

    def to_json(self, include_results: bool = False) -> str:
        return json.dumps(self.to_dict(include_results), indent=2, sort_keys=True)

    def format_text(self) -> str:
        def ms(p: Percentiles | None) -> str:
            if p is None:
                return "n/a"
            return (
                f"p50 {p.p50 * 1e3:.1f} ms  p90 {p.p90 * 1e3:.1f} ms  p99 {p.p99 * 1e3:.1f} ms  "
                f"max {p.max * 1e3:.1f} ms  (n={p.count})"
            )

        errors = "  ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(self.status_codes.items())) or "none"
        lines = [
            f"target    {self.target}  model {self.model or '(server default)'}  speedup ×{self.speedup:g}",
            f"requests  scheduled {self.scheduled}  sent {self.sent}  ok {self.ok}  failed {self.failed}  "
            f"dropped (concurrency limit {self.max_concurrency}) {self.dropped_concurrency}  "
            f"cancelled at stop {self.cancelled}",
            f"errors    {errors}",
            f"status    {codes}",
            f"rate      offered {self.offered_rps:.2f}/s  achieved {self.achieved_rps:.2f}/s  "
            f"ok {self.ok_rps:.2f}/s (wall; ÷{self.speedup:g} for trace time)",
            f"TTFT      {ms(self.ttft_s)}",
            f"latency   {ms(self.latency_s)}",
            f"tokens    prompt {self.prompt_tokens_sent} sent  output {self.output_tokens} received",
            f"client    max in flight {self.max_in_flight}  max send lag {self.max_send_lag_s * 1e3:.1f} ms  "
            f"sending {self.send_window_s:.2f} s  total {self.wall_s:.2f} s",
        ]
        for kind, samples in sorted(self.error_samples.items()):
            lines.extend(f"  {kind}: {sample}" for sample in samples)
        return "\n".join(lines)


class _Prefetcher:
    """Runs the request iterator in a helper thread and hands its items over in batches."""

    _END = object()

    def __init__(self, requests: Iterable[TraceRequest], batch: int = 512, depth: int = 64) -> None:
        self._iterator = iter(requests)
        self._batch = batch
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="loadgen-trace", daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stopped.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        while not self._stopped.is_set():
            batch: list[TraceRequest] = []
            failure: Exception | None = None
            try:
                for item in self._iterator:
                    batch.append(item)
                    if len(batch) == self._batch:
                        break
            except Exception as exc:  # handed to the consumer after the requests before it
                failure = exc
            if batch and not self._put(batch):
                return
            if failure is not None:
                self._put(failure)
                return
            if len(batch) < self._batch:
                break
        self._put(self._END)

    async def items(self) -> Iterator[TraceRequest] | None:
        """The next batch, or None at the end; re-raises what the iterator raised."""
        loop = asyncio.get_running_loop()
        got = await loop.run_in_executor(None, self._queue.get)
        if got is self._END:
            return None
        if isinstance(got, BaseException):
            raise got
        assert isinstance(got, list)
        return iter(got)

    def close(self) -> None:
        """Stop the helper thread; a consumer still waiting in `items` gets the end marker."""
        self._stopped.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._thread.join(timeout=5)
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(self._END)


class _Run:
    """The state of one replay (one event loop)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        model: str | None,
        report: LoadReport,
        emulator_hints: bool,
        ignore_eos: bool,
        request_timeout_s: float,
        keep_results: bool,
        prompts: _Prompts,
    ) -> None:
        self.client, self.url, self.model, self.report = client, url, model, report
        self.emulator_hints, self.ignore_eos = emulator_hints, ignore_eos
        self.request_timeout_s, self.keep_results, self.prompts = request_timeout_s, keep_results, prompts
        self.ttfts: list[float] = []
        self.latencies: list[float] = []
        self.errors: Counter[str] = Counter()
        self.codes: Counter[str] = Counter()

    def body(self, index: int, request: TraceRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": self.prompts.build(index, max(request.prompt_tokens, 1)),
            "max_tokens": max(request.max_tokens, 1),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model is not None:
            body["model"] = self.model
        if self.emulator_hints:
            body["prompt_tokens"] = max(request.prompt_tokens, 1)
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def send(self, index: int, request: TraceRequest, sent_at: float) -> None:
        result = await self._exchange(index, request, sent_at)
        report = self.report
        if result.status is not None:
            self.codes[str(result.status)] += 1
        if result.error is None:
            report.ok += 1
            report.output_tokens += result.output_tokens
            if result.ttft_s is not None:
                self.ttfts.append(result.ttft_s)
            if result.latency_s is not None:
                self.latencies.append(result.latency_s)
        else:
            self.errors[result.error] += 1
            samples = report.error_samples.setdefault(result.error, [])
            if len(samples) < ERROR_SAMPLES and result.detail and result.detail not in samples:
                samples.append(result.detail)
        if self.keep_results:
            report.results.append(result)

    async def _exchange(self, index: int, request: TraceRequest, sent_at: float) -> RequestResult:
        base = RequestResult(index, request.at_s, sent_at, request.prompt_tokens, request.max_tokens)
        status: int | None = None
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.request_timeout_s):
                async with self.client.stream("POST", self.url, json=self.body(index, request)) as response:
                    status = response.status_code
                    if status >= 400:
                        text = (await response.aread())[:300].decode("utf-8", "replace")
                        kind: ErrorClass = "http_4xx" if status < 500 else "http_5xx"
                        return _with(base, status=status, error=kind, detail=f"HTTP {status}: {text}")
                    if "text/event-stream" not in response.headers.get("content-type", ""):
                        return await _plain_response(base, response, started)
                    return await _read_stream(base, response, started)
        except TimeoutError:
            detail = f"no complete answer within {self.request_timeout_s:g} s"
            return _with(base, status=status, error="timeout", detail=detail)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            return _with(base, error="connect", detail=f"{type(exc).__name__}: {exc}")
        except httpx.TimeoutException as exc:
            return _with(base, status=status, error="timeout", detail=f"{type(exc).__name__}: {exc}")
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            return _with(base, status=status, error="broken_stream", detail=f"{type(exc).__name__}: {exc}")
        except httpx.HTTPError as exc:
            return _with(base, status=status, error="other", detail=f"{type(exc).__name__}: {exc}")


#: After ``data: [DONE]``, how long the rest of the body (the end of the chunked stream) is awaited.
DRAIN_AFTER_DONE_S = 0.5


def _with(base: RequestResult, **changes: Any) -> RequestResult:
    return dataclasses.replace(base, **changes)


def _aborted(choices: object) -> bool:
    return isinstance(choices, list) and any(
        isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices
    )


async def _plain_response(base: RequestResult, response: httpx.Response, started: float) -> RequestResult:
    """A server that ignored ``stream: true``: TTFT is the whole response time."""
    raw = await response.aread()
    elapsed = time.perf_counter() - started
    try:
        data = json.loads(raw)
    except ValueError:
        return _with(base, status=response.status_code, error="broken_stream", detail="response is not JSON")
    if not isinstance(data, dict):
        return _with(
            base, status=response.status_code, error="broken_stream", detail="response is not an object"
        )
    if _aborted(data.get("choices")):
        return _with(base, status=response.status_code, error="aborted", detail='finish_reason "abort"')
    usage = data.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return _with(
        base,
        status=response.status_code,
        ttft_s=elapsed,
        latency_s=elapsed,
        output_tokens=tokens if isinstance(tokens, int) else 0,
    )


async def _read_stream(base: RequestResult, response: httpx.Response, started: float) -> RequestResult:
    status = response.status_code
    first: float | None = None
    chunks = 0
    usage_tokens: int | None = None
    aborted = False
    lines = response.aiter_lines()
    async for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments, event:/id: fields
        payload = line[5:].strip()
        if payload == "[DONE]":
            if aborted:
                return _with(base, status=status, error="aborted", detail='finish_reason "abort"')
            done = time.perf_counter()
            ttft = (first if first is not None else done) - started
            tokens = usage_tokens if usage_tokens is not None else chunks
            # Read to the end of the body (briefly), as a well-behaved client does: the connection
            # can then be reused, and a gateway does not see us leave before it has finished.
            with contextlib.suppress(TimeoutError, httpx.HTTPError):
                async with asyncio.timeout(DRAIN_AFTER_DONE_S):
                    async for _ in lines:
                        pass
            return _with(base, status=status, ttft_s=ttft, latency_s=done - started, output_tokens=tokens)
        try:
            event = json.loads(payload)
        except ValueError:
            return _with(
                base, status=status, error="broken_stream", detail=f"bad SSE data: {payload[:120]!r}"
            )
        if not isinstance(event, dict):
            return _with(
                base, status=status, error="broken_stream", detail=f"bad SSE data: {payload[:120]!r}"
            )
        if "error" in event:
            detail = f"error in stream: {json.dumps(event['error'])[:200]}"
            return _with(base, status=status, error="broken_stream", detail=detail)
        choices = event.get("choices")
        if choices:
            if first is None:
                first = time.perf_counter()
            if any(isinstance(c, dict) and c.get("text") for c in choices):
                chunks += 1
            aborted = aborted or _aborted(choices)
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            usage_tokens = usage["completion_tokens"]
    return _with(base, status=status, error="broken_stream", detail="stream ended without [DONE]")


async def discover_model(client: httpx.AsyncClient, target: str) -> str | None:
    """The first model id of ``GET {target}/v1/models``, or None when that does not answer."""
    url = completions_url(target).removesuffix("/completions") + "/models"
    try:
        response = await client.get(url)
        if response.status_code != 200:
            return None
        data = response.json().get("data") or []
        model = data[0].get("id") if data and isinstance(data[0], dict) else None
        return model if isinstance(model, str) else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


async def run_load(
    requests: Iterable[TraceRequest],
    target: str,
    *,
    speedup: float = 60.0,
    duration_s: float | None = None,
    max_concurrency: int = 256,
    model: str | None = None,
    discover: bool = True,
    emulator_hints: bool = False,
    ignore_eos: bool = False,
    request_timeout_s: float = 300.0,
    connect_timeout_s: float = 5.0,
    drain_timeout_s: float = 30.0,
    keep_results: bool = False,
    prompt_seed: int = 0,
    stop: asyncio.Event | None = None,
) -> LoadReport:
    """Replay `requests` (ascending `at_s`, trace seconds) against `target` (a base URL).

    `speedup` K sends trace second t at wall second t/K. `duration_s` is in trace seconds.
    `model`: sent as is; when None and `discover`, the first id of ``/v1/models`` (else omitted).
    """
    if not (speedup > 0 and math.isfinite(speedup)):
        raise ValueError(f"speedup must be a finite number > 0, got {speedup}")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if not target.startswith(("http://", "https://")):
        raise ValueError(f"target must be an http(s) URL, got {target!r}")
    timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s, pool=request_timeout_s)
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    # trust_env=False: a proxy from the environment would sit between us and the server measured.
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        if model is None and discover:
            model = await discover_model(client, target)
        report = LoadReport(target, model, speedup, max_concurrency, duration_s)
        run = _Run(
            client,
            completions_url(target),
            model,
            report,
            emulator_hints,
            ignore_eos,
            request_timeout_s,
            keep_results,
            _Prompts(prompt_seed),
        )
        in_flight: set[asyncio.Task[None]] = set()
        prefetch = _Prefetcher(requests)
        stop = stop or asyncio.Event()
        reached_duration = False
        started = time.perf_counter()
        try:
            batch = await prefetch.items()  # the clock starts once the first requests are ready
            started = time.perf_counter()
            index = 0
            while batch is not None and not stop.is_set():
                for request in batch:
                    if duration_s is not None and request.at_s >= duration_s:
                        reached_duration = True
                        break
                    delay = request.at_s / speedup - (time.perf_counter() - started)
                    if delay > 0:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), delay)
                    else:
                        report.max_send_lag_s = max(report.max_send_lag_s, -delay)
                    if stop.is_set():
                        break
                    report.scheduled += 1
                    if len(in_flight) >= max_concurrency:
                        report.dropped_concurrency += 1
                        continue
                    report.sent += 1
                    report.prompt_tokens_sent += request.prompt_tokens
                    task = asyncio.create_task(run.send(index, request, time.perf_counter() - started))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                    report.max_in_flight = max(report.max_in_flight, len(in_flight))
                    index += 1
                if reached_duration or stop.is_set():
                    break
                batch = await prefetch.items()
        finally:
            prefetch.close()
            elapsed = time.perf_counter() - started
            spanned = duration_s is not None and not stop.is_set()  # the whole span was replayed
            report.send_window_s = duration_s / speedup if spanned and duration_s else elapsed
            if in_flight:
                _, pending = await asyncio.wait(set(in_flight), timeout=drain_timeout_s)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                report.cancelled = len(pending)
            report.wall_s = time.perf_counter() - started
            report.errors = {k: run.errors[k] for k in ERROR_CLASSES if run.errors[k]}
            report.status_codes = dict(sorted(run.codes.items()))
            report.ttft_s = Percentiles.of(run.ttfts)
            report.latency_s = Percentiles.of(run.latencies)
            report.results.sort(key=lambda r: r.index)
    return report


def run_load_sync(requests: Iterable[TraceRequest], target: str, **options: Any) -> LoadReport:
    """`run_load` from synchronous code (starts its own event loop; not from inside one)."""
    return asyncio.run(run_load(requests, target, **options))
