"""executor handles: attempts named by an opaque handle, with a pending phase and exit reasons

`attempts.pid` becomes `handle` (text: a pid for the local executor, a pod for a cluster one) and
`pid_started_at` becomes `handle_started_at`; `running_at` is when the attempt began to run (NULL
while PENDING); `exit_reason`/`exit_detail` say why it ended (docs/architecture.md §5). Existing
attempts ran from their start: `running_at = started_at`. `steps.retried_at` is when `lowtide
retry` last reopened a step (its walltime counts the attempts after it).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

Time = sa.Float(precision=53)


def upgrade() -> None:
    # Not batch mode (it would copy and drop `attempts` on SQLite, and the drop cascades to
    # checkpoints): ADD/RENAME/DROP COLUMN are native in SQLite >= 3.35 and in PostgreSQL.
    op.add_column("attempts", sa.Column("handle", sa.String(255), nullable=True))
    op.add_column("attempts", sa.Column("running_at", Time, nullable=True))
    op.add_column("attempts", sa.Column("exit_reason", sa.String(32), nullable=True))
    op.add_column("attempts", sa.Column("exit_detail", sa.Text(), nullable=True))
    op.add_column("steps", sa.Column("retried_at", Time, nullable=True))
    op.execute("UPDATE attempts SET handle = CAST(pid AS VARCHAR(255)) WHERE pid IS NOT NULL")
    op.execute("UPDATE attempts SET running_at = started_at")
    op.execute("ALTER TABLE attempts RENAME COLUMN pid_started_at TO handle_started_at")
    op.execute("ALTER TABLE attempts DROP COLUMN pid")


def downgrade() -> None:
    op.add_column("attempts", sa.Column("pid", sa.Integer(), nullable=True))
    op.execute(
        "UPDATE attempts SET pid = CAST(handle AS INTEGER) "
        "WHERE handle IS NOT NULL AND handle NOT LIKE '%/%' AND handle NOT LIKE '%:%'"
    )
    op.execute("ALTER TABLE attempts RENAME COLUMN handle_started_at TO pid_started_at")
    op.drop_column("steps", "retried_at")
    op.drop_column("attempts", "exit_detail")
    op.drop_column("attempts", "exit_reason")
    op.drop_column("attempts", "running_at")
    op.drop_column("attempts", "handle")
