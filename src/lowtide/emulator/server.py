"""The emulator's HTTP server: vLLM's OpenAI-compatible API in front of the capacity model.

Role: serve, like ``vllm serve``, what lowtide depends on, as vLLM does it (each behaviour checked
against vLLM's source; the table, with files and versions, is docs/vllm.md):

===========================  ==============================================================================
(cold start)                 the port is bound but not listening: connections are refused until the
                             engine is ready (vLLM binds its socket before building the engine and
                             listens only once the app runs: vllm/entrypoints/openai/api_server.py
                             ``setup_server`` / ``create_server_socket``)
``GET /health``              200 once listening, also while asleep (vLLM checks the engine process only);
                             500 if the engine loop died. A SIGSTOPped process answers nothing at all
``GET /v1/models``           the served model
``POST /v1/completions``     OpenAI completions; ``stream: true`` → SSE ``data: {...}`` chunks, one per
``POST /v1/chat/completions``  engine step that produced tokens for the request, then ``data: [DONE]``;
                             while asleep or waking a request is held until the engine is awake
``GET /metrics``             vLLM's Prometheus exposition (`emulator.vllm_metrics_export`)
===========================  ==============================================================================

Only with ``VLLM_SERVER_DEV_MODE=1`` in the environment (vllm/envs.py; the dev routers are
registered under ``if envs.VLLM_SERVER_DEV_MODE``), else 404 like any unknown path:

===========================  ==============================================================================
``POST /sleep``              ``level`` 0–2 (default 1), ``mode`` abort (default) | wait | keep; answers
                             ``{"status": "sleeping", "level": n}`` once asleep (``wait``: once the
                             in-flight requests finished); a JSON body is accepted and ignored
``POST /wake_up``            ``tags`` (repeatable: weights, kv_cache; default all); answers once what it
                             woke is back: ``{"status": "awake"|"sleeping", "tags_woken": [...]|null}``
``GET /is_sleeping``         ``{"is_sleeping": bool}``: true until every tag is awake and the wake is done
``POST /collective_rpc``,    accepted (200) and logged (400 without a JSON ``method``, as vLLM): the
                             emulator has no workers and no caches
``POST /reset_prefix_cache``, ``/reset_mm_cache``, ``/reset_encoder_cache``; ``GET /server_info``
===========================  ==============================================================================

Errors are OpenAI error objects (``{"error": {"message", "type", "param", "code"}}``): 400 for a body
that is not JSON or not a valid request (and prompts longer than ``max_model_len``), a bad sleep
level, mode or wake tag; 404 for an unknown model. A request aborted by ``/sleep`` (mode abort)
gets 503 when it has sent nothing yet (non-streaming: a client or gateway may retry it elsewhere);
a stream ends with a chunk whose ``finish_reason`` is ``abort``, then ``[DONE]``. A client that
disconnects (streaming or not) aborts its request, as in vLLM. Token counting and the extension
fields are described in `emulator.openai_shapes`.

The engine runs in model time on ``time.monotonic``: one asyncio task (`_Driver`) advances it to the
end of each step and sleeps until the next; handlers wait on per-request events the engine sets.
`serve` binds the port, waits out the cold start (SIGTERM or SIGINT then ends it with exit 0), runs
uvicorn on the bound socket and returns normally on SIGTERM or SIGINT after a graceful shutdown:
requests in flight get ``shutdown_grace_s`` (5 s) to finish, then whatever is left is aborted as by
``/sleep``. ``host`` "" or "0.0.0.0" is every interface (vLLM's default without ``--host``).
``data_parallel_size`` N runs N engines behind the one server (`engine.EngineGroup`).
Neighbours: `emulator.engine`, `emulator.vllm_metrics_export`, `emulator.openai_shapes`;
`cli.emulate_cmd` is the command line. Must not: import lowtide beyond `lowtide.domain` and
`lowtide.emulator`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any, TypeVar

import uvicorn
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lowtide.domain.metrics import MetricsVersion
from lowtide.emulator import openai_shapes as oai
from lowtide.emulator.engine import (
    SLEEP_MODES,
    EngineConfig,
    EngineGroup,
    EngineLike,
    EngineRequest,
    EngineState,
    EngineUnavailable,
    RequestRejected,
)
from lowtide.emulator.vllm_metrics_export import VllmMetricsExporter

log = logging.getLogger("lowtide.emulator")
_Req = TypeVar("_Req", bound=BaseModel)


class _Driver:
    """Advances the engine to the end of each step, in real time, and wakes up early when kicked."""

    def __init__(self, engine: EngineLike, clock: Callable[[], float]) -> None:
        self.engine = engine
        self.clock = clock
        self._kick = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def kick(self) -> None:
        self._kick.set()

    async def run(self) -> None:
        try:
            await self._loop()
        except Exception:
            log.exception("the engine loop failed; aborting every request")
            try:
                self.engine.abort_all()  # release the handlers waiting for tokens
            except Exception:
                log.exception("could not abort the requests in flight")
            raise

    async def _loop(self) -> None:
        engine = self.engine
        while True:
            engine.advance(self.clock())
            self._kick.clear()
            next_at = engine.next_event_at()
            if next_at is None:
                await self._kick.wait()
                continue
            delay = next_at - self.clock()
            if delay <= 0:
                await asyncio.sleep(0)  # behind: catch up, but let the handlers run
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._kick.wait()


class _Waiter:
    """The engine's listener for one request: an event a handler waits on."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __call__(self, _request: EngineRequest) -> None:
        self.event.set()

    async def next(self) -> None:
        await self.event.wait()
        self.event.clear()


