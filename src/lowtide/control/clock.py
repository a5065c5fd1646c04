"""Time as a port: production reads the system clock, tests and the simulator move a fake one."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Control time: seconds since the epoch (UTC), for deadlines, durations and records."""
        ...

    def wall(self) -> float:
        """The system's wall clock now: only to convert times other processes wrote (a shim's
        exit record) and to notice that the wall clock jumped."""
        ...


class SystemClock:
    def now(self) -> float:
        return time.time()

    def wall(self) -> float:
        return time.time()


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 1_790_000_000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        self._now += seconds
        return self._now

    def set(self, when: float) -> None:
        self._now = when
