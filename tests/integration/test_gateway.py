"""The gateway (adapters/gateway*.py) against real backends over real HTTP.

Each backend is a small Starlette app served by uvicorn on a free port, in its own thread and event
loop, that counts the requests it receives and how many it serves at once. Its streams send one
SSE chunk, then wait on a *gate* the test opens (an asyncio.Event set from the test thread), then
finish: so "the first chunk reached the client before the backend finished" is checked with
flags, not timings. The gateway is the real `GatewayServer` on a free port; clients are httpx.
Nothing asserts a duration; every wait is a bounded poll; every server and thread is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lowtide.adapters.gateway import GatewayError, GatewayRouter, GatewayServer, GatewayTimeouts

SERVICE = "chat"
CHAT = "/v1/chat/completions"
STREAM_CHUNKS = 4  # chunk 0 before the gate, 1..3 after it, then [DONE]


def wait_until(cond: Callable[[], object], timeout: float = 20.0, what: str = "") -> None:
    """Poll `cond` until it is truthy (bounded). Local: tests/support.py imports the whole wiring."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")
        time.sleep(0.01)


# -- a fake replica ----------------------------------------------------------------------------------


def _listen() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    return sock


def sse(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class Backend:
    """An OpenAI-style replica: `POST /v1/chat/completions` with a JSON body whose fields steer it:
    `id` (recorded), `stream`, `gate` (wait for `open(gate)`: before answering, or after the first
    chunk of a stream), `status` (answer this error status; `status_by`: per backend name), `die`
    (fail after the first chunk)."""

    def __init__(self, name: str, keep_alive_s: int = 5) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.seen: list[str] = []  # request ids in arrival order
        self.peers: dict[str, int] = {}  # request id -> the gateway's source port (its connection)
        self.headers: dict[str, dict[str, str]] = {}
        self.active = 0
        self.max_active = 0
        self.finished: set[str] = set()
        self.cancelled: set[str] = set()
        self._gates: dict[str, asyncio.Event] = {}
        app = Starlette(
            routes=[
                Route(CHAT, self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
            ]
        )
        self._sock = _listen()
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_config=None,
                lifespan="off",
                http="h11",
                ws="none",
                interface="asgi3",
                timeout_graceful_shutdown=1,  # a stream left at a closed gate must not hold teardown
                timeout_keep_alive=keep_alive_s,
                proxy_headers=False,  # record the real peer (the gateway's connection), not x-forwarded-for
            )
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"backend-{name}", daemon=True)
        self._thread.start()
        wait_until(lambda: self._server.started, timeout=10, what=f"backend {name} to start")

    def _run(self) -> None:
        self._loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        self._loop.close()

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
        assert not self._thread.is_alive()

    def _gate(self, name: str) -> asyncio.Event:
        with self.lock:
            return self._gates.setdefault(name, asyncio.Event())

    def open(self, gate: str) -> None:
        self._loop.call_soon_threadsafe(self._gate(gate).set)

    def count(self) -> int:
        with self.lock:
            return len(self.seen)

    def open_connections(self) -> int:
        return len(self._server.server_state.connections)

    def _enter(self, rid: str, request: Request) -> None:
        with self.lock:
            self.seen.append(rid)
            self.headers[rid] = dict(request.headers)
            self.peers[rid] = request.client.port if request.client else 0
            self.active += 1
            self.max_active = max(self.max_active, self.active)

    def _leave(self) -> None:
        with self.lock:
            self.active -= 1

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [], "query": dict(request.query_params)})

    async def _chat(self, request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        rid = str(body.get("id", ""))
        self._enter(rid, request)
        gate = body.get("gate")
        if not body.get("stream"):
            try:
                if gate:
                    await self._gate(gate).wait()
                status = int(body.get("status_by", {}).get(self.name, body.get("status", 200)))
                if status != 200:
                    error = {"message": f"{rid} refused", "type": "BadRequestError", "code": status}
                    return JSONResponse({"error": error}, status_code=status, headers={"x-note": "kept"})
                with self.lock:
                    self.finished.add(rid)
                return JSONResponse({"id": rid, "backend": self.name, "object": "chat.completion"})
            finally:
                self._leave()

        async def events() -> Any:
            try:
                yield sse({"id": rid, "backend": self.name, "n": 0})
                if gate:
                    await self._gate(gate).wait()
                if body.get("die"):
                    raise RuntimeError(f"backend {self.name} dies in the middle of {rid} (on purpose)")
                for n in range(1, STREAM_CHUNKS):
                    yield sse({"id": rid, "backend": self.name, "n": n})
                yield b"data: [DONE]\n\n"
                with self.lock:
                    self.finished.add(rid)
            except asyncio.CancelledError:
                with self.lock:
                    self.cancelled.add(rid)
                raise
            finally:
                self._leave()

        return StreamingResponse(events(), media_type="text/event-stream")


# -- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture
def make_backend() -> Iterator[Callable[..., Backend]]:
    started: list[Backend] = []

    def make(name: str, keep_alive_s: int = 5) -> Backend:
        backend = Backend(name, keep_alive_s)
        started.append(backend)
        return backend

    yield make
    for backend in started:
        backend.close()


@dataclass
class Gw:
    router: GatewayRouter
    server: GatewayServer
    url: str
    clients: list[httpx.Client] = field(default_factory=list)

    def client(self) -> httpx.Client:
        client = httpx.Client(base_url=self.url, timeout=30)
        self.clients.append(client)
        return client


def _gateway_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lowtide-gateway"]


@contextlib.contextmanager
def running_gateway(
    timeouts: GatewayTimeouts | None = None, router: GatewayRouter | None = None
) -> Iterator[Gw]:
    router = router or GatewayRouter()
    server = GatewayServer(router, timeouts=timeouts or GatewayTimeouts(shutdown_grace_s=1))
    port = server.start(SERVICE)
    gw = Gw(router, server, f"http://127.0.0.1:{port}")
    try:
        yield gw
    finally:
        for client in gw.clients:
            client.close()
        server.stop()
        assert not _gateway_threads()
        with pytest.raises(httpx.ConnectError):
            httpx.get(gw.url + "/health", timeout=5)


@pytest.fixture
def gw() -> Iterator[Gw]:
    with running_gateway() as gateway:
        yield gateway


@contextlib.contextmanager
def open_stream(client: httpx.Client, body: dict[str, Any]) -> Iterator[tuple[httpx.Response, Iterator[str]]]:
    """Send a streaming request; yields the response (headers read) and its SSE data lines."""
    response = client.send(client.build_request("POST", CHAT, json={**body, "stream": True}), stream=True)
    try:
        yield response, (line.removeprefix("data: ") for line in response.iter_lines() if line)
    finally:
        response.close()


def read_rest(lines: Iterator[str]) -> list[str]:
    return list(lines)


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


# -- the router alone --------------------------------------------------------------------------------


def test_router_rotates_among_equal_backends_and_prefers_the_least_loaded() -> None:
    router = GatewayRouter()
    router.set_backends(SERVICE, {"r2": "http://h:2/", "r1": "http://h:1", "r3": "http://h:3"})

    def pick_and_release() -> str:
        pick = router.acquire(SERVICE)
        assert pick is not None
        router.release(SERVICE, pick.replica_id)
        return pick.replica_id

    assert [pick_and_release() for _ in range(6)] == ["r1", "r2", "r3", "r1", "r2", "r3"]
    held = router.acquire(SERVICE)  # r1, kept in flight
    assert held is not None and held.replica_id == "r1" and held.url == "http://h:1"
    assert [pick_and_release() for _ in range(4)] == ["r2", "r3", "r2", "r3"]
    excluded = router.acquire(SERVICE, exclude={"r2", "r3"})
    assert excluded is not None and excluded.replica_id == "r1"
    assert router.in_flight(SERVICE, "r1") == 2
    assert router.acquire(SERVICE, exclude={"r1", "r2", "r3"}) is None
    assert router.acquire("other") is None

    router.set_backends(SERVICE, {"r2": "http://h:2"})  # r1 drains
    assert router.draining(SERVICE) == {"r1": 2}
    assert router.in_flight_all() == {SERVICE: {"r1": 2, "r2": 0}}
    router.release(SERVICE, "r1")
    router.release(SERVICE, "r1")
    assert router.in_flight(SERVICE, "r1") == 0
    assert router.draining(SERVICE) == {}
    assert router.in_flight_all() == {SERVICE: {"r2": 0}}
    router.release(SERVICE, "r1")  # an extra release never goes negative
    assert router.in_flight(SERVICE, "r1") == 0


def test_router_passes_over_a_backend_that_refused_a_connection_for_a_while() -> None:
    now = [100.0]
    router = GatewayRouter(connect_cooldown_s=5, clock=lambda: now[0])
    router.set_backends(SERVICE, {"a": "http://h:1", "b": "http://h:2"})

    def pick_and_release() -> str:
        pick = router.acquire(SERVICE)
        assert pick is not None
        router.release(SERVICE, pick.replica_id)
        return pick.replica_id

    router.connect_failed(SERVICE, "a")
    assert [pick_and_release() for _ in range(3)] == ["b", "b", "b"]
    held = router.acquire(SERVICE)  # b busy: a is still passed over while b can take it
    assert held is not None and held.replica_id == "b"
    only_a = router.acquire(SERVICE, exclude={"b"})  # nothing else left: a is tried anyway
    assert only_a is not None and only_a.replica_id == "a"
    router.release(SERVICE, "a")
    router.release(SERVICE, "b")
    now[0] = 105.0
    assert [pick_and_release() for _ in range(2)] == ["b", "a"]  # cooled down: rotation again (a went last)

    router.connect_failed(SERVICE, "a")
    router.set_backends(SERVICE, {"a": "http://h:1", "b": "http://h:2"})  # same address: still cooling
    assert pick_and_release() == "b"
    router.set_backends(SERVICE, {"a": "http://h:9", "b": "http://h:2"})  # restarted elsewhere: fresh
    assert pick_and_release() == "a"


# -- proxying ----------------------------------------------------------------------------------------


def test_non_stream_request_and_query_are_proxied(gw: Gw, make_backend: Callable[..., Backend]) -> None:
    a = make_backend("a")
    gw.router.set_backends(SERVICE, {"a": a.url})
    client = gw.client()

    r = client.post(
        CHAT,
        json={"id": "q1"},
        headers={"authorization": "Bearer sk-x", "connection": "keep-alive, x-hop", "x-hop": "1"},
    )
    assert r.status_code == 200
    assert r.json() == {"id": "q1", "backend": "a", "object": "chat.completion"}
    assert r.headers["content-type"] == "application/json"
    assert r.headers["x-lowtide-replica"] == "a"
    sent = a.headers["q1"]
    assert sent["authorization"] == "Bearer sk-x"  # end-to-end headers pass
    assert "x-hop" not in sent  # named hop-by-hop by the client's Connection header
    assert sent["x-forwarded-for"] == "127.0.0.1"
    assert sent["host"] == f"127.0.0.1:{a.port}"

    r = client.get("/v1/models", params={"a": "1", "b": "x y"})
    assert r.status_code == 200
    assert r.json()["query"] == {"a": "1", "b": "x y"}


def test_stream_chunks_reach_the_client_before_the_backend_finishes(
    gw: Gw, make_backend: Callable[..., Backend]
) -> None:
    a = make_backend("a")
    gw.router.set_backends(SERVICE, {"a": a.url})
    with open_stream(gw.client(), {"id": "s1", "gate": "g1"}) as (response, lines):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        first = json.loads(next(lines))
        assert first == {"id": "s1", "backend": "a", "n": 0}
        # The first chunk arrived while the backend is still held at its gate.
        assert "s1" not in a.finished and a.active == 1
        assert gw.router.in_flight(SERVICE, "a") == 1
        a.open("g1")
        rest = read_rest(lines)
    assert [json.loads(x)["n"] for x in rest[:-1]] == list(range(1, STREAM_CHUNKS))
    assert rest[-1] == "[DONE]"
    wait_until(lambda: gw.router.in_flight(SERVICE, "a") == 0, what="in_flight back to 0")


def test_status_codes_and_error_bodies_pass_through(gw: Gw, make_backend: Callable[..., Backend]) -> None:
    a = make_backend("a")
    gw.router.set_backends(SERVICE, {"a": a.url})
    client = gw.client()
    for status in (400, 422, 500):
        r = client.post(CHAT, json={"id": f"e{status}", "status": status})
        assert r.status_code == status
        assert r.json() == {
            "error": {"message": f"e{status} refused", "type": "BadRequestError", "code": status}
        }
        assert r.headers["x-note"] == "kept"
    r = client.get("/v1/nowhere")
    assert r.status_code == 404  # the backend's own 404
    r = client.get("/sleep")
    assert r.status_code == 404  # not under /v1: never forwarded
    assert r.json()["error"]["type"] == "not_found"
    assert a.count() == 3


def test_least_in_flight_sends_new_requests_away_from_a_busy_backend(
    gw: Gw, make_backend: Callable[..., Backend]
) -> None:
    a, b = make_backend("a"), make_backend("b")
    client = gw.client()
    gw.router.set_backends(SERVICE, {"a": a.url})
    with contextlib.ExitStack() as stack:
        held: list[Iterator[str]] = []
        for rid in ("slow1", "slow2"):  # pinned on a: it is the only backend
            _response, lines = stack.enter_context(open_stream(client, {"id": rid, "gate": "a-gate"}))
            assert json.loads(next(lines))["backend"] == "a"
            held.append(lines)
        gw.router.set_backends(SERVICE, {"a": a.url, "b": b.url})
        assert gw.router.in_flight(SERVICE, "a") == 2

        for n in range(5):  # short requests: b has 0 in flight each time, a has 2
            r = client.post(CHAT, json={"id": f"quick{n}"})
            assert r.headers["x-lowtide-replica"] == "b"
        assert a.seen == ["slow1", "slow2"]

        served_by = []
        for rid in ("slow3", "slow4", "slow5"):  # b: 0 -> 1 -> 2 in flight; then a tie 2/2
            _response, lines = stack.enter_context(open_stream(client, {"id": rid, "gate": "b-gate"}))
            served_by.append(json.loads(next(lines))["backend"])
            held.append(lines)
        # The tie goes to the backend picked least recently: a (slow2) before b (slow4).
        assert served_by == ["b", "b", "a"]
        assert gw.router.in_flight(SERVICE, "a") == 3 and gw.router.in_flight(SERVICE, "b") == 2

        for backend in (a, b):
            backend.open("a-gate")
            backend.open("b-gate")
        for lines in held:
            assert read_rest(lines)[-1] == "[DONE]"
    wait_until(
        lambda: gw.router.in_flight(SERVICE, "a") == gw.router.in_flight(SERVICE, "b") == 0,
        what="both backends drained",
    )


# -- draining ------------------------------------------------------------------------------------


@dataclass
class Result:
    after_change: bool
    replica: str | None
    error: str | None


class SteadyLoad:
    """Client threads sending requests back to back (every third one a short stream)."""

    def __init__(self, url: str, workers: int, change: threading.Event) -> None:
        self.url = url
        self.change = change
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.results: list[Result] = []
        self.threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(workers)]
        for thread in self.threads:
            thread.start()

    def _work(self, worker: int) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                after = self.change.is_set()  # read before sending: such a request is routed after it
                result = Result(after, None, None)
                try:
                    if n % 3 == 0:
                        with open_stream(client, {"id": f"w{worker}-{n}"}) as (response, lines):
                            body = read_rest(lines)
                        ok = response.status_code == 200 and body[-1] == "[DONE]"
                    else:
                        response = client.post(CHAT, json={"id": f"w{worker}-{n}"})
                        ok = response.status_code == 200 and response.json()["id"] == f"w{worker}-{n}"
                    result.replica = response.headers.get("x-lowtide-replica")
                    if not ok:
                        result.error = f"HTTP {response.status_code}"
                except httpx.HTTPError as exc:
                    result.error = repr(exc)
                with self.lock:
                    self.results.append(result)

    def served(self, replica: str, *, after_change: bool) -> int:
        with self.lock:
            return sum(1 for r in self.results if r.replica == replica and r.after_change == after_change)

    def finish(self) -> list[Result]:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)
        return self.results


