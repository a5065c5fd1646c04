"""The log port: where the API reads an attempt's output (docs/architecture.md §5).

An attempt's log lives where its executor put it: a file in its local work dir for the local
executor, the container's log behind the Kubernetes API (`pods/log`) for a cluster one. The API
asks this port, never a path, so following a log works the same way everywhere.
Neighbours: `adapters.local_logs` implements it over the local layout; `api.app` reads through it.
Must not: decide who may read a log (the API checks visibility first) or touch the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

#: At most this many bytes per read: a follower asks again for the rest.
READ_LIMIT = 1 << 20


@dataclass(frozen=True, slots=True)
class AttemptLogRef:
    """Which attempt's log: its job, step and number, and its executor's handle (None: unknown)."""

    job_id: str
    step: str
    number: int
    handle: str | None = None


class LogReader(Protocol):
    def read(self, ref: AttemptLogRef, offset: int, limit: int = READ_LIMIT) -> bytes:
        """Up to `limit` bytes of the log from byte `offset`; b"" when there is nothing there
        (yet). Never follows anything the step could have put in the log's place."""
        ...
