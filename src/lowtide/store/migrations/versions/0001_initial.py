"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("step_name", sa.String(length=63), nullable=True),
        sa.Column("attempt_id", sa.Integer(), nullable=True),
        sa.Column("at", sa.Float(precision=53), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_events_job_id"), ["job_id"], unique=False)

    op.create_table(
        "gpu_ledger",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("node", sa.String(length=63), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("holder_kind", sa.String(length=16), nullable=False),
        sa.Column("holder_id", sa.String(length=80), nullable=True),
        sa.Column("job_id", sa.String(length=40), nullable=True),
        sa.Column("team", sa.String(length=63), nullable=True),
        sa.Column("started_at", sa.Float(precision=53), nullable=False),
        sa.Column("ended_at", sa.Float(precision=53), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpu_ledger")),
    )
    with op.batch_alter_table("gpu_ledger", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_gpu_ledger_job_id"), ["job_id"], unique=False)
        batch_op.create_index(
            batch_op.f("ix_gpu_ledger_node_gpu_index_ended_at"),
            ["node", "gpu_index", "ended_at"],
            unique=False,
        )

    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("team", sa.String(length=63), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("submitted_at", sa.Float(precision=53), nullable=False),
        sa.Column("started_at", sa.Float(precision=53), nullable=True),
        sa.Column("finished_at", sa.Float(precision=53), nullable=True),
        sa.Column("cancel_requested_at", sa.Float(precision=53), nullable=True),
        sa.Column("grace_seconds", sa.Float(), nullable=False),
        sa.Column("template", sa.String(length=63), nullable=True),
        sa.Column("rerun_of", sa.String(length=40), nullable=True),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("source_text", sa.Text(), nullable=False),
        sa.Column("message", sa.Text(), server_default="", nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_jobs_state"), ["state"], unique=False)
        batch_op.create_index(batch_op.f("ix_jobs_submitted_at"), ["submitted_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_jobs_team"), ["team"], unique=False)

    op.create_table(
        "meta",
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_meta")),
    )
    op.create_table(
        "team_usage",
        sa.Column("team", sa.String(length=63), nullable=False),
        sa.Column("decayed_gpu_seconds", sa.Float(), nullable=False),
        sa.Column("as_of", sa.Float(precision=53), nullable=False),
        sa.PrimaryKeyConstraint("team", name=op.f("pk_team_usage")),
    )
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("attempt_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.Float(precision=53), nullable=False),
        sa.Column("revoked_at", sa.Float(precision=53), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_tokens_token_hash")),
    )
    op.create_table(
        "steps",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("depends", sa.JSON(), nullable=False),
        sa.Column("resolved", sa.JSON(), nullable=False),
        sa.Column("max_retries", sa.Integer(), nullable=False),
        sa.Column("retries_used", sa.Integer(), server_default="0", nullable=False),
        sa.Column("preemptions", sa.Integer(), server_default="0", nullable=False),
        sa.Column("eligible_at", sa.Float(precision=53), server_default="0", nullable=False),
        sa.Column("reason", sa.Text(), server_default="", nullable=False),
        sa.Column("last_checkpoint", sa.Text(), nullable=True),
        sa.Column("last_checkpoint_at", sa.Float(precision=53), nullable=True),
        sa.Column("updated_at", sa.Float(precision=53), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_steps_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_steps")),
        sa.UniqueConstraint("job_id", "name", name=op.f("uq_steps_job_id_name")),
    )
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_steps_state"), ["state"], unique=False)

    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("step_id", sa.Integer(), nullable=False),
        sa.Column("step_name", sa.String(length=63), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("node", sa.String(length=63), nullable=False),
        sa.Column("gpus", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.Float(precision=53), nullable=False),
        sa.Column("ended_at", sa.Float(precision=53), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("pid_started_at", sa.Float(precision=53), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("signal", sa.Integer(), nullable=True),
        sa.Column("notice_at", sa.Float(precision=53), nullable=True),
        sa.Column("stop_deadline", sa.Float(precision=53), nullable=True),
        sa.Column("stop_reason", sa.Text(), nullable=True),
        sa.Column("killed_at_deadline", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("work_dir", sa.Text(), nullable=False),
        sa.Column("record", sa.JSON(), nullable=False),
        sa.Column("message", sa.Text(), server_default="", nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_attempts_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["step_id"], ["steps.id"], name=op.f("fk_attempts_step_id_steps"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempts")),
        sa.UniqueConstraint("step_id", "number", name=op.f("uq_attempts_step_id_number")),
    )
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_attempts_job_id"), ["job_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_attempts_state"), ["state"], unique=False)

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("attempt_id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("step_name", sa.String(length=63), nullable=False),
        sa.Column("label", sa.Text(), nullable=False),
        sa.Column("progress", sa.Text(), nullable=True),
        sa.Column("source", sa.String(length=8), nullable=False),
        sa.Column("reported_at", sa.Float(precision=53), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_checkpoints_attempt_id_attempts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
    )
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_checkpoints_job_id"), ["job_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_checkpoints_job_id"))

    op.drop_table("checkpoints")
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_attempts_state"))
        batch_op.drop_index(batch_op.f("ix_attempts_job_id"))

    op.drop_table("attempts")
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_steps_state"))

    op.drop_table("steps")
    op.drop_table("tokens")
    op.drop_table("team_usage")
    op.drop_table("meta")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_team"))
        batch_op.drop_index(batch_op.f("ix_jobs_submitted_at"))
        batch_op.drop_index(batch_op.f("ix_jobs_state"))

    op.drop_table("jobs")
    with op.batch_alter_table("gpu_ledger", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_gpu_ledger_node_gpu_index_ended_at"))
        batch_op.drop_index(batch_op.f("ix_gpu_ledger_job_id"))

    op.drop_table("gpu_ledger")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_events_job_id"))

    op.drop_table("events")
