"""LocalExecutor and the step shim with real processes, files and signals (no mocks).

Steps are small `python -c` scripts. Time is real here (processes run on the wall clock), so the
tests wait for conditions with a bounded poll instead of sleeping, and assert no durations.
Every test gets its own instance id; a fixture SIGKILLs every process group the test started.
No container engine runs here: the container path is exercised with a fake `docker` client script.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import psutil
import pytest

from lowtide.adapters.container import ADD_HOST_GATEWAY, ContainerRuntime
from lowtide.adapters.local_executor import TAG_ENV, LocalExecutor
from lowtide.control.executor_port import (
    AdoptOutcome,
    AdoptRequest,
    AttemptExit,
    ExecutorError,
    LaunchRequest,
    ProcessIdentity,
)

PY = sys.executable
T = TypeVar("T")


# -- helpers ---------------------------------------------------------------------------------


def wait_until(condition: Callable[[], T | None], *, timeout: float = 10.0, what: str = "condition") -> T:
    """Poll `condition` on the real clock until it returns something truthy (bounded)."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@dataclass
class Loop:
    """Drives an executor like the control loop does, collecting every reported exit."""

    executor: LocalExecutor
    exits: dict[int, AttemptExit] = field(default_factory=dict)

    def poll(self) -> None:
        for e in self.executor.poll(time.time()).exits:
            assert e.attempt_id not in self.exits, "an exit was reported twice after its ack"
            self.exits[e.attempt_id] = e
            self.executor.ack_exit(e.attempt_id)  # as the loop does once the store has it

    def wait_exit(self, attempt_id: int, timeout: float = 10.0) -> AttemptExit:
        def done() -> AttemptExit | None:
            self.poll()
            return self.exits.get(attempt_id)

        return wait_until(done, timeout=timeout, what=f"exit of attempt {attempt_id}")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_dead(*pids: int) -> None:
    wait_until(lambda: not any(alive(p) for p in pids), what=f"processes {pids} to die")


def group_members(pgid: int) -> list[int]:
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


def script(body: str) -> tuple[str, ...]:
    return (PY, "-c", textwrap.dedent(body))


WAIT_FOR_GO = """
    import pathlib, sys, time
    pathlib.Path("ready").touch()
    while not pathlib.Path("go").exists():
        time.sleep(0.02)
    sys.exit({code})
"""

STUBBORN = """
    import os, pathlib, signal, subprocess, time
    print("cvd=" + os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "1000"])  # inherits the ignored SIGTERM
    pathlib.Path("grandchild.pid").write_text(str(child.pid))
    pathlib.Path("ready").touch()
    while True:
        time.sleep(0.05)
"""

CHECKPOINTS_ON_SIGTERM = """
    import os, pathlib, signal, sys, time
    def on_term(signum, frame):
        ckpt = pathlib.Path(os.environ["LOWTIDE_CHECKPOINT_DIR"])
        ckpt.mkdir(parents=True, exist_ok=True)
        notice = pathlib.Path(os.environ["LOWTIDE_NOTICE_FILE"])
        (ckpt / "LATEST").write_text(notice.read_text())
        sys.exit(3)  # non-zero: interrupted, not done (docs/architecture.md §6.2)
    signal.signal(signal.SIGTERM, on_term)
    pathlib.Path("ready").touch()
    while True:
        time.sleep(0.05)
"""

SLEEP_FOREVER = """
    import pathlib, time
    pathlib.Path("ready").touch()
    while True:
        time.sleep(0.05)
"""


