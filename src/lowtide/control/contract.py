"""The step contract (docs/architecture.md §6.2): the environment every attempt sees, computed once, here.

Neighbours: the loop calls `step_environment` when it launches an attempt; executors pass the
result through unchanged (containers by name). Must not: read the process environment, the clock
or files.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from lowtide.domain.gpus import cuda_visible_devices
from lowtide.domain.layout import is_remote, join_uri
from lowtide.domain.spec import ResolvedStep
from lowtide.domain.spec_render import param_text

_ENV_UNSAFE = re.compile(r"[^A-Za-z0-9_]")


def param_env_name(name: str) -> str:
    return "LOWTIDE_PARAM_" + _ENV_UNSAFE.sub("_", name).upper()


def resume_uri(checkpoint_dir: str, label: str) -> str:
    """Where the latest checkpoint is: the label as given if absolute, else inside the checkpoint dir."""
    if label.startswith("/") or is_remote(label) or label.startswith("file://"):
        return label
    return join_uri(checkpoint_dir, label)


def step_environment(
    *,
    job_id: str,
    attempt: int,
    node: str,
    gpus: tuple[int, ...],
    resolved: ResolvedStep,
    params: Mapping[str, Any],
    grace_seconds: float,
    notice_path: str,
    last_checkpoint: str | None,
    api_url: str | None,
    step_token: str | None,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    env: dict[str, str] = dict(resolved.env)
    env.update(
        {
            "CUDA_VISIBLE_DEVICES": cuda_visible_devices(gpus),
            "LOWTIDE_JOB_ID": job_id,
            "LOWTIDE_STEP": resolved.name,
            "LOWTIDE_ATTEMPT": str(attempt),
            "LOWTIDE_NODE": node,
            "LOWTIDE_GPUS": str(len(gpus)),
            "LOWTIDE_PARAMS": json.dumps(dict(params), sort_keys=True),
            "LOWTIDE_INPUTS": json.dumps(dict(resolved.inputs), sort_keys=True),
            "LOWTIDE_OUTPUTS": resolved.outputs,
            "LOWTIDE_NOTICE_FILE": notice_path,
            "LOWTIDE_GRACE_SECONDS": f"{grace_seconds:g}",
        }
    )
    for name, value in params.items():
        env[param_env_name(name)] = param_text(value)
    if resolved.checkpoint_dir is not None:
        env["LOWTIDE_CHECKPOINT_DIR"] = resolved.checkpoint_dir
        if last_checkpoint:
            env["LOWTIDE_RESUME_FROM"] = resume_uri(resolved.checkpoint_dir, last_checkpoint)
    if api_url:
        env["LOWTIDE_API_URL"] = api_url
    if step_token:
        env["LOWTIDE_STEP_TOKEN"] = step_token
    if storage_options:
        env["LOWTIDE_STORAGE_OPTIONS"] = json.dumps(dict(storage_options), sort_keys=True)
    return env


def parse_checkpoint_label(text: str) -> str:
    """Validate what a step wrote to ``LATEST``: one non-empty line of at most 1024 printable
    characters naming the checkpoint. Raises ValueError with the reason otherwise."""
    label = text.strip()
    if not label:
        raise ValueError("LATEST is empty")
    if "\n" in label or "\r" in label:
        raise ValueError("LATEST must hold a single line")
    if len(label) > 1024:
        raise ValueError("LATEST is longer than 1024 characters")
    if not label.isprintable():
        raise ValueError("LATEST contains control characters")
    return label