def test_removing_a_backend_drains_it_without_failing_any_request(
    gw: Gw, make_backend: Callable[..., Backend]
) -> None:
    a, b = make_backend("a"), make_backend("b")
    gw.router.set_backends(SERVICE, {"a": a.url})
    changed = threading.Event()
    load: SteadyLoad | None = None
    try:
        with open_stream(gw.client(), {"id": "long", "gate": "long"}) as (_, lines):  # pinned on a
            load = SteadyLoad(gw.url, workers=3, change=changed)
            assert json.loads(next(lines))["backend"] == "a"
            gw.router.set_backends(SERVICE, {"a": a.url, "b": b.url})
            wait_until(lambda: load.served("a", after_change=False) >= 5, what="load on a")
            wait_until(lambda: load.served("b", after_change=False) >= 5, what="load on b")

            gw.router.set_backends(SERVICE, {"b": b.url})  # take a out: it drains
            changed.set()
            assert gw.router.in_flight(SERVICE, "a") >= 1  # at least the long stream
            wait_until(lambda: load.served("b", after_change=True) >= 20, what="load going on to b")
            wait_until(lambda: gw.router.in_flight(SERVICE, "a") == 1, what="only the long stream left on a")
            assert gw.router.draining(SERVICE) == {"a": 1}

            a.open("long")  # the stream in flight on the drained backend completes
            rest = read_rest(lines)
        assert rest[-1] == "[DONE]" and len(rest) == STREAM_CHUNKS
        assert "long" in a.finished
        wait_until(lambda: gw.router.in_flight(SERVICE, "a") == 0, what="a drained")
        assert gw.router.draining(SERVICE) == {}

        a.close()  # parked; requests keep flowing to b
        seen = load.served("b", after_change=True)
        wait_until(lambda: load.served("b", after_change=True) >= seen + 20, what="load after parking a")
    finally:
        results = load.finish() if load else []
    assert [r for r in results if r.error] == []
    assert {r.replica for r in results if r.after_change} == {"b"}
    assert len(results) >= 50


