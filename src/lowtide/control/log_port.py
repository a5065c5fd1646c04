"""The log port: where the API reads an attempt's output (docs/architecture.md §5).

An attempt's log lives where its executor put it: a file in its local work dir for the local
executor, the container's log behind the Kubernetes API (`pods/log`) for a cluster one. The API
asks this port, never a path, so following a log works the same way everywhere.
A cluster's log lives only as long as its pod (the kubelet deletes a container's log with the
pod; docs/cluster.md "Logs"): a reader that can tell a log is gone for good also implements
`LogLoss`, so the API says so instead of showing an empty log; a reader that cannot read for a
reason an operator must fix (a missing RBAC rule) raises `LogUnreadable` with words naming it.
Neighbours: `adapters.local_logs` implements it over the local layout, `adapters.argo.pod_logs`
over the Kubernetes API (`pods/log`); `api.app` reads through it.
Must not: decide who may read a log (the API checks visibility first) or touch the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

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


class LogUnreadable(Exception):
    """The log cannot be read until an operator fixes something (the message says what)."""


@runtime_checkable
class LogLoss(Protocol):
    def lost(self, ref: AttemptLogRef) -> str | None:
        """Why the attempt's log can no longer be read at all (e.g. its pod was deleted); None
        while it is there or may yet appear."""
        ...
