"""The store's API tokens: mint, authenticate, list, revoke.

Only a token's SHA-256 (`token_codec.hash_token`, shared with the in-memory store) is stored; the
raw token is returned once, by `create_token`. Roles (`ROLES`): admin, user, and step (minted per
attempt by the control loop; `attempts_repo` revokes them when the attempt ends). A mixin over
`base.StoreBase`, composed into `repo.Store`; `api.auth` and the control loop call it.
Must not: store or log raw tokens, decide who may do what (`api.auth` does), or read the clock
(every time is passed in).
"""

from __future__ import annotations

import sqlalchemy as sa

from lowtide.control.records import NotFound, TokenRecord
from lowtide.store.base import StoreBase
from lowtide.store.schema import tokens
from lowtide.store.token_codec import ROLES, check_role, hash_token, new_raw_token

__all__ = ["ROLES", "TokensRepo", "hash_token"]


class TokensRepo(StoreBase):
    def create_token(
        self, *, name: str, owner: str, role: str, now: float, attempt_id: int | None = None
    ) -> tuple[TokenRecord, str]:
        check_role(role)
        raw = new_raw_token()
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
                )
                .returning(tokens.c.id)
            ).scalar_one()
        return TokenRecord(token_id, name, owner, role, attempt_id, now, None), raw

    def authenticate(self, raw: str) -> TokenRecord | None:
        with self._read() as conn:
            row = conn.execute(
                sa.select(tokens).where(tokens.c.token_hash == hash_token(raw), tokens.c.revoked_at.is_(None))
            ).first()
        if row is None:
            return None
        return TokenRecord(
            row.id, row.name, row.owner, row.role, row.attempt_id, row.created_at, row.revoked_at
        )

    def list_tokens(self) -> list[TokenRecord]:
        with self._read() as conn:
            rows = conn.execute(sa.select(tokens).where(tokens.c.role != "step").order_by(tokens.c.id)).all()
        return [
            TokenRecord(r.id, r.name, r.owner, r.role, r.attempt_id, r.created_at, r.revoked_at) for r in rows
        ]

    def revoke_token(self, token_id: int, now: float) -> None:
        with self._write() as conn:
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
