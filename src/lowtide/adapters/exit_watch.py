"""Hear at once when a supervised process ends, instead of at the next tick (Linux pidfds).

Role: one daemon thread waits on a pidfd per watched shim (research steps and inference replicas)
and calls `on_exit()` when any of them ends. It says nothing about *which* process or how it
ended: the adapters' `poll` still reads the exit records and the loop still decides. It only makes
that poll come sooner, so the GPUs a preempted step frees go to the replica waiting for them
within milliseconds rather than up to a tick later (`benchmarks/reclaim.py` measures the effect).

Where `os.pidfd_open` is missing or refused (not Linux ≥ 5.3, a sandbox), `watch` does nothing and
logs once: every exit is still seen by the next tick, only later.

Must not: reap, signal or wait for a process (a pidfd only becomes readable; it never reaps), touch
the store, or call `on_exit` while holding its lock. `on_exit` must be quick and thread-safe (the
loop's `wake` sets an event).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import threading
from collections.abc import Callable, Hashable

from lowtide.adapters.supervision import same_process
from lowtide.control.executor_port import ProcessIdentity

log = logging.getLogger(__name__)


class ExitWatcher:
    """Calls `on_exit()` from its own thread whenever a watched process ends."""

    def __init__(self, on_exit: Callable[[], None]) -> None:
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._fds: dict[Hashable, int] = {}  # key -> pidfd, owned by the watcher thread's selector
        self._pending: list[tuple[Hashable, int | None]] = []  # (key, fd to add | None to forget)
        self._selector: selectors.BaseSelector | None = None
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._closed = False
        self._unsupported = not hasattr(os, "pidfd_open")

    @property
    def active(self) -> bool:
        """False where pidfds are unavailable (exits are then only seen by polling)."""
        return not self._unsupported and not self._closed

    def watch(self, key: Hashable, identity: ProcessIdentity) -> None:
        """Watch the process `identity` under `key` (replacing what `key` watched before). A process
        that has already ended, or whose pid now names another process, reports at once."""
        if not self.active:
            return
        try:
            fd = os.pidfd_open(identity.pid)
        except ProcessLookupError:
            self._on_exit()  # already gone (and reaped): the next poll will see it
            return
        except OSError as exc:  # ENOSYS, EPERM in a sandbox: fall back to polling, say so once
            self._unsupported = True
            log.info("pidfd_open is not available (%s); exits are seen at the next tick", exc)
            return
        if same_process(identity) is None:  # the pid was reused, or it ended just now
            os.close(fd)
            self._on_exit()
            return
        with self._lock:
            if self._closed:
                os.close(fd)
                return
            self._start_locked()
            self._pending.append((key, fd))
        self._poke()

    def forget(self, key: Hashable) -> None:
        """Stop watching `key` (its process was handled); unknown keys are ignored."""
        with self._lock:
            if self._closed or self._thread is None:
                return
            self._pending.append((key, None))
        self._poke()

    def close(self) -> None:
        """Stop the thread and close every pidfd; later `watch` calls do nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._poke()
        if thread is not None:
            thread.join(timeout=5)

    # -- the watcher thread ----------------------------------------------------------------------

    def _start_locked(self) -> None:
        if self._thread is not None:
            return
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="lowtide-exit-watch", daemon=True)
        self._thread.start()

    def _poke(self) -> None:
        if self._wake_w >= 0:
            with contextlib.suppress(BlockingIOError, OSError):  # full pipe: it is awake anyway
                os.write(self._wake_w, b"x")

    def _run(self) -> None:
        selector = self._selector
        assert selector is not None
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    pending, self._pending = self._pending, []
                for key, fd in pending:
                    self._apply(selector, key, fd)
                ended = False
                ready = selector.select()
                # A `forget` (or a new `watch`) may have arrived while select waited, in the same
                # wake-up as the process's exit: apply it first, so a forgotten process does not
                # report and a re-watched key is not taken for its old process.
                with self._lock:
                    pending, self._pending = self._pending, []
                for key, fd in pending:
                    self._apply(selector, key, fd)
                for selected, _ in ready:
                    if selected.data is None:
                        with contextlib.suppress(BlockingIOError, OSError):
                            os.read(self._wake_r, 4096)
                        continue
                    if self._fds.get(selected.data) != selected.fd:
                        continue
                    self._drop(selector, selected.data)
                    ended = True
                if ended:
                    try:
                        self._on_exit()
                    except Exception:  # the loop must keep hearing about exits
                        log.exception("exit callback failed")
        except Exception:
            log.exception("the exit watcher stopped; exits are seen at the next tick")
        finally:
            for key in list(self._fds):
                self._drop(selector, key)
            selector.close()
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    def _apply(self, selector: selectors.BaseSelector, key: Hashable, fd: int | None) -> None:
        self._drop(selector, key)
        if fd is not None:
            self._fds[key] = fd
            selector.register(fd, selectors.EVENT_READ, key)

    def _drop(self, selector: selectors.BaseSelector, key: Hashable) -> None:
        fd = self._fds.pop(key, None)
        if fd is None:
            return
        with contextlib.suppress(KeyError, ValueError, OSError):
            selector.unregister(fd)
        with contextlib.suppress(OSError):
            os.close(fd)
