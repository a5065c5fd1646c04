"""The gateway's upstream HTTP/1.1 client: keep-alive connections to the replicas, parsed in C.

Why not httpx here: profiling the gateway (`benchmarks/gateway.py`, cProfile of its event loop)
put two thirds of its CPU per request in httpx/httpcore/anyio/h11: request and URL objects, an
anyio checkpoint per write, h11's pure-Python state machine, and the request head and body sent
in two writes. This client does what the proxy needs and no more: one `asyncio.Protocol` per
connection, responses parsed by `httptools.HttpResponseParser` (llhttp; httptools 0.9), the
request head and body in one write, and a per-origin stack of idle connections.

Behaviour the gateway relies on (each maps to the httpx exception the proxy already handles, so
`gateway_app` keeps one exception family; docs/architecture.md §4.2):
- connection refused, or any OSError while connecting: `httpx.ConnectError`; not connected
  within `connect_s`: `httpx.ConnectTimeout`. Nothing was sent in either case.
- no response head, or no next body chunk, within the read timeout: `httpx.ReadTimeout`.
- the request not written within `write_s` (the replica stopped reading): `httpx.WriteTimeout`.
- the replica closes the connection before the response is complete, or sends what is not
  HTTP: `httpx.RemoteProtocolError` (before the head) / `httpx.ReadError` (mid-body).
- a response is complete when its `content-length` is reached, its chunked body ends, or (with
  neither) the replica closes the connection. Only a complete response whose replica keeps the
  connection alive (`should_keep_alive`) returns its connection to the pool; closing an
  incomplete one (`aclose`, e.g. the client went away) closes the connection, so vLLM sees the
  disconnect and aborts the generation.
- idle connections older than `keepalive_s` (below the replicas' own idle timeout, uvicorn's 5 s)
  or closed by the replica are dropped when taken and by a sweep at most once per `keepalive_s`.
- responses to HEAD requests and 1xx/204/304 have no body (RFC 9112 §6.3); after a HEAD the
  connection is closed, not reused (llhttp is not told the method, and would take the next
  response for this one's body).

Per wait for data, a bare `loop.call_later` timer fails the waiter at the read timeout (cheaper
than `asyncio.timeout`, which cancels and uncancels the task); `next_raw`/`at_end` let the proxy
take the first body piece before it answers its client.

Flow control: reading pauses while more than `_READ_HIGH_WATER` bytes of body wait for the proxy
to take them (a slow client then slows the replica down, as with httpx).

Single event loop only: no locks, because nothing awaits between taking a connection off a stack
and using it. Must not: retry anything (the gateway decides what is safe to retry), follow
redirects, add headers of its own, or be shared between event loops.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from typing import cast

import httptools
import httpx

_READ_HIGH_WATER = 256 * 1024
_NO_BODY_STATUS = frozenset({204, 304})


class UpstreamHeaders:
    """The response head as received: `raw` (name, value) pairs and a case-insensitive `get`."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw

    def get(self, name: str, default: str = "") -> str:
        key = name.lower().encode("latin-1")
        for k, v in self.raw:
            if k.lower() == key:
                return v.decode("latin-1")
        return default


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, int]) -> None:
        self.loop = loop
        self.key = key  # the pool's (host, port)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_done = False
        self._complete = False
        self._body_known = False  # content-length or chunked: the parser finds the end
        self._keep_alive = False  # the replica keeps the connection open after this response
        self._no_body = False  # the request is a HEAD
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._drain: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"the replica sent a malformed response: {exc}"))
            self.close()
        self._wake()

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._head_done and not self._complete and not self._body_known and self._error is None:
            self._complete = True  # a body delimited by the connection's end (RFC 9112 §6.3)
        elif not self._complete and self._error is None:
            reason = f": {exc!r}" if exc else ""
            if self._head_done:
                self._fail(httpx.ReadError(f"the replica closed the connection mid-response{reason}"))
            else:
                self._fail(httpx.RemoteProtocolError(f"the replica closed the connection{reason}"))
        self._wake()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def pause_writing(self) -> None:
        self._drain = self.loop.create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_done = True
        status = self._parser.get_status_code()
        for name, value in self._headers:
            lowered = name.lower()
            if lowered == b"content-length" or (
                lowered == b"transfer-encoding" and b"chunked" in value.lower()
            ):
                self._body_known = True
        if status in _NO_BODY_STATUS or 100 <= status < 200:
            self._body_known = True
        if self._no_body:  # the answer to a HEAD: whatever its content-length says, no body follows
            self._body_known = self._complete = True

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _READ_HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        # Asked here: once this callback returns, llhttp resets its state for the next message.
        self._keep_alive = self._parser.should_keep_alive()
        self._complete = True

    # -- used by the pool and the response --------------------------------------------------------

    def _fail(self, exc: Exception) -> None:
        if self._error is None:
            self._error = exc

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, read_s: float | None) -> None:
        # A bare timer rather than `asyncio.timeout` (a context manager, a task cancel and uncancel
        # per wait): the timer fails the waiter itself, and any data wakes it first.
        waiter = self._waiter = self.loop.create_future()
        timer = None if read_s is None else self.loop.call_later(read_s, _expire, waiter, read_s)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def reusable(self, now: float, keepalive_s: float) -> bool:
        return not self.closed and now - self.idle_since < keepalive_s

    def begin(self, method: str) -> None:
        """Reset the per-response state before a request is written."""
        self._no_body = method == "HEAD"
        self._headers = []
        self._head_done = self._complete = self._body_known = self._keep_alive = False
        self._chunks.clear()
        self._buffered = 0
        self._error = None

    async def send(self, data: bytes, write_s: float) -> None:
        assert self.transport is not None
        self.transport.write(data)
        if self._drain is not None:
            try:
                async with asyncio.timeout(write_s):
                    await self._drain
            except TimeoutError:
                raise httpx.WriteTimeout(f"the replica did not read the request within {write_s}s") from None

    async def head(self, read_s: float | None) -> tuple[int, list[tuple[bytes, bytes]]]:
        while not self._head_done:
            if self._error is not None:
                raise self._error
            if self.closed:
                raise httpx.RemoteProtocolError("the replica closed the connection without answering")
            await self._wait(read_s)
        return self._parser.get_status_code(), self._headers

    async def next_chunk(self, read_s: float | None) -> bytes | None:
        """The next piece of the body, or None at its end."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._paused and self._buffered <= _READ_HIGH_WATER // 4 and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                return chunk
            if self._complete:
                return None
            if self._error is not None:
                raise self._error
            await self._wait(read_s)

    def finished_cleanly(self) -> bool:
        return self._complete and not self._chunks and self._error is None and not self.closed

    def keep_alive(self) -> bool:
        return self._keep_alive

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None], read_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout(f"no data from the replica within {read_s}s"))


class UpstreamResponse:
    """A response whose body is read with `aiter_raw`; `aclose` must always be called."""

    __slots__ = ("_conn", "_done", "_pool", "_read_s", "_reuse", "headers", "status_code")

    def __init__(
        self,
        pool: UpstreamPool,
        conn: _Connection,
        status: int,
        headers: list[tuple[bytes, bytes]],
        read_s: float | None,
        reuse: bool,
    ) -> None:
        self._pool = pool
        self._conn = conn
        self._read_s = read_s
        self._reuse = reuse
        self._done = False
        self.status_code = status
        self.headers = UpstreamHeaders(headers)

    async def next_raw(self) -> bytes | None:
        """The next piece of the body as it arrives, or None at its end."""
        return await self._conn.next_chunk(self._read_s)

    def at_end(self) -> bool:
        """The body was read to its end without a fault (`next_raw` would return None now)."""
        return self._conn.finished_cleanly()

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked framing removed, nothing decoded)."""
        while (chunk := await self._conn.next_chunk(self._read_s)) is not None:
            yield chunk

    async def aclose(self) -> None:
        """Give the connection back when the response was read to its end, else close it."""
        if self._done:
            return
        self._done = True
        conn = self._conn
        if self._reuse and conn.finished_cleanly() and conn.keep_alive():
            self._pool._checkin(conn)
        else:
            conn.close()


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections per origin (`host:port`), reused last-in first-out."""

    def __init__(
        self,
        *,
        connect_s: float = 2.0,
        read_s: float | None = 600.0,
        write_s: float = 30.0,
        keepalive_s: float = 2.0,
        max_idle_per_origin: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.connect_s = connect_s
        self.read_s = read_s
        self.write_s = write_s
        self.keepalive_s = keepalive_s
        self.max_idle_per_origin = max_idle_per_origin
        self._clock = clock
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._next_sweep = 0.0
        self._closed = False
        self._origins: dict[str, tuple[str, int, bytes]] = {}  # base URL -> host, port, Host header

    def idle_connections(self) -> int:
        return sum(len(stack) for stack in self._idle.values())

    async def request(
        self,
        base_url: str,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        read_s: float | None = None,
    ) -> UpstreamResponse:
        """Send one request to `base_url` (`http://host:port`) and return once its head arrived.
        `headers` must not hold hop-by-hop ones, `host` or `content-length`: this sets them."""
        if self._closed:
            raise RuntimeError("the upstream pool is closed")
        host, port, host_header = self._origin(base_url)
        read_timeout = self.read_s if read_s is None else read_s
        self._sweep()
        conn = self._checkout((host, port)) or await self._connect(host, port)
        conn.begin(method)
        parts = [method.encode("ascii"), b" ", target.encode("latin-1"), b" HTTP/1.1\r\nhost: ", host_header]
        for name, value in headers:
            parts += (b"\r\n", name, b": ", value)
        if body or method not in {"GET", "HEAD", "DELETE", "OPTIONS"}:
            parts += (b"\r\ncontent-length: ", str(len(body)).encode("ascii"))
        parts += (b"\r\n\r\n", body)
        try:
            await conn.send(b"".join(parts), self.write_s)
            status, raw = await conn.head(read_timeout)
        except BaseException:
            conn.close()
            raise
        reuse = method != "HEAD"
        return UpstreamResponse(self, conn, status, raw, read_timeout, reuse)

    async def aclose(self) -> None:
        self._closed = True
        stacks, self._idle = self._idle, {}
        for stack in stacks.values():
            for conn in stack:
                conn.close()

    # -- internals -------------------------------------------------------------------------------

    def _origin(self, base_url: str) -> tuple[str, int, bytes]:
        origin = self._origins.get(base_url)
        if origin is None:
            url = httpx.URL(base_url)
            if url.scheme != "http" or not url.host:
                raise httpx.UnsupportedProtocol(
                    f"the gateway speaks plain http to replicas, not {base_url!r}"
                )
            port = url.port or 80
            host_header = url.netloc
            origin = (url.host, port, host_header)
            if len(self._origins) > 4096:  # replicas come and go: keep the cache bounded
                self._origins.clear()
            self._origins[base_url] = origin
        return origin

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection(loop, (host, port))
        try:
            async with asyncio.timeout(self.connect_s):
                await loop.create_connection(lambda: conn, host, port)
        except TimeoutError:
            conn.close()
            raise httpx.ConnectTimeout(f"{host}:{port} did not accept within {self.connect_s}s") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    def _checkout(self, key: tuple[str, int]) -> _Connection | None:
        stack = self._idle.get(key)
        now = self._clock()
        while stack:
            conn = stack.pop()
            if conn.reusable(now, self.keepalive_s):
                return conn
            conn.close()
        return None

    def _checkin(self, conn: _Connection) -> None:
        if self._closed or conn.closed or conn.transport is None:
            conn.close()
            return
        stack = self._idle.setdefault(conn.key, [])
        if len(stack) >= self.max_idle_per_origin:
            conn.close()
            return
        conn.idle_since = self._clock()
        stack.append(conn)

    def _sweep(self) -> None:
        """Close idle connections that expired or that their replica closed; at most once a period."""
        now = self._clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.keepalive_s
        for key, stack in list(self._idle.items()):
            keep = [c for c in stack if c.reusable(now, self.keepalive_s)]
            for conn in stack:
                if not conn.reusable(now, self.keepalive_s):
                    conn.close()
            if keep:
                stack[:] = keep
            else:
                del self._idle[key]
