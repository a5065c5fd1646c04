"""inference replicas and service events

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replicas",
        sa.Column("id", sa.String(length=80), nullable=False),
        sa.Column("service", sa.String(length=63), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("node", sa.String(length=63), nullable=True),
        sa.Column("gpus", sa.JSON(), nullable=False),
        sa.Column("port", sa.Integer(), nullable=False),
        sa.Column("parked_as", sa.String(length=8), nullable=True),
        sa.Column("since", sa.Float(precision=53), nullable=False),
        sa.Column("failures", sa.Integer(), server_default="0", nullable=False),
        sa.Column("retry_at", sa.Float(precision=53), server_default="0", nullable=False),
        sa.Column("message", sa.Text(), server_default="", nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replicas")),
    )
    with op.batch_alter_table("replicas", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_replicas_service"), ["service"], unique=False)

    op.create_table(
        "service_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("service", sa.String(length=63), nullable=False),
        sa.Column("replica_id", sa.String(length=80), nullable=True),
        sa.Column("at", sa.Float(precision=53), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_service_events")),
    )
    with op.batch_alter_table("service_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_service_events_service_at"), ["service", "at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("service_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_service_events_service_at"))

    op.drop_table("service_events")
    with op.batch_alter_table("replicas", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_replicas_service"))

    op.drop_table("replicas")
