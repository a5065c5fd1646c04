"""The log port over the local executor's files: `<work dir>/log` of each attempt.

Neighbours: implements `control.log_port.LogReader`; `wiring` hands it to the API.
Must not: decide who may read (the API does) or follow links: the log lies in the step's own work
dir (docs/architecture.md §6.4), so a symlink or FIFO the step put in its place is not lowtide's
log (root must not read the admin token through it).
"""

from __future__ import annotations

import errno
import os
import stat

from lowtide.control.log_port import READ_LIMIT, AttemptLogRef
from lowtide.domain.layout import ArtifactLayout


class LocalLogReader:
    def __init__(self, layout: ArtifactLayout) -> None:
        self._layout = layout

    def read(self, ref: AttemptLogRef, offset: int, limit: int = READ_LIMIT) -> bytes:
        path = self._layout.attempt_log(ref.job_id, ref.step, ref.number)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return b""
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return b""
            raise
        try:
            with os.fdopen(fd, "rb") as fh:
                info = os.fstat(fh.fileno())
                if not stat.S_ISREG(info.st_mode):
                    return b""
                if offset >= info.st_size:
                    return b""  # nothing there (yet); seek() fails past the largest offset a file can have
                fh.seek(offset)
                return fh.read(limit)
        except FileNotFoundError:
            return b""
