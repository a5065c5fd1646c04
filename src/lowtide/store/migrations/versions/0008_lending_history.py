"""lending history: the lending envelope over time

`lending_history` holds `(at, lendable_gpus, mode)` points the inference controller writes when
the envelope changes and every few minutes otherwise (48 h kept), so the dashboard's timeline can
split idle GPUs into lent-and-idle and free (docs/architecture.md §12).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

Time = sa.Float(precision=53)


def upgrade() -> None:
    # A new table and its index: no existing table is touched, so no batch mode is needed.
    op.create_table(
        "lending_history",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", Time, nullable=False),
        sa.Column("lendable_gpus", sa.Integer(), nullable=False),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_lending_history"),
    )
    op.create_index("ix_lending_history_at", "lending_history", ["at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_lending_history_at", table_name="lending_history")
    op.drop_table("lending_history")
