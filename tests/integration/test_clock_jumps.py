"""Wall-clock jumps against real processes (issue 12, defect 4): the control loop with a real
SQLite store, a real LocalExecutor and step processes, and a `SystemClock` whose wall clock the
test jumps through the fault-injection hook (``LOWTIDE_FAULT_CLOCK_OFFSET_FILE``, which the
shims see too); and a real LocalServiceManager starting a replica across a jump.

Deadlines are checked as behaviour: a step under notice that ignores it is SIGKILLed no earlier
than its grace of monotonic time after the notice, and not much later (a few ticks), whichever
way the wall clock jumps; a replica that starts normally is not timed out by a +120 s jump. The
ledger and the attempt's times stay on control time (no 600 s in any interval).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from fastapi.testclient import TestClient

from lowtide.adapters import supervision
from lowtide.adapters.local_services import REPLICA_TAG_ENV, LocalServiceManager
from lowtide.control.clock import OFFSET_FILE_ENV, OFFSET_REREAD_S, ClockWatch, SystemClock
from lowtide.control.inference_ports import ReplicaLaunch
from lowtide.wiring import Embedded, build, keep_time_forward
from support import kill_steps_and_close, settings_for, tick_until, wait_until

GRACE_S = 3.0
TICK_S = 0.1  # support.settings_for
STUBBORN = [
    sys.executable,
    "-c",
    textwrap.dedent("""
        import json, os, pathlib, signal, time
        def noticed(*_):
            # What a step sees: the notice's deadline against its own (hooked) wall clock.
            notice = json.loads(pathlib.Path(os.environ["LOWTIDE_NOTICE_FILE"]).read_text())
            offset = pathlib.Path(os.environ["LOWTIDE_FAULT_CLOCK_OFFSET_FILE"]).read_text()
            wall = time.time() + float(offset)
            print(f"noticed, {notice['deadline'] - wall:.1f} s left", flush=True)
        signal.signal(signal.SIGTERM, noticed)
        print("ready", flush=True)
        while True:
            time.sleep(0.05)
    """),
]
FAKE_VLLM = str(Path(__file__).resolve().parents[1] / "fixtures" / "fake_vllm.py")


def jump(offset_file: Path, seconds: float) -> None:
    """Step the hooked wall clock to `seconds` from the real one, and wait until it is re-read."""
    offset_file.write_text(f"{seconds}\n")
    time.sleep(OFFSET_REREAD_S * 1.5)


@pytest.fixture
def offset_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "clock-offset"
    path.write_text("0\n")
    monkeypatch.setenv(OFFSET_FILE_ENV, str(path))  # the shims read it too
    return path


@pytest.fixture
def lt(tmp_path: Path, offset_file: Path) -> Iterator[Embedded]:
    system = build(settings_for(tmp_path, auth={"enabled": False}), clock=SystemClock(str(offset_file)))
    system.loop.recover()
    yield system
    kill_steps_and_close(system)


def _job(lt: Embedded, job_id: str) -> dict[str, Any]:
    r = TestClient(lt.app).get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200
    return dict(r.json())


def _said(lt: Embedded, job_id: str, prefix: str) -> str | None:
    """The step's first log line that starts with `prefix`, if any."""
    r = TestClient(lt.app).get(f"/v1/jobs/{job_id}/steps/a/logs")
    lines = r.text.splitlines() if r.status_code == 200 else []
    return next((line for line in lines if line.startswith(prefix)), None)


@pytest.mark.parametrize(("wall_jump_s", "before_notice"), [(600.0, False), (-600.0, False), (-600.0, True)])
def test_a_step_under_notice_is_killed_at_its_deadline_whatever_the_wall_clock_does(
    lt: Embedded, offset_file: Path, wall_jump_s: float, before_notice: bool
) -> None:
    """Measured before: +300 s SIGKILLed a step 2.3 s into a 30 s grace; −600 s kept one alive
    45 s after its cancel. A jump before the notice must not change the grace the step reads in
    its notice file either (its deadline is on the wall clock the step sees)."""
    watch = ClockWatch(lt.clock)
    client = TestClient(lt.app)
    doc = {
        "name": "stubborn",
        "grace_seconds": GRACE_S,
        "steps": [{"name": "a", "command": STUBBORN, "gpus": 2}],
    }
    r = client.post("/v1/jobs", content=yaml.safe_dump(doc), headers={"Content-Type": "application/yaml"})
    assert r.status_code == 201, r.text
    job = r.json()["id"]
    tick_until(lt, lambda: _said(lt, job, "ready"), what="the step to run")
    if before_notice:
        jump(offset_file, wall_jump_s)
    assert client.post(f"/v1/jobs/{job}/cancel").status_code == 200
    noticed = time.monotonic()  # at or before the notice: its deadline is ≥ GRACE_S after this
    lt.loop.tick()  # gives notice
    assert _job(lt, job)["attempts"][0]["notice_at"] is not None
    said = tick_until(lt, lambda: _said(lt, job, "noticed"), what="the step to get SIGTERM")
    left = float(said.split(", ")[1].split(" ")[0])
    assert GRACE_S - 1.0 < left <= GRACE_S  # the grace it was given, not 600 s more or less
    if not before_notice:
        jump(offset_file, wall_jump_s)
    # Not killed early: through most of the grace, the step is still running.
    while time.monotonic() - noticed < GRACE_S - 1.0:  # each tick starts ≥ 1 s before the deadline
        lt.loop.tick()
        assert _job(lt, job)["steps"][0]["state"] == "CANCELLING"
        time.sleep(TICK_S)
    # Killed at the deadline, not a jump later.
    tick_until(
        lt, lambda: _job(lt, job)["steps"][0]["state"] == "CANCELLED", timeout=GRACE_S + 10, what="the kill"
    )
    ended = time.monotonic()
    assert ended - noticed < GRACE_S + 3.0  # the grace, the kill and a few ticks; nowhere near 600 s
    att = _job(lt, job)["attempts"][0]
    assert att["killed_at_deadline"] is True
    assert att["stop_deadline"] - att["notice_at"] == pytest.approx(GRACE_S)
    assert GRACE_S <= att["ended_at"] - att["notice_at"] < GRACE_S + 2.0  # on control time
    assert watch.check() == pytest.approx(wall_jump_s, abs=1.0)  # seen, logged and counted
    assert watch.jumps == 1
    # The ledger's intervals are on control time too: capacity × time, no jump in them.
    now = lt.clock.now()
    report = lt.store.usage_report(now - 60, now, group_by="holder")
    assert report.totals.research_gpu_seconds == pytest.approx(
        2 * (att["ended_at"] - att["started_at"]), abs=1e-3
    )
    assert report.totals.research_gpu_seconds < 2 * 60
    assert all(h.holder_kind == "idle" for h in lt.store.holdings())


