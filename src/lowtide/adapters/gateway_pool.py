"""An httpx transport whose keep-alive pool costs O(1) per request: the load generator of
`benchmarks/gateway.py` uses it. (The gateway's own upstream calls moved to
`adapters.gateway_upstream`, a lighter client on httptools; this one stays for httpx users.)

Why not httpx's default transport: httpcore 1.0's `AsyncConnectionPool` rescans every pooled
connection on each request start and end, and for each idle connection it rebuilds a list of all
of them (`_assign_requests_to_connections`): O(idle × total) per event. A gateway in front of vLLM
holds hundreds of concurrent streams; after a burst, hundreds of idle connections wait for reuse,
and each request then costs tens of milliseconds of CPU on the event loop (a load generator using
the stock pool collapsed from 600 to 100 requests/s this way in `benchmarks/gateway.py`).

This pool keeps, per origin, a stack of idle `httpcore.AsyncHTTPConnection`s: a request pops the
most recently used one (the warmest: least likely to have been closed by the server) or opens a new
connection; a response, once closed, pushes its connection back if it is reusable (fully read, not
closed). Idle connections past `keepalive_expiry`, or that the server closed (httpcore's
`has_expired` checks the socket), are dropped when popped and by a sweep at most once per
`keepalive_expiry`, so a removed replica's connections do not linger. There is no cap on open
connections (vLLM queues requests itself); at most `max_idle_per_origin` idle ones are kept.

Single event loop only: no locks, because nothing awaits between taking a connection off a stack
and using it. httpcore errors are mapped to httpx's (ConnectError, ReadTimeout, ...) as httpx's
own transport does, so `gateway_app` handles one exception family.

Also: httpcore asks `sniffio` which async library runs on every lock it sets up (several per
request); without sniffio installed each ask is a failed import that searches sys.path (~0.1 ms).
`fail_missing_sniffio_fast` records it as absent in `sys.modules`, which makes the same import fail
at once, with the same outcome.

Neighbours: `gateway` builds the `httpx.AsyncClient` with this transport. Must not: be shared
between event loops, or retry anything (the gateway decides what is safe to retry).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager

import httpcore
import httpx

_EXCEPTIONS: dict[type[Exception], type[httpx.HTTPError]] = {
    httpcore.TimeoutException: httpx.TimeoutException,
    httpcore.ConnectTimeout: httpx.ConnectTimeout,
    httpcore.ReadTimeout: httpx.ReadTimeout,
    httpcore.WriteTimeout: httpx.WriteTimeout,
    httpcore.PoolTimeout: httpx.PoolTimeout,
    httpcore.NetworkError: httpx.NetworkError,
    httpcore.ConnectError: httpx.ConnectError,
    httpcore.ReadError: httpx.ReadError,
    httpcore.WriteError: httpx.WriteError,
    httpcore.ProxyError: httpx.ProxyError,
    httpcore.UnsupportedProtocol: httpx.UnsupportedProtocol,
    httpcore.ProtocolError: httpx.ProtocolError,
    httpcore.LocalProtocolError: httpx.LocalProtocolError,
    httpcore.RemoteProtocolError: httpx.RemoteProtocolError,
}

_Key = tuple[bytes, bytes, int | None]  # scheme, host, port


def fail_missing_sniffio_fast() -> None:
    """Make `import sniffio` fail without a sys.path search when it is not installed (see above)."""
    if "sniffio" not in sys.modules and importlib.util.find_spec("sniffio") is None:
        sys.modules["sniffio"] = None  # type: ignore[assignment]  # documented: import raises at once


@contextmanager
def _mapped() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        for cls in type(exc).__mro__:  # the most specific mapping first
            mapped = _EXCEPTIONS.get(cls)
            if mapped is not None:
                raise mapped(str(exc)) from exc
        raise


class PooledTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 keep-alive connections per origin, reused last-in first-out; O(1) per request."""

    def __init__(
        self,
        *,
        keepalive_expiry: float = 2.0,
        max_idle_per_origin: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keepalive_expiry = keepalive_expiry
        self.max_idle_per_origin = max_idle_per_origin
        self._clock = clock
        self._idle: dict[_Key, list[httpcore.AsyncHTTPConnection]] = {}
        self._next_sweep = 0.0
        self._closed = False

    def idle_connections(self) -> int:
        return sum(len(stack) for stack in self._idle.values())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise RuntimeError("the transport is closed")
        url = request.url
        key: _Key = (url.raw_scheme, url.raw_host, url.port)
        await self._sweep()
        connection = await self._checkout(key)
        if connection is None:
            connection = httpcore.AsyncHTTPConnection(
                origin=httpcore.Origin(
                    url.raw_scheme, url.raw_host, url.port or _default_port(url.raw_scheme)
                ),
                keepalive_expiry=self.keepalive_expiry,
            )
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _mapped():
            response = await connection.handle_async_request(core_request)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_Stream(self, key, connection, response),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        self._closed = True
        stacks, self._idle = self._idle, {}
        for stack in stacks.values():
            for connection in stack:
                await connection.aclose()

    # -- internals -------------------------------------------------------------------------------

    async def _checkout(self, key: _Key) -> httpcore.AsyncHTTPConnection | None:
        stack = self._idle.get(key)
        while stack:
            connection = stack.pop()
            if connection.is_idle() and not connection.has_expired():
                return connection
            await connection.aclose()
        return None

    async def _checkin(self, key: _Key, connection: httpcore.AsyncHTTPConnection) -> None:
        if self._closed or not connection.is_idle() or connection.has_expired():
            await connection.aclose()
            return
        stack = self._idle.setdefault(key, [])
        if len(stack) >= self.max_idle_per_origin:
            await connection.aclose()
            return
        stack.append(connection)

    async def _sweep(self) -> None:
        """Close idle connections that expired or that their server closed; at most once a period."""
        now = self._clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.keepalive_expiry
        stale: list[httpcore.AsyncHTTPConnection] = []
        for key, stack in list(self._idle.items()):  # no await in here: the stacks stay consistent
            keep: list[httpcore.AsyncHTTPConnection] = []
            for connection in stack:
                (keep if connection.is_idle() and not connection.has_expired() else stale).append(connection)
            if keep:
                stack[:] = keep
            else:
                del self._idle[key]
        for connection in stale:
            await connection.aclose()


class _Stream(httpx.AsyncByteStream):
    """A response body; closing it hands its connection back to the pool when reusable."""

    def __init__(
        self,
        pool: PooledTransport,
        key: _Key,
        connection: httpcore.AsyncHTTPConnection,
        response: httpcore.Response,
    ) -> None:
        self._pool = pool
        self._key = key
        self._connection = connection
        self._response = response
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _mapped():
            async for part in self._response.aiter_stream():
                yield part

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with _mapped():
                await self._response.aclose()  # an unread body closes the connection (httpcore)
        finally:
            await self._pool._checkin(self._key, self._connection)


def _default_port(scheme: bytes) -> int:
    return 443 if scheme == b"https" else 80
