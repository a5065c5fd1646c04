"""Artifacts through fsspec: the one place that touches the artifact root (local path or URL).

Implements `control.ports.ArtifactPort` for the loop (prepare output and checkpoint directories,
read a step's ``LATEST``, stat and hash a checkpoint's files before a resume) plus small helpers
for the API and tests. Below a local artifact root, `stat` and `sha256` walk the path one
component at a time with ``O_NOFOLLOW`` (open(2), openat(2): ``ELOOP`` on a link): a step owns
its checkpoint directory and must not make lowtide (root) stat or hash a file outside it.
Storage options (endpoint, credentials) apply to the artifact root's protocol.
Must not: decide what a file means.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from lowtide.control.ports import PathStat
from lowtide.domain.layout import is_remote

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1024 * 1024


class _Link(Exception):
    """A component of the path is a symbolic link (or not a directory): not followed."""


@contextmanager
def _parent_fd(root: str, path: str) -> Iterator[tuple[int, str]]:
    """An fd of `path`'s parent directory and its last name. Below `root` (the operator's, opened
    as it is) every directory is entered with O_NOFOLLOW; a path outside `root` is opened plainly
    up to its parent (the last name is still never followed by the callers)."""
    root = os.path.normpath(root)
    path = os.path.normpath(path)
    if path.startswith(root + "/"):
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        parts = path[len(root) + 1 :].split("/")
    else:
        parent, _, last = path.rpartition("/")
        fd = os.open(parent or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        parts = [last]
    try:
        for name in parts[:-1]:
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _Link(name) from None
                raise
            os.close(fd)
            fd = nxt
        yield fd, parts[-1]
    finally:
        os.close(fd)


def _modified(info: Mapping[str, Any]) -> float | None:
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, int | float):
            return float(value)
    return None


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

    def _local_root(self) -> str:
        return str(url_to_fs(self.root)[1]) if not is_remote(self.root) else "/"

    def stat(self, uri: str) -> PathStat | None:
        """What is at `uri`: a regular file with its size, a directory, or "other" (a link, a
        FIFO, a link on the way there); None if nothing. Locally never follows a link below the
        artifact root."""
        fs, path = self._fs(uri)
        if is_remote(uri):
            try:
                info = fs.info(path)
            except FileNotFoundError:
                return None
            kind = info.get("type")
            if kind == "directory":
                return PathStat("dir", None, _modified(info))
            return PathStat("file", int(info.get("size") or 0), _modified(info))
        try:
            with _parent_fd(self._local_root(), path) as (fd, name):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except _Link:
            return PathStat("other")
        if stat.S_ISREG(st.st_mode):
            return PathStat("file", st.st_size, st.st_mtime_ns / 1e9)
        if stat.S_ISDIR(st.st_mode):
            return PathStat("dir", None, st.st_mtime_ns / 1e9)
        return PathStat("other")

    def sha256(self, uri: str, *, max_bytes: int) -> str | None:
        """The hex sha256 of a regular file of at most `max_bytes` (None if larger or gone);
        ValueError if it is not a regular file (locally: opened with O_NOFOLLOW | O_NONBLOCK)."""
        fs, path = self._fs(uri)
        digest = hashlib.sha256()
        read = 0
        try:
            if is_remote(uri):
                with fs.open(path, "rb") as fh:
                    while chunk := fh.read(_CHUNK):
                        read += len(chunk)
                        if read > max_bytes:
                            return None
                        digest.update(chunk)
                return digest.hexdigest()
            with _parent_fd(self._local_root(), path) as (dir_fd, name):
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                try:
                    fd = os.open(name, flags, dir_fd=dir_fd)
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        raise ValueError("is a symbolic link (not followed)") from None
                    raise
            with os.fdopen(fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                    raise ValueError("is not a regular file")
                while chunk := fh.read(_CHUNK):
                    read += len(chunk)
                    if read > max_bytes:
                        return None
                    digest.update(chunk)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except _Link:
            raise ValueError("lies below a symbolic link (not followed)") from None
        return digest.hexdigest()

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
