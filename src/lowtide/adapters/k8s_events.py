"""Kubernetes Events (events.k8s.io/v1) for what lowtide does and refuses in a cluster, so that
`kubectl describe pod|deployment|hpa` and `kubectl events` show it (docs/cluster.md "Kubernetes
Events").

Role: `EventRecorder.emit` is called by the Argo executor and the Kubernetes service manager when
they admit, defer, stop or give up on a pod, or scale, refuse, steer or see a replica fail; it
queues the Event and returns. One daemon thread writes them with the real `kubernetes` client
(36.x, `EventsV1Api`) into the namespace of the object each Event regards.

The API (kubernetes commit 111ee70e, staging/src/k8s.io/api/events/v1/types.go; validation in
pkg/apis/core/validation/events.go at commit 04791b49, `ValidateEventCreate`/`legacyValidateEvent`):
`eventTime` (MicroTime) is required, `reportingController` a qualified name, `reportingInstance`
(<= 128), `action` and `reason` (<= 128 each) required, `note` at most 1024 bytes, `type` Normal or
Warning, the deprecated* fields unset; on update everything but `series` (count >= 2 and
`lastObservedTime`) is immutable. Here: `reportingController: lowtide.io/control-plane`,
`reportingInstance` the pod's name ($HOSTNAME) else the host name, `regarding` the pod,
Deployment or autoscaler (with its uid when known), the Event's name `<object name>.<hex
nanoseconds>` (client-go tools/events/recorder.go `makeEvent`). Notes are lowtide's own
sentences with user text in them: control characters are escaped and the note is cut to 1024
bytes on a character boundary.

Semantics follow client-go tools/events/event_broadcaster.go (kubernetes commit 015189e7) where
they matter:
- **Series**: an occurrence isomorphic to a recorded one (same regarding object, type, reason,
  action and note; client-go's key has no note, lowtide's has, so "scaled 1 → 2" and "2 → 3" stay
  apart) is not a new object: the cached Event's `series.count` goes up and its
  `lastObservedTime` moves, and the series is written by a strategic merge PATCH of `series`
  (client-go `createPatchBytesForSeries`); a PATCH answered 404 (the Event expired: the API
  server keeps Events an hour by default) creates it again, series included. A series ends
  after `series_finish_s` (client-go `finishTime`, 6 minutes) without an occurrence: its final
  count is written and the next occurrence starts a new Event. Unlike client-go (which writes a
  running series only every `refreshTime`, 30 minutes), a changed series is written at most
  every `series_flush_s` (30 s), and at `flush`/`close`.
- **Rate limit per object**: creating Events costs a token from a bucket per regarding object
  (burst 25, one token back every 300 s: client-go tools/record/events_cache.go
  `defaultSpamBurst`/`defaultSpamQPS`, its `EventSourceObjectSpamFilter`; the events.k8s.io
  recorder of tools/events has none); an occurrence that only counts in a series is free.
  A create refused by the bucket is dropped and counted (`stats.rate_limited`).
- **Never blocks the caller**: `emit` takes a lock, updates the cache and puts a create on a
  bounded queue (`queue_size`; client-go `maxQueuedEvents` 1000 with `DropIfChannelFull`); a full
  queue drops the Event, counted (`stats.dropped`) and logged with the count at most once a
  minute. It never raises.
- **Errors** (classified on the writer thread): 403 is logged once per namespace and verb,
  naming the RBAC rule (apiGroups ["events.k8s.io"], resources ["events"], verbs create, patch in
  that namespace), and dropped; 5xx, 429, timeouts and refused connections are retried
  `max_tries` times in all with a doubling backoff from `retry_s` (client-go: 12 tries, 10 s
  apart), then dropped (`stats.failed`, logged at most once a minute); 409 AlreadyExists on a
  create retries under a new name; 422 and other refusals are logged once per reason and
  dropped (a bug of lowtide's).
- **close** stops the thread: it writes what is queued and the series not yet written, one try
  each, within the close's timeout, then joins the thread (no retries while closing).

Must not: block or raise in `emit`, decide anything, touch the store, or read configuration.
Give it its own `ApiClient` (it closes it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import socket
import threading
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

__all__ = [
    "CONTROLLER",
    "EventRecorder",
    "EventSink",
    "EventType",
    "RecorderStats",
    "Regarding",
    "clean_note",
]

log = logging.getLogger(__name__)

EventType = Literal["Normal", "Warning"]
#: `reportingController` of every Event lowtide writes.
CONTROLLER = "lowtide.io/control-plane"
NOTE_LIMIT = 1024  # bytes (pkg/apis/core/validation/events.go NoteLengthLimit)
_FIELD_LIMIT = 128  # reportingInstance, action, reason
_NAME_LIMIT = 253
_STRATEGIC = "application/strategic-merge-patch+json"
_LOG_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class Regarding:
    """The object an Event is about (an ObjectReference); its namespace is the Event's."""

    kind: str
    name: str
    namespace: str
    api_version: str = "v1"
    uid: str = ""

    @classmethod
    def pod(cls, namespace: str, name: str, uid: str = "") -> Regarding:
        return cls("Pod", name, namespace, "v1", uid)

    @classmethod
    def deployment(cls, namespace: str, name: str, uid: str = "") -> Regarding:
        return cls("Deployment", name, namespace, "apps/v1", uid)

    def reference(self) -> dict[str, str]:
        ref = {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "namespace": self.namespace,
        }
        if self.uid:
            ref["uid"] = self.uid
        return ref


