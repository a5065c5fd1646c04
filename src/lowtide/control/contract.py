"""The step contract (docs/architecture.md §6.2): the environment every attempt sees, computed once, here.

Neighbours: the loop calls `step_environment` when it launches an attempt; executors pass the
result through unchanged (containers by name). `parse_checkpoint_label` is the one rule for a
checkpoint label, whether a step wrote it to LATEST or reported it through the API;
`parse_manifest` the one rule for a checkpoint's manifest (`manifest_uri`). Must not: read the
process environment, the clock or files.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from lowtide.domain.gpus import cuda_visible_devices
from lowtide.domain.layout import is_remote, join_uri
from lowtide.domain.spec import ResolvedStep
from lowtide.domain.spec_render import param_text
from lowtide.policy.checkpoints import ManifestEntry
from lowtide.policy.lending import GpuShare

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
    gpu_share: GpuShare | None = None,
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
    if gpu_share is not None:  # GPUs lent from under a sleeping replica (§4.2): not empty
        env["LOWTIDE_GPU_MEMORY_RESERVED_GIB"] = f"{math.ceil(gpu_share.reserved_gib * 100) / 100:g}"
        if gpu_share.limit_gib is not None:  # rounded down: a limit is never overstated
            env["LOWTIDE_GPU_MEMORY_LIMIT_GIB"] = f"{math.floor(gpu_share.limit_gib * 100) / 100:g}"
    return env


#: The longest checkpoint label (LATEST or the API).
MAX_LABEL_CHARS = 1024


def parse_checkpoint_label(text: str, *, checkpoint_dir: str | None = None) -> str:
    """Validate a checkpoint label, from ``LATEST`` or the API (one rule for both, §6.2).

    A label is one non-empty line (surrounding whitespace removed) of at most MAX_LABEL_CHARS
    printable characters (no C0/C1 control characters, no escape sequences, no bidi overrides:
    labels are shown in terminals) that names the checkpoint, and becomes LOWTIDE_RESUME_FROM of
    the step's next attempt (`resume_uri`). A relative label must stay inside the step's
    checkpoint directory: no `..` segment. An absolute path, `file://` or other URL must lie
    inside `checkpoint_dir`, the step's own checkpoint directory (and is refused when the step
    has none): otherwise a step could make the next attempt of itself, or through a shared
    directory of another job, resume from a checkpoint it was never given. Raises ValueError
    with the reason otherwise; returns the label as it is stored.
    """
    label = text.strip()
    if not label:
        raise ValueError("the checkpoint label is empty")
    if "\n" in label or "\r" in label:
        raise ValueError("the checkpoint label must be a single line")
    if len(label) > MAX_LABEL_CHARS:
        raise ValueError(f"the checkpoint label is longer than {MAX_LABEL_CHARS} characters")
    if not label.isprintable():
        raise ValueError("the checkpoint label contains control characters")
    path = label.removeprefix("file://")
    if ".." in path.split("/"):
        raise ValueError("the checkpoint label must not contain a '..' segment")
    if label.startswith(("/", "file://")) or is_remote(label):  # what `resume_uri` takes as is
        if checkpoint_dir is None:
            raise ValueError("an absolute checkpoint label needs a checkpoint directory; this step has none")
        inside = checkpoint_dir.removeprefix("file://").rstrip("/")
        if ".." in inside.split("/") or not path.startswith(inside + "/"):
            raise ValueError(
                f"an absolute checkpoint label must lie inside the step's checkpoint directory {inside}"
            )
    return label


#: The longest manifest lowtide reads, and the most files it may list.
MANIFEST_MAX_BYTES = 1024 * 1024
MANIFEST_MAX_FILES = 10_000
#: What a manifest's ``format`` says (docs/architecture.md §6.2).
MANIFEST_FORMAT = "lowtide-checkpoint-manifest/1"
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


def manifest_uri(checkpoint_dir: str, label: str) -> str:
    """Where the manifest of checkpoint `label` is: beside it, ``<label>.manifest.json``."""
    return resume_uri(checkpoint_dir, label).rstrip("/") + ".manifest.json"


def parse_manifest(text: str) -> tuple[ManifestEntry, ...]:
    """A checkpoint's manifest (docs/architecture.md §6.2), written by the step after the
    checkpoint's files and before LATEST names it. JSON::

        {"format": "lowtide-checkpoint-manifest/1",
         "files": [{"path": "step-000150.json", "size": 1234, "sha256": "<64 hex digits>"}]}

    `path` is relative to the step's checkpoint directory (no leading ``/``, no ``..`` or empty
    segment); `size` is in bytes; `sha256` may be left out (the file is then checked by size).
    At least one file, at most MANIFEST_MAX_FILES. Raises ValueError with the reason otherwise."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"not an object with format {MANIFEST_FORMAT!r}")
    files = doc.get("files")
    if not isinstance(files, list) or not files:
        raise ValueError("'files' must be a non-empty list")
    if len(files) > MANIFEST_MAX_FILES:
        raise ValueError(f"more than {MANIFEST_MAX_FILES} files")
    entries: list[ManifestEntry] = []
    for i, item in enumerate(files):
        if not isinstance(item, dict):
            raise ValueError(f"files[{i}] is not an object")
        path, size, digest = item.get("path"), item.get("size"), item.get("sha256")
        if (
            not isinstance(path, str)
            or not path
            or len(path) > MAX_LABEL_CHARS
            or not path.isprintable()
            or path.startswith("/")
            or any(part in ("", "..") for part in path.split("/"))
        ):
            raise ValueError(f"files[{i}].path must be a relative path inside the checkpoint directory")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"files[{i}].size must be a whole number of bytes")
        if digest is not None and (not isinstance(digest, str) or not _SHA256.fullmatch(digest)):
            raise ValueError(f"files[{i}].sha256 must be 64 hex digits")
        entries.append(ManifestEntry(path, size, digest.lower() if digest else None))
    return tuple(entries)