@dataclass
class Env:
    """A test's world: a root directory, unique instance ids, and everything to clean up."""

    root: Path
    pgids: set[int] = field(default_factory=set)
    instances: list[str] = field(default_factory=list)
    executors: list[LocalExecutor] = field(default_factory=list)
    strangers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def instance(self) -> str:
        name = f"test-{uuid.uuid4().hex[:10]}"
        self.instances.append(name)
        return name

    def executor(self, instance: str | None = None, **kwargs: object) -> LocalExecutor:
        executor = LocalExecutor(instance or self.instance(), **kwargs)  # type: ignore[arg-type]
        self.executors.append(executor)
        return executor

    def request(
        self,
        attempt_id: int,
        command: tuple[str, ...],
        *,
        gpus: tuple[int, ...] = (),
        env: Mapping[str, str] | None = None,
        image: str | None = None,
        contract: bool = True,
    ) -> LaunchRequest:
        work = self.root / f"attempt-{attempt_id}"
        base_env = (
            {
                "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
                "LOWTIDE_JOB_ID": "job-1",
                "LOWTIDE_STEP": "train",
                "LOWTIDE_ATTEMPT": "1",
                "LOWTIDE_NOTICE_FILE": str(work / "NOTICE"),
                "LOWTIDE_CHECKPOINT_DIR": str(self.root / "ckpt" / str(attempt_id)),
            }
            if contract
            else {}
        )
        return LaunchRequest(
            attempt_id=attempt_id,
            job_id="job-1",
            step="train",
            attempt=1,
            node="local",
            gpus=gpus,
            command=command,
            image=image,
            env={**base_env, **(env or {})},
            work_dir=str(work),
            log_path=str(work / "log"),
            notice_path=str(work / "NOTICE"),
        )

    def launch(self, executor: LocalExecutor, req: LaunchRequest) -> ProcessIdentity:
        handle = executor.launch(req, time.time())
        assert handle.running_at is not None  # a local process runs from its launch
        identity = ProcessIdentity.from_handle(handle)
        assert identity is not None, handle
        self.pgids.add(identity.pid)
        return identity

    def cleanup(self) -> None:
        for stranger in self.strangers:
            stranger.kill()
            stranger.wait(timeout=10)
        for pgid in self.pgids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        # Anything a step started, wherever it went, carries its instance in the executor's tag.
        stray: set[int] = set()
        for proc in psutil.process_iter():
            try:
                tag = proc.environ().get(TAG_ENV, "")
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if tag.rpartition("/")[0] in self.instances:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
                    stray.add(proc.pid)
        wait_until(lambda: not any(alive(p) for p in self.pgids | stray), what="test processes to die")
        for executor in self.executors:
            executor.close()  # reaps what it can; nothing is left running


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    world = Env(root=tmp_path)
    try:
        yield world
    finally:
        world.cleanup()


def ready(req: LaunchRequest) -> Callable[[], bool]:
    return (Path(req.work_dir) / "ready").exists


def go(req: LaunchRequest) -> None:
    (Path(req.work_dir) / "go").touch()


def unrelated_process(env: Env) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    env.strangers.append(proc)
    return proc


# -- running a step --------------------------------------------------------------------------


