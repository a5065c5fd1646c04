"""Container command lines for docker and podman: what the step shim runs instead of a raw command.

Used by `adapters.local_executor` when a container runtime is configured. `container_command` is
a pure function (argv in, argv out) so its exact output is unit-tested without any engine;
`resolve_runtime` is the only function here that looks at the machine (is the binary on PATH).

The container sees the same paths as the host (work dir, notice file, mounts are bind-mounted at
their own path) so every path in the step's environment stays valid inside; it sees only the
GPUs it was given, so CUDA_VISIBLE_DEVICES is renumbered from 0 inside.
Environment values are passed by name (``-e KEY``) and read by the client from its own
environment, so they never appear in ``ps``.

Must not: run containers, talk to an engine's API, or decide which GPUs a step gets.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal

from lowtide.control.executor_port import ExecutorError, LaunchRequest

Engine = Literal["docker", "podman"]
ENGINES: tuple[Engine, ...] = ("docker", "podman")
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


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


def container_command(runtime: ContainerRuntime, req: LaunchRequest, *, name: str) -> list[str]:
    """The full client argv (starting with the runtime binary) that runs `req` in its image."""
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
    argv = [runtime.binary, "run", "--rm", "--name", name, "--init", *_gpu_flags(runtime, gpus)]
    for key in sorted(req.env):
        if key != CUDA_VISIBLE_DEVICES:
            argv += ["-e", key]
    # The engine exposes only the passed GPUs, numbered from 0.
    argv += ["-e", f"{CUDA_VISIBLE_DEVICES}=" + ",".join(str(i) for i in range(len(gpus)))]
    for path in mounts:
        argv += ["-v", f"{path}:{path}"]
    argv += ["-w", req.work_dir, req.image, *req.command]
    return argv