class EventSink(Protocol):
    """What the executor and the service manager are given (None: no Events)."""

    def emit(self, regarding: Regarding, type_: EventType, reason: str, action: str, note: str) -> None: ...


@dataclass(slots=True)
class RecorderStats:
    """Counters of the recorder (read from any thread; written by the writer thread and `emit`)."""

    created: int = 0
    patched: int = 0
    aggregated: int = 0  # occurrences counted in a series without a new object
    dropped: int = 0  # the queue was full
    rate_limited: int = 0  # the object's bucket was empty
    failed: int = 0  # given up after retries, forbidden or refused


def clean_note(text: str, limit: int = NOTE_LIMIT) -> str:
    """`text` with control characters escaped (\\n, \\x1b, ...), cut to `limit` UTF-8 bytes on a
    character boundary (ending with "..." when cut)."""
    out = "".join(
        ch if unicodedata.category(ch)[0] != "C" or ch == " " else ch.encode("unicode_escape").decode("ascii")
        for ch in text
    )
    raw = out.encode()
    if len(raw) <= limit:
        return out
    return raw[: limit - 3].decode("utf-8", "ignore") + "..."


def _short(text: str, limit: int = _FIELD_LIMIT) -> str:
    return clean_note(text, limit)


def reporting_instance() -> str:
    """The pod's name in a cluster ($HOSTNAME), else the host name; at most 128 bytes."""
    return _short(os.environ.get("HOSTNAME") or socket.gethostname() or "lowtide")


def _micro(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


_Key = tuple[Regarding, str, str, str, str]


@dataclass(slots=True)
class _Entry:
    """One Event as recorded (client-go's eventCache entry)."""

    key: _Key
    event_time: float
    last_observed: float
    count: int = 1
    name: str | None = None  # set once created
    written: int = 0  # the count the API server has


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


@dataclass
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)


class _Retry(Exception):
    """A temporary failure (5xx, 429, timeouts, no answer): retried."""


