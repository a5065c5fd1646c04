"""The exact docker/podman argv for a step. Pure: no engine runs here (none exists on this machine;
the docker client is installed but has no daemon), so these tests only compare lists."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from lowtide.adapters.container import (
    ADD_HOST_GATEWAY,
    ContainerRuntime,
    RuntimeNotFoundError,
    container_api_url,
    container_command,
    container_name,
    resolve_runtime,
)
from lowtide.control.executor_port import ExecutorError, LaunchRequest, RunAs

DOCKER = ContainerRuntime(engine="docker", binary="/usr/bin/docker")
PODMAN = ContainerRuntime(engine="podman", binary="/usr/bin/podman")
WORK = "/srv/lowtide/work/jobs/j1/train/attempt-1"


def request(gpus: tuple[int, ...], **changes: object) -> LaunchRequest:
    base = LaunchRequest(
        attempt_id=7,
        job_id="j1",
        step="train",
        attempt=1,
        node="n1",
        gpus=gpus,
        command=("python", "train.py", "--lr", "2e-5"),
        image="registry/train:3.0",
        env={
            "LOWTIDE_STEP": "train",
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
            "LOWTIDE_JOB_ID": "j1",
            "SECRET_TOKEN": "do-not-show-in-ps",
        },
        work_dir=WORK,
        log_path=f"{WORK}/log",
        notice_path=f"{WORK}/NOTICE",
        mounts=("/srv/lowtide/artifacts/j1/train/checkpoints",),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


TAIL = [
    "-e", "LOWTIDE_JOB_ID",
    "-e", "LOWTIDE_STEP",
    "-e", "SECRET_TOKEN",
]  # fmt: skip
IDENTITY = ["-e", f"HOME={WORK}", "-e", f"TMPDIR={WORK}/tmp"]
MOUNTS = [
    "-v", f"{WORK}:{WORK}",
    "-v", "/srv/lowtide/artifacts/j1/train/checkpoints:/srv/lowtide/artifacts/j1/train/checkpoints",
    "-w", WORK,
    "registry/train:3.0", "python", "train.py", "--lr", "2e-5",
]  # fmt: skip
HEAD = ["run", "--rm", "--name", "lowtide-x-a7", "--init", ADD_HOST_GATEWAY]


@pytest.mark.parametrize(
    ("runtime", "gpus", "gpu_flags", "visible"),
    [
        (DOCKER, (), [], ""),
        (DOCKER, (5,), ["--gpus", '"device=5"'], "0"),
        (DOCKER, (6, 4, 5, 7), ["--gpus", '"device=4,5,6,7"'], "0,1,2,3"),
        (PODMAN, (), [], ""),
        (PODMAN, (5,), ["--device", "nvidia.com/gpu=5"], "0"),
        (
            PODMAN,
            (6, 4, 5, 7),
            [
                "--device", "nvidia.com/gpu=4",
                "--device", "nvidia.com/gpu=5",
                "--device", "nvidia.com/gpu=6",
                "--device", "nvidia.com/gpu=7",
            ],
            "0,1,2,3",
        ),
    ],
)  # fmt: skip
def test_exact_argv(
    runtime: ContainerRuntime, gpus: tuple[int, ...], gpu_flags: list[str], visible: str
) -> None:
    argv = container_command(runtime, request(gpus), name="lowtide-x-a7")
    assert argv == [
        runtime.binary,
        *HEAD,
        *gpu_flags,
        *TAIL,
        "-e", f"CUDA_VISIBLE_DEVICES={visible}",
        *IDENTITY,
        *MOUNTS,
    ]  # fmt: skip


def test_env_values_never_appear_in_argv() -> None:
    argv = container_command(DOCKER, request((0, 1)), name="n")
    assert not any("do-not-show-in-ps" in a for a in argv)


def test_notice_outside_work_dir_is_mounted_and_nested_paths_are_not_repeated() -> None:
    req = request((), notice_path="/run/lowtide/notices/a7", mounts=(f"{WORK}/data", "/datasets"))
    argv = container_command(DOCKER, req, name="n")
    volumes = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert volumes == [f"{WORK}:{WORK}", "/datasets:/datasets", "/run/lowtide/notices:/run/lowtide/notices"]


def test_missing_image_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"steps\[train\] has no image; a container runtime needs one"):
        container_command(DOCKER, request((0,), image=None), name="n")


def test_relative_paths_are_refused() -> None:
    with pytest.raises(ValueError, match="absolute"):
        container_command(DOCKER, request((0,), mounts=("data",)), name="n")


def test_container_name_is_deterministic_and_safe() -> None:
    assert container_name("prod east/1", 42) == "lowtide-prod-east-1-a42"
    assert container_name("prod east/1", 42) == container_name("prod east/1", 42)


def test_resolve_runtime_reports_a_missing_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeNotFoundError) as err:
        resolve_runtime("podman")
    assert str(err.value) == "runtime 'podman' is configured but no 'podman' executable is on PATH"
    assert isinstance(err.value, ExecutorError)
    assert err.value.temporary is False


def test_resolve_runtime_finds_the_installed_client() -> None:
    # The docker client is installed on this machine (without a daemon); resolving only looks at PATH.
    if shutil.which("docker") is None:
        pytest.skip("no docker client on PATH")
    runtime = resolve_runtime("docker")
    assert runtime.engine == "docker"
    assert runtime.binary == shutil.which("docker")


def test_resolve_runtime_rejects_unknown_engines() -> None:
    with pytest.raises(ValueError, match="unknown container runtime 'containerd'"):
        resolve_runtime("containerd")


STEP_USER = RunAs(uid=1_500_000_042, gid=998, user="lowtide-step")


def test_run_as_runs_the_container_as_the_jobs_uid_and_the_step_users_group() -> None:
    argv = container_command(DOCKER, request((), run_as=STEP_USER), name="lowtide-x-a7")
    assert argv[: 1 + len(HEAD) + 2] == [DOCKER.binary, *HEAD, "--user", "1500000042:998"]
    assert argv[argv.index(f"TMPDIR={WORK}/tmp") + 1 :][:4] == [
        "-e", "USER=lowtide-step", "-e", "LOGNAME=lowtide-step",
    ]  # fmt: skip


def test_without_run_as_a_given_default_user_is_used_and_else_none() -> None:
    argv = container_command(PODMAN, request(()), name="n", default_user=(1000, 1000))
    assert argv[argv.index("--user") + 1] == "1000:1000"
    assert "--user" not in container_command(PODMAN, request(()), name="n")


@pytest.mark.parametrize(
    ("url", "inside"),
    [
        ("http://127.0.0.1:8470", "http://host.docker.internal:8470"),
        ("http://localhost:9000/base", "http://host.docker.internal:9000/base"),
        ("http://[::1]:8470", "http://host.docker.internal:8470"),
        ("https://lowtide.example.org", "https://lowtide.example.org"),
        ("http://10.0.0.5:8470", "http://10.0.0.5:8470"),
    ],
)
def test_a_loopback_api_url_is_rewritten_to_the_host_gateway(url: str, inside: str) -> None:
    assert container_api_url(url) == inside
    env = {"LOWTIDE_API_URL": url, "LOWTIDE_STEP": "train"}
    argv = container_command(DOCKER, request((), env=env), name="n")
    assert f"LOWTIDE_API_URL={inside}" in argv
    assert "LOWTIDE_API_URL" not in argv  # given by value (not secret), not by name
    assert ADD_HOST_GATEWAY in argv


def test_the_specs_own_home_wins_over_the_work_dir() -> None:
    env = {"HOME": "/data/home", "LOWTIDE_STEP": "train"}
    argv = container_command(DOCKER, request((), env=env), name="n")
    assert f"HOME={WORK}" not in argv
    assert argv[argv.index("HOME") - 1] == "-e"  # passed by name like the rest of the spec's env
