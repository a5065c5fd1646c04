"""The gateway's ASGI application: one per service, proxying OpenAI-style requests to a replica.

Routes:
- `/v1/...` (every method): forwarded to the backend `GatewayRouter.acquire` picks (fewest
  requests in flight). Only `/v1/` is proxied: a replica's management endpoints (`/sleep`,
  `/wake_up`, `/metrics`, `/health`, ...) stay out of the clients' reach.
- `/health`: 200 while the service has at least one live backend, else 503 (for load balancers).
- `/metrics`: the gateway's own Prometheus metrics for this service (see `GatewayMetrics`).
- anything else: 404 with an OpenAI-style error.

Forwarding. The request body is buffered (bodies are small JSON; at most `max_body_bytes`, else
413), hop-by-hop headers and `host`/`content-length` are dropped and `x-forwarded-for` is added.
The response is streamed through chunk by chunk as the backend produces it (`aiter_raw`: no
re-encoding, no buffering), with its status and headers (minus hop-by-hop ones) and an
`x-lowtide-replica` header naming the replica that served it. The head of a response that is not
an SSE stream waits for the first piece of its body (a JSON answer is one piece), so that the two
leave in one write (`gateway_http`); an SSE stream's head goes out at once.

Failures:
- connection refused or connect timeout: nothing reached the backend (no TCP connection was
  established, so not one byte of the request was delivered), hence retrying on another replica is
  safe even for a non-idempotent POST: each live replica is tried at most once per request.
- the backend answers 503 before sending a body (vLLM's answer when its queue is full or it is
  shutting down; it has not acted on the request): retried on another live replica not tried yet;
  the last replica's 503 is passed through as it came.
- no live replica at all (the service is at zero, or its replicas are starting or waking): the
  request is **held** (scale from zero, issue 9 item 7) when holding is on (`hold_max` > 0, from
  `services[].gateway_queue`): it waits, counted on the router as demand (`held_begin`), until
  `set_backends` gives the service a live replica (the router calls this app's listener, which
  wakes the waiters through an `asyncio.Event` on the event loop: no polling), then goes on as any
  other request. At most `hold_max` requests wait per service; one more gets 503 with
  `retry-after` at once; a request held past `hold_timeout_s` (`services[].gateway_queue_timeout`)
  gets 503 `service_unavailable` saying so, with `retry-after`. A held request whose client
  goes away stops waiting (499), and `cut_all` answers held requests 503 at shutdown.
- no replica left (all refused, or none live with holding off): 503
  `{"error": {"message": ..., "type": "service_unavailable", "code": 503}}` with `retry-after`.
- the backend fails after the request was sent but before answering: 502 (`bad_gateway`); no
  answer within the read timeout: 504 (`gateway_timeout`). Neither is retried: the backend may
  have acted on the request. The read timeout is the server's (`GatewayTimeouts.read_s`) unless
  the app has its own (`read_timeout_s`, from `services[].gateway_read_timeout`).
- every failure on a replica (refused, timeout, broken answer, cut stream) is counted on the router
  (`upstream_failed`), and any answer ends the count (`upstream_answered`): the control loop reads
  failures in a row as a sign the replica is hung.
- the backend fails mid-response (dies, or stalls past the read timeout): an SSE stream gets one
  last event `data: {"error": {..., "type": "upstream_error", "code": 502}}`, then the connection
  is closed without the terminating chunk (the app returns with the response incomplete, and
  uvicorn closes the connection), so no client can mistake the cut stream for a complete one.
  A non-SSE body is cut the same way.
- the client goes away: a watcher task sees `http.disconnect` and cancels the forwarding, which
  closes the upstream connection, so vLLM aborts the generation instead of finishing it for
  nobody. Counted with `code="499"`.
- shutdown: `GatewayServer.stop` lets requests in flight finish for a grace period, then calls
  `cut_all`: a request that has sent nothing yet gets a 503, a stream a last SSE error event,
  and the connection is closed (rather than uvicorn cancelling each one with a traceback).

Keep-alive: the shared upstream client (`gateway_upstream.UpstreamPool`) should expire idle
connections before the backends do (vLLM/uvicorn close idle ones after 5 s;
`GatewayTimeouts.keepalive_s` defaults to 2 s), or a request may race the backend closing the
connection it was sent on (a 502 on a healthy replica).

Hot path: per request, one task for the disconnect watcher, the request head and body sent in
one write by `UpstreamPool`, each body chunk passed on as received (no copy, no re-encoding), a
whole one-piece body sent as the last message (no empty closing message), the response head and
first body piece in one write to the client, request headers filtered in one pass without
lowercasing (ASGI servers give them lowercased), and the metric children looked up once per
(replica, status) rather than per request.

Neighbours: `gateway_router` (choice, in-flight counts, metrics), `gateway` (runs this app under
uvicorn and owns the client). Must not: choose backends itself, block the event loop, or read
more of a request than `max_body_bytes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client import Counter as CounterChild

from lowtide.adapters.gateway_router import NO_REPLICA, GatewayRouter, Pick
from lowtide.adapters.gateway_upstream import UpstreamPool

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
#: How long a held request waits for a replica unless the app is told otherwise (seconds).
DEFAULT_HOLD_TIMEOUT_S = 300.0
#: `retry-after` (seconds) of a 503 for a request that could not be held or waited too long.
HELD_RETRY_AFTER_S = 5

# RFC 9110 §7.6.1: meaningful for one connection only; never forwarded by a proxy.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# httpx sets these itself from the URL and the buffered body.
_NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"expect"}


class _Exchange:
    """One proxied request in flight: what the client was sent so far, and why it may be cut short."""

    __slots__ = ("client_gone", "code", "cut", "done", "replica", "sse", "started", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.code = 0  # the status the client got (499: it went away first)
        self.replica = NO_REPLICA
        self.started = False  # response headers sent
        self.sse = False
        self.done = False  # last body message sent
        self.client_gone = False
        self.cut = False  # cut by `cut_all` at shutdown


@dataclass(frozen=True, slots=True)
class _Forward:
    method: str
    target: str  # raw path and query, e.g. /v1/models?x=1
    headers: list[tuple[bytes, bytes]]
    body: bytes


class GatewayApp:
    """The ASGI app of one service. `client` is the gateway's shared upstream client."""

    def __init__(
        self,
        service: str,
        router: GatewayRouter,
        client: UpstreamPool,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        read_timeout_s: float | None = None,
        hold_max: int = 0,
        hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S,
    ) -> None:
        self.service = service
        self.router = router
        self.client = client
        self.max_body_bytes = max_body_bytes
        #: Requests held at most while the service has no live replica (0: none, 503 at once).
        self.hold_max = hold_max
        self.hold_timeout_s = hold_timeout_s
        self._held = 0  # requests waiting now (only touched on the event loop)
        self._live = asyncio.Event()  # set (and replaced) when the service gets a live replica
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop, once a request waited
        router.listen(service, self._replicas_live)
        self._read_timeout_s = read_timeout_s  # None: the client's own
        self._metrics = router.metrics
        self._metrics.no_backend.labels(service)  # exported at 0 from the start, so rate() has a series
        self._exchanges: set[_Exchange] = set()
        # Per-request metric children, looked up once (a `labels()` call costs a lock and a tuple).
        self._duration = self._metrics.duration.labels(service)
        self._counters: dict[tuple[str, int], CounterChild] = {}

    def _count(self, replica: str, code: int) -> CounterChild:
        child = self._counters.get((replica, code))
        if child is None:
            if len(self._counters) > 4096:  # replicas come and go: keep the cache bounded
                self._counters.clear()
            child = self._metrics.requests.labels(self.service, replica, str(code))
            self._counters[replica, code] = child
        return child

    def configure(self, *, read_timeout_s: float | None, hold_max: int, hold_timeout_s: float) -> None:
        """New settings for the requests that arrive from now on (held ones keep their deadline)."""
        self._read_timeout_s = read_timeout_s
        self.hold_max = hold_max
        self.hold_timeout_s = hold_timeout_s

    def in_flight(self) -> int:
        """Requests this app is proxying now."""
        return len(self._exchanges)

    def cut_all(self) -> int:
        """Cut every request still in flight (at shutdown, once the grace is over); returns how many.
        Must run on the app's event loop. A cut request that has sent nothing yet gets a 503; a
        stream gets a last SSE error event; then the connection is closed."""
        cut = 0
        for exchange in list(self._exchanges):
            if not exchange.done and not exchange.cut:
                exchange.cut = True
                exchange.task.cancel()
                cut += 1
        return cut

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off; websockets are not served
            return
        path: str = scope["path"]
        if path.startswith("/v1/"):
            await self._proxy(scope, receive, send)
        elif path == "/health":
            count = len(self.router.backends(self.service))
            status = "ok" if count else "no_backend"
            await _send_json(
                send, 200 if count else 503, {"status": status, "service": self.service, "backends": count}
            )
        elif path == "/metrics":
            body = self._metrics.text(self.service)
            await _send(send, 200, [(b"content-type", CONTENT_TYPE_LATEST.encode())], body)
        else:
            await _send_error(send, 404, "not_found", f"no route {path}: the gateway serves /v1/...")

    # -- proxying ---------------------------------------------------------------------------------

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        try:
            body = await _read_body(receive, self.max_body_bytes)
        except _TooLarge:
            self._metrics.requests.labels(self.service, NO_REPLICA, "413").inc()
            await _send_error(
                send, 413, "invalid_request_error", f"request body over {self.max_body_bytes} bytes"
            )
            return
        if body is None:  # the client left before sending its whole request: nothing to count
            return
        forward = _Forward(scope["method"], _target(scope), _request_headers(scope), body)
        task = asyncio.current_task()
        assert task is not None  # always inside a task under uvicorn
        exchange = _Exchange(task)

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            # uvicorn also answers http.disconnect once the response is complete: not a hang-up.
            if not exchange.done:
                exchange.client_gone = True
                task.cancel()

        async def tracked_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.started, exchange.code = True, message["status"]
                exchange.sse = any(
                    name == b"content-type" and value.startswith(b"text/event-stream")
                    for name, value in message.get("headers", ())
                )
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                exchange.done = True

        self._exchanges.add(exchange)
        watcher = asyncio.ensure_future(watch())
        try:
            await self._forward(forward, tracked_send, exchange)
        except asyncio.CancelledError:
            if not (exchange.client_gone or exchange.cut) or task.uncancel() > 0:
                raise  # cancelled by someone else (uvicorn's own shutdown timeout): let it through
            if exchange.client_gone:
                exchange.code = 499
            else:
                await self._send_cut(tracked_send, exchange)
        finally:
            exchange.done = True
            self._exchanges.discard(exchange)
            watcher.cancel()
            self._count(exchange.replica, exchange.code).inc()
            self._duration.observe(time.perf_counter() - started)

    async def _send_cut(self, send: Send, exchange: _Exchange) -> None:
        message = f"the gateway of {self.service!r} is shutting down"
        if not exchange.started:
            await _send_error(send, 503, "service_unavailable", message)
        elif exchange.sse:
            event = b"data: " + _error_body(503, "service_unavailable", message) + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})
        # else: the body is left incomplete and uvicorn closes the connection

    async def _forward(self, forward: _Forward, send: Send, exchange: _Exchange) -> None:
        refused: list[str] = []
        while True:
            pick = self.router.acquire(self.service, refused)
            if pick is None and not refused and self.hold_max > 0:
                pick = await self._hold(send)
                if pick is None:  # answered: queue full or waited too long
                    exchange.replica = NO_REPLICA
                    return
            if pick is None:
                self._metrics.no_backend.labels(self.service).inc()
                exchange.replica = NO_REPLICA
                reason = (
                    f"no replica of {self.service!r} accepted a connection (tried {', '.join(refused)})"
                    if refused
                    else f"service {self.service!r} has no replica serving now"
                )
                await _send_error(send, 503, "service_unavailable", reason, [(b"retry-after", b"1")])
                return
            exchange.replica = pick.replica_id
            try:
                if await self._attempt(pick, forward, send, refused):
                    return
            finally:
                self.router.release(self.service, pick.replica_id)
            refused.append(pick.replica_id)

    # -- holding (scale from zero) -------------------------------------------------------------

    async def _hold(self, send: Send) -> Pick | None:
        """Wait for a live replica and return it acquired; None once an error has been sent
        (more than `hold_max` waiting, or nothing came within `hold_timeout_s`)."""
        retry = [(b"retry-after", str(HELD_RETRY_AFTER_S).encode())]
        if self._held >= self.hold_max:
            self._metrics.no_backend.labels(self.service).inc()
            message = (
                f"service {self.service!r} has no replica serving now and {self._held} requests are "
                f"already waiting for one (services[].gateway_queue = {self.hold_max}); retry later"
            )
            await _send_error(send, 503, "service_unavailable", message, retry)
            return None
        loop = self._loop = asyncio.get_running_loop()
        # Counted before looking again: a replica going live after this look wakes the wait below.
        self._held += 1
        self.router.held_begin(self.service)
        deadline = loop.time() + self.hold_timeout_s
        try:
            while True:
                live = self._live
                pick = self.router.acquire(self.service)
                if pick is not None:
                    return pick
                left = deadline - loop.time()
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(live.wait(), left)
        finally:
            self._held -= 1
            self.router.held_end(self.service)
        self._metrics.no_backend.labels(self.service).inc()
        message = (
            f"no replica of {self.service!r} became ready within {self.hold_timeout_s:g}s "
            "(the request was held while one was started or woken; services[].gateway_queue_timeout)"
        )
        await _send_error(send, 503, "service_unavailable", message, retry)
        return None

    def _replicas_live(self) -> None:
        """The router's listener: the service has a live replica again (any thread)."""
        loop = self._loop
        if loop is not None and self._held:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(self._wake_held)

    def _wake_held(self) -> None:
        live, self._live = self._live, asyncio.Event()
        live.set()

    async def _attempt(self, pick: Pick, forward: _Forward, send: Send, tried: list[str]) -> bool:
        """Serve the request from `pick`; False when it could not even connect, or answered 503
        while another replica may take it (try another)."""
        try:
            upstream = await self.client.request(
                pick.url,
                forward.method,
                forward.target,
                forward.headers,
                forward.body,
                read_s=self._read_timeout_s,
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            kind = "connect" if isinstance(exc, httpx.ConnectError) else "connect_timeout"
            self._upstream_error(pick, kind, exc)
            self.router.connect_failed(self.service, pick.replica_id)
            return False
        except httpx.TimeoutException as exc:
            self._upstream_error(pick, "timeout", exc)
            message = f"replica {pick.replica_id} did not answer in time ({type(exc).__name__})"
            await _send_error(send, 504, "gateway_timeout", message)
            return True
        except httpx.HTTPError as exc:
            self._upstream_error(pick, "protocol", exc)
            await _send_error(send, 502, "bad_gateway", f"replica {pick.replica_id} failed: {exc!r}")
            return True

        self.router.upstream_answered(self.service, pick.replica_id)
        if upstream.status_code == 503 and self.router.others(self.service, [*tried, pick.replica_id]):
            # vLLM's queue is full (or it is going away): nothing was done; another replica may.
            self._metrics.upstream_errors.labels(self.service, pick.replica_id, "unavailable").inc()
            await upstream.aclose()
            return False
        try:
            headers = _response_headers(upstream.headers.raw)
            headers.append((b"x-lowtide-replica", pick.replica_id.encode()))
            sse = upstream.headers.get("content-type").startswith("text/event-stream")
            start = {"type": "http.response.start", "status": upstream.status_code, "headers": headers}
            first: bytes | None = b""
            if not sse:
                # Not a stream: the head goes out with the first piece of the body, in one write
                # (`gateway_http`); a failure before that piece is handled as after it.
                try:
                    first = await upstream.next_raw()
                except httpx.HTTPError as exc:
                    await send(start)
                    self._upstream_error(pick, "stream", exc)
                    return True  # response left incomplete on purpose, as below
            await send(start)
            try:
                if first:
                    if upstream.at_end():  # the whole body came in one piece (a small JSON answer)
                        await send({"type": "http.response.body", "body": first, "more_body": False})
                        return True
                    await send({"type": "http.response.body", "body": first, "more_body": True})
                if first is not None:
                    async for chunk in upstream.aiter_raw():
                        if chunk:
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as exc:
                self._upstream_error(pick, "stream", exc)
                if sse:
                    event = _error_body(
                        502, "upstream_error", f"replica {pick.replica_id} failed mid-stream: {exc!r}"
                    )
                    await send(
                        {"type": "http.response.body", "body": b"data: " + event + b"\n\n", "more_body": True}
                    )
                return True  # response left incomplete on purpose: the client's connection is closed
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return True
        finally:
            await upstream.aclose()

    def _upstream_error(self, pick: Pick, kind: str, exc: BaseException) -> None:
        self._metrics.upstream_errors.labels(self.service, pick.replica_id, kind).inc()
        self.router.upstream_failed(self.service, pick.replica_id)
        log.warning("gateway %s: replica %s (%s): %s: %r", self.service, pick.replica_id, pick.url, kind, exc)


# -- helpers ----------------------------------------------------------------------------------------


class _TooLarge(Exception):
    pass


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None when the client disconnected first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _target(scope: Scope) -> str:
    raw: bytes | None = scope.get("raw_path")
    path = raw.decode("latin-1") if raw else scope["path"]
    query: bytes = scope.get("query_string", b"")
    return f"{path}?{query.decode('latin-1')}" if query else path


def _tokens(value: bytes) -> set[bytes]:
    """The header names a `connection` header's value declares hop-by-hop as well."""
    return {token.strip().lower() for token in value.split(b",")}


def _request_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    # Header names in an ASGI scope are lowercased by the server (ASGI spec, HTTP scope `headers`;
    # uvicorn's httptools and h11 protocols both do it), so they are compared as they are.
    raw: list[tuple[bytes, bytes]] = scope["headers"]
    dropped = _NOT_FORWARDED
    for name, value in raw:
        if name == b"connection":
            dropped = dropped | _tokens(value)
    if not scope.get("client"):
        return [(name, value) for name, value in raw if name not in dropped]
    headers: list[tuple[bytes, bytes]] = []
    forwarded: list[bytes] = []
    for name, value in raw:
        if name in dropped:
            continue
        if name == b"x-forwarded-for":
            forwarded.append(value)
        else:
            headers.append((name, value))
    forwarded.append(str(scope["client"][0]).encode())
    headers.append((b"x-forwarded-for", b", ".join(forwarded)))
    return headers


def _response_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    lowered = [(name.lower(), value) for name, value in raw]
    dropped = HOP_BY_HOP
    for name, value in lowered:
        if name == b"connection":
            dropped = dropped | _tokens(value)
    return [(name, value) for name, value in lowered if name not in dropped]


def _error_body(code: int, kind: str, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()


async def _send(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_json(send: Send, status: int, payload: object) -> None:
    await _send(send, status, [(b"content-type", b"application/json")], json.dumps(payload).encode())


async def _send_error(
    send: Send, status: int, kind: str, message: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    """An OpenAI-style error: `{"error": {"message": ..., "type": ..., "code": status}}`."""
    headers = [(b"content-type", b"application/json"), *(extra or [])]
    await _send(send, status, headers, _error_body(status, kind, message))
