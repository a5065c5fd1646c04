"""Artifacts through fsspec: the one place that touches the artifact root (local path or URL).

Implements `control.ports.ArtifactPort` for the loop (prepare output and checkpoint directories,
read a step's ``LATEST``) plus small helpers for the API and tests. Storage options (endpoint,
credentials) apply to the artifact root's protocol. Must not: decide what a file means.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from lowtide.domain.layout import is_remote


def _read_local(path: str, limit: int, uri: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{uri} is a symbolic link; write the file itself") from None
        raise
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise ValueError(f"{uri} is not a regular file")
        return fh.read(limit)


class FsspecArtifacts:
    def __init__(self, root: str, options: Mapping[str, Any] | None = None) -> None:
        self.root = root
        self.options = dict(options or {})

    def _fs(self, uri: str) -> tuple[Any, str]:
        opts = self.options if is_remote(uri) else {}
        fs, path = url_to_fs(uri, **opts)
        return fs, str(path)

    def ensure_dir(self, uri: str) -> None:
        if is_remote(uri):
            return  # object stores have no directories: keys appear when written
        fs, path = self._fs(uri)
        fs.makedirs(path, exist_ok=True)

    def read_text(self, uri: str, *, max_bytes: int) -> str | None:
        """A small text file (a step's ``LATEST``). A local one lies in a directory the step owns
        (docs/architecture.md §6.4), so it is opened without following a symlink and read only
        if it is a regular file: lowtide (root) must not read its own secrets through a step's
        link, nor block on a FIFO. Raises ValueError for anything else."""
        fs, path = self._fs(uri)
        try:
            if is_remote(uri):
                with fs.open(path, "rb") as fh:
                    data: bytes = fh.read(max_bytes + 1)
            else:
                data = _read_local(path, max_bytes + 1, uri)
        except FileNotFoundError:
            return None
        if len(data) > max_bytes:
            raise ValueError(f"{uri} is larger than {max_bytes} bytes")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{uri} is not UTF-8 text (byte {exc.start})") from exc

    def write_text(self, uri: str, text: str) -> None:
        fs, path = self._fs(uri)
        if not is_remote(uri):
            fs.makedirs(fs._parent(path), exist_ok=True)
        with fs.open(path, "wb") as fh:
            fh.write(text.encode("utf-8"))

    def exists(self, uri: str) -> bool:
        fs, path = self._fs(uri)
        return bool(fs.exists(path))

    def list(self, uri: str) -> list[str]:
        fs, path = self._fs(uri)
        try:
            return sorted(str(p) for p in fs.ls(path, detail=False))
        except FileNotFoundError:
            return []

    def check(self) -> None:
        """Fail early with a clear message if the artifact root cannot be reached."""
        fs, path = self._fs(self.root)
        if not is_remote(self.root):
            fs.makedirs(path, exist_ok=True)
            return
        fs.ls(path.split("/", 1)[0])


__all__ = ["FsspecArtifacts", "fsspec"]