class Emulator:
    """One emulated replica: the engine, its metrics and the ASGI app serving them."""

    def __init__(
        self,
        config: EngineConfig,
        model: str,
        *,
        metrics_version: MetricsVersion = "v1",
        clock: Callable[[], float] = time.monotonic,
        dev_mode: bool = False,
        data_parallel_size: int = 1,
    ) -> None:
        self.config = config
        self.model = model
        self.clock = clock
        self.dev_mode = dev_mode
        self.created = int(time.time())
        self._state_changed = asyncio.Event()
        self.engine: EngineLike = EngineGroup(
            config, clock, data_parallel_size, on_state_change=self._on_state_change
        )
        self.exporter = VllmMetricsExporter(self.engine, model, metrics_version)
        self.driver = _Driver(self.engine, clock)
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        if dev_mode:
            routes += [
                Route("/sleep", self.sleep, methods=["POST"]),
                Route("/wake_up", self.wake_up, methods=["POST"]),
                Route("/is_sleeping", self.is_sleeping, methods=["GET"]),
                Route("/collective_rpc", self.collective_rpc, methods=["POST"]),
                Route("/server_info", self.server_info, methods=["GET"]),
                *(
                    Route(path, self.reset_cache, methods=["POST"])
                    for path in ("/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache")
                ),
            ]
        self.app = Starlette(routes=routes, lifespan=self._lifespan)

    def end_in_flight(self) -> None:
        """Abort every running and waiting request (shutdown)."""
        aborted = self.engine.abort_all()
        self.driver.kick()
        if aborted:
            log.info("shutdown: aborted %d request(s) still in flight", aborted)

    def _on_state_change(self, state: EngineState) -> None:
        log.info("engine %s", state.value)
        self._state_changed.set()
        self._state_changed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        self.driver.task = asyncio.create_task(self.driver.run(), name="emulator-engine")
        log.info(
            "emulating vLLM for %s: %s; ready in %.1f s",
            self.model,
            self.config,
            max(0.0, self.engine.ready_at - self.clock()),
        )
        try:
            yield
        finally:
            self.end_in_flight()
            self.driver.task.cancel()
            await asyncio.gather(self.driver.task, return_exceptions=True)

    # -- helpers ---------------------------------------------------------------------------------

    @staticmethod
    def _error(
        status: int, message: str, param: str | None = None, retry_after: float | None = None
    ) -> Response:
        headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
        return JSONResponse(oai.error_body(status, message, param), status_code=status, headers=headers)

    def _unavailable(self, exc: EngineUnavailable) -> Response:
        now = self.clock()
        retry_after: float | None = None
        if exc.state is EngineState.STARTING:
            retry_after = self.engine.ready_at - now
        elif exc.state is EngineState.WAKING and self.engine.awake_at is not None:
            retry_after = self.engine.awake_at - now
        return self._error(503, f"{exc}; try again later", retry_after=retry_after)

    def _engine_failed(self) -> bool:
        task = self.driver.task
        return task is not None and task.done() and not task.cancelled() and task.exception() is not None

    async def _parse(self, request: Request, shape: type[_Req]) -> _Req | Response:
        raw = await request.body()
        try:
            json.loads(raw)
        except ValueError as exc:
            return self._error(400, f"the body is not valid JSON: {exc}")
        try:
            return shape.model_validate_json(raw)
        except ValidationError as exc:
            message, param = oai.describe_validation_error(exc)
            return self._error(400, message, param)

    # -- routes ----------------------------------------------------------------------------------

    async def health(self, _request: Request) -> Response:
        if self._engine_failed():
            return self._error(500, "the engine loop failed")
        state = self.engine.state
        if state is EngineState.STARTING:
            return self._error(503, "the engine is starting", retry_after=self.engine.ready_at - self.clock())
        return Response(status_code=200)

    async def models(self, _request: Request) -> Response:
        card = {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": self.config.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics(self, _request: Request) -> Response:
        self.engine.advance()
        return Response(self.exporter.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    async def is_sleeping(self, _request: Request) -> Response:
        return JSONResponse({"is_sleeping": self.engine.is_sleeping})

    async def sleep(self, request: Request) -> Response:
        # vLLM reads only the query (``level``: int 0..2, ``mode``: PauseMode); a body is ignored.
        try:
            level = int(request.query_params.get("level", "1"))
        except ValueError:
            return self._error(400, "level must be an integer", "level")
        if level not in (0, 1, 2):
            return self._error(400, "level must be 0, 1 or 2", "level")
        mode = request.query_params.get("mode", "abort")
        if mode not in SLEEP_MODES:
            return self._error(400, f"mode must be one of {', '.join(SLEEP_MODES)}", "mode")
        try:
            state = self.engine.sleep(level, mode)
        except EngineUnavailable as exc:
            return self._unavailable(exc)
        except ValueError as exc:
            return self._error(400, str(exc), "level")
        self.driver.kick()
        while state is EngineState.DRAINING:
            await self._state_changed.wait()
            state = self.engine.state
        return JSONResponse({"status": "sleeping", "level": level})

    async def wake_up(self, request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        try:
            back_at = self.engine.wake_up(tags)
        except EngineUnavailable as exc:
            return self._unavailable(exc)
        except ValueError as exc:
            return self._error(400, str(exc), "tags")
        self.driver.kick()
        # Until the clock has reached the wake's end: an event loop's timer may fire a little early
        # (uvloop keeps timers in whole milliseconds), and then the engine would still be waking.
        for _ in range(3):  # a timer early twice in a row would be odd; three is plenty
            delay = back_at - self.clock()
            if delay <= 0:
                break
            await asyncio.sleep(delay + 0.001)
        self.engine.advance()
        self.driver.kick()
        status = "sleeping" if self.engine.is_sleeping else "awake"
        return JSONResponse({"status": status, "tags_woken": tags})

    async def collective_rpc(self, request: Request) -> Response:
        # vLLM (vllm/entrypoints/serve/dev/rpc/api_router.py): a JSON body naming `method`, else 400;
        # the emulator has no workers, so the call is logged (a level-2 wake's `reload_weights`
        # shows in the replica's log) and answers one empty result.
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError as exc:
            return self._error(400, f"JSON decode error: {exc}", None)
        method = body.get("method") if isinstance(body, dict) else None
        if method is None:
            return self._error(400, "Missing 'method' in request body", "method")
        log.info("collective_rpc %s (level of the last sleep: %s)", method, self.engine.sleep_level)
        return JSONResponse({"results": [None]})

    async def reset_cache(self, _request: Request) -> Response:
        return Response(status_code=200)

    async def server_info(self, _request: Request) -> Response:
        return JSONResponse({"vllm_config": f"emulated: {self.config}"})

    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, oai.CompletionRequest)
        if isinstance(body, Response):
            return body
        try:
            prompt_tokens = oai.completion_prompt_tokens(body)
        except oai.BadRequest as exc:
            return self._error(400, str(exc), exc.param)
        return await self._generate(request, body, prompt_tokens, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request, oai.ChatCompletionRequest)
        if isinstance(body, Response):
            return body
        return await self._generate(request, body, oai.chat_prompt_tokens(body), chat=True)

    async def _generate(
        self,
        request: Request,
        body: oai.CompletionRequest | oai.ChatCompletionRequest,
        prompt_tokens: int,
        *,
        chat: bool,
    ) -> Response:
        if self._engine_failed():
            return self._error(500, "the engine loop failed")
        if body.model is not None and body.model != self.model:
            return self._error(404, f"The model `{body.model}` does not exist.", "model")
        waiter = _Waiter()
        try:
            seq = self.engine.submit(
                prompt_tokens,
                oai.completion_max_tokens(body),
                output_tokens=body.output_tokens,
                listener=waiter,
            )
        except EngineUnavailable as exc:
            return self._unavailable(exc)
        except RequestRejected as exc:
            return self._error(400, str(exc), "max_tokens")
        self.driver.kick()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._stream(seq, waiter, rid, chat=chat, include_usage=include_usage)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            if not await self._finished_before_disconnect(seq, waiter, request):
                self._abort(seq)  # the client went away, as vLLM does
                return Response(status_code=499)  # nobody reads it
        except asyncio.CancelledError:
            self._abort(seq)
            raise
        if seq.finish_reason == "abort":
            return self._error(
                503, "the request was aborted: the engine was put to sleep or is shutting down"
            )
        build = oai.chat_body if chat else oai.completion_body
        text = oai.text_for(0, seq.generated)
        return JSONResponse(
            build(
                rid, self.created, self.model, text, str(seq.finish_reason), seq.prompt_tokens, seq.generated
            )
        )

    @staticmethod
    async def _finished_before_disconnect(seq: EngineRequest, waiter: _Waiter, request: Request) -> bool:
        """Wait for the request to finish; False if the client disconnected first."""

        async def finished() -> None:
            while not seq.finished:
                await waiter.next()

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        done = asyncio.create_task(finished())
        gone = asyncio.create_task(disconnected())
        try:
            await asyncio.wait((done, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (done, gone):
                task.cancel()
            await asyncio.gather(done, gone, return_exceptions=True)
        return seq.finished

    def _abort(self, seq: EngineRequest) -> None:
        if not seq.finished:
            self.engine.abort(seq)
            self.driver.kick()

    async def _stream(
        self, seq: EngineRequest, waiter: _Waiter, rid: str, *, chat: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        sent = 0
        try:
            while True:
                await waiter.next()
                new = seq.generated - sent
                if new <= 0 and not seq.finished:
                    continue
                text = oai.text_for(sent, seq.generated)
                reason = seq.finish_reason
                if chat:
                    if sent == 0 and new > 0:
                        yield _sse(
                            oai.chat_chunk(
                                rid, self.created, self.model, {"role": "assistant", "content": ""}, None
                            )
                        )
                    delta = {"content": text} if text else {}
                    yield _sse(oai.chat_chunk(rid, self.created, self.model, delta, reason))
                else:
                    yield _sse(oai.completion_chunk(rid, self.created, self.model, text, reason))
                sent = seq.generated
                if seq.finished:
                    break
            if include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield _sse(
                    oai.usage_chunk(rid, self.created, self.model, obj, seq.prompt_tokens, seq.generated)
                )
            yield "data: [DONE]\n\n"
        finally:
            self._abort(seq)  # the client went away mid-stream


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def create_app(config: EngineConfig, model: str, **options: Any) -> Starlette:
    """The ASGI app of one emulated replica (see `Emulator` for the options)."""
    return Emulator(config, model, **options).app


class _Server(uvicorn.Server):
    """uvicorn, plus: once shutdown begins, in-flight requests get `grace_s` and are then aborted
    (streams end with ``finish_reason: abort``), so that no handler is cancelled mid-response."""

    def __init__(self, config: uvicorn.Config, emulator: Emulator, grace_s: float) -> None:
        super().__init__(config)
        self._emulator = emulator
        self._grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().call_later(self._grace_s, self._emulator.end_in_flight)
        await super().shutdown(sockets=sockets)


def dev_mode_from_env() -> bool:
    """vLLM's ``VLLM_SERVER_DEV_MODE`` (vllm/envs.py: ``bool(int(os.getenv(..., "0")))``)."""
    try:
        return bool(int(os.environ.get("VLLM_SERVER_DEV_MODE", "0")))
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind without listening, as vLLM's ``create_server_socket`` does (connections are refused
    until uvicorn listens on it): "" and "0.0.0.0" are every IPv4 interface."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family=family, type=socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve(
    config: EngineConfig,
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    metrics_version: MetricsVersion = "v1",
    log_level: str = "info",
    access_log: bool = True,
    shutdown_grace_s: float = 5.0,
    dev_mode: bool | None = None,
    data_parallel_size: int = 1,
) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully and return. `dev_mode` None: from
    ``VLLM_SERVER_DEV_MODE``."""
    dev = dev_mode_from_env() if dev_mode is None else dev_mode
    if dev:
        log.warning("SECURITY WARNING: Development endpoints are enabled (VLLM_SERVER_DEV_MODE=1)")
    try:
        sock = bind_socket(host, port)
    except OSError as exc:
        log.error("cannot bind %s:%d: %s", host, port, exc.strerror or exc)
        raise SystemExit(1) from exc
    emulator = Emulator(
        config, model, metrics_version=metrics_version, dev_mode=dev, data_parallel_size=data_parallel_size
    )
    received: list[int] = []

    def _note(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, _note) for sig in (signal.SIGINT, signal.SIGTERM)}
    # The cold start: bound, not listening (connection refused), as vLLM while it loads.
    log.info(
        "loading (emulated): %s:%d bound, connections refused for %.1f s",
        host or "0.0.0.0",  # noqa: S104 (a log line)
        port,
        max(0.0, emulator.engine.ready_at - emulator.clock()),
    )
    while not received and emulator.clock() < emulator.engine.ready_at:
        time.sleep(min(0.05, max(0.0, emulator.engine.ready_at - emulator.clock())))
    if received:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
        log.info("stopped by %s during the cold start", signal.Signals(received[0]).name)
        return
    uvicorn_config = uvicorn.Config(
        emulator.app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=math.ceil(shutdown_grace_s) + 5,  # a backstop: we end requests first
        lifespan="on",
    )
    server = _Server(uvicorn_config, emulator, shutdown_grace_s)
    # uvicorn handles SIGINT/SIGTERM, shuts down, restores the previous handlers and raises the
    # signal again: with `_note` as the previous handlers, the process then exits normally (0).
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        log.info("stopped by %s", signal.Signals(received[0]).name)
