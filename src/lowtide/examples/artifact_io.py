"""Tiny I/O helpers for the example steps: local paths or fsspec URLs (s3://...) alike.

Storage options (endpoint, credentials) come from LOWTIDE_STORAGE_OPTIONS, which lowtide sets
when its artifact root is remote.
"""

from __future__ import annotations

import json
import os
from typing import Any


def _remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _fs(path: str) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    options = json.loads(os.environ.get("LOWTIDE_STORAGE_OPTIONS") or "{}") if _remote(path) else {}
    fs, inner = url_to_fs(path, **options)
    return fs, str(inner)


def join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def write_text(path: str, text: str) -> None:
    """Write atomically where the storage allows it (local: temp file + rename)."""
    if not _remote(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return
    fs, p = _fs(path)
    with fs.open(p, "w") as fh:  # object stores make a single PUT visible atomically
        fh.write(text)


def read_text(path: str) -> str | None:
    if not _remote(path):
        try:
            with open(path, encoding="utf-8") as fh:
                return fh.read()
        except FileNotFoundError:
            return None
    fs, p = _fs(path)
    try:
        with fs.open(p, "r") as fh:
            return str(fh.read())
    except FileNotFoundError:
        return None


def list_names(path: str) -> list[str]:
    if not _remote(path):
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []
    fs, p = _fs(path)
    try:
        return sorted(str(x).rstrip("/").rsplit("/", 1)[-1] for x in fs.ls(p, detail=False))
    except FileNotFoundError:
        return []


def write_json(path: str, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=True))


def read_json(path: str) -> Any:
    text = read_text(path)
    return None if text is None else json.loads(text)
