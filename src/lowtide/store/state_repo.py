"""What the controllers remember across a restart: the `control_state` table (key → JSON value).

Role: a small key/value store of JSON documents with the time each was written, for memory a
controller must not lose when the control plane restarts (the autoscaler's windows,
`control.inference`; docs/architecture.md §4.4). One row per key, replaced wholesale by `put_state`.
`store.memory.state` has the same methods over a dict.
Neighbours: `store.repo.Store` composes it; `control.inference` is its user (through
`InferenceStore`). Must not: interpret the documents, decide anything, or read the clock (the
time is passed in).
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from lowtide.store.base import StoreBase
from lowtide.store.schema import control_state

#: The longest key `control_state` holds (its column is String(128)).
MAX_KEY_LENGTH = 128


def check_key(key: str) -> None:
    """Raise ValueError for a key the table cannot hold."""
    if not key or len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"control_state key must be 1..{MAX_KEY_LENGTH} characters: {key!r}")


class StateRepo(StoreBase):
    def get_state(self, key: str) -> Any | None:
        """The JSON document stored under `key` (plain dicts, lists and scalars), or None."""
        with self._read() as conn:
            row = conn.execute(sa.select(control_state.c.value).where(control_state.c.key == key)).first()
        return None if row is None else row.value

    def put_state(self, key: str, value: Any, *, now: float) -> None:
        """Store `value` (JSON-serialisable) under `key`, replacing what was there."""
        check_key(key)
        json.dumps(value, allow_nan=False)  # TypeError / ValueError before any SQL, as in memory
        with self._write() as conn:
            updated = conn.execute(
                sa.update(control_state).where(control_state.c.key == key).values(value=value, updated_at=now)
            ).rowcount
            if not updated:
                conn.execute(sa.insert(control_state).values(key=key, value=value, updated_at=now))

    def state_updated_at(self, key: str) -> float | None:
        """When `key` was last written (None: never)."""
        with self._read() as conn:
            value = conn.execute(
                sa.select(control_state.c.updated_at).where(control_state.c.key == key)
            ).scalar()
        return None if value is None else float(value)
