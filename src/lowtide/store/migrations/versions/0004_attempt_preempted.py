"""attempt preempted: a flag set from the exit decision, instead of reading the attempt's message

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("preempted", sa.Boolean(), server_default=sa.false(), nullable=False))
    # Attempts that ended before this revision: the exit decision's message said so (the only
    # record then): "preempted (...)" or "process lost during preemption; requeued".
    op.execute(
        "UPDATE attempts SET preempted = TRUE WHERE state IN ('INTERRUPTED', 'LOST') "
        "AND (message LIKE 'preempted%' OR message LIKE '%during preemption%')"
    )


def downgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_column("preempted")
