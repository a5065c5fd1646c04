"""The two `MetricsSource`s (control/inference_ports.py): direct scrape, or PromQL via Prometheus.

`ScrapeSource` GETs every replica's ``/metrics`` concurrently, reads each text with
`adapters.vllm_metrics`, keeps a bounded window of readings per replica and turns it into
signals with `policy.signals`. `PromQLSource` asks a Prometheus server that already scrapes the
replicas (its queries are listed in its docstring). A service picks one in its config (wiring).

Both are called synchronously from the control loop's thread and never raise: a replica that
cannot be read becomes a stale signal with the reason (timeout, connection refused, HTTP status,
unparsable text, Prometheus's ``up == 0``...), a source that fails as a whole (Prometheus down,
a query error) sets ``source_error`` and marks every replica stale. Nothing here decides anything
about load. Must not: block the caller longer than about the configured timeout per collect, or
keep state for replicas that are no longer listed.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import threading
from collections import deque
from collections.abc import Coroutine, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

from lowtide.adapters.vllm_metrics import ParseCache, failed_scrape, parse_vllm_metrics, sleep_state_of
from lowtide.domain.metrics import ReplicaScrape, ReplicaSignals, ServiceSignals, SleepState
from lowtide.policy.signals import replica_signals, stale_signals

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_BODY_BYTES = 32 * 1024 * 1024  # a vLLM /metrics is ~100 KiB; far beyond this is not metrics
MAX_READINGS = 2048  # per replica, on top of the time-based retention


def _source_failed(service: str, replicas: Iterable[str], now: float, error: str) -> ServiceSignals:
    reason = f"metrics source failed: {error}"
    return ServiceSignals(
        service=service,
        at=now,
        replicas=tuple(stale_signals(r, now, reason) for r in replicas),
        source_error=error,
    )


# -- direct scrape --------------------------------------------------------------------------------


class ScrapeSource:
    """Scrape each replica's ``{url}/metrics`` concurrently (httpx, asyncio in a private thread).

    Every reading of a collect is stamped with the caller's `now`. Per replica the source keeps
    readings for ``max(window_s, frozen_after_s) + stale_after_s`` seconds (and at most
    `MAX_READINGS`), which `policy.signals.replica_signals` needs for rates, quantiles, staleness
    and frozen-gauge detection. Each request has a hard deadline of `timeout_s` (connect, headers
    and body together); at most `max_concurrency` run at once. Failures are classified as
    ``timeout after Ns``, ``connection refused``, ``cannot connect: ...``, ``HTTP 503 ...``,
    ``body larger than N bytes`` or the parser's ``unparsable at line N: ...``.
    `last_scrapes` holds each replica's newest reading (with its ``problems``) for inspection.
    """

    def __init__(
        self,
        timeout_s: float = 2.0,
        window_s: float = 60.0,
        stale_after_s: float = 30.0,
        frozen_after_s: float = 120.0,
        max_concurrency: int = 32,
        *,
        cache: ParseCache | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.window_s = window_s
        self.stale_after_s = stale_after_s
        self.frozen_after_s = frozen_after_s
        self.max_concurrency = max(1, max_concurrency)
        self.retention_s = max(window_s, frozen_after_s) + stale_after_s
        self.cache = cache if cache is not None else ParseCache()
        self.last_scrapes: dict[tuple[str, str], ReplicaScrape] = {}
        self._windows: dict[tuple[str, str], deque[ReplicaScrape]] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._client: httpx.AsyncClient | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="lowtide-scrape", daemon=True)
        self._thread.start()
        self._closed = False

    def collect(self, service: str, replicas: Mapping[str, str], now: float) -> ServiceSignals:
        try:
            with self._lock:
                if self._closed:
                    return _source_failed(service, replicas, now, "scrape source is closed")
                readings = self._run(self._scrape_all(dict(replicas), now))
                signals = []
                for rid in replicas:
                    key = (service, rid)
                    window = self._windows.setdefault(key, deque(maxlen=MAX_READINGS))
                    window.append(readings[rid])
                    self.last_scrapes[key] = readings[rid]
                    horizon = now - self.retention_s
                    while window and window[0].at < horizon:
                        window.popleft()
                    signals.append(
                        replica_signals(
                            rid,
                            window,
                            now=now,
                            window_s=self.window_s,
                            stale_after_s=self.stale_after_s,
                            frozen_after_s=self.frozen_after_s,
                        )
                    )
                for key in [k for k in self._windows if k[0] == service and k[1] not in replicas]:
                    del self._windows[key]
                    self.last_scrapes.pop(key, None)
                return ServiceSignals(service=service, at=now, replicas=tuple(signals))
        except Exception as exc:  # never raise into the control loop
            log.exception("scrape source failed for service %s", service)
            return _source_failed(service, replicas, now, f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._client is not None:
                try:
                    self._run(self._client.aclose())
                except Exception:  # closing is best effort
                    log.debug("closing the scrape client failed", exc_info=True)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()

    # -- internals -------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _scrape_all(self, replicas: dict[str, str], now: float) -> dict[str, ReplicaScrape]:
        if self._client is None:
            # Made on the loop's thread; the hard deadline is wait_for's, httpx's is a backstop.
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s + 1.0),
                limits=httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=256),
                follow_redirects=False,
                trust_env=False,
            )
        client = self._client
        gate = asyncio.Semaphore(self.max_concurrency)

        async def one(url: str) -> ReplicaScrape:
            async with gate:
                return await self._scrape(client, url, now)

        results = await asyncio.gather(*(one(url) for url in replicas.values()))
        return dict(zip(replicas, results, strict=True))

    async def _scrape(self, client: httpx.AsyncClient, base_url: str, now: float) -> ReplicaScrape:
        url = base_url.rstrip("/") + "/metrics"
        try:
            status, reason, body = await asyncio.wait_for(self._fetch(client, url), self.timeout_s)
        except (TimeoutError, httpx.TimeoutException):
            return failed_scrape(now, f"timeout after {self.timeout_s:g}s ({url})")
        except httpx.ConnectError as exc:
            if _refused(exc):
                return failed_scrape(now, f"connection refused ({url})")
            return failed_scrape(now, f"cannot connect: {exc or type(exc).__name__} ({url})")
        except _TooLarge:
            return failed_scrape(now, f"body larger than {MAX_BODY_BYTES} bytes ({url})")
        except httpx.HTTPError as exc:
            return failed_scrape(now, f"HTTP error: {type(exc).__name__}: {exc} ({url})")
        except Exception as exc:  # an invalid URL and the like
            return failed_scrape(now, f"cannot scrape: {type(exc).__name__}: {exc} ({url})")
        if status != 200:
            return failed_scrape(now, f"HTTP {status} {reason} ({url})".replace("  ", " "))
        text = body.decode("utf-8", errors="replace")
        return parse_vllm_metrics(text, at=now, cache=self.cache)

    @staticmethod
    async def _fetch(client: httpx.AsyncClient, url: str) -> tuple[int, str, bytes]:
        async with client.stream("GET", url, headers={"Accept": "text/plain"}) as response:
            if response.status_code != 200:
                return response.status_code, response.reason_phrase, b""
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise _TooLarge
                chunks.append(chunk)
            return response.status_code, response.reason_phrase, b"".join(chunks)


class _TooLarge(Exception):
    pass


def _refused(exc: BaseException) -> bool:
    """Whether a connect error is, somewhere down its chain, a refused connection."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ConnectionRefusedError) or "refused" in str(current).lower():
            return True
        if isinstance(current, OSError) and current.errno == errno.ECONNREFUSED:
            return True
        current = current.__cause__ or current.__context__
    return False


