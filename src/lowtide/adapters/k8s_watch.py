"""A small informer: one Kubernetes collection (a namespace, a label/field selector) kept in a local
cache by LIST then WATCH, on one daemon thread, so that readers poll the cache instead of the API
server (docs/cluster.md "Serving on Kubernetes").

Semantics follow client-go's reflector, kubernetes/client-go @32ce75a7 (2026-07-24),
`tools/cache/reflector.go` (`RunWithContext`, `ListAndWatchWithContext`, `watch`, `list`,
`handleAnyWatch`, `isExpiredError`), and the API concepts page "Efficient detection of changes"
and "Watch bookmarks" (kubernetes.io/docs/reference/using-api/api-concepts, v1.35):

- LIST (label and field selector, pages of `PAGE` items with ``continue``), replace the cache
  with its items and remember the list's ``metadata.resourceVersion``; then WATCH from that
  version with ``allowWatchBookmarks=true`` and a server ``timeoutSeconds`` drawn in
  [`watch_timeout_s`, 2 × `watch_timeout_s`) (reflector: [minWatchTimeout, 2·minWatchTimeout),
  5 min). ADDED/MODIFIED put the object under ``namespace/name``, DELETED removes it; every event
  and every BOOKMARK (which carries only ``metadata.resourceVersion``) advances the version.
- A watch that the server ends cleanly (its timeout), or that stays silent for `idle_timeout_s`
  (the client's read timeout), is opened again from the last version at once: no LIST. Opening
  it fails with connection refused (any connection error here) or 429, or the stream breaks
  mid-way (the reflector takes an unexpected EOF as the watch's end): back off and watch again
  from the last version, keeping the cache (reflector `isWatchErrorRetriable`). Underneath,
  urllib3 (as the client configures it, 36.0.3) already retries a refused connection and a 429
  or 503 carrying Retry-After, 3 times, before the informer sees an error.
- ``410 Gone``/``Expired`` (an ERROR event carrying a Status with code 410 inside an HTTP 200
  stream, as the watch cache sends it, or an HTTP 410 answer), and every other error (an ERROR
  event, a 403, a 5xx, an undecodable line, a watch closed within a second with nothing in it:
  reflector `VeryShortWatchError`): LIST again (after the backoff, except for a 410).
- Backoff: 0.8 s doubling to 30 s, each delay × [1, 2) (reflector `defaultBackoff*`, jitter 1.0),
  reset once a watch is open (the reflector resets after 2 min without backoff).

Deliberate differences from client-go: every LIST is a consistent read (``resourceVersion``
unset; the reflector's first list asks for "0", any cached version, to spare etcd; a list of one
Deployment's pods is small); there is no resync and no handler fan-out (readers take snapshots).
Added here: **current**. The cache is *current* from the moment a watch request is answered (HTTP
200) until the next failure; it is not current before the first LIST and WATCH have succeeded,
and from any failure until a watch is open again. A not-current cache keeps its contents (the
reader decides what stale data is worth; `Snapshot.problem` says why it is not current, and
`Snapshot.error` is the exception of that failure, for a reader that classifies API errors). A
reader can also wait, bounded, until the cache has seen at least a given resourceVersion
(`wait_for`): read-your-writes after its own write, or a test waiting for a simulated
controller's. Comparing versions as integers follows KEP-5504 "Comparable Resource Version"
(stable in v1.35; apimachinery `pkg/util/resourceversion.CompareResourceVersion`: a positive
decimal integer without leading zeros, meaningful between objects of the same resource); a
version that is not one never counts as seen.

Known limits: between a re-opened watch's 200 and the replay of the events it missed (ms) the
cache is already called current; a connection that dies silently (no FIN, no RST) is noticed only
when no byte arrives for `idle_timeout_s` (the client-side read timeout; the API server sends a
bookmark about every minute on an idle watch).

Neighbours: `adapters.k8s_services` builds informers for a Deployment's pods and a Service's
EndpointSlices and reads their snapshots each poll. Must not: decide anything, write to the API
server, or block a reader for longer than the bound it passes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.exceptions import ReadTimeoutError

log = logging.getLogger(__name__)

#: Items per LIST page (client-go's pager default, `tools/pager` `defaultPageSize`, is 500).
PAGE = 500
#: A watch that ends within this many seconds with nothing in it counts as a failure.
VERY_SHORT_WATCH_S = 1.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A consistent copy of the cache: `items` by ``namespace/name`` (objects are never changed
    in place by the informer; readers must not change them either)."""

    items: Mapping[str, Any]
    resource_version: str
    synced: bool  # a LIST has filled the cache at least once
    current: bool  # synced and a watch is open, nothing has failed since
    problem: str  # why it is not current ("" when it is)
    #: The error of the last failure while not current (None when current, or none was raised),
    #: and what was being done: "list" or "watch" (for a reader that classifies API errors).
    error: BaseException | None = None
    error_verb: str = ""