# -- failures ------------------------------------------------------------------------------------


def test_connection_refused_is_retried_on_another_backend(make_backend: Callable[..., Backend]) -> None:
    b = make_backend("b")
    with (
        running_gateway(router=GatewayRouter(connect_cooldown_s=3600)) as gw,
        _listen() as dead,  # bound, never listening: every connect is refused
    ):
        dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
        gw.router.set_backends(SERVICE, {"a-dead": dead_url, "b": b.url})
        client = gw.client()
        for n in range(4):
            r = client.post(CHAT, json={"id": f"p{n}"})
            assert r.status_code == 200
            assert r.headers["x-lowtide-replica"] == "b"
        with open_stream(client, {"id": "p-stream"}) as (_response, lines):
            assert read_rest(lines)[-1] == "[DONE]"
        assert b.count() == 5

        gw.router.set_backends(SERVICE, {"a-dead": dead_url})  # only the dead one: tried despite cooldown
        r = client.post(CHAT, json={"id": "p-none"})
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "service_unavailable"
        assert "a-dead" in r.json()["error"]["message"]
        assert r.headers.get("x-lowtide-replica") is None
        samples = metric_samples(client.get("/metrics").text)
        refused = (
            "lowtide_gateway_upstream_errors_total",
            (("kind", "connect"), ("replica", "a-dead"), ("service", SERVICE)),
        )
        # The first request tried a-dead (never picked, lowest id); the next ones passed it over
        # (cooling down), the last one had nothing else to try.
        assert samples[refused] == 2
        no_replica = (
            "lowtide_gateway_requests_total",
            (("code", "503"), ("replica", "none"), ("service", SERVICE)),
        )
        assert samples[no_replica] == 1
        assert gw.router.in_flight(SERVICE, "a-dead") == 0


