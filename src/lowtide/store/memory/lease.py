"""The in-memory store's control-plane lease: `store.lease_repo`'s methods over one dict.

Same rules (`control.lease.claim_action`, `granted_row`), same records, same errors; expiry uses
the caller's `now` (as SQLite does). `fence_writes` makes the state-moving writes the control
loop and the inference side act through (`begin_attempt`, `set_attempt_process`,
`finish_attempt`, `request_preemption`, `mark_stopping`, `apply_dag`, `begin_replica`,
`move_replica`, `open_reclaim`, `update_reclaim`, `mark_jobs_ended`) check the token first
(`_check_fence`) and raise `FencedOut` before changing anything; plain records (events, reasons,
tokens, checkpoints) are not fenced here. One object is one process's store, so two "control
planes" sharing it in a test share its fence: the one that set it is the one checked.
Must not: read the clock, or decide who may hold the lease.
"""

from __future__ import annotations

from collections.abc import Callable

from lowtide.control.lease import (
    LEASE_NAME,
    ClaimAction,
    Fence,
    LeaseCandidate,
    LeaseClaim,
    LeaseRecord,
    claim_action,
    granted_row,
)
from lowtide.control.records import FencedOut
from lowtide.store.memory.base import MemoryBase


class LeasePart(MemoryBase):
    """See the module docstring."""

    def claim_lease(
        self, candidate: LeaseCandidate, *, ttl_s: float, now: float, name: str = LEASE_NAME
    ) -> LeaseClaim:
        with self._lock:
            row = self._leases.get(name)
            action = claim_action(row, candidate, now)
            new = granted_row(action, row, candidate, name=name, now=now, ttl_s=ttl_s)
            if new is None:
                return LeaseClaim(False, row, None, now)
            self._leases[name] = new
            return LeaseClaim(True, new, row if action == ClaimAction.TAKEOVER else None, now)

    def release_lease(self, holder: str, *, now: float, name: str = LEASE_NAME) -> bool:
        with self._lock:
            row = self._leases.get(name)
            if row is None or row.holder != holder:
                return False
            self._leases[name] = LeaseRecord(
                row.name, row.holder, row.host, row.pid, row.token, row.acquired_at, row.renewed_at, now
            )
            return True

    def lease(self, *, now: float, name: str = LEASE_NAME) -> tuple[LeaseRecord | None, float]:
        with self._lock:
            return self._leases.get(name), now

    def fence_writes(self, fence: Fence | None, on_fenced: Callable[[FencedOut], None] | None = None) -> None:
        with self._lock:
            self._fence = fence
            self._on_fenced = on_fenced if fence is not None else None