def compare_resource_versions(a: str, b: str) -> int | None:
    """-1, 0 or 1 like apimachinery's `CompareResourceVersion`; None when either is not a
    positive decimal integer without leading zeros."""
    for v in (a, b):
        if not v.isascii() or not v.isdigit() or v.startswith("0"):
            return None
    if len(a) != len(b):
        return -1 if len(a) < len(b) else 1
    return (a > b) - (a < b)


class _Raw:
    """What `ApiClient.deserialize` reads: a response-like object with `data`."""

    def __init__(self, data: str) -> None:
        self.data = data


class _Expired(Exception):
    """The watch's version is gone (410): LIST again at once."""


class _Stopped(Exception):
    """`close` was called."""


class _VeryShortWatch(Exception):
    """The server closed a watch at once with nothing in it (reflector `VeryShortWatchError`)."""


def _default_describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


class Informer:
    """LIST + WATCH of one collection into a cache, on one daemon thread; see the module docstring.

    `list_call` is a generated client's list method taking the namespace first (e.g.
    ``CoreV1Api(api).list_namespaced_pod``); `item_type` the model of one item (``"V1Pod"``), or
    None to keep items as the JSON dicts the server sent (no model deserialization)."""

    def __init__(
        self,
        api_client: Any,
        list_call: Callable[..., Any],
        item_type: str | None,
        namespace: str,
        *,
        label_selector: str = "",
        field_selector: str = "",
        what: str = "",
        request_timeout_s: float = 5.0,
        watch_timeout_s: float = 300.0,
        idle_timeout_s: float = 120.0,
        backoff_s: tuple[float, float] = (0.8, 30.0),
        describe: Callable[[BaseException], str] = _default_describe,
    ) -> None:
        if request_timeout_s <= 0 or watch_timeout_s < 1 or idle_timeout_s <= 0:
            raise ValueError("timeouts must be > 0 (watch_timeout_s >= 1)")
        if not 0 < backoff_s[0] <= backoff_s[1]:
            raise ValueError("backoff_s must be (initial, cap) with 0 < initial <= cap")
        self._api = api_client
        self._list_call = list_call
        self._item_type = item_type
        self.namespace = namespace
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.what = what or f"{item_type} in {namespace}"
        self.request_timeout_s = request_timeout_s
        self.watch_timeout_s = watch_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.backoff_s = backoff_s
        self._describe = describe
        self._cond = threading.Condition()
        self._items: dict[str, Any] = {}
        self._rv = ""
        self._synced = False
        self._current = False
        self._problem = "not started"
        self._error: BaseException | None = None
        self._error_verb = ""
        self._stop = threading.Event()
        self._resp: Any = None  # the open watch response, so that `close` can cut it
        self._thread: threading.Thread | None = None
        self._delay = 0.0
        self._failures = 0
        #: Requests made, by verb ("list", "watch"): for tests and diagnostics.
        self.requests: dict[str, int] = {"list": 0, "watch": 0}

    # -- readers ----------------------------------------------------------------------------------

    def start(self) -> Informer:
        with self._cond:
            if self._thread is None and not self._stop.is_set():
                self._problem = "waiting for the first LIST"
                self._thread = threading.Thread(target=self._run, name=f"informer {self.what}", daemon=True)
                self._thread.start()
        return self

    def snapshot(self) -> Snapshot:
        with self._cond:
            return Snapshot(
                dict(self._items),
                self._rv,
                self._synced,
                self._current,
                self._problem,
                None if self._current else self._error,
                "" if self._current else self._error_verb,
            )

    @property
    def current(self) -> bool:
        with self._cond:
            return self._current

    @property
    def resource_version(self) -> str:
        with self._cond:
            return self._rv

    def wait_current(self, timeout_s: float, *, or_failure: bool = False) -> bool:
        """Wait at most `timeout_s` until the cache is current (with `or_failure`, only until a
        LIST or WATCH fails, whichever comes first); True when it is current."""
        with self._cond:
            failures = self._failures

            def done() -> bool:
                return self._current or self._stop.is_set() or (or_failure and self._failures > failures)

            self._cond.wait_for(done, timeout_s)
            return self._current

    def wait_for(self, resource_version: str | int, timeout_s: float) -> bool:
        """Wait at most `timeout_s` until the cache is current and has seen `resource_version`
        (a version of this collection's resource, e.g. from the answer to one's own write)."""
        wanted = str(resource_version)

        def seen() -> bool:
            order = compare_resource_versions(self._rv, wanted) if self._rv else None
            return self._current and order is not None and order >= 0

        with self._cond:
            return self._cond.wait_for(lambda: seen() or self._stop.is_set(), timeout_s) and seen()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (cutting an open watch) and wait for it, at most `timeout_s`."""
        self._stop.set()
        with self._cond:
            self._current = False
            self._problem = "closed"
            self._cond.notify_all()
            thread = self._thread
        self._cut()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("informer %s did not stop within %gs", self.what, timeout_s)

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        need_list = True
        while not self._stop.is_set():
            try:
                if need_list:
                    self._list()
                    need_list = False
                self._watch()  # returns when the server ended the watch cleanly
            except _Stopped:
                break
            except _Expired as exc:
                self._failed(f"watching {self.what}: {exc}; listing again", exc, "watch")
                need_list = True
            except Exception as exc:
                if self._stop.is_set():
                    break
                if not isinstance(exc, ApiException | Urllib3Error | OSError | _VeryShortWatch):
                    log.exception("informer %s: unexpected error; listing again after a backoff", self.what)
                if isinstance(exc, ApiException) and exc.status == 410 and not need_list:
                    self._failed(f"watching {self.what}: {self._describe(exc)}; listing again", exc, "watch")
                    need_list = True
                    continue
                retriable = _retriable(exc) and self._synced and not need_list
                doing = "listing" if need_list else "watching"
                verb = "list" if need_list else "watch"
                self._failed(f"{doing} {self.what}: {self._describe(exc)}", exc, verb)
                need_list = need_list or not retriable
                if not self._backoff():
                    break
        with self._cond:
            self._current = False
            self._cond.notify_all()

    def _list(self) -> None:
        items: dict[str, Any] = {}
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {
                "limit": PAGE,
                "_request_timeout": self.request_timeout_s,
            }
            if self.label_selector:
                kwargs["label_selector"] = self.label_selector
            if self.field_selector:
                kwargs["field_selector"] = self.field_selector
            if token:
                kwargs["_continue"] = token
            self.requests["list"] += 1
            if self._item_type is None:  # raw dicts: the JSON as sent
                resp = self._list_call(self.namespace, _preload_content=False, **kwargs)
                doc = json.loads(resp.data)
                page_items = [i for i in doc.get("items") or [] if isinstance(i, dict)]
                meta = doc.get("metadata") or {}
                token, page_rv = meta.get("continue"), str(meta.get("resourceVersion") or "")
                for raw in page_items:
                    m = raw.get("metadata") or {}
                    items[_key(m.get("namespace"), m.get("name"))] = raw
            else:
                page = self._list_call(self.namespace, **kwargs)
                for item in page.items or []:
                    items[_key(item.metadata.namespace, item.metadata.name)] = item
                token = page.metadata._continue if page.metadata is not None else None
                page_rv = (page.metadata.resource_version if page.metadata is not None else "") or ""
            if self._stop.is_set():
                raise _Stopped
            if not token:
                rv = page_rv
                break
        with self._cond:
            self._items = items
            self._rv = rv or ""
            self._synced = True
            self._cond.notify_all()
        log.debug("informer %s: listed %d at resourceVersion %s", self.what, len(items), rv)

    def _watch(self) -> None:
        timeout = int(self.watch_timeout_s * (1 + random.random()))  # spreads the load, as client-go does
        kwargs: dict[str, Any] = {
            "watch": True,
            "allow_watch_bookmarks": True,
            "resource_version": self.resource_version,
            "timeout_seconds": timeout,
            "_preload_content": False,
            "_request_timeout": (self.request_timeout_s, self.idle_timeout_s),
        }
        if self.label_selector:
            kwargs["label_selector"] = self.label_selector
        if self.field_selector:
            kwargs["field_selector"] = self.field_selector
        self.requests["watch"] += 1
        started = time.monotonic()
        resp = self._list_call(self.namespace, **kwargs)
        with self._cond:
            self._resp = resp
            if self._stop.is_set():
                self._resp = None
                resp.release_conn()
                raise _Stopped
            if not self._current:
                log.info("informer %s: watching from resourceVersion %s", self.what, self._rv)
            self._current = True
            self._problem = ""
            self._delay = 0.0
            self._cond.notify_all()
        lines = 0
        try:
            for line in _lines(resp):
                if self._stop.is_set():
                    raise _Stopped
                if not line.strip():
                    continue
                lines += 1
                self._apply(json.loads(line))
        except _Stopped:
            raise
        except ReadTimeoutError:
            if self._stop.is_set():
                raise _Stopped from None
            # Nothing (not even a bookmark) for idle_timeout_s: the connection may be dead.
            log.info("informer %s: watch idle for %gs; watching again", self.what, self.idle_timeout_s)
            return
        except Exception:
            if self._stop.is_set():
                raise _Stopped from None
            raise
        finally:
            with self._cond:
                self._resp = None
            resp.close()
            resp.release_conn()
        if self._stop.is_set():
            raise _Stopped
        if lines == 0 and time.monotonic() - started < VERY_SHORT_WATCH_S:
            raise _VeryShortWatch("the server closed the watch at once, with no event")

    def _apply(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        raw = event.get("object") or {}
        if kind == "ERROR":
            code = int(raw.get("code") or 0)
            reason = str(raw.get("reason") or "")
            message = str(raw.get("message") or "")
            if code == 410 or reason in ("Expired", "Gone"):
                raise _Expired(f"HTTP 410 {reason}: {message}".rstrip(": "))
            exc = ApiException(status=code, reason=reason)
            exc.body = json.dumps(raw)
            raise exc
        meta = raw.get("metadata") or {}
        rv = str(meta.get("resourceVersion") or "")
        if kind == "BOOKMARK":
            with self._cond:
                if rv:
                    self._rv = rv
                self._cond.notify_all()
            return
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            log.warning("informer %s: unknown watch event type %r ignored", self.what, kind)
            return
        key = _key(meta.get("namespace"), meta.get("name"))
        obj: Any = None
        if kind != "DELETED":
            obj = (
                raw
                if self._item_type is None
                else self._api.deserialize(_Raw(json.dumps(raw)), self._item_type)
            )
        with self._cond:
            if obj is None:
                self._items.pop(key, None)
            else:
                self._items[key] = obj
            if rv:
                self._rv = rv
            self._cond.notify_all()

    def _failed(self, why: str, exc: BaseException | None = None, verb: str = "") -> None:
        with self._cond:
            changed = why != self._problem
            self._current = False
            self._problem = why
            self._error, self._error_verb = exc, verb
            self._failures += 1
            self._cond.notify_all()
        if changed:
            log.warning("informer: %s", why)

    def _backoff(self) -> bool:
        """Sleep the next backoff delay (False: closed meanwhile)."""
        initial, cap = self.backoff_s
        self._delay = initial if self._delay <= 0 else min(self._delay * 2, cap)
        return not self._stop.wait(self._delay * (1 + random.random()))

    def _cut(self) -> None:
        """Shut the open watch's socket down, so that a read blocked on it returns now (the same
        workaround as `kubernetes.watch.Watch.stop`, client 36.0.3)."""
        with self._cond:
            resp = self._resp
        conn = getattr(resp, "connection", None) if resp is not None else None
        sock = getattr(conn, "sock", None) if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _key(namespace: str | None, name: str | None) -> str:
    return f"{namespace or ''}/{name or ''}"


def _lines(resp: Any) -> Iterator[str]:
    return iter(iter_resp_lines(resp))


def _retriable(exc: BaseException) -> bool:
    """Watch again from the last version (not LIST) after this error: a 429, or a connection
    error (refused, reset, cut mid-stream): the cache is still right up to its version."""
    if isinstance(exc, ApiException):
        return bool(exc.status == 429)
    return isinstance(exc, (Urllib3Error, OSError))
