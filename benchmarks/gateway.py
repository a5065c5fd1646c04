"""Benchmark: the latency the gateway adds to a request, and the request rate it sustains.

Separate processes on this machine, so that none shares a GIL with another:
- backend(s): a raw ASGI app under uvicorn (h11) answering
  `POST /v1/chat/completions` at once: a ~0.5 KiB chat.completion JSON, or, with `"stream": true`,
  a short SSE stream (--stream-chunks chunks of ~150 bytes, then `data: [DONE]`);
- the gateway: the real `GatewayServer` (one thread, one uvloop event loop, httptools parser, its
  own upstream client `gateway_upstream.UpstreamPool`) with the backend(s) as the service's replicas;
- nginx (phase 0 only), in front of the same backend;
- the client (this process): an open-loop load generator on asyncio + httpx.AsyncClient (with the
  gateway's O(1) connection pool, `PooledTransport`, and not httpx's default one): request
  i is due at start + i / rate whether or not earlier ones have finished, and its latency is
  measured from the time it was due (so a client or server that falls behind shows up as latency,
  not as a quietly lower rate). Nearest-rank percentiles; stream requests also record the time to
  the first body chunk.

Phase 0, beside nginx (--proxy-requests 2000 per path, after --proxy-warmup 200 unrecorded rounds):
the same backend reached three ways, direct, through nginx (the Debian package; a generated
nginx.conf in a temp dir, run in the foreground (`daemon off`), one worker,
`proxy_http_version 1.1`, an upstream `keepalive` pool and `proxy_buffering off`, so it is as fair a
reference as a reverse proxy gets) and through the gateway, one keep-alive connection each
(`http.client`, one request at a time), interleaved round by round in a rotating order. Reports
p50/p99 of each, what each proxy adds over direct, the ratio gateway/nginx of what they add, and
the CPU milliseconds each proxy spent per request. Without nginx installed (`make bench` installs
it) the phase measures direct and the gateway only and says so.

Phase 1, steady rate (--rate 100 req/s for --duration 20 s, after --warmup s not recorded): for
each kind (json, stream), direct to the backend then through the gateway; reports p50/p90/p99 of
both and the difference (the latency the gateway adds), plus the CPU milliseconds each process
spent per request.

Phase 2, ramp (json requests, --ramp-rates, --step-seconds each): the offered rate rises until a
step is not sustained: any error, fewer than 97 % of the offered requests completed per second, or
p99 above --p99-limit-ms. The knee is the last sustained step. The same ramp runs direct too, for
reference: on this small machine the client and the backend take their share of the CPU, so the
figure is the whole system's knee; the gateway's CPU per request says what one core of it alone
would carry (1000 / gateway CPU ms per request).

Run:  .venv/bin/python benchmarks/gateway.py [--proxy-requests 2000] [--proxy-kinds json,stream]
          [--no-proxies] [--no-steady] [--rate 100] [--duration 20] [--no-ramp]
          [--ramp-rates 200,400,...] [--step-seconds 5] [--backends 1]
Writes benchmarks/results/gateway.json (machine, parameters, figures).
Not a test: nothing here asserts a time (docs/architecture.md §10).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import logging
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
from harness import free_port

from lowtide.adapters.gateway_pool import PooledTransport, fail_missing_sniffio_fast

DEFAULT_OUT = Path(__file__).parent / "results" / "gateway.json"
PATH = "/v1/chat/completions"
SERVICE = "bench"
REQUEST_JSON = json.dumps(
    {
        "model": "bench-model",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Summarise the plot of Hamlet in one sentence, please."},
        ],
        "max_tokens": 64,
        "temperature": 0.2,
    }
).encode()
REQUEST_STREAM = REQUEST_JSON[:-1] + b', "stream": true}'
HEADERS = {"content-type": "application/json", "authorization": "Bearer sk-bench"}

# -- the backend (a child process) ------------------------------------------------------------------

Message = MutableMapping[str, Any]


def backend_app(stream_chunks: int) -> Callable[..., Awaitable[None]]:
    completion = json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1764534000,
            "model": "bench-model",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "A Danish prince feigns madness to avenge his father's murder by his "
                        "uncle, and the revenge destroys nearly everyone, himself included.",
                    },
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 31, "completion_tokens": 29, "total_tokens": 60},
        }
    ).encode()
    chunk = (
        b"data: "
        + json.dumps(
            {
                "id": "chatcmpl-bench",
                "object": "chat.completion.chunk",
                "created": 1764534000,
                "model": "bench-model",
                "choices": [{"index": 0, "delta": {"content": " token"}, "finish_reason": None}],
            }
        ).encode()
        + b"\n\n"
    )
    json_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(completion)).encode()),
    ]
    sse_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

    async def app(
        scope: Message, receive: Callable[[], Awaitable[Message]], send: Callable[..., Any]
    ) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if b'"stream": true' not in body:
            await send({"type": "http.response.start", "status": 200, "headers": json_headers})
            await send({"type": "http.response.body", "body": completion})
            return
        await send({"type": "http.response.start", "status": 200, "headers": sse_headers})
        for _ in range(stream_chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


def tcp_socket(port: int = 0) -> socket.socket:
    # IPPROTO_TCP, or asyncio leaves Nagle on for accepted connections (~40 ms per response).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(2048)
    return sock


def serve_backend(stream_chunks: int) -> None:
    import uvicorn  # noqa: PLC0415 (child process only)

    sock = tcp_socket()
    print(f"READY {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(
        backend_app(stream_chunks),
        http="h11",
        ws="none",
        lifespan="off",
        interface="asgi3",
        log_level="warning",
        access_log=False,
    )
    uvicorn.Server(config).run(sockets=[sock])


def serve_gateway(backends: list[str]) -> None:
    from lowtide.adapters.gateway import GatewayRouter, GatewayServer  # noqa: PLC0415

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # the thread inherits it
    # Logging as the gateway process sets it up (gateway_process.main): a root handler, so uvicorn's
    # access logger has one, at WARNING. Per-request logging work then shows here as in production.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    router = GatewayRouter()
    server = GatewayServer(router)
    port = server.start(SERVICE, "127.0.0.1", 0)
    router.set_backends(SERVICE, {f"replica-{i}": url for i, url in enumerate(backends)})
    print(f"READY {port}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.stop()


# -- child process handling ---------------------------------------------------------------------------


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[str]
    url: str

    def cpu(self) -> float:
        times = psutil.Process(self.proc.pid).cpu_times()
        return float(times.user + times.system)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn(name: str, *args: str) -> Child:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--role", *args], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"{name} did not start (said {line!r}, exit {proc.wait()})")
    url = f"http://127.0.0.1:{int(line.split()[1])}"
    deadline = time.monotonic() + 15
    while True:  # answers requests yet?
        try:
            httpx.post(url + PATH, content=REQUEST_JSON, headers=HEADERS, timeout=2).raise_for_status()
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)
    return Child(name, proc, url)


# -- nginx beside the gateway: the same backend, one keep-alive connection each, interleaved ----------

NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream backend {{
        server {upstream};
        keepalive 16;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port};
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


@dataclass
class Nginx:
    """nginx as a reference reverse proxy: a generated nginx.conf in a temp dir, run in the foreground."""

    proc: subprocess.Popen[bytes]
    url: str
    workdir: tempfile.TemporaryDirectory[str]

    def cpu(self) -> float:
        """CPU seconds of the master and its worker."""
        master = psutil.Process(self.proc.pid)
        total = 0.0
        for proc in [master, *master.children(recursive=True)]:
            times = proc.cpu_times()
            total += times.user + times.system
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful shutdown (nginx docs, "Controlling nginx")
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.workdir.cleanup()


def start_nginx(backend_url: str) -> Nginx | None:
    """nginx in front of `backend_url` (HTTP/1.1 and keep-alive upstream, unbuffered like the gateway);
    None when nginx is not installed (`make bench` installs it)."""
    binary = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
    )
    if binary is None:
        print("note: nginx is not installed (make bench installs it): measuring without it", flush=True)
        return None
    workdir = tempfile.TemporaryDirectory(prefix="lowtide-bench-nginx-")
    port = free_port()
    conf = Path(workdir.name) / "nginx.conf"
    upstream = backend_url.removeprefix("http://")
    conf.write_text(NGINX_CONF.format(dir=workdir.name, upstream=upstream, port=port))
    proc = subprocess.Popen(
        [binary, "-p", workdir.name, "-c", str(conf), "-e", f"{workdir.name}/error.log"],
        start_new_session=True,
    )
    nginx = Nginx(proc, f"http://127.0.0.1:{port}", workdir)
    deadline = time.monotonic() + 15
    while True:
        try:
            httpx.post(nginx.url + PATH, content=REQUEST_JSON, headers=HEADERS, timeout=2).raise_for_status()
            return nginx
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log = Path(workdir.name, "error.log")
                nginx.stop()
                raise RuntimeError(
                    f"nginx did not start (exit {proc.poll()}): {log.read_text() if log.exists() else ''}"
                ) from None
            time.sleep(0.05)


def closed_loop(targets: dict[str, str], kind: str, requests: int, warmup: int) -> dict[str, list[float]]:
    """`requests` requests per target, one at a time, each target on its own keep-alive connection
    (http.client: no pool, no async machinery in the client's own figure), interleaved: round i sends
    one request to every target, in an order that rotates, so a slow spell of the machine falls on all
    of them alike. Returns each target's latencies (seconds, request sent to last byte read)."""
    body = REQUEST_JSON if kind == "json" else REQUEST_STREAM
    ending = b"}" if kind == "json" else b"[DONE]\n\n"
    conns: dict[str, http.client.HTTPConnection] = {}
    for name, url in targets.items():
        host, port = url.removeprefix("http://").split(":")
        conns[name] = http.client.HTTPConnection(host, int(port), timeout=10)
    latencies: dict[str, list[float]] = {name: [] for name in targets}
    names = list(targets)
    try:
        for i in range(warmup + requests):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                conn = conns[name]
                start = time.perf_counter()
                conn.request("POST", PATH, body=body, headers=HEADERS)
                response = conn.getresponse()
                data = response.read()
                end = time.perf_counter()
                if response.status != 200 or not data.endswith(ending) or response.will_close:
                    raise RuntimeError(f"{name}: HTTP {response.status}, body {data[-40:]!r}")
                if i >= warmup:
                    latencies[name].append(end - start)
    finally:
        for conn in conns.values():
            conn.close()
    return latencies


def compare_proxies(args: argparse.Namespace, backend: Child, gateway: Child) -> dict[str, Any]:
    """Direct, via nginx and via the gateway, against the same backend: added p50/p99 and the ratio."""
    nginx = start_nginx(backend.url)
    targets = {"direct": backend.url, "gateway": gateway.url}
    if nginx is not None:
        targets["nginx"] = nginx.url
    try:
        out: dict[str, Any] = {"nginx_version": nginx_version() if nginx else None}
        for kind in args.proxy_kinds:
            cpu_before = {"gateway": gateway.cpu(), "nginx": nginx.cpu() if nginx else 0.0}
            lat = closed_loop(targets, kind, args.proxy_requests, args.proxy_warmup)
            sent = args.proxy_requests + args.proxy_warmup
            cpu_ms = {"gateway": round(1000 * (gateway.cpu() - cpu_before["gateway"]) / sent, 3)}
            if nginx is not None:
                cpu_ms["nginx"] = round(1000 * (nginx.cpu() - cpu_before["nginx"]) / sent, 3)
            figures = {name: percentiles(values) for name, values in lat.items()}
            added = {name: diff(figures["direct"], figures[name]) for name in targets if name != "direct"}
            ratio: dict[str, float | None] = {}
            if "nginx" in added:
                for key in ("p50", "p99"):
                    g, n = added["gateway"][key], added["nginx"][key]
                    # nginx's added p99 can fall within the noise (<= 0): no ratio then
                    ratio[key] = round(g / n, 1) if g is not None and n is not None and n > 0 else None
            out[kind] = {
                "latency_ms": figures,
                "added_ms": added,
                "ratio_gateway_to_nginx": ratio,
                "proxy_cpu_ms_per_request": cpu_ms,
            }
            d = figures["direct"]
            print(
                f"proxies {kind:6s} ({args.proxy_requests} requests each, one keep-alive connection, "
                f"interleaved): direct p50 {d['p50']} ms, p99 {d['p99']} ms",
                flush=True,
            )
            for name, a in added.items():
                print(
                    f"  {name:7s} adds p50 {a['p50']:+.3f} ms, p99 {a['p99']:+.3f} ms "
                    f"({cpu_ms[name]} ms CPU per request)",
                    flush=True,
                )
            if ratio:
                shown = {k: "n/a (nginx within noise)" if v is None else f"{v}x" for k, v in ratio.items()}
                print(f"  gateway / nginx (added): p50 {shown['p50']}, p99 {shown['p99']}", flush=True)
        return out
    finally:
        if nginx is not None:
            nginx.stop()


def nginx_version() -> str:
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    out = subprocess.run([binary, "-v"], capture_output=True, text=True, check=False)
    return (out.stderr or out.stdout).strip().removeprefix("nginx version: ")


# -- the load generator ------------------------------------------------------------------------------


@dataclass
class Phase:
    target: str
    kind: str
    offered_rate: float
    seconds: float
    latencies: list[float] = field(default_factory=list)  # from due time to the last byte
    first_chunk: list[float] = field(default_factory=list)  # streams: from due time to the first chunk
    start_lag: list[float] = field(default_factory=list)  # how late the client started requests
    errors: Counter[str] = field(default_factory=Counter)
    wall: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return len(self.latencies)

    def achieved_rate(self) -> float:
        return self.ok / self.wall if self.wall else 0.0

    def summary(self) -> dict[str, Any]:
        total = self.ok + sum(self.errors.values())
        out: dict[str, Any] = {
            "target": self.target,
            "kind": self.kind,
            "offered_rate": self.offered_rate,
            "seconds": self.seconds,
            "requests": total,
            "ok": self.ok,
            "errors": dict(self.errors),
            "achieved_rate": round(self.achieved_rate(), 1),
            "latency_ms": percentiles(self.latencies),
            "client_start_lag_ms": percentiles(self.start_lag),
            "cpu_ms_per_request": {
                k: round(1000 * v / total, 3) if total else None for k, v in self.cpu.items()
            },
            "cpu_share": {k: round(v / self.wall, 3) if self.wall else None for k, v in self.cpu.items()},
        }
        if self.first_chunk:
            out["first_chunk_ms"] = percentiles(self.first_chunk)
        return out


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return round(1000 * ordered[max(0, math.ceil(q * len(ordered)) - 1)], 3)

    return {"p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99), "max": round(1000 * ordered[-1], 3)}


async def one_request(client: httpx.AsyncClient, kind: str, due: float, phase: Phase | None) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    first: float | None = None
    try:
        if kind == "json":
            response = await client.post(PATH, content=REQUEST_JSON, headers=HEADERS)
            ok = response.status_code == 200 and response.content.endswith(b"}")
            status = response.status_code
        else:
            tail = b""
            async with client.stream("POST", PATH, content=REQUEST_STREAM, headers=HEADERS) as response:
                async for chunk in response.aiter_raw():
                    if first is None:
                        first = loop.time()
                    tail = (tail + chunk)[-16:]
            ok = response.status_code == 200 and tail.endswith(b"[DONE]\n\n")
            status = response.status_code
    except httpx.HTTPError as exc:
        if phase is not None:
            phase.errors[type(exc).__name__] += 1
        return
    end = loop.time()
    if phase is None:
        return
    if not ok:
        phase.errors[f"HTTP {status}"] += 1
        return
    phase.latencies.append(end - due)
    phase.start_lag.append(started - due)
    if first is not None:
        phase.first_chunk.append(first - due)


async def offer(
    client: httpx.AsyncClient, kind: str, rate: float, seconds: float, phase: Phase | None
) -> float:
    """Open loop: request i is started at start + i/rate. Returns the wall time until the last ended."""
    loop = asyncio.get_running_loop()
    count = int(rate * seconds)
    start = loop.time() + 0.02
    tasks: list[asyncio.Task[None]] = []
    for i in range(count):
        due = start + i / rate
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one_request(client, kind, due, phase)))
    await asyncio.gather(*tasks)
    return loop.time() - start


