"""The in-memory store's `control_state`: key → JSON document, as `store.state_repo` keeps it.

Documents are kept as JSON text (a stored value never shares an object with the caller) and
read back as fresh plain values. Must not: interpret the documents, read the clock, or do I/O.
"""

from __future__ import annotations

import json
from typing import Any

from lowtide.store.memory.base import MemoryBase

#: The longest key (as `store.state_repo.MAX_KEY_LENGTH`; that module imports SQLAlchemy).
MAX_KEY_LENGTH = 128
#: `json.dumps(value, allow_nan=False)` without building an encoder per call (the inference memory
#: is saved at most ticks of a simulation).
_ENCODE = json.JSONEncoder(allow_nan=False).encode


def check_key(key: str) -> None:
    if not key or len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"control_state key must be 1..{MAX_KEY_LENGTH} characters: {key!r}")


class StatePart(MemoryBase):
    def get_state(self, key: str) -> Any | None:
        with self._lock:
            found = self._control_state.get(key)
        return None if found is None else json.loads(found[0])

    def put_state(self, key: str, value: Any, *, now: float) -> None:
        check_key(key)
        text = _ENCODE(value)  # TypeError / ValueError, as the SQL store raises
        with self._lock:
            self._control_state[key] = (text, now)

    def state_updated_at(self, key: str) -> float | None:
        with self._lock:
            found = self._control_state.get(key)
        return None if found is None else found[1]
