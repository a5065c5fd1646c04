"""token scope: the teams a token may submit for and see, and its highest priority

Tokens minted before this revision keep what they could do (every team, priority 100); an admin
restricts a person by minting a scoped token and revoking the old one (docs/architecture.md §11).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.add_column(sa.Column("teams", sa.JSON(), server_default='["*"]', nullable=False))
        batch_op.add_column(sa.Column("max_priority", sa.Integer(), server_default="100", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.drop_column("max_priority")
        batch_op.drop_column("teams")
