"""How the store has been doing: since when reads or writes fail, why, and when they last worked.

One `StoreHealth` per process, fed by the SQL store's transaction helpers (`store.base`: every
failed transaction classified as `records.StoreUnavailable` calls `failed`, every committed one
`succeeded`) and read by the control loop (to back off and log once per outage) and the API
(`/healthz` turns 503 when an outage has lasted longer than `api.store_unhealthy_after`, see
docs/architecture.md §4.4). Reads and writes are tracked apart: with SQLite in WAL mode readers
go on while a writer is locked out, and a read that works must not hide writes that do not.
Thread-safe (the API's threads and the loop's thread share it). Time comes from the injected
`Clock` (`now()` for durations, `wall()` for the "since" shown to people).
Must not: decide anything beyond "how long has it failed", touch the store, or sleep.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

from lowtide.control.clock import Clock, SystemClock

Access = Literal["read", "write"]


@dataclass(frozen=True, slots=True)
class StoreOutage:
    """An outage in progress: reads or writes have failed since `since` (control time)."""

    access: Access
    since: float  # control time (`Clock.now`) of the first failure
    since_wall: float  # the same moment on the wall clock, for people
    reason: str  # the last failure's reason
    failures: int

    def age(self, now: float) -> float:
        return max(0.0, now - self.since)


class StoreHealth:
    """See the module docstring."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._outages: dict[Access, StoreOutage] = {}
        self.last_success: float | None = None  # control time of the last committed transaction
        self.outages_total = 0

    def failed(self, access: Access, reason: str, *, started: float | None = None) -> bool:
        """Record a failure; True when it starts an outage (log it then, not at every failure).
        `started` (control time) is when the failed transaction began: a write that waited out
        the database's busy timeout before failing has found the store failing since then."""
        now, wall = self.clock.now(), self.clock.wall()
        since = now if started is None else min(now, started)
        with self._lock:
            known = self._outages.get(access)
            if known is None:
                self._outages[access] = StoreOutage(access, since, wall - (now - since), reason, 1)
                self.outages_total += 1
                return True
            self._outages[access] = StoreOutage(
                access, known.since, known.since_wall, reason, known.failures + 1
            )
            return False

    def succeeded(self, access: Access) -> StoreOutage | None:
        """Record a success; returns the outage of this kind it ended, if any. A write that
        commits also proves reads work."""
        now = self.clock.now()
        with self._lock:
            self.last_success = now
            if not self._outages:
                return None
            ended = self._outages.pop(access, None)
            if access == "write":
                self._outages.pop("read", None)
            return ended

    def outage(self) -> StoreOutage | None:
        """The oldest outage in progress (None: the store works)."""
        with self._lock:
            return min(self._outages.values(), key=lambda o: o.since, default=None)

    def unhealthy(self, bound_s: float) -> StoreOutage | None:
        """The outage in progress if it has lasted longer than `bound_s`, else None."""
        found = self.outage()
        if found is None or found.age(self.clock.now()) <= bound_s:
            return None
        return found