async def run_phase(
    target: str, url: str, kind: str, rate: float, seconds: float, warmup: float, children: list[Child]
) -> Phase:
    # The gateway's own pool: httpx's default one costs O(connections^2) per request and made this
    # client, not the servers, collapse at a few hundred requests/s.
    transport = PooledTransport(keepalive_expiry=30, max_idle_per_origin=1024)
    async with httpx.AsyncClient(base_url=url, transport=transport, timeout=10, trust_env=False) as client:
        if warmup > 0:
            await offer(client, kind, rate, warmup, None)
        phase = Phase(target, kind, rate, seconds)
        me = psutil.Process()
        before = {c.name: c.cpu() for c in children}
        mine = me.cpu_times()
        phase.wall = await offer(client, kind, rate, seconds, phase)
        after = {c.name: c.cpu() for c in children}
        mine_after = me.cpu_times()
    phase.cpu = {name: after[name] - before[name] for name in before}
    phase.cpu["client"] = (mine_after.user + mine_after.system) - (mine.user + mine.system)
    return phase


def sustained(phase: Phase, p99_limit_ms: float) -> bool:
    p99 = percentiles(phase.latencies)["p99"]
    return (
        not phase.errors
        and phase.achieved_rate() >= 0.97 * phase.offered_rate
        and p99 is not None
        and p99 <= p99_limit_ms
    )


