"""preemption: step limits, lost work, reclaims

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "reclaims",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("service", sa.String(length=63), nullable=True),
        sa.Column("replica_id", sa.String(length=80), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("victims", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("detected_at", sa.Float(precision=53), nullable=False),
        sa.Column("decided_at", sa.Float(precision=53), nullable=False),
        sa.Column("notice_at", sa.Float(precision=53), nullable=True),
        sa.Column("freed_at", sa.Float(precision=53), nullable=True),
        sa.Column("healthy_at", sa.Float(precision=53), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reclaims")),
    )
    with op.batch_alter_table("reclaims", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_reclaims_state"), ["state"], unique=False)

    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("lost_gpu_seconds", sa.Float(), nullable=True))

    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.add_column(sa.Column("min_runtime", sa.Float(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("max_preemptions", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("restart_seconds", sa.Float(), server_default="60", nullable=False))
        batch_op.add_column(sa.Column("stop_grace", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.drop_column("stop_grace")
        batch_op.drop_column("restart_seconds")
        batch_op.drop_column("max_preemptions")
        batch_op.drop_column("min_runtime")

    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_column("lost_gpu_seconds")

    with op.batch_alter_table("reclaims", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_reclaims_state"))

    op.drop_table("reclaims")