class EventRecorder:
    """Records Kubernetes Events on a background thread; see the module docstring."""

    def __init__(
        self,
        api_client: Any,
        *,
        controller: str = CONTROLLER,
        instance: str | None = None,
        queue_size: int = 256,
        series_flush_s: float = 30.0,
        series_finish_s: float = 360.0,
        burst: int = 25,
        refill_s: float = 300.0,
        max_tries: int = 3,
        retry_s: float = 1.0,
        request_timeout_s: float = 5.0,
        max_entries: int = 4096,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if queue_size < 1 or max_tries < 1 or burst < 1:
            raise ValueError("queue_size, max_tries and burst must be at least 1")
        self._api_client = api_client
        self._api = client.EventsV1Api(api_client)
        self.controller = controller
        self.instance = _short(instance) if instance else reporting_instance()
        self._series_flush_s = series_flush_s
        self._finish_s = series_finish_s
        self._burst = burst
        self._refill_s = refill_s
        self._max_tries = max_tries
        self._retry_s = retry_s
        self._timeout = request_timeout_s
        self._max_entries = max_entries
        self._clock = clock
        self.stats = RecorderStats()
        self._lock = threading.Lock()
        self._entries: dict[_Key, _Entry] = {}
        self._ended: list[_Entry] = []  # series that ended with a count not yet written
        self._buckets: dict[Regarding, _Bucket] = {}
        self._queue: queue.Queue[_Entry | _Flush | None] = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self._closing_until = 0.0
        self._last_name_ns = 0
        self._logged_once: set[str] = set()
        self._last_log: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name="lowtide-k8s-events", daemon=True)
        self._thread.start()

    # -- the caller's side (never blocks, never raises) --------------------------------------------

    def emit(self, regarding: Regarding, type_: EventType, reason: str, action: str, note: str) -> None:
        """Record one occurrence: counted in its series, or queued as a new Event, or dropped."""
        try:
            self._emit(regarding, type_, reason, action, note)
        except Exception:  # an Event is never worth breaking admission or scaling
            log.exception("recording a Kubernetes Event failed")

    def _emit(self, regarding: Regarding, type_: EventType, reason: str, action: str, note: str) -> None:
        if self._stop.is_set():
            return
        now = self._clock()
        key: _Key = (regarding, type_, _short(reason), _short(action), clean_note(note))
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and now - entry.last_observed < self._finish_s:
                entry.count += 1
                entry.last_observed = max(entry.last_observed, now)
                self.stats.aggregated += 1
                return
            if entry is not None:  # that series ended: the worker writes its final count
                self._retire(entry)
            if not self._take_token(regarding, now):
                self.stats.rate_limited += 1
                self._log_dropped("rate", f"Events about {_describe(regarding)} over the per-object limit")
                return
            entry = _Entry(key, now, now)
            try:
                self._queue.put_nowait(entry)
            except queue.Full:
                self.stats.dropped += 1
                self._log_dropped("full", "the Kubernetes Event queue is full (API server slow or away?)")
                return
            self._entries[key] = entry
            if len(self._entries) > self._max_entries:
                self._evict(now)

    def _take_token(self, regarding: Regarding, now: float) -> bool:
        bucket = self._buckets.get(regarding)
        if bucket is None:
            if len(self._buckets) >= self._max_entries:
                full = [r for r, b in self._buckets.items() if b.tokens >= self._burst - 1]
                for r in full or list(self._buckets)[: len(self._buckets) // 2]:
                    del self._buckets[r]
            bucket = self._buckets[regarding] = _Bucket(float(self._burst), now)
        if self._refill_s > 0:
            bucket.tokens = min(float(self._burst), bucket.tokens + (now - bucket.at) / self._refill_s)
        bucket.at = now
        if bucket.tokens < 1:
            return False
        bucket.tokens -= 1
        return True

    def _retire(self, entry: _Entry) -> None:
        """Under the lock: the entry leaves the cache; its last count is still to be written."""
        self._entries.pop(entry.key, None)
        if entry.name is not None and entry.count > entry.written:
            self._ended.append(entry)

    def _evict(self, now: float) -> None:
        """Under the lock: the cache is over its bound: retire the entries seen longest ago."""
        ordered = sorted(self._entries.values(), key=lambda e: e.last_observed)
        for entry in ordered[: len(ordered) - self._max_entries]:
            self._retire(entry)

    def _log_dropped(self, what: str, text: str) -> None:
        now = time.monotonic()
        if now - self._last_log.get(what, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._last_log[what] = now
            s = self.stats
            log.warning(
                "Kubernetes Event dropped: %s (so far %d dropped with the queue full, %d over the "
                "per-object limit, %d failed)",
                text,
                s.dropped,
                s.rate_limited,
                s.failed,
            )

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Write what is queued and every series not yet written now; True once done (for tests
        and shutdown). False when the queue is full or it took longer than `timeout_s`."""
        marker = _Flush()
        try:
            self._queue.put_nowait(marker)
        except queue.Full:
            return False
        return marker.done.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued and the pending series (one try each, within `timeout_s`), then
        stop the thread and close the API client."""
        if self._stop.is_set():
            return
        self._closing_until = time.monotonic() + timeout_s
        self._stop.set()
        with contextlib.suppress(queue.Full):  # else the worker sees the flag after its item
            self._queue.put_nowait(None)
        self._thread.join(timeout_s + self._timeout)
        if self._thread.is_alive():
            log.warning("the Kubernetes Event writer did not stop within %.0fs", timeout_s)
        self._api_client.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the writer thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        next_flush = time.monotonic() + self._series_flush_s
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=max(0.01, min(1.0, next_flush - time.monotonic())))
            except queue.Empty:
                item = None
            if isinstance(item, _Flush):
                self._safely(self._write_series)
                item.done.set()
                next_flush = time.monotonic() + self._series_flush_s
            elif item is not None:
                self._safely(self._create, item)
            if time.monotonic() >= next_flush and not self._stop.is_set():
                self._safely(self._write_series)
                next_flush = time.monotonic() + self._series_flush_s
        self._drain()

    def _drain(self) -> None:
        """Closing: what is queued, then every series not written, while the close allows."""
        markers: list[_Flush] = []
        while time.monotonic() < self._closing_until:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Flush):
                markers.append(item)
            elif item is not None:
                self._safely(self._create, item)
        if time.monotonic() < self._closing_until:
            self._safely(self._write_series)
        for marker in markers:
            marker.done.set()

    def _safely(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("the Kubernetes Event writer failed")

    def _tries(self) -> int:
        return 1 if self._stop.is_set() else self._max_tries

    def _call(self, what: str, namespace: str, verb: str, request: Callable[[], Any]) -> Any | None:
        """`request()` with retries; None when it failed for good (counted and logged). Raises
        ApiException 404/409 to the caller (they have their own meaning)."""
        tries = self._tries()
        error = ""
        for attempt in range(tries):
            try:
                return request()
            except ApiException as exc:
                status = exc.status or 0
                if status in (404, 409):
                    raise
                if status == 403:
                    self.stats.failed += 1
                    self._forbidden(namespace, verb, exc)
                    return None
                if status and status != 429 and status < 500:
                    self.stats.failed += 1
                    self._once(
                        f"{status}:{exc.reason}",
                        f"the API server refused a Kubernetes Event ({what}): HTTP {status} "
                        f"{exc.reason}: {_message(exc)}",
                    )
                    return None
                error = f"HTTP {status or 'no answer'} {exc.reason or ''}".strip()
            except (Urllib3Error, OSError) as exc:
                error = f"API server unreachable: {type(exc).__name__}: {exc}"
            if attempt + 1 < tries and self._stop.wait(self._retry_s * 2**attempt):
                break  # closing: no more tries
        self.stats.failed += 1
        self._log_dropped("failed", f"{what} not written after {tries} tries: {error}")
        return None

    def _forbidden(self, namespace: str, verb: str, exc: ApiException) -> None:
        self._once(
            f"403:{namespace}:{verb}",
            f"lowtide may not {verb} Kubernetes Events in namespace {namespace}: grant its "
            f'ServiceAccount apiGroups ["events.k8s.io"] resources ["events"] verbs ["create", '
            f'"patch"] there (the chart\'s Roles do); Events there are dropped: {_message(exc)}',
        )

    def _once(self, key: str, text: str) -> None:
        if key not in self._logged_once:
            self._logged_once.add(key)
            log.error("%s", text)

    def _name(self, regarding: Regarding) -> str:
        stamp = max(time.time_ns(), self._last_name_ns + 1)
        self._last_name_ns = stamp
        suffix = f".{stamp:x}"
        return regarding.name[: _NAME_LIMIT - len(suffix)] + suffix

    def _body(self, entry: _Entry, name: str, count: int, last: float) -> dict[str, Any]:
        regarding, type_, reason, action, note = entry.key
        body: dict[str, Any] = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": regarding.namespace},
            "eventTime": _micro(entry.event_time),
            "reportingController": self.controller,
            "reportingInstance": self.instance,
            "action": action,
            "reason": reason,
            "regarding": regarding.reference(),
            "note": note,
            "type": type_,
        }
        if count >= 2:
            body["series"] = {"count": count, "lastObservedTime": _micro(last)}
        return body

    def _create(self, entry: _Entry) -> None:
        regarding = entry.key[0]
        for _ in range(2):  # a second name after a 409 AlreadyExists
            with self._lock:
                count, last = entry.count, entry.last_observed
            name = self._name(regarding)
            body = self._body(entry, name, count, last)
            try:
                done = self._call(
                    f"Event {entry.key[2]} about {_describe(regarding)}",
                    regarding.namespace,
                    "create",
                    lambda body=body: self._api.create_namespaced_event(  # type: ignore[misc]
                        regarding.namespace, body, _request_timeout=self._timeout, _preload_content=False
                    ),
                )
            except ApiException as exc:
                if exc.status == 409:
                    continue
                self.stats.failed += 1
                self._once(
                    f"create:{exc.status}", f"creating a Kubernetes Event: HTTP {exc.status}: {_message(exc)}"
                )
                done = None
            with self._lock:
                if done is None:
                    if self._entries.get(entry.key) is entry:
                        del self._entries[entry.key]
                    return
                self.stats.created += 1
                entry.name, entry.written = name, count
            return

    def _write_series(self) -> None:
        """PATCH the series whose count the API server does not have yet, and retire the series
        that ended (their final count written)."""
        now = self._clock()
        with self._lock:
            for entry in list(self._entries.values()):
                if now - entry.last_observed >= self._finish_s:
                    self._retire(entry)
            todo = [e for e in self._entries.values() if e.name is not None and e.count > e.written]
            todo += self._ended
            self._ended = []
        for entry in todo:
            if self._stop.is_set() and time.monotonic() >= self._closing_until:
                return
            self._patch(entry)

    def _patch(self, entry: _Entry) -> None:
        regarding = entry.key[0]
        with self._lock:
            count, last, name = entry.count, entry.last_observed, entry.name
        if name is None or count < 2:
            return
        patch = {"series": {"count": count, "lastObservedTime": _micro(last)}}
        try:
            done = self._call(
                f"series of Event {name}",
                regarding.namespace,
                "patch",
                lambda: self._api.patch_namespaced_event(
                    name,
                    regarding.namespace,
                    patch,
                    _content_type=_STRATEGIC,
                    _request_timeout=self._timeout,
                    _preload_content=False,
                ),
            )
        except ApiException as exc:
            if exc.status != 404:
                self.stats.failed += 1
                self._once(
                    f"patch:{exc.status}", f"patching a Kubernetes Event: HTTP {exc.status}: {_message(exc)}"
                )
                return
            # gone (expired after the API server's event TTL): created again, series included
            with self._lock:
                entry.name = None
            self._create(entry)
            return
        if done is not None:
            with self._lock:
                entry.written = max(entry.written, count)
                self.stats.patched += 1


def _describe(regarding: Regarding) -> str:
    return f"{regarding.kind} {regarding.namespace}/{regarding.name}"


def _message(exc: ApiException) -> str:
    try:
        body = json.loads(exc.body) if exc.body else {}
    except (TypeError, ValueError):
        return str(exc.reason or "")
    return str(body.get("message", "")) if isinstance(body, dict) else ""