def test_the_step_sees_its_contract_and_its_output_is_logged(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOWTIDE_STEP", "inherited-and-wrong")
    monkeypatch.setenv("FROM_CONTROL_PLANE", "yes")
    ex = env.executor()
    req = env.request(
        1,
        script("""
            import json, os, sys
            keep = {k: v for k, v in os.environ.items() if k.startswith(("LOWTIDE_", "CUDA_", "FROM_"))}
            keep["cwd"] = os.getcwd()
            keep["pgid"] = os.getpgid(0)
            keep["sid"] = os.getsid(0)
            json.dump(keep, open("env.json", "w"))
            print("hello on stdout", flush=True)
            print("hello on stderr", file=sys.stderr)
        """),
        gpus=(2, 3),
    )
    identity = env.launch(ex, req)
    assert identity.pid > 0
    shim = json.loads((Path(req.work_dir) / "shim.json").read_text())
    assert (shim["pid"], shim["started_at"]) == (identity.pid, identity.started_at)

    done = Loop(ex).wait_exit(1)
    assert (done.exit_code, done.signal, done.killed_at_deadline) == (0, None, False)

    seen = json.loads((Path(req.work_dir) / "env.json").read_text())
    assert seen["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert seen["LOWTIDE_JOB_ID"] == "job-1"
    assert seen["LOWTIDE_STEP"] == "train"  # the request wins over the control plane's environment
    assert seen["LOWTIDE_ATTEMPT"] == "1"
    assert seen["LOWTIDE_NOTICE_FILE"] == req.notice_path
    assert "FROM_CONTROL_PLANE" not in seen  # a clean environment: only the allowlist passes
    assert seen["cwd"] == req.work_dir
    # The step shares the shim's group, and the shim leads its own session.
    assert seen["pgid"] == identity.pid == seen["sid"]

    log = Path(req.log_path).read_text().splitlines()
    assert log[0].startswith("=== lowtide")
    assert "hello on stdout" in log
    assert "hello on stderr" in log
    assert log[-1] == "=== lowtide: step exited with code 0"


def test_gpus_are_pinned_even_when_the_request_env_omits_them(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")  # the control plane sees everything
    ex = env.executor()
    step = script("import os; open('cvd', 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])")
    req = env.request(1, step, gpus=(5,), contract=False)
    env.launch(ex, req)
    Loop(ex).wait_exit(1)
    assert (Path(req.work_dir) / "cvd").read_text() == "5"


def test_non_zero_exit_is_reported(env: Env) -> None:
    ex = env.executor()
    env.launch(ex, env.request(1, ("sh", "-c", "echo failing; exit 42")))
    done = Loop(ex).wait_exit(1)
    assert (done.exit_code, done.signal) == (42, None)


def test_a_step_killed_by_a_signal_reports_the_signal(env: Env) -> None:
    ex = env.executor()
    env.launch(ex, env.request(1, ("sh", "-c", "kill -SEGV $$")))
    done = Loop(ex).wait_exit(1)
    assert (done.exit_code, done.signal) == (None, signal.SIGSEGV)


LEAVES_LEFTOVERS = (
    "sh",
    "-c",
    # One leftover in the step's group, one that left it (its own session).
    "sleep 1000 & echo $! > bg.pid; setsid sleep 1000 & echo $! > escaped.pid; exit 0",
)


def leftovers(req: LaunchRequest) -> list[int]:
    return [int((Path(req.work_dir) / f).read_text()) for f in ("bg.pid", "escaped.pid")]


def test_leftover_descendants_are_swept_when_the_step_exits(env: Env) -> None:
    ex = env.executor()
    req = env.request(1, LEAVES_LEFTOVERS)
    identity = env.launch(ex, req)
    done = Loop(ex).wait_exit(1)
    assert done.exit_code == 0
    wait_dead(*leftovers(req))
    wait_until(lambda: not group_members(identity.pid), what="the group to be empty")


# -- launch errors ---------------------------------------------------------------------------


def test_a_command_not_on_path_is_a_permanent_launch_error(env: Env) -> None:
    ex = env.executor()
    with pytest.raises(ExecutorError) as err:
        ex.launch(env.request(1, ("no-such-command-lowtide-test",)), time.time())
    assert err.value.temporary is False
    assert ex.watched() == set()


def test_an_unexecutable_command_is_recorded_as_127_by_the_shim(env: Env) -> None:
    # Passes the launch check (an executable file) but exec fails: its interpreter does not exist.
    broken = env.root / "broken.sh"
    broken.write_text("#!/nonexistent/interpreter\n")
    broken.chmod(0o755)
    ex = env.executor()
    req = env.request(1, (str(broken),))
    env.launch(ex, req)
    done = Loop(ex).wait_exit(1)
    assert (done.exit_code, done.signal) == (127, None)
    assert json.loads((Path(req.work_dir) / "exit_status.json").read_text())["exit_code"] == 127
    assert "cannot execute" in Path(req.log_path).read_text()


@pytest.mark.parametrize(("make", "code"), [("missing", 127), ("not-executable", 126)])
def test_the_shim_records_exec_failures(env: Env, make: str, code: int) -> None:
    target = env.root / "cmd"
    if make == "not-executable":
        target.write_text("#!/bin/sh\nexit 0\n")
        target.chmod(0o644)
    exit_file = env.root / "exit_status.json"
    with (env.root / "log").open("wb") as log:
        proc = subprocess.run(
            [PY, "-I", "-m", "lowtide.adapters.step_shim", "--instance", "x", "--attempt", "1",
             "--exit-file", str(exit_file), "--", str(target)],
            stdout=log, stderr=subprocess.STDOUT, timeout=30, check=False,
        )  # fmt: skip
    assert proc.returncode == code
    assert json.loads(exit_file.read_text())["exit_code"] == code
    assert "lowtide step_shim: cannot execute" in (env.root / "log").read_text()


def test_launching_the_same_attempt_twice_is_refused(env: Env) -> None:
    ex = env.executor()
    req = env.request(1, script(SLEEP_FOREVER))
    env.launch(ex, req)
    with pytest.raises(ExecutorError):
        ex.launch(req, time.time())


# -- stopping --------------------------------------------------------------------------------


def test_notice_then_sigterm_lets_the_step_checkpoint_and_exit(env: Env) -> None:
    ex = env.executor()
    req = env.request(1, script(CHECKPOINTS_ON_SIGTERM))
    env.launch(ex, req)
    wait_until(ready(req), what="step ready")
    deadline = time.time() + 60
    ex.notify_stop(1, deadline, time.time(), reason="inference needs the GPUs")

    done = Loop(ex).wait_exit(1)
    assert (done.exit_code, done.signal, done.killed_at_deadline) == (3, None, False)
    notice = json.loads(Path(req.notice_path).read_text())
    assert notice["deadline"] == deadline
    assert notice["reason"] == "inference needs the GPUs"
    assert "deadline_iso" in notice and "given_at" in notice
    checkpoint = json.loads((env.root / "ckpt" / "1" / "LATEST").read_text())
    assert checkpoint["deadline"] == deadline  # the step read the notice when SIGTERM came


def test_a_notice_the_crashed_control_plane_did_not_give_is_given_on_adoption(env: Env) -> None:
    instance = env.instance()
    a = env.executor(instance)
    req = env.request(1, script(CHECKPOINTS_ON_SIGTERM))
    identity = env.launch(a, req)
    wait_until(ready(req), what="step ready")
    a.close()  # crashed after recording the deadline, before writing the notice and signalling

    b = env.executor(instance)
    deadline = time.time() + 60
    result = b.adopt(adopt_request(req, identity, deadline=deadline), time.time())
    assert result.outcome is AdoptOutcome.ADOPTED
    done = Loop(b).wait_exit(1)
    assert (done.exit_code, done.killed_at_deadline) == (3, False)
    assert json.loads(Path(req.notice_path).read_text())["deadline"] == deadline


def test_a_second_notice_may_only_shorten_the_deadline(env: Env) -> None:
    ex = env.executor()
    req = env.request(1, script(STUBBORN))
    env.launch(ex, req)
    wait_until(ready(req), what="step ready")
    now = time.time()
    ex.notify_stop(1, now + 100, now)
    ex.notify_stop(1, now + 200, now)
    assert json.loads(Path(req.notice_path).read_text())["deadline"] == now + 100
    ex.notify_stop(1, now + 50, now)
    assert json.loads(Path(req.notice_path).read_text())["deadline"] == now + 50


def test_notice_for_an_unknown_attempt_is_an_error(env: Env) -> None:
    with pytest.raises(ExecutorError):
        env.executor().notify_stop(99, time.time() + 10, time.time())


def test_a_step_that_ignores_sigterm_is_killed_with_its_group_at_the_deadline(env: Env) -> None:
    ex = env.executor()
    req = env.request(1, script(STUBBORN))
    identity = env.launch(ex, req)
    wait_until(ready(req), what="step ready")
    grandchild = int((Path(req.work_dir) / "grandchild.pid").read_text())
    loop = Loop(ex)
    ex.notify_stop(1, time.time() + 0.3, time.time())
    loop.poll()
    assert 1 not in loop.exits  # still inside its grace period

    done = loop.wait_exit(1)
    assert done.killed_at_deadline is True
    assert (done.exit_code, done.signal) == (None, signal.SIGKILL)
    wait_dead(grandchild)
    wait_until(lambda: not group_members(identity.pid), what="the whole group to be gone")


# -- adoption after a control-plane crash ----------------------------------------------------


def adopt_request(
    req: LaunchRequest, identity: ProcessIdentity | None, deadline: float | None = None
) -> AdoptRequest:
    return AdoptRequest(
        attempt_id=req.attempt_id,
        work_dir=req.work_dir,
        notice_path=req.notice_path,
        handle=None if identity is None else identity.handle(running_at=identity.started_at),
        stop_deadline=deadline,
    )


def test_a_new_control_plane_adopts_a_running_step_and_reads_its_exit(env: Env) -> None:
    instance = env.instance()
    a = env.executor(instance)
    req = env.request(1, script(WAIT_FOR_GO.format(code=5)))
    identity = env.launch(a, req)
    wait_until(ready(req), what="step ready")
    a.close()  # the control plane "crashes": nothing is stopped

    b = env.executor(instance)
    result = b.adopt(adopt_request(req, identity), time.time())
    assert result.outcome is AdoptOutcome.ADOPTED
    assert result.handle is not None and ProcessIdentity.from_handle(result.handle) == identity
    loop = Loop(b)
    loop.poll()
    assert loop.exits == {}
    go(req)
    done = loop.wait_exit(1)
    assert (done.exit_code, done.signal) == (5, None)


@pytest.mark.parametrize("keep_shim_file", [True, False])
def test_adoption_without_a_recorded_pid_finds_the_shim(env: Env, keep_shim_file: bool) -> None:
    instance = env.instance()
    a = env.executor(instance)
    req = env.request(1, script(WAIT_FOR_GO.format(code=0)))
    identity = env.launch(a, req)
    wait_until(ready(req), what="step ready")
    a.close()
    if not keep_shim_file:
        (Path(req.work_dir) / "shim.json").unlink()  # only the command line is left to go by

    b = env.executor(instance)
    result = b.adopt(adopt_request(req, None), time.time())
    assert result.outcome is AdoptOutcome.ADOPTED
    assert result.handle is not None and result.handle.ref == str(identity.pid)
    go(req)
    assert Loop(b).wait_exit(1).exit_code == 0


def test_adoption_of_a_step_that_finished_meanwhile_reports_its_status(env: Env) -> None:
    instance = env.instance()
    a = env.executor(instance)
    req = env.request(1, ("sh", "-c", "exit 9"))
    identity = env.launch(a, req)
    wait_until((Path(req.work_dir) / "exit_status.json").exists, what="exit file")
    a.close()

    result = env.executor(instance).adopt(adopt_request(req, identity), time.time())
    assert result.outcome is AdoptOutcome.EXITED
    assert result.exit is not None
    assert (result.exit.attempt_id, result.exit.exit_code, result.exit.signal) == (1, 9, None)


def test_adopting_a_finished_step_sweeps_what_it_left_behind(env: Env) -> None:
    instance = env.instance()
    a = env.executor(instance)
    req = env.request(1, LEAVES_LEFTOVERS)
    identity = env.launch(a, req)
    wait_until((Path(req.work_dir) / "exit_status.json").exists, what="exit file")
    a.close()
    assert all(alive(pid) for pid in leftovers(req))  # nobody was watching

    result = env.executor(instance).adopt(adopt_request(req, identity), time.time())
    assert result.outcome is AdoptOutcome.EXITED
    wait_dead(*leftovers(req))


def test_adopting_past_the_deadline_kills_at_the_next_poll(env: Env) -> None:
    instance = env.instance()
    a = env.executor(instance)
    req = env.request(1, script(STUBBORN))
    identity = env.launch(a, req)
    wait_until(ready(req), what="step ready")
    a.close()

    b = env.executor(instance)
    result = b.adopt(adopt_request(req, identity, deadline=time.time() - 1), time.time())
    assert result.outcome is AdoptOutcome.ADOPTED
    done = Loop(b).wait_exit(1)
    assert done.killed_at_deadline is True
    assert (done.exit_code, done.signal) == (None, signal.SIGKILL)
    wait_until(lambda: not group_members(identity.pid), what="the whole group to be gone")


def test_a_stale_identity_is_lost_and_the_process_holding_the_pid_is_left_alone(env: Env) -> None:
    ex = env.executor()
    req = env.request(1, ("true",))
    Path(req.work_dir).mkdir(parents=True)
    stranger = unrelated_process(env)
    started = psutil.Process(stranger.pid).create_time()
    past = time.time() - 1

    wrong_start = ProcessIdentity(stranger.pid, started + 5.0)
    same_pid_not_a_shim = ProcessIdentity(stranger.pid, started)
    for identity in (wrong_start, same_pid_not_a_shim):
        result = ex.adopt(adopt_request(req, identity, deadline=past), time.time())
        assert result.outcome is AdoptOutcome.LOST
    assert ex.watched() == set()
    assert ex.poll(time.time()).exits == ()
    assert stranger.poll() is None and alive(stranger.pid)


def test_a_dead_pid_is_lost(env: Env) -> None:
    ex = env.executor()
    req = env.request(1, ("true",))
    Path(req.work_dir).mkdir(parents=True)
    gone = subprocess.Popen(["true"])
    started = psutil.Process(gone.pid).create_time()
    gone.wait()
    result = ex.adopt(adopt_request(req, ProcessIdentity(gone.pid, started)), time.time())
    assert result.outcome is AdoptOutcome.LOST
    assert ex.adopt(adopt_request(req, None), time.time()).outcome is AdoptOutcome.LOST


# -- orphans ---------------------------------------------------------------------------------


def test_reap_orphans_kills_only_this_instances_unknown_attempts(env: Env) -> None:
    ours = env.executor()
    theirs = env.executor()
    reqs = {i: env.request(i, script(SLEEP_FOREVER)) for i in (1, 2, 3)}
    ids = {
        1: env.launch(ours, reqs[1]),
        2: env.launch(ours, reqs[2]),
        3: env.launch(theirs, reqs[3]),
    }
    for r in reqs.values():
        wait_until(ready(r), what="step ready")

    assert ours.reap_orphans({1}) == [2]
    loop = Loop(ours)
    done = loop.wait_exit(2)
    assert done.signal == signal.SIGKILL
    wait_until(lambda: not group_members(ids[2].pid), what="orphan group gone")
    assert alive(ids[1].pid)
    assert alive(ids[3].pid)
    assert 1 not in loop.exits


def test_reap_orphans_finds_leftovers_whose_shim_is_gone(env: Env) -> None:
    instance = env.instance()
    a = env.executor(instance)
    req = env.request(1, ("sh", "-c", "setsid sleep 1000 & echo $! > escaped.pid; exec sleep 1000"))
    identity = env.launch(a, req)
    escaped_file = Path(req.work_dir) / "escaped.pid"
    wait_until(lambda: escaped_file.exists() and escaped_file.read_text().strip(), what="step started")
    escaped = int(escaped_file.read_text())
    os.kill(identity.pid, signal.SIGKILL)  # only the shim dies; the step runs on, unsupervised
    a.close()
    wait_dead(identity.pid)
    in_group = wait_until(lambda: group_members(identity.pid), what="step in the orphaned group")

    assert env.executor(instance).reap_orphans(set()) == [1]
    wait_dead(escaped, *in_group)


# -- robustness ------------------------------------------------------------------------------


def test_poll_survives_corrupt_files_of_one_attempt(env: Env) -> None:
    ex = env.executor()
    blocked, garbled, healthy = (env.request(i, script(WAIT_FOR_GO.format(code=i))) for i in (1, 2, 3))
    for r in (blocked, garbled, healthy):
        env.launch(ex, r)
        wait_until(ready(r), what="step ready")
    # The shim cannot replace a directory: attempt 1 ends without a readable status.
    (Path(blocked.work_dir) / "exit_status.json").mkdir()
    # Garbage while running is ignored; the shim's real status replaces it.
    (Path(garbled.work_dir) / "exit_status.json").write_text("{not json")
    (Path(garbled.work_dir) / "shim.json").write_text("[]")

    loop = Loop(ex)
    loop.poll()
    assert loop.exits == {}
    for r in (blocked, garbled, healthy):
        go(r)
    for i in (1, 2, 3):
        loop.wait_exit(i)
    assert (loop.exits[1].exit_code, loop.exits[1].signal) == (None, None)
    assert loop.exits[2].exit_code == 2
    assert loop.exits[3].exit_code == 3


# -- containers (fake client: no engine exists here) -----------------------------------------


def fake_docker(env: Env) -> tuple[ContainerRuntime, Path]:
    """A stand-in `docker` client: records its argv, and for `run` execs the command in-process
    with the container's CUDA_VISIBLE_DEVICES, as the real client's container would."""
    record = env.root / "docker-calls.jsonl"
    path = env.root / "docker"
    path.write_text(
        textwrap.dedent(f"""\
        #!{PY}
        import json, os, sys
        with open({str(record)!r}, "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\\n")
        if sys.argv[1] == "run":
            args = sys.argv[2:]
            w = args.index("-w")
            for i, a in enumerate(args[:w]):
                if a == "-e" and "=" in args[i + 1]:
                    k, v = args[i + 1].split("=", 1)
                    os.environ[k] = v
            os.chdir(args[w + 1])
            cmd = args[w + 3:]
            os.execvp(cmd[0], cmd)
        """)
    )
    path.chmod(0o755)
    return ContainerRuntime(engine="docker", binary=str(path)), record


def test_container_step_runs_through_the_client_and_is_killed_by_name(env: Env) -> None:
    runtime, record = fake_docker(env)
    ex = env.executor(runtime=runtime)
    req = env.request(1, script(STUBBORN), gpus=(6, 7), image="registry/train:3.0")
    env.launch(ex, req)
    wait_until(ready(req), what="step ready")
    ex.notify_stop(1, time.time() + 0.2, time.time())
    done = Loop(ex).wait_exit(1)
    assert done.killed_at_deadline is True

    def calls() -> list[list[str]]:
        return [json.loads(line) for line in record.read_text().splitlines()]

    name = calls()[0][calls()[0].index("--name") + 1]
    assert calls()[0][:7] == ["run", "--rm", "--name", name, "--init", ADD_HOST_GATEWAY, "--gpus"]
    assert calls()[0][7] == '"device=6,7"'
    wait_until(lambda: ["kill", name] in calls(), what="`docker kill` at the deadline")
    assert "cvd=0,1" in Path(req.log_path).read_text()


def test_a_container_runtime_needs_an_image(env: Env) -> None:
    runtime, _ = fake_docker(env)
    with pytest.raises(ExecutorError) as err:
        env.executor(runtime=runtime).launch(env.request(1, ("true",)), time.time())
    assert err.value.temporary is False
    assert "has no image" in str(err.value)


# -- exits are durable until acknowledged (docs/architecture.md §4.4) -------------------------------


def test_an_exit_is_reported_at_every_poll_until_acknowledged(env: Env) -> None:
    ex = env.executor()
    req = env.request(1, ("true",))
    env.launch(ex, req)
    first = wait_until(lambda: ex.poll(time.time()).exits, what="the exit")
    assert [(e.attempt_id, e.exit_code, e.wall_clock) for e in first] == [(1, 0, True)]
    assert ex.watched() == set() and ex.pending_exits() == {1}
    assert ex.poll(time.time()).exits == first  # the store did not have it yet: reported again
    ex.notify_stop(1, time.time() + 5, time.time())  # it has ended: nothing to stop, no error
    adopted = ex.adopt(adopt_request(req, None), time.time())
    assert adopted.outcome is AdoptOutcome.EXITED and adopted.exit == first[0]
    ex.ack_exit(1)
    assert ex.poll(time.time()).exits == () and ex.pending_exits() == set()


def test_a_work_dir_that_cannot_be_made_is_an_infrastructure_failure(env: Env) -> None:
    blocker = env.root / "attempt-2"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("a file where the work dir goes")
    ex = env.executor()
    with pytest.raises(ExecutorError) as caught:
        env.launch(ex, env.request(2, ("true",)))
    assert caught.value.infrastructure == "storage", caught.value
    assert ex.watched() == set()