def test_no_backend_answers_503_in_openai_form(gw: Gw, make_backend: Callable[..., Backend]) -> None:
    client = gw.client()
    r = client.post(CHAT, json={"id": "x"})
    assert r.status_code == 503
    assert r.json() == {
        "error": {
            "message": "service 'chat' has no replica serving now",
            "type": "service_unavailable",
            "code": 503,
        }
    }
    assert r.headers["retry-after"] == "1"
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["backends"] == 0

    a = make_backend("a")
    gw.router.set_backends(SERVICE, {"a": a.url})
    health = client.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "service": SERVICE, "backends": 1}
    assert client.post(CHAT, json={"id": "y"}).status_code == 200
    gw.router.set_backends(SERVICE, {})
    assert client.post(CHAT, json={"id": "z"}).status_code == 503


def test_backend_dying_mid_stream_ends_the_client_stream_with_an_error(
    gw: Gw, make_backend: Callable[..., Backend]
) -> None:
    a = make_backend("a")
    gw.router.set_backends(SERVICE, {"a": a.url})
    received: list[str] = []
    with (
        open_stream(gw.client(), {"id": "d1", "gate": "d1", "die": True}) as (_, lines),
        pytest.raises(httpx.RemoteProtocolError),
    ):
        received.append(next(lines))
        a.open("d1")
        received.extend(lines)
    assert json.loads(received[0])["n"] == 0
    error = json.loads(received[-1])["error"]
    assert error["type"] == "upstream_error" and error["code"] == 502
    assert len(received) == 2
    wait_until(lambda: gw.router.in_flight(SERVICE, "a") == 0, what="in_flight back to 0")
    samples = metric_samples(gw.client().get("/metrics").text)
    key = (
        "lowtide_gateway_upstream_errors_total",
        (("kind", "stream"), ("replica", "a"), ("service", SERVICE)),
    )
    assert samples[key] == 1


