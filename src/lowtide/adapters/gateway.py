"""The embedded mode's gateway: one stable OpenAI-compatible address per service, replicas behind it.

Three parts (this module re-exports them):
- `GatewayRouter` (`gateway_router`): the `Gateway` port the control loop talks to, the choice of
  replica (fewest requests in flight) and the gateway's own Prometheus metrics.
- `GatewayApp` (`gateway_app`): the ASGI app of one service; streams responses through and
  retries a request on another replica only when it never reached the first one.
- `GatewayServer` (here): runs one uvicorn server per service port, all inside ONE background
  thread with its own event loop, sharing one `gateway_upstream.UpstreamPool` for the upstream calls.

How it is used: in production `gateway_process` builds both inside the gateway's own process and
applies the routing table lowtide writes (the control loop talks to `gateway_supervisor`, its
`Gateway` port); in-process, as tests use it, the router is the `Gateway` port itself:

    router = GatewayRouter()
    server = GatewayServer(router, timeouts=GatewayTimeouts(read_s=600))
    server.start("chat", "0.0.0.0", 9000)          # clients use http://host:9000/v1/... from now on
    # (with start(..., hold_max=256) a request that comes while chat has no replica waits for one)
    router.set_backends("chat", {"chat/0": "http://127.0.0.1:8101"})   # each tick, from the loop
    # draining chat/0 before parking it: take it out, then wait for its requests to finish
    router.set_backends("chat", {"chat/1": "http://127.0.0.1:8102"})
    if router.in_flight("chat", "chat/0") == 0: ...  # park it (or park anyway after a timeout)
    server.stop()                                  # at shutdown

`start` binds the port in the caller's thread, so a taken port fails there and then with a
`GatewayError` naming the service and the address; it returns once the server accepts
connections. The socket is created with `IPPROTO_TCP` as its protocol: asyncio turns Nagle's
algorithm off (TCP_NODELAY) only on sockets that say so, and with Nagle on every small response
waits for a delayed ACK (~40 ms). `stop` (and `stop_service`) closes the port, lets responses in
flight finish for up to `GatewayTimeouts.shutdown_grace_s`, then cuts what is left
(`GatewayApp.cut_all`: 503 if nothing was sent yet, an SSE error event for a stream), closes the
client and ends the thread.

The upstream client (`gateway_upstream.UpstreamPool`) connects to the replicas directly (no proxy
environment variables: replicas are local), adds no headers of its own besides `host` and
`content-length`, and keeps a LIFO stack of keep-alive connections per replica (O(1) per request,
no cap on open connections: vLLM queues requests itself).

The hot path (issue 9; figures in benchmarks/README.md, gateway): the event loop is uvloop's
(`uvloop.new_event_loop`, uvloop 0.23) and uvicorn parses requests with httptools
(`gateway_http.GatewayHttpProtocol`: uvicorn 0.54's httptools protocol with the response head
written together with the first body piece and no per-request access-log work), both pinned;
without them (not installed) it falls back to asyncio's loop and h11, with the same behaviour.
uvloop sets TCP_NODELAY on every TCP transport itself (uvloop `handles/tcp.pyx`), accepted ones
included (`test_accepted_connections_have_nagle_off` checks it on both loops' sockets).

Must not: decide which replicas serve (the control loop does, through the router), touch the
process's logging configuration or signal handlers, or block the control loop's thread for longer
than starting or stopping a server takes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import logging
import math
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from lowtide.adapters.gateway_app import DEFAULT_HOLD_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, GatewayApp
from lowtide.adapters.gateway_pool import PooledTransport
from lowtide.adapters.gateway_router import GatewayMetrics, GatewayRouter, Pick
from lowtide.adapters.gateway_upstream import UpstreamPool
from lowtide.adapters.net import bind_tcp

__all__ = [
    "GatewayApp",
    "GatewayError",
    "GatewayMetrics",
    "GatewayRouter",
    "GatewayServer",
    "GatewayTimeouts",
    "Pick",
    "PooledTransport",
]

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 10.0


# The hot path's two C parts when installed (pinned in pyproject.toml; see the module docstring).
def _http_impl() -> type[asyncio.Protocol] | str:
    if importlib.util.find_spec("httptools") is None:
        return "h11"
    from lowtide.adapters.gateway_http import GatewayHttpProtocol  # noqa: PLC0415 (needs httptools)

    return GatewayHttpProtocol


_HTTP_IMPL = _http_impl()


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # noqa: PLC0415 (optional: plain asyncio where it is not installed)
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class GatewayError(RuntimeError):
    """A gateway server could not start (port taken, service already served, startup failed)."""


@dataclass(frozen=True, slots=True)
class GatewayTimeouts:
    """Upstream timeouts and lifetimes. `read_s` bounds the wait for the response headers and then
    for each next chunk, not the whole response: a long generation may stream for minutes."""

    connect_s: float = 2.0  # a replica that does not accept within this is skipped (retried elsewhere)
    read_s: float = 600.0  # a non-streamed generation sends nothing until it is complete
    write_s: float = 30.0
    keepalive_s: float = 2.0  # below the replicas' own idle timeout (uvicorn/vLLM: 5 s)
    shutdown_grace_s: float = 5.0  # stop(): how long responses in flight may still run


@dataclass(slots=True)
class _Running:
    app: GatewayApp
    server: uvicorn.Server
    future: concurrent.futures.Future[None]
    host: str
    port: int


class GatewayServer:
    """Serves every service's gateway app from one thread and one event loop."""

    def __init__(
        self,
        router: GatewayRouter | None = None,
        *,
        timeouts: GatewayTimeouts | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.router = router if router is not None else GatewayRouter()
        self.timeouts = timeouts if timeouts is not None else GatewayTimeouts()
        self.max_body_bytes = max_body_bytes
        self._lock = threading.Lock()
        self._servers: dict[str, _Running] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: UpstreamPool | None = None

    # -- public ------------------------------------------------------------------------------------

    def start(
        self,
        service: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        read_timeout_s: float | None = None,
        hold_max: int = 0,
        hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S,
        reuse_port: bool = False,
    ) -> int:
        """Serve `service` on host:port (0: any free port); returns the port once it accepts.
        `read_timeout_s`: this service's upstream read timeout (None: `timeouts.read_s`).
        `hold_max` / `hold_timeout_s`: requests held at most, and for how long, while the service
        has no live replica (scale from zero; 0: none, 503 at once; see `gateway_app`).
        `reuse_port`: bind with SO_REUSEPORT (the gateway process, `gateway_process`)."""
        with self._lock:
            if service in self._servers:
                running = self._servers[service]
                raise GatewayError(f"the gateway already serves {service!r} on {running.host}:{running.port}")
            sock = _listen(service, host, port, reuse_port=reuse_port)
            bound = int(sock.getsockname()[1])
            try:
                loop, client = self._ensure_loop()
                app = GatewayApp(
                    service,
                    self.router,
                    client,
                    max_body_bytes=self.max_body_bytes,
                    read_timeout_s=read_timeout_s,
                    hold_max=hold_max,
                    hold_timeout_s=hold_timeout_s,
                )
                server = uvicorn.Server(self._config(app))
                future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop)
                _wait_started(service, server, future)
            except BaseException:
                sock.close()
                raise
            self._servers[service] = _Running(app, server, future, host, bound)
            log.info("gateway for %s listening on %s:%d", service, host, bound)
            return bound

    def configure(
        self, service: str, *, read_timeout_s: float | None, hold_max: int, hold_timeout_s: float
    ) -> None:
        """Change a served service's read timeout and hold queue in place (new requests see them)."""
        with self._lock:
            running = self._servers.get(service)
        if running is not None:
            running.app.configure(
                read_timeout_s=read_timeout_s, hold_max=hold_max, hold_timeout_s=hold_timeout_s
            )

    def address(self, service: str) -> tuple[str, int] | None:
        """(host, port) the service is served on, or None."""
        with self._lock:
            running = self._servers.get(service)
        return None if running is None else (running.host, running.port)

    def url(self, service: str) -> str | None:
        """The base URL clients use for `service` (without /v1), while it is served."""
        with self._lock:
            running = self._servers.get(service)
        if running is None:
            return None
        wildcard = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}  # noqa: S104
        host = wildcard.get(running.host, running.host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{running.port}"

    def served(self) -> dict[str, int]:
        """`service -> port` for every running server."""
        with self._lock:
            return {service: running.port for service, running in self._servers.items()}

    def stop_service(self, service: str) -> None:
        """Stop serving one service (its port closes; responses in flight get the shutdown grace)."""
        with self._lock:
            running = self._servers.pop(service, None)
            loop = self._loop
        if running is not None and loop is not None:
            self._shutdown([running], loop)

    def stop(self) -> None:
        """Stop every server, close the upstream client and end the thread. Idempotent."""
        with self._lock:
            servers = list(self._servers.values())
            self._servers.clear()
            loop, thread, client = self._loop, self._thread, self._client
            self._loop = self._thread = self._client = None
        if loop is None or thread is None:
            return
        self._shutdown(servers, loop)
        if client is not None:
            try:
                asyncio.run_coroutine_threadsafe(client.aclose(), loop).result(timeout=5)
            except Exception:  # a client that does not close cleanly must not block shutdown
                log.exception("gateway: closing the upstream client failed")
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)

    def __enter__(self) -> GatewayServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals -----------------------------------------------------------------------------

    def _config(self, app: GatewayApp) -> uvicorn.Config:
        return uvicorn.Config(
            app,
            http=_HTTP_IMPL,
            ws="none",
            lifespan="off",
            interface="asgi3",
            log_config=None,  # leave the process's logging alone
            log_level=None,
            access_log=True,  # False would rewrite the global uvicorn.access logger
            proxy_headers=False,
            server_header=False,  # the replica's own server/date headers pass through
            date_header=False,
            # A backstop only: `_shutdown` cuts what is left after the grace itself, before this.
            timeout_graceful_shutdown=math.ceil(self.timeouts.shutdown_grace_s) + 5,
        )

    def _ensure_loop(self) -> tuple[asyncio.AbstractEventLoop, UpstreamPool]:
        if self._loop is not None and self._client is not None:
            return self._loop, self._client
        loop = _new_event_loop()
        thread = threading.Thread(target=_run_loop, args=(loop,), name="lowtide-gateway", daemon=True)
        thread.start()
        client = asyncio.run_coroutine_threadsafe(_make_client(self.timeouts), loop).result(timeout=10)
        self._loop, self._thread, self._client = loop, thread, client
        return loop, client

    def _shutdown(self, servers: list[_Running], loop: asyncio.AbstractEventLoop) -> None:
        """Stop accepting, give requests in flight the grace, cut the rest, wait for the servers."""
        for running in servers:
            running.server.should_exit = True
        grace_end = time.monotonic() + self.timeouts.shutdown_grace_s
        for running in servers:
            with contextlib.suppress(concurrent.futures.TimeoutError):
                running.future.result(timeout=max(0.0, grace_end - time.monotonic()))
        for running in servers:
            if not running.future.done():
                cut = asyncio.run_coroutine_threadsafe(_cut(running.app), loop).result(timeout=5)
                if cut:
                    log.warning(
                        "gateway %s: cut %d request(s) still in flight at shutdown", running.app.service, cut
                    )
        deadline = time.monotonic() + 15
        for running in servers:
            try:
                running.future.result(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                log.exception("gateway: the server on port %d did not stop cleanly", running.port)


async def _cut(app: GatewayApp) -> int:
    return app.cut_all()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()


async def _make_client(timeouts: GatewayTimeouts) -> UpstreamPool:
    return UpstreamPool(
        connect_s=timeouts.connect_s,
        read_s=timeouts.read_s,
        write_s=timeouts.write_s,
        keepalive_s=timeouts.keepalive_s,
    )


def _listen(service: str, host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    try:
        return bind_tcp(host, port, reuse_port=reuse_port)
    except OSError as exc:
        raise GatewayError(
            f"gateway for service {service!r} cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from exc


def _wait_started(service: str, server: uvicorn.Server, future: concurrent.futures.Future[None]) -> None:
    """Block until uvicorn accepts on the socket; raise if it failed or took too long."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if future.done():
            exc = future.exception()
            raise GatewayError(f"gateway for service {service!r} failed to start: {exc!r}") from exc
        if time.monotonic() > deadline:
            server.should_exit = True
            raise GatewayError(f"gateway for service {service!r} did not start in {STARTUP_TIMEOUT_S}s")
        time.sleep(0.002)
