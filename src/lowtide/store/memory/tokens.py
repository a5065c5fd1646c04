"""The in-memory store's API tokens: mint, authenticate, list, revoke.

The counterpart of `store.tokens_repo`: tokens are minted and hashed by `store.token_codec`,
shared with it, and only the hash is kept (`_token_by_hash`); the raw token is returned once.
Step tokens (one per attempt, revoked when the attempt ends: `attempts`) are indexed by attempt;
the others, few, are kept in id order for listing and for `has_admin_token`. Scopes and the
last-admin rule are those of `store.tokens_repo` (docs/architecture.md §11).
Neighbours: `base.MemoryBase` (state, `_revoke`). Must not: keep or log raw tokens, decide who
may do what (`api.auth` does), or read the clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from lowtide.control.records import LastAdminToken, NotFound, TokenRecord
from lowtide.store.memory.base import MemoryBase
from lowtide.store.token_codec import hash_token, new_raw_token, token_scope


class TokensPart(MemoryBase):
    def create_token(
        self,
        *,
        name: str,
        owner: str,
        role: str,
        now: float,
        attempt_id: int | None = None,
        teams: Sequence[str] | None = None,
        max_priority: int | None = None,
        raw: str | None = None,
    ) -> tuple[TokenRecord, str]:
        """A new token; `raw` registers a token given from outside (an admin token from a
        Kubernetes Secret) instead of drawing one."""
        scope, priority = token_scope(role, teams, max_priority)
        raw = new_raw_token() if raw is None else raw
        with self._lock:
            record = TokenRecord(
                next(self._token_ids), name, owner, role, attempt_id, now, None, scope, priority
            )
            self._tokens[record.id] = record
            self._token_by_hash[hash_token(raw)] = record.id
            if attempt_id is not None:
                self._tokens_of_attempt.setdefault(attempt_id, []).append(record.id)
            if role != "step":
                self._listed_tokens.append(record.id)
        return record, raw

    def authenticate(self, raw: str) -> TokenRecord | None:
        with self._lock:
            token_id = self._token_by_hash.get(hash_token(raw))
            record = None if token_id is None else self._tokens[token_id]
        return record if record is not None and record.revoked_at is None else None

    def token(self, token_id: int) -> TokenRecord:
        """One token by id, revoked or not (step tokens too); NotFound if there is none."""
        with self._lock:
            record = self._tokens.get(token_id)
        if record is None:
            raise NotFound(f"token {token_id} not found")
        return record

    def list_tokens(self) -> list[TokenRecord]:
        """Every token but step tokens, in id order."""
        with self._lock:
            return [self._tokens[i] for i in self._listed_tokens]

    def revoke_token(self, token_id: int, now: float) -> None:
        with self._lock:
            token = self._tokens.get(token_id)
            if token is not None and token.role == "admin" and token.revoked_at is None:
                active = sum(
                    1
                    for t in (self._tokens[i] for i in self._listed_tokens)
                    if t.role == "admin" and t.revoked_at is None
                )
                if active <= 1:
                    raise LastAdminToken(
                        f"token {token_id} is the last active admin token: create another admin token "
                        "first (lowtide token create NAME --role admin)"
                    )
            if not self._revoke(token_id, now):
                raise NotFound(f"token {token_id} not found or already revoked")

    def has_admin_token(self) -> bool:
        with self._lock:
            return any(
                t.role == "admin" and t.revoked_at is None
                for t in (self._tokens[i] for i in self._listed_tokens)
            )