def test_client_leaving_mid_stream_cancels_the_upstream_request(
    gw: Gw, make_backend: Callable[..., Backend]
) -> None:
    a = make_backend("a")
    gw.router.set_backends(SERVICE, {"a": a.url})
    client = gw.client()
    with open_stream(client, {"id": "gone", "gate": "never"}) as (_, lines):
        assert json.loads(next(lines))["n"] == 0
    # closed: the client hung up while the backend still generates
    wait_until(lambda: "gone" in a.cancelled, what="the backend to see the request cancelled")
    wait_until(lambda: gw.router.in_flight(SERVICE, "a") == 0, what="in_flight back to 0")
    samples = metric_samples(client.get("/metrics").text)
    key = ("lowtide_gateway_requests_total", (("code", "499"), ("replica", "a"), ("service", SERVICE)))
    assert samples[key] == 1


def test_read_timeout_answers_504(make_backend: Callable[..., Backend]) -> None:
    a = make_backend("a")
    with running_gateway(GatewayTimeouts(read_s=0.2, shutdown_grace_s=1)) as gw:
        gw.router.set_backends(SERVICE, {"a": a.url})
        r = gw.client().post(CHAT, json={"id": "t1", "gate": "t1"})  # the backend answers only at the gate
        assert r.status_code == 504
        assert r.json()["error"]["type"] == "gateway_timeout"
        a.open("t1")
        wait_until(lambda: gw.router.in_flight(SERVICE, "a") == 0, what="in_flight back to 0")


def test_a_service_read_timeout_overrides_the_servers_and_failures_in_a_row_are_counted(
    make_backend: Callable[..., Backend],
) -> None:
    a = make_backend("a")
    router = GatewayRouter()
    server = GatewayServer(router, timeouts=GatewayTimeouts(read_s=600, shutdown_grace_s=1))
    try:
        port = server.start(SERVICE, read_timeout_s=0.2)  # services[].gateway_read_timeout
        router.set_backends(SERVICE, {"a": a.url})
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for n in range(2):
                r = client.post(CHAT, json={"id": f"t{n}", "gate": f"t{n}"})
                assert r.status_code == 504
                a.open(f"t{n}")
            # The control loop reads these as a sign that the replica is hung.
            assert router.upstream_failures(SERVICE, "a") == 2
            assert client.post(CHAT, json={"id": "ok"}).status_code == 200
            assert router.upstream_failures(SERVICE, "a") == 0  # an answer ends the run
            assert client.post(CHAT, json={"id": "t9", "gate": "t9"}).status_code == 504
            a.open("t9")
            assert router.upstream_failures(SERVICE, "a") == 1
            router.set_backends(SERVICE, {})  # out of the live set: forgotten
            assert router.upstream_failures(SERVICE, "a") == 0
    finally:
        server.stop()


def test_a_503_is_retried_on_another_backend_and_the_last_one_passes_through(
    gw: Gw, make_backend: Callable[..., Backend]
) -> None:
    a, b = make_backend("a"), make_backend("b")
    gw.router.set_backends(SERVICE, {"a": a.url, "b": b.url})
    client = gw.client()
    # vLLM answers 503 when its queue is full: nothing was done, another replica may serve it.
    r = client.post(CHAT, json={"id": "q1", "status_by": {"a": 503}})
    assert r.status_code == 200 and r.headers["x-lowtide-replica"] == "b"
    assert (a.count(), b.count()) == (1, 1)  # a was tried first (never picked, lowest id)
    samples = metric_samples(client.get("/metrics").text)
    key = (
        "lowtide_gateway_upstream_errors_total",
        (("kind", "unavailable"), ("replica", "a"), ("service", SERVICE)),
    )
    assert samples[key] == 1
    # Every replica full: the last 503 is passed through as it came.
    r = client.post(CHAT, json={"id": "q2", "status": 503})
    assert r.status_code == 503 and r.headers["x-note"] == "kept"
    assert r.json()["error"]["message"].endswith("refused")


