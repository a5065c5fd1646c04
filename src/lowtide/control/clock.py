"""Time as a port: production reads the system clocks, tests and the simulator move a fake one.

Two times (docs/architecture.md §4.3, "Control time and wall time"):

- **Control time** (`Clock.now`): seconds since the epoch that never jump while the process lives.
  `SystemClock` reads the wall clock once (per process) and adds ``time.monotonic()`` elapsed
  since, so a wall clock stepped by NTP, an administrator or a VM restore moves no deadline,
  timeout, backoff, window or staleness, and no ledger interval. Everything the control plane
  decides and records uses it. It equals the wall clock at start-up; after a jump it keeps the
  old course (a restart re-anchors it: a jump while lowtide is down shifts persisted deadlines by
  the jump, except that `SystemClock.not_before` keeps a restart after a backward jump from
  going back before what the store already recorded).
- **Wall time** (`Clock.wall`): the system clock now. Only to convert times that other processes
  wrote with their own ``time.time()`` (a shim's ``ended_at``: ``t - (wall() - now())``, clamped)
  and to notice that the wall clock jumped (`detect_jump`, `ClockWatch`).

Testing hook: when the environment variable ``LOWTIDE_FAULT_CLOCK_OFFSET_FILE`` names a file, its
content (a float, seconds) is added to `SystemClock.wall` (re-read at most every 0.1 s; a missing or
garbled file counts as 0). The fault harness writes it to jump the "system" clock of a running
`lowtide up` without root; a process started after such a jump anchors its control time on the
shifted wall clock, as it would after a real jump. Never set it in production.

Must not: decide anything (`detect_jump` only measures), sleep, or touch the store.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Protocol

log = logging.getLogger("lowtide")

#: The testing hook's environment variable (see the module docstring).
OFFSET_FILE_ENV = "LOWTIDE_FAULT_CLOCK_OFFSET_FILE"
#: How often the offset file is re-read at most (seconds of monotonic time).
OFFSET_REREAD_S = 0.1
#: A change of wall − control time larger than this between two checks is a jump (seconds).
JUMP_THRESHOLD_S = 2.0


class Clock(Protocol):
    def now(self) -> float:
        """Control time: seconds since the epoch (UTC), for deadlines, durations and records."""
        ...

    def wall(self) -> float:
        """The system's wall clock now: only to convert times other processes wrote (a shim's
        exit record) and to notice that the wall clock jumped."""
        ...


def read_offset(path: str) -> float:
    """The testing hook's offset in seconds: the file's float, 0 when missing, unreadable,
    garbled or not finite."""
    try:
        with open(path, encoding="utf-8") as fh:
            value = float(fh.read(64).strip() or 0.0)
    except (OSError, ValueError):
        return 0.0
    return value if math.isfinite(value) else 0.0


class _Offset:
    """The wall-clock offset of the testing hook, re-read at most every `OFFSET_REREAD_S`."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._value = 0.0
        self._read_at = -math.inf
        self._lock = threading.Lock()

    def get(self) -> float:
        if self.path is None:
            return 0.0
        mono = time.monotonic()
        with self._lock:
            if mono - self._read_at >= OFFSET_REREAD_S:
                self._value = read_offset(self.path)
                self._read_at = mono
            return self._value


class _Anchor:
    """Where control time starts: a wall-clock reading and the monotonic reading taken with it."""

    def __init__(self, wall: float) -> None:
        self.wall = wall
        self.mono = time.monotonic()
        self.lock = threading.Lock()


_process_lock = threading.Lock()
_process: list[tuple[_Offset, _Anchor]] = []  # at most one: made by the first default SystemClock


def _process_clock() -> tuple[_Offset, _Anchor]:
    """The offset and anchor every default `SystemClock` of this process shares, so that all of
    them (loop, API, store health...) tell the same control time even after a jump."""
    with _process_lock:
        if not _process:
            offset = _Offset(os.environ.get(OFFSET_FILE_ENV) or None)
            _process.append((offset, _Anchor(time.time() + offset.get())))
        return _process[0]


class SystemClock:
    """Control time = the wall clock at the anchor + ``time.monotonic()`` elapsed since (Python
    docs, time.monotonic: "cannot go backward" and is "not affected by system clock updates");
    wall time = ``time.time()`` + the testing hook's offset. Instances made without arguments
    share one anchor per process; `offset_file` gives an instance its own hook and anchor (tests).
    Thread-safe."""

    def __init__(self, offset_file: str | None = None) -> None:
        if offset_file is None:
            self._offset, self._anchor = _process_clock()
        else:
            self._offset = _Offset(offset_file)
            self._anchor = _Anchor(time.time() + self._offset.get())

    def now(self) -> float:
        anchor = self._anchor
        return anchor.wall + (time.monotonic() - anchor.mono)

    def wall(self) -> float:
        return time.time() + self._offset.get()

    def not_before(self, t: float) -> float:
        """Move control time forward to `t` if it is earlier (a restart after the wall clock went
        back: the store holds times later than the new anchor, and deadlines, intervals and
        records must not go back before them). Never moves it back. Returns how far it moved."""
        anchor = self._anchor
        with anchor.lock:
            behind = t - self.now()
            if behind > 0:
                anchor.wall += behind
        if behind > 0:
            log.warning(
                "control time was %.1f s behind the last time the store recorded; it continues from "
                "there (the wall clock went back while lowtide was down?)",
                behind,
            )
            return behind
        return 0.0


class FakeClock:
    """A clock that only moves when told to. `now` and `wall` move together; `jump_wall` moves
    the wall clock alone (a simulated clock jump)."""

    def __init__(self, start: float = 1_790_000_000.0) -> None:
        self._now = start
        self._skew = 0.0

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._skew

    def advance(self, seconds: float) -> float:
        self._now += seconds
        return self._now

    def set(self, when: float) -> None:
        self._now = when

    def jump_wall(self, seconds: float) -> None:
        """Step the wall clock by `seconds` (control time does not move)."""
        self._skew += seconds


def detect_jump(previous_skew: float, skew: float, threshold_s: float = JUMP_THRESHOLD_S) -> float | None:
    """The size of a wall-clock jump between two readings of skew = wall − control time (seconds,
    signed), or None when it changed by no more than `threshold_s`."""
    change = skew - previous_skew
    return change if abs(change) > threshold_s else None


class ClockWatch:
    """Notices wall-clock jumps: `check` (called every tick) compares wall − control time with the
    previous check's, logs a WARNING once per jump and counts it. `skew` and `jumps` feed the
    metrics (``lowtide_clock_skew_seconds``, ``lowtide_clock_jumps_total``). Thread-safe."""

    def __init__(self, clock: Clock, threshold_s: float = JUMP_THRESHOLD_S) -> None:
        self.clock = clock
        self.threshold_s = threshold_s
        self._lock = threading.Lock()
        self.skew = clock.wall() - clock.now()
        self.jumps = 0

    def check(self) -> float | None:
        """Read both clocks; the jump since the last check (seconds), or None."""
        skew = self.clock.wall() - self.clock.now()
        with self._lock:
            jump = detect_jump(self.skew, skew, self.threshold_s)
            self.skew = skew
            if jump is not None:
                self.jumps += 1
        if jump is not None:
            log.warning(
                "wall clock jumped by %+.1f s; deadlines keep monotonic time (wall − control time is "
                "now %+.1f s)",
                jump,
                skew,
            )
        return jump