# -- PromQL ---------------------------------------------------------------------------------------


class PromQLError(Exception):
    """A query that did not give a vector (Prometheus down, HTTP error, ``status: error``)."""


@dataclass(frozen=True, slots=True)
class _Series:
    labels: dict[str, str]
    at: float  # evaluation time (Prometheus's clock)
    value: float


def _duration(seconds: float) -> str:
    return f"{int(seconds)}s" if float(seconds).is_integer() else f"{round(seconds * 1000)}ms"


def instance_of(url: str) -> str:
    """A replica URL's ``host:port``, which is the ``instance`` label Prometheus gives its target."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"{host}:{port}"


def _regex_alternation(values: Iterable[str]) -> str:
    """An RE2 alternation matching exactly these strings, as a PromQL string literal's content."""
    special = set(r"\.+*?()|[]{}^$")
    escaped = ["".join("\\" + c if c in special else c for c in v) for v in sorted(set(values))]
    return "|".join(escaped).replace("\\", "\\\\").replace('"', '\\"')


class PromQLSource:
    """Signals from a Prometheus server's HTTP API (``GET /api/v1/query``, instant queries at
    Prometheus's own time). With ``S`` = ``<selector>,instance=~"<the replicas' host:port>"`` and
    ``W`` = `window_s`, each collect runs these queries concurrently::

        up{S}                                   scrape health per target (0: Prometheus failed)
        timestamp(up{S})                        when Prometheus last scraped it (freshness)
        sum by (instance) (vllm:num_requests_running{S})            running
        sum by (instance) (vllm:num_requests_waiting{S})            waiting
        avg by (instance) (vllm:kv_cache_usage_perc{S})
          or avg by (instance) (vllm:gpu_cache_usage_perc{S})       KV usage (V1 | V0 name)
        vllm:cache_config_info{S}               KV capacity: Σ num_gpu_blocks × block_size labels
        sum by (instance) (rate(vllm:prompt_tokens_total{S}[W]))     prompt tokens/s
        sum by (instance) (rate(vllm:generation_tokens_total{S}[W])) generation tokens/s
        sum by (instance) (rate(vllm:request_success_total{S}[W]))   requests/s
        histogram_quantile(q, sum by (instance, le)
          (rate(vllm:time_to_first_token_seconds_bucket{S}[W])))     TTFT, q = 0.5, 0.9, 0.99
        histogram_quantile(q, sum by (instance, le)
          (rate(vllm:e2e_request_latency_seconds_bucket{S}[W])))     e2e, q = 0.5, 0.9, 0.99
        sum by (instance) (vllm:num_requests_waiting_by_reason{S,reason="capacity"})
                                                waiting for capacity (newer vLLM)
        sum by (instance) (vllm:num_requests_waiting_by_reason{S,reason="deferred"})
                                                deferred
        sum by (instance) (rate(vllm:num_preemptions_total{S}[W]))   preemptions/s
        vllm:engine_sleep_state{S}              sleep state (`vllm_metrics.sleep_state_of`
                                                over each instance's engines)

    The last four are what the scrape source reads too (`adapters.vllm_metrics` cites vLLM for
    them); an older vLLM without them leaves them unknown.

    A replica is stale when its target is missing (``up`` has no series), down (``up == 0``) or
    last scraped more than `stale_after_s` before Prometheus's now; ``stale_since`` is when this
    source first saw it so (or, for age, when it got too old). A query without a series for a
    replica leaves that signal unknown (None; NaN answers, e.g. a quantile without observations,
    too). Several series for one instance where one is expected are summed (``up``: the lowest
    wins) and noted in `last_problems`. Any failed query (Prometheus unreachable, timeout, HTTP
    error, ``status: error``) fails the collect: ``source_error`` and every replica stale.
    Frozen-gauge detection is the scrape source's; this one trusts Prometheus's freshness.
    """

    def __init__(
        self,
        base_url: str,
        selector: str = 'job="vllm"',
        window_s: float = 60.0,
        stale_after_s: float = 30.0,
        timeout_s: float = 5.0,
        *,
        max_concurrency: int = 8,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.selector = selector.strip().strip("{}").strip().rstrip(",")
        self.window_s = window_s
        self.stale_after_s = stale_after_s
        self.timeout_s = timeout_s
        self.last_problems: tuple[str, ...] = ()
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout_s, trust_env=False)
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, max_concurrency), thread_name_prefix="lowtide-promql"
        )
        self._stale_since: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def queries(self, instances: Iterable[str]) -> dict[str, str]:
        """The PromQL of one collect, by signal name (see the class docstring)."""
        sel = f'{self.selector},instance=~"{_regex_alternation(instances)}"'.lstrip(",")
        w = _duration(self.window_s)

        def quantile(q: float, family: str) -> str:
            return f"histogram_quantile({q}, sum by (instance, le) (rate({family}_bucket{{{sel}}}[{w}])))"

        queries = {
            "up": f"up{{{sel}}}",
            "scraped_at": f"timestamp(up{{{sel}}})",
            "running": f"sum by (instance) (vllm:num_requests_running{{{sel}}})",
            "waiting": f"sum by (instance) (vllm:num_requests_waiting{{{sel}}})",
            "kv_usage": (
                f"avg by (instance) (vllm:kv_cache_usage_perc{{{sel}}})"
                f" or avg by (instance) (vllm:gpu_cache_usage_perc{{{sel}}})"
            ),
            "cache_info": f"vllm:cache_config_info{{{sel}}}",
            "prompt_tokens_per_s": f"sum by (instance) (rate(vllm:prompt_tokens_total{{{sel}}}[{w}]))",
            "generation_tokens_per_s": (
                f"sum by (instance) (rate(vllm:generation_tokens_total{{{sel}}}[{w}]))"
            ),
            "requests_per_s": f"sum by (instance) (rate(vllm:request_success_total{{{sel}}}[{w}]))",
            "waiting_capacity": (
                f'sum by (instance) (vllm:num_requests_waiting_by_reason{{{sel},reason="capacity"}})'
            ),
            "waiting_deferred": (
                f'sum by (instance) (vllm:num_requests_waiting_by_reason{{{sel},reason="deferred"}})'
            ),
            "preemptions_per_s": f"sum by (instance) (rate(vllm:num_preemptions_total{{{sel}}}[{w}]))",
            "sleep_state": f"vllm:engine_sleep_state{{{sel}}}",
        }
        for name, family in (
            ("ttft", "vllm:time_to_first_token_seconds"),
            ("e2e", "vllm:e2e_request_latency_seconds"),
        ):
            for q in (0.5, 0.9, 0.99):
                queries[f"{name}_p{round(q * 100)}"] = quantile(q, family)
        return queries

    def collect(self, service: str, replicas: Mapping[str, str], now: float) -> ServiceSignals:
        try:
            with self._lock:
                return self._collect(service, replicas, now)
        except Exception as exc:  # never raise into the control loop
            log.exception("PromQL source failed for service %s", service)
            return _source_failed(service, replicas, now, f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    # -- internals -------------------------------------------------------------------------

    def _collect(self, service: str, replicas: Mapping[str, str], now: float) -> ServiceSignals:
        for key in [k for k in self._stale_since if k[0] == service and k[1] not in replicas]:
            del self._stale_since[key]
        if not replicas:
            self.last_problems = ()
            return ServiceSignals(service=service, at=now)
        instances = {rid: instance_of(url) for rid, url in replicas.items()}
        queries = self.queries(instances.values())
        futures = {name: self._pool.submit(self._query, expr) for name, expr in queries.items()}
        results: dict[str, list[_Series]] = {}
        errors: list[str] = []
        for name, future in futures.items():
            try:
                results[name] = future.result()
            except PromQLError as exc:
                errors.append(f"{name}: {exc}")
        if errors:
            self.last_problems = tuple(errors)
            for rid in replicas:
                self._stale_since.setdefault((service, rid), now)
            error = (
                errors[0] if len(errors) == 1 else f"{errors[0]} (and {len(errors) - 1} more failed queries)"
            )
            return ServiceSignals(
                service=service,
                at=now,
                replicas=tuple(
                    stale_signals(
                        rid, now, f"metrics source failed: {error}", self._stale_since[(service, rid)]
                    )
                    for rid in replicas
                ),
                source_error=error,
            )
        problems: list[str] = []
        single = {
            name: _by_instance(name, series, problems, combine=min if name in ("up", "scraped_at") else _fsum)
            for name, series in results.items()
            if name not in ("cache_info", "sleep_state")
        }
        capacity = _capacity_by_instance(results["cache_info"], problems)
        sleep = _sleep_by_instance(results["sleep_state"])
        signals = [
            self._replica(service, rid, inst, single, capacity.get(inst), now, sleep.get(inst))
            for rid, inst in instances.items()
        ]
        self.last_problems = tuple(problems)
        for p in problems:
            log.info("PromQL source, service %s: %s", service, p)
        return ServiceSignals(service=service, at=now, replicas=tuple(signals))

    def _replica(
        self,
        service: str,
        rid: str,
        inst: str,
        values: dict[str, dict[str, tuple[float, float]]],
        capacity: float | None,
        now: float,
        sleep_state: SleepState | None = None,
    ) -> ReplicaSignals:
        def get(name: str) -> float | None:
            found = values[name].get(inst)
            if found is None or math.isnan(found[1]):
                return None
            return found[1]

        key = (service, rid)
        up = values["up"].get(inst)
        scraped = values["scraped_at"].get(inst)
        reason = ""
        since: float | None = None
        if up is None:
            reason = f"Prometheus has no target for {inst} ({{{self.selector}}})"
        elif up[1] != 1:
            reason = f"Prometheus could not scrape {inst} (up={up[1]:g})"
        elif scraped is not None and scraped[0] - scraped[1] > self.stale_after_s:
            age = scraped[0] - scraped[1]
            reason = f"Prometheus last scraped {inst} {age:.0f}s ago (limit {self.stale_after_s:g}s)"
            since = now - (age - self.stale_after_s)
        if reason:
            since = self._stale_since.setdefault(key, since if since is not None else now)
        else:
            self._stale_since.pop(key, None)
        kv = get("kv_usage")
        return ReplicaSignals(
            replica=rid,
            at=now,
            running=get("running"),
            waiting=get("waiting"),
            kv_usage=kv,
            kv_tokens_used=kv * capacity if kv is not None and capacity is not None else None,
            prompt_tokens_per_s=get("prompt_tokens_per_s"),
            generation_tokens_per_s=get("generation_tokens_per_s"),
            requests_per_s=get("requests_per_s"),
            ttft_p50_s=get("ttft_p50"),
            ttft_p90_s=get("ttft_p90"),
            ttft_p99_s=get("ttft_p99"),
            e2e_p50_s=get("e2e_p50"),
            e2e_p90_s=get("e2e_p90"),
            e2e_p99_s=get("e2e_p99"),
            waiting_capacity=get("waiting_capacity"),
            waiting_deferred=get("waiting_deferred"),
            preemptions_per_s=get("preemptions_per_s"),
            sleep_state=sleep_state,
            stale=bool(reason),
            stale_reason=reason,
            stale_since=since if reason else None,
        )

    def _query(self, expr: str) -> list[_Series]:
        try:
            response = self._client.get("/api/v1/query", params={"query": expr})
        except httpx.TimeoutException as exc:
            raise PromQLError(f"Prometheus at {self.base_url} timed out after {self.timeout_s:g}s") from exc
        except httpx.HTTPError as exc:
            raise PromQLError(
                f"Prometheus at {self.base_url} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise PromQLError(
                f"Prometheus at {self.base_url} answered HTTP {response.status_code} without JSON"
            )
        if body.get("status") != "success":
            raise PromQLError(
                f"Prometheus HTTP {response.status_code}: {body.get('errorType', 'error')}: "
                f"{body.get('error', 'no error message')}"
            )
        data = body.get("data") or {}
        if data.get("resultType") != "vector":
            raise PromQLError(f"expected a vector, Prometheus gave {data.get('resultType')!r}")
        series = []
        for item in data.get("result") or []:
            try:
                at, raw = item["value"]
                series.append(_Series(labels=dict(item.get("metric") or {}), at=float(at), value=float(raw)))
            except (KeyError, TypeError, ValueError) as exc:
                raise PromQLError(f"malformed sample in Prometheus's answer: {item!r}") from exc
        return series


def _fsum(values: Iterable[float]) -> float:
    return math.fsum(values)


def _by_instance(
    name: str, series: list[_Series], problems: list[str], combine: Any
) -> dict[str, tuple[float, float]]:
    """instance -> (evaluation time, value); several series for one instance are combined."""
    grouped: dict[str, list[_Series]] = {}
    for s in series:
        grouped.setdefault(s.labels.get("instance", ""), []).append(s)
    out: dict[str, tuple[float, float]] = {}
    for inst, group in grouped.items():
        if len(group) > 1:
            how = "lowest taken" if combine is min else "summed"
            problems.append(f"{name}: {len(group)} series for instance {inst!r}, {how}")
        out[inst] = (group[0].at, combine(s.value for s in group))
    return out


def _sleep_by_instance(series: list[_Series]) -> dict[str, SleepState | None]:
    """instance -> its sleep state from the raw ``vllm:engine_sleep_state`` series (one per engine
    and ``sleep_state`` label), read as the scrape source reads them."""
    sums: dict[str, dict[str, float]] = {}
    engines: dict[str, int] = {}
    nan: set[str] = set()
    for s in series:
        inst = s.labels.get("instance", "")
        state = s.labels.get("sleep_state", "")
        if math.isnan(s.value):
            nan.add(inst)
        per = sums.setdefault(inst, {})
        per[state] = per.get(state, 0.0) + s.value
        if state == "awake":
            engines[inst] = engines.get(inst, 0) + 1
    return {
        inst: None
        if inst in nan
        else sleep_state_of(
            per.get("awake"), per.get("weights_offloaded"), per.get("discard_all"), engines.get(inst, 0)
        )
        for inst, per in sums.items()
    }


def _capacity_by_instance(series: list[_Series], problems: list[str]) -> dict[str, float]:
    """instance -> Σ num_gpu_blocks × block_size over its cache_config_info series (one per engine)."""
    out: dict[str, float] = {}
    bad: set[str] = set()
    for s in series:
        inst = s.labels.get("instance", "")
        try:
            tokens = int(s.labels["num_gpu_blocks"]) * int(s.labels["block_size"])
        except (KeyError, ValueError):
            problems.append(f"cache_info: no numeric num_gpu_blocks and block_size for {inst!r}")
            bad.add(inst)
            continue
        out[inst] = out.get(inst, 0.0) + tokens
    for inst in bad:
        out.pop(inst, None)
    return out