def test_oversized_body_is_refused_with_413(make_backend: Callable[..., Backend]) -> None:
    a = make_backend("a")
    router = GatewayRouter()
    server = GatewayServer(router, max_body_bytes=1000)
    try:
        port = server.start(SERVICE)
        router.set_backends(SERVICE, {"a": a.url})
        r = httpx.post(f"http://127.0.0.1:{port}{CHAT}", content=b"x" * 1001, timeout=10)
        assert r.status_code == 413
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert a.count() == 0
    finally:
        server.stop()


# -- metrics and the server ------------------------------------------------------------------------


def test_metrics_endpoint_parses_and_counts_requests(gw: Gw, make_backend: Callable[..., Backend]) -> None:
    a, b = make_backend("a"), make_backend("b")
    client = gw.client()
    client.post(CHAT, json={"id": "before"})  # no backend yet: 503
    gw.router.set_backends(SERVICE, {"a": a.url, "b": b.url})
    for n in range(6):
        assert client.post(CHAT, json={"id": f"m{n}"}).status_code == 200
    assert client.post(CHAT, json={"id": "bad", "status": 400}).status_code == 400  # goes to a (rotation)

    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = metric_samples(r.text)

    def requests(replica: str, code: str) -> float:
        key = (("code", code), ("replica", replica), ("service", SERVICE))
        return samples.get(("lowtide_gateway_requests_total", key), 0.0)

    assert requests("a", "200") == 3 and requests("b", "200") == 3
    assert requests("a", "400") == 1
    assert requests("none", "503") == 1
    assert samples[("lowtide_gateway_no_backend_total", (("service", SERVICE),))] == 1
    assert samples[("lowtide_gateway_request_duration_seconds_count", (("service", SERVICE),))] == 8
    assert samples[("lowtide_gateway_in_flight", (("replica", "a"), ("service", SERVICE)))] == 0
    assert samples[("lowtide_gateway_in_flight", (("replica", "b"), ("service", SERVICE)))] == 0


def test_each_service_port_serves_its_own_metrics_and_backends(
    make_backend: Callable[..., Backend],
) -> None:
    a, b = make_backend("a"), make_backend("b")
    router = GatewayRouter()
    with GatewayServer(router) as server:
        chat_port, code_port = server.start("chat"), server.start("code")
        assert server.served() == {"chat": chat_port, "code": code_port}
        assert server.url("code") == f"http://127.0.0.1:{code_port}"
        router.set_backends("chat", {"a": a.url})
        router.set_backends("code", {"b": b.url})
        with httpx.Client(timeout=10) as client:
            assert (
                client.post(f"http://127.0.0.1:{chat_port}{CHAT}", json={}).headers["x-lowtide-replica"]
                == "a"
            )
            assert (
                client.post(f"http://127.0.0.1:{code_port}{CHAT}", json={}).headers["x-lowtide-replica"]
                == "b"
            )
            text = client.get(f"http://127.0.0.1:{code_port}/metrics").text
            services = {s.labels["service"] for f in text_string_to_metric_families(text) for s in f.samples}
            assert services == {"code"}
            server.stop_service("code")
            with pytest.raises(httpx.ConnectError):
                client.get(f"http://127.0.0.1:{code_port}/health")
            assert client.get(f"http://127.0.0.1:{chat_port}/health").status_code == 200
            assert router.metrics.text().count(b'service="code"') > 0  # the whole registry keeps both
    assert not _gateway_threads()


def test_start_errors_are_raised_synchronously() -> None:
    with GatewayServer() as server, _listen() as taken:
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(GatewayError, match=rf"service 'chat' cannot listen on 127.0.0.1:{port}"):
            server.start("chat", "127.0.0.1", port)
        first = server.start("chat")
        with pytest.raises(GatewayError, match=rf"already serves 'chat' on 127.0.0.1:{first}"):
            server.start("chat")
    assert not _gateway_threads()


def test_accepted_connections_have_nagle_off(gw: Gw, make_backend: Callable[..., Backend]) -> None:
    """The listening socket says IPPROTO_TCP, so asyncio sets TCP_NODELAY on what it accepts."""
    a = make_backend("a")
    gw.router.set_backends(SERVICE, {"a": a.url})
    running = gw.server._servers[SERVICE]
    (listener,) = [s for s in running.server.servers[0].sockets]
    # Ask the descriptor itself: uvloop hands out a PseudoSocket whose `proto` reads 0.
    with socket.socket(fileno=os.dup(listener.fileno())) as real:
        assert real.proto == socket.IPPROTO_TCP
    client = gw.client()
    assert client.get("/health").status_code == 200
    connections = list(running.server.server_state.connections)
    assert connections
    for protocol in connections:
        sock = protocol.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


# -- upstream connections and shutdown -----------------------------------------------------------


