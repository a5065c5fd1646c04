"""faults: idempotent submits, the control-plane lease, controller memory

`jobs.idempotency_key`/`request_digest` (unique per owner and key) make a retried submit return
the job it created; `control_lease` holds the one active control plane and its fencing token;
`control_state` keeps what the controllers must remember across a restart (docs/architecture.md
§4.4).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

Time = sa.Float(precision=53)


def upgrade() -> None:
    # Not batch mode: on SQLite it would copy and drop `jobs`, and the drop cascades to steps and
    # attempts (ON DELETE CASCADE). ADD COLUMN and CREATE INDEX need no copy.
    op.add_column("jobs", sa.Column("idempotency_key", sa.String(128), nullable=True))
    op.add_column("jobs", sa.Column("request_digest", sa.String(64), nullable=True))
    op.create_index("ix_jobs_owner_idempotency_key", "jobs", ["owner", "idempotency_key"], unique=True)
    op.create_table(
        "control_lease",
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("host", sa.String(255), server_default="", nullable=False),
        sa.Column("pid", sa.Integer(), server_default="0", nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.Column("acquired_at", Time, nullable=False),
        sa.Column("renewed_at", Time, nullable=False),
        sa.Column("expires_at", Time, nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_control_lease"),
    )
    op.create_table(
        "control_state",
        sa.Column("key", sa.String(128), nullable=False),
        sa.Column("value", sa.JSON(), nullable=False),
        sa.Column("updated_at", Time, nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_control_state"),
    )


def downgrade() -> None:
    op.drop_table("control_state")
    op.drop_table("control_lease")
    op.drop_index("ix_jobs_owner_idempotency_key", table_name="jobs")
    for column in ("request_digest", "idempotency_key"):
        # SQLite ≥ 3.35 drops a column in place (no table copy, so no cascade; see upgrade).
        op.execute(sa.text(f"ALTER TABLE jobs DROP COLUMN {column}"))
