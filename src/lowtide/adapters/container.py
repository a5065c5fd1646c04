"""Container command lines for docker and podman: what the step shim runs instead of a raw command.

Used by `adapters.local_executor` when a container runtime is configured. `container_command` is
a pure function (argv in, argv out) so its exact output is unit-tested without any engine;
`resolve_runtime` (is the binary on PATH) and `check_engine` (does the engine answer, run once by
`lowtide up`) are the only functions here that look at the machine.

The container sees the same paths as the host (work dir, notice file, mounts are bind-mounted at
their own path) so every path in the step's environment stays valid inside; it sees only the
GPUs it was given, so CUDA_VISIBLE_DEVICES is renumbered from 0 inside.
Environment values are passed by name (``-e KEY``) and read by the client from its own
environment, so they never appear in ``ps``; only the contract (and HOME/TMPDIR/USER/LOGNAME of
the step, which are not secret) enters the container, never the client's own variables.

Isolation (docs/architecture.md §6.4): with `executor.run_as` the container runs as the job's uid
and the step user's group (``--user UID:GID``), so what it writes to its outputs and checkpoints
belongs to that job and nothing runs as root inside. The client itself runs as lowtide's user
(it needs the engine's socket, which would be root-equivalent for a step).

Reaching the API from inside (decision): a loopback address (``127.0.0.1``, ``localhost``,
``::1``) in LOWTIDE_API_URL would name the container itself, so it is rewritten to
``host.docker.internal`` and every container gets ``--add-host=host.docker.internal:host-gateway``
(docker ≥ 20.10: ``host-gateway`` is the host's address on the default bridge; podman ≥ 4.7
accepts the same special value, "an IP address the container can use to connect to the host",
podman v5.4 docs/source/markdown/options/add-host.md, and adds ``host.docker.internal`` itself).
This keeps one setting (`api.public_url`, used unchanged when it is not loopback) instead of a
second container-only URL. The requirement it leaves to the operator: the API must listen on an
address the bridge reaches (``api.host: 0.0.0.0``, or the bridge's address such as
``172.17.0.1``); `lowtide up` warns when it listens on loopback only.

Exit statuses (docker run reference, "Exit status"; podman-run(1) "Exit Status"): 125 means the
error is with the engine itself (daemon down, image pull, bad flags), 126 the contained command
cannot be invoked, 127 it cannot be found, anything else is the contained command's own status.
`ENGINE_FAILURE_EXIT` is therefore infrastructure (no retry used); 126/127 are the step's fault.
A command that itself exits 125 inside a container is indistinguishable and counts as an engine
failure too (requeued with backoff, without using a retry).

Must not: run containers, decide which GPUs a step gets, or pass the client's environment in.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from lowtide.control.executor_port import ExecutorError, LaunchRequest

Engine = Literal["docker", "podman"]
ENGINES: tuple[Engine, ...] = ("docker", "podman")
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
API_URL_ENV = "LOWTIDE_API_URL"
HOST_GATEWAY_NAME = "host.docker.internal"
ADD_HOST_GATEWAY = f"--add-host={HOST_GATEWAY_NAME}:host-gateway"
#: `docker run`/`podman run` exit status when the engine itself failed.
ENGINE_FAILURE_EXIT = 125
#: What the engine's client needs from lowtide's environment to reach its engine (never passed
#: into the container): its socket or context, configuration, rootless runtime dir, and HOME.
ENGINE_CLIENT_ENV: tuple[str, ...] = (
    "HOME",
    "DOCKER_HOST",
    "DOCKER_CONTEXT",
    "DOCKER_CONFIG",
    "DOCKER_CERT_PATH",
    "DOCKER_TLS_VERIFY",
    "CONTAINER_HOST",
    "CONTAINER_CONNECTION",
    "CONTAINERS_CONF",
    "CONTAINERS_STORAGE_CONF",
    "REGISTRY_AUTH_FILE",
    "XDG_RUNTIME_DIR",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
)
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "::"})  # noqa: S104


class RuntimeNotFoundError(ExecutorError):
    """The configured container engine has no executable on PATH: a configuration error."""

    def __init__(self, message: str) -> None:
        super().__init__(message, temporary=False)


@dataclass(frozen=True)
class ContainerRuntime:
    engine: Engine
    binary: str  # absolute path of the client executable


def resolve_runtime(engine: str) -> ContainerRuntime:
    """Find the engine's client on PATH. Raises ValueError for an unknown engine and
    RuntimeNotFoundError when the binary is missing."""
    if engine == "docker":
        checked: Engine = "docker"
    elif engine == "podman":
        checked = "podman"
    else:
        raise ValueError(f"unknown container runtime {engine!r}; expected one of {', '.join(ENGINES)}")
    binary = shutil.which(checked)
    if binary is None:
        raise RuntimeNotFoundError(
            f"runtime {checked!r} is configured but no {checked!r} executable is on PATH"
        )
    return ContainerRuntime(engine=checked, binary=binary)


def check_engine(runtime: ContainerRuntime, timeout_s: float = 15.0) -> str | None:
    """Ask the engine whether it answers: None when it does, else why not, in one line with the
    client's own last words. docker: ``docker version --format '{{.Server.Version}}'`` (the
    server part needs the daemon); podman: ``podman info --format '{{.Version.Version}}'``
    (podman-version(1) has a ``.Server`` only for a remote engine; ``podman info`` opens the
    engine's storage and runtime, so it fails where a container could not start)."""
    if runtime.engine == "docker":
        argv = [runtime.binary, "version", "--format", "{{.Server.Version}}"]
    else:
        argv = [runtime.binary, "info", "--format", "{{.Version.Version}}"]
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_s,
            check=False,
            env={k: v for k, v in os.environ.items() if k in ENGINE_CLIENT_ENV or k == "PATH"},
        )
    except subprocess.TimeoutExpired:
        return f"`{runtime.engine} {argv[1]}` did not answer within {timeout_s:g}s"
    except OSError as exc:
        return f"cannot run {runtime.binary}: {exc.strerror or exc}"
    said = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
    if done.returncode != 0 or not done.stdout.strip():
        last = said[-1][:300] if said else "no output"
        return f"`{runtime.engine} {argv[1]}` failed (exit {done.returncode}): {last}"
    return None


