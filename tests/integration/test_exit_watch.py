"""ExitWatcher with real processes: the loop hears of an exit without polling for it.

Each test waits (bounded) for the callback and asserts that it came, never how fast.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from lowtide.adapters.exit_watch import ExitWatcher
from lowtide.adapters.local_executor import LocalExecutor
from lowtide.control.executor_port import LaunchRequest, ProcessIdentity

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfds are Linux-only")


class Calls:
    def __init__(self) -> None:
        self.count = 0
        self.event = threading.Event()
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.count += 1
        self.event.set()

    def wait(self, timeout: float = 10.0) -> bool:
        ok = self.event.wait(timeout)
        self.event.clear()
        return ok


def identity(proc: subprocess.Popen[bytes]) -> ProcessIdentity:
    return ProcessIdentity(proc.pid, psutil.Process(proc.pid).create_time())


@pytest.fixture
def calls() -> Calls:
    return Calls()


@pytest.fixture
def watcher(calls: Calls) -> Iterator[ExitWatcher]:
    w = ExitWatcher(calls)
    yield w
    w.close()


def sleeper(seconds: float = 60) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_an_exit_is_reported_without_any_poll(watcher: ExitWatcher, calls: Calls) -> None:
    assert watcher.active
    proc = sleeper()
    try:
        watcher.watch("a", identity(proc))
        assert calls.count == 0
        proc.terminate()
        assert calls.wait(), "no callback after the process ended"
        # The watcher never reaps: the exit status is still ours to collect.
        assert proc.wait(timeout=5) == -15
    finally:
        proc.kill()
        proc.wait()


def test_a_forgotten_process_does_not_report_and_others_still_do(watcher: ExitWatcher, calls: Calls) -> None:
    first, second = sleeper(), sleeper()
    try:
        watcher.watch("first", identity(first))
        watcher.watch("second", identity(second))
        watcher.forget("first")
        first.kill()
        first.wait()
        second.kill()
        assert calls.wait()
        second.wait()
        time.sleep(0.2)  # let a wrong extra callback for `first` arrive, if there were one
        assert calls.count == 1
    finally:
        for p in (first, second):
            p.kill()
            p.wait()


def test_a_process_already_gone_or_replaced_reports_at_once(watcher: ExitWatcher, calls: Calls) -> None:
    proc = sleeper(0)
    ident = identity(proc)
    proc.wait()  # reaped: the pid no longer exists
    watcher.watch("gone", ident)
    assert calls.wait(timeout=0.5)
    live = sleeper()
    try:
        # Same pid, another start time: not the process we were asked about.
        watcher.watch("reused", ProcessIdentity(live.pid, identity(live).started_at - 100))
        assert calls.wait(timeout=0.5)
    finally:
        live.kill()
        live.wait()


def test_close_stops_the_thread_and_later_watches_do_nothing(calls: Calls) -> None:
    w = ExitWatcher(calls)
    proc = sleeper()
    try:
        w.watch("a", identity(proc))
        assert any(t.name == "lowtide-exit-watch" for t in threading.enumerate())
        w.close()
        assert not any(t.name == "lowtide-exit-watch" for t in threading.enumerate())
        assert not w.active
        w.watch("b", identity(proc))  # ignored, no error
        proc.kill()
        proc.wait()
        time.sleep(0.2)
        assert calls.count == 0
    finally:
        proc.kill()
        proc.wait()


def test_the_local_executor_reports_a_step_exit_through_the_watcher(
    tmp_path: Path, watcher: ExitWatcher, calls: Calls
) -> None:
    executor = LocalExecutor(f"t{time.time_ns()}", watcher=watcher)
    work = tmp_path / "work"
    request = LaunchRequest(
        attempt_id=7,
        job_id="j1",
        step="train",
        attempt=1,
        node="n1",
        gpus=(0,),
        command=(sys.executable, "-c", "import time, sys; time.sleep(0.3); sys.exit(3)"),
        image=None,
        env={},
        work_dir=str(work),
        log_path=str(work / "log.txt"),
        notice_path=str(work / "notice.json"),
    )
    executor.launch(request, time.time())
    try:
        assert calls.wait(), "the step's exit did not wake anybody"
        exits = executor.poll(time.time()).exits
        assert [(e.attempt_id, e.exit_code) for e in exits] == [(7, 3)]
    finally:
        executor.close()