async def ramp(
    target: str, url: str, rates: list[float], args: argparse.Namespace, children: list[Child]
) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    knee: float | None = None
    for rate in rates:
        phase = await run_phase(target, url, "json", rate, args.step_seconds, 1.0, children)
        ok = sustained(phase, args.p99_limit_ms)
        summary = phase.summary() | {"sustained": ok}
        steps.append(summary)
        print(
            f"  ramp {target:7s} {rate:6.0f} req/s offered -> {summary['achieved_rate']:7.1f} achieved, "
            f"p50 {summary['latency_ms']['p50']} ms, p99 {summary['latency_ms']['p99']} ms, "
            f"errors {sum(phase.errors.values())}, gateway CPU {summary['cpu_share'].get('gateway')}"
            f"{'' if ok else '  <- not sustained'}",
            flush=True,
        )
        if not ok:
            break
        knee = rate
        await asyncio.sleep(0.5)  # let connections settle between steps
    return {"target": target, "knee_rate": knee, "steps": steps}


def diff(a: dict[str, float | None], b: dict[str, float | None]) -> dict[str, float | None]:
    """b - a per percentile (the maxima are single outliers: their difference means nothing)."""
    out: dict[str, float | None] = {}
    for key in ("p50", "p90", "p99"):
        x, y = a[key], b[key]
        out[key] = round(y - x, 3) if x is not None and y is not None else None
    return out


