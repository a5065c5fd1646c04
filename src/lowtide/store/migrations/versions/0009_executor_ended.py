"""executor ended: when the executor took the end of a job that will start nothing more

`jobs.executor_ended_at` is set by the control loop once `Executor.end_job` succeeded for a
finished job (SUCCEEDED, FAILED, CANCELLED): until then the job is listed by `jobs_to_end`, so a
restart, a new leader or a cancel the loop never saw still ends it (docs/cluster.md "When a job
will start nothing more"). Jobs already finished at upgrade are marked ended (at their finish, or
their submit when none is recorded): an upgrade does not replay `end_job` for history.
`ix_jobs_executor_unended` is a partial index (SQLite ≥ 3.8.0 and PostgreSQL both have them) on
(state, id) of the rows still NULL: the loop's per-tick read touches only those.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

Time = sa.Float(precision=53)
UNENDED = "executor_ended_at IS NULL"


def upgrade() -> None:
    # ADD COLUMN of a nullable column is native on SQLite and PostgreSQL (no batch copy of `jobs`,
    # whose drop would cascade to steps and attempts on SQLite).
    op.add_column("jobs", sa.Column("executor_ended_at", Time, nullable=True))
    op.execute(
        "UPDATE jobs SET executor_ended_at = COALESCE(finished_at, submitted_at) "
        "WHERE state IN ('SUCCEEDED', 'FAILED', 'CANCELLED')"
    )
    op.create_index(
        "ix_jobs_executor_unended",
        "jobs",
        ["state", "id"],
        unique=False,
        sqlite_where=sa.text(UNENDED),
        postgresql_where=sa.text(UNENDED),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_executor_unended", table_name="jobs")
    op.drop_column("jobs", "executor_ended_at")