def test_upstream_connections_are_reused_and_stale_ones_dropped(make_backend: Callable[..., Backend]) -> None:
    a = make_backend("a", keep_alive_s=1)  # closes an idle connection after 1 s
    with running_gateway(GatewayTimeouts(keepalive_s=60, shutdown_grace_s=1)) as gw:
        gw.router.set_backends(SERVICE, {"a": a.url})
        client = gw.client()
        for n in range(5):
            assert client.post(CHAT, json={"id": f"k{n}"}).status_code == 200
        assert len({a.peers[f"k{n}"] for n in range(5)}) == 1  # one keep-alive connection, reused

        with contextlib.ExitStack() as stack:  # three at once need three connections
            streams = [
                stack.enter_context(open_stream(client, {"id": f"c{n}", "gate": "c"})) for n in range(3)
            ]
            for _, lines in streams:
                next(lines)
            a.open("c")
            for _, lines in streams:
                assert read_rest(lines)[-1] == "[DONE]"
        assert len({a.peers[f"c{n}"] for n in range(3)}) == 3

        # The backend closes the idle connections; the gateway must not send on a closed one.
        wait_until(lambda: a.open_connections() == 0, what="the backend to close its idle connections")
        r = client.post(CHAT, json={"id": "after"})
        assert r.status_code == 200
        assert a.peers["after"] not in {a.peers[f"c{n}"] for n in range(3)} | {a.peers["k0"]}


def test_stop_lets_requests_in_flight_finish_within_the_grace(make_backend: Callable[..., Backend]) -> None:
    a = make_backend("a")
    router = GatewayRouter()
    server = GatewayServer(router, timeouts=GatewayTimeouts(shutdown_grace_s=30))
    port = server.start(SERVICE)
    router.set_backends(SERVICE, {"a": a.url})
    stopper = threading.Thread(target=server.stop)
    try:
        with (
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client,
            open_stream(client, {"id": "finishing", "gate": "f"}) as (_, lines),
        ):
            assert json.loads(next(lines))["n"] == 0
            stopper.start()

            def refused() -> bool:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                    # Refused, or accepted from the backlog as the listener closed and then
                    # dropped unanswered (closed, or reset: "connection reset by peer" when the
                    # kernel drops the backlog): either way it no longer takes requests.
                    return True
                return False

            wait_until(refused, what="the gateway to stop accepting")
            a.open("f")
            rest = read_rest(lines)
        assert rest[-1] == "[DONE]" and len(rest) == STREAM_CHUNKS
    finally:
        a.open("f")
        if stopper.ident is not None:
            stopper.join(timeout=30)
        server.stop()  # a no-op when the stopper did it
    assert not stopper.is_alive()
    assert not _gateway_threads()


def test_stop_cuts_what_is_left_after_the_grace(
    make_backend: Callable[..., Backend], caplog: pytest.LogCaptureFixture
) -> None:
    a = make_backend("a")
    router = GatewayRouter()
    server = GatewayServer(router, timeouts=GatewayTimeouts(shutdown_grace_s=0.3))
    port = server.start(SERVICE)
    router.set_backends(SERVICE, {"a": a.url})
    results: dict[str, Any] = {}

    def waiting_request() -> None:  # the backend answers only at a gate that never opens
        results["json"] = httpx.post(
            f"http://127.0.0.1:{port}{CHAT}", json={"id": "j", "gate": "never"}, timeout=30
        )

    waiter = threading.Thread(target=waiting_request)
    try:
        with (
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client,
            open_stream(client, {"id": "s", "gate": "never"}) as (_, lines),
        ):
            assert json.loads(next(lines))["n"] == 0
            waiter.start()
            wait_until(lambda: "j" in a.seen, what="the waiting request to reach the backend")
            server.stop()
            received: list[str] = []
            with pytest.raises(httpx.RemoteProtocolError):
                received.extend(lines)
        waiter.join(timeout=30)
    finally:
        server.stop()
        a.open("never")  # let the backend's handlers end before its own shutdown
    assert json.loads(received[-1])["error"]["type"] == "service_unavailable"
    assert results["json"].status_code == 503
    assert "shutting down" in results["json"].json()["error"]["message"]
    assert "Exception in ASGI application" not in caplog.text
    assert "cut 2 request(s) still in flight at shutdown" in caplog.text
    assert router.in_flight(SERVICE, "a") == 0
    wait_until(lambda: "s" in a.cancelled, what="the backend to see the cut stream's connection closed")
    assert not _gateway_threads()


# -- the upstream client's HTTP/1.1 framing (adapters/gateway_upstream.py) ---------------------------


class RawBackend:
    """A replica that answers each connection's requests with canned bytes (`reply(n)` for the n-th
    request on the whole server; None closes without answering) and records what it received."""

    def __init__(self, reply: Callable[[int], bytes | None], close_after_reply: bool) -> None:
        self.reply = reply
        self.close_after_reply = close_after_reply
        self.received: list[bytes] = []  # each request as received, head and body
        self.connections = 0
        self.pause_after: int | None = None  # send this many bytes of each reply, pause, then the rest
        self._sock = _listen()
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="raw-backend", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    part = conn.recv(65536)
                    if not part:
                        return
                    data += part
                head, _, rest = data.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(rest) < length:
                    rest += conn.recv(65536)
                self.received.append(head + b"\r\n\r\n" + rest[:length])
                data = rest[length:]
                answer = self.reply(len(self.received) - 1)
                if answer is None:
                    return
                if self.pause_after is not None:  # the head, then the rest a moment later
                    conn.sendall(answer[: self.pause_after])
                    time.sleep(0.05)
                    answer = answer[self.pause_after :]
                conn.sendall(answer)
                if self.close_after_reply:
                    conn.shutdown(socket.SHUT_WR)
                    return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sock.close()


