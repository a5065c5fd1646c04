"""API tokens as values: minting a raw token, hashing it for storage, the roles a token carries
and the default scope (teams, highest priority) of each role (docs/architecture.md §11).

Shared by both stores (`tokens_repo` on SQL, `store.memory`), so a token minted by either is
stored and recognised the same way: only `hash_token(raw)` (SHA-256, hex) is kept.
Must not: import SQLAlchemy (the in-memory store, which the simulator imports, uses it), store or
log raw tokens, or decide who may do what (`api.auth` does).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

ROLES = ("admin", "user", "viewer", "step")
#: "every team" in a token's `teams`.
ALL_TEAMS = "*"
#: What a token may do when its creator does not say: admins everything; users submit for the
#: team "default" (the team of a spec that names none) at most at "normal" priority (50).
DEFAULT_MAX_PRIORITY = {"admin": 100, "user": 50, "viewer": 0, "step": 0}
DEFAULT_TEAMS: dict[str, tuple[str, ...]] = {
    "admin": (ALL_TEAMS,),
    "user": ("default",),
    "viewer": ("default",),
    "step": (),
}


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def new_raw_token() -> str:
    return f"lt_{secrets.token_urlsafe(32)}"


def check_role(role: str) -> None:
    """Raise ValueError for a role that is not one of `ROLES`."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")


def token_scope(
    role: str, teams: Sequence[str] | None, max_priority: int | None
) -> tuple[tuple[str, ...], int]:
    """(teams, max_priority) of a new token: as given, else the role's defaults; an admin token
    always holds every team and priority 100. Raises ValueError for a priority outside 0..100."""
    check_role(role)
    if role == "admin":
        return (ALL_TEAMS,), 100
    scope = tuple(dict.fromkeys(teams)) if teams else DEFAULT_TEAMS[role]
    priority = DEFAULT_MAX_PRIORITY[role] if max_priority is None else max_priority
    if not 0 <= priority <= 100:
        raise ValueError(f"max_priority must be between 0 and 100, got {priority}")
    return scope, priority
