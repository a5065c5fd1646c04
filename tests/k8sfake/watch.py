"""Watch streams: `?watch=true` answered as newline-delimited JSON events.

Semantics (kubernetes commit 000f2605; staging/src/k8s.io/apiserver/pkg/endpoints/handlers/
watch.go, staging/.../pkg/storage/cacher/cacher.go and watch_cache.go):
- resourceVersion unset or "0": synthetic ADDED events for the current objects, then live
  events; resourceVersion N: every event after N, then live events.
- N older than the retained window: the stream (HTTP 200) carries one ERROR event whose
  object is a Status with code 410, reason Expired, "too old resource version: N (M)".
- Label/field selectors are applied to the old and new object: an object that stops matching
  arrives as DELETED, one that starts matching as ADDED (cacher `watchCacheEvent` filtering).
- allowWatchBookmarks=true: BOOKMARK events carrying only kind, apiVersion and
  metadata.resourceVersion (the current revision), here every `bookmark_interval` seconds.
- timeoutSeconds ends the stream cleanly; the server stopping ends every stream.
- A resourceVersion newer than the store's: after a short wait (min(timeoutSeconds, 3 s)) an
  ERROR event with a 504 Timeout Status, "Too large resource version" (cacher.go
  `waitUntilFreshAndBlock`).
Neighbours: `objects.Store.subscribe` feeds events; `server` wraps this in a response.
Must NOT: authorize or parse query strings.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

from .errors import ApiError
from .objects import Event, Kind, Store
from .selectors import Selector

Obj = dict[str, Any]


def _line(type_: str, obj: Obj) -> bytes:
    return (json.dumps({"type": type_, "object": obj}) + "\n").encode()


def translate(event: Event, selector: Selector) -> tuple[str, Obj] | None:
    """The event a watcher with `selector` sees, or None."""
    if event.type == "DELETED":
        return ("DELETED", event.obj) if selector.matches(event.prev or event.obj) else None
    now = selector.matches(event.obj)
    before = event.prev is not None and selector.matches(event.prev)
    if event.type == "ADDED":
        return ("ADDED", event.obj) if now else None
    if now and before:
        return ("MODIFIED", event.obj)
    if now:
        return ("ADDED", event.obj)
    if before:
        return ("DELETED", event.obj)
    return None


class WatchStreams:
    """The open watch streams of one server, so stopping it can end them all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Event | None]]] = set()

    def close_all(self) -> None:
        with self._lock:
            for loop, queue in list(self._open):
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(queue.put_nowait, None)

    async def stream(
        self,
        store: Store,
        kind: Kind,
        namespace: str,
        selector: Selector,
        since: int | None,
        bookmarks: bool,
        timeout_s: float | None,
        bookmark_interval: float,
    ) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        entry = (loop, queue)

        def listener(event: Event) -> None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(queue.put_nowait, event)

        if since is not None and since > store.resource_version:
            # cacher.go waits briefly for a future version, then gives up with a 504 Timeout
            await asyncio.sleep(min(timeout_s or 3.0, 3.0))
            if since > store.resource_version:
                yield _line(
                    "ERROR",
                    ApiError(
                        504,
                        "Timeout",
                        (f"Too large resource version: {since}, current: {store.resource_version}"),
                        {
                            "causes": [
                                {"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}
                            ],
                            "retryAfterSeconds": 1,
                        },
                    ).status(),
                )
                return
        try:
            backlog, current, _ = store.subscribe(kind, namespace, since, listener)
        except ApiError as exc:
            yield _line("ERROR", exc.status())
            return
        with self._lock:
            self._open.add(entry)
        try:
            for obj in current:
                if selector.matches(obj):
                    yield _line("ADDED", obj)
            for event in backlog:
                seen = translate(event, selector)
                if seen:
                    yield _line(*seen)
            deadline = None if timeout_s is None else loop.time() + timeout_s
            while True:
                wait = bookmark_interval if bookmarks else None
                if deadline is not None:
                    left = deadline - loop.time()
                    if left <= 0:
                        return
                    wait = left if wait is None else min(wait, left)
                try:
                    item = await asyncio.wait_for(queue.get(), wait)
                except TimeoutError:
                    if bookmarks and (deadline is None or deadline - loop.time() > 0):
                        yield _line(
                            "BOOKMARK",
                            {
                                "kind": kind.kind,
                                "apiVersion": kind.api_version,
                                "metadata": {"resourceVersion": str(store.resource_version)},
                            },
                        )
                    continue
                if item is None:
                    return
                seen = translate(item, selector)
                if seen:
                    yield _line(*seen)
        finally:
            store.unsubscribe(listener)
            with self._lock:
                self._open.discard(entry)