# -- a replica starting across a jump ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_tagged(instance: str) -> None:
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.environ().get(REPLICA_TAG_ENV, "").split(" ", 1)[0] == instance:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.kill()


def test_a_starting_replica_is_not_timed_out_by_a_wall_clock_jump(tmp_path: Path, offset_file: Path) -> None:
    """Measured before: +120 s killed a replica that was starting normally."""
    clock = SystemClock(str(offset_file))
    instance = f"t{uuid.uuid4().hex[:10]}"
    manager = LocalServiceManager(instance, health_interval_s=0.05, http_timeout_s=2.0, stop_grace_s=5.0)
    port = _free_port()
    work = tmp_path / "chat-0"
    launch = ReplicaLaunch(
        replica_id="chat/0",
        service="chat",
        model="fake-8b",
        node="local",
        gpus=(0,),
        port=port,
        command=(sys.executable, FAKE_VLLM, "--port", str(port), "--model", "fake-8b", "--cold-start", "1.5"),
        env={"CUDA_VISIBLE_DEVICES": "0"},
        work_dir=str(work),
        log_path=str(work / "replica.log"),
        health_timeout_s=60.0,
    )
    try:
        manager.start(launch, clock.now())
        jump(offset_file, 120.0)
        events = wait_until(
            lambda: [e for e in manager.poll(clock.now()) if e.replica_id == "chat/0"],
            timeout=30,
            what="the replica's first event",
        )
        assert [e.kind for e in events] == ["healthy"], events
    finally:
        _kill_tagged(instance)
        manager.close()


# -- process identities across a real clock step ----------------------------------------------------


def test_a_stepped_wall_clock_does_not_disown_live_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux derives /proc/stat btime, and so psutil's create_time, from the wall clock: a step
    moves every process's create_time by the step, and a pid + create_time identity no longer
    matches (the supervisor would take its live steps for dead ones). Simulated here by moving
    the btime psutil reads (stepping the real clock needs root and would disturb the machine)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        identity = supervision.identify_child(child, [])
        assert supervision.same_process(identity) is not None
        real_btime = psutil.boot_time()
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: real_btime + 600.0)
        assert psutil.Process(child.pid).create_time() - identity.started_at > 599  # psutil moved
        assert supervision.same_process(identity) is not None  # ours did not
    finally:
        child.kill()
        child.wait()
    assert supervision.same_process(identity) is None


def test_the_boot_time_is_pinned_per_boot_in_the_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart after a step keeps counting from the boot time lowtide first saw in this boot."""
    path = tmp_path / "boot-time.json"
    real_btime = psutil.boot_time()
    monkeypatch.setattr(supervision, "_pinned", [])
    assert supervision.pin_boot_time(path) == real_btime  # recorded
    assert json.loads(path.read_text())["btime"] == real_btime
    monkeypatch.setattr(supervision, "_pinned", [])  # a restart...
    monkeypatch.setattr(psutil, "boot_time", lambda: real_btime + 600.0)  # ...after a +600 s step
    assert supervision.pin_boot_time(path) == real_btime
    monkeypatch.setattr(supervision, "_pinned", [])  # another boot: the record is replaced
    path.write_text(json.dumps({"boot_id": "another", "btime": 1.0}))
    assert supervision.pin_boot_time(path) == real_btime + 600.0
    assert json.loads(path.read_text())["btime"] == real_btime + 600.0


def test_a_restart_after_the_clock_went_back_starts_no_earlier_than_the_store(
    tmp_path: Path, offset_file: Path
) -> None:
    """The store holds times up to 600 s after what the wall clock now says (it was stepped back
    while lowtide was down): control time continues from there, so no interval runs backwards."""
    clock = SystemClock(str(offset_file))
    lt = build(settings_for(tmp_path, auth={"enabled": False}), clock=clock)
    try:
        recorded = clock.now() + 600
        lt.store.ensure_gpus(lt.nodes, recorded)  # the last handover before the restart
        keep_time_forward(lt)
        assert clock.now() >= recorded
        lt.loop.recover()
        lt.loop.tick()
        assert all(h.since <= clock.now() for h in lt.store.holdings())
        keep_time_forward(lt)  # a second call moves nothing
        assert clock.now() - recorded < 60
    finally:
        kill_steps_and_close(lt)