def container_api_url(url: str) -> str:
    """The API address as seen from inside a container: a loopback host becomes
    ``host.docker.internal`` (module docstring); any other address is kept."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host not in _LOOPBACK:
        return url
    netloc = HOST_GATEWAY_NAME + (f":{parts.port}" if parts.port is not None else "")
    if parts.username or parts.password:
        return url  # credentials in the URL: leave it alone rather than rebuild it wrongly
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]")


def container_name(instance_id: str, attempt_id: int) -> str:
    """A deterministic container name, so a restarted control plane can kill what it adopts."""
    safe = _NAME_UNSAFE.sub("-", instance_id).strip("-.") or "x"
    return f"lowtide-{safe}-a{attempt_id}"


def _gpu_flags(runtime: ContainerRuntime, gpus: list[int]) -> list[str]:
    if not gpus:
        return []
    if runtime.engine == "docker":
        # docker parses --gpus as CSV: without the quotes "device=0,1" would split at the comma.
        return ["--gpus", '"device=' + ",".join(str(i) for i in gpus) + '"']
    flags: list[str] = []
    for i in gpus:
        flags += ["--device", f"nvidia.com/gpu={i}"]  # CDI device names
    return flags


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def container_command(
    runtime: ContainerRuntime,
    req: LaunchRequest,
    *,
    name: str,
    default_user: tuple[int, int] | None = None,
) -> list[str]:
    """The full client argv (starting with the runtime binary) that runs `req` in its image: as
    ``req.run_as`` when set, else as `default_user` (uid, gid) when given, else as the image says."""
    if req.image is None:
        raise ValueError(f"steps[{req.step}] has no image; a container runtime needs one")
    if not req.command:
        raise ValueError(f"steps[{req.step}] has an empty command")
    mounts: list[str] = []
    notice_dir = str(PurePosixPath(req.notice_path).parent)
    for path in (req.work_dir, *req.mounts, notice_dir):
        if not PurePosixPath(path).is_absolute():
            raise ValueError(f"container mount {path!r} must be an absolute path")
        if not any(_under(path, m) for m in mounts):
            mounts.append(path)
    gpus = sorted(req.gpus)
    argv = [runtime.binary, "run", "--rm", "--name", name, "--init", ADD_HOST_GATEWAY]
    if req.run_as is not None:
        argv += ["--user", f"{req.run_as.uid}:{req.run_as.gid}"]
    elif default_user is not None:
        argv += ["--user", f"{default_user[0]}:{default_user[1]}"]
    argv += _gpu_flags(runtime, gpus)
    for key in sorted(req.env):
        if key not in (CUDA_VISIBLE_DEVICES, API_URL_ENV):
            argv += ["-e", key]
    if API_URL_ENV in req.env:
        argv += ["-e", f"{API_URL_ENV}={container_api_url(req.env[API_URL_ENV])}"]
    # The engine exposes only the passed GPUs, numbered from 0.
    argv += ["-e", f"{CUDA_VISIBLE_DEVICES}=" + ",".join(str(i) for i in range(len(gpus)))]
    # The step's home and temporary dir are its work dir, as with the process runtime.
    identity = {"HOME": req.work_dir, "TMPDIR": str(PurePosixPath(req.work_dir, "tmp"))}
    if req.run_as is not None:
        identity |= {"USER": req.run_as.user, "LOGNAME": req.run_as.user}
    for key, value in identity.items():
        if key not in req.env:  # the spec's own env wins, as with the process runtime
            argv += ["-e", f"{key}={value}"]
    for path in mounts:
        argv += ["-v", f"{path}:{path}"]
    argv += ["-w", req.work_dir, req.image, *req.command]
    return argv
