"""The store's API tokens: mint, authenticate, read one, list, revoke.

Only a token's SHA-256 (`token_codec.hash_token`, shared with the in-memory store) is stored; the
raw token is returned once, by `create_token`. Roles (`ROLES`): admin, user, viewer, and step
(minted per attempt by the control loop; `attempts_repo` revokes them when the attempt ends).
Each token carries its scope: the teams it may submit for and see, and its highest priority
(`token_codec.token_scope` fills the role's defaults; docs/architecture.md §11). The last active
admin token cannot be revoked (`LastAdminToken`), checked in the same transaction as the revoke.
A mixin over `base.StoreBase`, composed into `repo.Store`; `api.auth` and the control loop call it.
Must not: store or log raw tokens, decide who may do what (`api.auth` does), or read the clock
(every time is passed in).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from lowtide.control.records import LastAdminToken, NotFound, TokenRecord
from lowtide.store.base import StoreBase
from lowtide.store.schema import tokens
from lowtide.store.token_codec import ROLES, hash_token, new_raw_token, token_scope

__all__ = ["ROLES", "TokensRepo", "hash_token"]


def _record(row: Any) -> TokenRecord:
    return TokenRecord(
        row.id,
        row.name,
        row.owner,
        row.role,
        row.attempt_id,
        row.created_at,
        row.revoked_at,
        tuple(row.teams),
        row.max_priority,
    )


class TokensRepo(StoreBase):
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
        with self._write() as conn:
            token_id = conn.execute(
                sa.insert(tokens)
                .values(
                    name=name,
                    owner=owner,
                    role=role,
                    token_hash=hash_token(raw),
                    attempt_id=attempt_id,
                    created_at=now,
                    teams=list(scope),
                    max_priority=priority,
                )
                .returning(tokens.c.id)
            ).scalar_one()
        return TokenRecord(token_id, name, owner, role, attempt_id, now, None, scope, priority), raw

    def authenticate(self, raw: str) -> TokenRecord | None:
        with self._read() as conn:
            row = conn.execute(
                sa.select(tokens).where(tokens.c.token_hash == hash_token(raw), tokens.c.revoked_at.is_(None))
            ).first()
        return None if row is None else _record(row)

    def token(self, token_id: int) -> TokenRecord:
        """One token by id, revoked or not (step tokens too); NotFound if there is none."""
        with self._read() as conn:
            row = conn.execute(sa.select(tokens).where(tokens.c.id == token_id)).first()
        if row is None:
            raise NotFound(f"token {token_id} not found")
        return _record(row)

    def list_tokens(self) -> list[TokenRecord]:
        with self._read() as conn:
            rows = conn.execute(sa.select(tokens).where(tokens.c.role != "step").order_by(tokens.c.id)).all()
        return [_record(r) for r in rows]

    def revoke_token(self, token_id: int, now: float) -> None:
        """Revoke a token; NotFound if there is no such active token, LastAdminToken (nothing
        written) if it is the only active admin token."""
        with self._write() as conn:
            role = conn.execute(
                sa.select(tokens.c.role).where(tokens.c.id == token_id, tokens.c.revoked_at.is_(None))
            ).scalar()
            if role == "admin":
                # Lock the active admin rows (PostgreSQL) so that two revokes cannot both pass.
                admins = conn.execute(
                    sa.select(tokens.c.id)
                    .where(tokens.c.role == "admin", tokens.c.revoked_at.is_(None))
                    .with_for_update()
                ).all()
                if len(admins) <= 1:
                    raise LastAdminToken(
                        f"token {token_id} is the last active admin token: create another admin token "
                        "first (lowtide token create NAME --role admin)"
                    )
            result = conn.execute(
                sa.update(tokens)
                .where(tokens.c.id == token_id, tokens.c.revoked_at.is_(None))
                .values(revoked_at=now)
            )
            if result.rowcount != 1:
                raise NotFound(f"token {token_id} not found or already revoked")

    def has_admin_token(self) -> bool:
        with self._read() as conn:
            return (
                conn.execute(
                    sa.select(tokens.c.id)
                    .where(tokens.c.role == "admin", tokens.c.revoked_at.is_(None))
                    .limit(1)
                ).first()
                is not None
            )
