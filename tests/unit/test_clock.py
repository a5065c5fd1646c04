"""The Clock port (issue 12, defect 4): control time from the monotonic clock, wall time with the
fault-injection offset, jump detection, and the floor a restart starts from.

`SystemClock(offset_file=...)` is the testing hook the fault harness drives through
``LOWTIDE_FAULT_CLOCK_OFFSET_FILE``; writing the file jumps `wall()` and never `now()`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lowtide.api.metrics import LoopStatus, metrics_text
from lowtide.control.clock import (
    OFFSET_FILE_ENV,
    OFFSET_REREAD_S,
    ClockWatch,
    FakeClock,
    SystemClock,
    detect_jump,
    read_offset,
)
from lowtide.store.memory import MemoryStore
from lowtide.wiring import watch_clock


def _set_offset(path: Path, seconds: float) -> None:
    path.write_text(f"{seconds}\n")
    time.sleep(OFFSET_REREAD_S * 1.5)  # the clock re-reads the file at most every 0.1 s


def test_a_wall_jump_moves_wall_and_never_control_time(tmp_path: Path) -> None:
    offset = tmp_path / "offset"
    offset.write_text("0")
    clock = SystemClock(offset_file=str(offset))
    before_now, before_wall = clock.now(), clock.wall()
    _set_offset(offset, 600.0)
    after_now, after_wall = clock.now(), clock.wall()
    assert 600.0 < after_wall - before_wall < 605.0
    assert 0.0 <= after_now - before_now < 5.0  # only the time that passed
    _set_offset(offset, -600.0)
    assert clock.wall() - after_wall < -1195.0
    assert clock.now() >= after_now  # control time never goes back


def test_the_anchor_includes_the_offset_at_construction(tmp_path: Path) -> None:
    """A process started after a jump anchors its control time on the shifted wall clock."""
    offset = tmp_path / "offset"
    offset.write_text("-3600")
    clock = SystemClock(offset_file=str(offset))
    assert abs(clock.now() - (time.time() - 3600)) < 5.0
    assert abs(clock.wall() - clock.now()) < 1.0


@pytest.mark.parametrize("content", ["", "soon", "nan", "inf", "1e999", "\x00"])
def test_a_garbled_offset_file_counts_as_zero(tmp_path: Path, content: str) -> None:
    offset = tmp_path / "offset"
    offset.write_text(content)
    assert read_offset(str(offset)) == 0.0
    assert read_offset(str(tmp_path / "missing")) == 0.0
    assert abs(SystemClock(offset_file=str(offset)).wall() - time.time()) < 1.0


def test_default_clocks_of_one_process_share_their_anchor() -> None:
    a, b = SystemClock(), SystemClock()
    assert a._anchor is b._anchor
    assert abs(a.now() - b.now()) < 0.5


def test_the_environment_variable_hooks_the_process_clock(tmp_path: Path) -> None:
    offset = tmp_path / "offset"
    offset.write_text("900")
    code = (
        "import json, time\n"
        "from lowtide.control.clock import SystemClock\n"
        "c = SystemClock()\n"
        "print(json.dumps([c.now() - time.time(), c.wall() - time.time()]))\n"
    )
    env = {**os.environ, OFFSET_FILE_ENV: str(offset)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    now_skew, wall_skew = json.loads(out.stdout)
    assert 895.0 < now_skew < 905.0 and 895.0 < wall_skew < 905.0


def test_not_before_moves_control_time_forward_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = SystemClock(offset_file=str(tmp_path / "none"))
    now = clock.now()
    assert clock.not_before(now - 100) == 0.0
    assert clock.now() < now + 5
    with caplog.at_level(logging.WARNING, logger="lowtide"):
        moved = clock.not_before(now + 600)
    assert 590 < moved <= 600
    assert clock.now() >= now + 600
    assert "behind the last time the store recorded" in caplog.text


def test_detect_jump() -> None:
    assert detect_jump(0.0, 1.5) is None
    assert detect_jump(0.0, -2.0) is None
    assert detect_jump(10.0, 610.0) == 600.0
    assert detect_jump(10.0, -590.0) == -600.0
    assert detect_jump(0.0, 1.0, threshold_s=0.5) == 1.0


def test_clock_watch_logs_and_counts_each_jump_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    watch = ClockWatch(clock)
    with caplog.at_level(logging.WARNING, logger="lowtide"):
        assert watch.check() is None
        clock.jump_wall(600)
        clock.advance(1)
        assert watch.check() == 600.0
        assert watch.check() is None  # the same jump, seen again: not a new one
        clock.jump_wall(-600)
        assert watch.check() == -600.0
        clock.jump_wall(1.0)  # small steps (NTP slewing, a late tick) are no jumps
        assert watch.check() is None
    assert watch.jumps == 2 and watch.skew == 1.0
    jumped = [r.getMessage() for r in caplog.records if "jumped" in r.getMessage()]
    assert len(jumped) == 2
    assert "wall clock jumped by +600.0 s; deadlines keep monotonic time" in jumped[0]
    assert "wall clock jumped by -600.0 s" in jumped[1]


def test_fake_clock_moves_wall_alone_on_a_jump() -> None:
    clock = FakeClock(1000.0)
    clock.jump_wall(-30)
    assert (clock.now(), clock.wall()) == (1000.0, 970.0)
    clock.advance(5)
    assert (clock.now(), clock.wall()) == (1005.0, 975.0)


def test_the_clock_watch_thread_and_metrics_report_a_jump() -> None:
    """`wiring.watch_clock` checks every tick; `/metrics` shows the count and the skew."""
    clock = FakeClock()
    watch = ClockWatch(clock)
    stop = threading.Event()
    thread = threading.Thread(target=watch_clock, args=(watch, stop, 0.01), daemon=True)
    thread.start()
    try:
        clock.jump_wall(-600)
        deadline = time.monotonic() + 10
        while watch.jumps == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(timeout=5)
    assert (watch.jumps, watch.skew) == (1, -600.0)
    status = LoopStatus(
        last_tick_at=None,
        last_tick_duration_s=0.0,
        ticks=0,
        tick_errors=0,
        queued_waiting=0,
        clock_jumps=watch.jumps,
        clock_skew_s=watch.skew,
    )
    body, _ = metrics_text(MemoryStore(), (), status)
    text = body.decode()
    assert "lowtide_clock_jumps_total 1.0" in text
    assert "lowtide_clock_skew_seconds -600.0" in text