async def measure(args: argparse.Namespace, backends: list[Child], gateway: Child) -> dict[str, Any]:
    children = [*backends, gateway]
    steady: dict[str, Any] = {}
    for kind in args.kinds if args.steady else []:
        runs = {}
        for target, url in (("direct", backends[0].url), ("gateway", gateway.url)):
            phase = await run_phase(target, url, kind, args.rate, args.duration, args.warmup, children)
            runs[target] = phase.summary()
            s = runs[target]
            print(
                f"steady {kind:6s} {target:7s} {args.rate:.0f} req/s: p50 {s['latency_ms']['p50']} ms, "
                f"p90 {s['latency_ms']['p90']} ms, p99 {s['latency_ms']['p99']} ms, errors {s['errors'] or 0}"
                + (f", first chunk p50 {s['first_chunk_ms']['p50']} ms" if "first_chunk_ms" in s else ""),
                flush=True,
            )
        added = {"latency_ms": diff(runs["direct"]["latency_ms"], runs["gateway"]["latency_ms"])}
        if kind == "stream":
            added["first_chunk_ms"] = diff(
                runs["direct"]["first_chunk_ms"], runs["gateway"]["first_chunk_ms"]
            )
        print(f"  added by the gateway ({kind}): {added}", flush=True)
        steady[kind] = {**runs, "added_by_gateway": added}
    out: dict[str, Any] = {"steady": steady} if args.steady else {}
    if args.ramp:
        rates = [float(r) for r in args.ramp_rates.split(",")]
        out["ramp"] = {
            "gateway": await ramp("gateway", gateway.url, rates, args, children),
            "direct": await ramp("direct", backends[0].url, rates, args, children),
        }
    return out


