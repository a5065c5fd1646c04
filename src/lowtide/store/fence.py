"""The fence check every write transaction of a leader's store makes first (docs/architecture.md §4.4).

`check_fence(conn, fence)` reads the lease row's token inside the caller's write transaction and
raises `records.FencedOut` (the transaction then rolls back) when it is not the leader's token any
more: another control plane took the lease over, so nothing this one writes may count.

PostgreSQL: the row is read ``FOR SHARE`` (PostgreSQL 16 docs, §13.3.2 "Row-Level Locks": FOR SHARE
"blocks other transactions from performing UPDATE, DELETE, SELECT FOR UPDATE ... on these rows"),
so a takeover (``SELECT ... FOR UPDATE`` in `lease_repo.claim_lease`) waits until the leader's
in-flight writes have committed or rolled back, and every write that starts after the takeover
committed reads the new token (READ COMMITTED re-reads a row that a concurrent transaction
updated: §13.2.1). SQLite: write transactions are exclusive (``BEGIN IMMEDIATE``, `store.db`), so
the plain read is already serialised with a takeover.
Must not: decide who holds the lease (`control.lease`), or write anything.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy import Connection

from lowtide.control.lease import Fence, fenced_message
from lowtide.control.records import FencedOut
from lowtide.store.schema import control_lease


def check_fence(conn: Connection, fence: Fence, on_fenced: Callable[[FencedOut], None] | None = None) -> None:
    """Raise FencedOut unless the lease row `fence.name` still holds `fence.token`; `on_fenced`
    hears of it first (the leadership stops acting at once, whoever catches the error)."""
    query = sa.select(control_lease.c.token, control_lease.c.holder).where(control_lease.c.name == fence.name)
    row = conn.execute(query.with_for_update(read=True)).first()
    if row is not None and int(row.token) == fence.token:
        return
    holder, token = (str(row.holder), int(row.token)) if row is not None else (None, None)
    exc = FencedOut(fenced_message(fence, holder, token))
    if on_fenced is not None:
        on_fenced(exc)
    raise exc
