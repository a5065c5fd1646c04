"""Steps isolated from the control plane and from each other (docs/architecture.md §6.4).

Real step processes driven by the real loop over a real SQLite store: with `executor.run_as`
every job's steps run as their own uid, cannot read the state dir, the database or the admin
token, cannot write another job's checkpoints, and see only their contract, their spec's env and
the allowlist. Container engine failures (a fake `docker` on PATH exiting 125) are not the
step's failure, and `lowtide up` refuses an engine that does not answer before it listens.

Running steps as other uids needs root (CI runs as root); the tests that need it skip otherwise.
The step user is created here when missing (`useradd --system`), as `make demo` and CI do.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from lowtide.adapters.local_executor import _read_status
from lowtide.adapters.step_identity import allowed, own_tree, safe_write_json, step_environment_for
from lowtide.config import ConfigError
from lowtide.control.executor_port import RunAs
from lowtide.wiring import Embedded, ensure_admin_token, preflight
from support import embedded, ensure_step_user, settings_for, tick_until
from support import job_detail as detail
from support import job_finished as finished
from support import kill_steps_and_close as close
from support import step_log as log_of
from support import submit_job as submit

PY = sys.executable
STEP_USER = "lowtide-step"
UID_BASE = 1_500_000_000
ROOT_ONLY = pytest.mark.skipif(
    os.geteuid() != 0, reason="steps run as other uids only when lowtide runs as root (CI runs as root)"
)


def py(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


def state(lt: Embedded, job_id: str) -> str:
    return str(detail(lt, job_id)["job"]["state"])


@pytest.fixture(scope="module")
def step_user() -> str:
    """The operator's step user, created when missing; the interpreter must be reachable by it."""
    if os.geteuid() != 0:
        pytest.skip("steps run as other uids only when lowtide runs as root (CI runs as root)")
    return ensure_step_user()


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory every uid can traverse (pytest's tmp_path is 0700): state, work, artifacts."""
    root = Path(tempfile.mkdtemp(prefix="lowtide-isolation-"))
    root.chmod(0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """lowtide's own environment holds an operator's secrets; a locale keeps Python from adding
    LC_CTYPE (PEP 538) so that the step's environment is exactly what lowtide gave it."""
    monkeypatch.setenv("LANG", "C.UTF-8")
    for name in [k for k in os.environ if k.startswith("LC_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "operator-cloud-secret")
    monkeypatch.setenv("LOWTIDE_TOKEN", "operator-admin-token")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCLX_NOT_ALLOWED", "no")
    monkeypatch.setenv("HF_HOME", "/models/hf")


def isolated(tmp_path: Path, base: Path, user: str | None) -> Embedded:
    executor: dict[str, Any] = {"env_allowlist": ["NCCL_*", "HF_HOME"]}
    if user is not None:
        executor["run_as"] = user
    lt = embedded(
        tmp_path,
        state_dir=str(base / "state"),
        artifact_root=str(base / "artifacts"),
        auth={"enabled": False},
        executor=executor,
    )
    lt.loop.recover()
    return lt


ENV_DUMP = py("""
    import json, os, pathlib
    out = pathlib.Path(os.environ["LOWTIDE_OUTPUTS"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "env.json").write_text(json.dumps(dict(os.environ)))
    (out / "who.json").write_text(json.dumps({"uid": os.getuid(), "gid": os.getgid(),
                                              "groups": os.getgroups(), "cwd": os.getcwd()}))
""")

CONTRACT = {
    "CUDA_VISIBLE_DEVICES", "LOWTIDE_JOB_ID", "LOWTIDE_STEP", "LOWTIDE_ATTEMPT", "LOWTIDE_NODE",
    "LOWTIDE_GPUS", "LOWTIDE_PARAMS", "LOWTIDE_INPUTS", "LOWTIDE_OUTPUTS", "LOWTIDE_NOTICE_FILE",
    "LOWTIDE_GRACE_SECONDS", "LOWTIDE_API_URL", "LOWTIDE_STEP_TOKEN", "LOWTIDE_PARAM_LR",
}  # fmt: skip
IDENTITY = {"HOME", "USER", "LOGNAME", "TMPDIR", "LOWTIDE_SHIM_TAG"}


def allowlisted() -> set[str]:
    return {k for k in os.environ if k in ("PATH", "LANG", "TZ", "HF_HOME") or k.startswith(("LC_", "NCCL_"))}


def run_env_dump(lt: Embedded) -> tuple[str, dict[str, Any], dict[str, str], dict[str, Any]]:
    job = submit(
        lt,
        {
            "name": "env",
            "params": {"lr": 0.1},
            "steps": [{"name": "dump", "command": ENV_DUMP, "gpus": 1, "env": {"MY_SETTING": "x"}}],
        },
    )
    tick_until(lt, lambda: finished(lt, job), what="the env dump to finish")
    d = detail(lt, job)
    assert d["job"]["state"] == "SUCCEEDED", (d, log_of(lt, job, "dump"))
    out = Path(d["steps"][0]["outputs"])
    return job, d, json.loads((out / "env.json").read_text()), json.loads((out / "who.json").read_text())


# -- isolation with run_as -------------------------------------------------------------------------


@ROOT_ONLY
def test_a_step_cannot_read_the_state_dir_the_database_or_the_admin_token(
    tmp_path: Path, base: Path, step_user: str
) -> None:
    lt = isolated(tmp_path, base, step_user)
    try:
        token = lt.settings.admin_token_path
        assert ensure_admin_token(lt.store, token, lt.clock.now()) is not None
        database = Path(lt.settings.state_dir) / "lowtide.db"
        assert database.exists()
        probe = py(f"""
            import json, os, pathlib
            seen = {{}}
            for name, path in {{"token": {str(token)!r}, "database": {str(database)!r}}}.items():
                try:
                    pathlib.Path(path).read_bytes()
                    seen[name] = "read"
                except PermissionError:
                    seen[name] = "PermissionError"
            try:
                os.listdir({str(lt.settings.state_dir)!r})
                seen["state_dir"] = "listed"
            except PermissionError:
                seen["state_dir"] = "PermissionError"
            out = pathlib.Path(os.environ["LOWTIDE_OUTPUTS"])
            (out / "probe.json").write_text(json.dumps(seen))
            pathlib.Path({str(token)!r}).read_text()  # the attempt fails with the error
        """)
        job = submit(lt, {"name": "steal", "steps": [{"name": "probe", "command": probe}]})
        tick_until(lt, lambda: finished(lt, job), what="the probe to finish")
        d = detail(lt, job)
        assert d["job"]["state"] == "FAILED"
        assert [a["exit_code"] for a in d["attempts"]] == [1]
        assert "PermissionError" in log_of(lt, job, "probe")
        seen = json.loads((Path(d["steps"][0]["outputs"]) / "probe.json").read_text())
        assert seen == {
            "token": "PermissionError",
            "database": "PermissionError",
            "state_dir": "PermissionError",
        }
        assert Path(lt.settings.state_dir).stat().st_mode & 0o777 == 0o700
    finally:
        close(lt)


@ROOT_ONLY
def test_a_step_cannot_write_another_jobs_checkpoint_and_that_job_resumes_from_its_own(
    tmp_path: Path, base: Path, step_user: str
) -> None:
    lt = isolated(tmp_path, base, step_user)
    try:
        gate = base / "gate"
        gate.mkdir(mode=0o755)
        gate.chmod(0o755)
        bob = py(f"""
            import os, pathlib, sys, time
            out = pathlib.Path(os.environ["LOWTIDE_OUTPUTS"])
            if os.environ["LOWTIDE_ATTEMPT"] == "1":
                ckpt = pathlib.Path(os.environ["LOWTIDE_CHECKPOINT_DIR"])
                (ckpt / "bob-step-100").write_text("weights")  # the checkpoint, then LATEST names it
                (ckpt / "LATEST").write_text("bob-step-100\\n")
                (out / "checkpointed").write_text("yes")
                while not pathlib.Path({str(gate / "go")!r}).exists():
                    time.sleep(0.05)
                sys.exit(1)
            (out / "resumed_from").write_text(os.environ.get("LOWTIDE_RESUME_FROM", ""))
        """)
        job_b = submit(
            lt,
            {
                "name": "bob",
                "max_retries": 1,
                "steps": [{"name": "train", "command": bob, "checkpoint": True}],
            },
        )
        b_step = detail(lt, job_b)["steps"][0]
        tick_until(lt, (Path(b_step["outputs"]) / "checkpointed").exists, what="bob's checkpoint")
        b_latest = Path(b_step["checkpoint_dir"]) / "LATEST"
        alice = py(f"""
            import pathlib
            pathlib.Path({str(b_latest)!r}).write_text("alice-poisoned\\n")
        """)
        job_a = submit(lt, {"name": "alice", "steps": [{"name": "attack", "command": alice}]})
        tick_until(lt, lambda: finished(lt, job_a), what="alice's step to end")
        assert state(lt, job_a) == "FAILED"
        assert "PermissionError" in log_of(lt, job_a, "attack")
        assert b_latest.read_text() == "bob-step-100\n"

        (gate / "go").touch()
        tick_until(lt, lambda: finished(lt, job_b), what="bob's job to finish")
        d = detail(lt, job_b)
        assert d["job"]["state"] == "SUCCEEDED"
        resumed = (Path(b_step["outputs"]) / "resumed_from").read_text()
        assert resumed == f"{b_step['checkpoint_dir']}/bob-step-100"
        # Each job ran as its own uid: the job's serial above the base.
        owners = {job: Path(detail(lt, job)["steps"][0]["outputs"]).stat().st_uid for job in (job_a, job_b)}
        assert owners == {job: UID_BASE + lt.store.job_serial(job) for job in (job_a, job_b)}
        assert owners[job_a] != owners[job_b]
    finally:
        close(lt)


@ROOT_ONLY
def test_a_steps_environment_is_its_contract_its_env_and_the_allowlist_and_its_files_are_its_own(
    tmp_path: Path, base: Path, step_user: str, clean_env: None
) -> None:
    lt = isolated(tmp_path, base, step_user)
    try:
        job, d, env, who = run_env_dump(lt)
        assert set(env) == CONTRACT | {"MY_SETTING"} | allowlisted() | IDENTITY
        for leaked in ("AWS_SECRET_ACCESS_KEY", "LOWTIDE_TOKEN", "NCCLX_NOT_ALLOWED"):
            assert leaked not in env
        work_dir = lt.store.step_attempts(job, "dump")[0].work_dir
        entry = pwd.getpwnam(step_user)
        uid = UID_BASE + lt.store.job_serial(job)
        assert (env["USER"], env["LOGNAME"], env["HOME"]) == (step_user, step_user, work_dir)
        assert env["TMPDIR"] == f"{work_dir}/tmp" and Path(env["TMPDIR"]).stat().st_uid == uid
        assert (env["NCCL_DEBUG"], env["HF_HOME"], env["MY_SETTING"]) == ("INFO", "/models/hf", "x")
        assert who == {"uid": uid, "gid": entry.pw_gid, "groups": [], "cwd": work_dir}
        # What the step wrote is the job's; its directories are private, their parents only traversable.
        out = Path(d["steps"][0]["outputs"])
        for path in (out / "env.json", out, Path(work_dir)):
            assert (path.stat().st_uid, path.stat().st_gid) == (uid, entry.pw_gid)
        assert out.stat().st_mode & 0o777 == 0o700
        job_dir = Path(lt.settings.artifacts) / "jobs" / job
        assert job_dir.stat().st_mode & 0o777 == 0o700 and job_dir.stat().st_uid == uid
        assert job_dir.parent.stat().st_mode & 0o777 == 0o711
        assert Path(work_dir).parents[2].stat().st_mode & 0o777 == 0o711
        # lowtide still reads the log (its own file) through the API.
        assert "=== lowtide" in log_of(lt, job, "dump")
    finally:
        close(lt)


@ROOT_ONLY
def test_a_step_cannot_make_lowtide_read_the_admin_token_through_a_symlink(
    tmp_path: Path, base: Path, step_user: str
) -> None:
    """The step owns its work dir and checkpoint dir; lowtide reads its log and LATEST there as
    root. Links it plants in their place must not be followed (the token would come back as the
    log, or as a checkpoint label, to the job's owner)."""
    lt = isolated(tmp_path, base, step_user)
    try:
        token_file = lt.settings.admin_token_path
        raw = ensure_admin_token(lt.store, token_file, lt.clock.now())
        assert raw is not None
        trick = py(f"""
            import os, pathlib, sys, time
            ckpt = pathlib.Path(os.environ["LOWTIDE_CHECKPOINT_DIR"])
            (ckpt / "LATEST").symlink_to({str(token_file)!r})
            log = pathlib.Path(os.getcwd()) / "log"
            log.rename(log.with_name("log.moved"))
            log.symlink_to({str(token_file)!r})
            time.sleep(1.0)  # the loop polls LATEST while the step runs
            sys.exit(1)
        """)
        job = submit(lt, {"name": "trick", "steps": [{"name": "s", "command": trick, "checkpoint": True}]})
        tick_until(lt, lambda: finished(lt, job), what="the step to end")
        d = detail(lt, job)
        assert d["job"]["state"] == "FAILED"
        assert all(c["label"] != raw.strip() for c in d.get("checkpoints", []))
        assert any(e["kind"] == "checkpoint_invalid" and "symbolic link" in e["message"] for e in d["events"])
        assert raw.strip() not in log_of(lt, job, "s")
    finally:
        close(lt)


@ROOT_ONLY
def test_a_step_running_as_its_job_uid_reads_its_notice(tmp_path: Path, base: Path, step_user: str) -> None:
    lt = isolated(tmp_path, base, step_user)
    try:
        code = py("""
            import json, os, pathlib, signal, sys, time
            out = pathlib.Path(os.environ["LOWTIDE_OUTPUTS"])
            def stop(*_):
                notice = json.loads(pathlib.Path(os.environ["LOWTIDE_NOTICE_FILE"]).read_text())
                (out / "deadline").write_text(str(notice["deadline"]))
                sys.exit(143)
            signal.signal(signal.SIGTERM, stop)
            (out / "ready").write_text("yes")
            while True:
                time.sleep(0.05)
        """)
        job = submit(lt, {"name": "long", "grace_seconds": 20, "steps": [{"name": "a", "command": code}]})
        out = Path(detail(lt, job)["steps"][0]["outputs"])
        tick_until(lt, (out / "ready").exists, what="the step to run")
        assert TestClient(lt.app).post(f"/v1/jobs/{job}/cancel").status_code == 200
        tick_until(lt, lambda: detail(lt, job)["steps"][0]["state"] == "CANCELLED", what="the step to stop")
        att = detail(lt, job)["attempts"][0]
        assert att["exit_code"] == 143 and not att["killed_at_deadline"]
        assert float((out / "deadline").read_text()) == pytest.approx(att["stop_deadline"])
    finally:
        close(lt)


def test_without_run_as_the_environment_is_still_clean(tmp_path: Path, base: Path, clean_env: None) -> None:
    lt = isolated(tmp_path, base, None)
    try:
        job, _, env, who = run_env_dump(lt)
        assert set(env) == CONTRACT | {"MY_SETTING"} | allowlisted() | IDENTITY
        assert "AWS_SECRET_ACCESS_KEY" not in env and "LOWTIDE_TOKEN" not in env
        assert env["USER"] == pwd.getpwuid(os.geteuid()).pw_name
        assert env["HOME"] == lt.store.step_attempts(job, "dump")[0].work_dir == who["cwd"]
        assert who["uid"] == os.geteuid()
    finally:
        close(lt)


def test_without_run_as_lowtide_up_warns_that_steps_can_read_its_secrets(tmp_path: Path) -> None:
    warnings = preflight(settings_for(tmp_path))
    assert any("can read its state dir" in w and "executor.run_as" in w for w in warnings)


@ROOT_ONLY
def test_an_unknown_step_user_is_a_config_error_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"executor\.run_as: no Unix user named 'no-such-user-xyz'"):
        preflight(settings_for(tmp_path, executor={"run_as": "no-such-user-xyz"}))


@ROOT_ONLY
def test_run_as_refuses_an_artifact_root_inside_the_state_dir(
    tmp_path: Path, base: Path, step_user: str
) -> None:
    settings = settings_for(
        tmp_path,
        state_dir=str(base / "state"),
        artifact_root=str(base / "state" / "a"),
        executor={"run_as": step_user},
    )
    with pytest.raises(ConfigError, match=r"executor\.run_as: artifact_root .* lies inside state_dir"):
        preflight(settings)


# -- container runtimes ----------------------------------------------------------------------------


def fake_engine(bin_dir: Path, name: str, *, version_ok: bool, run_exit: int | None = None) -> Path:
    """A stand-in engine client on PATH: `version`/`info` answer or fail as told; `run` exits with
    `run_exit` (the daemon's message first) while the file `broken` exists beside it, else runs
    the container's command in-process."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text(
        textwrap.dedent(f"""\
        #!{PY}
        import os, pathlib, sys
        here = pathlib.Path(__file__).parent
        if sys.argv[1] in ("version", "info"):
            if {version_ok!r}:
                print("27.0.1")
                sys.exit(0)
            print("Cannot connect to the Docker daemon at unix:///var/run/docker.sock. "
                  "Is the docker daemon running?", file=sys.stderr)
            sys.exit(1)
        if sys.argv[1] == "run":
            if (here / "broken").exists():
                print("docker: Cannot connect to the Docker daemon at unix:///var/run/docker.sock. "
                      "Is the docker daemon running?", file=sys.stderr, flush=True)
                sys.exit({run_exit!r})
            args = sys.argv[2:]
            w = args.index("-w")
            os.chdir(args[w + 1])
            os.execvp(args[w + 3], args[w + 3:])
        sys.exit(0)
        """)
    )
    path.chmod(0o755)
    return path


def test_an_engine_failure_uses_no_retry_and_the_step_runs_once_the_engine_is_back(
    tmp_path: Path, base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    fake_engine(bin_dir, "docker", version_ok=True, run_exit=125)
    (bin_dir / "broken").touch()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    lt = embedded(
        tmp_path,
        state_dir=str(base / "state"),
        artifact_root=str(base / "artifacts"),
        auth={"enabled": False},
        executor={"runtime": "docker"},
    )
    lt.loop.recover()
    try:
        job = submit(
            lt,
            {
                "name": "boxed",
                "max_retries": 0,
                "steps": [{"name": "a", "image": "registry/x:1", "command": ["true"]}],
            },
        )
        tick_until(lt, lambda: len(detail(lt, job)["attempts"]) >= 2, what="two engine failures")
        d = detail(lt, job)
        first = d["attempts"][0]
        assert first["state"] == "FAILED" and first["exit_code"] == 125
        assert first["message"].startswith(
            "container engine failed (exit 125): docker: Cannot connect to the Docker daemon"
        )
        assert d["steps"][0]["retries_used"] == 0
        assert d["job"]["state"] != "FAILED"  # max_retries 0, yet not failed: not the step's fault

        (bin_dir / "broken").unlink()
        tick_until(lt, lambda: finished(lt, job), what="the job to run once the engine is back")
        d = detail(lt, job)
        assert d["job"]["state"] == "SUCCEEDED"
        assert d["attempts"][-1]["exit_code"] == 0 and d["steps"][0]["retries_used"] == 0
    finally:
        close(lt)


def lowtide_up(config: Path, path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path}
    return subprocess.run(
        [PY, "-m", "lowtide", "--config", str(config), "up"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_lowtide_up_refuses_a_docker_without_a_daemon_before_it_listens(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    fake_engine(bin_dir, "docker", version_ok=False)
    settings_for(tmp_path, executor={"runtime": "docker"})
    done = lowtide_up(tmp_path / "lowtide.yaml", f"{bin_dir}:{os.environ['PATH']}")
    assert done.returncode == 2, done.stderr
    assert "listening" not in done.stderr and "Traceback" not in done.stderr
    assert "executor.runtime: docker is not usable" in done.stderr
    assert "Cannot connect to the Docker daemon" in done.stderr


def test_lowtide_up_refuses_a_missing_podman_before_it_listens(tmp_path: Path) -> None:
    settings_for(tmp_path, executor={"runtime": "podman"})
    # PATH without podman: only the directory of this Python.
    done = lowtide_up(tmp_path / "lowtide.yaml", str(Path(PY).parent))
    assert done.returncode == 2, done.stderr
    assert "listening" not in done.stderr and "Traceback" not in done.stderr
    assert (
        "executor.runtime: runtime 'podman' is configured but no 'podman' executable is on PATH"
        in done.stderr
    )


@ROOT_ONLY
def test_run_as_without_root_is_refused_before_listening(base: Path, step_user: str) -> None:
    config = base / "lowtide.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(base / "state"),
                "artifact_root": str(base / "artifacts"),
                "nodes": [{"name": "n", "gpus": 1}],
                "api": {"port": 0},
                "executor": {"run_as": step_user},
            }
        )
    )
    config.chmod(0o644)
    entry = pwd.getpwnam(step_user)
    done = subprocess.run(
        [PY, "-m", "lowtide", "--config", str(config), "up"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "HOME": str(base)},
        cwd=base,
        user=entry.pw_uid,
        group=entry.pw_gid,
        extra_groups=[],
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "listening" not in done.stderr and "Traceback" not in done.stderr
    assert "executor.run_as" in done.stderr and "needs lowtide to run as root" in done.stderr


# -- the adapter's file rules, on real files -------------------------------------------------------


def test_writing_into_a_steps_directory_never_follows_a_planted_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    notice = tmp_path / "NOTICE"
    (tmp_path / f"NOTICE.tmp.{os.getpid()}").symlink_to(victim)  # what a step could plant
    safe_write_json(notice, {"deadline": 1.0})
    assert victim.read_text() == "precious\n"
    assert json.loads(notice.read_text()) == {"deadline": 1.0} and not notice.is_symlink()


@ROOT_ONLY
def test_a_private_tree_is_never_walked_through_a_symlink(tmp_path: Path, step_user: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    job_dir = tmp_path / "jobs" / "j1"
    (job_dir / "train").mkdir(parents=True)
    (job_dir / "train" / "outputs").symlink_to(outside)  # swapped in by the job's own step
    owner = RunAs(uid=UID_BASE + 7, gid=pwd.getpwnam(step_user).pw_gid, user=step_user)
    with pytest.raises(OSError, match="not a plain directory"):
        own_tree(job_dir, [PurePosixPath("train/outputs")], owner)
    assert outside.stat().st_uid == 0 and not (outside / "outputs").exists()
    assert (job_dir / "train").stat().st_uid == owner.uid  # the levels above were taken over


def test_an_exit_file_that_is_not_a_regular_file_is_ignored_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "exit_status.json"
    os.mkfifo(fifo)
    assert _read_status(str(fifo)) is None  # a FIFO would block a plain open()


def test_the_allowlist_takes_names_and_trailing_globs_only() -> None:
    patterns = ["PATH", "NCCL_*"]
    assert allowed("NCCL_DEBUG", patterns) and allowed("PATH", patterns)
    assert not allowed("NCCLX", patterns) and not allowed("PATHX", patterns)
    env = step_environment_for(
        {"LOWTIDE_STEP": "a"},
        gpus=(3, 1),
        allowlist=["NCCL_*"],
        home="/w",
        tmp_dir="/w/tmp",
        user="u",
        tag=("TAG", "x/1"),
        base={"PATH": "/bin", "NCCL_X": "1", "SECRET": "s", "LC_ALL": "C"},
    )
    assert env == {
        "PATH": "/bin", "NCCL_X": "1", "LC_ALL": "C", "HOME": "/w", "TMPDIR": "/w/tmp", "USER": "u",
        "LOGNAME": "u", "LOWTIDE_STEP": "a", "CUDA_VISIBLE_DEVICES": "1,3", "TAG": "x/1",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("executor", "problem"),
    [
        ({"job_uid_base": 2**32 - 2**27}, "executor.job_uid_base: must be between 1000 and"),
        ({"job_uid_base": 10}, "executor.job_uid_base: must be between 1000 and"),
        ({"env_allowlist": ["OK", "BAD-NAME"]}, "executor.env_allowlist: [1]: 'BAD-NAME' is not a variable"),
        ({"run_as": "Robert'); DROP"}, 'executor.run_as: "Robert\'); DROP" is not a Unix user name'),
        ({"work_root": "relative/dir"}, "executor.work_root: 'relative/dir' must be an absolute local path"),
    ],
)
def test_bad_isolation_settings_are_located_errors(
    tmp_path: Path, executor: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ConfigError) as err:
        settings_for(tmp_path, executor=executor)
    assert problem in str(err.value)
