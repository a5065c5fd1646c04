"""LocalServiceManager with real processes, real HTTP and real signals (no mocks).

Replicas are `tests/fixtures/fake_vllm.py` servers on free ports (a tiny stdlib stand-in for vLLM:
/health, /sleep, /wake_up, /is_sleeping, /v1/models, graceful SIGTERM, and options to misbehave).
Time is real: tests drive `poll(time.time())` in a bounded loop until the event they expect, and
assert what happened (events, details, processes, environment), never how long it took.
Every test uses its own instance id; a fixture SIGKILLs every process carrying one of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
import pytest

from lowtide.adapters.exit_watch import ExitWatcher
from lowtide.adapters.local_executor import TAG_ENV as STEP_TAG_ENV
from lowtide.adapters.local_services import (
    CHECK_THREAD_NAME,
    EXIT_FILE,
    REPLICA_TAG_ENV,
    SHIM_FILE,
    LocalServiceManager,
    Phase,
)
from lowtide.control.inference_ports import ReplicaEvent, ReplicaLaunch

FAKE = str(Path(__file__).resolve().parents[1] / "fixtures" / "fake_vllm.py")
T = TypeVar("T")


# -- helpers ---------------------------------------------------------------------------------------


def wait_until(condition: Callable[[], T | None], *, timeout: float = 20.0, what: str = "condition") -> T:
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_dead(*pids: int) -> None:
    wait_until(lambda: not any(alive(p) for p in pids), what=f"processes {pids} to end")


def tagged(instance: str) -> list[psutil.Process]:
    """Live processes carrying `instance`'s replica tag."""
    found = []
    for proc in psutil.process_iter():
        try:
            tag = proc.environ().get(REPLICA_TAG_ENV, "")
            if tag.split(" ", 1)[0] == instance and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


@dataclass
class Driver:
    """Polls a manager like the control loop does and keeps every event it reported."""

    manager: LocalServiceManager
    events: list[ReplicaEvent] = field(default_factory=list)
    seen: dict[str, int] = field(default_factory=dict)  # replica id -> events already returned

    def poll(self) -> list[ReplicaEvent]:
        new = self.manager.poll(time.time())
        self.events.extend(new)
        return new

    def of(self, replica_id: str) -> list[ReplicaEvent]:
        return [e for e in self.events if e.replica_id == replica_id]

    def next(self, replica_id: str, timeout: float = 20.0) -> ReplicaEvent:
        """The next event of `replica_id` not returned before."""

        def found() -> ReplicaEvent | None:
            self.poll()
            mine = self.of(replica_id)
            index = self.seen.get(replica_id, 0)
            if len(mine) > index:
                self.seen[replica_id] = index + 1
                return mine[index]
            return None

        return wait_until(found, timeout=timeout, what=f"an event of {replica_id}")


