"""API tokens as values: minting a raw token, hashing it for storage, and the roles a token carries.

Shared by both stores (`tokens_repo` on SQL, `store.memory`), so a token minted by either is
stored and recognised the same way: only `hash_token(raw)` (SHA-256, hex) is kept.
Must not: import SQLAlchemy (the in-memory store, which the simulator imports, uses it), store or
log raw tokens, or decide who may do what (`api.auth` does).
"""

from __future__ import annotations

import hashlib
import secrets

ROLES = ("admin", "user", "step")


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def new_raw_token() -> str:
    return f"lt_{secrets.token_urlsafe(32)}"


def check_role(role: str) -> None:
    """Raise ValueError for a role that is not one of `ROLES`."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
