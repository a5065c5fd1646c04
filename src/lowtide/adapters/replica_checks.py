"""Replica checks: the HTTP requests that tell the local service manager what a replica is doing.

Role: `Checker` runs every HTTP check of `adapters.local_services` on one background daemon thread
with an asyncio loop (`httpx.AsyncClient`, no proxies from the environment, no keep-alive, one
timeout per request). `submit` returns a `concurrent.futures.Future` at once, so the control loop
never blocks on a replica; a hanging request holds no thread; `close` cancels what is in flight.
A check (`ProbeKind`) is one or a few requests to vLLM's endpoints (``/health``, ``POST /sleep``,
``POST /wake_up``, ``/is_sleeping``; after a level-2 sleep the wake also reloads the weights
through ``POST /collective_rpc``), and its `Answer` says what came back, or why nothing did.
A sleep is confirmed twice: ``/is_sleeping`` true, and, where the server exports it (vLLM's V1
``vllm:engine_sleep_state`` gauge, vllm/v1/metrics/loggers.py, 0.11+ and the 0.33 line checked in
docs/vllm.md), no engine with ``sleep_state="awake"`` at 1; a server without the family is
trusted on ``/is_sleeping`` alone.

Neighbours: `adapters.local_services` (the only user) decides which check a phase needs and what an
answer means; `tests/fixtures/fake_vllm.py` and `emulator` answer the same endpoints.

Must not: touch manager or replica state (the check thread only runs HTTP), decide anything from
an answer, retry, or raise from a check (every failure becomes an `Answer` with an `error`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

import httpx

log = logging.getLogger(__name__)

CHECK_THREAD_NAME = "lowtide-replica-checks"

ProbeKind = Literal["health", "state", "sleep", "is_sleeping", "wake", "awake"]


@dataclass(frozen=True, slots=True)
class Answer:
    """The outcome of one background check (one or two HTTP requests)."""

    status: int | None = None  # HTTP status of the first request; None: no answer
    sleeping: bool | None = None  # from /is_sleeping; None: not asked or not understood
    healthy: bool = False  # /health answered 200
    error: str = ""  # why no answer came
    sent: bool = False  # no answer, but the request reached the server (a read timeout)


# vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 1.0 (label order may vary)
_AWAKE_SERIES = re.compile(r'^vllm:engine_sleep_state\{[^}]*sleep_state="awake"[^}]*\}\s+(\S+)', re.MULTILINE)


def engine_awake(metrics_text: str) -> bool | None:
    """From `/metrics`: True when an engine's ``vllm:engine_sleep_state{sleep_state="awake"}`` is 1,
    False when every such series is 0, None when the server does not export it."""
    values = []
    for match in _AWAKE_SERIES.finditer(metrics_text):
        try:
            values.append(float(match.group(1)))
        except ValueError:
            continue
    if not values:
        return None
    return any(v >= 1 for v in values)


async def _sleep_confirmed(client: httpx.AsyncClient, base: str) -> bool:
    """False only when `/metrics` says an engine is still awake."""
    try:
        response = await client.get(f"{base}/metrics")
    except httpx.HTTPError:
        return True  # /is_sleeping said so; the metrics are only a second opinion
    return response.status_code != 200 or engine_awake(response.text) is not True


def _sleeping_flag(response: httpx.Response) -> bool | None:
    if response.status_code != 200:
        return None
    try:
        value = response.json().get("is_sleeping")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, bool) else None


async def _wake_and_reload(client: httpx.AsyncClient, base: str) -> Answer:
    """Wake from sleep level 2, whose weights were discarded: vLLM's documented sequence
    (vLLM's docs/features/sleep_mode.md, "Sleep level 2", since PR 28357; current tree):
    ``POST /wake_up?tags=weights`` (the weight memory back, contents undefined),
    ``POST /collective_rpc {"method": "reload_weights"}`` (each worker loads them again from
    the model's files: vllm/entrypoints/serve/dev/rpc/api_router.py; the worker's
    `reload_weights` is in current trees only, an older V1 gpu_worker.py read at commit 0012cf69
    lacks it), then ``POST /wake_up?tags=kv_cache``. The first status not 2xx is the answer."""
    steps = (
        ("/wake_up", {"tags": "weights"}, None),
        ("/collective_rpc", None, {"method": "reload_weights"}),
        ("/wake_up", {"tags": "kv_cache"}, None),
    )
    status = 0
    for path, params, body in steps:
        status = (await client.post(f"{base}{path}", params=params, json=body)).status_code
        if not 200 <= status < 300:
            break
    return Answer(status=status)


async def _probe(client: httpx.AsyncClient, base: str, kind: ProbeKind, level: int = 1) -> Answer:
    try:
        if kind == "health":
            return Answer(status=(await client.get(f"{base}/health")).status_code)
        if kind == "sleep":
            answer = await client.post(f"{base}/sleep", params={"level": str(level)})
            return Answer(status=answer.status_code)
        if kind == "wake" and level == 2:
            return await _wake_and_reload(client, base)
        if kind == "wake":
            return Answer(status=(await client.post(f"{base}/wake_up")).status_code)
        response = await client.get(f"{base}/is_sleeping")
        sleeping = _sleeping_flag(response)
        if kind == "is_sleeping" and sleeping and not await _sleep_confirmed(client, base):
            sleeping = None  # not yet: an engine still reports itself awake
        if (
            kind == "is_sleeping"
            or (kind == "state" and sleeping)
            or (kind == "awake" and sleeping is not False)
        ):
            return Answer(status=response.status_code, sleeping=sleeping)
        healthy = (await client.get(f"{base}/health")).status_code == 200
        return Answer(status=response.status_code, sleeping=sleeping, healthy=healthy)
    except httpx.ReadTimeout as exc:
        return Answer(error=f"no answer within the timeout ({type(exc).__name__})", sent=True)
    except httpx.HTTPError as exc:
        return Answer(error=f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # a check must never take the event loop down
        return Answer(error=f"{type(exc).__name__}: {exc}")


class Checker:
    """An asyncio loop on one daemon thread that runs the HTTP checks: submitting one costs
    microseconds (no thread to start), a hanging request holds no thread, and `close` cancels
    whatever is in flight at once."""

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = httpx.AsyncClient(
            timeout=timeout_s,
            trust_env=False,  # never route 127.0.0.1 through a proxy from the environment
            # At most one check per replica is in flight; no keep-alive, so a replica restarted on
            # the same port never gets a request on its predecessor's connection.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
        )
        self._thread = threading.Thread(target=self._run, name=CHECK_THREAD_NAME, daemon=True)
        self._thread.start()
        self._closed = False

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
            self._loop.run_until_complete(self._drain())
        finally:
            self._loop.close()

    async def _drain(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.aclose()

    def submit(self, base: str, kind: ProbeKind, level: int = 1) -> Future[Answer]:
        """`level`: the vLLM sleep level a ``sleep`` check asks for and a ``wake`` check undoes."""
        return asyncio.run_coroutine_threadsafe(_probe(self._client, base, kind, level), self._loop)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():
            log.warning("the replica check thread did not stop within 10 s")


def describe_answer(kind: ProbeKind, answer: Answer) -> str:
    if answer.error:
        return f"{kind} check: {answer.error}"
    parts = [f"{kind} check: HTTP {answer.status}"]
    if answer.sleeping is not None:
        parts.append(f"is_sleeping={str(answer.sleeping).lower()}")
    if kind in ("state", "awake") and answer.sleeping is not True:
        parts.append(f"health {'200' if answer.healthy else 'not 200'}")
    return ", ".join(parts)