def test_request_is_sent_whole_and_a_body_ended_by_the_connection_close_passes_through(gw: Gw) -> None:
    """A response with neither content-length nor chunked framing ends when the replica closes the
    connection (RFC 9112 §6.3); the request goes out with its host, content-length and exact body."""
    body = b'{"choices": [' + b", ".join(b'{"index": %d}' % i for i in range(2000)) + b"]}"
    raw = RawBackend(
        lambda n: b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n" + body,
        close_after_reply=True,
    )
    try:
        gw.router.set_backends(SERVICE, {"raw": raw.url})
        client = gw.client()
        sent = json.dumps({"id": "r1", "messages": [{"role": "user", "content": "é" * 3000}]}).encode()
        for _ in range(2):  # the closed connection is not reused for the second request
            r = client.post(
                CHAT + "?x=1", content=sent, headers={"content-type": "application/json", "x-custom": "kept"}
            )
            assert r.status_code == 200
            assert r.content == body
            assert r.headers["x-lowtide-replica"] == "raw"
        assert raw.connections == 2
        head, _, received_body = raw.received[0].partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /v1/chat/completions?x=1 HTTP/1.1"
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
        assert fields[b"host"] == raw.url.removeprefix("http://").encode()
        assert fields[b"content-length"] == str(len(sent)).encode()
        assert fields[b"x-custom"] == b"kept"
        assert b"x-forwarded-for" in fields
        assert received_body == sent
    finally:
        raw.close()


def test_a_malformed_or_missing_answer_is_a_502_counted_as_an_upstream_failure(gw: Gw) -> None:
    raw = RawBackend(lambda n: b"THIS IS NOT HTTP\r\n\r\n" if n == 0 else None, close_after_reply=True)
    try:
        gw.router.set_backends(SERVICE, {"raw": raw.url})
        client = gw.client()
        for n in range(2):  # garbage, then a connection closed without any answer
            r = client.post(CHAT, json={"id": f"m{n}"})
            assert r.status_code == 502
            assert r.json()["error"]["type"] == "bad_gateway"
            assert gw.router.upstream_failures(SERVICE, "raw") == n + 1
        samples = metric_samples(client.get("/metrics").text)
        key = (
            "lowtide_gateway_upstream_errors_total",
            (("kind", "protocol"), ("replica", "raw"), ("service", SERVICE)),
        )
        assert samples[key] == 2
    finally:
        raw.close()


def test_a_head_request_gets_its_answer_without_waiting_for_a_body(
    make_backend: Callable[..., Backend],
) -> None:
    """The answer to a HEAD carries the content-length of a GET but no body (RFC 9110 §9.3.2)."""
    a = make_backend("a")
    with running_gateway(GatewayTimeouts(read_s=10, shutdown_grace_s=1)) as gw:
        gw.router.set_backends(SERVICE, {"a": a.url})
        client = gw.client()
        for _ in range(2):
            r = client.head("/v1/models")
            assert r.status_code == 200
            assert r.headers["x-lowtide-replica"] == "a"
            assert int(r.headers["content-length"]) > 0
            assert r.content == b""
        assert client.get("/v1/models").json()["object"] == "list"
        assert gw.router.upstream_failures(SERVICE, "a") == 0


# -- the server side's per-request costs (adapters/gateway_http.py) -------------------------------


def test_a_json_answer_reaches_the_client_head_and_body_in_one_piece(gw: Gw) -> None:
    """The response head is written together with the body (one send), so the client's first read
    holds the whole answer, not the head alone, even when the replica sends its head first and
    its body a moment later (as uvicorn, and so vLLM, does: two writes)."""
    body = b'{"object": "chat.completion", "choices": [{"index": 0}]}'
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    raw = RawBackend(lambda n: head + body, close_after_reply=False)
    raw.pause_after = len(head)
    port = int(gw.url.rsplit(":", 1)[1])
    try:
        gw.router.set_backends(SERVICE, {"raw": raw.url})
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for n in range(3):
                request = b'{"id": "one-piece-%d"}' % n
                sock.sendall(
                    b"POST %s HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (CHAT.encode(), len(request), request)
                )
                first = sock.recv(65536)
                assert first.startswith(b"HTTP/1.1 200 ")
                assert first.endswith(b"\r\n\r\n" + body), first
                assert b"x-lowtide-replica: raw\r\n" in first
    finally:
        raw.close()


def test_uvicorn_access_log_stays_silent_even_when_its_logger_would_print(
    gw: Gw, make_backend: Callable[..., Backend], caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway counts requests in its metrics; uvicorn's per-request access line is never built."""
    caplog.set_level(logging.INFO, logger="uvicorn.access")
    a = make_backend("a")
    gw.router.set_backends(SERVICE, {"a": a.url})
    client = gw.client()
    assert client.post(CHAT, json={"id": "quiet"}).status_code == 200
    assert client.get("/health").status_code == 200
    # The backend (uvicorn too) logs its own requests; only the gateway answers /health itself.
    backend_lines = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    assert any(CHAT in line for line in backend_lines)  # the logger would print...
    assert not any("/health" in line for line in backend_lines)  # ...but not the gateway's lines