@dataclass
class World:
    root: Path
    instances: list[str] = field(default_factory=list)
    managers: list[LocalServiceManager] = field(default_factory=list)

    def instance(self) -> str:
        name = f"t{uuid.uuid4().hex[:10]}"
        self.instances.append(name)
        return name

    def manager(self, instance: str | None = None, **kwargs: Any) -> LocalServiceManager:
        options: dict[str, Any] = {"health_interval_s": 0.05, "http_timeout_s": 2.0, "stop_grace_s": 10.0}
        manager = LocalServiceManager(instance or self.instance(), **{**options, **kwargs})
        self.managers.append(manager)
        return manager

    def launch(
        self,
        replica_id: str,
        *fake_args: str,
        env: dict[str, str] | None = None,
        gpus: tuple[int, ...] = (0, 1),
        health_timeout_s: float = 20.0,
        port: int | None = None,
        command: tuple[str, ...] | None = None,
    ) -> ReplicaLaunch:
        port = port or free_port()
        work = self.root / replica_id.replace("/", "-")
        cmd = command or (
            sys.executable,
            FAKE,
            "--port",
            str(port),
            "--model",
            "fake-8b",
            "--info-file",
            str(work / "info.json"),
            *fake_args,
        )
        return ReplicaLaunch(
            replica_id=replica_id,
            service=replica_id.split("/", maxsplit=1)[0],
            model="fake-8b",
            node="local",
            gpus=gpus,
            port=port,
            command=cmd,
            env={"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if env is None else env,
            work_dir=str(work),
            log_path=str(work / "replica.log"),
            health_timeout_s=health_timeout_s,
        )


def info(launch: ReplicaLaunch) -> dict[str, Any]:
    """What the fake server recorded about itself once listening."""
    path = Path(launch.work_dir) / "info.json"
    wait_until(path.exists, what=f"{path}")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def fresh_info(launch: ReplicaLaunch, not_pid: int) -> dict[str, Any]:
    """The info of a new server process (after a restart), not the one with `not_pid`."""

    def new() -> dict[str, Any] | None:
        data = info(launch)
        return data if data["pid"] != not_pid else None

    return wait_until(new, what="the restarted server's info")


def get(launch: ReplicaLaunch, path: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{launch.port}{path}", timeout=5, trust_env=False)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    for instance in w.instances:
        procs = tagged(instance)
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(psutil.Error):
                proc.kill()
        wait_dead(*(p.pid for p in procs))
    for manager in w.managers:
        manager.close()
    assert not [t for t in threading.enumerate() if t.name == CHECK_THREAD_NAME]


# -- start and health ------------------------------------------------------------------------------


def test_start_reports_healthy_with_the_launch_environment(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STEP_TAG_ENV, "someone/1")  # the control plane's own tag must not leak
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    manager = world.manager()
    drive = Driver(manager)
    launch = world.launch(
        "chat/0", "--cold-start", "0.3", env={"CUDA_VISIBLE_DEVICES": "2,3", "EXTRA": "x"}, gpus=(2, 3)
    )
    manager.start(launch, time.time())
    assert manager.url("chat/0") == f"http://127.0.0.1:{launch.port}"
    assert manager.phase("chat/0") == Phase.STARTING

    event = drive.next("chat/0")
    assert (event.kind, event.detail) == ("healthy", "")
    assert manager.phase("chat/0") == Phase.HEALTHY
    card = get(launch, "/v1/models").json()["data"][0]
    assert card["cuda_visible_devices"] == "2,3"
    record = info(launch)
    assert record["cwd"] == launch.work_dir
    assert record["env"]["EXTRA"] == "x"
    assert record["env"][REPLICA_TAG_ENV] == f"{manager.instance_id} chat/0"
    assert STEP_TAG_ENV not in record["env"]
    assert (Path(launch.work_dir) / SHIM_FILE).exists()
    header = Path(launch.log_path).read_text().splitlines()[0]
    assert "replica chat/0" in header and f"port {launch.port}" in header and "gpus [2,3]" in header

    # Without CUDA_VISIBLE_DEVICES in the launch, the replica gets its GPUs, not ours (0..7).
    bare = world.launch("chat/1", env={}, gpus=(5, 4))
    manager.start(bare, time.time())
    assert drive.next("chat/1").kind == "healthy"
    assert get(bare, "/v1/models").json()["data"][0]["cuda_visible_devices"] == "4,5"


def test_start_of_a_running_replica_is_an_error_and_unknown_ids_are_refused(world: World) -> None:
    manager = world.manager()
    launch = world.launch("chat/0")
    manager.start(launch, time.time())
    with pytest.raises(ValueError, match="running"):
        manager.start(launch, time.time())
    with pytest.raises(ValueError, match="not managed"):
        manager.park("chat/9", "stop", time.time())
    with pytest.raises(ValueError, match="not managed"):
        manager.unpark("chat/9", time.time())
    assert manager.url("chat/9") is None
    assert Driver(manager).next("chat/0").kind == "healthy"
    with pytest.raises(ValueError, match="running"):
        manager.start(launch, time.time())


def test_never_healthy_fails_after_the_timeout_and_its_group_is_killed(world: World) -> None:
    manager = world.manager()
    drive = Driver(manager)
    launch = world.launch("chat/0", "--never-healthy", "--spawn-child", health_timeout_s=1.0)
    manager.start(launch, time.time())
    record = info(launch)
    shim = manager.pid("chat/0")
    assert shim is not None

    event = drive.next("chat/0")
    assert event.kind == "failed"
    assert "not healthy within 1s" in event.detail
    assert "HTTP 503" in event.detail  # the last check's outcome, for the operator
    assert manager.phase("chat/0") == Phase.FAILED
    assert manager.url("chat/0") is None
    # `failed` is only reported once the process is gone, its leftovers included.
    assert not alive(shim) and not alive(record["pid"]) and not alive(record["child_pid"])
    assert tagged(manager.instance_id) == []


def test_a_crash_is_reported_with_its_exit_code(world: World) -> None:
    manager = world.manager()
    drive = Driver(manager)
    serving = world.launch("chat/0", "--crash-after", "1", "--crash-code", "7")
    booting = world.launch("chat/1", "--cold-start", "100", "--crash-after", "0.2", "--crash-code", "9")
    manager.start(serving, time.time())
    manager.start(booting, time.time())

    assert drive.next("chat/0").kind == "healthy"
    crashed = drive.next("chat/0")
    assert (crashed.kind, crashed.detail) == ("failed", "process exited with code 7 while healthy")
    early = drive.next("chat/1")
    assert (early.kind, early.detail) == ("failed", "process exited with code 9 while starting")
    assert manager.url("chat/0") is None

    # A failed replica may be started again.
    manager.start(world.launch("chat/0", port=serving.port), time.time())
    assert drive.next("chat/0").kind == "healthy"


def test_a_replica_that_cannot_start_fails_on_the_next_poll(world: World) -> None:
    manager = world.manager()
    drive = Driver(manager)
    missing = world.launch("chat/0", command=("no-such-vllm-binary", "serve"))
    manager.start(missing, time.time())
    event = drive.next("chat/0")
    assert (event.kind, event.detail) == ("failed", "command not found on PATH: no-such-vllm-binary")

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        taken = world.launch("chat/1", port=port)
        manager.start(taken, time.time())
        event = drive.next("chat/1")
        assert (event.kind, event.detail) == ("failed", f"port {port} is already in use")
        assert not (Path(taken.work_dir) / "info.json").exists()  # never started
    manager.start(taken, time.time())  # the port is free again
    assert drive.next("chat/1").kind == "healthy"


# -- park and unpark -------------------------------------------------------------------------------


def test_sleep_then_wake_keeps_the_same_process(world: World) -> None:
    manager = world.manager()
    drive = Driver(manager)
    launch = world.launch("chat/0", "--sleep-delay", "0.3", "--wake-delay", "0.3")
    manager.start(launch, time.time())
    assert drive.next("chat/0").kind == "healthy"
    pid = info(launch)["pid"]

    manager.park("chat/0", "sleep", time.time())
    assert manager.phase("chat/0") == Phase.SLEEPING
    assert drive.next("chat/0").kind == "asleep"
    assert get(launch, "/is_sleeping").json() == {"is_sleeping": True}
    assert manager.url("chat/0") is not None  # the process is still there
    manager.park("chat/0", "sleep", time.time())  # parking a parked replica says so again
    assert drive.next("chat/0").kind == "asleep"

    manager.unpark("chat/0", time.time())
    assert manager.phase("chat/0") == Phase.WAKING
    assert drive.next("chat/0").kind == "healthy"
    assert get(launch, "/is_sleeping").json() == {"is_sleeping": False}
    assert info(launch)["pid"] == pid and alive(pid)
    log = Path(launch.log_path).read_text()
    assert "POST /sleep?level=1" in log and "POST /wake_up" in log


def test_stop_then_unpark_starts_a_new_process(world: World) -> None:
    manager = world.manager()
    drive = Driver(manager)
    launch = world.launch("chat/0", "--spawn-child", env={"CUDA_VISIBLE_DEVICES": "1"}, gpus=(1,))
    manager.start(launch, time.time())
    assert drive.next("chat/0").kind == "healthy"
    first = info(launch)
    shim = manager.pid("chat/0")
    assert shim is not None

    manager.park("chat/0", "stop", time.time())
    event = drive.next("chat/0")
    assert (event.kind, event.detail) == ("stopped", "exited with code 0")
    assert manager.url("chat/0") is None
    # The child that ignored SIGTERM (like an engine core) did not outlive the replica.
    assert not alive(shim) and not alive(first["pid"]) and not alive(first["child_pid"])
    status = json.loads((Path(launch.work_dir) / EXIT_FILE).read_text())
    assert status["exit_code"] == 0
    manager.park("chat/0", "stop", time.time())  # idempotent
    assert drive.next("chat/0").kind == "stopped"

    manager.unpark("chat/0", time.time())
    assert drive.next("chat/0").kind == "healthy"
    second = fresh_info(launch, first["pid"])
    assert second["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert manager.pid("chat/0") not in (None, shim)
    manager.unpark("chat/0", time.time())  # serving already: says so again
    assert drive.next("chat/0").kind == "healthy"


def test_a_replica_ignoring_sigterm_is_killed_after_the_grace(world: World) -> None:
    manager = world.manager(stop_grace_s=0.5)
    drive = Driver(manager)
    launch = world.launch("chat/0", "--ignore-sigterm")
    manager.start(launch, time.time())
    assert drive.next("chat/0").kind == "healthy"
    pid = info(launch)["pid"]

    manager.park("chat/0", "stop", time.time())
    event = drive.next("chat/0")
    assert event.kind == "stopped"
    assert event.detail == "was killed by SIGKILL (SIGKILLed after the 0.5s stop grace)"
    assert not alive(pid)


def test_sleep_falls_back_to_stop_when_the_server_refuses_it(world: World) -> None:
    manager = world.manager()
    drive = Driver(manager)
    launch = world.launch("chat/0", "--no-sleep-mode")
    manager.start(launch, time.time())
    assert drive.next("chat/0").kind == "healthy"
    pid = info(launch)["pid"]

    manager.park("chat/0", "sleep", time.time())
    event = drive.next("chat/0")
    assert event.kind == "stopped"
    assert event.detail.startswith(
        "POST /sleep answered HTTP 404: vLLM serves it only with VLLM_SERVER_DEV_MODE=1"
    )
    assert event.detail.endswith("stopped instead of put to sleep; exited with code 0")
    assert not alive(pid)
    manager.unpark("chat/0", time.time())  # parked as stopped: starts again
    assert drive.next("chat/0").kind == "healthy"


def test_sleep_while_starting_stops_instead(world: World) -> None:
    manager = world.manager()
    drive = Driver(manager)
    launch = world.launch("chat/0", "--cold-start", "100")
    manager.start(launch, time.time())
    pid = info(launch)["pid"]
    manager.park("chat/0", "sleep", time.time())
    event = drive.next("chat/0")
    assert event.kind == "stopped"
    assert event.detail == "not serving yet, so stopped instead of put to sleep; exited with code 0"
    assert not alive(pid)


def test_sleep_that_never_completes_fails_and_kills(world: World) -> None:
    manager = world.manager()
    drive = Driver(manager)
    launch = world.launch("chat/0", "--sleep-delay", "1000", health_timeout_s=1.0)
    manager.start(launch, time.time())
    assert drive.next("chat/0").kind == "healthy"
    pid = info(launch)["pid"]
    manager.park("chat/0", "sleep", time.time())
    with pytest.raises(ValueError, match="being parked"):
        manager.unpark("chat/0", time.time())
    event = drive.next("chat/0")
    assert event.kind == "failed"
    assert event.detail.startswith(
        "not asleep within 1s (last is_sleeping check: HTTP 200, is_sleeping=false"
    )
    assert not alive(pid)
    manager.park("chat/0", "stop", time.time())  # a failed replica stays failed
    assert drive.next("chat/0").kind == "failed"


# -- the loop is never blocked ---------------------------------------------------------------------


def test_a_hanging_health_endpoint_blocks_neither_poll_nor_other_replicas(world: World) -> None:
    # Requests may take 60 s; the hanging replica's deadline is 1.5 s. If poll waited for HTTP, the
    # other replica could not become healthy while the hanging request is outstanding, and the
    # hanging one could not fail before its request timed out.
    manager = world.manager(http_timeout_s=60.0)
    drive = Driver(manager)
    hanging = world.launch("chat/0", "--hang", health_timeout_s=1.5)
    good = world.launch("chat/1", "--cold-start", "0.3")
    manager.start(hanging, time.time())
    wait_until(
        lambda: (drive.poll(), "hanging on GET /health" in Path(hanging.log_path).read_text())[1],
        what="the hanging server to hold a health check",
    )
    manager.start(good, time.time())
    assert drive.next("chat/1").kind == "healthy"
    assert drive.of("chat/0") == []  # still checking: its request has not come back
    assert "hanging on GET /health" in Path(hanging.log_path).read_text()

    event = drive.next("chat/0")
    assert event.kind == "failed"
    assert event.detail.startswith("not healthy within 1.5s (last health check still unanswered after ")
    assert drive.of("chat/1")[-1].kind == "healthy"  # the other one is untouched
    assert manager.phase("chat/1") == Phase.HEALTHY


def test_one_bad_replica_never_affects_the_others(world: World) -> None:
    manager = world.manager()
    drive = Driver(manager)
    launches = {
        "a/0": world.launch("a/0"),
        "a/1": world.launch("a/1", "--never-healthy", health_timeout_s=1.0),
        "a/2": world.launch("a/2", "--cold-start", "100", "--crash-after", "0.3"),
        "a/3": world.launch("a/3", command=("/nonexistent/vllm",)),
        "a/4": world.launch("a/4", "--cold-start", "0.5"),
    }
    for launch in launches.values():
        manager.start(launch, time.time())
    kinds = {rid: drive.next(rid).kind for rid in launches}
    assert kinds == {"a/0": "healthy", "a/1": "failed", "a/2": "failed", "a/3": "failed", "a/4": "healthy"}
    assert manager.phase("a/0") == manager.phase("a/4") == Phase.HEALTHY


# -- control-plane restarts ------------------------------------------------------------------------


def test_adopt_after_close_rechecks_and_controls_the_replicas(world: World) -> None:
    instance = world.instance()
    first = world.manager(instance)
    drive = Driver(first)
    serving = world.launch("chat/0")
    sleeping = world.launch("chat/1")
    for launch in (serving, sleeping):
        first.start(launch, time.time())
        assert drive.next(launch.replica_id).kind == "healthy"
    first.park("chat/1", "sleep", time.time())
    assert drive.next("chat/1").kind == "asleep"
    pids = {rid: first.pid(rid) for rid in ("chat/0", "chat/1")}
    first.close()  # the control plane goes away; the replicas keep running
    assert get(serving, "/health").status_code == 200
    assert all(pid is not None and alive(pid) for pid in pids.values())

    second = world.manager(instance)
    redrive = Driver(second)
    assert second.adopt("chat/0", serving, time.time())
    assert second.adopt("chat/1", sleeping, time.time())
    assert second.adopt("chat/0", serving, time.time())  # already watched
    assert second.phase("chat/0") == Phase.CHECKING
    assert second.url("chat/0") == f"http://127.0.0.1:{serving.port}"
    assert redrive.next("chat/0").kind == "healthy"
    assert redrive.next("chat/1").kind == "asleep"
    assert second.pid("chat/0") == pids["chat/0"]

    second.unpark("chat/1", time.time())
    assert redrive.next("chat/1").kind == "healthy"
    second.park("chat/0", "stop", time.time())  # signals a group it did not start
    event = redrive.next("chat/0")
    assert (event.kind, event.detail) == ("stopped", "exited with code 0")
    pid0 = pids["chat/0"]
    assert pid0 is not None and not alive(pid0)

    # An adopted replica that dies is reported with the status its shim recorded.
    os.kill(info(sleeping)["pid"], signal.SIGKILL)
    event = redrive.next("chat/1")
    assert (event.kind, event.detail) == ("failed", "process was killed by SIGKILL while healthy")


def test_adopt_reports_gone_replicas(world: World) -> None:
    instance = world.instance()
    first = world.manager(instance)
    drive = Driver(first)
    exited = world.launch("chat/0", "--crash-after", "0.5", "--crash-code", "4")
    killed = world.launch("chat/1")
    for launch in (exited, killed):
        first.start(launch, time.time())
        assert drive.next(launch.replica_id).kind == "healthy"
    shim = first.pid("chat/1")
    first.close()
    assert shim is not None
    os.killpg(shim, signal.SIGKILL)
    exit_file = Path(exited.work_dir) / EXIT_FILE
    wait_until(exit_file.exists, what="the crashed replica's exit record")
    wait_dead(shim)

    second = world.manager(instance)
    assert not second.adopt("chat/0", exited, time.time())  # ended while nobody watched
    assert not second.adopt("chat/1", killed, time.time())  # vanished
    assert not second.adopt("chat/2", world.launch("chat/2"), time.time())  # never existed
    assert second.phase("chat/0") is None
    assert Driver(second).poll() == []
    with pytest.raises(ValueError, match="not 'chat/1'"):
        second.adopt("chat/1", exited, time.time())


def test_adopt_finds_the_shim_without_its_file_but_never_another_instances(world: World) -> None:
    instance = world.instance()
    first = world.manager(instance)
    drive = Driver(first)
    launch = world.launch("chat/0")
    first.start(launch, time.time())
    assert drive.next("chat/0").kind == "healthy"
    first.close()

    stranger = world.manager()  # another installation, same replica id and work dir
    assert not stranger.adopt("chat/0", launch, time.time())
    assert get(launch, "/health").status_code == 200  # and it did not touch the replica

    (Path(launch.work_dir) / SHIM_FILE).unlink()  # as if the control plane died right after spawning
    second = world.manager(instance)
    assert second.adopt("chat/0", launch, time.time())
    assert Driver(second).next("chat/0").kind == "healthy"


def test_reap_orphans_kills_only_unknown_replicas_of_this_instance(world: World) -> None:
    instance = world.instance()
    first = world.manager(instance)
    other = world.manager()
    drive, other_drive = Driver(first), Driver(other)
    keep = world.launch("chat/0")
    orphan = world.launch("chat/1", "--spawn-child")
    foreign = world.launch("chat/2")
    first.start(keep, time.time())
    first.start(orphan, time.time())
    other.start(foreign, time.time())
    assert drive.next("chat/0").kind == "healthy"
    assert drive.next("chat/1").kind == "healthy"
    assert other_drive.next("chat/2").kind == "healthy"
    orphan_info = info(orphan)
    first.close()

    second = world.manager(instance)
    assert second.reap_orphans({"chat/0"}) == ["chat/1"]
    wait_dead(orphan_info["pid"], orphan_info["child_pid"])
    assert get(keep, "/health").status_code == 200
    assert get(foreign, "/health").status_code == 200
    assert second.reap_orphans({"chat/0"}) == []
    assert {p.environ()[REPLICA_TAG_ENV] for p in tagged(instance)} == {f"{instance} chat/0"}


def test_a_wake_is_posted_at_once_and_its_answer_nudges_the_loop(world: World) -> None:
    """unpark sends POST /wake_up itself (no poll needed), and the answers that move the replica
    on (wake done, then awake and healthy) call `on_progress`, so the loop polls without a tick."""
    nudged = threading.Event()
    manager = world.manager(on_progress=nudged.set)
    drive = Driver(manager)
    # Awake as soon as the POST is answered, as vLLM does (it answers /wake_up when done).
    launch = world.launch("chat/0", "--wake-delay", "0")
    manager.start(launch, time.time())
    assert drive.next("chat/0").kind == "healthy"
    manager.park("chat/0", "sleep", time.time())
    assert drive.next("chat/0").kind == "asleep"

    nudged.clear()
    manager.unpark("chat/0", time.time())  # no poll after this until the nudge
    assert nudged.wait(10), "the POST /wake_up answer did not nudge"
    assert "POST /wake_up" in Path(launch.log_path).read_text()
    nudged.clear()
    assert drive.poll() == []  # collects the POST's answer; asks /is_sleeping + /health at once
    assert nudged.wait(10), "the awake-and-healthy answer did not nudge"
    assert [e.kind for e in drive.poll()] == ["healthy"]


def test_a_replica_exit_is_heard_through_the_exit_watcher(world: World) -> None:
    exited = threading.Event()
    watcher = ExitWatcher(exited.set)
    try:
        manager = world.manager(watcher=watcher)
        drive = Driver(manager)
        launch = world.launch("chat/0")
        manager.start(launch, time.time())
        assert drive.next("chat/0").kind == "healthy"
        os.kill(info(launch)["pid"], signal.SIGKILL)  # the server dies; its shim follows
        assert exited.wait(10), "the replica's end did not wake anybody"
        assert drive.next("chat/0").kind == "failed"
    finally:
        watcher.close()