# -- main ---------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--proxy-requests", type=int, default=2000, help="nginx comparison: requests per path"
    )
    parser.add_argument("--proxy-warmup", type=int, default=200, help="nginx comparison: unrecorded rounds")
    parser.add_argument("--proxy-kinds", default="json", help="nginx comparison: json, stream or both")
    parser.add_argument(
        "--no-proxies", dest="proxies", action="store_false", help="skip the nginx comparison"
    )
    parser.add_argument("--no-steady", dest="steady", action="store_false", help="skip the steady phase")
    parser.add_argument("--rate", type=float, default=100.0, help="steady phase: requests per second")
    parser.add_argument("--duration", type=float, default=20.0, help="steady phase: seconds per run")
    parser.add_argument("--warmup", type=float, default=2.0, help="unrecorded seconds before each steady run")
    parser.add_argument("--kinds", default="json,stream", help="steady phase: json, stream or both")
    parser.add_argument("--no-ramp", dest="ramp", action="store_false", help="skip the maximum-rate ramp")
    parser.add_argument("--ramp-rates", default="200,300,400,500,600,700,800,900,1000,1200,1500")
    parser.add_argument("--step-seconds", type=float, default=5.0)
    parser.add_argument(
        "--p99-limit-ms", type=float, default=50.0, help="a ramp step above this is not sustained"
    )
    parser.add_argument("--backends", type=int, default=1, help="backend processes behind the gateway")
    parser.add_argument("--stream-chunks", type=int, default=8)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)  # internal: child processes
    args = parser.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.proxy_kinds = [k for k in args.proxy_kinds.split(",") if k]

    if args.role:
        if args.role[0] == "backend":
            serve_backend(int(args.role[1]))
        elif args.role[0] == "gateway":
            serve_gateway(args.role[1:])
        return 0

    fail_missing_sniffio_fast()
    backends: list[Child] = []
    gateway: Child | None = None
    try:
        for i in range(args.backends):
            backends.append(
                spawn(f"backend{i}" if args.backends > 1 else "backend", "backend", str(args.stream_chunks))
            )
        gateway = spawn("gateway", "gateway", *[b.url for b in backends])
        print(f"backend(s) {[b.url for b in backends]}, gateway {gateway.url}", flush=True)
        load_before = os.getloadavg()
        proxies = compare_proxies(args, backends[0], gateway) if args.proxies else None
        figures = asyncio.run(measure(args, backends, gateway))
        if proxies is not None:
            figures = {"proxies": proxies, **figures}
        load_after = os.getloadavg()
    finally:
        for child in [*([gateway] if gateway else []), *backends]:
            child.stop()

    output = {
        "benchmark": "gateway: added latency vs direct, and the maximum sustained rate",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "parameters": {
            "rate": args.rate,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "proxy_requests": args.proxy_requests if args.proxies else None,
            "proxy_warmup_rounds": args.proxy_warmup,
            "proxy_kinds": args.proxy_kinds,
            "proxies_means": "direct, nginx and the gateway, one keep-alive connection each, one request "
            "at a time, interleaved; latency from sending the request to reading its last byte",
            "steady": args.steady,
            "kinds": args.kinds,
            "ramp_rates": args.ramp_rates if args.ramp else None,
            "step_seconds": args.step_seconds,
            "p99_limit_ms": args.p99_limit_ms,
            "sustained_means": "no errors, completions >= 97% of the offered rate, p99 <= p99_limit_ms",
            "backends": args.backends,
            "stream_chunks": args.stream_chunks,
            "request_bytes": len(REQUEST_JSON),
            "latency_from": "the time the request was due (open loop), to its last byte",
        },
        "results": figures,
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            # Other work on the machine shows up as noise in the latency tails: say how busy it was.
            "load_average_1m_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(output, indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.ramp:
        for target, r in figures["ramp"].items():
            print(f"knee ({target}): {r['knee_rate']} req/s sustained")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
